"""The static checks that scripts/test runs before pytest (ruff and mypy, configured in
pyproject.toml) really fail on a finding, and mypy's strict mode reaches the modules it names.

Each check runs on a small file in a temporary tree with the project's own configuration, next to
a control that passes, so a configuration that silently checks nothing fails here."""

from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "pyproject.toml"


def _run(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", *args], cwd=cwd, capture_output=True, text=True, timeout=240)


def test_ruff_fails_on_an_unused_import_and_a_bugbear_finding(tmp_path):
    (tmp_path / "bad.py").write_text("import os\n\n\ndef f(x=[]):\n    return x\n")
    (tmp_path / "good.py").write_text("import os\n\n\ndef f(x=None):\n    return os.sep, x\n")
    bad = _run("ruff", "check", "--config", str(CONFIG), "--no-cache", "bad.py", cwd=tmp_path)
    assert bad.returncode == 1, bad.stdout + bad.stderr
    assert "F401" in bad.stdout and "B006" in bad.stdout
    good = _run("ruff", "check", "--config", str(CONFIG), "--no-cache", "good.py", cwd=tmp_path)
    assert good.returncode == 0, good.stdout + good.stderr


def test_the_tree_is_formatted(tmp_path):
    done = _run("ruff", "format", "--check", "--no-cache", "src", "tests", "bench", "scripts", cwd=ROOT)
    assert done.returncode == 0, done.stdout + done.stderr
    # Negative control: an unformatted file is found.
    (tmp_path / "ugly.py").write_text("x = {  'a':1 }\n")
    ugly = _run(
        "ruff", "format", "--check", "--no-cache", "--config", str(CONFIG), str(tmp_path / "ugly.py"), cwd=tmp_path
    )
    assert ugly.returncode == 1, ugly.stdout + ugly.stderr


def test_the_tree_passes_ruff():
    done = _run("ruff", "check", "--no-cache", "src", "tests", "bench", "scripts", cwd=ROOT)
    assert done.returncode == 0, done.stdout + done.stderr


def _package(tmp_path: Path, module: str, text: str) -> Path:
    """A file at ``h5ngff/<module path>.py`` in a throwaway tree, so mypy names it as in the project."""
    path = tmp_path.joinpath("h5ngff", *module.split(".")).with_suffix(".py")
    folder = path.parent
    while folder != tmp_path:
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "__init__.py").touch()
        folder = folder.parent
    path.write_text(text)
    return path


UNTYPED = "def double(x):\n    return x * 2\n"


@pytest.mark.slow
def test_mypy_is_strict_below_the_cli_default_above_and_fails_on_a_finding(tmp_path):
    """One mypy run (the slow part) over five files: an untyped function is a finding in the
    planner, the engine, the backends and the operator (strict) but not in the runner (default
    mode), where a wrong return type still is."""
    files = [
        _package(tmp_path, "planner.untyped", UNTYPED),
        _package(tmp_path, "engine.write.untyped", UNTYPED),
        _package(tmp_path, "backends.untyped", UNTYPED),
        _package(tmp_path, "operator.untyped", UNTYPED),
        _package(tmp_path, "runner", UNTYPED + "def f() -> int:\n    return 'one'\n"),
    ]
    done = _run(
        "mypy",
        "--config-file",
        str(CONFIG),
        "--no-incremental",
        "--cache-dir",
        str(tmp_path / "cache"),
        *(str(f.relative_to(tmp_path)) for f in files),
        cwd=tmp_path,
    )
    assert done.returncode == 1, done.stdout + done.stderr
    found = {
        (line.split(":")[0], line.rsplit("[", 1)[-1].rstrip("]"))
        for line in done.stdout.splitlines()
        if ": error:" in line
    }
    assert found == {
        ("h5ngff/planner/untyped.py", "no-untyped-def"),
        ("h5ngff/engine/write/untyped.py", "no-untyped-def"),
        ("h5ngff/backends/untyped.py", "no-untyped-def"),
        ("h5ngff/operator/untyped.py", "no-untyped-def"),
        ("h5ngff/runner.py", "return-value"),
    }, done.stdout


def test_no_module_is_exempt_from_mypy():
    """The issue-29 rule: no ``ignore_errors`` override hides a module's findings."""
    config = tomllib.loads(CONFIG.read_text())["tool"]["mypy"]
    assert not [o for o in config.get("overrides", []) if o.get("ignore_errors")], config.get("overrides")
