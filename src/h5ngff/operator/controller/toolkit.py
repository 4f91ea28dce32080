"""The reconcile steps a ConversionJob and a ConversionBatch share, typed.

Both kinds run attempts: one runner Job each, whose pods (the runner, the Dask scheduler and
workers) write outputs held by output Leases. The rules that keep one writer per output are the
same for both, so they are written once, here, and ``reconcile`` (a job) and ``batchreconcile``
(a batch) only say what differs:

* ``current_job``: is the current attempt's runner Job there, ended, gone after it existed, or
  unknown (asked for by a pass that did not live to see it)? A missing Job is looked up by name
  before it counts as gone.
* ``pods_gate``: has every pod of the object exited? Asked before a Lease goes back and before a
  new attempt starts; while pods run, the DaskCluster is deleted (again) and the step waits.
* ``conversion_changed``: does the spec convert something else than what ran? Compared on the
  normalised conversion (defaults left out), so writing a default out, removing one or an upgrade
  that adds a defaulted field never re-runs a finished conversion.

Pure: each step is a function of what the controller observed, returning either what it needs to
look up first, a wait, or nothing (go on).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Literal, Mapping, Sequence

from .diagnose import JobSummary, live_pods

#: What a pass can be asked to look up before a decision: the runner Job by name, the pods (and the
#: runner Job's Events), the output Lease(s).
Lookup = Literal["job", "pods", "events", "lease", "leases"]


@dataclass(frozen=True)
class Need:
    """Look these up, then decide again (each at most once per pass)."""

    what: frozenset[str]

    @classmethod
    def of(cls, *what: Lookup) -> "Need":
        return cls(frozenset(what))


@dataclass(frozen=True)
class Wait:
    """Pods of an earlier attempt still run: delete the DaskCluster (again) and decide later."""

    pods: tuple[str, ...]

    def message(self, what: str) -> str:
        names = ", ".join(self.pods[:5]) + (", ..." if len(self.pods) > 5 else "")
        return f"{what} waits until {len(self.pods)} pod(s) that may still write have exited: {names}."


JobState = Literal["present", "ended", "vanished", "unknown"]


@dataclass(frozen=True)
class CurrentJob:
    """The current attempt's runner Job as far as the controller can tell.

    * ``present``: it exists and runs (or waits to);
    * ``ended``: it exists and completed or failed;
    * ``vanished``: it existed (its uid was recorded, or its runner reported) and is gone: deleted,
      or its TTL ran out;
    * ``unknown``: it is not there and nothing says it ever was: asked for by a pass that did not
      live to record it, or refused. Creating it again is safe only with overwrite off.
    """

    state: JobState
    job: JobSummary | None = None


def current_job(
    jobs: Iterable[JobSummary], name: str | None, uid: str | None, runner_spoke: bool, job_checked: bool
) -> CurrentJob | Need:
    """Classify the runner Job ``name`` of the current attempt from the index (``jobs``) and what
    the status says about it: its recorded ``uid``, and whether its runner reported anything."""
    job = next((j for j in jobs if j.name == name), None) if name else None
    if job is not None:
        return CurrentJob("ended" if job.state in ("succeeded", "failed") else "present", job)
    if not job_checked:  # the index may lag (a replica that just took over): ask the API by name
        return Need.of("job")
    return CurrentJob("vanished" if uid or runner_spoke else "unknown")


def pods_gate(pods: Sequence[Mapping[str, object]], pods_checked: bool) -> Need | Wait | None:
    """None once no pod of the object may still run (and write); else what to do first."""
    if not pods_checked:
        return Need.of("pods")
    running = live_pods(tuple(dict(p) for p in pods))
    return Wait(tuple(running)) if running else None


def conversion_changed(
    recorded: str | None, current: str, accepted: Iterable[str], generation: int, compared_at: int | None
) -> bool:
    """True when the spec's conversion is not the one recorded: its normalised hash differs, and
    none of the hashes other builds computed for the same spec (``accepted``) matches either. At
    the generation the hash was last compared at nobody edited the spec, so a differing hash
    there comes from another operator build, never from a change: only a later generation
    counts."""
    if not recorded or not current or recorded == current or recorded in set(accepted):
        return False
    return generation != compared_at


def without(leases: Iterable[str], kept: Iterable[str]) -> tuple[str, ...]:
    """The Leases to give back, minus any the new status still records as held: a decision never
    releases a Lease it keeps (that released runner-2's Lease of a retried batch item, issue 41)."""
    keep = set(kept)
    return tuple(dict.fromkeys(name for name in leases if name and name not in keep))
