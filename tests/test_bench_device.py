"""bench/device: the bundle that runs the benchmark on a machine with no network. Checked here
without network and quickly: the bundle script's options and package list, its dry run, a bundle
built without wheels, run.sh's syntax and its refusal of the wrong Python, and the helpers run.sh
calls (pregen.py bit for bit against write_sample, preflight.py, summary.py)."""

from __future__ import annotations

import importlib.machinery
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DEVICE = ROOT / "bench" / "device"
BUNDLE = DEVICE / "bundle"
#: Any pip call a test makes by mistake fails instead of reaching a registry.
OFFLINE = {**os.environ, "PIP_NO_INDEX": "1"}


def _bundle_module():
    loader = importlib.machinery.SourceFileLoader("bench_device_bundle", str(BUNDLE))
    spec = importlib.util.spec_from_loader(loader.name, loader)
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    return module


def _run(
    *args: str, cwd: Path = ROOT, env: dict | None = None, timeout: float = 120
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(list(args), cwd=cwd, env=env or OFFLINE, capture_output=True, text=True, timeout=timeout)


def _py(script: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**OFFLINE, "PYTHONPATH": str(ROOT / "src")}
    return _run(sys.executable, str(script), *args, env=env)


def test_bundle_help_names_its_options():
    done = _run(sys.executable, str(BUNDLE), "--help")
    assert done.returncode == 0, done.stderr
    for option in (
        "--out",
        "--python-version",
        "--platform",
        "--with-provided",
        "--worktree",
        "--dry-run",
        "--no-wheels",
    ):
        assert option in done.stdout
    assert os.access(BUNDLE, os.X_OK) and os.access(DEVICE / "run.sh", os.X_OK)


def test_every_package_is_pinned_in_the_lock_with_a_reason():
    bundle = _bundle_module()
    lock = bundle.read_lock()
    with open(ROOT / "requirements" / "lock.txt") as f:
        assert f"dask=={lock['dask']}\n" in f.read()
    groups = (bundle.CARRIED, bundle.PROVIDED, bundle.OPTIONAL)
    names = [n for g in groups for n in g]
    assert len(names) == len({bundle.canonical(n) for n in names}), "a package is listed twice"
    for group in groups:
        for name, why in group.items():
            assert bundle.canonical(name) in lock, f"{name} is not in requirements/lock.txt"
            assert name == bundle.canonical(name) and why.strip()
    # The packages h5ngff itself depends on are carried or provided (hdf5plugin: the stub or --real-hdf5plugin).
    with open(ROOT / "pyproject.toml", "rb") as f:
        import tomllib

        deps = tomllib.load(f)["project"]["dependencies"]
    for dep in deps:
        name = bundle.canonical(dep.split(">")[0].split("<")[0].split("=")[0].split("[")[0].strip())
        assert name in names, f"h5ngff depends on {name}, which the bundle neither carries nor expects"


def test_dry_run_prints_what_it_would_fetch_and_writes_nothing(tmp_path):
    out = tmp_path / "bundle"
    done = _run(sys.executable, str(BUNDLE), "--dry-run", "--out", str(out), "--python-version", "3.12")
    assert done.returncode == 0, done.stderr
    bundle = _bundle_module()
    lock = bundle.read_lock()
    assert (
        "pip download" in done.stdout
        and "--python-version 3.12" in done.stdout
        and "--only-binary=:all:" in done.stdout
    )
    for name in bundle.CARRIED:
        assert f"{name}=={lock[name]}" in done.stdout
    assert "numpy==" not in done.stdout  # provided by the target unless --with-provided
    assert "git archive HEAD" in done.stdout and "libjemalloc.so.2" in done.stdout
    assert not out.exists()
    provided = _run(sys.executable, str(BUNDLE), "--dry-run", "--out", str(out), "--with-provided")
    assert f"numpy=={lock['numpy']}" in provided.stdout and f"tensorstore=={lock['tensorstore']}" in provided.stdout


def test_run_sh_parses():
    done = _run("bash", "-n", str(DEVICE / "run.sh"))
    assert done.returncode == 0, done.stderr


@pytest.fixture(scope="module")
def wheelless(tmp_path_factory):
    """A bundle with no wheels and no jemalloc, for a Python that cannot be this one: built offline."""
    out = tmp_path_factory.mktemp("device") / "bundle"
    done = _run(
        sys.executable, str(BUNDLE), "--out", str(out), "--no-wheels", "--no-jemalloc", "--python-version", "3.0"
    )
    assert done.returncode == 0, done.stdout + done.stderr
    return out


def test_a_bundle_holds_the_tree_at_head_and_the_helpers(wheelless):
    out = wheelless
    head = _run("git", "rev-parse", "HEAD").stdout.strip()
    assert (out / "h5ngff" / "COMMIT").read_text().splitlines()[0] == head
    for path in (
        "h5ngff/bench/cli.py",
        "h5ngff/bench/suite.py",
        "h5ngff/src/h5ngff/cli.py",
        "h5ngff/pyproject.toml",
        "stub/hdf5plugin/__init__.py",
        "run.sh",
        "preflight.py",
        "pregen.py",
        "summary.py",
    ):
        assert (out / path).is_file(), path
    assert os.access(out / "run.sh", os.X_OK)
    assert list((out / "h5ngff" / "src").glob(f"h5ngff-*+g{head[:7]}.dist-info/METADATA"))
    manifest = json.loads((out / "MANIFEST.json").read_text())
    assert manifest["python_version"] == "3.0" and manifest["wheels"] == {} and manifest["h5ngff"]["commit"] == head
    # A second build replaces the first; a folder that is not a bundle is left alone.
    stranger = out.parent / "not-a-bundle"
    stranger.mkdir()
    (stranger / "keep.txt").write_text("mine")
    done = _run(sys.executable, str(BUNDLE), "--out", str(stranger), "--no-wheels", "--no-jemalloc")
    assert done.returncode != 0 and (stranger / "keep.txt").read_text() == "mine"


def test_run_sh_refuses_a_python_the_wheels_are_not_for(wheelless, tmp_path):
    env = {**OFFLINE, "BENCH_PYTHON": sys.executable, "BENCH_SITE": str(tmp_path / "site")}
    done = _run("bash", str(wheelless / "run.sh"), "0.01", str(tmp_path / "out"), env=env)
    assert done.returncode == 2, done.stdout + done.stderr
    log = (tmp_path / "out" / "run.log").read_text()
    assert "the bundle's wheels are for 3.0" in log
    assert not (tmp_path / "site").exists()


def test_pregen_writes_the_input_bit_for_bit(tmp_path):
    done = _py(DEVICE / "pregen.py", "--scale", "0.0005", "--data-dir", str(tmp_path), "--workers", "2", "--check")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "bit-identical to write_sample: True; same layout: True" in done.stdout
    meta = json.loads(next(tmp_path.glob("scale-*/f32.h5.json")).read_text())
    from bench.config import build_cases
    from bench.data import _identity

    assert meta["identity"] == _identity(build_cases(0.0005)["f32"])  # so the suite reuses it


def test_bench_allows_a_scale_above_one():
    done = _run(
        sys.executable,
        "-m",
        "bench",
        "--list",
        "--scale",
        "4",
        "--cases",
        "f32",
        env={**OFFLINE, "PYTHONPATH": f"{ROOT / 'src'}:{ROOT}"},
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "(150, 7536, 4016) float32" in done.stdout


@pytest.mark.slow
def test_preflight_imports_what_the_runs_need():
    done = _py(DEVICE / "preflight.py", "--only", "h5ngff,h5ngff-pyramid,tensorstore")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "preflight ok" in done.stdout and "IMPORT FAILED" not in done.stdout


def test_summary_reads_a_results_file(tmp_path):
    run = {
        "id": "h5ngff",
        "status": "ok",
        "seconds": 2.0,
        "rounds": [2.0, 2.5],
        "wall": 3.0,
        "ratio_limit": 1.1,
        "levels": 1,
        "memory": {"n_workers": 2, "peak_worker": 1e8},
        "extra": {"plan": {"workers": 2, "threads_per_worker": 1}},
        "load1": 0.5,
        "message": "L0 exact",
    }
    failed = {"id": "tensorstore", "status": "error", "seconds": None, "levels": 1, "message": "boom"}
    doc = {
        "command": "bench/run",
        "machine": "m",
        "versions": {"h5ngff": "0.1.0"},
        "cases": [
            {
                "case": {"name": "f32", "shape": [150, 64, 64], "dtype": "float32"},
                "input": {"blosc_ratio": 3.5, "seconds": 0.1},
                "limit": {"cores": 2, "total": 1.8, "totals": [1.8], "seconds": 0.9, "parallel": 1.0, "stages": {}},
                "runs": [run, failed],
            },
            {
                "case": {"name": "u16-4d", "shape": [2, 150, 64, 64], "dtype": "uint16"},
                "input": {},
                "limit": None,
                "limit_error": "no limit",
                "runs": [],
            },
        ],
    }
    path = tmp_path / "results.json"
    path.write_text(json.dumps(doc))
    done = _py(DEVICE / "summary.py", str(path))
    assert done.returncode == 0, done.stdout + done.stderr
    assert "2.00x the measured 2-process limit" in done.stdout and "boom" in done.stdout and "no limit" in done.stdout
