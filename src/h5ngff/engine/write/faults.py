"""Fault injection for tests and drills, switched on only by the ``H5NGFF_FAULTS`` environment
variable (never by a spec or a flag): ``H5NGFF_FAULTS="slab_sleep=0.2,slab_extra_bytes=1GiB"``.

* ``slab_sleep``: seconds each slab task sleeps before writing (slows a run down so a test can
  kill it mid-flight).
* ``slab_gate``: a path; while a file is there, each slab task waits before writing (at most 10
  minutes), so a test holds a run mid-flight for as long as it needs and lets it go at once.
* ``slab_extra_bytes``: each slab task allocates and touches this much memory beyond the plan,
  ``fault_growth_rate`` bytes per second (default 1 GiB/s) - a task that outgrows its plan.
* ``slab_leak_bytes``: each slab task leaves this much memory behind for good - a leak.
* ``rename_sleep``: seconds every chunk or shard write waits with its temporary file written and
  still open, before the rename, so a test can find the writer and kill it there.
* ``crash_at``: the process that creates the output kills itself (SIGKILL, nothing cleaned up) at
  this step of creating it: ``lock`` (the lock taken, nothing else), ``manifest`` (the manifest
  header's bytes written but not yet visible), ``metadata`` (the first array document stored, the
  rest not), ``slab`` (the first slab's chunks written, its manifest record not) or ``finish``
  (every slab recorded, the completion marker not written). Every one must leave an output that
  the same command resumes and ``--overwrite`` replaces.
"""

from __future__ import annotations

import os
import signal
import time

import numpy as np

from ...units import parse_bytes

ENV = "H5NGFF_FAULTS"
_leaked: list[np.ndarray] = []


def active() -> dict[str, str]:
    raw = os.environ.get(ENV, "")
    return dict(item.split("=", 1) for item in raw.split(",") if "=" in item)


def at_slab_start() -> list[np.ndarray]:
    """Apply the slab faults; returns memory the caller must hold until the slab is done."""
    faults = active()
    if not faults:
        return []
    if "slab_sleep" in faults:
        time.sleep(float(faults["slab_sleep"]))
    if "slab_gate" in faults:
        deadline = time.monotonic() + 600
        while os.path.exists(faults["slab_gate"]) and time.monotonic() < deadline:
            time.sleep(0.05)
    if "slab_leak_bytes" in faults:
        _leaked.append(np.ones(parse_bytes(faults["slab_leak_bytes"]), dtype=np.uint8))
    held: list[np.ndarray] = []
    extra = parse_bytes(faults["slab_extra_bytes"]) if "slab_extra_bytes" in faults else 0
    rate = parse_bytes(faults.get("fault_growth_rate", "1GiB"))
    step = 16 << 20
    while extra > 0:
        held.append(np.ones(min(step, extra), dtype=np.uint8))  # touched pages count in RSS
        extra -= step
        time.sleep(step / rate)
    return held


def before_rename() -> None:
    """Apply ``rename_sleep`` (a dictionary lookup when no fault is set: this runs per chunk)."""
    if ENV not in os.environ:
        return
    delay = active().get("rename_sleep")
    if delay:
        time.sleep(float(delay))


#: The steps of creating an output at which ``crash_at`` can kill the process, in order.
CRASH_POINTS = ("lock", "manifest", "metadata", "slab", "finish")


def crash_point(step: str) -> None:
    """SIGKILL this process if ``crash_at`` names ``step`` (a dictionary lookup otherwise)."""
    if ENV in os.environ and active().get("crash_at") == step:
        os.kill(os.getpid(), signal.SIGKILL)
