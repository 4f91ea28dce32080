"""Fault injection: crashes, kills, a full disk and bad input never lose or corrupt data.

A conversion either finishes with exact data, or fails with a reason and resumes."""

from __future__ import annotations

import io
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import psutil
import pytest
import zarr

from conftest import requires_cgroups, smooth, spec_for, write_h5
from h5ngff.backends.local import LocalBackend, LocalPodsBackend
from h5ngff.engine.stores.local import TMP_MARK
from h5ngff.engine.write.chunkio import ArrayLayout, write_block
from h5ngff.engine.write.output import completion_marker
from h5ngff.engine.verify.check import verify_output
from h5ngff.errors import DiskFullError, UnalignedWriteError
from h5ngff.runner import plan_job, run_job
from h5ngff.spec import CompressorSpec
from test_engine_resume import chunk_files, manifest_lines

pytestmark = pytest.mark.integration

CLI = [sys.executable, "-m", "h5ngff.cli"]
FLAGS = ["--chunks", "8,32,32", "--levels", "2", "--slab", "16,64,256", "--workers", "2", "--no-progress"]


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    base = tmp_path_factory.mktemp("reliability")
    data = smooth((48, 256, 512), "uint16", seed=21)
    h5 = write_h5(base / "in.h5", data)
    clean = str(base / "clean.ome.zarr")
    subprocess.run(CLI + ["convert", f"{h5}:/volume/data", clean] + FLAGS, check=True, capture_output=True)
    return h5, data, base, clean


def worker_processes() -> list[psutil.Process]:
    """This process's Dask worker processes: forked from the fork server, our child (its children
    share its command line), or spawned as our children (H5NGFF_WORKER_START=spawn)."""
    me = os.getpid()
    return [
        p
        for p in psutil.Process().children(recursive=True)
        if "spawn_main" in (cmd := " ".join(p.cmdline())) or ("multiprocessing.forkserver" in cmd and p.ppid() != me)
    ]


@pytest.mark.slow
def test_worker_sigkilled_mid_slab_reruns_the_slab(source, tmp_path, monkeypatch):
    h5, _, _, clean = source
    out = str(tmp_path / "out.ome.zarr")
    monkeypatch.setenv("H5NGFF_FAULTS", "slab_sleep=0.15")  # each slab takes long enough to be caught mid-way
    spec = spec_for(
        h5, out, output={"chunks": [8, 32, 32]}, pyramid={"levels": 2}, resources={"workers": 2, "slab": [16, 64, 256]}
    )
    backend = LocalBackend()
    job = plan_job(spec, backend)
    killed: list[int] = []
    # Workers of other clusters (the session's shared one) are ours too: this run's are new.
    others = {p.pid for p in worker_processes()}

    def kill_one_worker(progress):
        if not killed and progress.slabs_done >= progress.slabs_total // 3:
            victim = next(p for p in worker_processes() if p.pid not in others)
            killed.append(victim.pid)
            victim.send_signal(signal.SIGKILL)

    summary = run_job(job, backend, [kill_one_worker])
    assert killed, "the test must really kill a worker"
    assert summary.status == "Succeeded"
    assert chunk_files(out) == chunk_files(clean)
    assert verify_output(out).ok
    # The run succeeded, and its report still says a worker died and was restarted.
    assert sorted(w.nanny_restarts for w in summary.workers) == [0, 1]
    text = _rendered(summary)
    assert "restarts (any cause)" in text and "memory terminations" in text, text
    for w in summary.workers:  # the control: a run without restarts has no such column
        w.nanny_restarts = 0
    assert "restarts" not in _rendered(summary)


def _rendered(summary) -> str:
    from rich.console import Console

    from h5ngff.report import summary_renderable

    console = Console(width=300, record=True, file=io.StringIO())
    console.print(summary_renderable(summary))
    return console.export_text()


def _temporaries(path: str) -> list[str]:
    return [os.path.join(d, n) for d, _, names in os.walk(path) for n in names if TMP_MARK in n]


@pytest.mark.slow
@pytest.mark.parametrize("sweep", [True, False], ids=["swept", "negative-control-no-sweep"])
def test_regression_a_worker_killed_before_its_rename_leaves_no_temporary_file(tmp_path, monkeypatch, sweep):
    """A worker SIGKILLed between writing a chunk's temporary file and renaming it left that file
    in a finished output (seen as flaky kill tests under load): Dask re-ran the task, so the chunk
    is whole, but verify reported the stale file. The driver now sweeps before the marker."""
    data = smooth((16, 64, 128), "uint16", seed=5)
    h5 = write_h5(tmp_path / "in.h5", data)
    out = str(tmp_path / "out.ome.zarr")
    monkeypatch.setenv("H5NGFF_FAULTS", "rename_sleep=0.4")  # every write pauses with its temporary file on disk
    if not sweep:
        monkeypatch.setattr("h5ngff.engine.write.output.sweep_temporary_files", lambda path: 0)
    spec = spec_for(h5, out, output={"chunks": [8, 32, 32]}, resources={"workers": 2, "slab": [8, 64, 128]})
    backend = LocalBackend()
    killed: list[str] = []

    def kill_a_writer():
        for worker in worker_processes():  # the worker holding a temporary file open, before its rename
            try:
                held = [f.path for f in worker.open_files() if TMP_MARK in f.path]
            except psutil.Error:
                continue
            if held and not killed:
                killed.append(held[0])
                worker.send_signal(signal.SIGKILL)

    deadline = time.time() + 60
    summary = None
    watcher_stop = threading.Event()

    def watch():  # progress events come per slab; this catches the window inside one
        while not watcher_stop.is_set() and time.time() < deadline:
            try:
                kill_a_writer()
            except psutil.Error:  # a process ended while we looked at it
                pass
            time.sleep(0.02)

    thread = threading.Thread(target=watch, daemon=True)
    thread.start()
    try:
        summary = run_job(plan_job(spec, backend), backend)
    finally:
        watcher_stop.set()
        thread.join()
    assert killed, "the test must kill a worker while its temporary file exists"
    assert summary.status == "Succeeded"
    assert np.array_equal(zarr.open_array(os.path.join(out, "0"), mode="r")[:], data)
    if sweep:
        assert _temporaries(out) == [] and verify_output(out).ok
    else:  # the old behaviour: the killed writer's file stays, and verify says so
        assert _temporaries(out) and not verify_output(out).ok


@pytest.mark.slow
def test_reader_polling_never_sees_a_finished_image_over_partial_data(source, tmp_path):
    """Poll the output while a run writes it: whenever the NGFF metadata is visible, every chunk
    must already be there and decode."""
    h5, _, _, _ = source
    out = str(tmp_path / "out.ome.zarr")
    env = {**os.environ, "H5NGFF_FAULTS": "slab_sleep=0.05"}
    proc = subprocess.Popen(
        CLI + ["convert", f"{h5}:/volume/data", out] + FLAGS,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    sightings = partial_sightings = 0
    while proc.poll() is None or sightings == 0:
        try:
            with open(os.path.join(out, "zarr.json")) as f:
                has_metadata = "ome" in json.load(f).get("attributes", {})
        except (OSError, ValueError):
            has_metadata = False
        if has_metadata:
            sightings += 1
            if not verify_output(out).ok:
                partial_sightings += 1
        if proc.poll() is not None and not has_metadata:
            break
        time.sleep(0.02)
    assert proc.returncode == 0
    assert sightings > 0 and partial_sightings == 0


@pytest.mark.slow
def test_truncated_chunk_and_stale_temp_file_are_rewritten_on_resume(source, tmp_path):
    h5, data, _, clean = source
    out = str(tmp_path / "out.ome.zarr")
    env = {**os.environ, "H5NGFF_FAULTS": "slab_sleep=0.05"}
    proc = subprocess.Popen(
        CLI + ["convert", f"{h5}:/volume/data", out] + FLAGS,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    while manifest_lines(out) < 10 and proc.poll() is None:
        time.sleep(0.01)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    # Damage a chunk the manifest vouches for, and leave a temporary file as a killed write would.
    with open(os.path.join(out, ".h5ngff", "manifest.jsonl")) as f:
        record = next(json.loads(line) for line in f if '"slab"' in line)
    level, key, _ = record["units"][0]
    victim = os.path.join(out, str(level), key)
    with open(victim, "r+b") as f:
        f.truncate(os.path.getsize(victim) // 2)
    stale = os.path.join(os.path.dirname(victim), f".{os.path.basename(victim)}{TMP_MARK}deadbeef0000")
    with open(stale, "wb") as f:
        f.write(b"half a chunk")
    result = subprocess.run(
        CLI + ["convert", f"{h5}:/volume/data", out, "--json"] + FLAGS, capture_output=True, text=True, check=True
    )
    summary = json.loads(result.stdout)
    assert summary["resumed"] and summary["slabs_skipped"] >= 9  # the damaged slab was not trusted
    assert not os.path.exists(stale)
    assert chunk_files(out) == chunk_files(clean)
    assert verify_output(out, (h5, "/volume/data")).ok


@pytest.mark.slow
def test_verify_names_the_bad_chunks(source, tmp_path):
    h5, _, _, clean = source
    out = str(tmp_path / "copy.ome.zarr")
    shutil.copytree(clean, out)
    assert verify_output(out, (h5, "/volume/data")).ok
    garbage, missing, wrong = "0/c/0/1/2", "1/c/1/1/1", "0/c/2/3/4"
    with open(os.path.join(out, garbage), "wb") as f:
        f.write(b"\x00" * 40)
    os.unlink(os.path.join(out, missing))
    # A chunk that decodes fine but holds another chunk's data: only the source comparison sees it.
    shutil.copy(os.path.join(out, "0/c/2/3/5"), os.path.join(out, wrong))
    report = verify_output(out, (h5, "/volume/data"))
    assert not report.ok
    assert set(report.bad_units) == {(0, "c/0/1/2"), (1, "c/1/1/1"), (0, "c/2/3/4")}
    cli = subprocess.run(CLI + ["verify", out, "--source", f"{h5}:/volume/data"], capture_output=True, text=True)
    assert cli.returncode == 1 and "c/0/1/2" in cli.stdout and "differs from the source" in cli.stdout
    assert subprocess.run(CLI + ["verify", clean], capture_output=True).returncode == 0


def test_unaligned_writes_are_refused(tmp_path):
    layout = ArrayLayout(str(tmp_path / "0"), (16, 64), (8, 32), None, "<u2", 3, CompressorSpec(), 0)
    with pytest.raises(UnalignedWriteError, match="covers part of a"):
        write_block(layout, np.zeros((8, 40), dtype="<u2"), (0, 0))  # ends mid-chunk
    with pytest.raises(UnalignedWriteError):
        write_block(layout, np.zeros((8, 32), dtype="<u2"), (4, 0))  # starts mid-chunk
    assert write_block(layout, np.zeros((16, 64), dtype="<u2"), (0, 0))  # whole chunks are fine


def test_positive_control_two_writers_on_a_chunk_lose_data(tmp_path, monkeypatch):
    """With the alignment guard bypassed, two slabs splitting a chunk each write it whole (their
    half plus fill values): whichever lands last erases the other's data. This is the corruption
    the planner's alignment and the guard exist to prevent."""
    from h5ngff.engine.write import chunkio

    monkeypatch.setattr(chunkio, "check_alignment", lambda layout, region: None)
    data = np.arange(8 * 32, dtype="<u2").reshape(8, 32) + 1
    zarr.create_array(str(tmp_path / "0"), shape=(8, 32), chunks=(8, 32), dtype="<u2", fill_value=0, compressors=None)
    layout = ArrayLayout(str(tmp_path / "0"), (8, 32), (8, 32), None, "<u2", 3, CompressorSpec(codec="none"), 0)
    first_half, second_half = data[:, :16], data[:, 16:]
    threads = [
        threading.Thread(target=write_block, args=(layout, first_half, (0, 0))),
        threading.Thread(target=write_block, args=(layout, second_half, (0, 16))),
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    stored = zarr.open_array(str(tmp_path / "0"), mode="r")[...]
    assert not np.array_equal(stored, data)
    assert (stored == 0).sum() == data.size // 2  # one writer's half is gone, replaced by fill


@pytest.fixture
def small_disk(tmp_path):
    """A 6 MiB tmpfs made by the test (needs root)."""
    mount = tmp_path / "disk"
    mount.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=6m", "tmpfs", str(mount)], capture_output=True).returncode:
        pytest.skip("cannot mount a tmpfs here (needs root)")
    yield mount
    subprocess.run(["umount", "-l", str(mount)], check=False)


@pytest.mark.slow
def test_disk_full_fails_clearly_and_resumes_after_space_is_freed(source, small_disk):
    h5, data, _, clean = source
    out = str(small_disk / "out.ome.zarr")
    spec = spec_for(
        h5,
        out,
        output={"chunks": [8, 32, 32], "compressor": {"codec": "none"}},
        pyramid={"levels": 2},
        resources={"workers": 2, "slab": [16, 64, 256]},
    )
    backend = LocalBackend()
    with pytest.raises(DiskFullError, match="No space left on the output device"):
        run_job(plan_job(spec, backend), backend)
    assert completion_marker(out) is None
    subprocess.run(["mount", "-o", "remount,size=64m", str(small_disk)], check=True)
    summary = run_job(plan_job(spec, backend), backend)
    assert summary.status == "Succeeded" and summary.resumed
    np.testing.assert_array_equal(zarr.open_array(out + "/0", mode="r")[...], data)
    assert verify_output(out, (h5, "/volume/data")).ok


@pytest.mark.slow
def test_huge_sparse_dataset_stays_within_its_plan(tmp_path):
    """1 GiB of logical data in a file of a few KiB (no chunk ever written: all fill value).
    Memory follows the plan, not the logical size."""
    import h5py

    path = tmp_path / "sparse.h5"
    with h5py.File(path, "w") as f:
        f.create_dataset("/volume/data", shape=(128, 2048, 4096), dtype="uint8", chunks=(64, 256, 256), fillvalue=7)
    assert os.path.getsize(path) < 100_000
    out = str(tmp_path / "out.ome.zarr")
    spec = spec_for(
        str(path),
        out,
        output={"chunks": [64, 256, 256]},
        pyramid={"levels": 1},
        resources={"workers": 2, "memoryPerWorker": "400Mi"},
    )
    from h5ngff.backends.cgroups import cgroups_available

    backend = (
        LocalPodsBackend() if cgroups_available() is None else LocalBackend()
    )  # pod limits where the machine has them
    job = plan_job(spec, backend)
    summary = run_job(job, backend)
    for w in summary.workers:
        assert w.peak_rss <= job.plan.memory.predicted_peak
        assert w.oom_kills == 0
    level0 = zarr.open_array(out + "/0", mode="r")
    assert level0.shape == (128, 2048, 4096) and int(level0[5, 1000, 4000]) == 7


@pytest.mark.slow
def test_names_from_input_cannot_escape_the_output(tmp_path, convert):
    """Dataset paths and image names come from users and files; only level numbers and chunk
    indices ever become file names, so nothing is written outside the output directory."""
    data = smooth((4, 16, 16))
    h5 = write_h5(tmp_path / "in.h5", data, dataset="/b/data")
    out = tmp_path / "nested" / "out.ome.zarr"
    before = set(os.listdir(tmp_path))
    convert(spec_for(h5, str(out), dataset="/b/data", image={"name": "../../../escape"}, pyramid={"levels": 1}))
    assert set(os.listdir(tmp_path)) == before | {"nested"}
    assert set(os.listdir(tmp_path / "nested")) == {"out.ome.zarr"}
    for directory, _, _files in os.walk(out):
        assert os.path.realpath(directory).startswith(os.path.realpath(out))
    attrs = zarr.open_group(str(out), mode="r").attrs.asdict()
    assert attrs["ome"]["multiscales"][0]["name"] == "../../../escape"  # kept as metadata text only


@pytest.mark.slow
@requires_cgroups
@pytest.mark.cgroup
def test_a_killed_pod_is_restarted_and_the_run_completes(source, tmp_path, monkeypatch):
    """The kernel can OOM-kill a pod's nanny together with its worker. As kubelet restarts the
    container, pod emulation restarts the pod; the slab reruns and the output is exact."""
    h5, _, _, clean = source
    out = str(tmp_path / "out.ome.zarr")
    monkeypatch.setenv("H5NGFF_FAULTS", "slab_sleep=0.15")
    spec = spec_for(
        h5, out, output={"chunks": [8, 32, 32]}, pyramid={"levels": 2}, resources={"workers": 2, "slab": [16, 64, 256]}
    )
    backend = LocalPodsBackend()
    killed: list[int] = []

    def kill_a_nanny(progress):
        if not killed and progress.slabs_done >= progress.slabs_total // 3:
            nanny = next(
                p for p in psutil.Process().children() if "distributed.cli.dask_worker" in " ".join(p.cmdline())
            )
            killed.append(nanny.pid)
            os.killpg(nanny.pid, signal.SIGKILL)  # the nanny and its worker, as a pod OOM kill can

    summary = run_job(plan_job(spec, backend), backend, [kill_a_nanny])
    assert killed and summary.status == "Succeeded"
    assert sum(w.pod_restarts for w in summary.workers) >= 1
    # The restarted pod's new processes are the same pod, not a third worker.
    assert [w.name for w in summary.workers] == ["pod-0", "pod-1"] and all(
        w.pod_nonreclaimable_peak for w in summary.workers
    )
    assert chunk_files(out) == chunk_files(clean)


@pytest.mark.slow
def test_losing_every_worker_fails_the_run_instead_of_hanging(source, tmp_path, monkeypatch):
    """An existing cluster whose workers all go away: after the watchdog's timeout the run fails
    with WorkersLost, it does not wait forever."""
    import logging

    from distributed import LocalCluster

    from h5ngff.backends.external import ExternalBackend
    from h5ngff.engine.write import driver
    from h5ngff.errors import WorkersLostError

    monkeypatch.setattr(driver, "NO_WORKERS_TIMEOUT", 3.0)
    monkeypatch.setenv("H5NGFF_FAULTS", "slab_sleep=0.3")
    h5, _, _, _ = source
    with LocalCluster(n_workers=2, threads_per_worker=1, dashboard_address=":0", silence_logs=logging.ERROR) as cluster:
        backend = ExternalBackend(cluster.scheduler_address)
        job = plan_job(
            spec_for(
                h5,
                str(tmp_path / "out.ome.zarr"),
                output={"chunks": [8, 32, 32]},
                pyramid={"levels": 1},
                resources={"slab": [16, 64, 256]},
            ),
            backend,
        )
        gone: list[bool] = []

        def remove_all_workers(progress):
            if not gone and progress.slabs_done >= 2:
                gone.append(True)
                cluster.scale(0)

        started = time.time()
        with pytest.raises(WorkersLostError, match="No Dask worker for 3 s"):
            run_job(job, backend, [remove_all_workers])
        assert time.time() - started < 60
