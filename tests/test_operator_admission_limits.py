"""What the API server admitted and the model then refused (the job failed InvalidSpec, or the
operator crashed, minutes after ``kubectl apply``), now refused by both at admission:

1. cross-field rules with no CEL twin (``retry.intervalSeconds: 400`` over the default maximum);
2. byte quantities the parser cannot represent (``1e300Gi`` crashed the model with OverflowError);
3. worker budgets below the smallest plan (64Mi-225Mi passed and could never plan);
4. output and source paths that start like a URL but are none (``s3:/bucket``), or are padded;
5. ``h5ngff operator render`` of the shipped example, refused because the built-in image was
   ``:latest`` while the chart and manifests pin the release.

The CRD side runs through tests/crd_admission.py (real JSON-schema and CEL evaluation). Run once
against 9bb18a8: every test fails there except the controls (a retry interval within its
maximum, local paths with a colon, quantities the model always accepted).
"""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import yaml
from hypothesis import example, given, settings
from hypothesis import strategies as st

from crd_admission import admission_errors, cel_errors
from h5ngff import spec as spec_module
from h5ngff.cli import build_parser, main, spec_from_args
from h5ngff.errors import BudgetTooSmallError, SpecError
from h5ngff.jobspec import ConversionJobSpec, parse_job_spec
from h5ngff.operator.schema import admission
from h5ngff.operator.controller import manifests as operator_manifests
from h5ngff.operator.schema.crd import build_crd
from h5ngff.planner import Capacity, DatasetInfo, make_plan
from h5ngff.planner import memory
from h5ngff.spec import ResourcesSpec, parse_spec
from h5ngff.units import MiB

ROOT = Path(__file__).resolve().parents[1]
BASE = {
    "source": {"path": "/data/in.h5", "dataset": "/volume/data"},
    "output": {"path": "/data/out.ome.zarr"},
    "resources": {"workers": 2, "memoryPerWorker": "1Gi"},
}


def with_(section: str, **values) -> dict:
    doc = copy.deepcopy(BASE)
    doc[section] = {**doc.get(section, {}), **values}
    return doc


@pytest.fixture(scope="module")
def schema() -> dict:
    return build_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]


def model_error(spec: dict) -> SpecError | None:
    try:
        parse_job_spec(spec)
    except SpecError as exc:
        return exc
    return None


def message(error: SpecError) -> str:
    return str(error).removeprefix(f"{error.field}: ")


# --- 1. cross-field rules ----------------------------------------------------------------------


@pytest.mark.parametrize(
    "retry",
    [{"intervalSeconds": 400}, {"intervalSeconds": 20, "maxIntervalSeconds": 10}, {"maxIntervalSeconds": 5}],
    ids=["interval 400, default max 300", "max below interval", "max 5, default interval 10"],
)
def test_a_retry_interval_above_its_maximum_is_refused_at_admission(schema, retry):
    spec = with_("retry", **retry)
    error = model_error(spec)
    assert error is not None and error.field == "retry" and "maxIntervalSeconds" in message(error)
    assert cel_errors(schema, spec) == [
        "spec.retry: retry.maxIntervalSeconds (default 300) must be at least retry.intervalSeconds (default 10)"
    ]


def test_a_retry_interval_within_its_maximum_is_admitted(schema):
    for retry in (
        {"intervalSeconds": 300},
        {"intervalSeconds": 400, "maxIntervalSeconds": 400},
        {"maxIntervalSeconds": 10},
    ):
        spec = with_("retry", **retry)
        assert model_error(spec) is None and admission_errors(schema, spec) == [], retry


def _validators() -> dict[str, str]:
    """Every validator of the ConversionJob spec's models: name -> model."""
    out: dict[str, str] = {}
    todo, seen = [ConversionJobSpec], set()
    while todo:
        model = todo.pop()
        if model in seen:
            continue
        seen.add(model)
        decorators = model.__pydantic_decorators__
        out.update({name: model.__name__ for name in [*decorators.model_validators, *decorators.field_validators]})
        todo += [
            a
            for f in model.model_fields.values()
            for a in (f.annotation, *getattr(f.annotation, "__args__", ()))
            if isinstance(a, type) and hasattr(a, "__pydantic_decorators__")
        ]
    return out


#: Validators whose admission rule's ``why`` names the check, not the validator.
MIRRORED_AS = {
    "_agrees_with_axes": "planner: resolve_",
    "_positive": "positive, one per axis",
    "_slab_positive": "positive, one per axis",
    "_valid_axes": "parse_axes",
    "_known_units": "NGFF (UDUNITS-2) unit names",
    "_positive_scale": "a positive voxel size",
    "_levels_range": "int-or-string",
    "_workers_range": "int-or-string",
    "_axes_letters": "distinct spatial axes",
}
#: Validators with no admission rule, and why none is needed or possible.
NOT_IN_THE_CRD = {
    "_absolute_dataset": "normalises source.dataset (adds the leading '/'); refuses nothing",
    "_path_from_paths": "a default (source.path is the first of source.paths when left out); refuses nothing",
    "_no_sidecar_in_a_bucket": "a default (no checksums for an NGFF 0.4 bucket); refuses nothing",
    "_version_is_a_string": "a type check: the CRD's type string refuses a number",
    "_levels_not_bool": "a type check: int-or-string refuses a boolean",
    "_workers_not_bool": "a type check: int-or-string refuses a boolean",
    "_quantity_not_bool": "a type check: int-or-string refuses a boolean",
}


def test_every_validator_of_the_spec_has_an_admission_rule_or_a_reason():
    whys = " | ".join(r.why for r in (*admission.CEL_RULES, *admission.SCHEMA_RULES))
    missing = [
        f"{model}.{name}"
        for name, model in _validators().items()
        if name not in NOT_IN_THE_CRD and name not in whys and MIRRORED_AS.get(name, "\0") not in whys
    ]
    assert missing == [], f"validators the CRD does not mirror: {missing}"


@pytest.mark.parametrize(
    "slurm",
    [
        {"directives": ["--mem=1G"]},
        {"directives": ["#SBATCH -c 4"]},
        {"directives": ["constraint"]},
        {"partition": "gpu\nx"},
        {"prologue": ["a\nb"]},
    ],
    ids=repr,
)
def test_slurm_settings_the_model_refuses_are_refused_at_admission(schema, slurm):
    spec = with_("slurm", **slurm)
    assert model_error(spec) is not None and admission_errors(schema, spec) != []


def test_a_bare_sbatch_directive_is_a_spec_error_not_a_crash():
    """``#SBATCH`` alone (or ``=x``) left no option word: the validator raised IndexError."""
    for directive in ("#SBATCH", "=x", "#SBATCH   "):
        assert model_error(with_("slurm", directives=[directive])) is not None, directive


@pytest.mark.parametrize("stack", ["x", "cc", ""])
def test_a_stack_the_model_refuses_is_refused_at_admission(schema, stack):
    spec = with_("source", stack=stack)
    assert model_error(spec) is not None and admission_errors(schema, spec) != []


# --- 2. byte quantities ---------------------------------------------------------------------------


def _quantity_fields() -> list[str]:
    """The wire names of every byte-quantity field (those ResourcesSpec._quantity checks)."""
    names = ResourcesSpec.__pydantic_decorators__.field_validators["_quantity"].info.fields
    return [ResourcesSpec.model_fields[n].alias or n for n in names]


def quantity_spec(field: str, value) -> dict:
    doc = copy.deepcopy(BASE)
    doc["resources"] = {"workers": 2, field: value}
    return doc


WEIRD = [
    "1e300Gi",
    "1e400",
    "1e308T",
    "9.3e18",
    "9223372036854775808",
    2**63,
    2**64,
    10**400,
    1e300,
    "nan",
    "NaN",
    "inf",
    "-inf",
    "Infinity",
    "-1Gi",
    "1e-300",
    "1e-300Gi",
    "0x10",
    "0x10Gi",
    "1_000Mi",
    "1e99999Mi",
    "1e+300Ki",
    "1e",
    "e9",
    ".",
    "1..5Gi",
    "1Gi ",
    " 1Gi",
    "1 Gi",
    "1GiB",
    "1gib",
    "1Ei",
    "1Pi",
    "١Gi",
    "1\u00a0Gi",
    "",
    " ",
    "Gi",
    "1e2e3",
    "8e18",
    "1" * 64,
    -1,
    0,
    0.5,
]


@pytest.mark.parametrize("value", WEIRD, ids=repr)
def test_a_weird_quantity_is_a_spec_error_or_a_value_in_every_quantity_field(schema, value):
    for field in _quantity_fields():
        spec = quantity_spec(field, value)
        error = model_error(spec)  # anything but SpecError escapes and fails the test
        if error is not None:
            assert message(error).startswith("Expected ") and " instead" in message(error), message(error)
        else:
            resources = parse_job_spec(spec).resources
            assert (
                memory.minimum_pod_limit()
                <= (resources.memory_per_worker_bytes or resources.memory_total_bytes or 0)
                < 2**63
            )
        if not isinstance(value, int) or -(2**63) <= value < 2**63:  # JSON the API server can hold
            assert (error is None) == (admission_errors(schema, spec) == []), (field, value, error)


def test_an_overflowing_quantity_says_what_is_allowed():
    error = model_error(quantity_spec("memoryPerWorker", "1e300Gi"))
    assert error is not None and error.field == "resources.memoryPerWorker"
    assert (
        message(error)
        == "Expected a byte quantity below 2**63 bytes (8Ei), e.g. '1Gi' or '512MiB'. Got '1e300Gi' instead."
    )


@settings(max_examples=150, deadline=None)
@example("1e300Gi")
@example(10**400)
@given(
    st.one_of(
        st.text(alphabet="0123456789.eE+-xXkKmMgGtTiIbB \tnaf_", max_size=24),
        st.integers(min_value=-(2**70), max_value=2**70),
        st.floats(allow_nan=True, allow_infinity=True),
    )
)
def test_fuzzed_quantities_never_crash_the_model(value):
    for field in _quantity_fields():
        model_error(quantity_spec(field, value))


# --- 3. the smallest worker -------------------------------------------------------------------------


def test_the_spec_floor_is_the_planners_smallest_pod():
    """spec.MIN_WORKER_MEMORY is a number (the spec sits below the planner); it must be the one
    the memory model gives."""
    assert spec_module.MIN_WORKER_MEMORY == memory.minimum_pod_limit(), "update spec.MIN_WORKER_MEMORY"


def cheapest(budget: int) -> dict:
    """The spec that needs least memory: one thread, one level, no zstd context."""
    return {
        "source": {"path": "a.h5", "dataset": "d"},
        "output": {"path": "o", "compressor": {"codec": "gzip"}},
        "pyramid": {"levels": 1},
        "resources": {"workers": 1, "threadsPerWorker": 1, "memoryPerWorker": budget, "allocator": "jemalloc"},
    }


def test_the_floor_plans_and_one_mib_less_never_does():
    floor = memory.minimum_pod_limit()
    ds, cap = DatasetInfo((1, 1), "|u1", 1), Capacity(cores=4, memory_bytes=64 << 30)
    plan = make_plan(ds, parse_spec(cheapest(floor)), cap)
    assert plan.memory.pod_limit == floor
    # Below the floor the spec refuses; the planner, handed such a budget anyway, refuses too.
    below = parse_spec(cheapest(floor))
    below = below.model_copy(
        update={"resources": below.resources.model_copy(update={"memory_per_worker": floor - MiB})}
    )
    with pytest.raises(BudgetTooSmallError) as info:
        make_plan(ds, below, cap)
    assert info.value.minimum_bytes == floor


@pytest.mark.slow
@pytest.mark.parametrize("budget", ["64Mi", "128Mi", "200Mi", 225 * MiB, "0.2Gi"])
@pytest.mark.parametrize("field", ["memoryPerWorker", "memoryTotal"])
def test_a_budget_below_the_smallest_plan_is_refused_at_admission_saying_what_to_set(schema, budget, field):
    floor = f"{memory.minimum_pod_limit() // MiB}Mi"
    spec = quantity_spec(field, budget)
    error = model_error(spec)
    assert error is not None and error.field == f"resources.{field}"
    assert message(error).startswith(
        f"Expected at least {floor}, the smallest worker any plan fits in"
    ) and f"raise it to at least {floor}" in message(error)
    assert cel_errors(schema, spec) == [
        f"spec.resources.{field}: resources.{field} must be at least {floor} (the smallest worker any plan "
        f"fits in) and below 2**63 bytes, as a byte count or a quantity such as 1Gi or 512MiB"
    ]


def test_the_floor_itself_is_admitted(schema):
    floor = memory.minimum_pod_limit()
    for value in (floor, f"{floor // MiB}Mi", str(floor)):
        spec = quantity_spec("memoryPerWorker", value)
        assert model_error(spec) is None and admission_errors(schema, spec) == [], value


# --- 4. URL-like and padded paths -----------------------------------------------------------------

URL_LIKE = [
    "s3:/bucket/x.ome.zarr",
    "S3:/bucket/x.ome.zarr",
    "gs:/bucket/x.ome.zarr",
    "s3:bucket/x.ome.zarr",
    "out:1.ome.zarr",
    "https:/host/x",
    " /data/out.ome.zarr",
    "/data/out.ome.zarr ",
    "\t/data/out.ome.zarr",
    "/data/out.ome.zarr\n",
    " s3://b/x",
]
LOCAL = [
    "./s3:odd",
    "/data/a:b",
    "/data/a://b",
    "C:/data/out.ome.zarr",
    "C:\\data\\out.ome.zarr",
    "data/my out.ome.zarr",
    "o",
]


@pytest.mark.parametrize("path", URL_LIKE, ids=repr)
@pytest.mark.parametrize("section", ["output", "source"])
def test_a_url_like_or_padded_path_is_refused_by_the_model_and_at_admission(schema, section, path):
    spec = with_(section, path=path)
    error = model_error(spec)
    assert error is not None and error.field == f"{section}.path" and message(error).startswith("Expected "), error
    assert admission_errors(schema, spec) != []


@pytest.mark.parametrize("path", LOCAL, ids=repr)
@pytest.mark.parametrize("section", ["output", "source"])
def test_a_local_path_with_a_colon_is_still_a_path(schema, section, path):
    spec = with_(section, path=path)
    assert model_error(spec) is None and admission_errors(schema, spec) == []


def test_the_refusal_says_how_to_write_a_bucket_or_a_local_name():
    error = model_error(with_("output", path="s3:/bucket/x.ome.zarr"))
    assert error is not None
    assert (
        "Write s3://bucket/prefix for a bucket, or ./s3:/bucket/x.ome.zarr for a local directory; nothing was written."
        in message(error)
    )


@pytest.mark.parametrize("output", ["s3:/bucket/x.ome.zarr", "gs:/bucket/x.ome.zarr", " out.ome.zarr"])
def test_cli_convert_refuses_a_url_like_output(output):
    with pytest.raises(SpecError) as info:
        spec_from_args(build_parser().parse_args(["convert", "in.h5:/d", output]))
    assert info.value.field == "output.path"


def test_h5ngff_run_refuses_a_one_slash_s3_output_and_writes_nothing(tmp_path, monkeypatch, capsys):
    import h5py
    import numpy as np

    with h5py.File(tmp_path / "in.h5", "w") as f:
        f.create_dataset("d", data=np.zeros((8, 8), dtype="u1"))
    job = {
        "apiVersion": "h5ngff.dev/v1alpha1",
        "kind": "ConversionJob",
        "metadata": {"name": "j"},
        "spec": {
            "source": {"path": "in.h5", "dataset": "/d"},
            "output": {"path": "s3:/bucket/x.ome.zarr"},
            "resources": {"workers": 1},
        },
    }
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(job))
    monkeypatch.chdir(tmp_path)
    code = main(["run", "job.yaml"])
    assert code != 0 and "output.path" in capsys.readouterr().err
    assert not (tmp_path / "s3:").exists()


# --- 5. the default image -----------------------------------------------------------------------------


def test_the_default_image_is_the_charts_and_the_manifests():
    values = yaml.safe_load((ROOT / "helm/h5ngff/values.yaml").read_text())
    chart = yaml.safe_load((ROOT / "helm/h5ngff/Chart.yaml").read_text())
    assert (
        operator_manifests.DEFAULT_IMAGE
        == f"{values['image']['repository']}:{values['image']['tag'] or chart['appVersion']}"
    )
    deployment = next(
        d for d in yaml.safe_load_all((ROOT / "manifests/h5ngff.yaml").read_text()) if d and d["kind"] == "Deployment"
    )
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    assert container["image"] == operator_manifests.DEFAULT_IMAGE
    assert "--image" not in container.get("args", []) or operator_manifests.DEFAULT_IMAGE in container["args"]
    example = yaml.safe_load((ROOT / "manifests/examples/conversionjob.yaml").read_text())
    assert example["spec"]["pod"]["image"] == operator_manifests.DEFAULT_IMAGE


# ConversionJob examples: `h5ngff operator render` renders a job's runner Job (a batch's: not yet).
@pytest.mark.parametrize(
    "example",
    sorted(p for p in (ROOT / "manifests/examples").glob("*.yaml") if "kind: ConversionBatch" not in p.read_text()),
    ids=lambda p: p.name,
)
def test_render_of_the_shipped_example_succeeds(capsys, monkeypatch, example):
    """Render assumes the chart's operator: its image and its runner account (every example but
    one names that account, which a render without the chart's default refused)."""
    monkeypatch.delenv("H5NGFF_RUNNER_SERVICE_ACCOUNT", raising=False)
    monkeypatch.delenv("H5NGFF_IMAGE", raising=False)
    code = main(["operator", "render", str(example)])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    job = next(d for d in yaml.safe_load_all(captured.out) if d and d["kind"] == "Job")
    pod = job["spec"]["template"]["spec"]
    assert pod["serviceAccountName"] == operator_manifests.CHART_RUNNER_ACCOUNT
    if example.name == "conversionjob.yaml":
        assert pod["containers"][0]["image"] == operator_manifests.DEFAULT_IMAGE


def test_the_charts_runner_account_is_renders_default():
    values = yaml.safe_load((ROOT / "helm/h5ngff/values.yaml").read_text())
    assert values["runner"]["serviceAccount"]["name"] == operator_manifests.CHART_RUNNER_ACCOUNT
