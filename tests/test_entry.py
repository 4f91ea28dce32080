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
