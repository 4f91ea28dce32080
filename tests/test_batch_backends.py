"""Batch conversions on every backend and to every store a single conversion uses: a batch to an
S3 bucket (moto's server on loopback) through the command, and a batch on the real single-node
SLURM (scripts/slurm-local) with one set of worker jobs for the whole batch. Real HDF5 files,
every output read back and compared with its source."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import h5py
import numpy as np
import pytest
import zarr

from conftest import smooth, write_h5
from slurm_local import slurm_cluster, squeue  # noqa: F401  (session fixture)

pytestmark = [pytest.mark.integration, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[1]
CLI = [sys.executable, "-m", "h5ngff.cli"]
FLAGS = ["--chunks", "8,32,32", "--levels", "2", "--workers", "2", "--threads", "1"]


@pytest.fixture
def runs(tmp_path):
    """Three small files: f32, u16 gzip-chunked, f32 (a different shape)."""
    day = tmp_path / "runs"
    day.mkdir()
    write_h5(day / "cell_0.h5", smooth((16, 64, 48), "float32", seed=0))
    write_h5(day / "cell_1.h5", smooth((16, 64, 48), "uint16", seed=1), chunks=(8, 32, 24), compression="gzip")
    write_h5(day / "cell_2.h5", smooth((24, 48, 64), "float32", seed=2))
    return tmp_path


def source_of(h5: Path) -> np.ndarray:
    with h5py.File(h5, "r") as f:
        return f["/volume/data"][...]


def _env(**extra: str) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(ROOT / "src") + os.pathsep + os.environ.get("PYTHONPATH", ""), **extra}


def test_a_batch_to_an_s3_bucket_template_is_exact_read_back_through_the_endpoint(runs, s3):
    bucket = s3.new_bucket()
    flags = [f for k, v in s3.options().items() for f in ("--storage-option", f"{k}={v}")]
    argv = [
        *CLI,
        "convert",
        "runs/*.h5:/volume/data",
        f"s3://{bucket}/prefix/{{stem}}.ome.zarr",
        *FLAGS,
        *flags,
        "--json",
    ]
    proc = subprocess.run(argv, cwd=runs, env=_env(**s3.env()), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads(proc.stdout)
    assert summary["done"] == 3 and summary["cluster_starts"] == 1, summary
    assert [r["output"] for r in summary["results"]] == [f"s3://{bucket}/prefix/cell_{i}.ome.zarr" for i in range(3)]
    from zarr.storage import FsspecStore

    options = {"endpoint_url": s3.url, "key": "h5ngff-test", "secret": "h5ngff-test-secret"}
    for i in range(3):
        group = zarr.open_group(
            FsspecStore.from_url(f"s3://{bucket}/prefix/cell_{i}.ome.zarr", storage_options=options, read_only=True),
            mode="r",
        )
        np.testing.assert_array_equal(group["0"][...], source_of(runs / "runs" / f"cell_{i}.h5"))
        assert group.attrs["h5ngff"]["complete"] is True
    keys = s3.keys(bucket)
    assert {k.split("/")[1] for k in keys} == {f"cell_{i}.ome.zarr" for i in range(3)}, (
        "an object outside the three outputs"
    )
    assert not [k for k in keys if "/.h5ngff/" in k], "a manifest left in a finished output"
    # A re-run finds every item complete in the bucket and starts no cluster.
    again = subprocess.run(argv, cwd=runs, env=_env(**s3.env()), capture_output=True, text=True, timeout=300)
    assert again.returncode == 0, again.stderr[-3000:]
    second = json.loads(again.stdout)
    assert second["complete"] == 3 and second["cluster_starts"] == 0, second
    # Two items mapped to one object prefix are refused before anything is written there.
    clash = subprocess.run(
        [*CLI, "convert", "runs/*.h5:/volume/data", f"s3://{bucket}/other/{{parent}}.ome.zarr", *FLAGS, *flags],
        cwd=runs,
        env=_env(**s3.env()),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert clash.returncode == 2 and "both written to" in clash.stderr and "Traceback" not in clash.stderr, (
        clash.stderr[-3000:]
    )
    assert not s3.keys(bucket, "other/")


def _jobs_of_logs(logs: Path) -> dict[str, set[str]]:
    """The worker jobs the batch submitted, by the job name of their session: every job writes
    ``<job name>-<job id>.err`` in the log directory (the SLURM backend's own record)."""
    jobs: dict[str, set[str]] = {}
    for path in logs.glob("*.err"):
        name, job_id = re.fullmatch(r"(h5ngff-[0-9a-f]+)-(\d+)\.err", path.name).groups()  # type: ignore[union-attr]
        jobs.setdefault(name, set()).add(job_id)
    return jobs


def _scontrol_jobs(job_ids: set[str]) -> dict[str, str]:
    """Each job's JobName as slurmctld recorded it (finished jobs stay visible for 10 min)."""
    names = {}
    for job_id in job_ids:
        out = subprocess.run(
            ["scontrol", "show", "job", "-o", job_id], capture_output=True, text=True, check=False
        ).stdout
        match = re.search(r"JobName=(\S+)", out)
        if match:
            names[job_id] = match.group(1)
    return names


@pytest.mark.usefixtures("slurm_cluster")
def test_a_batch_on_slurm_submits_one_set_of_worker_jobs_and_converts_every_item(runs):
    logs = runs / "logs"
    argv = [
        *CLI,
        "convert",
        "runs/*.h5:/volume/data",
        "out/{stem}.ome.zarr",
        *FLAGS,
        "--backend",
        "slurm",
        "--slurm-log-dir",
        str(logs),
        "--json",
    ]
    proc = subprocess.run(argv, cwd=runs, env=_env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads(proc.stdout)
    assert summary["done"] == 3 and summary["cluster_starts"] == 1, summary
    # One session, one job per planned worker, for all three items: what SLURM recorded agrees.
    jobs = _jobs_of_logs(logs)
    assert len(jobs) == 1, f"more than one set of worker jobs: {jobs}"
    ((name, ids),) = jobs.items()
    assert len(ids) == summary["cluster"]["workers"] == 2, ids
    assert set(_scontrol_jobs(ids).values()) <= {name}
    assert not squeue(name), "a worker job of the batch is still queued"
    for i, r in enumerate(summary["results"]):
        assert r["status"] == "Done" and 0 < r["peak_rss"] <= r["predicted_peak"], r
        np.testing.assert_array_equal(
            zarr.open_group(str(runs / "out" / f"cell_{i}.ome.zarr"), mode="r")["0"][...],
            source_of(runs / "runs" / f"cell_{i}.h5"),
        )
    # Negative control of the count: the same three files converted one at a time submit three sets.
    logs_one = runs / "logs-one"
    for i in range(3):
        one = subprocess.run(
            [
                *CLI,
                "convert",
                f"runs/cell_{i}.h5:/volume/data",
                f"one/cell_{i}.ome.zarr",
                *FLAGS,
                "--backend",
                "slurm",
                "--slurm-log-dir",
                str(logs_one),
                "--no-progress",
            ],
            cwd=runs,
            env=_env(),
            capture_output=True,
            text=True,
            timeout=600,
        )
        assert one.returncode == 0, one.stderr[-3000:]
    assert len(_jobs_of_logs(logs_one)) == 3
