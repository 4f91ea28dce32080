"""The Grafana dashboard and the Prometheus rule file shipped with h5ngff, and the PromQL inside
them: one place to load them from (the Helm chart and the tests use the same files)."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from importlib import resources
from typing import Any, Iterator

import yaml

DASHBOARD = "dashboards/h5ngff.json"
RULES = "rules/h5ngff-alerts.yaml"

_METRIC = re.compile(r"\bh5ngff_[A-Za-z0-9_]+\b")
_LABEL_VALUES = re.compile(r"^\s*label_values\((?P<expr>.*),\s*(?P<label>[A-Za-z_][A-Za-z0-9_]*)\s*\)\s*$", re.S)
_VARIABLE = re.compile(r"\$\{(\w+)(?::\w+)?\}|\$(\w+)")


def asset_path(name: str) -> str:
    return str(resources.files("h5ngff.metrics").joinpath(name))


def load_dashboard() -> dict[str, Any]:
    with open(asset_path(DASHBOARD)) as f:
        return json.load(f)


def load_rules() -> dict[str, Any]:
    with open(asset_path(RULES)) as f:
        return yaml.safe_load(f)


@dataclass(frozen=True)
class Query:
    where: str  #: panel title + refId, variable name, or rule name
    expr: str
    #: For Grafana ``label_values(expr, label)`` variables: the label the values come from.
    label: str | None = None


def iter_panels(panels: list[dict[str, Any]]) -> Iterator[dict[str, Any]]:
    for panel in panels:
        yield panel
        yield from iter_panels(panel.get("panels", []))


def dashboard_queries(dashboard: dict[str, Any]) -> list[Query]:
    """Every PromQL expression of every panel and every query variable."""
    out = []
    for panel in iter_panels(dashboard.get("panels", [])):
        for target in panel.get("targets", []):
            if target.get("expr"):
                out.append(Query(f"panel {panel.get('title')!r} {target.get('refId')}", target["expr"]))
    for var in dashboard.get("templating", {}).get("list", []):
        if var.get("type") != "query":
            continue
        query = var["query"]["query"] if isinstance(var.get("query"), dict) else var.get("query", "")
        match = _LABEL_VALUES.match(query)
        out.append(
            Query(f"variable {var['name']}", match["expr"], match["label"])
            if match
            else Query(f"variable {var['name']}", query)
        )
    return out


def rule_queries(rules: dict[str, Any]) -> list[Query]:
    return [
        Query(f"rule {r.get('alert') or r.get('record')}", r["expr"].strip())
        for g in rules["groups"]
        for r in g["rules"]
    ]


def referenced_metrics(expr: str) -> set[str]:
    return set(_METRIC.findall(expr))


def unknown_metrics(queries: list[Query], exported: set[str]) -> dict[str, set[str]]:
    """Queries that reference h5ngff metrics not in ``exported``, with those names."""
    out = {}
    for q in queries:
        missing = referenced_metrics(q.expr) - exported
        if missing:
            out[q.where] = missing
    return out


def substitute(expr: str, values: dict[str, str]) -> str:
    """Replace Grafana variables ($name, ${name}, ${name:fmt}); unknown ones raise KeyError."""
    return _VARIABLE.sub(lambda m: values[m.group(1) or m.group(2)], expr)
