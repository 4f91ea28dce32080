"""The ConversionJob CRD: generated from the models, checked in twice, structural, and the
example manifest is valid against it."""

from __future__ import annotations

import copy
from pathlib import Path

import jsonschema
import kubernetes_validate
import pytest
import yaml
from pydantic import BaseModel

from h5ngff.job import load_job
from h5ngff.jobspec import ConversionJobSpec
from h5ngff.operator.schema.crd import PRINTER_COLUMNS, build_crd, render
from h5ngff.operator.schema.status import ConversionJobStatus

ROOT = Path(__file__).resolve().parents[1]
COPIES = [ROOT / "src/h5ngff/operator/schema/crd.yaml", ROOT / "manifests/crd.yaml"]
EXAMPLE = ROOT / "manifests/examples/conversionjob.yaml"
FORBIDDEN = {"$ref", "$defs", "anyOf", "oneOf", "allOf", "not", "title", "default", "const", "nullable"}
REGENERATE = "python -m h5ngff.operator.schema.crd > src/h5ngff/operator/schema/crd.yaml && cp src/h5ngff/operator/schema/crd.yaml manifests/crd.yaml"


@pytest.mark.parametrize("path", COPIES, ids=lambda p: str(p.relative_to(ROOT)))
def test_checked_in_crd_matches_the_models(path):
    assert path.read_text() == render(), (
        f"{path.relative_to(ROOT)} drifted from the models; regenerate it: {REGENERATE}"
    )


def openapi_schema() -> dict:
    return build_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]


def _model_fields(model: type[BaseModel], prefix: str = "") -> set[str]:
    """Every field path of a model, camelCase, recursing into nested models."""
    out = set()
    for name, info in model.model_fields.items():
        path = f"{prefix}{info.alias or name}"
        out.add(path)
        for arg in (info.annotation, *getattr(info.annotation, "__args__", ())):
            if isinstance(arg, type) and issubclass(arg, BaseModel):
                out |= _model_fields(arg, path + ".")
            for inner in getattr(arg, "__args__", ()):
                if isinstance(inner, type) and issubclass(inner, BaseModel):
                    out |= _model_fields(inner, path + ".")
    return out


def _schema_fields(node: dict, prefix: str = "") -> set[str]:
    """Field paths of the schema; properties of a free-form Kubernetes object (declared only so
    CEL rules can read them, e.g. a volume's name) are not fields of the model."""
    out = set()
    if node.get("x-kubernetes-preserve-unknown-fields"):
        return out
    for name, sub in node.get("properties", {}).items():
        out.add(prefix + name)
        out |= _schema_fields(sub, prefix + name + ".")
        if "items" in sub:
            out |= _schema_fields(sub["items"], prefix + name + ".")
    return out


def test_every_model_field_is_in_the_schema_and_nothing_else():
    schema = openapi_schema()["properties"]
    assert _schema_fields(schema["spec"]) == _model_fields(ConversionJobSpec)
    assert _schema_fields(schema["status"]) == _model_fields(ConversionJobStatus)


def test_a_model_change_shows_up_as_drift():
    """Negative control for the drift test: the rendering follows the model."""
    from h5ngff.operator.schema import crd

    class Changed(ConversionJobSpec):
        priority_class_name: str | None = None

    original = crd.ConversionJobSpec
    crd.ConversionJobSpec = Changed
    try:
        assert render() != COPIES[0].read_text()
        assert "priorityClassName" in render()
    finally:
        crd.ConversionJobSpec = original


def _walk(node, path="$"):
    yield path, node
    if isinstance(node, dict):
        for key, value in node.items():
            yield from _walk(value, f"{path}.{key}")
    elif isinstance(node, list):
        for i, value in enumerate(node):
            yield from _walk(value, f"{path}[{i}]")


def test_the_schema_is_structural():
    """Kubernetes' rules for structural schemas (apiextensions v1)."""
    for path, node in _walk(openapi_schema()):
        if not isinstance(node, dict) or path.endswith((".properties", ".enum", ".required")):
            continue
        if (
            path.split(".")[-2:-1] == ["properties"]
            or path == "$"
            or path.endswith((".items", ".additionalProperties"))
        ):
            assert not FORBIDDEN & set(node), f"{path} uses {FORBIDDEN & set(node)}"
            kinds = {"type", "x-kubernetes-int-or-string", "x-kubernetes-preserve-unknown-fields"} & set(node)
            assert kinds, f"{path} has no type"
            if node.get("x-kubernetes-int-or-string"):
                assert "type" not in node, path
            assert not ("properties" in node and "additionalProperties" in node), path
            if node.get("type") == "array":
                assert "items" in node, path


def test_the_crd_is_a_valid_kubernetes_object():
    crd = yaml.safe_load(COPIES[1].read_text())
    kubernetes_validate.validate(crd, "1.30", strict=True)
    version = crd["spec"]["versions"][0]
    assert crd["metadata"]["name"] == "conversionjobs.h5ngff.dev" and crd["spec"]["names"]["shortNames"] == ["cj"]
    assert version["name"] == "v1alpha1" and version["subresources"] == {"status": {}}
    assert [c["name"] for c in version["additionalPrinterColumns"] if "priority" not in c] == [
        "Phase",
        "Progress",
        "Workers",
        "Memory/worker",
        "Age",
    ]


def test_printer_columns_point_at_status_fields():
    status = openapi_schema()["properties"]["status"]
    for column in PRINTER_COLUMNS:
        path = column["jsonPath"].lstrip(".").split(".")
        if path[0] == "metadata":
            continue
        node = {"properties": {"status": status}}
        for part in path:
            node = node["properties"][part]
        assert node.get("type") == column["type"], column


def as_json_schema(node):
    """The CRD schema as JSON Schema that also rejects unknown fields (kubectl --validate=strict)."""
    node = copy.deepcopy(node)
    for _, sub in _walk(node):
        if not isinstance(sub, dict):
            continue
        if sub.pop("x-kubernetes-int-or-string", False):
            sub["type"] = ["integer", "string"]
        if "properties" in sub and not sub.get("x-kubernetes-preserve-unknown-fields"):
            sub["additionalProperties"] = False
        sub.pop("x-kubernetes-preserve-unknown-fields", None)
    return node


def validate_against_crd(doc: dict) -> None:
    schema = as_json_schema(openapi_schema())
    schema["properties"]["metadata"] = {"type": "object"}
    # OpenAPI v3.0's boolean exclusiveMinimum is draft 4's
    jsonschema.Draft4Validator(schema).validate(doc)


def test_the_example_is_valid_for_the_crd_and_the_model():
    doc = yaml.safe_load(EXAMPLE.read_text())
    validate_against_crd(doc)
    job = load_job(str(EXAMPLE))
    assert job.spec.source.path == "h5ngff-demo/sample.h5" and job.spec.source.dataset == "/volume/data"
    assert job.spec.output.path.startswith("h5ngff-demo/")


@pytest.mark.parametrize(
    "change",
    [
        lambda d: d["spec"]["resources"].update(memoryPerWorkr="1Gi"),  # a typo
        lambda d: d["spec"]["output"].update(ngffVersion=0.5),  # unquoted: a number, not a string
        lambda d: d["spec"]["output"].update(chunks="64,64,64"),
        lambda d: d["spec"].update(backoffLimit=-1),
        lambda d: d["spec"]["pyramid"].update(method="median"),
        lambda d: d["spec"].pop("source"),
    ],
    ids=["typo", "float-version", "chunks-string", "negative-backoff", "unknown-method", "no-source"],
)
def test_the_crd_rejects_broken_manifests(change):
    """Negative controls: the validation above is not vacuous."""
    doc = yaml.safe_load(EXAMPLE.read_text())
    change(doc)
    with pytest.raises(jsonschema.ValidationError):
        validate_against_crd(doc)


def test_int_or_string_fields_take_both():
    doc = yaml.safe_load(EXAMPLE.read_text())
    doc["spec"]["resources"].update(workers="auto", memoryPerWorker=2**30)
    doc["spec"]["pyramid"]["levels"] = "auto"
    validate_against_crd(doc)
