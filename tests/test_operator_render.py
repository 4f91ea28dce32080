"""``h5ngff operator render job.yaml [--plan]``: the objects the operator would create.

* the rendered runner Job, Role and RoleBinding equal what the real kopf operator creates in
  KMock for the same manifest and settings;
* with --plan (a real HDF5 file) the DaskCluster's worker pods carry the plan's pod limit and
  Dask memory_limit, as ``h5ngff plan --kubernetes`` computes them;
* every object passes kubernetes-validate (strict) where a schema exists, and every pod meets
  the restricted Pod Security Standard (tests/pod_security.py);
* negative controls: a manifest the policy refuses prints nothing and exits 2 (PolicyDenied),
  an invalid one exits 2.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import h5py
import kubernetes_validate
import numpy as np
import pytest
import yaml

from h5ngff.cli import main
from h5ngff.operator.controller.manifests import CHART_RUNNER_ACCOUNT
from h5ngff.units import k8s_quantity
from operator_harness import (
    JOB_RES,
    ROLE_RES,
    ROLEBINDING_RES,
    emulator,
    fast_config,
    manifest,
    operator_running,
    wait_for,
)
from pod_security import pod_specs, violations

ROOT = Path(__file__).resolve().parents[1]
KUBE_VERSION = "1.33"
SPEC = {
    "source": {"path": "scan.h5", "dataset": "/volume/data"},
    "output": {"path": "scan.ome.zarr", "chunks": [16, 32, 32]},
    "pyramid": {"levels": 2},
    "resources": {"workers": 2, "memoryPerWorker": "1Gi"},
    "pod": {
        "image": "registry.example/h5ngff:1",
        "workingDir": "/data",
        "volumes": [{"name": "data", "persistentVolumeClaim": {"claimName": "scans"}}],
        "volumeMounts": [{"name": "data", "mountPath": "/data"}],
    },
}
FLAGS = ["--image", "h5ngff:test", "--allowed-image", "registry.example/*"]


@pytest.fixture
def job_file(tmp_path, monkeypatch):
    with h5py.File(tmp_path / "scan.h5", "w") as f:
        f.create_dataset(
            "volume/data", data=np.arange(48 * 96 * 80, dtype="<u2").reshape(48, 96, 80), chunks=(16, 32, 32)
        )
    doc = manifest("scan", SPEC, namespace="imaging")
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(doc))
    monkeypatch.chdir(tmp_path)
    return path


def render(capsys, *args) -> tuple[int, list[dict], str]:
    code = main(["operator", "render", *map(str, args)])
    captured = capsys.readouterr()
    objs = [d for d in yaml.safe_load_all(captured.out) if d] if code == 0 else []
    # Errors go to stderr (the exit-code table's rule); a failed render prints nothing on stdout.
    return code, objs, captured.out if code == 0 else captured.out + captured.err


def by_kind(objs: list[dict]) -> dict[str, dict]:
    return {o["kind"]: o for o in objs}


async def created_for(c, name: str) -> dict[str, dict]:
    """The runner Job of attempt 1, Role and RoleBinding the operator created for ``name``."""
    await wait_for(lambda: c.live(JOB_RES, "imaging"), what="runner Job")
    return {
        "Job": c.live(JOB_RES, "imaging")[f"{name}-runner-1"],
        "Role": c.live(ROLE_RES, "imaging")[f"{name}-runner-status"],
        "RoleBinding": c.live(ROLEBINDING_RES, "imaging")[f"{name}-runner-status"],
    }


def assert_same_objects(created: dict[str, dict], rendered: dict[str, dict]) -> None:
    """What the operator created equals what render printed: the bodies and the identifying metadata."""
    for kind, obj in created.items():
        for key in ("spec", "rules", "subjects", "roleRef"):
            assert obj.get(key) == rendered[kind].get(key), (kind, key)
        for key in ("name", "namespace", "labels", "ownerReferences"):
            assert obj["metadata"].get(key) == rendered[kind]["metadata"].get(key), (kind, key)


def test_render_prints_role_binding_and_runner_job(capsys, job_file):
    code, objs, out = render(capsys, job_file, *FLAGS)
    assert code == 0 and out.startswith("# h5ngff operator render")
    assert [o["kind"] for o in objs] == ["Role", "RoleBinding", "Job"]
    job = by_kind(objs)["Job"]
    assert job["metadata"]["name"] == "scan-runner-1" and job["metadata"]["namespace"] == "imaging"
    assert job["spec"]["template"]["spec"]["containers"][0]["image"] == "registry.example/h5ngff:1"
    assert job["metadata"]["ownerReferences"][0]["uid"] == "uid-scan"  # the manifest's own uid


@pytest.mark.slow
@pytest.mark.integration
@pytest.mark.asyncio
@pytest.mark.timeout(120)
@pytest.mark.parametrize("fixture, name", [("job_file", "scan"), ("batch_file", "lab-run")], ids=["job", "batch"])
async def test_rendered_objects_are_what_the_operator_creates(capsys, request, fixture, name):
    path = request.getfixturevalue(fixture)
    code, objs, _ = render(capsys, path, *FLAGS, "--namespace", "ignored-when-the-manifest-names-one")
    assert code == 0
    rendered = by_kind(objs)
    doc = yaml.safe_load(path.read_text())
    # render assumes the chart's operator, whose runner account is h5ngff-runner: so does this one
    async with emulator() as c, operator_running(fast_config(c.url, runner_service_account=CHART_RUNNER_ACCOUNT)):
        await (c.apply_batch(doc) if doc["kind"] == "ConversionBatch" else c.apply(doc))
        created = await created_for(c, name)
    assert_same_objects(created, rendered)


def test_plan_adds_the_dask_cluster_sized_by_the_plan(capsys, job_file):
    code, objs, _ = render(capsys, job_file, *FLAGS, "--plan")
    assert code == 0 and [o["kind"] for o in objs] == ["Role", "RoleBinding", "Job", "DaskCluster"]
    cluster = by_kind(objs)["DaskCluster"]
    assert main(["plan", "--kubernetes", "--json", str(job_file)]) == 0
    plan = json.loads(capsys.readouterr().out)["plan"]
    worker = cluster["spec"]["worker"]
    (container,) = worker["spec"]["containers"]
    assert worker["replicas"] == plan["workers"] == 2
    assert (
        container["resources"]["limits"]["memory"]
        == container["resources"]["requests"]["memory"]
        == k8s_quantity(plan["memory"]["pod_limit"])
    )
    args = container["args"]
    assert args[args.index("--memory-limit") + 1] == str(plan["memory"]["memory_limit"])
    env = {e["name"]: e["value"] for e in container["env"]}
    assert env["LD_PRELOAD"] == "/usr/local/lib/libjemalloc.so.2"  # the image's jemalloc, whatever this machine has
    assert container["image"] == "registry.example/h5ngff:1"


def test_every_rendered_object_validates_and_every_pod_is_restricted(capsys, job_file):
    code, objs, _ = render(capsys, job_file, *FLAGS, "--plan")
    assert code == 0
    pods = 0
    for obj in objs:
        if obj["kind"] == "DaskCluster":  # no schema in kubernetes-validate: its pods are checked below
            with pytest.raises(kubernetes_validate.SchemaNotFoundError):
                kubernetes_validate.validate(obj, KUBE_VERSION, strict=True)
        else:
            kubernetes_validate.validate(obj, KUBE_VERSION, strict=True)
        for where, pod, pod_annotations in pod_specs(obj):
            assert violations(pod, pod_annotations) == [], where
            pods += 1
    assert pods == 3  # runner, scheduler, worker


def test_a_manifest_the_policy_refuses_renders_nothing(capsys, job_file):
    """Negative control: without the allowed image the operator would refuse this job."""
    code, objs, out = render(capsys, job_file, "--image", "h5ngff:test")
    assert code == 2 and objs == []
    assert "PolicyDenied" in out and "policy.allowedImages" in out and "kind:" not in out


def test_an_invalid_manifest_exits_2(capsys, tmp_path):
    doc = manifest("bad", {**SPEC, "resources": {"workers": 0}})
    (tmp_path / "bad.yaml").write_text(yaml.safe_dump(doc))
    code, objs, out = render(capsys, tmp_path / "bad.yaml", *FLAGS)
    assert code == 2 and objs == [] and "resources.workers" in out


@pytest.mark.slow
@pytest.mark.integration
def test_help_has_an_example_and_the_image_path_matches_the_dockerfile():
    from h5ngff.clirender import IMAGE_JEMALLOC

    out = subprocess.run(
        [sys.executable, "-m", "h5ngff.cli", "operator", "render", "--help"],
        capture_output=True,
        text=True,
        env={"PYTHONPATH": str(ROOT / "src"), "PATH": "/usr/bin:/bin"},
    )
    assert out.returncode == 0 and "h5ngff operator render job.yaml --plan" in out.stdout and "examples:" in out.stdout
    assert f"H5NGFF_JEMALLOC={IMAGE_JEMALLOC}" in (ROOT / "docker/Dockerfile").read_text()


BATCH_SPEC = {
    "items": [
        {"source": {"path": "a.h5", "dataset": "/volume/data"}},
        {"source": {"path": "b.h5", "dataset": "/volume/data"}, "output": "retake.ome.zarr"},
    ],
    "output": {"path": "{stem}.ome.zarr", "chunks": [16, 32, 32]},
    "resources": {"workers": 2},
    "pod": SPEC["pod"],
}


@pytest.fixture
def batch_file(tmp_path, monkeypatch):
    from operator_harness import batch_manifest

    path = tmp_path / "batch.yaml"
    path.write_text(yaml.safe_dump(batch_manifest("lab-run", BATCH_SPEC, namespace="imaging")))
    monkeypatch.chdir(tmp_path)
    return path


def test_a_batch_renders_its_runner_job_for_every_item(capsys, batch_file):
    from h5ngff.operator.schema.batchspec import parse_batch_spec

    code, objs, out = render(capsys, batch_file, *FLAGS)
    assert code == 0 and [o["kind"] for o in objs] == ["Role", "RoleBinding", "Job"], out
    job = by_kind(objs)["Job"]
    env = {e["name"]: e.get("value") for e in job["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert job["metadata"]["name"] == "lab-run-runner-1"
    assert job["metadata"]["ownerReferences"][0]["kind"] == "ConversionBatch"
    ids = [p.id for p in parse_batch_spec(BATCH_SPEC).planned_items()]
    assert env["H5NGFF_KIND"] == "ConversionBatch" and env["H5NGFF_ITEMS"] == ",".join(ids) and len(ids) == 2
    assert by_kind(objs)["Role"]["rules"][0]["resources"] == ["conversionbatches/status"]
    # Negative controls: --plan is a job's, and the policy refuses a batch as it refuses a job.
    code, _, out = render(capsys, batch_file, *FLAGS, "--plan")
    assert code == 2 and "--plan" in out and "ConversionBatch" in out
    code, _, out = render(capsys, batch_file, "--image", "h5ngff:test")
    assert code == 2 and "PolicyDenied" in out
