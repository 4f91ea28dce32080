"""The SLURM backend: the job script carries the plan (pure, no cluster), and on a real single-node
SLURM (scripts/slurm-local, memory enforced by task/cgroup) conversions match the local backend
byte for byte, stay under the plan, fail OOMKilled when the job's --mem is forced below it, and
leave no job behind when the client is killed."""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
from conftest import smooth, spec_for, write_h5
from slurm_local import slurm_cluster, squeue  # noqa: F401  (session fixture)

from h5ngff.backends.local import LocalBackend
from h5ngff.backends.slurm import SlurmBackend
from h5ngff.backends.slurmctl import oom_events, parse_scontrol_job
from h5ngff.backends.slurmscript import job_mem_mib
from h5ngff.cli import main
from h5ngff.engine.verify.check import verify_output
from h5ngff.errors import (
    ClusterError,
    OOMKilledError,
    SpecError,
    WorkersLostError,
    WorkersPendingError,
)
from h5ngff.jobspec import parse_job_spec
from h5ngff.runner import plan_job, run_job
from h5ngff.spec import SlurmSpec
from h5ngff.units import MiB

pytestmark = pytest.mark.integration

CLI = [sys.executable, "-m", "h5ngff.cli"]


def chunk_files(root: str) -> dict[str, bytes]:
    """Every chunk and array metadata file of the output, by relative path (not h5ngff's own
    bookkeeping, nor the root's attributes, which carry the run's summary and times)."""
    out = {}
    for directory, _, names in os.walk(root):
        if ".h5ngff" in directory:
            continue
        for name in names:
            if directory == root and name == "zarr.json":
                continue
            path = os.path.join(directory, name)
            with open(path, "rb") as f:
                out[os.path.relpath(path, root)] = f.read()
    return out


def ome(root: str) -> dict:
    with open(os.path.join(root, "zarr.json")) as f:
        return json.load(f)["attributes"]["ome"]


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    base = tmp_path_factory.mktemp("slurm")
    return write_h5(base / "in.h5", smooth((32, 192, 160), "uint16", seed=3)), base


# --- the job script (pure) --------------------------------------------------------------------


def test_job_script_is_the_plan(small):
    h5, base = small
    backend = SlurmBackend(
        SlurmSpec(
            partition="short",
            account="lab",
            qos="normal",
            directives=["--constraint=avx2"],
            prologue=["module load hdf5"],
        )
    )
    job = plan_job(spec_for(h5, str(base / "p.ome.zarr"), resources={"workers": 3, "threadsPerWorker": 2}), backend)
    plan, script = job.plan, backend.job_script(job.plan)
    text = script.text()
    # --mem is the pod limit, term by term, and nothing the user wrote can change it
    assert sum(t.bytes for t in script.mem_terms) <= plan.memory.pod_limit == script.mem_bytes
    assert [t.name for t in script.mem_terms] == ["dask terminate threshold", "nanny", "page cache and overshoot room"]
    assert f"#SBATCH --mem={plan.memory.pod_limit // MiB}M" in script.header
    assert "#SBATCH --cpus-per-task=2" in script.header and "#SBATCH -n 1" in script.header
    for line in (
        "#SBATCH -p short",
        "#SBATCH -A lab",
        "#SBATCH --qos=normal",
        "#SBATCH --constraint=avx2",
        "#SBATCH -t 01:00:00",
    ):
        assert line in script.header
    assert f"--memory-limit {plan.memory.memory_limit} " in script.command and "--nthreads 2 " in script.command
    assert "export DASK_DISTRIBUTED__WORKER__MEMORY__TERMINATE=0.95" in text
    assert "export DASK_DISTRIBUTED__WORKER__MEMORY__PAUSE=False" in text
    assert text.index("module load hdf5") < text.index("exec ")
    assert ('LD_PRELOAD="$H5NGFF_JEMALLOC"' in text) == (plan.allocator == "jemalloc")
    assert plan.workers == 3


def test_negative_control_an_override_changes_mem_and_says_so(small):
    h5, base = small
    spec = spec_for(h5, str(base / "p.ome.zarr"), resources={"workers": 1, "allocator": "glibc"})
    planned = SlurmBackend()
    plan = plan_job(spec, planned).plan
    forced = SlurmBackend(job_mem=100 * MiB)
    script = forced.job_script(plan)
    assert "#SBATCH --mem=100M" in script.header and f"{plan.memory.pod_limit // MiB}M" in script.mem_override
    assert "#SBATCH --mem=100M" not in planned.job_script(plan).header
    assert "LD_PRELOAD=''" in script.text() and "libjemalloc" not in script.text()  # a glibc plan preloads nothing


@pytest.mark.parametrize("directive", ["--mem=1G", "--cpus-per-task=8", "-c 4", "#SBATCH --ntasks=2"])
def test_directives_cannot_override_what_the_plan_sets(directive):
    with pytest.raises(SpecError, match="slurm.directives.*the plan sets"):
        parse_job_spec(
            {"source": {"path": "a.h5", "dataset": "/d"}, "output": {"path": "o"}, "slurm": {"directives": [directive]}}
        )
    parse_job_spec(
        {
            "source": {"path": "a.h5", "dataset": "/d"},
            "output": {"path": "o"},
            "slurm": {"directives": ["--constraint=x"]},
        }
    )


def test_plan_cli_shows_the_job_script(small, capsys):
    h5, base = small
    assert (
        main(
            ["plan", f"{h5}:/volume/data", "--backend", "slurm", "--workers", "2", "--slurm-partition", "gpu", "--json"]
        )
        == 0
    )
    doc = json.loads(capsys.readouterr().out)
    pod_limit = doc["plan"]["memory"]["pod_limit"]
    assert doc["slurm"]["mem_bytes"] == job_mem_mib(pod_limit) * MiB
    assert (
        f"#SBATCH --mem={job_mem_mib(pod_limit)}M" in doc["slurm"]["script"]
        and "#SBATCH -p gpu" in doc["slurm"]["script"]
    )
    assert main(["plan", f"{h5}:/volume/data", "--backend", "slurm", "--workers", "2"]) == 0
    table = capsys.readouterr().out
    assert "#SBATCH --mem" in table and "+ nanny" in table and "exec " in table
    # a manifest's slurm: block reaches the job script, and flags override it
    manifest = base / "job.yaml"
    manifest.write_text(
        json.dumps(
            {
                "apiVersion": "h5ngff.dev/v1alpha1",
                "kind": "ConversionJob",
                "metadata": {"name": "j"},
                "spec": {
                    "source": {"path": h5, "dataset": "/volume/data"},
                    "output": {"path": str(base / "j.ome.zarr")},
                    "slurm": {"partition": "long", "qos": "big", "walltime": "2-00:00:00"},
                },
            }
        )
    )
    assert main(["plan", str(manifest), "--backend", "slurm", "--slurm-qos", "small", "--json"]) == 0
    header = json.loads(capsys.readouterr().out)["slurm"]["header"]
    assert {"#SBATCH -p long", "#SBATCH --qos=small", "#SBATCH -t 2-00:00:00"} <= set(header)


def test_scontrol_and_err_readings():
    line = (
        "JobId=42 JobName=h5ngff-x UserId=root(0) JobState=PENDING Reason=QOSMaxMemoryPerJob Dependency=(null) "
        "ExitCode=0:0 MinMemoryNode=244M"
    )
    state = parse_scontrol_job(line)
    assert (state.job_id, state.state, state.reason, state.mem, state.finished) == (
        "42",
        "PENDING",
        "QOSMaxMemoryPerJob",
        "244M",
        False,
    )
    assert parse_scontrol_job("slurm_load_jobs error: Invalid job id specified") is None
    assert (
        oom_events("slurmstepd-vm: error: Detected 3 oom-kill event(s) in StepId=8.batch. Some of your processes") == 3
    )
    assert oom_events("2026 distributed.nanny - INFO - Worker process 5884 was killed by signal 9") == 0


def hold_the_gil(seconds: int, started: str) -> None:
    """A task that holds the GIL, as a C extension that never releases it does: ctypes' PyDLL
    keeps the GIL across the foreign call, so the worker's event loop cannot answer meanwhile."""
    import ctypes

    open(started, "w").close()
    ctypes.PyDLL(None).sleep(seconds)


@pytest.mark.slow
def test_the_run_does_not_wait_on_a_worker_that_holds_the_gil(tmp_path, monkeypatch):
    """A SLURM run's end reads each job's cgroup through its worker, and every run polls its
    workers' memory every 0.5 s; one worker stuck in a GIL-holding task once held a run's end for
    about 250 s. A real worker stuck that way; each wait bounded (at 1 s here)."""
    from distributed import Client, LocalCluster

    import h5ngff.metrics.probes as probes
    from h5ngff.backends.base import Session
    from h5ngff.backends.slurm import job_cgroup_figures, running_job_figures

    monkeypatch.setattr(probes, "POLL_TIMEOUT", 1.0)
    started = tmp_path / "started"
    with (
        LocalCluster(n_workers=1, threads_per_worker=1, dashboard_address=":0", processes=True) as cluster,
        Client(cluster) as client,
    ):
        # The plan only sizes the pod limit, which the session gives here.
        poller = probes.ClusterPoller(Session(client, "external", pod_limit=1 << 30), plan=None)  # type: ignore[arg-type]
        assert running_job_figures(client)  # an idle worker answers (no SLURM job here: its name alone)
        assert poller.poll().workers  # and the poll sees it
        stuck = client.submit(hold_the_gil, 15, str(started), pure=False)  # past the 6 s of waits below, with room
        while not started.exists():
            time.sleep(0.05)
        t0 = time.monotonic()
        assert running_job_figures(client, timeout=1) == {}
        assert time.monotonic() - t0 < 5
        t0 = time.monotonic()
        with pytest.raises(TimeoutError):
            poller.poll()
        assert time.monotonic() - t0 < 5
        # Negative control: Dask's own call waits for as long as the worker is stuck.
        unbounded = threading.Thread(target=client.run, args=(job_cgroup_figures,), daemon=True)
        unbounded.start()
        unbounded.join(4)
        assert unbounded.is_alive()
        stuck.result()
        unbounded.join(30)


# --- a real SLURM -----------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.usefixtures("slurm_cluster")
def test_negative_control_job_mem_below_the_plan_is_oom_killed(tmp_path):
    # One 192 MiB slab in a job forced to 256 MiB. Dask caps the worker's memory_limit at the
    # job's RLIMIT_RSS (SLURM sets it from --mem), so its nanny would terminate the worker at 95 %
    # of 256 MiB of RSS, and which of the two acts first is a race (CI saw the nanny win). This
    # control is about the kernel: the nanny's terminate is switched off for it, so the job's
    # cgroup is the only thing that can stop the worker, and it must.
    data = np.broadcast_to(np.arange(1024, dtype=np.uint16)[None, None, :], (96, 1024, 1024))
    h5 = write_h5(tmp_path / "big.h5", np.ascontiguousarray(data))
    spec = spec_for(
        h5, str(tmp_path / "neg.ome.zarr"), resources={"workers": 1, "slab": [96, 1024, 1024]}, pyramid={"levels": 1}
    )
    logs = tmp_path / "logs"
    backend = SlurmBackend(SlurmSpec(logDirectory=str(logs), pendingTimeout=120), job_mem=256 * MiB)
    job = plan_job(spec, backend)
    assert job.plan.memory.pod_limit > 256 * MiB + 150 * MiB  # the override really is far below the plan
    memory = job.plan.memory
    no_terminate = dataclasses.replace(memory.thresholds, terminate=False)
    job = dataclasses.replace(
        job, plan=dataclasses.replace(job.plan, memory=dataclasses.replace(memory, thresholds=no_terminate))
    )
    with pytest.raises(OOMKilledError) as info:
        run_job(job, backend)
    err = info.value
    assert err.reason == "OOMKilled" and "job --mem 256 MiB" in str(err) and "below the plan" in str(err)
    (worker,) = err.summary.workers
    assert (
        worker.oom_kills >= 1
        and worker.pod_limit == 256 * MiB
        and worker.predicted_peak == job.plan.memory.predicted_peak
    )
    assert "slurm-0:" in str(err) and "peak RSS" in str(err)
    err_text = "".join(p.read_text() for p in logs.glob("*.err"))
    assert oom_events(err_text) >= 1, "slurmstepd did not report the kill"
    assert not squeue(), "a job of the run is still queued"


@pytest.mark.slow
@pytest.mark.usefixtures("slurm_cluster")
def test_killed_client_leaves_no_job_and_the_resumed_output_is_local_byte_for_byte(small, tmp_path):
    """Kill the client (SIGKILL, no cleanup) mid-run: its jobs leave the queue. Re-running on SLURM
    resumes, every worker stays under the plan in a job cgroup limited to the plan, and the output
    is byte-identical to the local backend's and verifies against the source."""
    h5, _ = small
    out = tmp_path / "slurm.ome.zarr"
    resources = {"workers": 2, "threadsPerWorker": 1, "slab": [8, 192, 160]}
    flags = ["--chunks", "8,64,64", "--slab", "8,192,160", "--levels", "2", "--workers", "2"]
    args = [
        f"{h5}:/volume/data",
        str(out),
        *flags,
        "--backend",
        "slurm",
        "--slurm-log-dir",
        str(tmp_path / "logs"),
        "--no-progress",
    ]
    env = {**os.environ, "H5NGFF_FAULTS": "slab_sleep=1.0"}
    proc = subprocess.Popen(
        CLI + ["convert", *args], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True
    )
    manifest = out / ".h5ngff" / "manifest.jsonl"
    deadline = time.monotonic() + 60
    while not (manifest.exists() and '"slab"' in manifest.read_text()):
        assert proc.poll() is None and time.monotonic() < deadline, "the run ended or never wrote a slab"
        time.sleep(0.1)
    assert squeue(), "no worker job was running when the client was killed"
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    deadline = time.monotonic() + 20
    while squeue() and time.monotonic() < deadline:
        time.sleep(0.25)
    assert not squeue(), "worker jobs outlived the killed client"

    spec = {"resources": resources, "output": {"chunks": [8, 64, 64]}, "pyramid": {"levels": 2}}
    backend = SlurmBackend(SlurmSpec(logDirectory=str(tmp_path / "logs"), pendingTimeout=120))
    job = plan_job(spec_for(h5, str(out), **spec), backend)
    summary = run_job(job, backend)
    assert summary.status == "Succeeded" and summary.resumed and summary.totals.slabs_skipped >= 1
    assert summary.totals.slabs_written + summary.totals.slabs_skipped == job.plan.n_tasks
    plan = job.plan
    assert [w.name for w in summary.workers] == ["slurm-0", "slurm-1"]
    for w in summary.workers:
        assert 0 < w.peak_rss <= plan.memory.predicted_peak, (
            f"{w.name}: {w.peak_rss >> 20} MiB > predicted {plan.memory.predicted_peak >> 20} MiB"
        )
        # the limit SLURM put on the job's cgroup, read from inside the job, is the plan's
        assert w.pod_limit == plan.memory.pod_limit
        assert w.cgroup_peak is not None and 0 < w.cgroup_peak <= plan.memory.pod_limit
        assert w.oom_kills == 0
    assert not squeue(), "a job of the run is still queued"

    local = run_job(plan_job(spec_for(h5, str(tmp_path / "local.ome.zarr"), **spec), LocalBackend()), LocalBackend())
    assert local.status == "Succeeded"
    assert chunk_files(str(out)) == chunk_files(str(tmp_path / "local.ome.zarr"))
    assert ome(str(out))["multiscales"] == ome(str(tmp_path / "local.ome.zarr"))["multiscales"]
    report = verify_output(str(out), (h5, "/volume/data"))
    assert report.ok and report.compared_with_source and report.levels_compared == 2, report.problems


@pytest.mark.slow
@pytest.mark.usefixtures("slurm_cluster")
def test_jobs_pending_past_the_timeout_fail_with_slurms_reason(small, tmp_path):
    h5, _ = small
    # --begin keeps the job pending (Reason=BeginTime) whatever else the node runs.
    backend = SlurmBackend(
        SlurmSpec(logDirectory=str(tmp_path / "logs"), pendingTimeout=3, directives=["--begin=now+1hour"])
    )
    job = plan_job(spec_for(h5, str(tmp_path / "p.ome.zarr"), resources={"workers": 1}), backend)
    start = time.monotonic()
    with pytest.raises(WorkersPendingError) as info:
        run_job(job, backend)
    # A pending job named in a signal makes scancel retry for 30 s; the stop cancels it instead.
    assert time.monotonic() - start < 20, "the pending job held up the stop"
    assert info.value.reason == "WorkersPending" and "BeginTime" in str(info.value)
    assert f"--mem={job.plan.memory.pod_limit // MiB}M" in str(info.value)
    assert not squeue(), "the pending job was left queued"


@pytest.mark.slow
@pytest.mark.usefixtures("slurm_cluster")
def test_a_job_script_slurm_refuses_fails_before_anything_is_submitted(small, tmp_path):
    h5, _ = small
    backend = SlurmBackend(SlurmSpec(logDirectory=str(tmp_path / "logs"), partition="no-such-partition"))
    job = plan_job(spec_for(h5, str(tmp_path / "r.ome.zarr"), resources={"workers": 1}), backend)
    with pytest.raises(ClusterError, match="invalid partition"):
        run_job(job, backend)
    assert not squeue()


def _semaphores() -> set[str]:
    """multiprocessing's named semaphores in this node's shared memory."""
    return {name for name in os.listdir("/dev/shm") if name.startswith("sem.mp-")}


class _JobSemaphores:
    """The named semaphores the SLURM jobs' processes hold, seen in their memory maps while the
    run runs (every 50 ms): what a run left behind is what it held and is still there, never a
    name another process made in /dev/shm meanwhile (a before-and-after difference counted those,
    and failed under load, issue 42). A process is a job's when its environment has SLURM_JOB_ID
    (this test's are the only jobs on the node's fixture while it runs)."""

    def __init__(self) -> None:
        self.held: set[str] = set()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)

    def __enter__(self) -> "_JobSemaphores":
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def left(self) -> set[str]:
        return self.held & _semaphores()

    def _watch(self) -> None:
        while not self._stop.is_set():
            for pid in (p for p in os.listdir("/proc") if p.isdigit()):
                try:
                    with open(f"/proc/{pid}/environ", "rb") as f:
                        if b"SLURM_JOB_ID=" not in f.read():
                            continue
                    with open(f"/proc/{pid}/maps") as f:
                        maps = f.read()
                except OSError:  # gone, or not ours to read
                    continue
                self.held.update(
                    os.path.basename(line.split()[-1]) for line in maps.splitlines() if "/dev/shm/sem.mp-" in line
                )
            self._stop.wait(0.05)


def _remove_semaphores(names: set[str]) -> None:
    """A negative control's leftovers are its test's to remove."""
    for name in names:
        os.unlink(os.path.join("/dev/shm", name))


@pytest.mark.slow
@pytest.mark.usefixtures("slurm_cluster")
def test_a_finished_run_leaves_no_semaphore_in_the_nodes_shared_memory(small, tmp_path, monkeypatch):
    """Each nanny hands its worker queues backed by named semaphores in /dev/shm, which it unlinks
    when it closes. The run's jobs are stopped with SIGTERM to each nanny first, not SIGKILL
    alone, which left 6 names per worker on the node until its next reboot."""
    h5, _ = small
    backend = SlurmBackend(SlurmSpec(logDirectory=str(tmp_path / "logs"), pendingTimeout=120))

    def run(name: str) -> set[str]:
        job = plan_job(spec_for(h5, str(tmp_path / f"{name}.ome.zarr"), resources={"workers": 2}), backend)
        with _JobSemaphores() as watched:
            run_job(job, backend)
        assert not squeue(), "a job of the run is still queued"
        assert watched.held, "no semaphore of the jobs was seen: the watch shows nothing"
        return watched.left()

    left = run("stopped")
    assert not left, f"the run left {sorted(left)} in /dev/shm"
    # Negative control: SIGKILL alone, as before, leaves each worker's semaphores behind.
    import h5ngff.backends.slurm as slurm_backend
    from h5ngff.backends.slurmctl import cancel_by_name

    monkeypatch.setattr(slurm_backend, "stop_by_name", lambda job_name: cancel_by_name(job_name, kill=True))
    left = run("killed")
    _remove_semaphores(left)
    assert len(left) >= 2 * 6, f"SIGKILL alone left only {sorted(left)}: the control shows nothing"


@pytest.mark.slow
@pytest.mark.usefixtures("slurm_cluster")
def test_a_run_stopped_with_slabs_in_flight_leaves_no_semaphore(small, tmp_path, monkeypatch):
    """A Ctrl-C or a failure stops the jobs while their workers still run slabs. The nanny, told
    to stop, waits 8 s for its busy worker before it terminates it; SIGKILL any earlier takes the
    nanny before it unlinks its semaphores (6 per worker, 12 here, as this test measured with a
    5 s grace). The stop gives it that time, and only then kills."""
    import h5ngff.runner as runner_module

    h5, _ = small
    backend = SlurmBackend(SlurmSpec(logDirectory=str(tmp_path / "logs"), pendingTimeout=120))

    class Stopped(Exception):
        pass

    def busy_then_stopped(client, *args, **kwargs):
        futures = client.map(time.sleep, [60.0, 60.0], pure=False)  # a slab each, for a minute
        deadline = time.monotonic() + 30
        while len([t for ts in client.processing().values() for t in ts]) < 2 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert futures and len([t for ts in client.processing().values() for t in ts]) == 2
        raise Stopped  # as a Ctrl-C or a failed slab would, with both workers busy

    monkeypatch.setattr(runner_module, "run_conversion", busy_then_stopped)

    def stopped_run(name: str) -> tuple[set[str], float]:
        job = plan_job(spec_for(h5, str(tmp_path / f"{name}.ome.zarr"), resources={"workers": 2}), backend)
        start = time.monotonic()
        with _JobSemaphores() as watched, pytest.raises(Stopped):
            run_job(job, backend)
        assert not squeue(), "a job of the run is still queued"
        assert watched.held, "no semaphore of the jobs was seen: the watch shows nothing"
        return watched.left(), time.monotonic() - start

    left, took = stopped_run("busy")
    assert not left, f"the run left {sorted(left)} in /dev/shm"
    assert took < 30, f"the stop took {took:.1f} s"  # 11 s measured: the nanny's 8 s, then the close
    # Negative control: SIGKILL before the nanny's 8 s are up leaves the busy workers' semaphores.
    from h5ngff.backends import slurmctl

    monkeypatch.setattr(slurmctl, "STOP_GRACE", 3.0)
    left, _ = stopped_run("killed")
    _remove_semaphores(left)
    assert len(left) >= 6, f"SIGKILL after 3 s left only {sorted(left)}: the control shows nothing"


@pytest.mark.slow
@pytest.mark.usefixtures("slurm_cluster")
def test_a_job_cancelled_under_the_run_is_workers_lost(small, tmp_path):
    h5, _ = small
    backend = SlurmBackend(
        SlurmSpec(logDirectory=str(tmp_path / "logs"), pendingTimeout=60, directives=["--begin=now+1hour"])
    )
    job = plan_job(spec_for(h5, str(tmp_path / "c.ome.zarr"), resources={"workers": 1}), backend)

    def cancel_when_queued():  # as an admin (or a preemption) would
        deadline = time.monotonic() + 30
        while not squeue() and time.monotonic() < deadline:
            time.sleep(0.2)
        subprocess.run(["scancel", *squeue()], check=False)

    threading.Thread(target=cancel_when_queued, daemon=True).start()
    start = time.monotonic()
    with pytest.raises(WorkersLostError, match="cancelled"):
        run_job(job, backend)
    assert time.monotonic() - start < 30, "the cancelled job was not noticed before the pending timeout"


@pytest.mark.slow
@pytest.mark.usefixtures("slurm_cluster")
def test_ctrl_c_exits_130_and_cancels_the_jobs(small, tmp_path):
    h5, _ = small
    args = [
        f"{h5}:/volume/data",
        str(tmp_path / "i.ome.zarr"),
        "--workers",
        "1",
        "--backend",
        "slurm",
        "--slurm-directive=--begin=now+1hour",
        "--slurm-log-dir",
        str(tmp_path / "logs"),
        "--no-progress",
    ]
    proc = subprocess.Popen(
        CLI + ["convert", *args], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, start_new_session=True
    )
    deadline = time.monotonic() + 60
    while not squeue():
        assert proc.poll() is None and time.monotonic() < deadline, "no job was submitted"
        time.sleep(0.1)
    os.killpg(proc.pid, signal.SIGINT)  # what a terminal's Ctrl-C does
    _, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 130, stderr[-2000:]
    assert "interrupted" in stderr and not squeue()


@pytest.mark.slow
def test_negative_control_dask_jobqueue_alone_takes_over_ctrl_c():
    """Importing dask_jobqueue replaces SIGINT's handler with sys.exit(): a Ctrl-C exited 0 with
    the jobs left running. The backend imports it through _import_jobqueue, which restores it."""
    probe = (
        "import signal, sys; {}; sys.exit(0 if signal.getsignal(signal.SIGINT) is signal.default_int_handler else 1)"
    )
    plain = subprocess.run([sys.executable, "-c", probe.format("import dask_jobqueue")], check=False)
    ours = subprocess.run(
        [sys.executable, "-c", probe.format("from h5ngff.backends.slurm import _import_jobqueue; _import_jobqueue()")],
        check=False,
    )
    assert (plain.returncode, ours.returncode) == (1, 0)
