"""One definition of the phase names (h5ngff.phases): every other copy is derived from it or checked
against it here, so a renamed or added phase cannot leave the metrics, the CRD or the status model
behind."""

from __future__ import annotations

import ast
from pathlib import Path
from typing import get_args

import yaml

from h5ngff.metrics import families
from h5ngff.metrics.operator import OperatorMetrics
from h5ngff.operator.schema.status import ConversionJobStatus
from h5ngff.phases import JOB_PHASES, RUN_PHASES, TERMINAL_PHASES, WRITING_PHASES, Phase

PACKAGE = Path(__file__).resolve().parents[1] / "src" / "h5ngff"
NAMES = {p.value for p in Phase}


def test_the_status_model_and_the_crd_name_the_job_phases():
    literal = get_args(get_args(ConversionJobStatus.model_fields["phase"].annotation)[0])
    assert literal == tuple(JOB_PHASES)
    crd = yaml.safe_load((PACKAGE / "operator" / "schema" / "crd.yaml").read_text())
    schema = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["status"]["properties"]["phase"]
    assert schema["enum"] == list(JOB_PHASES)


def test_the_metrics_label_every_phase():
    assert families.PHASES == RUN_PHASES
    assert "Writing, Finalizing" in families.BY_NAME["h5ngff_job_phase"].help
    metrics = OperatorMetrics()
    labels = [
        s.labels["phase"]
        for m in metrics.registry.collect()
        if m.name == "h5ngff_operator_conversionjobs"
        for s in m.samples
    ]
    assert labels == list(JOB_PHASES)


def test_the_groups_are_subsets():
    assert TERMINAL_PHASES <= set(RUN_PHASES) & set(JOB_PHASES)
    assert WRITING_PHASES <= set(RUN_PHASES) and not WRITING_PHASES & set(JOB_PHASES)


#: Lists that name something else spelled alike: Kubernetes' Pod phases.
NOT_OURS = {"POD_ENDED"}


def _phase_literals(tree: ast.AST) -> tuple[list[str], list[int]]:
    """String literals used as a phase (``phase=...``, ``{"phase": ...}``), and the lines of
    tuples/lists/sets of two or more phase names (a second list of the phases). ``Literal[...]``
    annotations are checked against the enum by the tests above."""
    used, lists = [], []
    skip = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Subscript) and isinstance(node.value, ast.Name) and node.value.id == "Literal":
            skip.update(id(n) for n in ast.walk(node.slice))
        elif isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id in NOT_OURS for t in node.targets):
            skip.update(id(n) for n in ast.walk(node.value))
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.keyword) and node.arg == "phase" and isinstance(node.value, ast.Constant):
            used.append(node.value.value)
        elif isinstance(node, ast.Dict):
            used += [
                v.value
                for k, v in zip(node.keys, node.values)
                if isinstance(k, ast.Constant) and k.value == "phase" and isinstance(v, ast.Constant)
            ]
        elif isinstance(node, (ast.Tuple, ast.List, ast.Set)):
            names = [e.value for e in node.elts if isinstance(e, ast.Constant) and e.value in NAMES]
            if len(names) >= 2:
                lists.append(node.lineno)
    return used, lists


def test_no_module_spells_a_phase_that_does_not_exist_or_lists_the_phases_again():
    problems = []
    for path in PACKAGE.rglob("*.py"):
        if path.name == "phases.py":
            continue
        used, lists = _phase_literals(ast.parse(path.read_text()))
        problems += [f"{path.relative_to(PACKAGE)}: phase {u!r} is not a Phase" for u in used if u not in NAMES]
        problems += [f"{path.relative_to(PACKAGE)}:{line}: a list of phase names (use h5ngff.phases)" for line in lists]
    assert problems == []


def test_negative_control_the_scan_finds_a_typo_and_a_second_list():
    source = 'emit(phase="Writting")\nPHASES = ("Pending", "Planned")\nd = {"phase": "Done"}\nx: Literal["Pending", "Failed"]\n'
    used, lists = _phase_literals(ast.parse(source))
    assert sorted(used) == ["Done", "Writting"] and lists == [2]
