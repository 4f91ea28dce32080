"""Nested-dict merges, shared by the CLI (flags over a spec file) and the operator (status patches)."""

from __future__ import annotations

from typing import Any


def deep_merge(first: dict[str, Any], second: dict[str, Any]) -> dict[str, Any]:
    """``second`` over ``first``: nested dicts merge, anything else (lists, None) replaces. As a
    combination of two merge patches it keeps ``None``s, which delete when the patch is applied."""
    out = dict(first)
    for key, value in second.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = deep_merge(out[key], value)
        else:
            out[key] = value
    return out


def apply_merge_patch(document: dict[str, Any], patch: dict[str, Any]) -> dict[str, Any]:
    """Apply a JSON merge patch (RFC 7386: dicts merge, None deletes, lists replace), as the
    Kubernetes API does."""
    out = dict(document)
    for key, value in patch.items():
        if value is None:
            out.pop(key, None)
        elif isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = apply_merge_patch(out[key], value)
        else:
            out[key] = value
    return out
