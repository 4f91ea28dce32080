"""Writing to an object store under enforced pod limits (memory cgroups at the planned pod limit,
as kubelet enforces them) stays under the plan, whose network-path terms (client, upload
buffers) are needed: the same run measured against the plan without them goes over. The store
is configured by an AWS profile, so every worker also imports botocore to read it: the costlier
of the two ways a worker builds its client, and the one the client term is sized for."""

from __future__ import annotations


import numpy as np
import pytest

from conftest import requires_cgroups, spec_for, write_h5
from h5ngff.backends.local import LocalPodsBackend
from h5ngff.runner import plan_job, run_job
from s3_server import CREDENTIALS

pytestmark = [requires_cgroups, pytest.mark.cgroup, pytest.mark.integration]


@pytest.mark.slow
def test_a_run_to_the_endpoint_under_pod_limits_stays_under_the_plan(s3, tmp_path, monkeypatch):
    data = (
        np.random.default_rng(5).standard_normal((64, 256, 256)).astype("float32")
    )  # incompressible: full-size chunks
    h5 = write_h5(tmp_path / "in.h5", data)
    url = f"s3://{s3.new_bucket()}/pod.ome.zarr"
    # The workers inherit this environment: they read the profile themselves (engine/stores/awsconfig.py).
    (tmp_path / "config").write_text(f"[profile pods]\nregion = {CREDENTIALS['region']}\nendpoint_url = {s3.url}\n")
    (tmp_path / "credentials").write_text(
        f"[pods]\naws_access_key_id = {CREDENTIALS['access_key_id']}\n"
        f"aws_secret_access_key = {CREDENTIALS['secret_access_key']}\n"
    )
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "config"))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "credentials"))
    options = {"profile": "pods", "allow_http": "true"}
    spec = spec_for(
        h5,
        url,
        output={"chunks": [64, 64, 64], "storageOptions": options},
        pyramid={"levels": 2},
        resources={"workers": 2, "slab": [64, 128, 256]},
    )
    backend = LocalPodsBackend()
    job = plan_job(spec, backend)
    names = {t.name for t in job.plan.memory.terms}
    assert {"object store client", "object store upload buffers"} <= names
    summary = run_job(job, backend)
    assert summary.status == "Succeeded" and len(summary.workers) == 2
    for w in summary.workers:
        assert w.oom_kills == 0 and w.nanny_restarts == 0 and w.memory_terminations == 0, w
        assert 0 < w.peak_rss <= job.plan.memory.predicted_peak, (
            f"{w.name}: measured {w.peak_rss} > predicted {job.plan.memory.predicted_peak}"
        )
        assert w.cgroup_peak is not None and w.cgroup_peak <= job.plan.memory.pod_limit
    # Calibration and control: the same run to local disk under the same limits. What the network
    # path costs above it is real (not padding) and within what the plan's object-store terms add.
    local = spec.model_copy(
        update={
            "output": spec.output.model_copy(update={"path": str(tmp_path / "disk.ome.zarr"), "storage_options": None})
        }
    )
    disk = run_job(plan_job(local, backend), backend)
    network = sum(t.bytes for t in job.plan.memory.terms if t.name.startswith("object store"))
    delta = max(w.peak_rss for w in summary.workers) - max(w.peak_rss for w in disk.workers)
    print(
        f"s3 peak {max(w.peak_rss for w in summary.workers) / 2**20:.1f} MiB, disk peak {max(w.peak_rss for w in disk.workers) / 2**20:.1f} MiB, "
        f"network terms {network / 2**20:.1f} MiB, predicted {job.plan.memory.predicted_peak / 2**20:.1f} MiB"
    )
    assert 0.25 * network < delta <= network, (
        f"the network path measured {delta / 2**20:.1f} MiB above disk; the plan adds {network / 2**20:.1f} MiB"
    )
