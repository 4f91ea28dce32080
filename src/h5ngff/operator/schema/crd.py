"""The ConversionJob and ConversionBatch CRDs, generated from the pydantic models.

``ConversionJobSpec`` (the spec the CLI also uses) and ``ConversionJobStatus`` give JSON schemas;
``structural`` turns them into the Kubernetes *structural* OpenAPI v3 schema the API server
requires: ``$ref``s inlined, ``anyOf`` with null dropped (omitted = default), ``int | str``
as ``x-kubernetes-int-or-string``, free-form objects as ``x-kubernetes-preserve-unknown-fields``,
no titles, no ``additionalProperties: false`` (the API server prunes unknown fields, and kubectl's
strict field validation reports them). Descriptions stay, so ``kubectl explain cj.spec`` works.

Regenerate the checked-in copies after changing a model (a test fails until you do)::

    python -m h5ngff.operator.schema.crd > src/h5ngff/operator/schema/crd.yaml
    cp src/h5ngff/operator/schema/crd.yaml manifests/crd.yaml
    python -m h5ngff.operator.schema.crd batch > src/h5ngff/operator/schema/crd-batch.yaml
    cp src/h5ngff/operator/schema/crd-batch.yaml manifests/crd-batch.yaml

Each CRD is a file of its own (one YAML document each): tools and tests that read ``crd.yaml``
as one document keep working, and a cluster can take the ConversionJob CRD alone.
"""

from __future__ import annotations

import copy
import sys
from typing import Any

import yaml
from pydantic import BaseModel

from ...batch.items import FORMATTED_FIELD_PATTERN
from ...jobspec import BATCH_KIND, BATCH_PLURAL, GROUP, KIND, PLURAL, VERSION, ConversionJobSpec
from .admission import _cel_string, apply_rules
from .batchspec import ConversionBatchSpec
from .batchstatus import ConversionBatchStatus
from .status import ConversionJobStatus

#: JSON-schema keys the structural schema keeps (the rest, e.g. title and default, go).
KEEP = {
    "type",
    "description",
    "properties",
    "items",
    "required",
    "enum",
    "minimum",
    "maximum",
    "minLength",
    "maxLength",
    "minItems",
    "maxItems",
    "pattern",
    "format",
    "additionalProperties",
    "x-kubernetes-int-or-string",
    "x-kubernetes-preserve-unknown-fields",
    "exclusiveMinimum",
}

PRINTER_COLUMNS: list[dict[str, Any]] = [
    {"name": "Phase", "type": "string", "jsonPath": ".status.phase"},
    {"name": "Progress", "type": "string", "jsonPath": ".status.progress.summary"},
    {"name": "Workers", "type": "integer", "jsonPath": ".status.plan.workers"},
    {
        "name": "Memory/worker",
        "type": "string",
        "jsonPath": ".status.plan.podLimit",
        "description": "Memory request and limit of each Dask worker pod.",
    },
    {"name": "Reason", "type": "string", "jsonPath": ".status.reason", "priority": 1},
    {"name": "Attempts", "type": "integer", "jsonPath": ".status.attempts", "priority": 1},
    {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
]


BATCH_PRINTER_COLUMNS: list[dict[str, Any]] = [
    {"name": "Phase", "type": "string", "jsonPath": ".status.phase"},
    {"name": "Total", "type": "integer", "jsonPath": ".status.total"},
    {"name": "Succeeded", "type": "integer", "jsonPath": ".status.succeeded"},
    {"name": "Failed", "type": "integer", "jsonPath": ".status.failed"},
    {"name": "Running", "type": "integer", "jsonPath": ".status.running"},
    {"name": "Reason", "type": "string", "jsonPath": ".status.reason", "priority": 1},
    {"name": "Attempts", "type": "integer", "jsonPath": ".status.attempts", "priority": 1},
    {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
]


def _resolve(node: Any, defs: dict[str, Any]) -> Any:
    if isinstance(node, dict):
        if "$ref" in node:
            target = copy.deepcopy(defs[node["$ref"].rsplit("/", 1)[-1]])
            extra = {k: v for k, v in node.items() if k != "$ref"}
            return _resolve({**target, **extra}, defs)
        return {k: _resolve(v, defs) for k, v in node.items()}
    if isinstance(node, list):
        return [_resolve(v, defs) for v in node]
    return node


def _collapse_any_of(node: dict[str, Any]) -> dict[str, Any]:
    members = [m for m in node["anyOf"] if m.get("type") != "null"]
    rest = {k: v for k, v in node.items() if k != "anyOf"}
    if len(members) == 1:
        return {**members[0], **rest}
    types = {m.get("type") for m in members}
    if types == {"integer", "string"} or rest.get("x-kubernetes-int-or-string"):
        return {**rest, "x-kubernetes-int-or-string": True}
    raise ValueError(f"No structural form for anyOf of {sorted(map(str, types))} in {rest.get('description', node)!r}")


def structural(node: dict[str, Any]) -> dict[str, Any]:
    """A pydantic JSON schema (``$ref``s already resolved) as a Kubernetes structural schema."""
    if "anyOf" in node:
        node = _collapse_any_of(node)
    if "const" in node:
        node = {**{k: v for k, v in node.items() if k != "const"}, "enum": [node["const"]]}
    out = {k: v for k, v in node.items() if k in KEEP}
    if out.get("x-kubernetes-int-or-string"):
        out.pop("type", None)
        out.pop("enum", None)  # e.g. const "auto": the planner checks the string
    if "properties" in out:
        out["properties"] = {k: structural(v) for k, v in out["properties"].items()}
        out.pop("additionalProperties", None)
    elif out.get("type") == "object":
        extra = out.pop("additionalProperties", True)
        if isinstance(extra, dict) and extra:
            out["additionalProperties"] = structural(extra)
        else:
            out["x-kubernetes-preserve-unknown-fields"] = True  # dict[str, Any]: a Kubernetes object
    if "items" in out:
        out["items"] = structural(out["items"])
    if "required" in out:
        out["required"] = sorted(out["required"])
    order = ["type", "description"]
    return {**{k: out[k] for k in order if k in out}, **{k: v for k, v in out.items() if k not in order}}


def schema_of(model: type[BaseModel]) -> dict[str, Any]:
    raw = model.model_json_schema(by_alias=True)
    return structural(_resolve({k: v for k, v in raw.items() if k != "$defs"}, raw.get("$defs", {})))


def _without_required(node: Any) -> Any:
    if isinstance(node, dict):
        return {k: _without_required(v) for k, v in node.items() if k != "required"}
    if isinstance(node, list):
        return [_without_required(v) for v in node]
    return node


def _crd(
    kind: str,
    plural: str,
    short: str,
    description: str,
    spec: dict[str, Any],
    status: dict[str, Any],
    columns: list[dict[str, Any]],
) -> dict[str, Any]:
    root = {
        "type": "object",
        "description": description,
        "required": ["spec"],
        "properties": {
            "apiVersion": {"type": "string"},
            "kind": {"type": "string"},
            "metadata": {"type": "object"},
            "spec": spec,
            "status": status,
        },
    }
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": f"{plural}.{GROUP}", "labels": {"app.kubernetes.io/name": "h5ngff"}},
        "spec": {
            "group": GROUP,
            "scope": "Namespaced",
            "names": {
                "kind": kind,
                "plural": plural,
                "singular": kind.lower(),
                "listKind": f"{kind}List",
                "shortNames": [short],
                "categories": ["h5ngff"],
            },
            "versions": [
                {
                    "name": VERSION,
                    "served": True,
                    "storage": True,
                    "subresources": {"status": {}},
                    "additionalPrinterColumns": columns,
                    "schema": {"openAPIV3Schema": root},
                }
            ],
        },
    }


def build_crd() -> dict[str, Any]:
    # The admission rules (OpenAPI keys and CEL) the models check in validators.
    spec = apply_rules(schema_of(ConversionJobSpec))
    # Only our own code writes the status, by merge patches; a "required" there could only make
    # the API server reject a partial write of ours.
    status = _without_required(schema_of(ConversionJobStatus))
    return _crd(
        KIND,
        PLURAL,
        "cj",
        "Converts one HDF5 dataset to OME-Zarr on a Dask cluster sized by a memory plan.",
        spec,
        status,
        PRINTER_COLUMNS,
    )


def batch_spec_schema() -> dict[str, Any]:
    """The ConversionBatch ``.spec`` schema with a ConversionJob's admission rules: the rules of
    ``source`` go to every item's source (the job's own source node, rules and all), the rest
    (output template, resources, pod) apply as they are."""
    spec = schema_of(ConversionBatchSpec)
    spec["properties"]["source"] = copy.deepcopy(schema_of(ConversionJobSpec)["properties"]["source"])
    apply_rules(spec)
    source = spec["properties"].pop("source")
    item = spec["properties"]["items"]["items"]["properties"]
    item["source"] = source
    _template_rules(spec["properties"]["output"]["properties"]["path"], item["output"])
    # Kept in the schema (a pruned field would be dropped silently) and refused, as the operator
    # refuses them (batchspec: a batch has no deadline or retry backoff yet).
    for name in ("activeDeadlineSeconds", "retry"):
        spec["properties"][name]["description"] = "A ConversionJob's; not supported on a ConversionBatch yet (refused)."
    spec.setdefault("x-kubernetes-validations", []).append(
        {
            "rule": "!has(self.activeDeadlineSeconds) && !has(self.retry)",
            "message": "activeDeadlineSeconds and retry are a ConversionJob's: a ConversionBatch does not support them yet",
        }
    )
    return spec


def _template_rules(template: dict[str, Any], item_output: dict[str, Any]) -> None:
    """An item's own ``output`` is a path as ``output.path`` is (its rules, named for it), and
    both are templates whose fields take no format spec (batch.items._parts)."""
    formatted = {
        "rule": f"!self.matches('{_cel_string(FORMATTED_FIELD_PATTERN)}')",
        "message": "template fields take no format spec or conversion: write {stem}, {name} or {parent}",
    }
    for rule in template.get("x-kubernetes-validations", ()):
        item_output.setdefault("x-kubernetes-validations", []).append(
            {**rule, "message": rule["message"].replace("output.path", "items[].output")}
        )
    for node, name in ((template, "output.path"), (item_output, "items[].output")):
        node.setdefault("x-kubernetes-validations", []).append(
            {**formatted, "message": f"{name}'s {formatted['message']}"}
        )


def build_batch_crd() -> dict[str, Any]:
    status = _without_required(schema_of(ConversionBatchStatus))
    return _crd(
        BATCH_KIND,
        BATCH_PLURAL,
        "cb",
        "Converts many HDF5 datasets to OME-Zarr through one runner and one Dask cluster sized for the largest.",
        batch_spec_schema(),
        status,
        BATCH_PRINTER_COLUMNS,
    )


HEADER = "# Generated by `python -m h5ngff.operator.schema.crd` from h5ngff's pydantic models. Do not edit.\n"


def render(kind: str = KIND) -> str:
    """The CRD of ``kind`` (ConversionJob or ConversionBatch) as its checked-in file holds it."""
    crd = build_batch_crd() if kind == BATCH_KIND else build_crd()
    text: str = yaml.safe_dump(crd, sort_keys=False, width=120)  # a str when given no stream
    return HEADER + text


if __name__ == "__main__":
    sys.stdout.write(render(BATCH_KIND if sys.argv[1:] == ["batch"] else KIND))
