"""The property tests' profiles: a short one for CI, a long one anyone can run.

``H5NGFF_PROPERTY_PROFILE=long scripts/properties`` (or ``pytest -m property`` with the variable
set) runs each property test with its long example count; unset, or ``ci``, runs the short one
that keeps the suite within its time. The seed of every run is printed in pytest's header
(tests/conftest.py), and ``--hypothesis-seed=N`` repeats a run.
"""

from __future__ import annotations

import os

PROFILES = ("ci", "long")
PROFILE = os.environ.get("H5NGFF_PROPERTY_PROFILE", "ci")
if PROFILE not in PROFILES:
    raise ValueError(f"H5NGFF_PROPERTY_PROFILE: expected one of {', '.join(PROFILES)}. Got {PROFILE!r} instead.")


def examples(ci: int, long: int) -> int:
    """The number of examples a property test draws under the current profile."""
    return long if PROFILE == "long" else ci
