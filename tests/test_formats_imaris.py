"""Imaris .ims: 2 time points x 3 channels, blocks padded beyond the image, converted exactly at
every level; voxel sizes, channel names and colours taken from DataSetInfo. Every fixture is
read back with imaris-ims-file-reader (an independent reader) and the output with ome-zarr-py,
ngff-zarr and ome-zarr-models."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import h5py
import numpy as np
import pytest
import zarr

from conftest import smooth, spec_for
from formats_fixtures import PADDING_VALUE, read_by_independent_clients, read_ims_independently, write_ims
from h5ngff.engine.verify.check import verify_output
from h5ngff.errors import UnsupportedDatasetError
from reference import halving_steps, reference_pyramid

pytestmark = pytest.mark.integration

NAMES = ["DAPI", "GFP", "mCherry"]
COLORS = [(0.0, 0.0, 1.0), (0.0, 1.0, 0.0), (1.0, 0.0, 1.0)]
LEVELS = 3


@pytest.fixture(scope="module")
def ims_file(tmp_path_factory):
    data = smooth((2, 3, 10, 37, 29), "uint16", seed=11)  # no axis a multiple of the (4, 16, 16) blocks
    path = write_ims(
        tmp_path_factory.mktemp("ims") / "cells.ims", data, voxel=(2.0, 0.5, 0.25), names=NAMES, colors=COLORS
    )
    independent, resolution = read_ims_independently(path)
    np.testing.assert_array_equal(independent, data)  # the fixture is what an independent reader sees
    with h5py.File(path) as f:  # and its blocks really are padded
        assert f["DataSet/ResolutionLevel 0/TimePoint 1/Channel 2/Data"].shape == (12, 48, 32)
        assert f["DataSet/ResolutionLevel 0/TimePoint 1/Channel 2/Data"][11, 47, 31] == PADDING_VALUE
    return path, independent, resolution


@pytest.fixture(scope="module")
def converted(ims_file, tmp_path_factory, shared_cluster):
    from h5ngff.backends.external import ExternalBackend
    from h5ngff.runner import plan_job, run_job

    path, data, _ = ims_file
    out = str(tmp_path_factory.mktemp("ims-out") / "cells.ome.zarr")
    backend = ExternalBackend(shared_cluster.scheduler_address)
    spec = spec_for(
        path,
        out,
        dataset="/",
        output={"chunks": [1, 1, 4, 16, 16]},
        pyramid={"levels": LEVELS},
        resources={"slab": [1, 2, 8, 37, 29]},
    )
    summary = run_job(plan_job(spec, backend), backend)
    return out, summary


@pytest.mark.slow
def test_every_level_equals_the_independent_reader(ims_file, converted):
    _, data, _ = ims_file
    out, summary = converted
    assert summary.job.plan.axes == "tczyx" and summary.job.plan.passes[0].slab[1] == 2  # slabs span channels
    # The voxel size is anisotropic: each step halves the axes the anisotropy rule picks.
    plan = summary.job.plan
    want = reference_pyramid(data, halving_steps(plan.axes, plan.levels[0].scale, LEVELS - 1), "mean", LEVELS)
    for k, expected in enumerate(want):
        np.testing.assert_array_equal(zarr.open_array(f"{out}/{k}", mode="r")[...], expected)


def test_scale_is_the_voxel_size_and_channels_carry_names_and_colours(ims_file, converted):
    _, _, resolution = ims_file
    out, _ = converted
    with open(os.path.join(out, "zarr.json")) as f:
        ome = json.load(f)["attributes"]["ome"]
    ms = ome["multiscales"][0]
    assert ms["datasets"][0]["coordinateTransformations"][0]["scale"] == [1.0, 1.0, *resolution]
    assert [a.get("unit") for a in ms["axes"]] == [None, None, "micrometer", "micrometer", "micrometer"]
    assert [c["label"] for c in ome["omero"]["channels"]] == NAMES
    assert [c["color"] for c in ome["omero"]["channels"]] == ["0000FF", "00FF00", "FF00FF"]


@pytest.mark.slow
def test_independent_ome_zarr_clients_read_it(ims_file, converted):
    _, data, _ = ims_file
    out, _ = converted
    ms = read_by_independent_clients(out, data)
    assert ms.images[0].scale["x"] == 0.25 and ms.images[0].scale["z"] == 2.0


def test_verify_compares_with_the_imaris_file(ims_file, converted, tmp_path):
    path, _, _ = ims_file
    out, _ = converted
    assert verify_output(out, (path, "/")).ok
    changed = str(tmp_path / "changed.ims")
    with open(path, "rb") as src, open(changed, "wb") as dst:
        dst.write(src.read())
    with h5py.File(changed, "r+") as f:  # negative control: one voxel of the last channel differs
        f["DataSet/ResolutionLevel 0/TimePoint 1/Channel 2/Data"][9, 36, 28] += 1
    report = verify_output(out, (changed, "/"))
    # verify compares every level with the source's pyramid: the voxel's chunk at each level differs
    assert not report.ok and sorted(level for level, _ in report.bad_units) == [0, 1, 2]
    assert {m.chunk[:2] for m in report.mismatches} == {(1, 2)}  # time point 1, channel 2 only


def test_single_time_point_and_channel_is_zyx(tmp_path):
    from h5ngff.engine.sources import open_source

    path = write_ims(tmp_path / "one.ims", smooth((1, 1, 5, 20, 20), "uint8"), voxel=(1.0, 0.3, 0.3))
    info = open_source(spec_for(path, str(tmp_path / "o"), dataset="/")).info
    assert info.attr_axes == "zyx" and info.shape == (5, 20, 20) and info.dtype == "|u1"


def test_differing_channel_sizes_are_refused_with_what_to_do(tmp_path):
    from h5ngff.engine.sources import open_source

    path = write_ims(tmp_path / "odd.ims", smooth((1, 2, 5, 20, 20), "uint16"))
    with h5py.File(path, "r+") as f:
        f["DataSet/ResolutionLevel 0/TimePoint 0/Channel 1"].attrs["ImageSizeX"] = np.array([b"1", b"8"], dtype="S1")
    with pytest.raises(
        UnsupportedDatasetError,
        match=r"channel 1 is \(5, 20, 18\) .* but the image is \(5, 20, 20\).*Convert that channel alone",
    ):
        open_source(spec_for(path, str(tmp_path / "o"), dataset="/"))


@pytest.mark.slow
def test_cli_converts_an_ims_file_named_alone(ims_file, tmp_path):
    path, _, _ = ims_file
    out = str(tmp_path / "cli.ome.zarr")
    proc = subprocess.run(
        [sys.executable, "-m", "h5ngff.cli", "plan", path, out, "--json", "--levels", "1"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    plan = json.loads(proc.stdout)["plan"]
    assert plan["axes"] == "tczyx" and plan["dataset"]["shape"] == [2, 3, 10, 37, 29]
    assert plan["dataset"]["channel_names"] == NAMES


@pytest.mark.slow
@pytest.mark.timeout(900)  # three CLI runs, each starting a local cluster: minutes on a loaded machine
def test_a_killed_imaris_run_resumes_bit_identical(ims_file, converted, tmp_path):
    """Resume keyed on the composite source: kill a run mid-flight (slabs slowed by the fault
    switch), re-run it, and get the chunk files of the uninterrupted run, byte for byte."""
    import signal
    import time

    from test_engine_resume import chunk_files, manifest_lines

    path, data, _ = ims_file
    clean, summary = converted
    total = summary.job.plan.n_tasks
    flags = [
        "--chunks",
        "1,1,4,16,16",
        "--levels",
        str(LEVELS),
        "--slab",
        "1,2,8,37,29",
        "--workers",
        "2",
        "--no-progress",
    ]
    out = str(tmp_path / "killed.ome.zarr")
    env = {**os.environ, "H5NGFF_FAULTS": "slab_sleep=0.4"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "h5ngff.cli", "convert", path, out, *flags],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    deadline = time.time() + 180
    while manifest_lines(out) < 2 and proc.poll() is None and time.time() < deadline:
        time.sleep(0.01)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    recorded = manifest_lines(out)
    assert 0 < recorded < total, f"the kill must land mid-run ({recorded} of {total})"
    result = subprocess.run(
        [sys.executable, "-m", "h5ngff.cli", "convert", path, out, "--json", *flags],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr
    resumed = json.loads(result.stdout)
    assert resumed["resumed"] is True and resumed["slabs_skipped"] >= recorded
    assert chunk_files(out) == chunk_files(clean)
    np.testing.assert_array_equal(zarr.open_array(out + "/0", mode="r")[...], data)
