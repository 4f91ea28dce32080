"""ConversionJob manifests as files: ``load_job``, ``h5ngff plan job.yaml`` and ``h5ngff run job.yaml``."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from h5ngff.errors import SpecError
from h5ngff.job import load_job
from h5ngff.sample import write_sample

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "manifests/examples/conversionjob.yaml"
H5NGFF = [sys.executable, "-m", "h5ngff.cli"]


def write(tmp_path, doc, name="job.yaml") -> str:
    path = tmp_path / name
    path.write_text(yaml.safe_dump_all(doc) if isinstance(doc, list) else yaml.safe_dump(doc))
    return str(path)


def example() -> dict:
    return yaml.safe_load(EXAMPLE.read_text())


@pytest.mark.parametrize(
    "change, field, words",
    [
        (
            lambda d: d.update(apiVersion="h5ngff.dev/v1"),
            "apiVersion",
            "Expected h5ngff.dev/v1alpha1. Got 'h5ngff.dev/v1' instead.",
        ),
        (lambda d: d.update(kind="Job"), "kind", "Expected a document with kind: ConversionJob"),
        (lambda d: d["metadata"].pop("name"), "metadata.name", "Expected a name"),
        (
            lambda d: d["spec"]["resources"].update(workers=0),
            "spec.resources.workers",
            "Expected 'auto' or an integer from 1 to 4096. Got 0 instead.",
        ),
        (
            lambda d: d["spec"]["pod"]["volumeMounts"].append({"name": "scratch", "mountPath": "/s"}),
            "spec.pod",
            "Got a mount of 'scratch' instead.",
        ),
        (lambda d: d["spec"].update(backofLimit=3), "spec.backofLimit", "Expected no such field"),
    ],
)
def test_manifest_errors_name_the_field(tmp_path, change, field, words):
    doc = example()
    change(doc)
    with pytest.raises(SpecError) as err:
        load_job(write(tmp_path, doc))
    assert err.value.field == field and words in str(err.value)
    assert err.value.exit_code == 2


def test_missing_and_broken_files_say_so(tmp_path):
    with pytest.raises(SpecError, match="does not exist"):
        load_job(str(tmp_path / "nope.yaml"))
    (tmp_path / "bad.yaml").write_text("spec: [unclosed\n")
    with pytest.raises(SpecError, match="valid YAML"):
        load_job(str(tmp_path / "bad.yaml"))


def test_a_file_with_the_crd_and_the_job_yields_the_job(tmp_path):
    crd = yaml.safe_load((ROOT / "manifests/crd.yaml").read_text())
    job = load_job(write(tmp_path, [crd, example()]))
    assert job.name == "demo-sample" and job.spec.resources.workers == 2
    assert job.spec.pod.volumes[0]["persistentVolumeClaim"]["claimName"] == "h5ngff-data"


@pytest.fixture
def demo_dir(tmp_path):
    """A fresh checkout after the README's first command: h5ngff-demo/sample.h5 exists (smaller)."""
    os.makedirs(tmp_path / "h5ngff-demo")
    write_sample(str(tmp_path / "h5ngff-demo/sample.h5"), "/volume/data", (48, 160, 128), "uint16")
    shutil.copytree(ROOT / "manifests", tmp_path / "manifests")
    return tmp_path


@pytest.mark.slow
def test_plan_accepts_a_manifest_and_flags_override_it(demo_dir):
    out = subprocess.run(
        [*H5NGFF, "plan", "manifests/examples/conversionjob.yaml", "--json", "--workers", "1"],
        cwd=demo_dir,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    planned = json.loads(out.stdout)
    assert planned["plan"]["workers"] == 1  # the flag beat the manifest's 2
    assert planned["spec"]["output"]["path"] == "h5ngff-demo/job.ome.zarr" and planned["spec"]["pyramid"]["levels"] == 3


@pytest.mark.slow
def test_run_the_example_manifest_on_a_fresh_checkout(demo_dir):
    out = subprocess.run(
        [*H5NGFF, "run", "manifests/examples/conversionjob.yaml", "--json"],
        cwd=demo_dir,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    doc = json.loads(out.stdout)
    status = doc["status"]
    assert doc["kind"] == "ConversionJob" and doc["metadata"]["name"] == "demo-sample"
    assert status["phase"] == "Succeeded" and status["attempts"] == 1
    assert status["progress"]["slabsDone"] == status["progress"]["slabsTotal"] == status["plan"]["tasks"]
    assert status["plan"]["workers"] == 2 and status["plan"]["levels"] == 3
    from h5ngff.operator.schema.status import ConversionJobStatus

    ConversionJobStatus.model_validate(status)  # what the operator would write, field for field
    import zarr
    from ome_zarr_models.v05 import Image

    image = Image.from_zarr(zarr.open_group(str(demo_dir / "h5ngff-demo/job.ome.zarr"), mode="r"))
    assert len(image.datasets[0]) == 3


@pytest.mark.slow
def test_run_reports_an_unreadable_source_as_the_operator_would(demo_dir):
    doc = example()
    doc["spec"]["source"]["path"] = "h5ngff-demo/missing.h5"
    path = write(demo_dir, doc, "missing.yaml")
    out = subprocess.run([*H5NGFF, "run", path, "--json"], cwd=demo_dir, capture_output=True, text=True, timeout=120)
    assert out.returncode == 2
    status = json.loads(out.stdout)["status"]
    assert status["phase"] == "Failed" and status["reason"] == "SourceUnreadable" and "missing.h5" in status["message"]
