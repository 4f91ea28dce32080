"""The console script's entry point (h5ngff/entry.py): the workers' fork server is started before
the CLI's imports, only for commands that start a local cluster, and the cluster then uses it."""

from __future__ import annotations

import os
import subprocess
import sys

import h5py
import numpy as np
import pytest

from h5ngff.entry import _allocator, starts_a_local_cluster


@pytest.mark.parametrize(
    "argv, expected",
    [
        (["convert", "in.h5:/d", "out.ome.zarr"], True),
        (["demo"], True),
        (["convert", "in.h5:/d", "out.ome.zarr", "--backend", "slurm"], False),
        (["convert", "in.h5:/d", "out.ome.zarr", "--backend=local"], False),  # explicit: no head start
        (["convert", "in.h5:/d", "out.ome.zarr", "--scheduler", "tcp://x:8786"], False),
        (["convert", "in.h5:/d", "out.ome.zarr", "--enforce-pod-limits"], False),
        (["convert", "--help"], False),
        (["convert", "-h"], False),
        (["-v", "convert", "in.h5:/d", "out.ome.zarr"], True),  # a global flag before the command
        (["-vv", "demo"], True),
        (["convert", "in.h5:/d", "out.ome.zarr", "--back", "slurm"], False),  # argparse's abbreviations
        (["convert", "in.h5:/d", "out.ome.zarr", "--sched", "tcp://x:8786"], False),
        (["convert", "in.h5:/d", "out.ome.zarr", "--enforce-pod"], False),
        (["convert", "in.h5:/d", "out.ome.zarr", "--b", "slurm"], False),  # the shortest prefixes too
        (["convert", "in.h5:/d", "out.ome.zarr", "--e"], False),
        (["demo", "--h"], False),
        (["convert", "in.h5:/d", "out.ome.zarr", "--workers", "2"], True),
        (["plan", "in.h5:/d"], False),
        (["verify", "out.ome.zarr"], False),
        ([], False),
    ],
)
def test_which_commands_get_a_head_start(argv, expected):
    assert starts_a_local_cluster(argv) is expected


def test_the_allocator_flag_is_read_in_both_spellings():
    assert _allocator(["convert", "a", "b"]) == "auto"
    assert _allocator(["convert", "a", "b", "--allocator", "glibc"]) == "glibc"
    assert _allocator(["convert", "a", "b", "--allocator=jemalloc"]) == "jemalloc"
    assert _allocator(["convert", "a", "b", "--alloc", "glibc"]) == "glibc"  # abbreviated
    assert _allocator(["convert", "--allocator", "glibc", "--allocator", "jemalloc"]) == "jemalloc"  # the last


# Runs in a fresh interpreter as the console script would: the head start, then the CLI; prints
# whether the cluster forked its workers from the server started early.
_PROBE = """
import os, sys
import multiprocessing.forkserver as f
from h5ngff import entry
argv = sys.argv[1:]
assert entry.start_fork_server_early(argv)
early = f._forkserver._forkserver_pid
if os.environ.get("PROBE_CHANGE_ENV"):
    os.environ["PROBE_CHANGED"] = "after the head start"  # what the workers must see
from h5ngff.backends import local
chosen = []
choose = local.worker_start_method
local.worker_start_method = lambda: chosen.append(choose()) or chosen[-1]
from h5ngff import cli
code = cli.main(argv)
same = f._forkserver._forkserver_pid == early
print("REUSED" if chosen == ["forkserver"] and same else "RESTARTED" if chosen == ["forkserver"] else chosen, code)
"""


def _probe(tmp_path, *extra: str, change_env: bool = False) -> str:
    source = tmp_path / "in.h5"
    if not source.exists():
        with h5py.File(source, "w") as f:
            f["d"] = np.arange(8 * 64 * 64, dtype=np.uint16).reshape(8, 64, 64)
    out = tmp_path / f"out{len(list(tmp_path.iterdir()))}.ome.zarr"
    env = {"PROBE_CHANGE_ENV": "1"} if change_env else {}
    done = subprocess.run(
        [sys.executable, "-c", _PROBE, "convert", f"{source}:/d", str(out), "--workers", "2", "--no-progress", *extra],
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout.strip().splitlines()[-1]


@pytest.mark.slow
def test_the_cluster_forks_its_workers_from_the_server_started_early(tmp_path):
    assert _probe(tmp_path) == "REUSED 0"
    assert _probe(tmp_path, "--allocator", "glibc") == "REUSED 0"
    # Negative control: a variable set after the head start makes the environment differ, and
    # the cluster starts a server of its own (its workers must see the variable).
    assert _probe(tmp_path, change_env=True) == "RESTARTED 0"


# The fork server started early, preloading a module that takes 1.5 s to import; a Ctrl-C (SIGINT
# to the process group, as a terminal sends it) lands during that preload.
_CTRL_C_PROBE = """
import os, signal, sys, time
import multiprocessing.forkserver as f
from h5ngff.backends import forkserver
shield = sys.argv[1] == "shield"
signal.signal(signal.SIGINT, lambda *_: None)  # this process stands for the CLI, which handles it
assert forkserver.start_early({}, ["h5ngff_slow_import"], shield_ctrl_c=shield)
pid = f._forkserver._forkserver_pid
time.sleep(0.5)
os.killpg(os.getpgid(0), signal.SIGINT)
time.sleep(2.0)
print("ALIVE" if os.waitpid(pid, os.WNOHANG) == (0, 0) else "DEAD", flush=True)
"""


@pytest.mark.slow
@pytest.mark.parametrize("shield", [True, False], ids=["shielded", "negative-control"])
def test_a_ctrl_c_while_the_early_server_preloads_does_not_kill_it(tmp_path, shield):
    (tmp_path / "h5ngff_slow_import.py").write_text("import time\ntime.sleep(1.5)\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])}
    env.pop("H5NGFF_WORKER_START", None)
    result = subprocess.run(
        [sys.executable, "-c", _CTRL_C_PROBE, "shield" if shield else "bare"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        start_new_session=True,  # its own process group: the SIGINT reaches nothing else
    )
    if shield:
        assert result.stdout.strip() == "ALIVE", result.stderr
        assert "Traceback" not in result.stderr, result.stderr
    else:  # the server dies in its preload with a traceback, as before the fix
        assert result.stdout.strip() == "DEAD"
        assert "KeyboardInterrupt" in result.stderr


# The console script's first moments: a signal while the head start runs or the CLI imports. The
# head start is made slow here so that the signal lands inside that window every time.
_EARLY_SIGNAL_PROBE = """
import os, signal, sys, threading, time
from h5ngff import entry
entry.start_fork_server_early = lambda args: time.sleep(3)
threading.Timer(0.5, os.kill, (os.getpid(), getattr(signal, sys.argv[1]))).start()
sys.exit(entry.main(["convert", "in.h5:/d", "out.ome.zarr"]))
"""


@pytest.mark.slow
@pytest.mark.parametrize(
    "signame, code, line", [("SIGINT", 130, "interrupted"), ("SIGTERM", 143, "terminated (SIGTERM)")]
)
def test_a_signal_before_the_cli_is_imported_is_one_line_not_a_traceback(signame, code, line):
    result = subprocess.run(
        [sys.executable, "-c", _EARLY_SIGNAL_PROBE, signame], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == code, result.stderr
    assert result.stderr.strip() == f"{line}: re-run the same command to resume.", result.stderr
