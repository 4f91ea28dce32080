"""zarr-python's private internals, used by ``verify`` only through engine/zarr_internals.py, are
proven on the zarr releases named in ``PROVEN_ZARR`` (3.1.6: this file and the verify tests pass
on it), and pyproject.toml pins zarr to them. This fails if the installed zarr is outside them or
an internal is gone, so a zarr upgrade is a decision, not an accident. It is its own negative
control: run on zarr 3.1.0 to 3.1.5 (which the old pin ``zarr>=3.1,<4`` admitted), the internals
check and the decoding tests fail (no ``AsyncArray.config``, no ``BytesCodec._decode_sync``), as
verify itself did there."""

from __future__ import annotations

import re
from pathlib import Path

import numcodecs
import numpy as np
import pytest
import zarr

from h5ngff.engine.verify import zarr_internals as zi

ROOT = Path(__file__).resolve().parents[1]


def _version(text: str) -> tuple[int, ...]:
    return tuple(int(p) for p in re.match(r"(\d+)\.(\d+)\.(\d+)", text).groups())


def test_the_installed_zarr_is_one_the_internals_are_proven_on():
    first, last = (_version(v) for v in zi.PROVEN_ZARR)
    assert first <= _version(zarr.__version__) <= last, (
        f"zarr {zarr.__version__} is outside the releases engine/zarr_internals.py is proven on ({zi.PROVEN_ZARR}): run this file "
        f"and the verify tests on it, then widen PROVEN_ZARR and the pin in pyproject.toml together."
    )


def test_pyproject_pins_zarr_to_the_proven_releases():
    pins = re.findall(r'^\s*"zarr([<>=!~][^"]*)",', (ROOT / "pyproject.toml").read_text(), re.M)
    first, last = zi.PROVEN_ZARR
    assert pins == [f"=={first}" if first == last else f">={first},<={last}"]


def test_every_private_internal_is_there():
    """The names the adapter reaches into (its module docstring lists them)."""
    from zarr.codecs.sharding import ShardingCodec, _ShardIndex
    from zarr.core.array import Array
    from zarr.core.codec_pipeline import codecs_from_list
    from zarr.core.metadata.v3 import ArrayV3Metadata

    assert callable(codecs_from_list) and hasattr(_ShardIndex, "get_chunk_slice")
    for name in ("_get_chunk_spec", "_shard_index_size", "_get_index_chunk_spec"):
        assert callable(getattr(ShardingCodec, name, None)), name
    assert "_async_array" in Array.__dataclass_fields__ or hasattr(Array, "_async_array")
    assert callable(getattr(ArrayV3Metadata, "get_chunk_spec", None))
    codecs = zarr.codecs  # every codec an h5ngff output's chunks (or a shard's inner chunks) go through
    for codec in (codecs.BytesCodec, codecs.BloscCodec, codecs.ZstdCodec, codecs.GzipCodec, codecs.Crc32cCodec):
        assert callable(getattr(codec, "_decode_sync", None)), codec.__name__


@pytest.mark.parametrize("sharded", [False, True], ids=["chunks", "shards"])
def test_the_adapter_decodes_what_zarr_wrote(tmp_path, sharded):
    """Each function against zarr's own public read of the same array (v3 with crc32c, sharded
    or not; v2). Control: a flipped byte fails the crc32c check."""
    data = (np.arange(16 * 16) % 251).reshape(16, 16).astype("<u2")
    kwargs = {"shards": (16, 16)} if sharded else {}
    a = zarr.create_array(
        str(tmp_path / "a"),
        shape=data.shape,
        chunks=(8, 8),
        dtype="<u2",
        compressors=[zarr.codecs.ZstdCodec(level=3), zarr.codecs.Crc32cCodec()],
        **kwargs,
    )
    a[...] = data
    codecs, spec = zi.chunk_codecs(a)
    if sharded:
        shard = (tmp_path / "a" / "c" / "0" / "0").read_bytes()
        size = zi.shard_index_size(a)
        index = zi.decode_shard_index(a, shard[-size:])
        start, stop = index.chunk_slice((1, 0))
        raw = shard[start:stop]
    else:
        raw = (tmp_path / "a" / "c" / "1" / "0").read_bytes()
    np.testing.assert_array_equal(zi.decode(codecs, zi.buffer(raw), spec).reshape(8, 8), data[8:, :8])
    bad = bytearray(raw)
    bad[len(bad) // 2] ^= 0xFF
    with pytest.raises(Exception, match="checksum"):
        zi.decode(codecs, zi.buffer(bytes(bad)), spec)


def test_the_v2_chain_is_the_one_in_zarray(tmp_path):
    data = np.arange(64, dtype="<i4").reshape(8, 8)
    a = zarr.create_array(
        str(tmp_path / "v2"),
        shape=data.shape,
        chunks=(4, 8),
        dtype="<i4",
        zarr_format=2,
        compressors=numcodecs.Blosc(cname="zstd", clevel=3),
        chunk_key_encoding={"name": "v2", "separator": "."},
    )
    a[...] = data
    chain = zi.v2_chain(a)
    raw = (tmp_path / "v2" / "1.0").read_bytes()
    assert chain.compressor is not None and chain.filters == ()
    decoded = chain.compressor.decode(raw)
    np.testing.assert_array_equal(np.frombuffer(decoded, "<i4").reshape(4, 8, order=chain.order), data[4:])
