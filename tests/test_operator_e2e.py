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

import numpy as np
import pytest
import zarr

from conftest import requires_cgroups, smooth, write_h5
from h5ngff.operator.rbac import RUNNER_RULES, calls
from operator_harness import emulator, fast_config, manifest, operator_running, wait_for
from test_operator_kmock import env_of, phases

pytestmark = [pytest.mark.asyncio, pytest.mark.timeout(180)]

SHAPE = (40, 96, 80)


async def run_container(job: dict, api_url: str, cwd: str, backend: str = "local", timeout: float = 150, **extra_env: str) -> tuple[int, str]:
    """Execute the runner Job's container as the kubelet would, but as a local process."""
    (container,) = job["spec"]["template"]["spec"]["containers"]
    env = {**os.environ, **env_of(job),
           "H5NGFF_KUBE_API": api_url,  # instead of the pod's service account
           "H5NGFF_BACKEND": backend,  # "local": the one substitution, no DaskCluster pods here
           "PATH": os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", ""), **extra_env}
    log_path = os.path.join(cwd, f"{job['metadata']['name']}.log")
    with open(log_path, "wb") as log:
        proc = await asyncio.create_subprocess_exec(*container["command"], *container["args"], env=env, cwd=container.get("workingDir", cwd),
                                                    stdout=log, stderr=asyncio.subprocess.STDOUT, start_new_session=True)
        try:
            code = await asyncio.wait_for(proc.wait(), timeout)
        except asyncio.TimeoutError:
            os.killpg(proc.pid, signal.SIGKILL)
            code = await proc.wait()
    with open(log_path, errors="replace") as f:
        return code, f.read()


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
        code, log = await run_container(job, c.url, str(tmp_path))
        assert code == 0, log
        await c.patch_job_status("scan-runner-1", {"active": 0, "succeeded": 1, "conditions": [{"type": "Complete", "status": "True"}]})
        await wait_for(lambda: c.status("scan").get("phase") == "Succeeded", what="Succeeded")
        status = c.status("scan")
        runner_calls = c.api_calls()["runner"]

    plan = status["plan"]
    assert plan["workers"] == 2 and plan["levels"] == 2 and plan["tasks"] >= 2
    progress = status["progress"]
    assert progress["slabsDone"] == progress["slabsTotal"] == plan["tasks"] and progress["percent"] == 100
    assert progress["bytesRead"] >= data.nbytes and status["result"]["bytesWritten"] > 0
    assert status["runner"]["outcome"] == "Succeeded" and status["output"] == output
    assert phases(c, "scan") == ["Pending", "Planned", "Running", "Succeeded"]
    assert {x["type"]: x["status"] for x in status["conditions"]} == {"Validated": "True", "Planned": "True", "Running": "False", "Complete": "True"}

    from ome_zarr_models.v05 import Image

    group = zarr.open_group(output, mode="r")
    image = Image.from_zarr(group)
    assert [a.name for a in image.ome_attributes.multiscales[0].axes] == ["z", "y", "x"]
    np.testing.assert_array_equal(group["0"][...], data)
    # The runner needed only what its RBAC grants.
    assert runner_calls and runner_calls <= calls(RUNNER_RULES)


async def test_a_runner_that_cannot_read_its_source_fails_the_job_without_retrying(tmp_path):
    spec = {"source": {"path": str(tmp_path / "missing.h5"), "dataset": "/volume/data"},
            "output": {"path": str(tmp_path / "out.ome.zarr")}, "backoffLimit": 3}
    async with emulator() as c, operator_running(fast_config(c.url)):
        await c.apply(manifest("lost", spec))
        await wait_for(lambda: "lost-runner-1" in c.jobs(), what="runner Job")
        job = c.jobs()["lost-runner-1"]
        code, log = await run_container(job, c.url, str(tmp_path))
        assert code == 2, log
        await c.patch_job_status("lost-runner-1", {"failed": 1, "conditions": [{"type": "Failed", "status": "True", "reason": "BackoffLimitExceeded"}]})
        await wait_for(lambda: c.status("lost").get("phase") == "Failed", what="Failed")
        status = c.status("lost")
        await asyncio.sleep(0.5)
        assert status["reason"] == "SourceUnreadable" and "missing.h5" in status["message"]
        assert list(c.jobs()) == ["lost-runner-1"]  # an unreadable input is not retried


@requires_cgroups
@pytest.mark.cgroup
async def test_a_worker_killed_by_the_kernel_is_oomkilled_and_retried_then_given_up(tmp_path):
    """A real kernel OOM kill: the runner runs its workers in memory cgroups (the pod emulation of
    ``convert --enforce-pod-limits``) with the pod limit at 0.45x the plan. Both attempts are
    killed; the operator records OOMKilled, retries once (backoffLimit 1), then gives up."""
    from h5ngff.backends.local import LocalBackend
    from h5ngff.jobspec import parse_job_spec
    from h5ngff.runner import plan_job
    from h5ngff.sample import write_sample

    source = str(tmp_path / "big.h5")
    write_sample(source, "/volume/data", (48, 942, 502), "float32")
    spec = {"source": {"path": source, "dataset": "/volume/data"}, "output": {"path": str(tmp_path / "big.ome.zarr"), "chunks": [64, 64, 64]},
            "pyramid": {"levels": 1}, "resources": {"workers": 1, "slab": [48, 942, 502]}, "backoffLimit": 1}
    pod_limit = plan_job(parse_job_spec(spec).conversion(), LocalBackend()).plan.memory.pod_limit
    squeeze = str(int(0.45 * pod_limit))  # below the predicted peak: the kernel must kill
    async with emulator() as c, operator_running(fast_config(c.url)):
        await c.apply(manifest("big", spec))
        for attempt in (1, 2):
            name = f"big-runner-{attempt}"
            await wait_for(lambda: name in c.jobs(), what=name)
            code, log = await run_container(c.jobs()[name], c.url, str(tmp_path), "local-pods", timeout=60, H5NGFF_POD_LIMIT=squeeze, TMPDIR=str(tmp_path))
            assert code == 1, log[-3000:]
            await c.patch_job_status(name, {"failed": 1, "conditions": [{"type": "Failed", "status": "True", "reason": "BackoffLimitExceeded"}]})
        await wait_for(lambda: c.status("big").get("phase") == "Failed", what="Failed")
        status = c.status("big")
    assert status["reason"] == "BackoffLimitExceeded" and status["attempts"] == 2
    assert [f["reason"] for f in status["failures"]] == ["OOMKilled", "OOMKilled"]
    assert f"pod limit {int(squeeze) >> 20} MiB" in status["failures"][0]["message"]
    assert phases(c, "big") == ["Pending", "Planned", "Running", "Pending", "Planned", "Running", "Failed"]
