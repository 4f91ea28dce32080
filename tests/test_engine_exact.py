"""Exactness: every dtype, HDF5 layout and filter, output format and codec converts losslessly, and
every pyramid level equals an independent NumPy reference. Real HDF5, real Dask, read back with zarr."""

from __future__ import annotations

import hdf5plugin
import numpy as np
import pytest
import zarr

from conftest import smooth, spec_for, write_h5
from reference import reference_pyramid

pytestmark = pytest.mark.integration

DTYPES = [
    "int8",
    "uint8",
    "int16",
    "uint16",
    "int32",
    "uint32",
    "int64",
    "uint64",
    "float16",
    "float32",
    "float64",
    "bool",
]


def read_levels(path: str, n: int) -> list[np.ndarray]:
    group = zarr.open_group(path, mode="r")
    return [group[str(k)][...] for k in range(n)]


def assert_pyramid(out: str, data: np.ndarray, downsampled, method: str, levels: int) -> None:
    got = read_levels(out, levels)
    want = reference_pyramid(data, downsampled, method, levels)
    for k, (g, w) in enumerate(zip(got, want)):
        assert g.shape == w.shape, f"level {k}"
        assert g.dtype == w.dtype, f"level {k}"
        if g.dtype == np.float64 and k > 0:
            np.testing.assert_allclose(g, w, rtol=0, atol=1e-12 * max(1.0, np.abs(w).max()), err_msg=f"level {k}")
        else:
            np.testing.assert_array_equal(g, w, err_msg=f"level {k}")


@pytest.mark.parametrize("dtype", DTYPES)
def test_every_dtype_round_trips_with_its_pyramid(tmp_path, convert, dtype):
    data = smooth((13, 37, 29), dtype)  # nothing divides the chunks
    h5 = write_h5(tmp_path / "in.h5", data)
    out = str(tmp_path / "out.ome.zarr")
    summary = convert(spec_for(h5, out, output={"chunks": [8, 16, 16]}, pyramid={"levels": 3}))
    assert summary.status == "Succeeded"
    assert_pyramid(out, data, (True, True, True), "mean", 3)


LAYOUTS = {
    "chunked": dict(chunks=(5, 16, 10)),
    "gzip": dict(chunks=(4, 8, 8), compression="gzip", compression_opts=4),
    "lzf": dict(chunks=(4, 20, 7), compression="lzf"),
    "shuffle+gzip+fletcher32": dict(chunks=(8, 8, 8), shuffle=True, compression="gzip", fletcher32=True),
    "blosc": dict(chunks=(6, 12, 12), **hdf5plugin.Blosc(cname="zstd", clevel=3, shuffle=hdf5plugin.Blosc.BITSHUFFLE)),
    "zstd": dict(chunks=(16, 16, 16), **hdf5plugin.Zstd()),
    "lz4": dict(chunks=(3, 37, 29), **hdf5plugin.LZ4()),
    "bitshuffle": dict(chunks=(8, 16, 8), **hdf5plugin.Bitshuffle()),
}


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("dtype", ["uint16", "float32"])
def test_hdf5_layouts_and_filters(tmp_path, convert, layout, dtype):
    data = smooth((19, 37, 29), dtype, seed=3)
    h5 = write_h5(tmp_path / "in.h5", data, **LAYOUTS[layout])
    out = str(tmp_path / "out.ome.zarr")
    convert(spec_for(h5, out, output={"chunks": [8, 16, 16]}, pyramid={"levels": 2}))
    assert_pyramid(out, data, (True, True, True), "mean", 2)


@pytest.mark.slow
@pytest.mark.parametrize("method", ["mean", "nearest", "max"])
def test_multipass_pyramid_equals_reference(tmp_path, convert, method, monkeypatch):
    """Later passes read written levels. Big volumes get there because a slab deep enough for every
    level would exceed the slab cap; a small one gets there with the cap scaled down."""
    from h5ngff.planner import plan as planner

    monkeypatch.setattr(planner, "MAX_SLAB_BYTES", 40_000)
    monkeypatch.setattr(planner, "MIN_BALANCED_SLAB_BYTES", 4_000)
    data = smooth((33, 70, 45), "uint16", seed=4)
    h5 = write_h5(tmp_path / "in.h5", data)
    out = str(tmp_path / "out.ome.zarr")
    summary = convert(spec_for(h5, out, output={"chunks": [4, 4, 4]}, pyramid={"levels": 5, "method": method}))
    assert len(summary.job.plan.passes) > 1, "the case must exercise later passes"
    assert_pyramid(out, data, (True, True, True), method, 5)


@pytest.mark.parametrize(
    "shape,axes,chunks,downsampled",
    [
        ((45, 61), "yx", [16, 16], (True, True)),
        ((3, 9, 30, 21), "czyx", [1, 4, 8, 8], (False, True, True, True)),
        ((2, 2, 7, 20, 18), "tczyx", [1, 1, 4, 8, 8], (False, False, True, True, True)),
    ],
)
def test_two_to_five_dimensions(tmp_path, convert, shape, axes, chunks, downsampled):
    data = smooth(shape, "uint16", seed=5)
    h5 = write_h5(tmp_path / "in.h5", data)
    out = str(tmp_path / "out.ome.zarr")
    summary = convert(spec_for(h5, out, output={"chunks": chunks}, image={"axes": axes}, pyramid={"levels": 2}))
    assert summary.job.plan.axes == axes
    assert_pyramid(out, data, downsampled, "mean", 2)


COMPRESSORS = [
    {"codec": "blosc", "cname": "zstd", "clevel": 5, "shuffle": "bitshuffle"},
    {"codec": "blosc", "cname": "lz4", "clevel": 3, "shuffle": "shuffle"},
    {"codec": "blosc", "cname": "zlib", "clevel": 1, "shuffle": "noshuffle"},
    {"codec": "zstd", "clevel": 3},
    {"codec": "gzip", "clevel": 6},
    {"codec": "none"},
]


@pytest.mark.parametrize("version", ["0.4", "0.5"])
@pytest.mark.parametrize("compressor", COMPRESSORS, ids=lambda c: "-".join(str(v) for v in c.values()))
def test_formats_and_codecs(tmp_path, convert, version, compressor):
    data = smooth((10, 33, 20), "int16", seed=6)
    h5 = write_h5(tmp_path / "in.h5", data)
    out = str(tmp_path / "out.ome.zarr")
    convert(
        spec_for(
            h5,
            out,
            output={"chunks": [4, 16, 8], "ngffVersion": version, "compressor": compressor},
            pyramid={"levels": 2},
        )
    )
    group = zarr.open_group(out, mode="r")
    assert group.metadata.zarr_format == (3 if version == "0.5" else 2)
    assert_pyramid(out, data, (True, True, True), "mean", 2)


@pytest.mark.parametrize("shards", [[8, 32, 16], [4, 16, 24]])
def test_shards_round_trip(tmp_path, convert, shards):
    data = smooth((21, 50, 37), "float32", seed=7)
    h5 = write_h5(tmp_path / "in.h5", data)
    out = str(tmp_path / "out.ome.zarr")
    convert(spec_for(h5, out, output={"chunks": [4, 16, 8], "shards": shards}, pyramid={"levels": 3}))
    group = zarr.open_group(out, mode="r")
    assert tuple(group["0"].shards) == tuple(shards)
    assert_pyramid(out, data, (True, True, True), "mean", 3)


def test_big_endian_source_is_stored_little_endian(tmp_path, convert):
    data = smooth((9, 20, 20), "uint32").astype(">u4")
    h5 = write_h5(tmp_path / "in.h5", data)
    out = str(tmp_path / "out.ome.zarr")
    convert(spec_for(h5, out, output={"chunks": [4, 8, 8]}, pyramid={"levels": 1}))
    got = zarr.open_array(out + "/0", mode="r")[...]
    assert got.dtype == np.dtype("<u4")
    np.testing.assert_array_equal(got, data)


def test_nan_and_inf_round_trip_exactly(tmp_path, convert):
    data = smooth((8, 16, 16), "float32")
    data[0, 0, :4] = [np.nan, np.inf, -np.inf, -0.0]
    h5 = write_h5(tmp_path / "in.h5", data)
    out = str(tmp_path / "out.ome.zarr")
    convert(spec_for(h5, out, output={"chunks": [4, 8, 8]}, pyramid={"levels": 1}))
    got = zarr.open_array(out + "/0", mode="r")[...]
    assert got.tobytes() == data.tobytes()  # bit-identical, NaN payload and signed zero included
    window = zarr.open_group(out, mode="r").attrs["ome"]["omero"]["channels"][0]["window"]
    finite = data[np.isfinite(data)]
    assert window["min"] == pytest.approx(float(finite.min())) and window["max"] == pytest.approx(float(finite.max()))


def test_comparison_catches_a_wrong_level(tmp_path, convert):
    """Negative control: a level built with another method does not pass as the mean."""
    data = smooth((12, 20, 20), "uint16", seed=8)
    h5 = write_h5(tmp_path / "in.h5", data)
    out = str(tmp_path / "out.ome.zarr")
    convert(spec_for(h5, out, output={"chunks": [4, 8, 8]}, pyramid={"levels": 2, "method": "max"}))
    with pytest.raises(AssertionError):
        assert_pyramid(out, data, (True, True, True), "mean", 2)


def test_the_run_builds_its_tasks_on_the_planning_inspection_s_reader(tmp_path, convert, monkeypatch):
    """The source is opened once on the client: the slab tasks are built on the reader the plan's
    inspection made (a batch item spent a third of its client time opening its file again)."""
    from h5ngff.engine.write import driver

    def opened_again(*args, **kwargs):
        raise AssertionError("the source was opened again to build the slab tasks")

    monkeypatch.setattr(driver, "slab_source", opened_again)
    data = smooth((40, 96, 80), "uint16")
    h5 = write_h5(tmp_path / "in.h5", data, chunks=(8, 32, 32), compression="gzip")
    out = str(tmp_path / "out.ome.zarr")
    summary = convert(spec_for(h5, out, pyramid={"levels": 2}))
    assert summary.status == "Succeeded" and summary.job.reader is not None
    assert_pyramid(out, data, (True, True, True), "mean", 2)
    # Negative control: without that reader, building the tasks opens the source again.
    with pytest.raises(AssertionError, match="opened again"):
        next(driver.build_tasks(summary.job.plan, summary.job.spec, None, 0))  # type: ignore[arg-type]
