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


def merge_patch(target: Any, patch: Any) -> Any:
    """RFC 7386's MergePatch(Target, Patch), as the Kubernetes API applies a merge patch: an
    object patch merges into the target (a non-object target becomes ``{}``), ``None`` removes a
    key at any depth, anything else (lists included) replaces. The inputs are not modified."""
    if not isinstance(patch, dict):
        return patch
    out = dict(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if value is None:
            out.pop(key, None)
        else:
            # Recurse even where the target has no object: a patch's nested nulls must not survive
            # into the result (they did before, when a new key's value was copied as it was).
            out[key] = merge_patch(out.get(key), value)
    return out


def apply_merge_patch(document: dict[str, Any], patch: dict[str, Any]) -> dict[str, Any]:
    """Apply a JSON merge patch object to a document object (RFC 7386, see ``merge_patch``)."""
    out: dict[str, Any] = merge_patch(document, patch)
    return out
