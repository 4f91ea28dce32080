"""Import rules (docs/architecture.md, "Layers"), enforced with import-linter.

The contracts live in pyproject.toml ``[tool.importlinter]``. The negative controls copy the real
package to a temporary directory, add one forbidden import, and show that the same contracts fail
on it, naming the contract that broke.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "src" / "h5ngff"
PYPROJECT = ROOT / "pyproject.toml"
LINT_IMPORTS = str(Path(sys.executable).with_name("lint-imports"))


def contracts() -> list[dict]:
    return tomllib.loads(PYPROJECT.read_text())["tool"]["importlinter"]["contracts"]


def lint(package_parent: Path, cwd: Path) -> subprocess.CompletedProcess:
    """Run ``lint-imports`` with our contracts on the package found under ``package_parent``."""
    env = {**os.environ, "PYTHONPATH": str(package_parent)}
    return subprocess.run(
        [LINT_IMPORTS, "--no-cache", str(PYPROJECT)], capture_output=True, text=True, timeout=120, cwd=cwd, env=env
    )


def contract_name(fragment: str) -> str:
    return next(c["name"] for c in contracts() if fragment in c["name"])


def test_the_real_package_keeps_every_contract(tmp_path):
    proc = lint(ROOT / "src", tmp_path)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    n = len(contracts())
    assert f"Contracts: {n} kept, 0 broken." in out, out
    # The rules the design names are all there.
    kinds = {c["name"]: c["type"] for c in contracts()}
    assert list(kinds.values()).count("layers") == 3
    assert list(kinds.values()).count("acyclic_siblings") == 1
    for fragment in (
        "Layers",
        "Engine rooms",
        "planner is pure",
        "kopf only",
        "dask_kubernetes only",
        "prometheus_client only",
        "No import cycles",
        "Operator rooms",
        "controller imports no",
    ):
        assert contract_name(fragment)


def test_siblings_in_a_layer_are_independent():
    """Every layer with more than one module uses "|" (independent), not ":" (siblings may
    import each other, which let cli.py and clijob.py import each other)."""
    layered = [c["layers"] for c in contracts() if c["type"] == "layers"]
    assert layered and not [layer for layers in layered for layer in layers if ":" in layer], layered


def test_no_import_cycle_in_the_package():
    """The whole graph, not only siblings: no module reaches itself through top-level imports
    (function-level imports included, as grimp sees them)."""
    import grimp

    graph = grimp.build_graph("h5ngff")
    modules = sorted(m for m in graph.modules if m.startswith("h5ngff"))
    cycles = []
    for m in modules:
        for imported in graph.find_modules_directly_imported_by(m):
            if (
                imported != m
                and imported.startswith("h5ngff")
                and not _is_package_of(imported, m)
                and not _is_package_of(m, imported)
                and graph.chain_exists(imported, m)
            ):
                cycles.append((m, imported))
    assert not cycles, cycles[:10]


def _is_package_of(package: str, module: str) -> bool:
    # A package's __init__ and its own modules import each other by design (re-exports).
    return module.startswith(package + ".")


def test_every_subpackage_is_a_regular_package():
    """import-linter (grimp) does not see modules in implicit namespace subpackages: a folder
    without __init__.py would silently escape every contract."""
    missing = [
        str(d.relative_to(PACKAGE))
        for d in PACKAGE.rglob("*")
        if d.is_dir() and d.name != "__pycache__" and any(d.glob("*.py")) and not (d / "__init__.py").exists()
    ]
    assert not missing, f"add __init__.py to {missing}"


def test_the_lint_sees_every_module():
    """Negative control for the namespace trap: grimp's graph holds every module on disk."""
    import grimp

    graph = grimp.build_graph("h5ngff")
    on_disk = set()
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        on_disk.add(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
    assert "h5ngff.engine.sources.hdf5" in on_disk and "h5ngff.planner" in on_disk
    assert on_disk <= set(graph.modules), sorted(on_disk - set(graph.modules))


@pytest.fixture
def package_copy(tmp_path):
    """A throwaway copy of the real package to break on purpose."""
    parent = tmp_path / "src"
    shutil.copytree(PACKAGE, parent / "h5ngff", ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    return parent


def test_negative_control_the_unbroken_copy_passes(package_copy, tmp_path):
    proc = lint(package_copy, tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr


VIOLATIONS = [
    # (file to create or extend, line to add, contract that must break)
    ("planner/violation.py", "import h5py\n", "planner is pure"),
    ("planner/violation.py", "import zarr\n", "planner is pure"),
    ("planner/violation.py", "from distributed import Client\n", "planner is pure"),
    ("planner/violation.py", "from ..engine.write import chunkio\n", "Layers"),
    ("planner/violation.py", "from .. import runner\n", "Layers"),
    ("units.py", "from . import spec\n", "Layers"),
    ("engine/violation.py", "from .. import cli\n", "Layers"),
    ("runner.py", "from .operator import handlers\n", "Layers"),
    ("engine/violation.py", "import kopf\n", "kopf only"),
    ("cli.py", "import kopf\n", "kopf only"),
    ("backends/local.py", "from dask_kubernetes.operator import KubeCluster\n", "dask_kubernetes only"),
    ("operator/violation.py", "import dask_kubernetes\n", "dask_kubernetes only"),
    ("runner.py", "import prometheus_client\n", "prometheus_client only"),
    ("backends/violation.py", "from prometheus_client import Gauge\n", "prometheus_client only"),
    # Siblings are independent ("|"): each of these was allowed while layers used ":".
    ("clijob.py", "from .cli import build_parser\n", "Layers"),
    ("clijob.py", "from . import cliverify\n", "Layers"),
    ("backends/violation.py", "from ..engine import progress\n", "Layers"),
    ("engine/violation.py", "from ..backends import cgroups\n", "Layers"),
    ("jobspec.py", "from . import k8s\n", "Layers"),
    ("units.py", "from . import errors\n", "Layers"),
    # The engine's rooms: verify above write, sources and stores apart, shared pieces at the bottom.
    ("engine/write/violation.py", "from ..verify import check\n", "Engine rooms"),
    ("engine/sources/violation.py", "from ..write import chunkio\n", "Engine rooms"),
    ("engine/sources/violation.py", "from ..stores import open_store\n", "Engine rooms"),
    ("engine/stores/violation.py", "from ..sources import hdf5\n", "Engine rooms"),
    ("engine/codecs.py", "from .write import manifest\n", "Engine rooms"),
    # The layers say nothing inside a package: a cycle there breaks the acyclic contract.
    ("engine/progress.py", "from .write import driver\n", "No import cycles"),
    ("operator/schema/status.py", "from . import crd\n", "No import cycles"),
    # The operator's rooms: the controller and the runner pod's program apart, over the schema.
    ("operator/runner/violation.py", "from ..controller import reconcile\n", "Operator rooms"),
    ("operator/schema/violation.py", "from ..controller import lease\n", "Operator rooms"),
    ("operator/contract.py", "from .schema import status\n", "Operator rooms"),
    # The controller converts nothing, directly or through what it imports (issue 41).
    ("operator/controller/violation.py", "import distributed\n", "controller imports no"),
    ("operator/controller/violation.py", "import zarr\n", "controller imports no"),
    ("operator/controller/violation.py", "from ...engine import progress\n", "controller imports no"),
    ("operator/controller/violation.py", "from ...backends import base\n", "controller imports no"),
    ("operator/schema/status.py", "import h5py\n", "controller imports no"),  # reached indirectly
    ("operator/controller/manifests.py", "from ...metrics import exporter\n", "controller imports no"),
]


@pytest.mark.parametrize("target, line, broken", VIOLATIONS, ids=[f"{t}:{line.strip()}" for t, line, _ in VIOLATIONS])
def test_negative_control_each_contract_catches_a_violation(package_copy, tmp_path, target, line, broken):
    path = package_copy / "h5ngff" / target
    path.write_text((path.read_text() if path.exists() else "") + "\n" + line)
    proc = lint(package_copy, tmp_path)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out
    name = contract_name(broken)
    # lint-imports wraps long names; compare with whitespace collapsed.
    flat = re.sub(r"\s+", " ", out)
    assert f"{name} BROKEN" in flat, out
    # Only the contract concerned breaks (and, for planner imports, the layering it also breaks;
    # an upward import also closes a cycle).
    broken_names = {c["name"] for c in contracts() if f"{c['name']} BROKEN" in flat}
    allowed = {
        name,
        contract_name("Layers"),
        contract_name("planner is pure"),
        contract_name("No import cycles"),
        contract_name("Engine rooms"),
        contract_name("Operator rooms"),
        contract_name("controller imports no"),
    }
    assert broken_names <= allowed, broken_names


#: The operator modules that build a backend or run on one (and so may import backends: the
#: factory, the Backend protocol); every other operator module takes Kubernetes names, labels and
#: pod conventions from h5ngff.k8s.
OPERATOR_BUILDS_BACKENDS = {"h5ngff.operator.runner.main", "h5ngff.operator.runner.attempt"}


def operator_imports_of_backends(package_parent: Path) -> set[str]:
    """Operator modules importing h5ngff.backends, in the package found under ``package_parent``
    (grimp in a subprocess, so a broken copy never mixes with the real package)."""
    code = (
        "import grimp, json; g = grimp.build_graph('h5ngff'); "
        "print(json.dumps(sorted({m for m in g.find_descendants('h5ngff.operator') "
        "for i in g.find_modules_directly_imported_by(m) if i.startswith('h5ngff.backends')})))"
    )
    env = {**os.environ, "PYTHONPATH": str(package_parent)}
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env, cwd=package_parent
    )
    assert proc.returncode == 0, proc.stderr
    return set(json.loads(proc.stdout))


def test_the_operator_takes_kubernetes_names_from_the_neutral_module(package_copy):
    assert operator_imports_of_backends(ROOT / "src") <= OPERATOR_BUILDS_BACKENDS
    # Negative control: the import the operator had before h5ngff.k8s is caught.
    lease = package_copy / "h5ngff" / "operator" / "controller" / "lease.py"
    lease.write_text(lease.read_text() + "\nfrom ...backends.kubernetes import labels\n")
    assert "h5ngff.operator.controller.lease" in operator_imports_of_backends(package_copy)


def test_negative_control_a_missing_optional_module_is_tolerated(package_copy, tmp_path):
    """The operator and the kubernetes backend are optional to the contracts: deleting them (as
    before they existed) must not break or crash the lint."""
    shutil.rmtree(package_copy / "h5ngff" / "operator")
    # The operator's own contracts name it and its controller: empty packages stand for them.
    (package_copy / "h5ngff" / "operator" / "controller").mkdir(parents=True)
    (package_copy / "h5ngff" / "operator" / "__init__.py").write_text("")
    (package_copy / "h5ngff" / "operator" / "controller" / "__init__.py").write_text("")
    (package_copy / "h5ngff" / "clirender.py").unlink()
    (package_copy / "h5ngff" / "backends" / "kubernetes.py").unlink()
    for path in (package_copy / "h5ngff").rglob("*.py"):
        text = path.read_text()
        # Cut the imports of the deleted modules so the rest of the package still parses as before.
        kept = [
            ln
            for ln in text.splitlines()
            if not re.search(
                r"\boperator\.(controller|runner|schema|contract|kube)\b|from \.+operator\b|backends\.kubernetes|from \.kubernetes|from \.\.operator|clirender",
                ln,
            )
        ]
        path.write_text("\n".join(kept) + "\n")
    proc = lint(package_copy, tmp_path)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert "does not exist" not in out and "Missing layer" not in out


def controller_loads(module: str) -> list[str]:
    """What importing ``module`` really executes (package __init__s included) of what converts:
    the contract above checks the import graph, this checks ``sys.modules``."""
    code = (
        f"import sys, json; import {module}; "
        "print(json.dumps(sorted(m for m in sys.modules if m.split('.')[0] in {'distributed', 'dask', 'zarr', 'h5py', "
        "'numpy'} or m.startswith(('h5ngff.engine', 'h5ngff.backends', 'h5ngff.planner', 'h5ngff.runner', "
        "'h5ngff.operator.runner')))))"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


@pytest.mark.slow
def test_importing_the_controller_loads_nothing_that_converts():
    assert controller_loads("h5ngff.operator.controller.handlers") == []
    # Negative control: the runner pod's program loads all of it.
    roots = {
        m.split(".")[0] if not m.startswith("h5ngff") else ".".join(m.split(".")[:2])
        for m in controller_loads("h5ngff.operator.runner.main")
    }
    assert {"distributed", "zarr", "h5py", "h5ngff.engine", "h5ngff.backends"} <= roots, roots
