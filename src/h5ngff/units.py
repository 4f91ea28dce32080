"""Byte quantities as people write them: ``1Gi`` (Kubernetes), ``1GiB`` (Dask), ``512MB``, ``2e9``.

Kept dependency-free so the planner and the spec can use it.
"""

from __future__ import annotations

import math
import re

MiB = 1 << 20
GiB = 1 << 30

_SUFFIXES = {
    "": 1,
    "b": 1,
    "k": 10**3, "kb": 10**3, "ki": 1 << 10, "kib": 1 << 10,
    "m": 10**6, "mb": 10**6, "mi": 1 << 20, "mib": 1 << 20,
    "g": 10**9, "gb": 10**9, "gi": 1 << 30, "gib": 1 << 30,
    "t": 10**12, "tb": 10**12, "ti": 1 << 40, "tib": 1 << 40,
}
_QUANTITY = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([a-zA-Z]*)\s*$")

ALLOWED_UNITS = "a byte count or a number with a unit: Ki, Mi, Gi, Ti (powers of 2), k, M, G, T (powers of 10), optionally ending in B"


def parse_bytes(value: int | float | str) -> int:
    """Parse a byte quantity; raise ``ValueError`` that says what is allowed."""
    if isinstance(value, bool):
        raise ValueError(f"Expected {ALLOWED_UNITS}. Got {value!r} instead.")
    if isinstance(value, (int, float)):
        if value < 0 or not math.isfinite(value):
            raise ValueError(f"Expected a non-negative byte count. Got {value!r} instead.")
        return int(value)
    match = _QUANTITY.match(str(value))
    if not match or match.group(2).lower() not in _SUFFIXES:
        raise ValueError(f"Expected {ALLOWED_UNITS}, e.g. '1Gi' or '512MiB'. Got {value!r} instead.")
    return int(float(match.group(1)) * _SUFFIXES[match.group(2).lower()])


def format_bytes(n: float) -> str:
    """Human-readable, binary units: ``1.5 GiB``."""
    for unit, size in (("TiB", 1 << 40), ("GiB", GiB), ("MiB", MiB), ("KiB", 1 << 10)):
        if abs(n) >= size:
            return f"{n / size:.1f} {unit}"
    return f"{int(n)} B"


def k8s_quantity(n: int) -> str:
    """A Kubernetes memory quantity, rounded up to whole MiB so the limit is never below the plan."""
    return f"{math.ceil(n / MiB)}Mi"
