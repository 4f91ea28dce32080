"""Independent OME-Zarr clients accept our output: ome-zarr-models validates the metadata, and
ome-zarr-py's reader and ngff-zarr read back identical arrays, for NGFF 0.4 and 0.5."""

from __future__ import annotations

import json
import os
import warnings

import numpy as np
import pytest
import zarr

from conftest import smooth, spec_for, write_h5
from reference import reference_pyramid

pytestmark = pytest.mark.integration

CASES = {
    "0.5-zyx": dict(shape=(12, 40, 33), axes="zyx", output={"chunks": [4, 16, 16], "ngffVersion": "0.5"}),
    "0.5-shards": dict(
        shape=(12, 40, 33), axes="zyx", output={"chunks": [4, 8, 8], "shards": [8, 16, 16], "ngffVersion": "0.5"}
    ),
    "0.4-zyx": dict(shape=(12, 40, 33), axes="zyx", output={"chunks": [4, 16, 16], "ngffVersion": "0.4"}),
    "0.5-tczyx": dict(shape=(2, 3, 6, 20, 18), axes="tczyx", output={"chunks": [1, 1, 4, 8, 8], "ngffVersion": "0.5"}),
    "0.4-cyx": dict(shape=(2, 40, 33), axes="cyx", output={"chunks": [1, 16, 16], "ngffVersion": "0.4"}),
}


@pytest.fixture(scope="module")
def outputs(tmp_path_factory, shared_cluster):
    """Convert every case once; the reader tests share the outputs."""
    from h5ngff.backends.external import ExternalBackend
    from h5ngff.runner import plan_job, run_job

    made = {}
    base = tmp_path_factory.mktemp("readers")
    for name, case in CASES.items():
        data = smooth(case["shape"], "uint16", seed=len(name))
        h5 = write_h5(base / f"{name}.h5", data)
        out = str(base / f"{name}.ome.zarr")
        units = ["second" if a == "t" else "" if a == "c" else "micrometer" for a in case["axes"]]
        scale = [1.0 if a in "tc" else 0.5 for a in case["axes"]]
        spec = spec_for(
            h5,
            out,
            output=case["output"],
            image={"axes": case["axes"], "units": units, "scale": scale, "name": name},
            pyramid={"levels": 3},
        )
        backend = ExternalBackend(shared_cluster.scheduler_address)
        run_job(plan_job(spec, backend), backend)
        downsampled = tuple(a in "zyx" for a in case["axes"])
        made[name] = (out, reference_pyramid(data, downsampled, "mean", 3), case)
    return made


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(CASES))
def test_ome_zarr_models_validates(outputs, name):
    out, _, case = outputs[name]
    group = zarr.open_group(out, mode="r")
    if case["output"]["ngffVersion"] == "0.5":
        from ome_zarr_models.v05 import Image
    else:
        from ome_zarr_models.v04 import Image
    image = Image.from_zarr(group)
    multiscales = image.ome_attributes.multiscales
    assert [a.name for a in multiscales[0].axes] == list(case["axes"])
    assert len(image.datasets[0]) == 3


@pytest.mark.parametrize("name", sorted(CASES))
def test_ome_zarr_py_reads_identical_arrays(outputs, name):
    from ome_zarr.io import parse_url
    from ome_zarr.reader import Reader

    out, want, _ = outputs[name]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        nodes = list(Reader(parse_url(out))())
    data = nodes[0].data
    assert len(data) == 3
    for level, expected in zip(data, want):
        np.testing.assert_array_equal(np.asarray(level), expected)


@pytest.mark.parametrize("name", sorted(CASES))
def test_ngff_zarr_reads_identical_arrays(outputs, name):
    import ngff_zarr

    out, want, case = outputs[name]
    multiscales = ngff_zarr.from_ngff_zarr(out)
    assert len(multiscales.images) == 3
    for image, expected in zip(multiscales.images, want):
        np.testing.assert_array_equal(np.asarray(image.data), expected)
    assert list(multiscales.images[0].dims) == list(case["axes"])


def test_metadata_scale_translation_and_omero(outputs):
    out, want, _ = outputs["0.5-zyx"]
    with open(os.path.join(out, "zarr.json")) as f:
        attrs = json.load(f)["attributes"]
    ms = attrs["ome"]["multiscales"][0]
    assert attrs["ome"]["version"] == "0.5"
    assert [d["path"] for d in ms["datasets"]] == ["0", "1", "2"]
    assert ms["datasets"][0]["coordinateTransformations"] == [{"type": "scale", "scale": [0.5, 0.5, 0.5]}]
    assert ms["datasets"][2]["coordinateTransformations"] == [
        {"type": "scale", "scale": [2.0, 2.0, 2.0]},
        {"type": "translation", "translation": [0.75, 0.75, 0.75]},  # centre of a 4-voxel block
    ]
    assert [a.get("unit") for a in ms["axes"]] == ["micrometer"] * 3
    window = attrs["ome"]["omero"]["channels"][0]["window"]
    assert (window["min"], window["max"]) == (int(want[0].min()), int(want[0].max()))
    assert attrs["h5ngff"]["complete"] is True
    assert not os.path.exists(os.path.join(out, ".h5ngff")), "a finished output is a plain OME-Zarr"


def test_per_channel_windows(outputs):
    out, want, _ = outputs["0.4-cyx"]
    with open(os.path.join(out, ".zattrs")) as f:
        omero = json.load(f)["omero"]
    for c, channel in enumerate(omero["channels"]):
        assert channel["window"]["min"] == int(want[0][c].min())
        assert channel["window"]["max"] == int(want[0][c].max())


def test_validator_rejects_broken_metadata(outputs, tmp_path):
    """Negative control: ome-zarr-models does fail on metadata that breaks the spec."""
    import shutil

    import pydantic
    from ome_zarr_models.v05 import Image

    out, _, _ = outputs["0.5-zyx"]
    broken = tmp_path / "broken.ome.zarr"
    shutil.copytree(out, broken)
    with open(broken / "zarr.json") as f:
        doc = json.load(f)
    doc["attributes"]["ome"]["multiscales"][0]["axes"][0]["type"] = "space"
    doc["attributes"]["ome"]["multiscales"][0]["axes"] = doc["attributes"]["ome"]["multiscales"][0]["axes"][:2]
    with open(broken / "zarr.json", "w") as f:
        json.dump(doc, f)
    with pytest.raises(pydantic.ValidationError):
        Image.from_zarr(zarr.open_group(str(broken), mode="r"))
