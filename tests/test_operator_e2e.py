"""End to end: kubectl apply -> operator -> runner Job -> conversion -> Succeeded.

A ConversionJob is applied to the KMock emulator, the real operator creates the runner Job, and
the test executes that Job's container command (from its pod template) as a local process
pointed at the emulator. The only substitution: ``H5NGFF_BACKEND=local``, a Dask LocalCluster
in place of the DaskCluster pods. The test plays the Job controller (active, then succeeded or
failed by the exit code), and the operator must take the job to Succeeded with correct progress
and a valid OME-Zarr output.
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import time
import urllib.request

import numpy as np
import pytest
import zarr

from conftest import smooth, write_h5
from h5ngff.operator.schema.rbac import RUNNER_JOB_RULES, RUNNER_RULES, calls
from operator_harness import emulator, fast_config, manifest, operator_running, passes, wait_for
from test_operator_kmock import env_of, phases

pytestmark = [pytest.mark.asyncio, pytest.mark.timeout(180), pytest.mark.integration]

SHAPE = (40, 96, 80)


async def run_container(
    job: dict, api_url: str, cwd: str, backend: str = "local", timeout: float = 150, **extra_env: str
) -> tuple[int, str]:
    """Execute the runner Job's container as the kubelet would, but as a local process."""
    (container,) = job["spec"]["template"]["spec"]["containers"]
    env = {
        **os.environ,
        **env_of(job),
        "H5NGFF_KUBE_API": api_url,  # instead of the pod's service account
        "H5NGFF_BACKEND": backend,  # "local": the one substitution, no DaskCluster pods here
        "PATH": os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", ""),
        "H5NGFF_METRICS_LINGER": "0",  # no Prometheus here, unless a test scrapes (extra_env)
        **extra_env,
    }
    log_path = os.path.join(cwd, f"{job['metadata']['name']}.log")
    with open(log_path, "wb") as log:
        proc = await asyncio.create_subprocess_exec(
            *container.get("command", ()),  # none: the args are the command (the image's tini runs them)
            *container.get("args", []),
            env=env,
            cwd=container.get("workingDir", cwd),
            stdout=log,
            stderr=asyncio.subprocess.STDOUT,
            start_new_session=True,
        )
        try:
            code = await asyncio.wait_for(proc.wait(), timeout)
        except asyncio.TimeoutError:
            os.killpg(proc.pid, signal.SIGKILL)
            code = await proc.wait()
    with open(log_path, errors="replace") as f:
        return code, f.read()


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def by_name_and_phase(text: str) -> dict:
    """A scrape's samples keyed by (name, phase label)."""
    samples = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name_labels, value = line.rsplit(" ", 1)
            name = name_labels.split("{")[0]
            phase = name_labels.split('phase="')[1].split('"')[0] if 'phase="' in name_labels else ""
            samples[(name, phase)] = float(value)
    return samples


def scrape_until(port: int, done, task: asyncio.Task, timeout: float = 150, parse=by_name_and_phase) -> dict:
    """Scrape a runner's metrics every 0.2 s until ``done(parse(text))``; by default the samples
    keyed by (name, phase label)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and not task.done():
        try:
            text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
        except OSError:
            time.sleep(0.2)
            continue
        samples = parse(text)
        if done(samples):
            return samples
        time.sleep(0.2)
    raise AssertionError("the runner's metrics never showed the final values (did it exit without lingering?)")


def scrape_until_exit(port: int, task: asyncio.Task, timeout: float = 90) -> int:
    """Scrape every 0.2 s, as Prometheus would, until the runner exits; the scrapes made. A
    runner lingers until a scrape after its end has read its final values, and values that look
    final can come before its end: a test that stopped scraping there waited out the whole
    linger (60 s of a loaded suite)."""
    deadline, scrapes = time.monotonic() + timeout, 0
    while time.monotonic() < deadline and not task.done():
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read()
            scrapes += 1
        except OSError:
            pass
        time.sleep(0.2)
    return scrapes


@pytest.mark.slow
async def test_a_conversion_job_runs_to_succeeded_through_the_runner_command(tmp_path):
    data = smooth(SHAPE, "uint16", seed=6)
    source = write_h5(tmp_path / "scan.h5", data)
    output = str(tmp_path / "scan.ome.zarr")
    spec = {
        "source": {"path": source, "dataset": "/volume/data"},
        "output": {"path": output, "chunks": [16, 32, 32]},
        "image": {"scale": [2.0, 0.5, 0.5], "units": ["micrometer"] * 3},
        "pyramid": {"levels": 2},
        "resources": {"workers": 2, "slab": [16, 96, 80]},  # several slabs, so progress has steps
        "pod": {"image": "registry.example/h5ngff:1"},
    }
    async with emulator() as c, operator_running(fast_config(c.url)):
        await c.apply(manifest("scan", spec))
        await wait_for(lambda: "scan-runner-1" in c.jobs(), what="runner Job")
        job = c.jobs()["scan-runner-1"]
        await c.patch_job_status("scan-runner-1", {"active": 1})
        port = free_port()
        runner = asyncio.create_task(
            run_container(job, c.url, str(tmp_path), H5NGFF_METRICS_PORT=str(port), H5NGFF_METRICS_LINGER="60")
        )
        # Prometheus' part: scrape until the final values show; the runner lingers for that one scrape.
        final = await asyncio.to_thread(
            scrape_until, port, lambda m: m.get(("h5ngff_job_phase", "Succeeded")) == 1, runner
        )
        scraped_at = time.monotonic()
        code, log = await runner
        assert code == 0, log
        assert time.monotonic() - scraped_at < 20, "the runner lingered on after its final values were scraped"
        assert (
            "up to 60 s more" in log
            and final[("h5ngff_job_slabs_done_total", "")] == final[("h5ngff_job_planned_slabs", "")]
        )
        await c.patch_job_status(
            "scan-runner-1", {"active": 0, "succeeded": 1, "conditions": [{"type": "Complete", "status": "True"}]}
        )
        await wait_for(lambda: c.status("scan").get("phase") == "Succeeded", what="Succeeded")
        await wait_for(lambda: "outputLease" not in c.status("scan"), what="the Lease back once no pod runs")
        status = c.status("scan")
        runner_calls = c.api_calls()["runner"]

    plan = status["plan"]
    assert plan["workers"] == 2 and plan["levels"] == 2 and plan["tasks"] >= 2
    progress = status["progress"]
    assert progress["slabsDone"] == progress["slabsTotal"] == plan["tasks"] and progress["percent"] == 100
    assert progress["bytesRead"] >= data.nbytes and status["result"]["bytesWritten"] > 0
    assert status["runner"]["outcome"] == "Succeeded" and status["output"] == output
    assert phases(c, "scan") == ["Pending", "Planned", "Running", "Succeeded"]
    assert {x["type"]: x["status"] for x in status["conditions"]} == {
        "Validated": "True",
        "OutputLease": "False",
        "Planned": "True",
        "Running": "False",
        "Complete": "True",
    }

    from ome_zarr_models.v05 import Image

    group = zarr.open_group(output, mode="r")
    image = Image.from_zarr(group)
    assert [a.name for a in image.ome_attributes.multiscales[0].axes] == ["z", "y", "x"]
    np.testing.assert_array_equal(group["0"][...], data)
    # The runner needed only what its RBAC grants.
    assert runner_calls and runner_calls <= calls(RUNNER_RULES + RUNNER_JOB_RULES)


@pytest.mark.slow
async def test_a_runner_that_cannot_read_its_source_fails_the_job_without_retrying(tmp_path):
    spec = {
        "source": {"path": str(tmp_path / "missing.h5"), "dataset": "/volume/data"},
        "output": {"path": str(tmp_path / "out.ome.zarr")},
        "backoffLimit": 3,
    }
    async with emulator() as c, operator_running(cfg := fast_config(c.url)):
        await c.apply(manifest("lost", spec))
        await wait_for(lambda: "lost-runner-1" in c.jobs(), what="runner Job")
        job = c.jobs()["lost-runner-1"]
        code, log = await run_container(job, c.url, str(tmp_path))
        assert code == 2, log
        await c.patch_job_status(
            "lost-runner-1",
            {"failed": 1, "conditions": [{"type": "Failed", "status": "True", "reason": "BackoffLimitExceeded"}]},
        )
        await wait_for(lambda: c.status("lost").get("phase") == "Failed", what="Failed")
        status = c.status("lost")
        await passes(cfg, "lost", 3)
        assert status["reason"] == "SourceUnreadable" and "missing.h5" in status["message"]
        assert list(c.jobs()) == ["lost-runner-1"]  # an unreadable input is not retried
