"""The plain manifests (manifests/) and the example ConversionJobs (manifests/examples/).

* manifests/h5ngff.yaml is the chart rendered with its default values: a test fails when the
  file drifts from the rendering (scripts/render-manifests regenerates it);
* every object of ``kubectl apply -k manifests/`` is valid Kubernetes (kubernetes-validate);
* every example validates against our CRD's schema, loads with h5ngff's own job loader, and
  plans (on the Kubernetes backend) for a tiny HDF5 file of the right rank; the four kinds the
  deployment docs promise exist (minimal, PVCs, a total memory budget, 5-D TCZYX).
"""

from __future__ import annotations

import copy
import sys
from pathlib import Path

import h5py
import jsonschema
import kubernetes_validate
import pytest
import yaml

from h5ngff.backends.kubernetes import KubernetesBackend
from h5ngff.jobspec import Owner
from h5ngff.errors import SpecError
from h5ngff.job import load_job, parse_manifest
from h5ngff.runner import plan_job
from test_crd import validate_against_crd

ROOT = Path(__file__).resolve().parents[1]
MANIFESTS = ROOT / "manifests"
#: ConversionJob examples (ConversionBatch examples: tests/test_operator_batch_spec.py).
EXAMPLES = sorted(p for p in (MANIFESTS / "examples").glob("*.yaml") if "kind: ConversionBatch" not in p.read_text())
sys.path.insert(0, str(ROOT / "scripts"))
import render_manifests as rm  # noqa: E402

KUBE_VERSION = "1.33"


def test_the_plain_manifests_are_the_chart_rendering():
    expected = rm.plain_manifests()
    stale = [str(p.relative_to(ROOT)) for p in rm.drifted(expected)]
    assert stale == [], f"{stale} drifted from helm/h5ngff; run scripts/render-manifests"


def test_a_chart_change_shows_up_as_drift(monkeypatch):
    """Negative control: rendering with other values gives a different file."""
    real = rm.render
    monkeypatch.setattr(rm, "render", lambda values=None, **kw: real({"operator": {"interval": 7}}, **kw))
    assert MANIFESTS / "h5ngff.yaml" in rm.drifted(rm.plain_manifests())


def _kustomize_objects() -> list[dict]:
    kustomization = yaml.safe_load((MANIFESTS / "kustomization.yaml").read_text())
    objs = []
    for resource in kustomization["resources"]:
        objs += [d for d in yaml.safe_load_all((MANIFESTS / resource).read_text()) if d]
    return objs


@pytest.mark.slow
def test_kubectl_apply_k_objects_are_valid_kubernetes():
    objs = _kustomize_objects()
    kinds = {o["kind"] for o in objs}
    assert {
        "CustomResourceDefinition",
        "Namespace",
        "Deployment",
        "ServiceAccount",
        "ClusterRole",
        "Role",
        "RoleBinding",
    } <= kinds
    for obj in objs:
        kubernetes_validate.validate(obj, KUBE_VERSION, strict=True)
    (namespace,) = [o for o in objs if o["kind"] == "Namespace"]
    assert {o["metadata"].get("namespace") for o in objs} <= {None, namespace["metadata"]["name"]}
    crd = [o for o in objs if o["kind"] == "CustomResourceDefinition"]
    assert [yaml.safe_dump(c) for c in crd] == [
        yaml.safe_dump(yaml.safe_load((ROOT / f"src/h5ngff/operator/schema/{name}").read_text()))
        for name in ("crd.yaml", "crd-batch.yaml")
    ]


def _runner_account() -> str:
    values = yaml.safe_load((ROOT / "helm/h5ngff/values.yaml").read_text())
    return values["runner"]["serviceAccount"]["name"]


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_each_example_is_valid_for_the_crd_and_loads(path):
    doc = yaml.safe_load(path.read_text())
    validate_against_crd(doc)
    job = load_job(str(path))
    assert job.name == doc["metadata"]["name"]
    account = job.spec.pod.service_account_name
    assert account in (None, _runner_account()), "examples use the runner account the chart creates"
    for mount in job.spec.pod.volume_mounts or ():
        assert mount["mountPath"].startswith("/")


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_broken_examples_are_rejected_by_both(path):
    """Negative control: a misspelt field fails the CRD schema and the job loader alike."""
    doc = yaml.safe_load(path.read_text())
    broken = copy.deepcopy(doc)
    broken["spec"]["resources"]["threadPerWorker"] = 1
    with pytest.raises(jsonschema.ValidationError):
        validate_against_crd(broken)
    with pytest.raises(SpecError, match="threadPerWorker"):
        parse_manifest(broken)


#: Tiny sources with the rank each example's axes need.
SHAPES = {3: (40, 96, 80), 5: (2, 2, 24, 64, 48)}


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_each_example_plans_on_kubernetes(path, tmp_path):
    job = load_job(str(path))
    axes = job.spec.image.axes or "zyx"
    source = tmp_path / "in.h5"
    with h5py.File(source, "w") as f:
        f.create_dataset(job.spec.source.dataset, shape=SHAPES[len(axes)], dtype="uint16")
    spec = job.spec.conversion()
    spec = spec.model_copy(
        update={
            "source": spec.source.model_copy(update={"path": str(source)}),
            "output": spec.output.model_copy(update={"path": str(tmp_path / "out.ome.zarr")}),
        }
    )
    backend = KubernetesBackend(Owner("ns", job.name, "uid"), image="img")
    planned = plan_job(spec, backend)
    plan = planned.plan
    assert plan.workers >= 1 and plan.memory.pod_limit > plan.memory.memory_limit > 0
    if job.spec.resources.memory_total is not None:
        assert plan.workers * plan.memory.pod_limit <= job.spec.resources.memory_total_bytes
    if job.spec.resources.memory_per_worker is not None:
        assert plan.memory.pod_limit <= job.spec.resources.memory_per_worker_bytes
    assert len(plan.levels[0].shape) == len(axes)


def test_the_promised_examples_exist():
    jobs = {p.name: load_job(str(p)) for p in EXAMPLES}
    assert "conversionjob.yaml" in jobs  # the minimal one
    with_pvc = [n for n, j in jobs.items() if any("persistentVolumeClaim" in v for v in j.spec.pod.volumes or ())]
    budget = [n for n, j in jobs.items() if j.spec.resources.memory_total is not None]
    five_d = [n for n, j in jobs.items() if j.spec.image.axes == "tczyx"]
    assert with_pvc and budget and five_d, (with_pvc, budget, five_d)
    separate = [
        n
        for n, j in jobs.items()
        if len(
            {v["persistentVolumeClaim"]["claimName"] for v in j.spec.pod.volumes or () if "persistentVolumeClaim" in v}
        )
        >= 2
    ]
    assert separate, "one example reads from one claim and writes to another"
