"""The runner contract (operator/contract.py): what the controller tells a runner pod, as one value.

Round trips through the environment, refuses what it cannot run with the field's name, and is the
only place the runner's variables are named (the one-definition check at the end)."""

from __future__ import annotations

import ast
import json
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from h5ngff.errors import RunnerContractError
from h5ngff.jobspec import Owner, parse_job_spec
from h5ngff.operator.contract import ENV, SAFE_PATH_ENV, RunnerContract
from h5ngff.operator.controller.manifests import build_runner_job

PACKAGE = Path(__file__).resolve().parents[1] / "src" / "h5ngff"
IDS = st.lists(st.text("0123456789abcdef", min_size=12, max_size=12), max_size=6, unique=True)
NAMES = st.from_regex(r"[a-z]([-a-z0-9]{0,20}[a-z0-9])?", fullmatch=True)


@st.composite
def contracts(draw) -> RunnerContract:
    items = tuple(draw(IDS))
    batch = bool(items) or draw(st.booleans())
    return RunnerContract(
        kind="ConversionBatch" if batch else "ConversionJob",
        namespace=draw(NAMES),
        name=draw(NAMES),
        uid=draw(st.uuids()).hex,
        attempt=draw(st.integers(1, 10_000)),
        spec=draw(st.dictionaries(st.sampled_from(["source", "output", "pod"]), st.dictionaries(NAMES, NAMES))),
        backend=draw(st.sampled_from(["kubernetes", "local", "local-pods"])),
        items=items,
        resume=tuple(draw(st.sets(st.sampled_from(items)))) if items else (),
        metrics_port=draw(st.none() | st.integers(1, 65535)),
        metrics_linger=draw(st.floats(0, 3600, allow_nan=False)),
        pod_limit=draw(st.none() | st.sampled_from(["512Mi", "2Gi"])),
    )


@pytest.mark.slow
@given(contracts())
def test_a_contract_round_trips_through_the_environment(contract):
    env = contract.to_env()
    assert all(isinstance(v, str) for v in env.values())
    assert RunnerContract.from_env(env) == contract


def test_the_runner_job_carries_exactly_its_contract():
    spec = parse_job_spec({"source": {"path": "/d/a.h5", "dataset": "/x"}, "output": {"path": "/d/a.ome.zarr"}})
    job = build_runner_job(Owner("ns", "scan", "uid-1", 3), spec, 3, "img:1", resume=True)
    env = {e["name"]: e["value"] for e in job["spec"]["template"]["spec"]["containers"][0]["env"] if "value" in e}
    contract = RunnerContract.from_env(env)
    assert (contract.kind, contract.namespace, contract.name, contract.uid, contract.attempt) == (
        "ConversionJob",
        "ns",
        "scan",
        "uid-1",
        3,
    )
    assert contract.spec["pod"]["image"] == "img:1" and contract.spec["output"]["overwrite"] is False
    assert env["PYTHONSAFEPATH"] == "1"  # the working directory never goes on the import path
    # Every variable of the container is the contract's, the scratch HOME, or a credential key.
    assert set(env) <= set(ENV.values()) | set(SAFE_PATH_ENV) | {"HOME"}


@pytest.mark.parametrize(
    "env, says",
    [
        ({}, "H5NGFF_JOB_NAMESPACE"),
        ({"H5NGFF_JOB_NAMESPACE": "ns", "H5NGFF_JOB_NAME": "j"}, "H5NGFF_SPEC"),
        ({"H5NGFF_JOB_NAMESPACE": "ns", "H5NGFF_JOB_NAME": "j", "H5NGFF_SPEC": "{"}, "invalid JSON"),
        ({"H5NGFF_JOB_NAMESPACE": "ns", "H5NGFF_JOB_NAME": "j", "H5NGFF_SPEC": "[]"}, "JSON object"),
        ({"H5NGFF_JOB_NAMESPACE": "ns", "H5NGFF_JOB_NAME": "j", "H5NGFF_SPEC": "{}", "H5NGFF_ATTEMPT": "x"}, "int"),
        (
            {"H5NGFF_JOB_NAMESPACE": "ns", "H5NGFF_JOB_NAME": "j", "H5NGFF_SPEC": "{}", "H5NGFF_ATTEMPT": "0"},
            "1 or more",
        ),
        ({"H5NGFF_JOB_NAMESPACE": "ns", "H5NGFF_JOB_NAME": "j", "H5NGFF_SPEC": "{}", "H5NGFF_KIND": "Pod"}, "Pod"),
        (
            {"H5NGFF_JOB_NAMESPACE": "ns", "H5NGFF_JOB_NAME": "j", "H5NGFF_SPEC": "{}", "H5NGFF_RESUME": "a"},
            "H5NGFF_RESUME",
        ),
    ],
)
def test_a_contract_this_build_cannot_run_is_refused_naming_the_variable(env, says):
    with pytest.raises(RunnerContractError, match=says):
        RunnerContract.from_env(env)


def test_the_runner_s_variables_are_named_only_in_the_contract():
    """The scattered H5NGFF_* variables of the runner (issue 41) have one home: no module but the
    contract (and k8s.py, for the two the metrics exporter shares) spells one."""
    wire = {v for k, v in ENV.items() if k not in ("namespace", "name")}
    spelled: dict[str, set[str]] = {}
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and node.value in wire:
                spelled.setdefault(node.value, set()).add(str(path.relative_to(PACKAGE)))
    assert spelled == {name: {"operator/contract.py"} for name in wire}, json.dumps(
        {k: sorted(v) for k, v in spelled.items()}
    )
