"""The ConversionBatch spec: the model (a ConversionJob's fields, items and an output template),
its CRD (generated, checked in, structural, the job's admission rules on every item's source),
the example manifest, and the tenant policy applied as to a job."""

from __future__ import annotations

import copy
from pathlib import Path

import jsonschema
import kubernetes_validate
import pytest
import yaml

from crd_admission import admission_errors, as_json_schema
from h5ngff.errors import SpecError
from h5ngff.jobspec import ConversionJobSpec
from h5ngff.operator.schema.batchspec import ConversionBatchSpec, item_id, parse_batch_spec
from h5ngff.operator.schema.batchstatus import ConversionBatchStatus
from h5ngff.operator.schema.crd import BATCH_PRINTER_COLUMNS, build_batch_crd, render
from h5ngff.operator.schema.policy import TenantPolicy, policy_violations
from test_crd import FORBIDDEN, _model_fields, _schema_fields, _walk

ROOT = Path(__file__).resolve().parents[1]
COPIES = [
    ROOT / "src/h5ngff/operator/schema/crd-batch.yaml",
    ROOT / "manifests/crd-batch.yaml",
    ROOT / "helm/h5ngff/crds/conversionbatches.h5ngff.dev.yaml",
]
EXAMPLE = ROOT / "manifests/examples/conversionbatch.yaml"
BASE = {
    "output": {"path": "/data/out/{stem}.ome.zarr"},
    "items": [{"source": {"path": "/data/a.h5", "dataset": "/d"}}, {"source": {"path": "/data/b.h5", "dataset": "/d"}}],
}


def _spec_schema() -> dict:
    return build_batch_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]


@pytest.mark.parametrize("path", COPIES, ids=lambda p: str(p.relative_to(ROOT)))
def test_checked_in_batch_crd_matches_the_models(path):
    assert path.read_text() == render("ConversionBatch"), (
        f"{path} drifted: python -m h5ngff.operator.schema.crd batch > src/h5ngff/operator/schema/crd-batch.yaml"
    )


def test_the_batch_crd_is_structural_and_valid_kubernetes():
    crd = build_batch_crd()
    kubernetes_validate.validate(crd, "1.33", strict=True)
    for path, node in _walk(crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]):
        if isinstance(node, dict) and (
            path.split(".")[-2:-1] == ["properties"] or path.endswith((".items", ".additionalProperties"))
        ):
            assert not FORBIDDEN & set(node), f"{path} uses {FORBIDDEN & set(node)}"
            assert {"type", "x-kubernetes-int-or-string", "x-kubernetes-preserve-unknown-fields"} & set(node), (
                f"{path} has no type"
            )
    assert [c["name"] for c in BATCH_PRINTER_COLUMNS] == [
        "Phase",
        "Total",
        "Succeeded",
        "Failed",
        "Running",
        "Reason",
        "Attempts",
        "Age",
    ]
    assert crd["spec"]["names"]["kind"] == "ConversionBatch" and crd["spec"]["names"]["shortNames"] == ["cb"]


def test_every_batch_field_is_in_the_schema_and_nothing_else():
    schema = build_batch_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]
    job_fields = {f for f in _model_fields(ConversionJobSpec) if not f.startswith("source")}
    items = {
        "items",
        "itemsInFlight",
        "items.output",
        *("items." + f for f in _model_fields(ConversionJobSpec) if f.startswith("source")),
    }
    assert _schema_fields(schema["spec"]) == job_fields | items  # the job's fields, reused, the items and their pace
    status = _model_fields(ConversionBatchStatus)
    reports = {f for f in status if f.startswith("itemReports.")}
    assert _schema_fields(schema["status"]) == status - reports  # itemReports is a map: its entries' fields are below
    assert {
        "itemReports." + f
        for f in _schema_fields(schema["status"]["properties"]["itemReports"]["additionalProperties"])
    } == reports


def test_items_get_their_own_conversion_spec_from_the_template():
    spec = parse_batch_spec(
        {
            **BASE,
            "resources": {"memoryPerWorker": "1Gi"},
            "items": [
                *BASE["items"],
                {"source": {"path": "/data/c.h5", "dataset": "/d"}, "output": "/data/out/c-retake.ome.zarr"},
            ],
        }
    )
    items = spec.planned_items()
    assert [p.output for p in items] == ["/data/out/a.ome.zarr", "/data/out/b.ome.zarr", "/data/out/c-retake.ome.zarr"]
    assert all(isinstance(p.spec, ConversionJobSpec) and p.spec.resources.memory_per_worker == "1Gi" for p in items)
    assert items[0].item.source == "/data/a.h5:/d" and items[0].id == item_id("/data/out/a.ome.zarr")
    # The item's hash is the hash the same ConversionJob would have: one definition.
    job = ConversionJobSpec.model_validate(
        {
            "source": {"path": "/data/a.h5", "dataset": "/d"},
            "output": {"path": "/data/out/a.ome.zarr"},
            "resources": {"memoryPerWorker": "1Gi"},
        }
    )
    assert items[0].conversion_hash() == job.conversion_hash()
    assert len({p.conversion_hash() for p in items}) == 3


def test_items_in_flight_is_the_batchs_and_no_items_conversion():
    """spec.itemsInFlight: 2 by default, 1-64; how the batch runs, so no item's spec carries it
    and changing it re-runs nothing (each item's conversion hash is the same)."""
    plain, four = parse_batch_spec(BASE), parse_batch_spec({**BASE, "itemsInFlight": 4})
    assert (plain.items_in_flight, four.items_in_flight) == (2, 4)
    assert [p.conversion_hash() for p in plain.planned_items()] == [p.conversion_hash() for p in four.planned_items()]
    for bad in (0, 65):
        with pytest.raises(SpecError) as err:
            parse_batch_spec({**BASE, "itemsInFlight": bad})
        assert err.value.field == "itemsInFlight"


def test_relative_paths_resolve_against_the_working_directory():
    spec = parse_batch_spec(
        {
            **BASE,
            "output": {"path": "out/{parent}/{stem}.ome.zarr"},
            "pod": {"workingDir": "/work"},
            "items": [{"source": {"path": "day1/a.h5", "dataset": "/d"}}],
        }
    )
    (item,) = spec.planned_items()
    assert item.item.path == "/work/day1/a.h5" and item.id == item_id("/work/out/day1/a.ome.zarr")


@pytest.mark.parametrize(
    "change, field",
    [
        (
            lambda d: d["items"].append({"source": {"path": "/other/a.h5", "dataset": "/d"}}),
            "output",
        ),  # two sources, one output
        (
            lambda d: d["items"].append(
                {"source": {"path": "/data/c.h5", "dataset": "/d"}, "output": "/data/out/a.ome.zarr/x.ome.zarr"}
            ),
            "output",
        ),
        (lambda d: d["output"].update(path="/data/out/{nope}.ome.zarr"), "output.path"),
        (lambda d: d.update(source={"path": "/data/a.h5", "dataset": "/d"}), "source"),
        (lambda d: d["items"][0]["source"].update(path="gs://bucket/a.h5"), "items[0].source.path"),
        (lambda d: d["items"][0].update(output=""), "items[0].output"),
        (lambda d: d.update(activeDeadlineSeconds=3600), "activeDeadlineSeconds"),
        (lambda d: d.update(retry={"intervalSeconds": 5}), "retry"),
    ],
    ids=[
        "two-to-one",
        "nested",
        "unknown-field",
        "top-level-source",
        "url-source",
        "empty-output",
        "job-deadline",
        "job-retry",
    ],
)
def test_bad_batches_are_refused_naming_the_field(change, field):
    data = copy.deepcopy(BASE)
    change(data)
    with pytest.raises(SpecError) as err:
        parse_batch_spec(data)
    assert err.value.field == field, err.value


def test_two_items_with_one_explicit_output_are_told_to_give_each_its_own():
    """The hint was the command line's ("add a field ... to the template") for items whose
    outputs the manifest names one by one."""
    data = copy.deepcopy(BASE)
    data["items"] = [
        {"source": {"path": "/data/a.h5", "dataset": "/d"}, "output": "/data/out/same.ome.zarr"},
        {"source": {"path": "/data/b.h5", "dataset": "/d"}, "output": "/data/out/same.ome.zarr"},
    ]
    with pytest.raises(
        SpecError, match=r"both written to .*give each of them an output of its own \(items\[\]\.output\)"
    ):
        parse_batch_spec(data)


def test_admission_refuses_what_the_model_refuses_for_item_sources():
    """The job's rules on source apply to each item's source (CEL included), and a valid batch passes."""
    schema = _spec_schema()
    assert admission_errors(schema, BASE) == []
    url = copy.deepcopy(BASE)
    url["items"][1]["source"]["path"] = "gs://bucket/b.h5"
    assert any("items[1].source.path" in e and "gs://" in e for e in admission_errors(schema, url))
    with pytest.raises(SpecError):
        parse_batch_spec(url)
    both = {
        **copy.deepcopy(BASE),
        "resources": {"memoryPerWorker": "1Gi", "memoryTotal": "4Gi"},
    }  # a job-level rule, as for a job
    assert admission_errors(schema, both) and pytest.raises(SpecError, parse_batch_spec, both)
    # A job's deadline and retry backoff: refused at admission as by the operator, never pruned
    # (a field the schema dropped would be ignored silently).
    for extra in ({"activeDeadlineSeconds": 60}, {"retry": {"intervalSeconds": 5}}):
        errors = admission_errors(schema, {**copy.deepcopy(BASE), **extra})
        assert any("does not support them yet" in e for e in errors), errors


def _with(**changes) -> dict:
    """BASE with its first item's output, or the template, or a top-level field changed."""
    spec = copy.deepcopy(BASE)
    if "item_output" in changes:
        spec["items"][0]["output"] = changes.pop("item_output")
    if "template" in changes:
        spec["output"]["path"] = changes.pop("template")
    return {**spec, **changes}


#: Issue 41: rows the CRD admitted and the model refused (an item's own output skipped the
#: output.path rules; a template field's format spec), or the other way round ("3").
BATCH_ROWS = {
    "an item with its own output": (_with(item_output="/data/x.ome.zarr"), True),
    "an item writing to a bucket": (_with(item_output="s3://bucket/x.ome.zarr"), True),
    "a template with escaped braces": (_with(template="/data/{{a:b}}/{stem}.ome.zarr"), True),
    "an item output with a leading space": (_with(item_output=" /data/x"), False),
    "an item output like a URL without //": (_with(item_output="s3:/b/p"), False),
    "an item output of an unknown scheme": (_with(item_output="gs://b/x.ome.zarr"), False),
    "a template field with a width": (_with(template="/data/out/{stem:>100000000}.zarr"), False),
    "an item template field with a conversion": (_with(item_output="/data/{stem!r}.ome.zarr"), False),
    "levels as a string": (_with(pyramid={"levels": "3"}), False),
    "mounts /a and /a/": (
        _with(
            pod={
                "volumes": [{"name": "v", "emptyDir": {}}],
                "volumeMounts": [{"name": "v", "mountPath": "/a"}, {"name": "v", "mountPath": "/a/"}],
            }
        ),
        False,
    ),
}


def _model_admits(spec: dict) -> bool:
    try:
        parse_batch_spec(spec)
    except SpecError:
        return False
    return True


@pytest.mark.parametrize("name", BATCH_ROWS)
def test_the_batch_crd_and_the_model_give_one_answer(name):
    spec, admitted = BATCH_ROWS[name]
    assert _model_admits(spec) is admitted
    assert (admission_errors(_spec_schema(), spec) == []) is admitted


def test_without_the_item_output_rules_the_crd_admits_what_the_model_refuses():
    """Negative control: the item's output node as it was (no rules of its own)."""
    schema = _spec_schema()
    schema["properties"]["items"]["items"]["properties"]["output"].pop("x-kubernetes-validations")
    admitted = {name for name, (spec, _) in BATCH_ROWS.items() if admission_errors(schema, spec) == []}
    assert {"an item output with a leading space", "an item output like a URL without //"} <= admitted


def test_the_example_is_valid_for_the_crd_and_the_model():
    doc = yaml.safe_load(EXAMPLE.read_text())
    schema = as_json_schema(build_batch_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"])
    jsonschema.Draft4Validator(schema).validate(doc)
    assert admission_errors(_spec_schema(), doc["spec"]) == []
    spec = parse_batch_spec(doc["spec"])
    assert [p.output for p in spec.planned_items()] == [
        "/out/2026-11-03/cell_01.ome.zarr",
        "/out/2026-11-03/cell_02.ome.zarr",
        "/out/2026-11-03/cell_03-retake.ome.zarr",
    ]
    broken = copy.deepcopy(doc)
    broken["spec"]["resources"]["threadPerWorker"] = 1  # negative control: a typo fails both
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.Draft4Validator(schema).validate(broken)
    with pytest.raises(SpecError, match="threadPerWorker"):
        parse_batch_spec(broken["spec"])


def test_the_tenant_policy_applies_to_a_batch_as_to_a_job():
    policy = TenantPolicy(allowed_images=("registry.example/*",))
    ok = parse_batch_spec({**BASE, "pod": {"image": "registry.example/h5ngff:1"}})
    assert isinstance(ok, ConversionBatchSpec) and policy_violations(ok, policy, "h5ngff:test", None) == []
    bad = parse_batch_spec(
        {
            **BASE,
            "pod": {
                "image": "evil.example/miner:1",
                "volumes": [{"name": "root", "hostPath": {"path": "/"}}],
                "volumeMounts": [{"name": "root", "mountPath": "/host"}],
            },
        }
    )
    found = policy_violations(bad, policy, "h5ngff:test", None)
    assert any("spec.pod.image" in v for v in found) and any("hostPath" in v for v in found)


def test_every_test_the_lifecycle_tables_name_exists():
    """docs/operator.md's ConversionJob and ConversionBatch lifecycle tables name real tests (a
    renamed test fails here), and every row of issue 41 (§) names one."""
    import re

    docs = (ROOT / "docs/operator.md").read_text()
    tables = [
        docs.split("## Lifecycle", 1)[1].split("\n\n", 3)[2],
        docs.split("### ConversionBatch lifecycle", 1)[1].split("\n\n", 3)[2],
    ]
    defined = set()
    for path in (ROOT / "tests").glob("test_*.py"):
        defined |= set(re.findall(r"(?:def|class) (test_[a-z0-9_]+|Test[A-Za-z]+)", path.read_text()))
        defined |= set(re.findall(r"^(Test[A-Za-z]+) = ", path.read_text(), re.M))
    for table in tables:
        named = set(re.findall(r"`(test_[a-z0-9_]+|Test[A-Za-z]+)`", table))
        assert len(named) >= 10 and named <= defined, named - defined
        issue_41 = [row for row in table.splitlines() if row.startswith("| §")]
        assert issue_41 and all(re.search(r"`(test_|Test)", row) for row in issue_41), issue_41
