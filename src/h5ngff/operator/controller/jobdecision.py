"""A ConversionJob's observations and decisions (``Observed``, ``Decision``) and the steps that
end a run, shared by the rest of the job's reconcile (reconcile.py, inflight.py).

The steps read the status as the model (``ConversionJobStatus``, read once per pass as the
batch's is), and write merge patches: dicts of the API's camelCase keys.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Mapping

from .diagnose import (  # noqa: F401  (re-exported: tests and handlers read them from here)
    JobSummary,
    failure_cause,
    job_summary,
    live_pods,
    runner_report,
    start_problem,
)
from ...phases import TERMINAL_PHASES, Phase
from .toolkit import Need, Wait, pods_gate
from ..schema.status import (
    ConversionJobStatus,
    PlanSummary,
    bounded,
    condition,
    dump_status,
    failed_patch,
    merge,
    patch_list,
    read_status,
    set_condition,
    succeeded_patch,
)

#: Status fields (the model's attribute names) that describe one run; a new run starts without them.
RUN_FIELDS = (
    "plan",
    "progress",
    "result",
    "runner",
    "failures",
    "reason",
    "message",
    "completion_time",
    "next_retry_time",
    "runner_job_uid",
)


@dataclass(frozen=True)
class Observed:
    name: str
    #: The object's ``.status``; given as the API holds it (a mapping, as the tests do), it is
    #: read into the model here, leaving out what this build cannot read.
    status: ConversionJobStatus
    backoff_limit: int
    output: str
    jobs: tuple[JobSummary, ...] = ()
    #: Pods of this ConversionJob (runner and Dask), only looked up when a decision needs them.
    pods: tuple[dict[str, Any], ...] = ()
    pods_checked: bool = False
    now: str = ""
    generation: int = 1
    #: Hash of the spec's conversion fields ("" when the spec is invalid).
    conversion: str = ""
    #: The same fields hashed as builds up to 0.x did (defaults included); a status written by
    #: such a build is compared with this, so an upgrade alone never looks like an edit.
    legacy_conversion: str = ""
    #: The hashes other builds compute for this spec (as written, defaults that were written out
    #: included: builds up to issue 41); a recorded one of these is the same conversion.
    other_conversions: tuple[str, ...] = ()
    spec_error: str | None = None
    #: Seconds to wait before a retry, by failed attempts of the run so far (1, 2, ...).
    retry_delays: tuple[int, ...] = (0,)
    deadline_seconds: int | None = None
    #: The Lease of the spec's output path, and whether we got it (None: not asked yet).
    lease_name: str = ""
    lease: Any = None  #: a lease.LeaseState
    events: tuple[dict[str, Any], ...] = ()
    events_checked: bool = False
    #: The current runner Job was looked up by name (the index did not have it).
    job_checked: bool = False
    #: Why the tenant policy (operator/schema/policy.py) refuses this spec, or None. A denied spec
    #: starts nothing, and a run of it in flight is stopped; a finished outcome stays as it was.
    policy_denial: str | None = None
    #: Why this job must not run because a ConversionBatch of its name is older (names.py), or None.
    name_taken: str | None = None
    #: This process asked for the current attempt's runner Job and Kubernetes refused it for good
    #: (HTTP 4xx): the API's message. A permanent refusal ends the attempt (reason ``Rejected``).
    create_rejected: str | None = None
    #: This process knows the current attempt's runner Job was never created (its create failed
    #: with a definite answer), so creating it as first intended is safe.
    known_uncreated: bool = False

    def __post_init__(self) -> None:
        # Tests write a status as the API holds it (a dict); read it as a pass does. The type
        # says model, so the check is on ``object``.
        raw: object = self.status
        if isinstance(raw, Mapping):
            object.__setattr__(self, "status", read_status(ConversionJobStatus, raw))


@dataclass(frozen=True)
class Decision:
    patch: dict[str, Any] = field(default_factory=dict)
    #: The attempt whose runner Job must exist (created if missing; an existing one is kept).
    ensure_attempt: int | None = None
    #: Resume instead of overwrite in that attempt (an earlier one of the run may have written).
    resume: bool = False
    #: Delete the DaskCluster an earlier attempt left behind.
    delete_cluster: bool = False
    #: A runner Job to delete (the attempt of a run that was stopped).
    delete_job: str | None = None
    #: Acquire ``Observed.lease_name`` / release this Lease.
    release_lease: str | None = None
    #: (type, reason, message) of a Kubernetes Event to post, or None.
    event: tuple[str, str, str] | None = None
    #: What must be looked up before deciding: "job", "pods", "events", "lease".
    needs: frozenset[str] = frozenset()

    @property
    def needs_pods(self) -> bool:
        return "pods" in self.needs


NOTHING = Decision()


def in_flight_now(status: ConversionJobStatus) -> bool:
    """An attempt of a run is current: started, not ended, and not given up for a new run that
    waits for its output."""
    return status.phase not in TERMINAL_PHASES and (status.attempts or 0) > 0 and not waiting_for_output(status)


def waiting_for_output(status: ConversionJobStatus) -> bool:
    """A new run waits for its output's Lease (``_output_busy``, which forgets the earlier run's
    runner Job: that attempt is over, its pods gone)."""
    return status.reason == "OutputBusy" and not status.runner_job and (status.attempts or 0) > 0


def current_job_of(o: Observed) -> JobSummary | None:
    attempt = o.status.attempts or 0
    return next((j for j in o.jobs if j.attempt == attempt), None)


def run_fields_cleared(status: ConversionJobStatus) -> dict[str, Any]:
    """The patch that removes the previous run's fields (``RUN_FIELDS``) the status has."""
    present = status.model_dump(include=set(RUN_FIELDS), by_alias=True, exclude_none=True)
    return {key: None for key in present}


def patched(status: ConversionJobStatus, patch: Mapping[str, Any]) -> ConversionJobStatus:
    """``status`` once the API applied the merge patch ``patch`` to it."""
    return read_status(ConversionJobStatus, merge(dump_status(status), dict(patch)))


def ended(o: Observed, d: Decision, ask: bool = False) -> Decision:
    """A run that ended (``d`` records its end, or it ended earlier) gives its Lease back only
    once no pod of it can still write: the runner pod and every Dask pod gone (toolkit's
    ``pods_gate``). Until then the DaskCluster is deleted again, a runner Job still running is
    deleted, and the OutputLease condition says what the Lease waits for. The pass that records
    the end does not wait for a pod listing (``ask`` False): the Lease then goes back in a
    later pass over the finished run."""
    lease = o.status.output_lease
    if d.needs or not lease:
        return d
    gate = pods_gate(o.pods, o.pods_checked)
    if isinstance(gate, Need):
        return Decision(needs=gate.what) if ask else d
    base = d.patch["conditions"] if "conditions" in d.patch else patch_list(o.status.conditions)
    if isinstance(gate, Wait):
        text = gate.message(f"Giving back the output Lease {lease}")
        conditions = set_condition(base, "OutputLease", "True", "Draining", text, o.now)
        patch = {**d.patch, "conditions": conditions} if conditions != base else d.patch
        job = current_job_of(o)
        running = job.name if job is not None and job.state in ("pending", "active") else None
        return dataclasses.replace(d, patch=patch, delete_cluster=True, delete_job=d.delete_job or running)
    patch = {**d.patch, "outputLease": None}
    if condition(o.status, "OutputLease") is not None:
        patch["conditions"] = set_condition(base, "OutputLease", "False", "Released", None, o.now)
    return dataclasses.replace(d, patch=patch, release_lease=lease)


def converted_fields(o: Observed) -> dict[str, Any]:
    """What the output holds complete once the current run succeeded (its runner said so): the
    run's conversion and its output's Lease name. A spec asking for it again runs nothing
    (``reconcile._converted``) until a run that writes that output starts."""
    return {
        "convertedHash": o.status.conversion_hash or o.conversion or None,
        "convertedOutput": o.status.output_lease or o.lease_name or None,
    }


def succeeded(o: Observed) -> Decision:
    patch = {**succeeded_patch(o.status, o.now), "nextRetryTime": None, **converted_fields(o)}
    event = ("Normal", "Succeeded", f"Converted into {o.status.output or o.output}.")
    return ended(o, Decision(patch, event=event))


def final(o: Observed, reason: str, message: str, delete_job: str | None = None, failures: Any = None) -> Decision:
    patch = {**failed_patch(o.status, reason, message, o.now), "nextRetryTime": None}
    if failures is not None:
        patch["failures"] = failures
    event = ("Warning", reason, bounded(message) or "")
    return ended(o, Decision(patch, delete_job=delete_job, delete_cluster=True, event=event))


def merged(d: Decision, patch: dict[str, Any]) -> Decision:
    return dataclasses.replace(d, patch={**patch, **d.patch}) if patch and not d.needs else d


def conditions_patch(status: ConversionJobStatus, now: str) -> dict[str, Any]:
    """Mirror the runner's phases into conditions (only the operator writes conditions)."""
    conditions = patch_list(status.conditions)
    new = conditions
    if status.plan is not None:
        new = set_condition(new, "Planned", "True", "Planned", _plan_message(status.plan), now)
    if status.phase == Phase.RUNNING.value:
        new = set_condition(new, "Running", "True", "Writing", None, now)
    return {"conditions": new} if new != conditions else {}


def _plan_message(plan: PlanSummary) -> str:
    return (
        f"{plan.workers} worker(s) x {plan.threads_per_worker} thread(s), pod limit {plan.pod_limit}, "
        f"Dask memory_limit {plan.memory_limit}, slab {plan.slab}, {plan.tasks} task(s)"
    )
