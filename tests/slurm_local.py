"""A real single-node SLURM for the tests: ``scripts/slurm-local`` started once per session.

It installs the Debian packages if needed and runs munged, slurmctld and slurmd as root with
task/cgroup memory enforcement. The fixture stops exactly what it started: a SLURM already running
from the same script (a developer's, on the same state directory) is used and left running.
Skipped, with the reason, only where it cannot run at all: not root, or neither SLURM nor apt-get.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "slurm-local"
STATE = os.environ.get("H5NGFF_SLURM_STATE", "/tmp/h5ngff-slurm")


def unavailable() -> str | None:
    if os.geteuid() != 0:
        return "a local SLURM needs root (slurmd creates the job cgroups); run the tests as root or in CI"
    if not shutil.which("slurmctld") and not shutil.which("apt-get"):
        return "SLURM is not installed and there is no apt-get to install it (apt-get install slurmctld slurmd slurm-client munge)"
    return None


def _status() -> str:
    return subprocess.run([str(SCRIPT), "status", STATE], capture_output=True, text=True, check=False).stdout


@pytest.fixture(scope="session")
def slurm_cluster():
    reason = unavailable()
    if reason:
        pytest.skip(reason)
    conf = os.path.join(STATE, "etc", "slurm.conf")
    already = "slurmctld pid=" in _status() and "slurmd pid=" in _status()
    if not already:
        proc = subprocess.run([str(SCRIPT), "start", STATE], capture_output=True, text=True, timeout=600, check=False)
        assert proc.returncode == 0, f"scripts/slurm-local start failed:\n{proc.stderr[-3000:]}"
    previous = os.environ.get("SLURM_CONF")
    os.environ["SLURM_CONF"] = conf
    try:
        yield conf
    finally:
        if previous is None:
            os.environ.pop("SLURM_CONF", None)
        else:
            os.environ["SLURM_CONF"] = previous
        if not already:
            subprocess.run([str(SCRIPT), "stop", STATE], capture_output=True, text=True, timeout=120, check=False)


def squeue(name: str | None = None) -> list[str]:
    args = ["squeue", "-h", "-o", "%i"] + (["-n", name] if name else [])
    return subprocess.run(args, capture_output=True, text=True, check=True).stdout.split()
