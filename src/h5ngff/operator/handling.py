"""What the ConversionJob and the ConversionBatch handlers share: when a pass runs, how a failed
pass is counted, and a spec validated once per change (both kinds are passed over every interval,
finished ones too)."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any, Callable, TypeVar

import kopf

from ..errors import SpecError

if TYPE_CHECKING:
    from ..metrics.operator import OperatorMetrics

S = TypeVar("S")


def not_deleted(meta: kopf.Meta, **_: Any) -> bool:
    # Every object gets passes, finished ones too: a pass on a finished, unchanged one costs no
    # API call, and it is where a spec edit is noticed (docs/operator.md, Lifecycle).
    return not meta.get("deletionTimestamp")


def count_error(metrics: OperatorMetrics | None, kind: str) -> None:
    if metrics is not None:
        metrics.reconcile_error(kind)


def parse_once(
    cache: dict[str, tuple[str, tuple[S | None, str | None]]], body: kopf.Body, parse: Callable[[Any], S]
) -> tuple[S | None, str | None]:
    """(the spec, None) or (None, the error), validated once per change of the object's spec."""
    meta, data = body["metadata"], dict(body.get("spec") or {})
    key = json.dumps(data, sort_keys=True, default=str)
    cached = cache.get(meta["uid"])
    if cached is not None and cached[0] == key:
        return cached[1]
    result: tuple[S | None, str | None]
    try:
        result = (parse(data), None)
    except SpecError as exc:
        result = (None, str(exc))
    cache[meta["uid"]] = (key, result)
    return result
