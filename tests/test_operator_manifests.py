"""Pure manifest builders: the runner Job and the Dask cluster's pods carry exactly the plan.

The worker container is also started for real (``dask worker`` with the built args and env,
against a local scheduler), so the args are valid for Dask and the env reaches the worker.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from distributed import Client, LocalCluster

from h5ngff.backends.allocator import JEMALLOC_CONF
from h5ngff.backends.kubernetes import SCHEDULER_MEMORY, KubernetesBackend, build_dask_cluster, build_worker_container
from h5ngff.jobspec import PodSettings, parse_job_spec
from h5ngff.k8s import CREDENTIAL_ENV, MAX_CLUSTER_NAME, child_name, dask_cluster_name, label_value
from h5ngff.operator.contract import ENV, RunnerContract
from h5ngff.operator.controller.manifests import Owner, build_runner_job, runner_job_name
from h5ngff.planner import DEFAULT_CONSTANTS, DatasetInfo, make_plan
from h5ngff.units import k8s_quantity, parse_bytes

SPEC_ENV = ENV["spec"]

VOLUMES = [{"name": "data", "persistentVolumeClaim": {"claimName": "scans"}}]
MOUNTS = [{"name": "data", "mountPath": "/data"}]


def job_spec(**extra):
    base = {
        "source": {"path": "/data/in.h5", "dataset": "/volume/data"},
        "output": {"path": "/data/out.ome.zarr", "overwrite": True},
        "resources": {"workers": 3, "threadsPerWorker": 2, "memoryPerWorker": "2Gi"},
        "pod": {
            "volumes": VOLUMES,
            "volumeMounts": MOUNTS,
            "serviceAccountName": "h5ngff-runner",
            "nodeSelector": {"pool": "highmem"},
            "tolerations": [{"key": "batch", "operator": "Exists", "effect": "NoSchedule"}],
            "workingDir": "/data",
        },
        "backoffLimit": 1,
        "ttlSecondsAfterFinished": 600,
    }
    base.update(extra)
    return parse_job_spec(base)


def plan_for(spec, allocator="jemalloc"):
    ds = DatasetInfo(shape=(128, 512, 512), dtype="<u2", itemsize=2)
    backend = KubernetesBackend(Owner("ns", "j", "u"), image="img")
    return make_plan(ds, spec.conversion(), backend.capacity(), DEFAULT_CONSTANTS, allocator)


OWNER = Owner("science", "scan-42", "0b9f-uid")


def test_runner_job_runs_the_hidden_runner_with_identity_owner_and_storage():
    spec = job_spec()
    job = build_runner_job(OWNER, spec, attempt=1, default_image="ghcr.io/x/h5ngff:1")
    meta, pod = job["metadata"], job["spec"]["template"]["spec"]
    assert meta["name"] == "scan-42-runner-1" and meta["namespace"] == "science"
    assert meta["ownerReferences"] == [
        {
            "apiVersion": "h5ngff.dev/v1alpha1",
            "kind": "ConversionJob",
            "name": "scan-42",
            "uid": "0b9f-uid",
            "controller": True,
            "blockOwnerDeletion": True,
        }
    ]
    (c,) = pod["containers"]
    assert "command" not in c  # the image's entrypoint (tini) runs the args: tests/test_image.py
    assert c["args"] == ["h5ngff", "runner"]  # who it is comes with everything else, in its runner contract
    contract = RunnerContract.from_env({e["name"]: e["value"] for e in c["env"] if "value" in e})
    assert (contract.kind, contract.namespace, contract.name, contract.uid, contract.attempt) == (
        "ConversionJob",
        "science",
        "scan-42",
        "0b9f-uid",
        1,
    )
    assert c["image"] == "ghcr.io/x/h5ngff:1"
    # the user's volumes first, then the scratch emptyDir at /tmp (tests/test_pod_security.py)
    assert c["volumeMounts"][:-1] == MOUNTS and pod["volumes"][:-1] == VOLUMES and c["workingDir"] == "/data"
    assert pod["serviceAccountName"] == "h5ngff-runner"
    assert pod["nodeSelector"] == {"pool": "highmem"} and pod["tolerations"][0]["key"] == "batch"
    assert pod["restartPolicy"] == "Never"
    # The operator retries, not the Job controller: it must see each failure and its reason.
    assert job["spec"]["backoffLimit"] == 0
    assert job["spec"]["ttlSecondsAfterFinished"] == 600
    labels = job["spec"]["template"]["metadata"]["labels"]
    assert labels["h5ngff.dev/conversionjob"] == "scan-42" and labels["h5ngff.dev/attempt"] == "1"
    assert meta["labels"] == labels


def test_runner_spec_env_round_trips_and_pins_the_image():
    spec = job_spec()
    job = build_runner_job(OWNER, spec, attempt=1, default_image="ghcr.io/x/h5ngff:1")
    env = {e["name"]: e["value"] for e in job["spec"]["template"]["spec"]["containers"][0]["env"]}
    carried = parse_job_spec(json.loads(env[SPEC_ENV]))
    assert carried.conversion() == spec.conversion()
    assert carried.pod.image == "ghcr.io/x/h5ngff:1"  # the workers must run what the runner runs
    assert env["H5NGFF_BACKEND"] == "kubernetes"
    own = build_runner_job(OWNER, job_spec(pod={"image": "mine:2"}), 1, "ghcr.io/x/h5ngff:1")
    assert own["spec"]["template"]["spec"]["containers"][0]["image"] == "mine:2"


def test_a_retry_resumes_instead_of_overwriting():
    spec = job_spec()  # overwrite: true
    first = build_runner_job(OWNER, spec, attempt=1, default_image="i")
    retry = build_runner_job(OWNER, spec, attempt=2, default_image="i", resume=True)

    def overwrite(job):
        env = {e["name"]: e["value"] for e in job["spec"]["template"]["spec"]["containers"][0]["env"]}
        return json.loads(env[SPEC_ENV])["output"]["overwrite"]

    assert overwrite(first) is True and overwrite(retry) is False
    assert retry["metadata"]["name"] == "scan-42-runner-2"


@pytest.mark.parametrize("name", ["a", "x" * 50, "y" * 63, "z" * 200])
def test_child_names_are_deterministic_unique_and_short(name):
    job = runner_job_name(name, 12)
    cluster = dask_cluster_name(name)
    assert len(job) <= 63 and len(cluster) <= MAX_CLUSTER_NAME and len(label_value(name)) <= 63
    assert job == runner_job_name(name, 12) and cluster == dask_cluster_name(name)
    assert job.endswith("-runner-12") and cluster.endswith("-dask")
    # Two long names sharing a prefix must not collide after shortening.
    assert child_name(name + "a", "runner-1") != child_name(name + "b", "runner-1")


def test_worker_pods_carry_the_plan():
    spec = job_spec()
    plan = plan_for(spec)
    cluster = build_dask_cluster(plan, Owner("science", "scan-42", "0b9f-uid", attempt=2), "img:1", spec.pod)
    worker = cluster["spec"]["worker"]
    assert worker["replicas"] == plan.workers == 3
    pod = worker["spec"]
    (c,) = pod["containers"]
    limit = k8s_quantity(plan.memory.pod_limit)
    assert c["resources"]["requests"] == c["resources"]["limits"] == {"memory": limit, "cpu": "2"}  # Guaranteed QoS
    assert parse_bytes(limit) >= plan.memory.pod_limit
    args = c["args"]
    assert args[args.index("--memory-limit") + 1] == str(plan.memory.memory_limit)
    assert args[args.index("--nthreads") + 1] == "2"
    assert "auto" not in args
    env = {e["name"]: e["value"] for e in c["env"]}
    t = plan.memory.thresholds
    assert env["DASK_DISTRIBUTED__WORKER__MEMORY__PAUSE"] == str(t.pause)
    assert env["DASK_DISTRIBUTED__WORKER__MEMORY__TERMINATE"] == str(t.terminate)
    assert env["DASK_DISTRIBUTED__WORKER__MEMORY__TARGET"] == str(t.target)
    assert env["DASK_DISTRIBUTED__WORKER__MEMORY__SPILL"] == str(t.spill)
    assert env["MALLOC_CONF"] == JEMALLOC_CONF and env["LD_PRELOAD"].endswith("libjemalloc.so.2")
    assert pod["volumes"][:-1] == VOLUMES and c["volumeMounts"][:-1] == MOUNTS and c["workingDir"] == "/data"
    assert pod["nodeSelector"] == {"pool": "highmem"} and pod["automountServiceAccountToken"] is False
    meta = cluster["metadata"]
    assert meta["ownerReferences"][0]["uid"] == "0b9f-uid" and meta["labels"]["h5ngff.dev/attempt"] == "2"


def test_glibc_workers_get_the_tuned_glibc_env_not_jemalloc():
    spec = job_spec()
    env = {e["name"]: e["value"] for e in build_worker_container(plan_for(spec, "glibc"), "img", spec.pod)["env"]}
    # The image preloads jemalloc; an empty LD_PRELOAD is what turns it off for these workers.
    assert env["LD_PRELOAD"] == "" and env["MALLOC_ARENA_MAX"] == "2"


def test_scheduler_pod_is_guaranteed_and_sized_apart_from_workers():
    spec = job_spec()
    plan = plan_for(spec)
    sched = build_dask_cluster(plan, Owner("science", "scan-42", "u"), "img", spec.pod)["spec"]["scheduler"]
    (c,) = sched["spec"]["containers"]
    assert c["resources"]["requests"] == c["resources"]["limits"]
    assert parse_bytes(c["resources"]["limits"]["memory"]) == SCHEDULER_MEMORY
    assert [v["name"] for v in sched["spec"]["volumes"]] == ["h5ngff-scratch"]  # it reads no data, only /tmp
    assert sched["service"]["selector"]["dask.org/cluster-name"] == dask_cluster_name("scan-42")


@pytest.mark.slow
@pytest.mark.integration
def test_the_worker_container_starts_a_worker_with_the_planned_limits(tmp_path):
    """Run the built container's command for real: Dask must accept the args, and the worker
    must come up with the planned memory_limit, threads and thresholds."""
    spec = job_spec(resources={"workers": 1, "threadsPerWorker": 2, "memoryPerWorker": "1Gi"})
    plan = plan_for(spec)
    container = build_worker_container(plan, "img", PodSettings())
    with LocalCluster(n_workers=0, processes=True, dashboard_address=None) as cluster, Client(cluster) as client:
        env = {
            **os.environ,
            **{e["name"]: e["value"] for e in container["env"]},
            "DASK_WORKER_NAME": "pod-worker-0",
            "DASK_SCHEDULER_ADDRESS": cluster.scheduler_address,
        }
        args = [a.replace("$(DASK_WORKER_NAME)", env["DASK_WORKER_NAME"]) for a in container["args"]]
        assert args[:2] == ["dask", "worker"]
        cmd = [
            sys.executable,
            "-m",
            "distributed.cli.dask_worker",
            *args[2:],
            "--dashboard-address",
            ":0",
            "--local-directory",
            str(tmp_path),
        ]
        proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        try:
            client.wait_for_workers(1, timeout=60)
            (info,) = client.scheduler_info()["workers"].values()
            assert info["memory_limit"] == plan.memory.memory_limit
            assert info["nthreads"] == 2 and info["name"] == "pod-worker-0"
            import dask

            t = plan.memory.thresholds
            config = {
                k: _one(client.run(dask.config.get, f"distributed.worker.memory.{k}"))
                for k in ("target", "spill", "pause", "terminate")
            }
            assert config == {"target": t.target, "spill": t.spill, "pause": t.pause, "terminate": t.terminate}
            assert _one(client.run(os.getenv, "LD_PRELOAD")).endswith("libjemalloc.so.2")
        finally:
            proc.terminate()
            proc.wait(30)


def _one(per_worker: dict):
    (value,) = per_worker.values()
    return value


def test_without_the_env_a_worker_would_run_on_dask_defaults(tmp_path):
    """Negative control for the test above: the thresholds it checks are not Dask's defaults."""
    import dask

    plan = plan_for(job_spec())
    defaults = {k: dask.config.get(f"distributed.worker.memory.{k}") for k in ("target", "spill", "pause", "terminate")}
    t = plan.memory.thresholds
    assert defaults != {"target": t.target, "spill": t.spill, "pause": t.pause, "terminate": t.terminate}


def test_runner_pods_get_the_default_service_account_and_serve_metrics():
    """A job that names no service account runs its runner as the operator's default (the Helm
    chart's h5ngff-runner, which holds the runner RBAC), and every runner serves its metrics on
    the container port the chart's PodMonitor scrapes."""
    from h5ngff.operator.controller.manifests import RUNNER_METRICS_PORT

    spec = job_spec(pod={})
    job = build_runner_job(OWNER, spec, 1, "img", default_service_account="h5ngff-runner")
    pod = job["spec"]["template"]["spec"]
    container = pod["containers"][0]
    assert pod["serviceAccountName"] == "h5ngff-runner"
    assert container["ports"] == [{"name": "metrics", "containerPort": RUNNER_METRICS_PORT, "protocol": "TCP"}]
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert env["H5NGFF_METRICS_PORT"] == str(RUNNER_METRICS_PORT)
    assert (env["H5NGFF_JOB_NAME"], env["H5NGFF_JOB_NAMESPACE"]) == (OWNER.name, OWNER.namespace)
    own = build_runner_job(
        OWNER, job_spec(pod={"serviceAccountName": "mine"}), 1, "img", default_service_account="h5ngff-runner"
    )
    assert own["spec"]["template"]["spec"]["serviceAccountName"] == "mine"
    assert "serviceAccountName" not in build_runner_job(OWNER, spec, 1, "img")["spec"]["template"]["spec"]


def _containers(obj):
    """Every container dict anywhere in a rendered manifest."""
    if isinstance(obj, dict):
        if "image" in obj and "name" in obj and ("args" in obj or "command" in obj):
            yield obj
        for value in obj.values():
            yield from _containers(value)
    elif isinstance(obj, list):
        for value in obj:
            yield from _containers(value)


def test_an_s3_output_gets_its_credentials_from_a_namespace_local_secret_in_runner_and_workers():
    spec = job_spec(
        output={"path": "s3://scans/run-7/out.ome.zarr", "storageOptions": {"region": "eu-west-1"}},
        pod={"credentialsSecret": "s3-writer"},
    )
    runner = build_runner_job(OWNER, spec, attempt=1, default_image="img")
    plan = plan_for(spec)
    cluster = build_dask_cluster(plan, Owner("science", "scan-42", "0b9f-uid"), "img", spec.pod)
    (rc,) = runner["spec"]["template"]["spec"]["containers"]
    (wc,) = cluster["spec"]["worker"]["spec"]["containers"]
    for c in (rc, wc):
        # A secretKeyRef has no namespace: the kubelet resolves it in the pod's (the job's)
        # namespace. Named keys only, never envFrom (tests/test_operator_tenant_escape.py).
        refs = {e["name"]: e["valueFrom"]["secretKeyRef"] for e in c["env"] if "valueFrom" in e}
        assert (
            refs == {k: {"name": "s3-writer", "key": k, "optional": True} for k in CREDENTIAL_ENV}
            and "envFrom" not in c
        )
    assert (
        json.loads(next(e["value"] for e in rc["env"] if e["name"] == SPEC_ENV))["pod"]["credentialsSecret"]
        == "s3-writer"
    )
    assert not [
        e for e in rc["env"] if e["name"] in CREDENTIAL_ENV and "value" in e
    ]  # the operator never reads the Secret
    # Negative control: without the field no container takes anything from a Secret.
    plain = job_spec()
    assert "secretKeyRef" not in json.dumps(build_runner_job(OWNER, plain, 1, "img"))
    assert "secretKeyRef" not in json.dumps(
        build_dask_cluster(plan_for(plain), Owner("science", "scan-42", "u"), "img", plain.pod)
    )


@pytest.mark.parametrize("name", ["other-ns/s3-writer", "S3Writer", "", "-x"])
def test_a_credentials_secret_is_a_plain_secret_name_never_another_namespace(name):
    from h5ngff.errors import SpecError

    with pytest.raises(SpecError, match="pod.credentialsSecret"):
        job_spec(pod={"credentialsSecret": name})


@pytest.mark.slow
def test_the_output_lease_of_a_bucket_prefix_is_the_url_whatever_the_working_directory():
    from h5ngff.operator.controller.lease import output_key

    a = job_spec(output={"path": "s3://scans/run-7/out.ome.zarr"})
    b = job_spec(output={"path": "s3://scans/run-7//out.ome.zarr/"}, pod={"workingDir": "/elsewhere"})
    assert output_key(a) == output_key(b) == "url:s3://scans/run-7/out.ome.zarr"
    # Control: a relative local path does depend on the working directory.
    assert output_key(job_spec(output={"path": "out.ome.zarr"})) != output_key(
        job_spec(output={"path": "out.ome.zarr"}, pod={"workingDir": "/elsewhere"})
    )
