"""One image from many datasets: ranges, lists and globs of datasets stacked along new c or t axes,
converted exactly at every level, with slabs that span datasets, verify against the composite,
and resume keyed on the datasets the selection resolved to."""

from __future__ import annotations

import h5py
import numpy as np
import pytest
import zarr

from conftest import smooth, spec_for
from h5ngff.engine.sources import open_source
from h5ngff.engine.verify.check import verify_output
from h5ngff.errors import OutputConflictError, SpecError, UnsupportedDatasetError
from reference import halving_steps, reference_pyramid


def levels_of(out: str, n: int) -> list[np.ndarray]:
    return [zarr.open_array(f"{out}/{k}", mode="r")[...] for k in range(n)]


@pytest.fixture(scope="module")
def channels(tmp_path_factory):
    """Three sibling datasets /ch0../ch2, chunked and gzip-compressed, Fiji's element_size_um on each."""
    data = smooth((3, 12, 40, 33), "uint16", seed=3)
    path = str(tmp_path_factory.mktemp("stacked") / "siblings.h5")
    with h5py.File(path, "w") as f:
        for c in range(3):
            ds = f.create_dataset(f"/ch{c}", data=data[c], chunks=(4, 16, 16), compression="gzip")
            ds.attrs["element_size_um"] = [2.0, 0.5, 0.5]
        f.create_dataset("/other", data=np.zeros((5, 5), "f4"))
    return path, data


@pytest.mark.slow
@pytest.mark.integration
def test_stacked_channels_are_exact_at_every_level_with_slabs_spanning_datasets(channels, tmp_path, convert):
    path, data = channels
    out = str(tmp_path / "out.ome.zarr")
    spec = spec_for(
        path,
        out,
        dataset="/ch{0..2}",
        output={"chunks": [1, 4, 16, 16]},
        pyramid={"levels": 3},
        resources={"slab": [2, 8, 40, 33]},
    )
    summary = convert(spec)
    plan = summary.job.plan
    assert plan.axes == "czyx" and plan.passes[0].slab[0] == 2, plan.passes[0].slab  # a slab holds two datasets
    assert plan.levels[0].scale == (1.0, 2.0, 0.5, 0.5) and plan.units == ("", "micrometer", "micrometer", "micrometer")
    assert plan.dataset.hdf5_chunks == (1, 4, 16, 16)  # each dataset prices its own chunk cache share
    # z (2.0) is 4x y and x: the anisotropy rule halves y and x only, both levels.
    want = reference_pyramid(data, halving_steps(plan.axes, plan.levels[0].scale, 2), "mean", 3)
    assert halving_steps(plan.axes, plan.levels[0].scale, 2) == [(False, False, True, True)] * 2
    for got, expected in zip(levels_of(out, 3), want):
        np.testing.assert_array_equal(got, expected)
    assert verify_output(out, (path, "/ch{0..2}")).ok


@pytest.mark.integration
def test_verify_compares_with_the_composite_source(channels, tmp_path, convert):
    path, data = channels
    out = str(tmp_path / "out.ome.zarr")
    convert(spec_for(path, out, dataset="/ch{0..2}", output={"chunks": [1, 4, 16, 16]}, pyramid={"levels": 1}))
    changed = tmp_path / "changed.h5"
    with h5py.File(path) as src, h5py.File(changed, "w") as dst:
        for c in range(3):
            dst.create_dataset(f"/ch{c}", data=src[f"/ch{c}"][...])
        dst["/ch2"][11, 39, 32] += 1  # negative control: one voxel of the last dataset differs
    report = verify_output(out, (str(changed), "/ch{0..2}"))
    assert report.compared_with_source and not report.ok
    assert [lv for lv, _ in report.bad_units] == [0], report.problems  # exactly the one chunk holding it


def test_a_range_a_list_and_a_glob_name_the_same_image(channels, tmp_path):
    path, _ = channels
    described = []
    for selection in ("/ch{0..2}", "/ch0,/ch1,/ch2", "/ch*"):
        opened = open_source(spec_for(path, str(tmp_path / "o"), dataset=selection))
        described.append((opened.info.shape, opened.identity.dataset))
    assert described[0] == described[1] == described[2] == ((3, 12, 40, 33), "/ch0,/ch1,/ch2 stacked along c")


@pytest.mark.integration
def test_resume_is_keyed_on_the_resolved_datasets(channels, tmp_path, convert):
    path, _ = channels
    out = str(tmp_path / "out.ome.zarr")
    convert(spec_for(path, out, dataset="/ch{0..2}", output={"chunks": [1, 4, 16, 16]}, pyramid={"levels": 1}))
    again = convert(spec_for(path, out, dataset="/ch*", output={"chunks": [1, 4, 16, 16]}, pyramid={"levels": 1}))
    assert again.resumed and again.totals.slabs_skipped == again.job.plan.n_tasks  # the same datasets: complete
    with pytest.raises(OutputConflictError, match="source"):  # negative control: other datasets, same shape
        convert(spec_for(path, out, dataset="/ch2,/ch1,/ch0", output={"chunks": [1, 4, 16, 16]}, pyramid={"levels": 1}))


@pytest.mark.integration
def test_time_points_and_channels_as_two_ranges(tmp_path, convert):
    """Fiji's HDF5 plugin layout: /t{T}/channel{C}, each 3-D with element_size_um (z, y, x)."""
    data = smooth((2, 2, 6, 20, 18), "float32", seed=5)
    path = str(tmp_path / "fiji.h5")
    with h5py.File(path, "w") as f:
        for t in range(2):
            for c in range(2):
                ds = f.create_dataset(f"/t{t}/channel{c}", data=data[t, c])
                ds.attrs["element_size_um"] = np.array([3.0, 0.25, 0.25], dtype="f4")
    out = str(tmp_path / "out.ome.zarr")
    summary = convert(
        spec_for(path, out, dataset="/t{0..1}/channel{0..1}", output={"chunks": [1, 1, 4, 8, 8]}, pyramid={"levels": 2})
    )
    assert summary.job.plan.axes == "tczyx" and summary.job.plan.levels[0].scale == (1.0, 1.0, 3.0, 0.25, 0.25)
    want = reference_pyramid(
        data, halving_steps("tczyx", (1.0, 1.0, 3.0, 0.25, 0.25), 1), "mean", 2
    )  # y and x only: z is 12x
    for got, expected in zip(levels_of(out, 2), want):
        np.testing.assert_array_equal(got, expected)


def test_stacking_along_t(channels, tmp_path):
    path, _ = channels
    opened = open_source(spec_for(path, str(tmp_path / "o"), dataset="/ch{0..2}", source={"stack": "t"}))
    assert opened.info.attr_axes == "tzyx" and opened.info.shape == (3, 12, 40, 33)


def test_datasets_that_differ_are_named(tmp_path):
    path = str(tmp_path / "bad.h5")
    with h5py.File(path, "w") as f:
        f.create_dataset("/a", data=np.zeros((4, 8, 8), "u2"))
        f.create_dataset("/b", data=np.zeros((4, 8, 9), "u2"))
        f.create_dataset("/c", data=np.zeros((4, 8, 8), "f4"))
    with pytest.raises(UnsupportedDatasetError, match=r"'/b' has shape \(4, 8, 9\) and '/a' has \(4, 8, 8\)"):
        open_source(spec_for(path, str(tmp_path / "o"), dataset="/a,/b"))
    with pytest.raises(UnsupportedDatasetError, match=r"'/c' is float32 and '/a' is uint16"):
        open_source(spec_for(path, str(tmp_path / "o"), dataset="/a,/c"))
    with pytest.raises(Exception, match="matches no dataset"):
        open_source(spec_for(path, str(tmp_path / "o"), dataset="/z*"))
    with pytest.raises(SpecError, match="not an NGFF axis order"):  # c stacked onto datasets that have c
        _czyx(tmp_path)


def _czyx(tmp_path):
    path = str(tmp_path / "czyx.h5")
    with h5py.File(path, "w") as f:
        for name in ("/a", "/b"):
            ds = f.create_dataset(name, data=np.zeros((2, 4, 8, 8), "u2"))
            for dim, label in zip(ds.dims, "czyx"):
                dim.label = label
    return open_source(spec_for(path, str(tmp_path / "o"), dataset="/a,/b"))


def test_options_of_another_container_are_refused(channels, tmp_path):
    path, _ = channels
    with pytest.raises(SpecError, match="source.tile only with a BigDataViewer source") as refused:
        open_source(spec_for(path, "o", dataset="/ch0", source={"tile": 1}))
    assert refused.value.field == "source.tile"
    with pytest.raises(SpecError, match="source.stack only with several datasets"):
        open_source(spec_for(path, "o", dataset="/ch0", source={"stack": "t"}))
