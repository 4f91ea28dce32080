"""Sources in a bucket from the command line and the operator (issue 44): ``h5ngff convert
s3://bucket/run/scan.h5:/data OUT`` with an s3:// output's options (the default) or its own
``--source-storage-option``; ``verify --source s3://...``; a run SIGKILLed mid-run resumes
byte-identical, and a replaced object is refused on resume naming its ETag; the operator
renders a job whose source and output are in a bucket with no volume at all."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
from pathlib import Path

import h5py
import numpy as np
import pytest
import yaml

from conftest import smooth
from h5ngff.cli import main
from h5ngff.errors import ExitCode
from operator_harness import manifest

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[1]
CLI = [sys.executable, "-m", "h5ngff.cli"]


def _env(**extra: str) -> dict[str, str]:
    """No AWS variables: every option comes from the flags under test."""
    clean = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    return {**clean, "PYTHONPATH": str(ROOT / "src") + os.pathsep + os.environ.get("PYTHONPATH", ""), **extra}


def h5ngff(*argv, env=None) -> subprocess.CompletedProcess:
    return subprocess.run([*CLI, *map(str, argv)], capture_output=True, text=True, timeout=180, env=env or _env())


def _flags(flag: str, options: dict[str, str]) -> list[str]:
    return [f for k, v in options.items() for f in (flag, f"{k}={v}")]


def _upload(s3, bucket: str, key: str, data: np.ndarray) -> str:
    buf = io.BytesIO()
    with h5py.File(buf, "w") as f:
        f.create_dataset("volume/data", data=data, chunks=(8, 16, 16), compression="gzip")
    s3.client().put_object(Bucket=bucket, Key=key, Body=buf.getvalue())
    return f"s3://{bucket}/{key}"


def _files(root: Path) -> dict[str, bytes]:
    return {
        str(p.relative_to(root)): p.read_bytes() for p in root.rglob("*") if p.is_file() and ".h5ngff" not in str(p)
    }


@pytest.mark.slow
def test_convert_and_verify_on_the_command_line_with_the_outputs_options_by_default(s3):
    bucket = s3.new_bucket()
    data = smooth((16, 48, 32), "uint16", seed=21)
    url = _upload(s3, bucket, "run/scan.h5", data)
    out = f"s3://{bucket}/out/scan.ome.zarr"
    flags = ["--levels", "2", "--chunks", "8,16,16", "--workers", "1", "--no-progress", "--json"]
    # The output's --storage-option values read the source too (one endpoint for both).
    done = h5ngff("convert", f"{url}:/volume/data", out, *flags, *_flags("--storage-option", s3.options()))
    assert done.returncode == 0, done.stderr[-2000:]
    assert json.loads(done.stdout)["status"] == "Succeeded"
    verified = h5ngff(
        "verify", out, "--json", "--source", f"{url}:/volume/data", *_flags("--storage-option", s3.options())
    )
    report = json.loads(verified.stdout)
    assert verified.returncode == 0 and report["ok"] and report["levels_compared"] == 2, verified.stderr[-2000:]
    # Negative control: the source's own flag wins, and a wrong endpoint there is what is used.
    wrong = {**s3.options(), "endpoint": "http://127.0.0.1:9", "retries": "1", "connect_timeout": "1s"}
    refused = h5ngff(
        "convert",
        f"{url}:/volume/data",
        f"s3://{bucket}/out/other.ome.zarr",
        *flags,
        *_flags("--storage-option", s3.options()),
        *_flags("--source-storage-option", wrong),
    )
    assert refused.returncode != 0 and "127.0.0.1:9" in refused.stderr + refused.stdout


@pytest.mark.slow
def test_a_killed_run_resumes_byte_identical_and_a_replaced_object_is_refused(s3, tmp_path):
    bucket = s3.new_bucket()
    data = smooth((64, 48, 32), "uint16", seed=22)
    url = _upload(s3, bucket, "run/scan.h5", data)
    original = s3.client().get_object(Bucket=bucket, Key="run/scan.h5")["Body"].read()
    flags = ["--chunks", "8,16,16", "--levels", "2", "--slab", "32,48,32", "--workers", "1", "--threads", "1"]
    flags += ["--no-progress", *_flags("--source-storage-option", s3.options())]
    whole = tmp_path / "whole.ome.zarr"
    assert h5ngff("convert", f"{url}:/volume/data", whole, *flags).returncode == 0
    out = tmp_path / "out.ome.zarr"
    killed = h5ngff("convert", f"{url}:/volume/data", out, *flags, env=_env(H5NGFF_FAULTS="crash_at=slab"))
    assert killed.returncode == -9, killed.stderr[-2000:]
    assert _files(out) != _files(whole), "the kill must land mid-run, or the resume proves nothing"
    resumed = h5ngff("convert", f"{url}:/volume/data", out, *flags)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert _files(out) == _files(whole)
    content = json.loads((out / "zarr.json").read_text())["attributes"]["h5ngff"]["content"]["source"]
    assert content["path"] == url and content["etag"] and content["size"] == len(original)
    # Another object under the same key: refused (exit 3), naming the ETag; the original again: complete.
    changed = data.copy()
    changed[30, 20, 10] += 1
    _upload(s3, bucket, "run/scan.h5", changed)
    refused = h5ngff("convert", f"{url}:/volume/data", out, *flags)
    assert refused.returncode == ExitCode.OUTPUT_REFUSED and "etag" in refused.stderr, refused.stderr[-2000:]
    s3.client().put_object(Bucket=bucket, Key="run/scan.h5", Body=original)
    assert h5ngff("convert", f"{url}:/volume/data", out, *flags).returncode == 0


@pytest.mark.slow
def test_the_operator_renders_a_job_whose_source_is_in_a_bucket_with_no_volumes(s3, tmp_path, capsys, monkeypatch):
    bucket = s3.new_bucket()
    _upload(s3, bucket, "run/scan.h5", smooth((32, 64, 48), "uint16", seed=23))
    spec = {
        "source": {"path": f"s3://{bucket}/run/scan.h5", "dataset": "/volume/data"},
        "output": {"path": f"s3://{bucket}/out/scan.ome.zarr", "chunks": [16, 32, 32]},
        "pyramid": {"levels": 2},
        "resources": {"workers": 2, "memoryPerWorker": "1Gi"},
        "pod": {"image": "registry.example/h5ngff:1", "credentialsSecret": "s3-reader"},
    }
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(manifest("scan", spec, namespace="imaging")))
    for key, value in s3.env().items():  # render plans here: it reads the source's metadata from the bucket
        monkeypatch.setenv(key, value)
    code = main(
        ["operator", "render", str(path), "--image", "h5ngff:test", "--allowed-image", "registry.example/*", "--plan"]
    )
    captured = capsys.readouterr()
    assert code == 0, captured.err
    objs = {o["kind"]: o for o in yaml.safe_load_all(captured.out) if o}
    assert set(objs) == {"Role", "RoleBinding", "Job", "DaskCluster"}
    runner = objs["Job"]["spec"]["template"]["spec"]
    worker = objs["DaskCluster"]["spec"]["worker"]["spec"]
    for pod in (runner, worker):
        # No volume holds data: at most the pods' own scratch emptyDir (k8s.SCRATCH_VOLUME).
        assert all(set(v) == {"name", "emptyDir"} for v in pod.get("volumes", [])), pod.get("volumes")
        env = {e["name"]: e for c in pod["containers"] for e in c.get("env", [])}
        assert env["AWS_ACCESS_KEY_ID"]["valueFrom"]["secretKeyRef"]["name"] == "s3-reader"
    terms = {t["name"] for t in json.loads(_plan_json(path))["plan"]["memory"]["terms"]}
    assert {"source requests in flight", "source range buffers", "object store client"} <= terms
    # Negative control: the same job with a key that is not in the bucket renders nothing, exit 2.
    spec["source"]["path"] = f"s3://{bucket}/run/missing.h5"
    path.write_text(yaml.safe_dump(manifest("scan", spec, namespace="imaging")))
    code = main(
        ["operator", "render", str(path), "--image", "h5ngff:test", "--allowed-image", "registry.example/*", "--plan"]
    )
    captured = capsys.readouterr()
    assert code == ExitCode.BAD_INPUT and not captured.out.strip() and "missing.h5 does not exist" in captured.err


def _plan_json(path: Path) -> str:
    proc = h5ngff(
        "plan",
        "--kubernetes",
        "--json",
        path,
        env={**_env(), **{k: v for k, v in os.environ.items() if k.startswith("AWS_")}},
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc.stdout


def test_a_batch_items_object_keeps_its_url_under_a_working_dir():
    """A ConversionBatch item in a bucket is its URL as the pods see it; a relative local path
    still resolves against pod.workingDir (the control)."""
    from h5ngff.operator.schema.batchspec import parse_batch_spec

    spec = parse_batch_spec(
        {
            "output": {"path": "s3://scans/out/{stem}.ome.zarr"},
            "pod": {"workingDir": "/data"},
            "items": [
                {"source": {"path": "s3://raw/run/a.h5", "dataset": "/d"}},
                {"source": {"path": "run/b.h5", "dataset": "/d"}},
            ],
        }
    )
    items = spec.planned_items()
    assert [i.item.path for i in items] == ["s3://raw/run/a.h5", "/data/run/b.h5"]
    assert [i.item.output for i in items] == ["s3://scans/out/a.ome.zarr", "s3://scans/out/b.ome.zarr"]
