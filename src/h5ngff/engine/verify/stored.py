"""A pyramid level as zarr-python reads it: what ``verify`` decodes with.

``verify`` must not share the writer's code (``chunkio``): a bug common to the writer's encoder
and decoder would pass unseen. Here the array metadata, the chunk keys, the codecs (their
parsing from the metadata and their decoding, the crc32c check included) and the shard index
are all zarr-python's; h5ngff only chooses which chunk to read, one at a time.

The codecs run synchronously in this thread (engine.verify.zarr_internals, where every private zarr
use is kept): zarr's own read path (an event loop thread, a thread hop per file read and per
decompression, ~2,700 Python calls per chunk) cost 4-5x the old verify on a busy 2-core machine,
for the same codec code. The stored bytes are read through the output's Store (``get``, a
``get_suffix`` for a shard's index, a ``get_ranges`` per inner chunk), the same calls for a
directory and a bucket. The one thing zarr cannot tell is whether a chunk is *absent* (it reads as
the fill value either way), so that is asked of the store; and for Zarr v2, which has no checksum
codec, each file's raw bytes are checked against the CRC32C sidecar (``engine.write.checksums``).
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass, field
from itertools import product
from typing import Any, Iterator

import google_crc32c
import numpy as np
import zarr

from ...planner.grid import ceil_div
from ..stores import Store
from .zarr_internals import ShardIndex, buffer, chunk_codecs, decode, decode_shard_index, shard_index_size, v2_chain

#: zarr-python's Crc32cCodec message: "Stored and computed checksum do not match. Stored: b'..'. Computed: b'..'."
_ZARR_CRC = re.compile(r"checksum do not match\. Stored: (b'.*?'|b\".*?\")\. Computed: (b'.*?'|b\".*?\")\.")


class ChecksumMismatch(ValueError):
    """A chunk's bytes no longer match the CRC32C written with them."""

    def __init__(self, expected: str, actual: str, where: str):
        super().__init__(
            f"checksum mismatch ({where}: CRC32C expected {expected}, actual {actual}): the file changed after it was written."
        )
        self.expected = expected
        self.actual = actual


def _hex_crc(raw: bytes) -> str:
    return f"{int.from_bytes(raw, 'little'):08x}"


def checksum_error(exc: BaseException) -> ChecksumMismatch | None:
    """zarr-python's crc32c failure as a ChecksumMismatch (None for any other error)."""
    match = _ZARR_CRC.search(str(exc))
    if match is None:
        return None
    stored, computed = (ast.literal_eval(g) for g in match.groups())
    return ChecksumMismatch(_hex_crc(stored), _hex_crc(computed), "Zarr v3 crc32c codec")


@dataclass
class StoredLevel:
    """One level of an OME-Zarr opened with zarr-python, read one chunk at a time."""

    level: int
    array: Any  # zarr.Array
    #: The output's store, which the chunk bytes are read from (keys relative to its root).
    store: Store
    #: Output finished (completion marker set): an absent chunk is a skipped all-fill chunk.
    complete: bool = True
    #: Zarr v2: key -> CRC32C (8 hex digits) of every chunk file written, from the sidecar.
    recorded: dict[str, str] | None = None
    #: A few decoded shard indices (unit -> (the index, the shard's size); None: no shard file).
    _indices: dict[tuple[int, ...], tuple[ShardIndex, int] | None] = field(default_factory=dict)

    def __post_init__(self) -> None:
        # Read once: zarr recomputes these properties from its metadata on every access.
        a = self.array
        self.shape: tuple[int, ...] = tuple(a.shape)
        self.chunks: tuple[int, ...] = tuple(a.chunks)
        self.shards: tuple[int, ...] | None = None if a.shards is None else tuple(a.shards)
        self.dtype: str = np.dtype(a.dtype).str
        self.fill_value = a.fill_value
        self._v2 = a.metadata.zarr_format == 2
        self._codecs: Any = None
        self._spec: Any = None
        if not self._v2:
            self._codecs, self._spec = chunk_codecs(a)
        #: The level's key prefix in the store (its array's path in the group).
        self._prefix = a.store_path.path

    @property
    def crc_codec(self) -> bool:
        """Zarr v3 chunks end in the crc32c codec (inside shards: the inner chunks)."""
        return not self._v2 and any(c.to_dict().get("name") == "crc32c" for c in self._codecs or ())

    @property
    def unit(self) -> tuple[int, ...]:
        return self.shards or self.chunks

    @property
    def unit_grid(self) -> tuple[int, ...]:
        return tuple(ceil_div(n, u) for n, u in zip(self.shape, self.unit))

    def key(self, unit: tuple[int, ...]) -> str:
        """The store key of a chunk or shard file, by zarr's own chunk key encoding."""
        return str(self.array.metadata.encode_chunk_key(unit))

    def unit_region(self, unit: tuple[int, ...]) -> tuple[slice, ...]:
        return tuple(slice(i * u, min((i + 1) * u, n)) for i, u, n in zip(unit, self.unit, self.shape))

    def inner_chunks(self, unit: tuple[int, ...]) -> Iterator[tuple[int, ...]]:
        """The chunks (level chunk indices) stored in one unit that lie inside the array."""
        per = tuple(u // c for u, c in zip(self.unit, self.chunks))
        grid = tuple(ceil_div(n, c) for n, c in zip(self.shape, self.chunks))
        ranges = [range(i * p, min((i + 1) * p, g)) for i, p, g in zip(unit, per, grid)]
        return product(*ranges)

    def exists(self, unit: tuple[int, ...]) -> bool:
        return self.store.size(self._store_key(self.key(unit))) is not None

    def missing(self, unit: tuple[int, ...]) -> bool:
        """Absent, and not a legitimately skipped all-fill chunk: the output is unfinished, or the
        checksum sidecar says the file was written."""
        if self.complete and (self.recorded is None or self.key(unit) not in self.recorded):
            return False  # not asked of the store: a finished output may skip all-fill chunks
        return not self.exists(unit)

    def read_chunk(self, chunk: tuple[int, ...], check: bool = True) -> np.ndarray:
        """One chunk decoded by zarr's codecs, clipped at the array's edge; an absent chunk (or
        empty shard slot) reads as the fill value. A crc32c failure raises ChecksumMismatch, any
        other decode failure what the codec raised. In Zarr v2 the file's bytes are first checked
        against the sidecar's CRC32C, unless ``check`` is off (the data of a chunk already
        reported, to say how it differs too)."""
        unit = tuple(c * k // u for c, k, u in zip(chunk, self.chunks, self.unit))
        key = self.key(unit)
        try:
            if self.shards is None:
                raw = self._get(key)
                if raw is not None and check and self.recorded is not None:
                    self._check_crc(key, raw)
            else:
                raw = self._inner_bytes(unit, chunk)
            data = self._fill() if raw is None else self._decode_chunk(raw)
        except ChecksumMismatch:
            raise
        except Exception as exc:
            mismatch = checksum_error(exc)
            if mismatch is None:
                raise
            raise mismatch from None
        return data[tuple(slice(0, min(k, n - i * k)) for i, k, n in zip(chunk, self.chunks, self.shape))]

    def _check_crc(self, key: str, raw: bytes) -> None:
        expected = (self.recorded or {}).get(key)
        actual = f"{google_crc32c.value(raw):08x}"
        if expected != actual:
            raise ChecksumMismatch(expected or "none recorded", actual, "checksum sidecar")

    def index_problem(self, unit: tuple[int, ...]) -> str | None:
        """Why a shard's index cannot be read (None: it reads), so that a broken index is
        reported once and not once per inner chunk."""
        if self.shards is None:
            return None
        try:
            self._shard_index(unit)
        except Exception as exc:
            mismatch = checksum_error(exc)
            return f"shard index {mismatch or f'does not decode ({type(exc).__name__}: {exc}).'}"
        return None

    # -- zarr's metadata and codecs, the output's store --------------------------------------
    def _store_key(self, key: str) -> str:
        return f"{self._prefix}/{key}" if self._prefix else key

    def _get(self, key: str) -> bytes | None:
        try:
            return self.store.get(self._store_key(key))
        except KeyError:
            return None

    def _fill(self) -> np.ndarray:
        return np.full(self.chunks, self.fill_value, dtype=self.array.dtype)

    def _decode_chunk(self, raw: bytes) -> np.ndarray:
        if self._v2:
            return self._decode_v2(raw)
        return decode(self._codecs, buffer(raw), self._spec).reshape(self.chunks)

    def _decode_v2(self, raw: bytes) -> np.ndarray:
        """Zarr v2's chain as zarr parsed it from ``.zarray``: compressor, then filters last to first."""
        chain = v2_chain(self.array)
        data = raw if chain.compressor is None else chain.compressor.decode(raw)
        for f in reversed(chain.filters):
            data = f.decode(data)
        return np.frombuffer(data, dtype=self.array.dtype).reshape(self.chunks, order=chain.order)

    def _shard_index(self, unit: tuple[int, ...]) -> tuple[ShardIndex, int] | None:
        """zarr's decoded index of one shard (its crc32c checked by zarr's index codecs) and the
        shard's size, the last few kept: verify's walk comes back to a shard for each 2x2x2 block
        of its chunks."""
        if unit in self._indices:
            return self._indices[unit]
        size = shard_index_size(self.array)
        try:
            tail, total = self.store.get_suffix(self._store_key(self.key(unit)), size)
        except KeyError:
            found = None
        else:
            if len(tail) < size:
                raise ValueError(f"shard of {len(tail)} bytes is shorter than its index ({size} bytes)")
            found = (decode_shard_index(self.array, tail), total)
        if len(self._indices) >= 16:
            self._indices.pop(next(iter(self._indices)))
        self._indices[unit] = found
        return found

    def _inner_bytes(self, unit: tuple[int, ...], chunk: tuple[int, ...]) -> bytes | None:
        found = self._shard_index(unit)
        if found is None or self.shards is None:
            return None
        index, total = found
        inner = tuple(c % (s // k) for c, s, k in zip(chunk, self.shards, self.chunks))
        where = index.chunk_slice(inner)
        if where is None:
            return None
        start, stop = where
        raw = None
        if stop <= total:  # a range past the end is not asked of the store (a bucket answers 416)
            try:
                raw = next(iter(self.store.get_ranges(self._store_key(self.key(unit)), [(start, stop - start)])))
            except KeyError:
                raw = None
        if raw is None or len(raw) != stop - start:
            raise ValueError(f"inner chunk {inner} runs past the end of the shard")
        return raw


def open_levels(
    root: Any,
    store: Store,
    multiscale: dict[str, Any],
    complete: bool,
    sidecars: dict[int, dict[str, str] | None] | None = None,
) -> tuple[list[StoredLevel], list[str]]:
    """Every level of ``multiscale`` opened with zarr-python (``root``: what zarr opens, the
    store's ``as_zarr_store()``), read from ``store``, and the problems of those that do not open."""
    levels, problems = [], []
    group = zarr.open_group(root, mode="r")
    for index, ds in enumerate(multiscale.get("datasets", [])):
        try:
            array = group[ds["path"]]
            if not isinstance(array, zarr.Array):
                raise ValueError(f"{ds['path']!r} is a group, not an array")
        except (KeyError, ValueError, OSError, TypeError) as exc:
            problems.append(f"level {ds.get('path')}: unreadable array metadata ({type(exc).__name__}: {exc}).")
            continue
        recorded = None if sidecars is None else sidecars.get(index)
        levels.append(StoredLevel(index, array, store, complete, recorded))
    return levels, problems
