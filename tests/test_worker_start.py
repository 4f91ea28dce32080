"""The embedded cluster's workers are forked from one fork server (backends/forkserver.py): they
carry the plan's allocator with its background threads, a changed environment starts a new
server, and H5NGFF_WORKER_START=spawn goes back to Dask's spawn."""

from __future__ import annotations

import contextlib
import json
import multiprocessing
import multiprocessing.forkserver as mp_forkserver
import os
import subprocess
import sys
import time

import h5py
import numpy as np
import psutil
import pytest

from h5ngff.backends import forkserver, local
from h5ngff.backends.allocator import allocator_env, jemalloc_path
from h5ngff.backends.local import LocalBackend
from h5ngff.runner import plan_job
from h5ngff.spec import parse_spec

needs_jemalloc = pytest.mark.skipif(jemalloc_path() is None, reason="libjemalloc is not installed")


def _worker_facts() -> dict:
    """Run on a worker: its parent, its allocator and its threads."""
    with open("/proc/self/maps") as f:
        maps = f.read()
    names = [open(f"/proc/self/task/{t}/comm").read().strip() for t in os.listdir("/proc/self/task")]
    return {
        "ppid": os.getppid(),
        "jemalloc": "jemalloc" in maps,
        "background_threads": names.count("jemalloc_bg_thd"),
        "mark": os.environ.get("H5NGFF_TEST_MARK"),
    }


def _facts(tmp_path, allocator: str = "auto") -> list[dict]:
    source = tmp_path / "in.h5"
    if not source.exists():
        with h5py.File(source, "w") as f:
            f["d"] = np.zeros((8, 64, 64), np.uint16)
    spec = parse_spec(
        {
            "source": {"path": str(source), "dataset": "/d"},
            "output": {"path": str(tmp_path / "out.ome.zarr")},
            "resources": {"workers": 2, "allocator": allocator},
        }
    )
    backend = LocalBackend()
    with backend.session(plan_job(spec, backend).plan) as session:
        return list(session.client.run(_worker_facts).values())


def _background_threads_of_a_plain_fork() -> int:
    """A process forked from the same server without h5ngff's worker main module."""
    child = multiprocessing.get_context("forkserver").Process(target=time.sleep, args=(5,))
    child.start()
    try:
        most = 0
        deadline = time.monotonic() + 3  # its start-up and part of its sleep
        while time.monotonic() < deadline:
            names = [
                open(f"/proc/{child.pid}/task/{t}/comm").read().strip() for t in os.listdir(f"/proc/{child.pid}/task")
            ]
            most = max(most, names.count("jemalloc_bg_thd"))
            time.sleep(0.1)
        assert child.is_alive()
        with open(f"/proc/{child.pid}/maps") as f:
            assert "jemalloc" in f.read()  # a fork of the server, which has jemalloc loaded
        return most
    finally:
        child.terminate()
        child.join()


@pytest.mark.slow
@needs_jemalloc
def test_workers_are_forked_from_one_server_with_jemalloc_and_its_background_threads(tmp_path):
    facts = _facts(tmp_path, "jemalloc")
    (server,) = {f["ppid"] for f in facts}
    assert server != os.getpid()  # not spawned by the nannies in this process: forked by the server
    assert all(f["jemalloc"] and f["background_threads"] >= 1 for f in facts), facts
    with open(f"/proc/{server}/maps") as f:  # the server preloaded the engine: HDF5 is loaded in it
        assert "libhdf5" in f.read(), "the engine (h5py) is not preloaded in the fork server"
    # Negative control: jemalloc stops its background threads in a forked child; without the
    # worker main module's restart, a fork of the same server has none.
    assert _background_threads_of_a_plain_fork() == 0


@pytest.mark.slow
@needs_jemalloc
def test_a_changed_environment_starts_a_new_server(tmp_path, monkeypatch):
    first = _facts(tmp_path, "jemalloc")
    monkeypatch.setenv("H5NGFF_TEST_MARK", "set after the first cluster")
    second = _facts(tmp_path, "jemalloc")
    assert {f["mark"] for f in second} == {"set after the first cluster"}
    assert {f["ppid"] for f in first}.isdisjoint(f["ppid"] for f in second)
    glibc = _facts(tmp_path, "glibc")  # another allocator: the server must not carry jemalloc over
    assert not any(f["jemalloc"] for f in glibc), glibc
    # Negative control: told that nothing changed, the running server forks workers that do not
    # see a variable set since it started.
    monkeypatch.setenv("H5NGFF_TEST_MARK", "set after the glibc cluster")
    started = dict(forkserver._started_with or {})
    monkeypatch.setattr(forkserver, "_started_with", {**started, "H5NGFF_TEST_MARK": "set after the glibc cluster"})
    stale = _facts(tmp_path, "glibc")
    assert {f["mark"] for f in stale} == {"set after the first cluster"}


@pytest.mark.slow
def test_spawn_on_request(tmp_path, monkeypatch):
    monkeypatch.setenv(forkserver.METHOD_VARIABLE, "spawn")
    facts = _facts(tmp_path)
    assert {f["ppid"] for f in facts} == {os.getpid()}  # each worker a child of its nanny, here


@pytest.mark.slow
@needs_jemalloc
@pytest.mark.parametrize("method", ["spawn", "forkserver"])
def test_a_glibc_plan_after_a_jemalloc_one_gets_glibc(tmp_path, monkeypatch, method):
    """Dask's nanny gives the process's own variables precedence over its pre-spawn config and
    leaves its own in os.environ: the local backend sets the plan's for the cluster's life."""
    monkeypatch.setenv(forkserver.METHOD_VARIABLE, method)
    for key in {**allocator_env("jemalloc"), **allocator_env("glibc")}:
        monkeypatch.delenv(key, raising=False)  # and put back as they were, whatever the nanny wrote
    assert all(f["jemalloc"] for f in _facts(tmp_path, "jemalloc"))
    assert not any(f["jemalloc"] for f in _facts(tmp_path, "glibc"))
    assert "MALLOC_CONF" not in os.environ  # jemalloc's variables went with its cluster
    # Negative control: without the plan's variables set for the cluster, the glibc plan's
    # workers start with the jemalloc cluster's LD_PRELOAD.
    monkeypatch.setattr(local, "worker_environment", lambda env: contextlib.nullcontext())
    assert all(f["jemalloc"] for f in _facts(tmp_path, "jemalloc"))
    assert all(f["jemalloc"] for f in _facts(tmp_path, "glibc"))


@pytest.mark.slow
def test_a_fork_server_multiprocessing_lost_track_of_falls_back_to_spawn(tmp_path):
    """An interrupt inside multiprocessing's own stop (a test's timeout did it) leaves the server's
    pid without its descriptor: every later stop raised TypeError and no cluster could start."""
    _facts(tmp_path)  # a server is running
    server = mp_forkserver._forkserver
    fd = server._forkserver_alive_fd
    server._forkserver_alive_fd = None  # what the interrupted stop left
    try:
        with pytest.raises(TypeError):  # negative control: multiprocessing itself cannot stop it
            server._stop()
        facts = _facts(tmp_path)
        assert {f["ppid"] for f in facts} == {os.getpid()}  # spawned, and the conversion ran
    finally:
        server._forkserver_alive_fd = fd
    assert forkserver.worker_start_method() == "forkserver"  # usable again once its state is whole


@pytest.mark.slow
def test_a_process_outliving_its_cluster_does_not_hold_up_the_next(tmp_path, monkeypatch):
    """The old server exits only once every process forked from it has. multiprocessing's own stop
    waits for that, and a CI run hung on it; the server is let go instead."""
    _facts(tmp_path)
    old = mp_forkserver._forkserver._forkserver_pid
    straggler = multiprocessing.get_context("forkserver").Process(target=time.sleep, args=(60,))
    straggler.start()
    try:
        monkeypatch.setenv("H5NGFF_TEST_MARK", "a new environment")
        started = time.monotonic()
        facts = _facts(tmp_path)
        assert time.monotonic() - started < 60
        assert {f["ppid"] for f in facts} != {old} and {f["mark"] for f in facts} == {"a new environment"}
        # What multiprocessing's stop would have waited for: the old server is still there.
        assert psutil.pid_exists(old) and psutil.Process(old).status() != psutil.STATUS_ZOMBIE
    finally:
        straggler.kill()
        straggler.join()
    deadline = time.monotonic() + 10  # then it exits, and the reaper thread waits for it
    while psutil.pid_exists(old) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not psutil.pid_exists(old)


# A fresh interpreter runs one conversion with a stand-in "pandas" on its path that holds 64 MiB
# once imported (Dask's own preload list adds pandas where it is installed, and imports it here
# to check). Prints the JSON summary's worker peaks and plan, and whether this process imported it.
_PANDAS_PROBE = """
import json, sys
from h5ngff.backends import forkserver
from h5ngff.cli import main
if sys.argv[1] == "preload-it":
    forkserver.WORKER_PRELOAD = forkserver.WORKER_PRELOAD + ("pandas",)
sys.argv = ["h5ngff"]
import io, contextlib
out = io.StringIO()
with contextlib.redirect_stdout(out):
    code = main(["convert", sys.argv_source, sys.argv_out, "--workers", "1", "--json", "--no-progress"])
summary = json.loads(out.getvalue())
print(json.dumps({
    "code": code,
    "peaks": [w["peak_rss"] for w in summary["workers"]],
    "predicted": summary["predicted_peak_per_worker"],
    "client_imported": "pandas" in sys.modules,
}))
"""


@pytest.mark.slow
@pytest.mark.parametrize("preload", ["ours", "preload-it"], ids=["ours", "negative-control"])
def test_a_forked_worker_does_not_carry_modules_no_worker_needs(tmp_path, preload):
    """A forked worker's RSS starts with every page of its server's: a module the server imported
    is in every worker's peak. With pandas 3.1 installed, Dask's preload list put workers at 141
    MiB against a 138.3 MiB plan. The stand-in holds 64 MiB: preloaded (the control), the worker
    goes over its plan."""
    fake = tmp_path / "mods" / "pandas"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("_ballast = bytes(range(256)) * (256 << 10)  # 64 MiB, every page written\n")
    source = tmp_path / "in.h5"
    with h5py.File(source, "w") as f:
        f["d"] = np.arange(8 * 64 * 64, dtype=np.uint16).reshape(8, 64, 64)
    probe = _PANDAS_PROBE.replace("sys.argv_source", repr(f"{source}:/d")).replace(
        "sys.argv_out", repr(str(tmp_path / "out.ome.zarr"))
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path / "mods"), os.environ.get("PYTHONPATH", "")])}
    env.pop(forkserver.METHOD_VARIABLE, None)
    result = subprocess.run(
        [sys.executable, "-c", probe, preload], env=env, capture_output=True, text=True, timeout=180
    )
    assert result.returncode == 0, result.stderr[-3000:]
    facts = json.loads(result.stdout.strip().splitlines()[-1])
    if preload == "ours":
        assert facts["code"] == 0, result.stderr[-3000:]
        assert all(peak <= facts["predicted"] for peak in facts["peaks"]), facts
        assert not facts["client_imported"], "Dask's preload list imported it in the client"
    else:  # over its plan from its first moment (and, where that passes the terminate threshold, killed for it)
        assert any(peak > facts["predicted"] for peak in facts["peaks"]), facts


KILLED_WORKER = """
import multiprocessing, os, sys

def make_a_semaphore_and_die():
    held = multiprocessing.get_context("spawn").Lock()  # held: collected, it would unlink itself
    print(held._semlock.name, flush=True)
    os._exit(0)  # as a SIGKILL (the kernel's OOM kill) does: no finalizer runs

if __name__ == "__main__":
    if sys.argv[1] == "quiet":
        from h5ngff.backends.forkserver import start_resource_tracker
        start_resource_tracker()
    child = multiprocessing.get_context("spawn").Process(target=make_a_semaphore_and_die)
    child.start()
    child.join()
"""


@pytest.mark.parametrize(
    "tracker, flags", [("quiet", []), ("quiet", ["-W", "default"]), ("quiet", ["-E"]), ("control", [])]
)
def test_a_killed_workers_semaphore_is_cleaned_up_without_a_warning(tmp_path, tracker, flags):
    """A worker the kernel kills leaves a semaphore registered with the resource tracker, which
    unlinks it when the run's process exits, with a two-line UserWarning after the run's report.
    Started by h5ngff, the tracker still unlinks it and says nothing, whatever -W options or -E
    the interpreter has; started as multiprocessing starts it (the control), it warns."""
    script = tmp_path / "killed_worker.py"
    script.write_text(KILLED_WORKER)
    # The tracker holds stderr open until it has cleaned up and exited: run() waits for it.
    done = subprocess.run([sys.executable, *flags, str(script), tracker], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    name = done.stdout.split()[0]  # the child's semaphore, "/mp-..."
    assert not os.path.exists("/dev/shm/sem." + name.lstrip("/")), f"the tracker left {name}"
    warned = "leaked semaphore objects to clean up at shutdown" in done.stderr
    assert warned == (tracker == "control"), done.stderr
