"""Deflate chunks inflated by libdeflate give exactly h5py's bytes, and everything else goes to h5py."""

from __future__ import annotations

import h5py
import numpy as np
import pytest

from conftest import smooth
from h5ngff.engine.sources import base as source_module
from h5ngff.engine.sources.inflate import direct_deflate, read_deflate
from h5ngff.errors import SourceError

REGIONS = [
    (slice(0, 13), slice(0, 70), slice(0, 90)),  # the whole dataset, edge chunks included
    (slice(3, 11), slice(17, 61), slice(5, 88)),  # cuts chunks on every side
    (slice(12, 13), slice(69, 70), slice(89, 90)),  # one voxel of the last edge chunk
]


@pytest.fixture(scope="module")
def h5(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("inflate") / "in.h5")
    data = smooth((13, 70, 90), "uint16", seed=4)
    with h5py.File(path, "w") as f:
        f.create_dataset("gzip", data=data, chunks=(4, 16, 32), compression="gzip", compression_opts=4)
        f.create_dataset("float", data=data.astype("<f4") / 7, chunks=(4, 16, 32), compression="gzip")
        f.create_dataset("big", data=data.astype(">u2"), chunks=(4, 16, 32), compression="gzip")
        f.create_dataset("shuffle", data=data, chunks=(4, 16, 32), compression="gzip", shuffle=True)
        sparse = f.create_dataset(
            "sparse", shape=data.shape, dtype="<u2", chunks=(4, 16, 32), compression="gzip", fillvalue=7
        )
        sparse[:4, :16, :32] = data[:4, :16, :32]  # one chunk written; the others are never allocated
    return path, data


@pytest.mark.parametrize("name", ["gzip", "float", "sparse"])
def test_direct_inflate_equals_h5py_byte_for_byte(h5, name):
    path, _ = h5
    with h5py.File(path, "r") as f:
        ds = f[name]
        assert direct_deflate(ds)
        for region in REGIONS:
            out = np.empty(tuple(r.stop - r.start for r in region), dtype=ds.dtype)
            read_deflate(ds, region, out)
            assert out.tobytes() == ds[region].tobytes()


def test_other_filters_and_byte_orders_go_through_h5py(h5):
    path, data = h5
    with h5py.File(path, "r") as f:
        assert not direct_deflate(f["shuffle"])  # shuffle + deflate: h5py's pipeline
    for name in ("shuffle", "big", "gzip"):
        got = source_module.read_plain(path, name, 0, REGIONS[1])
        np.testing.assert_array_equal(got, data[REGIONS[1]])
    source_module.close_files()


def test_a_corrupt_deflate_chunk_is_a_source_error(h5, tmp_path):
    """Negative control: the direct path does decode the stored bytes (a damaged stream fails)."""
    path, _ = h5
    bad = str(tmp_path / "bad.h5")
    with h5py.File(path, "r") as f, h5py.File(bad, "w") as g:
        ds = g.create_dataset("gzip", shape=f["gzip"].shape, dtype="<u2", chunks=(4, 16, 32), compression="gzip")
        for start in [(z, y, x) for z in range(0, 13, 4) for y in range(0, 70, 16) for x in range(0, 90, 32)]:
            mask, raw = f["gzip"].id.read_direct_chunk(start)
            ds.id.write_direct_chunk(start, raw if start != (4, 16, 32) else raw[:10] + b"\xff" * (len(raw) - 10), mask)
    with pytest.raises(SourceError, match="does not decode"):
        source_module.read_plain(bad, "gzip", 0, REGIONS[0])
    source_module.close_files()
