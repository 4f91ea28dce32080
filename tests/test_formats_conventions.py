"""Plain-HDF5 metadata conventions, each on a file written the way its tool writes it: applied to
the axes they describe, overridden by flags, and refused (not guessed) where they conflict."""

from __future__ import annotations

import json

import h5py
import numpy as np
import pytest
import zarr

from conftest import smooth, spec_for
from h5ngff.engine.sources import open_source
from h5ngff.errors import SpecError
from reference import halving_steps, reference_pyramid

_FLAGS = {"t": 8, "c": 1, "z": 2, "y": 2, "x": 2}  # vigra's AxisType: Time, Channels, Space


def axistags(axes: str) -> str:
    """ilastik's ``axistags`` attribute as vigra's AxisTags.toJSON() writes it."""
    return json.dumps(
        {"axes": [{"key": a, "typeFlags": _FLAGS[a], "resolution": 0, "description": ""} for a in axes]}, indent=2
    )


def fiji_4d(path, data):
    """Fiji's HDF5 plugin: element_size_um holds z, y, x (three values) whatever the rank."""
    with h5py.File(path, "w") as f:
        ds = f.create_dataset("/data", data=data, chunks=(1,) + data.shape[1:])
        ds.attrs["element_size_um"] = np.array([2.0, 0.4, 0.4], dtype="f4")
        for dim, label in zip(ds.dims, "tzyx"):
            dim.label = label


def ilastik(path, data, axes="tczyx"):
    """ilastik's export: /exported_data with axistags (JSON), no voxel size."""
    with h5py.File(path, "w") as f:
        ds = f.create_dataset("/exported_data", data=data, chunks=True, compression="gzip")
        ds.attrs["axistags"] = axistags(axes)


def labelled(path, data, labels):
    """h5py / MATLAB / netCDF-4: HDF5 dimension scales (DIMENSION_LABELS)."""
    with h5py.File(path, "w") as f:
        ds = f.create_dataset("/data", data=data)
        for dim, label in zip(ds.dims, labels):
            dim.label = label


CASES = {
    "fiji-element_size_um-on-tzyx": (fiji_4d, "/data", (2, 6, 20, 18), "tzyx", (1.0, 2.0, 0.4, 0.4)),
    "ilastik-axistags-tczyx": (ilastik, "/exported_data", (2, 2, 6, 20, 18), "tczyx", (1.0,) * 5),
    "dimension-labels-czyx": (
        lambda p, d: labelled(p, d, ["channel", "z", "y", "x"]),
        "/data",
        (3, 6, 20, 18),
        "czyx",
        (1.0,) * 4,
    ),
}


@pytest.mark.integration
@pytest.mark.parametrize("name", sorted(CASES))
def test_each_convention_converts_exactly_with_its_axes_and_scale(name, tmp_path, convert):
    write, dataset, shape, axes, scale = CASES[name]
    data = smooth(shape, "uint16", seed=len(name))
    path = str(tmp_path / "in.h5")
    write(path, data)
    out = str(tmp_path / "out.ome.zarr")
    summary = convert(
        spec_for(
            path, out, dataset=dataset, output={"chunks": [1] * (len(shape) - 3) + [4, 8, 8]}, pyramid={"levels": 2}
        )
    )
    plan = summary.job.plan
    assert plan.axes == axes and plan.levels[0].scale == scale
    assert plan.units == tuple("micrometer" if a in "zyx" and name.startswith("fiji") else "" for a in axes)
    for k, expected in enumerate(reference_pyramid(data, halving_steps(axes, scale, 1), "mean", 2)):
        np.testing.assert_array_equal(zarr.open_array(f"{out}/{k}", mode="r")[...], expected)


def test_flags_override_the_attributes(tmp_path):
    path = str(tmp_path / "fiji.h5")
    fiji_4d(path, np.zeros((2, 4, 8, 8), "u2"))
    spec = spec_for(
        path,
        "o",
        dataset="/data",
        image={"axes": "czyx", "scale": [1, 3, 3, 3], "units": ["", "nanometer", "nanometer", "nanometer"]},
    )
    from h5ngff.planner import make_plan
    from h5ngff.planner.model import Capacity

    plan = make_plan(open_source(spec).info, spec, Capacity(cores=2, memory_bytes=8 << 30))
    assert plan.axes == "czyx" and plan.levels[0].scale == (1, 3, 3, 3) and plan.units[1] == "nanometer"


def test_ilastik_channel_last_is_refused_not_transposed(tmp_path):
    """ilastik's default export order puts c last; NGFF needs it before z, y, x."""
    path = str(tmp_path / "ilastik.h5")
    ilastik(path, np.zeros((4, 8, 8, 2), "u1"), axes="zyxc")
    with pytest.raises(SpecError, match=r"axis order 'zyxc'.*does not transpose") as refused:
        open_source(spec_for(path, "o", dataset="/exported_data"))
    assert refused.value.field == "image.axes"
    # --axes decides (the user names the axes as stored): no refusal.
    assert open_source(spec_for(path, "o", dataset="/exported_data", image={"axes": "czyx"})).info.shape == (4, 8, 8, 2)


def test_conflicting_axes_are_reported_and_a_flag_decides(tmp_path):
    path = str(tmp_path / "both.h5")
    with h5py.File(path, "w") as f:
        ds = f.create_dataset("/data", data=np.zeros((2, 4, 8, 8), "u2"))
        for dim, label in zip(ds.dims, "czyx"):
            dim.label = label
        ds.attrs["axistags"] = axistags("tzyx")
    with pytest.raises(SpecError, match=r"DIMENSION_LABELS say 'czyx' but ilastik axistags say 'tzyx'.*--axes"):
        open_source(spec_for(path, "o", dataset="/data"))
    assert open_source(spec_for(path, "o", dataset="/data", image={"axes": "tzyx"})).info.attr_axes is None


def test_an_element_size_that_fits_no_axis_is_reported(tmp_path):
    path = str(tmp_path / "odd.h5")
    with h5py.File(path, "w") as f:
        f.create_dataset("/data", data=np.zeros((2, 4, 8, 8), "u2")).attrs["element_size_um"] = [0.5, 0.5]
    with pytest.raises(
        SpecError, match=r"element_size_um has 2 values \[0.5, 0.5\] for a 4-dimensional dataset.*--scale"
    ):
        open_source(spec_for(path, "o", dataset="/data"))
    assert open_source(spec_for(path, "o", dataset="/data", image={"scale": [1, 1, 1, 1]})).info.attr_scale is None
