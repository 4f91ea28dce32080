"""The API server's admission of a ConversionJob ``.spec``, emulated: the CRD's OpenAPI schema
through a real JSON-schema validator, then every CEL ``x-kubernetes-validations`` rule through a
real CEL implementation (cel-python, ``import celpy``).

KMock does not evaluate CEL, and no API server runs here. cel-python implements standard CEL;
Kubernetes adds libraries, of which the CRD uses one function, ``find`` (Kubernetes' regex
library: the first match of a regex, or ''), provided here with the same meaning.
"""

from __future__ import annotations

import copy
import json
import re
from functools import lru_cache
from typing import Any

import celpy
import jsonschema
from celpy import celtypes


def _find(text: Any, pattern: Any) -> celtypes.StringType:
    match = re.search(str(pattern), str(text))
    return celtypes.StringType(match.group(0) if match else "")


FUNCTIONS = {"find": _find}
#: The interpreting runner: cel-python's transpiling runner (faster) mishandles ``has()`` and
#: custom functions in 0.5.0.
_ENV = celpy.Environment()


@lru_cache(maxsize=None)
def program(rule: str):
    return _ENV.program(_ENV.compile(rule), functions=FUNCTIONS)


def as_json_schema(node: dict[str, Any]) -> dict[str, Any]:
    """The OpenAPI v3.0 schema as JSON Schema draft 4 (same boolean exclusiveMinimum), rejecting
    unknown fields as ``kubectl --validate=strict`` does."""
    node = copy.deepcopy(node)

    def walk(sub: Any) -> None:
        if isinstance(sub, dict):
            if sub.pop("x-kubernetes-int-or-string", False):
                sub["type"] = ["integer", "string"]
            if "properties" in sub and not sub.get("x-kubernetes-preserve-unknown-fields"):
                sub["additionalProperties"] = False
            sub.pop("x-kubernetes-preserve-unknown-fields", None)
            sub.pop("x-kubernetes-validations", None)
            for value in sub.values():
                walk(value)
        elif isinstance(sub, list):
            for value in sub:
                walk(value)

    walk(node)
    return node


@lru_cache(maxsize=64)
def _validator(schema_json: str) -> jsonschema.Draft4Validator:
    return jsonschema.Draft4Validator(as_json_schema(json.loads(schema_json)))


def openapi_errors(schema: dict[str, Any], value: Any) -> list[str]:
    validator = _validator(json.dumps(schema, sort_keys=True))
    return [f"{'.'.join(map(str, e.absolute_path))}: {e.message}" for e in validator.iter_errors(value)]


@lru_cache(maxsize=None)
def _breaks(rule: str, value_json: str) -> bool:
    """Whether ``value`` breaks ``rule``; an evaluation error counts as a break, as the API server
    reports it as invalid too. Cached: cel-python interprets, at milliseconds per rule."""
    try:
        ok = program(rule).evaluate({"self": celpy.json_to_cel(json.loads(value_json))})
    except celpy.CELEvalError:
        return True
    return not (isinstance(ok, celtypes.BoolType) and bool(ok))


def cel_failures(schema: dict[str, Any], value: Any, path: str = "spec") -> list[tuple[str, str, str]]:
    """(where, rule, message) of every CEL rule of ``schema`` and its descendants ``value`` breaks."""
    out = []
    for rule in schema.get("x-kubernetes-validations", ()):
        if _breaks(rule["rule"], json.dumps(value, sort_keys=True)):
            out.append((path, rule["rule"], rule["message"]))
    if isinstance(value, dict):
        for key, sub in (schema.get("properties") or {}).items():
            if key in value:
                out += cel_failures(sub, value[key], f"{path}.{key}")
    if isinstance(value, list) and "items" in schema:
        for i, item in enumerate(value):
            out += cel_failures(schema["items"], item, f"{path}[{i}]")
    return out


def cel_errors(schema: dict[str, Any], value: Any) -> list[str]:
    return [f"{where}: {message}" for where, _, message in cel_failures(schema, value)]


def admission_errors(spec_schema: dict[str, Any], spec: Any) -> list[str]:
    """What the API server would refuse: schema errors first; CEL runs on schema-valid values
    (the API server also skips rules whose inputs failed their own schema)."""
    errors = openapi_errors(spec_schema, spec)
    return errors or cel_errors(spec_schema, spec)
