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
    "k": 10**3,
    "kb": 10**3,
    "ki": 1 << 10,
    "kib": 1 << 10,
    "m": 10**6,
    "mb": 10**6,
    "mi": 1 << 20,
    "mib": 1 << 20,
    "g": 10**9,
    "gb": 10**9,
    "gi": 1 << 30,
    "gib": 1 << 30,
    "t": 10**12,
    "tb": 10**12,
    "ti": 1 << 40,
    "tib": 1 << 40,
}
#: Spaces are named, not ``\s``: Python's ``\s`` also matches Unicode spaces and the vertical tab,
#: RE2's (the API server's, for the CRD's copy of this grammar) does not.
SPACE = r"[ \t\n\f\r]"
_QUANTITY = re.compile(rf"^{SPACE}*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?){SPACE}*([a-zA-Z]*){SPACE}*$")

ALLOWED_UNITS = "a byte count or a number with a unit: Ki, Mi, Gi, Ti (powers of 2), k, M, G, T (powers of 10), optionally ending in B"
#: Bytes a quantity may count: below 2**63, what a Kubernetes quantity (int64) and a C size can
#: hold. Anything larger is a typo; past it, ``1e300Gi`` would overflow to infinity.
MAX_BYTES = 1 << 63


def parse_bytes(value: int | float | str) -> int:
    """Parse a byte quantity; raise ``ValueError`` that says what is allowed."""
    if isinstance(value, bool):
        raise ValueError(f"Expected {ALLOWED_UNITS}. Got {value!r} instead.")
    if isinstance(value, (int, float)):
        if value < 0 or (isinstance(value, float) and not math.isfinite(value)):  # isfinite(10**400) overflows
            raise ValueError(f"Expected a non-negative byte count. Got {value!r} instead.")
        return _bounded(value, value)
    match = _QUANTITY.match(str(value))
    if not match or match.group(2).lower() not in _SUFFIXES:
        raise ValueError(f"Expected {ALLOWED_UNITS}, e.g. '1Gi' or '512MiB'. Got {value!r} instead.")
    # Computed in floating point, as the CRD's CEL rule computes it (operator/schema/admission.py), so
    # the API server and the model refuse the same quantities at the bound.
    return _bounded(float(match.group(1)) * _SUFFIXES[match.group(2).lower()], value)


def _bounded(n: int | float, given: object) -> int:
    if not n < MAX_BYTES:  # also refuses inf and nan, which int() cannot convert
        raise ValueError(
            f"Expected a byte quantity below 2**63 bytes (8Ei), e.g. '1Gi' or '512MiB'. Got {given!r} instead."
        )
    return int(n)


def format_bytes(n: float) -> str:
    """Human-readable, binary units: ``1.5 GiB``."""
    for unit, size in (("TiB", 1 << 40), ("GiB", GiB), ("MiB", MiB), ("KiB", 1 << 10)):
        if abs(n) >= size:
            return f"{n / size:.1f} {unit}"
    return f"{int(n)} B"


def k8s_quantity(n: int) -> str:
    """A Kubernetes memory quantity, rounded up to whole MiB so the limit is never below the plan."""
    return f"{math.ceil(n / MiB)}Mi"
