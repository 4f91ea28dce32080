"""The ConversionJob CRD, generated from the pydantic models.

``ConversionJobSpec`` (the spec the CLI also uses) and ``ConversionJobStatus`` give JSON schemas;
``structural`` turns them into the Kubernetes *structural* OpenAPI v3 schema the API server
requires: ``$ref``s inlined, ``anyOf`` with null dropped (omitted = default), ``int | str``
as ``x-kubernetes-int-or-string``, free-form objects as ``x-kubernetes-preserve-unknown-fields``,
no titles, no ``additionalProperties: false`` (the API server prunes unknown fields, and kubectl's
strict field validation reports them). Descriptions stay, so ``kubectl explain cj.spec`` works.

Regenerate the checked-in copies after changing a model (a test fails until you do)::

    python -m h5ngff.operator.crd > src/h5ngff/operator/crd.yaml
    cp src/h5ngff/operator/crd.yaml manifests/crd.yaml
"""

from __future__ import annotations

import copy
import sys
from typing import Any

import yaml
from pydantic import BaseModel

from ..jobspec import ConversionJobSpec
from .admission import apply_rules
from .manifests import GROUP, KIND, PLURAL, VERSION
from .status import ConversionJobStatus

#: JSON-schema keys the structural schema keeps (the rest, e.g. title and default, go).
KEEP = {"type", "description", "properties", "items", "required", "enum", "minimum", "maximum", "minLength", "maxLength",
        "minItems", "maxItems", "pattern", "format", "additionalProperties",
        "x-kubernetes-int-or-string", "x-kubernetes-preserve-unknown-fields", "exclusiveMinimum"}

PRINTER_COLUMNS = [
    {"name": "Phase", "type": "string", "jsonPath": ".status.phase"},
    {"name": "Progress", "type": "string", "jsonPath": ".status.progress.summary"},
    {"name": "Workers", "type": "integer", "jsonPath": ".status.plan.workers"},
    {"name": "Memory/worker", "type": "string", "jsonPath": ".status.plan.podLimit", "description": "Memory request and limit of each Dask worker pod."},
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


def build_crd() -> dict[str, Any]:
    # The admission rules (OpenAPI keys and CEL) the models check in validators.
    spec = apply_rules(schema_of(ConversionJobSpec))
    # Only our own code writes the status, by merge patches; a "required" there could only make
    # the API server reject a partial write of ours.
    status = _without_required(schema_of(ConversionJobStatus))
    root = {
        "type": "object",
        "description": "Converts one HDF5 dataset to OME-Zarr on a Dask cluster sized by a memory plan.",
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
        "metadata": {"name": f"{PLURAL}.{GROUP}", "labels": {"app.kubernetes.io/name": "h5ngff"}},
        "spec": {
            "group": GROUP,
            "scope": "Namespaced",
            "names": {"kind": KIND, "plural": PLURAL, "singular": KIND.lower(), "listKind": f"{KIND}List", "shortNames": ["cj"], "categories": ["h5ngff"]},
            "versions": [{
                "name": VERSION,
                "served": True,
                "storage": True,
                "subresources": {"status": {}},
                "additionalPrinterColumns": PRINTER_COLUMNS,
                "schema": {"openAPIV3Schema": root},
            }],
        },
    }


HEADER = "# Generated by `python -m h5ngff.operator.crd` from h5ngff's pydantic models. Do not edit.\n"


def render() -> str:
    text: str = yaml.safe_dump(build_crd(), sort_keys=False, width=120)  # a str when given no stream
    return HEADER + text


if __name__ == "__main__":
    sys.stdout.write(render())
