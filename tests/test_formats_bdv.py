"""BigDataViewer XML + HDF5 written by npy2bdv and pybdv (independent writers, what Fiji reads):
2 setups as channels x 2 time points, uint16 stored as int16, voxel size and unit from the XML,
exact at every level; several tiles refused with what the file holds, and selected with --tile."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import zarr

from conftest import smooth, spec_for
from formats_fixtures import read_by_independent_clients
from h5ngff.engine.sources import open_source
from h5ngff.engine.verify.check import verify_output
from h5ngff.errors import SourceError, SpecError
from reference import reference_pyramid

LEVELS = 3


def write_npy2bdv(path, data, ntiles=1, labels=("488", "561")):
    """data: (tile, t, c, z, y, x) -> an npy2bdv XML/HDF5 pair with a BDV pyramid of its own."""
    import npy2bdv

    ntile, T, C = data.shape[:3]
    writer = npy2bdv.BdvWriter(
        str(path), nchannels=C, ntiles=ntile, subsamp=((1, 1, 1), (1, 2, 2)), blockdim=((4, 16, 16),)
    )
    writer.set_attribute_labels("channel", labels[:C])
    for tile in range(ntile):
        for t in range(T):
            for c in range(C):
                writer.append_view(
                    data[tile, t, c], time=t, channel=c, tile=tile, voxel_size_xyz=(0.5, 0.5, 2.0), voxel_units="um"
                )
    writer.write_xml()
    writer.close()
    return str(path)[:-3] + ".xml"


def read_npy2bdv(xml, T, C, tile=0):
    import npy2bdv

    editor = npy2bdv.BdvEditor(xml, mode="r")  # read-only: the workers still hold the file open for reading
    try:
        return np.stack(
            [np.stack([editor.read_view(time=t, channel=c, tile=tile) for c in range(C)]) for t in range(T)]
        )
    finally:
        editor.finalize()


@pytest.fixture(scope="module")
def bdv(tmp_path_factory):
    data = smooth((1, 2, 2, 10, 36, 30), "uint16", seed=21)
    assert data.max() > 32767  # values that int16 storage must not mangle
    xml = write_npy2bdv(tmp_path_factory.mktemp("bdv") / "dataset.h5", data)
    independent = read_npy2bdv(xml, 2, 2)
    np.testing.assert_array_equal(independent, data[0])
    return xml, independent


@pytest.fixture(scope="module")
def converted(bdv, tmp_path_factory, shared_cluster):
    from h5ngff.backends.external import ExternalBackend
    from h5ngff.runner import plan_job, run_job

    xml, _ = bdv
    out = str(tmp_path_factory.mktemp("bdv-out") / "dataset.ome.zarr")
    backend = ExternalBackend(shared_cluster.scheduler_address)
    spec = spec_for(xml, out, dataset="/", output={"chunks": [1, 1, 4, 16, 16]}, pyramid={"levels": LEVELS})
    return out, run_job(plan_job(spec, backend), backend)


@pytest.mark.slow
@pytest.mark.integration
def test_every_level_equals_what_npy2bdv_reads(bdv, converted):
    _, data = bdv
    out, summary = converted
    plan = summary.job.plan
    assert plan.axes == "tczyx" and plan.dtype == "<u2"
    assert plan.levels[0].scale == (1.0, 1.0, 2.0, 0.5, 0.5) and plan.units[2:] == ("micrometer",) * 3
    # z (2.0) is 4x y and x (0.5): the anisotropy rule halves y and x only, levels 1 and 2.
    yx = (False, False, False, True, True)
    for k, expected in enumerate(
        reference_pyramid(data, [yx, yx, (False, False, True, True, True)][: LEVELS - 1], "mean", LEVELS)
    ):
        np.testing.assert_array_equal(zarr.open_array(f"{out}/{k}", mode="r")[...], expected)


@pytest.mark.slow
@pytest.mark.integration
def test_channel_names_and_independent_clients(bdv, converted):
    _, data = bdv
    out, _ = converted
    with open(os.path.join(out, "zarr.json")) as f:
        ome = json.load(f)["attributes"]["ome"]
    assert [c["label"] for c in ome["omero"]["channels"]] == ["488", "561"]
    ms = read_by_independent_clients(out, data)
    assert ms.images[0].scale["z"] == 2.0 and ms.images[0].scale["x"] == 0.5


@pytest.mark.integration
def test_verify_against_the_xml_and_the_h5_names_the_same_source(bdv, converted):
    xml, _ = bdv
    out, _ = converted
    assert verify_output(out, (xml, "/")).ok
    h5 = xml[:-4] + ".h5"
    by_h5 = open_source(spec_for(h5, "unused", dataset="/"))
    assert by_h5.identity == open_source(spec_for(xml, "unused", dataset="/")).identity


def test_int16_storage_is_reinterpreted_not_converted(bdv):
    """Negative control for the dtype rule: h5py's own conversion of the stored int16 to uint16
    would clip every value above 32767."""
    import h5py

    xml, data = bdv
    with h5py.File(xml[:-4] + ".h5") as f:
        stored = f["t00001/s01/0/cells"]
        assert stored.dtype == np.int16
        clipped = stored.astype(np.uint16)[...]
    reader = open_source(spec_for(xml, "unused", dataset="/")).reader
    region = (slice(1, 2), slice(1, 2), slice(0, 10), slice(0, 36), slice(0, 30))
    np.testing.assert_array_equal(reader[region][0, 0], data[1, 1])
    assert not np.array_equal(clipped, data[1, 1])


@pytest.mark.integration
def test_several_tiles_are_refused_then_selected(tmp_path, convert):
    data = smooth((2, 1, 2, 6, 20, 18), "uint16", seed=4)
    xml = write_npy2bdv(tmp_path / "tiles.h5", data)
    with pytest.raises(SpecError, match=r"2 tile\(s\) \[0, 1\].*--tile 0") as refused:
        open_source(spec_for(xml, "unused", dataset="/"))
    assert refused.value.field == "source"
    out = str(tmp_path / "tile1.ome.zarr")
    summary = convert(
        spec_for(xml, out, dataset="/", source={"tile": 1}, output={"chunks": [1, 4, 16, 16]}, pyramid={"levels": 1})
    )
    assert summary.job.plan.axes == "czyx"
    np.testing.assert_array_equal(zarr.open_array(f"{out}/0", mode="r")[...], read_npy2bdv(xml, 1, 2, tile=1)[0])


@pytest.mark.integration
def test_pybdv_files_read_the_same_way(tmp_path, convert):
    """A second independent writer: pybdv, one setup per channel, unit micrometer."""
    import pybdv

    data = smooth((2, 8, 24, 20), "uint16", seed=9)
    h5 = str(tmp_path / "pybdv.h5")
    for c in range(2):
        pybdv.make_bdv(
            data[c],
            h5,
            resolution=[1.5, 0.3, 0.3],
            unit="micrometer",
            setup_id=c,
            timepoint=0,
            attributes={"channel": {"id": c}},
            downscale_factors=[[1, 2, 2]],
        )
    out = str(tmp_path / "pybdv.ome.zarr")
    summary = convert(
        spec_for(h5[:-3] + ".xml", out, dataset="/", output={"chunks": [1, 4, 16, 16]}, pyramid={"levels": 2})
    )
    assert summary.job.plan.axes == "czyx" and summary.job.plan.levels[0].scale == (1.0, 1.5, 0.3, 0.3)
    # z (1.5) is 5x y and x (0.3): the anisotropy rule halves y and x only.
    for k, expected in enumerate(reference_pyramid(data, (False, False, True, True), "mean", 2)):
        np.testing.assert_array_equal(zarr.open_array(f"{out}/{k}", mode="r")[...], expected)


def test_a_single_view_is_zyx_and_read_exactly(tmp_path):
    data = smooth((1, 1, 1, 5, 20, 18), "uint16", seed=6)
    xml = write_npy2bdv(tmp_path / "one.h5", data, labels=("only",))
    reader = open_source(spec_for(xml, "unused", dataset="/")).reader
    assert reader.shape == (5, 20, 18) and reader.lead_shape == ()
    np.testing.assert_array_equal(reader[(slice(0, 5), slice(3, 20), slice(0, 18))], data[0, 0, 0, :, 3:])


_MISSING_VIEW = '<MissingViews><MissingView setup="9" /></MissingViews></SequenceDescription>'


@pytest.mark.parametrize(
    "damage",
    [
        lambda text: text.replace("<id>0</id>", "", 1),
        lambda text: text.replace("</SequenceDescription>", _MISSING_VIEW, 1),
    ],
    ids=["setup id", "missing view"],
)
def test_an_xml_without_a_required_element_is_a_source_error(tmp_path, damage):
    """A ViewSetup without its <id>, or a MissingView without its time point, is named; it used
    to surface as a TypeError from int(None). Negative control: the undamaged XML opens."""
    data = smooth((1, 1, 1, 5, 20, 18), "uint16", seed=6)
    xml = write_npy2bdv(tmp_path / "one.h5", data, labels=("only",))
    open_source(spec_for(xml, "unused", dataset="/"))  # the control
    with open(xml) as f:
        text = f.read()
    damaged = damage(text)
    assert damaged != text
    with open(xml, "w") as f:
        f.write(damaged)
    with pytest.raises(SourceError, match="BigDataViewer XML has a <(ViewSetup|MissingView)> without"):
        open_source(spec_for(xml, "unused", dataset="/"))
