"""Every use of zarr-python's private internals, in one place: what ``verify`` (engine.verify.stored)
decodes with.

``verify`` reads each chunk through zarr's own codecs, run synchronously in the calling thread
(zarr's public read path costs 4-5x as much on a busy machine: an event loop thread and a thread
hop per read and per decompression), and each shard through zarr's own index decoding. zarr has
no public API for either, so this module reaches into its internals: ``codecs_from_list``,
``Codec._decode_sync``, ``Array._async_array``, ``ArrayV3Metadata.get_chunk_spec``,
``ShardingCodec._get_chunk_spec``, ``_shard_index_size``, ``_get_index_chunk_spec`` and
``_ShardIndex``. zarr may change any of them in a minor release, so the versions this is proven on
are named in ``PROVEN_ZARR`` and pinned in pyproject.toml, and tests/test_zarr_internals.py fails
if the installed zarr is outside them or an internal is missing. To admit a new zarr release: run
that test and the verify tests on it, then widen both.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import zarr
from zarr.codecs.sharding import _ShardIndex
from zarr.core.buffer import default_buffer_prototype
from zarr.core.codec_pipeline import codecs_from_list

#: The zarr-python releases this module is proven on (tests/test_zarr_internals.py), first and
#: last, both included; pyproject.toml pins zarr to them. 3.1.0 to 3.1.5 were tried and fail:
#: their ``AsyncArray`` has no ``config`` and their ``BytesCodec`` no ``_decode_sync``.
PROVEN_ZARR = ("3.1.6", "3.1.6")


def buffer(data: bytes) -> Any:
    """Bytes as the zarr Buffer its codecs decode."""
    return default_buffer_prototype().buffer.from_bytes(data)


def decode(codecs: Any, data: Any, spec: Any) -> np.ndarray:
    """zarr's codec chain, decoded in order in this thread: bytes-to-bytes codecs last to first
    (crc32c, then the compressor), the array-to-bytes codec, then any array-to-array codecs."""
    chain: tuple[Any, Any, Any] = codecs_from_list(codecs)
    array_array, array_bytes, bytes_bytes = chain
    for codec in reversed(bytes_bytes):
        data = codec._decode_sync(data, spec)
    data = array_bytes._decode_sync(data, spec)
    for codec in reversed(array_array):
        data = codec._decode_sync(data, spec)
    return np.asarray(data.as_numpy_array())


def chunk_codecs(array: zarr.Array[Any]) -> tuple[Any, Any]:
    """(codecs, chunk spec) of one stored chunk of a Zarr v3 array: inside a shard, the inner
    chunk's."""
    meta = array._async_array.metadata
    spec = meta.get_chunk_spec((0,) * len(array.shape), array._async_array.config, default_buffer_prototype())
    codecs = meta.codecs
    if array.shards is not None:
        sharding = codecs[0]
        return sharding.codecs, sharding._get_chunk_spec(spec)
    return codecs, spec


@dataclass(frozen=True)
class V2Chain:
    """A Zarr v2 array's chain as zarr parsed it from ``.zarray``."""

    compressor: Any
    filters: tuple[Any, ...]
    order: Any


def v2_chain(array: zarr.Array[Any]) -> V2Chain:
    meta = array._async_array.metadata
    return V2Chain(meta.compressor, tuple(meta.filters or ()), meta.order)


def _sharding(array: zarr.Array[Any]) -> tuple[Any, tuple[int, ...]]:
    assert array.shards is not None  # only sharded levels have a shard index
    per = tuple(s // c for s, c in zip(array.shards, array.chunks))
    return array._async_array.metadata.codecs[0], per


def shard_index_size(array: zarr.Array[Any]) -> int:
    """Bytes of a shard's index (with its checksum) at the end of each shard file."""
    sharding, per = _sharding(array)
    return int(sharding._shard_index_size(per))


class ShardIndex:
    """A decoded shard index: where each inner chunk lies in the shard file."""

    def __init__(self, index: Any):
        self._index = index

    def chunk_slice(self, inner: tuple[int, ...]) -> tuple[int, int] | None:
        """(start, stop) of the inner chunk's bytes, or None for an empty slot."""
        where = self._index.get_chunk_slice(inner)
        return None if where is None else (int(where[0]), int(where[1]))


def decode_shard_index(array: zarr.Array[Any], tail: bytes) -> ShardIndex:
    """The index at the end of a shard (``tail``: its last ``shard_index_size`` bytes), decoded
    and its crc32c checked by zarr's index codecs."""
    sharding, per = _sharding(array)
    return ShardIndex(_ShardIndex(decode(sharding.index_codecs, buffer(tail), sharding._get_index_chunk_spec(per))))
