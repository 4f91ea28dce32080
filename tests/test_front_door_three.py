"""The front door, round three (issue 42): what a first use hit, each pinned by a test that failed
on cb6367c. Real ``h5ngff`` processes on small generated files; the conversions run on the
session's shared Dask cluster (``--scheduler``) where the test is not about the cluster itself."""

from __future__ import annotations

import fcntl
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import h5py
import pytest

from conftest import smooth, write_h5
from h5ngff.errors import ExitCode

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[1]
CLI = [sys.executable, "-m", "h5ngff.cli"]
ENV = {**os.environ, "PYTHONPATH": str(ROOT / "src") + os.pathsep + os.environ.get("PYTHONPATH", "")}


def h5ngff(*argv, cwd=None, env=None, timeout=180) -> subprocess.CompletedProcess:
    return subprocess.run(
        [*CLI, *map(str, argv)], capture_output=True, text=True, timeout=timeout, cwd=cwd, env=env or ENV
    )


def one_error_line(proc: subprocess.CompletedProcess) -> str:
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error ("), proc.stderr
    assert "Traceback" not in proc.stdout + proc.stderr
    return lines[0]


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    d = tmp_path_factory.mktemp("front3")
    write_h5(d / "small.h5", smooth((16, 40, 40)))
    return d


# -- tracebacks -----------------------------------------------------------------------------------


@pytest.mark.slow
def test_sample_chunks_larger_than_the_shape_are_refused_in_one_line(tmp_path):
    proc = h5ngff("sample", tmp_path / "s.h5", "--shape", "4,64,64", "--hdf5-chunks", "8,128,128")
    assert proc.returncode == ExitCode.BAD_INPUT
    assert "'4,64,64' fits" in one_error_line(proc)
    assert os.listdir(tmp_path) == []


@pytest.mark.slow
def test_a_sample_too_large_for_memory_or_disk_is_refused_before_anything_is_written(tmp_path):
    plane = h5ngff("sample", tmp_path / "s.h5", "--shape", "100000,100000,100000")
    assert plane.returncode == ExitCode.BAD_INPUT and "half of the" in one_error_line(plane)
    disk = h5ngff("sample", tmp_path / "s.h5", "--shape", "10000000,1000,1000")
    assert disk.returncode == ExitCode.BAD_INPUT and "fits on the disk" in one_error_line(disk)
    assert os.listdir(tmp_path) == []


# -- messages -------------------------------------------------------------------------------------


@pytest.mark.slow
def test_a_source_held_open_by_a_writer_names_the_lock_and_what_to_do(tmp_path):
    path = tmp_path / "busy.h5"
    with h5py.File(path, "w") as f:  # held open for writing, with HDF5's file lock
        f["x"] = smooth((8, 8))
        f.flush()
        proc = h5ngff("plan", f"{path}:/x")
    assert proc.returncode == ExitCode.BAD_INPUT
    line = one_error_line(proc)
    assert "locked by another process" in line and "HDF5_USE_FILE_LOCKING" in line and "SWMR" in line
    assert "uncorrupted" not in line


@pytest.mark.slow
def test_a_five_kilobyte_path_is_not_echoed_whole(tmp_path):
    long = "d/" * 2500 + "x.h5"
    proc = h5ngff("convert", f"{long}:/data", tmp_path / "o")
    assert proc.returncode == ExitCode.BAD_INPUT
    line = one_error_line(proc)
    assert len(line) < 600 and "characters)" in line, len(line)


@pytest.mark.slow
def test_a_misspelt_manifest_key_is_named_with_the_closest_field(tmp_path, small):
    job = tmp_path / "job.yaml"
    job.write_text(
        "apiVersion: h5ngff.dev/v1alpha1\nkind: ConversionJob\nmetadata: {name: j}\n"
        f"spec:\n  sourc: {{path: {small / 'small.h5'}, dataset: /volume/data}}\n  output: {{path: {tmp_path / 'o'}}}\n"
    )
    proc = h5ngff("run", job)
    assert proc.returncode == ExitCode.BAD_INPUT
    line = one_error_line(proc)
    assert "spec.sourc" in line and "Did you mean source?" in line and "more problem" not in line


@pytest.mark.slow
def test_a_read_only_filesystem_is_not_called_permission_denied(tmp_path, small):
    ro = tmp_path / "ro"
    ro.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", str(ro)], capture_output=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a read-only tmpfs here: {mounted.stderr.decode().strip()}")
    try:
        proc = h5ngff("convert", f"{small / 'small.h5'}:/volume/data", ro / "out.ome.zarr")
    finally:
        subprocess.run(["umount", str(ro)], check=True)
    assert proc.returncode == ExitCode.OUTPUT_REFUSED
    line = one_error_line(proc)
    assert "read-only filesystem" in line and "permission denied" not in line


# -- help that matches behaviour ------------------------------------------------------------------


@pytest.mark.slow
def test_help_says_what_each_command_does():
    assert "h5ngff batch" in h5ngff("run", "--help").stdout  # run takes a ConversionJob only
    assert "--memory-report" not in h5ngff("batch", "--help").stdout  # which batch refused
    convert = " ".join(h5ngff("convert", "--help").stdout.split())
    assert "budget" in convert and "250Mi pod" in convert  # --memory-per-worker caps, it is no limit
    assert ".jpg" in convert  # --memory-report writes every format it accepts
    for command, words in (("sample", "compress it a few to one"), ("demo", "end to end")):
        assert words in " ".join(h5ngff(command, "--help").stdout.split()), command


@pytest.mark.slow
def test_a_memory_report_in_any_accepted_format_is_that_format(tmp_path, small, shared_cluster):
    report = tmp_path / "mem.jpg"
    out = tmp_path / "o.ome.zarr"
    proc = h5ngff("convert", f"{small / 'small.h5'}:/volume/data", out, "--memory-report", report, "--no-progress")
    assert proc.returncode == 0, proc.stderr
    assert report.read_bytes()[:3] == b"\xff\xd8\xff"  # a JPEG, not a PNG named .jpg
    refused = h5ngff("convert", f"{small / 'small.h5'}:/volume/data", out, "--memory-report", tmp_path / "m.bmp")
    assert refused.returncode == ExitCode.BAD_INPUT and ".webp" in one_error_line(refused)


# -- noise ----------------------------------------------------------------------------------------


@pytest.mark.slow
def test_convert_prints_a_short_plan_results_on_stdout_and_the_bar_on_stderr(tmp_path, small, shared_cluster):
    out = tmp_path / "o.ome.zarr"
    address = shared_cluster.scheduler_address
    proc = h5ngff("convert", f"{small / 'small.h5'}:/volume/data", out, "--scheduler", address)
    assert proc.returncode == 0, proc.stderr
    head = proc.stdout.split("status")[0]
    assert len(head.strip().splitlines()) == 2 and "pod limit" in head and "h5ngff plan" in head, proc.stdout
    assert "Memory per worker (the pass" not in proc.stdout and "━━━━━━━━━━━━━━━━━━━━ 100%" not in proc.stdout
    assert "100%" in proc.stderr  # the bar's last line
    assert max(len(line) for line in proc.stdout.splitlines() if "│" in line or "┃" in line) <= 100
    full = h5ngff("-v", "convert", f"{small / 'small.h5'}:/volume/data", out, "--overwrite", "--scheduler", address)
    assert full.returncode == 0 and "Memory per worker (the pass" in full.stdout


@pytest.mark.slow
def test_verify_of_a_path_that_is_no_zarr_leaves_no_half_drawn_bar(tmp_path):
    (tmp_path / "notzarr").mkdir()
    (tmp_path / "notzarr" / "a").write_text("x")
    proc = h5ngff("verify", tmp_path / "notzarr")
    assert proc.returncode == 1
    assert "━" not in proc.stdout + proc.stderr and "not a Zarr group" in proc.stdout


# -- batch outcomes -------------------------------------------------------------------------------


def _file(source: str) -> str:
    """The file name of a batch item's source (``.../r0.h5:/volume/data`` -> ``r0.h5``)."""
    return os.path.basename(source.rsplit(":/", 1)[0])


def _runs(tmp_path, n=2, shape=(8, 32, 32)):
    runs = tmp_path / "runs"
    runs.mkdir()
    for i in range(n):
        write_h5(runs / f"r{i}.h5", smooth(shape, seed=i))
    return f"{runs}/*.h5:/volume/data", str(tmp_path / "out" / "{stem}.ome.zarr")


@pytest.mark.slow
def test_an_item_finished_by_the_rerun_is_done_and_a_rerun_of_finished_items_starts_no_cluster(tmp_path):
    """Killed after every slab of the first item was recorded, before its completion marker: the
    re-run writes the marker, so the item is Done, not Complete ("nothing done"). A third run
    finds every item complete and says it starts no cluster (it said "one cluster of 2")."""
    pattern, template = _runs(tmp_path)
    flags = ["--chunks", "8,16,16", "--levels", "2", "--no-progress", "--items-in-flight", "1"]
    killed = h5ngff("convert", pattern, template, *flags, env={**ENV, "H5NGFF_FAULTS": "crash_at=finish"})
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    again = h5ngff("convert", pattern, template, *flags, "--json")
    assert again.returncode == 0, again.stderr
    outcomes = {_file(r["source"]): r["status"] for r in json.loads(again.stdout)["results"]}
    assert outcomes == {"r0.h5": "Done", "r1.h5": "Done"}
    third = h5ngff("convert", pattern, template, *flags)
    assert third.returncode == 0, third.stderr
    assert "every one already complete: no cluster to start" in third.stdout and "one cluster" not in third.stdout
    assert "0 cluster start(s)" in third.stdout and "2 complete of 2" in third.stdout
    assert "batch: 2 items" in third.stdout


@pytest.mark.slow
def test_a_batch_of_one_says_one_item(tmp_path, shared_cluster):
    pattern, template = _runs(tmp_path, n=1)
    proc = h5ngff("convert", pattern, template, "--no-progress", "--scheduler", shared_cluster.scheduler_address)
    assert proc.returncode == 0, proc.stderr
    assert "batch: 1 item," in proc.stdout and "1 items" not in proc.stdout


@pytest.mark.slow
def test_an_output_busy_when_its_item_starts_is_refused_not_failed(tmp_path, shared_cluster):
    """The second item's output is locked by another run after the batch planned it (the first
    item runs slowly meanwhile): docs/batch.md puts a busy output under Refused, as planning does."""
    pattern, template = _runs(tmp_path)
    proc = subprocess.Popen(
        [*CLI, "convert", pattern, template, "--items-in-flight", "1", "--json", "--scheduler", shared_cluster.scheduler_address],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env={**ENV, "H5NGFF_FAULTS": "slab_sleep=0.6"},
    )  # fmt: skip
    busy = tmp_path / "out" / "r1.ome.zarr"
    first = tmp_path / "out" / "r0.ome.zarr"
    deadline = time.monotonic() + 120
    while not (first / ".h5ngff.lock").exists() and time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.05)
    busy.mkdir(parents=True)
    with open(busy / ".h5ngff.lock", "w") as holder:
        fcntl.flock(holder, fcntl.LOCK_EX | fcntl.LOCK_NB)  # another run's lock, as lock.py takes it
        holder.write(json.dumps({"pid": os.getpid(), "host": "elsewhere", "command": "another h5ngff run"}))
        holder.flush()
        stdout, stderr = proc.communicate(timeout=180)
    assert proc.returncode == ExitCode.FAILED, stderr
    results = {r["output"].split("/")[-1]: r for r in json.loads(stdout)["results"]}
    assert results["r0.ome.zarr"]["status"] == "Done"
    assert results["r1.ome.zarr"]["status"] == "Refused" and results["r1.ome.zarr"]["reason"] == "OutputBusy"


@pytest.mark.slow
def test_why_an_item_was_refused_goes_to_stderr(tmp_path, shared_cluster):
    pattern, template = _runs(tmp_path, n=1)
    (tmp_path / "runs" / "r9.h5").symlink_to("gone.h5")
    proc = h5ngff("convert", pattern, template, "--no-progress", "--scheduler", shared_cluster.scheduler_address)
    assert proc.returncode == ExitCode.FAILED
    assert "symbolic link to 'gone.h5'" in proc.stderr and "gone.h5'" not in proc.stdout
    assert "Refused" in proc.stdout  # the outcome stays in the table


@pytest.mark.slow
def test_fail_fast_with_an_item_refused_at_planning_converts_nothing(tmp_path, shared_cluster):
    """The decision (docs/batch.md): --fail-fast plans every item before any starts, so an item
    refused at planning stops the batch before anything is converted; the items before it are
    NotRun, and no output is written."""
    pattern, template = _runs(tmp_path)
    (tmp_path / "runs" / "r1.h5").unlink()
    (tmp_path / "runs" / "r1.h5").symlink_to("gone.h5")
    proc = h5ngff(
        "convert", pattern, template, "--fail-fast", "--json", "--scheduler", shared_cluster.scheduler_address
    )
    assert proc.returncode == ExitCode.FAILED, proc.stderr
    results = {_file(r["source"]): r["status"] for r in json.loads(proc.stdout)["results"]}
    assert results == {"r0.h5": "NotRun", "r1.h5": "Refused"}
    assert not (tmp_path / "out").exists()


# -- plan and verify take what convert takes ------------------------------------------------------


@pytest.mark.slow
def test_plan_of_a_glob_plans_every_item_and_names_the_cluster(tmp_path):
    pattern, template = _runs(tmp_path, n=2)
    (tmp_path / "runs" / "r9.h5").symlink_to("gone.h5")
    proc = h5ngff("plan", pattern, template, "--json")
    assert proc.returncode == ExitCode.FAILED, proc.stderr  # one item would be refused, as convert would
    doc = json.loads(proc.stdout)
    status = {_file(i["source"]): i["status"] for i in doc["items"]}
    assert status == {"r0.h5": "Planned", "r1.h5": "Planned", "r9.h5": "Refused"}
    assert doc["cluster"]["workers"] >= 1 and doc["items"][0]["plan"]["memory"]["pod_limit"] > 0
    assert not (tmp_path / "out").exists()  # a plan writes nothing
    table = h5ngff("plan", pattern)
    assert "batch plan: 3 items, 1 refused" in table.stdout and "gone.h5" in table.stderr


@pytest.mark.slow
def test_verify_takes_the_template_and_sources_convert_took_or_a_glob_of_outputs(tmp_path, shared_cluster):
    pattern, template = _runs(tmp_path, n=2)
    done = h5ngff("convert", pattern, template, "--no-progress", "--scheduler", shared_cluster.scheduler_address)
    assert done.returncode == 0, done.stderr
    both = h5ngff("verify", template, "--source", pattern)
    assert both.returncode == 0 and "2 of 2 output(s) ok." in both.stdout, both.stdout + both.stderr
    assert h5ngff("verify", str(tmp_path / "out" / "*.ome.zarr")).returncode == 0
    # A wrong source for one output: that output is named, the exit status is 1.
    (tmp_path / "runs" / "r1.h5").unlink()
    write_h5(tmp_path / "runs" / "r1.h5", smooth((8, 32, 32), seed=99))
    bad = h5ngff("verify", template, "--source", pattern)
    assert bad.returncode == 1 and "1 of 2 output(s) ok, 1 with problems." in bad.stdout
    assert "r1.ome.zarr: level 0" in bad.stdout
    glob_with_source = h5ngff("verify", str(tmp_path / "out" / "*.ome.zarr"), "--source", pattern)
    assert glob_with_source.returncode == ExitCode.BAD_INPUT and "template" in one_error_line(glob_with_source)


# -- other ----------------------------------------------------------------------------------------


@pytest.mark.slow
def test_a_windows_style_dataset_path_is_shown_as_typed_with_the_slashed_one(small):
    proc = h5ngff("plan", f"{small / 'small.h5'}:\\volume\\data")
    assert proc.returncode == ExitCode.BAD_INPUT
    line = one_error_line(proc)
    assert "'/\\volume\\data'" in line and "Did you mean '/volume/data'?" in line and "\\\\" not in line


@pytest.mark.slow
def test_scales_and_translations_are_written_as_decimals(tmp_path, shared_cluster):
    path = tmp_path / "aniso.h5"
    with h5py.File(path, "w") as f:
        f.create_dataset("x", data=smooth((16, 16, 16))).attrs["element_size_um"] = [0.3, 0.2, 0.1]
    out = tmp_path / "o.ome.zarr"
    proc = h5ngff(
        "convert", f"{path}:/x", out, "--chunks", "4,4,4", "--levels", "4", "--no-progress",
        "--scheduler", shared_cluster.scheduler_address,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    text = (out / "zarr.json").read_text()
    assert "0.15000000000000002" not in text and "0000000" not in text, text
    values = [
        v
        for d in json.loads(text)["attributes"]["ome"]["multiscales"][0]["datasets"]
        for t in d["coordinateTransformations"]
        for v in t.get("scale", t.get("translation", []))
    ]
    assert 0.15 in values and all(len(repr(v)) <= 6 for v in values), values


@pytest.mark.slow
def test_each_level_has_chunks_no_larger_than_itself(tmp_path, shared_cluster):
    """A (5, 16, 16) level kept (40, 64, 64) chunks (issue 42): every reader decoded buffers 32
    times the level. Each level's chunks are now level 0's, at most its own extent; the chunk and
    shard grids are unchanged, so verify --source and ome-zarr-models still agree."""
    from ome_zarr_models.v05 import Image
    import zarr

    path = write_h5(tmp_path / "in.h5", smooth((40, 64, 64)))
    out = tmp_path / "o.ome.zarr"
    proc = h5ngff(
        "convert", f"{path}:/volume/data", out, "--chunks", "40,64,64", "--levels", "4", "--no-progress",
        "--scheduler", shared_cluster.scheduler_address,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    group = zarr.open_group(str(out), mode="r")
    assert [tuple(group[str(k)].chunks) for k in range(4)] == [(40, 64, 64), (20, 32, 32), (10, 16, 16), (5, 8, 8)]
    Image.from_zarr(group)
    check = h5ngff("verify", out, "--source", f"{path}:/volume/data")
    assert check.returncode == 0, check.stdout


@pytest.mark.slow
def test_an_output_of_an_earlier_version_with_level_0s_chunks_everywhere_is_complete_or_refused_clearly(
    tmp_path, shared_cluster
):
    """Outputs written before levels had their own chunks lack ``levelChunks`` in their content: a
    finished one is complete (a re-run has nothing to do, as before); an unfinished one is refused
    with what to do, never resumed in a mixed layout."""
    path = write_h5(tmp_path / "in.h5", smooth((16, 64, 64)))
    address = shared_cluster.scheduler_address
    flags = ["--chunks", "16,64,64", "--levels", "3", "--no-progress", "--scheduler", address]
    done = tmp_path / "done.ome.zarr"
    assert h5ngff("convert", f"{path}:/volume/data", done, *flags).returncode == 0
    root = json.loads((done / "zarr.json").read_text())
    del root["attributes"]["h5ngff"]["content"]["levelChunks"]  # as an earlier version wrote it
    (done / "zarr.json").write_text(json.dumps(root))
    before = sorted((p.relative_to(done), p.stat().st_mtime_ns) for p in done.rglob("*") if p.is_file())
    again = h5ngff("convert", f"{path}:/volume/data", done, *flags)
    assert again.returncode == 0 and "0 written" in again.stdout, again.stdout + again.stderr
    assert sorted((p.relative_to(done), p.stat().st_mtime_ns) for p in done.rglob("*") if p.is_file()) == before
    unfinished = tmp_path / "unfinished.ome.zarr"
    killed = h5ngff(
        "convert", f"{path}:/volume/data", unfinished, *flags, env={**ENV, "H5NGFF_FAULTS": "crash_at=finish"}
    )
    assert killed.returncode == -signal.SIGKILL
    manifest = unfinished / ".h5ngff" / "manifest.jsonl"
    lines = manifest.read_text().splitlines()
    header = json.loads(lines[0])
    del header["content"]["levelChunks"]
    manifest.write_text("\n".join([json.dumps(header), *lines[1:]]) + "\n")
    refused = h5ngff("convert", f"{path}:/volume/data", unfinished, *flags)
    assert refused.returncode == ExitCode.OUTPUT_REFUSED and "--overwrite" in one_error_line(refused)
    assert h5ngff("convert", f"{path}:/volume/data", unfinished, *flags, "--overwrite").returncode == 0
