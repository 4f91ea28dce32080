"""A ConversionJob's ``.status``: its schema, and pure builders shared by the operator, the runner
and ``h5ngff run``.

Who writes what (so two writers never replace each other's lists):

* the runner (``h5ngff runner``, in the runner Job) writes ``plan``, ``progress``, ``result``,
  its own ``runner`` report, and the non-terminal phases ``Planned`` and ``Running``;
* the operator writes everything else: ``Pending`` and the terminal phases ``Succeeded`` and
  ``Failed`` (only it can tell a retry from the end), ``attempts``, ``failures``, ``reason`` and
  ``conditions``.

Nothing here does I/O; times are passed in as RFC 3339 strings.
"""

from __future__ import annotations

import datetime
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field
from pydantic.alias_generators import to_camel

from ..engine.progress import Progress
from ..planner.model import Plan
from ..units import k8s_quantity
from ..patches import apply_merge_patch, deep_merge

# Status patches carry plain strings (``.value``): ``h5ngff run`` prints them with yaml.safe_dump.
from ..phases import Phase

#: Failures that the same spec will hit again on every attempt: retrying only wastes a pod.
PERMANENT_REASONS = frozenset(
    {"InvalidSpec", "BudgetTooSmall", "SourceUnreadable", "OutputConflict", "OutputUnwritable", "DiskFull"}
)
#: Why a run's pods do not start, as the scheduler, kubelet or Job controller says (shown while
#: Pending; ``activeDeadlineSeconds`` ends such a run).
START_REASONS = frozenset(
    {
        "Unschedulable",
        "ErrImagePull",
        "ImagePullBackOff",
        "InvalidImageName",
        "CreateContainerConfigError",
        "CreateContainerError",
        "FailedCreate",
    }
)
#: How many failed attempts ``status.failures`` keeps (the newest); the count is in ``attempts``.
MAX_FAILURE_RECORDS = 10
#: The runner's ``progress`` patches are rate-limited to one per this many seconds (phase
#: changes always go through): a 10 000-slab run must not write 10 000 status updates.
PROGRESS_INTERVAL = 2.0


def now() -> str:
    """RFC 3339 UTC time, seconds precision (what Kubernetes writes)."""
    return datetime.datetime.now(tz=datetime.timezone.utc).strftime(TIME_FORMAT)


TIME_FORMAT = "%Y-%m-%dT%H:%M:%SZ"


def parse_time(text: str) -> datetime.datetime:
    return datetime.datetime.strptime(text, TIME_FORMAT).replace(tzinfo=datetime.timezone.utc)


def add_seconds(text: str, seconds: float) -> str:
    return (parse_time(text) + datetime.timedelta(seconds=seconds)).strftime(TIME_FORMAT)


def seconds_between(earlier: str, later: str) -> float:
    return (parse_time(later) - parse_time(earlier)).total_seconds()


# ---------------------------------------------------------------------------------------------
# Schema (the CRD's status schema is generated from these models)


class _Status(BaseModel):
    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, extra="forbid")


class Condition(_Status):
    type: str = Field(description="Validated, Planned, Running, Complete or Failed.")
    status: Literal["True", "False", "Unknown"]
    reason: str | None = Field(None, description="CamelCase reason, e.g. OOMKilled.")
    message: str | None = None
    last_transition_time: str | None = None
    observed_generation: int | None = Field(None, description="The metadata.generation this condition was set for.")


class PlanSummary(_Status):
    """What the runner planned: enough to see why each worker pod is as large as it is."""

    shape: list[int] = Field(description="Source dataset shape.")
    dtype: str
    chunks: list[int]
    slab: list[int] = Field(description="Read slab of the first pass.")
    levels: int
    passes: int
    tasks: int = Field(description="Slab tasks over all passes.")
    workers: int
    threads_per_worker: int
    memory_limit: str = Field(description="Dask memory_limit per worker (Kubernetes quantity).")
    pod_limit: str = Field(description="Memory request and limit of each worker pod (Kubernetes quantity).")
    memory_limit_bytes: int
    pod_limit_bytes: int
    predicted_peak_bytes: int
    allocator: str


class ProgressStatus(_Status):
    slabs_done: int
    slabs_total: int
    slabs_skipped: int = 0
    percent: int
    summary: str = Field(description="e.g. '12/40 (30%)'.")
    bytes_read: int = 0
    bytes_written: int = 0
    update_time: str | None = None


class RunnerReport(_Status):
    """The runner's own account of one attempt."""

    attempt: int
    outcome: Literal["Succeeded", "Failed"]
    reason: str | None = None
    message: str | None = None
    time: str | None = None


class FailureRecord(_Status):
    attempt: int
    reason: str
    message: str | None = None
    time: str | None = None


class ResultSummary(_Status):
    seconds: float
    bytes_read: int
    bytes_written: int
    gb_per_s: float
    resumed: bool
    peak_worker_rss_bytes: int = Field(0, description="Highest RSS any worker reached.")


class ConversionJobStatus(_Status):
    """The observed state of a ConversionJob."""

    #: The CRD's enum: phases.JOB_PHASES (tests/test_phases.py keeps the two equal).
    phase: Literal["Pending", "Planned", "Running", "Succeeded", "Failed"] | None = None
    reason: str | None = Field(
        None,
        description="Why the job failed: InvalidSpec, SourceUnreadable, OutputConflict, OOMKilled, NannyTerminated, BackoffLimitExceeded, ...",
    )
    message: str | None = None
    attempts: int | None = Field(None, description="Runner attempts started so far (1 + retries).")
    runner_job: str | None = Field(None, description="Name of the current attempt's runner Job.")
    start_time: str | None = None
    completion_time: str | None = None
    output: str | None = Field(None, description="Where the OME-Zarr output is written.")
    plan: PlanSummary | None = None
    progress: ProgressStatus | None = None
    result: ResultSummary | None = None
    runner: RunnerReport | None = None
    failures: list[FailureRecord] | None = None
    conditions: list[Condition] | None = None
    observed_generation: int | None = Field(
        None, description="The metadata.generation the status describes: the operator has acted on that spec."
    )
    conversion_hash: str | None = Field(
        None,
        description="Hash of the conversion fields of the current run's spec; an edit that changes it starts a new run.",
    )
    conversion_generation: int | None = Field(
        None,
        description="The metadata.generation at which conversionHash was last compared with the spec; "
        "only a later generation can start a new run (an operator upgrade never does).",
    )
    first_attempt: int | None = Field(
        None, description="The first attempt of the current run (attempt numbers keep counting across runs)."
    )
    runner_job_uid: str | None = Field(
        None,
        description="uid of the current attempt's runner Job once the operator saw it (a Job that vanishes after that was deleted).",
    )
    next_retry_time: str | None = Field(None, description="When the next attempt starts (retry backoff).")
    output_lease: str | None = Field(
        None, description="The coordination.k8s.io Lease this job holds on its output path while it runs."
    )


# ---------------------------------------------------------------------------------------------
# Conditions


def set_condition(
    conditions: list[dict[str, Any]] | None,
    type_: str,
    status: str,
    reason: str | None,
    message: str | None,
    when: str,
    generation: int | None = None,
) -> list[dict[str, Any]]:
    """A new list with ``type_`` set; ``lastTransitionTime`` changes only when ``status`` does.
    ``generation`` (else the one the condition had) becomes its ``observedGeneration``."""
    out = [dict(c) for c in conditions or () if c.get("type") != type_]
    old = next((c for c in conditions or () if c.get("type") == type_), None)
    changed = old is None or old.get("status") != status
    entry = {
        "type": type_,
        "status": status,
        "reason": reason,
        "message": message,
        "lastTransitionTime": when if changed else (old or {}).get("lastTransitionTime", when),
        "observedGeneration": generation if generation is not None else (old or {}).get("observedGeneration"),
    }
    out.append({k: v for k, v in entry.items() if v is not None})
    return out


def condition(status: dict[str, Any], type_: str) -> dict[str, Any] | None:
    return next((c for c in status.get("conditions") or () if c.get("type") == type_), None)


def at_generation(conditions: list[dict[str, Any]] | None, generation: int) -> list[dict[str, Any]]:
    """Every condition stamped with ``generation``: the outcome they state holds for it too."""
    return [{**c, "observedGeneration": generation} for c in conditions or ()]


# ---------------------------------------------------------------------------------------------
# Operator-side builders


def pending_patch(status: dict[str, Any], attempt: int, job_name: str, output: str, when: str) -> dict[str, Any]:
    """A runner attempt was (or is about to be) started."""
    conditions = set_condition(status.get("conditions"), "Validated", "True", "SpecValid", None, when)
    patch: dict[str, Any] = {
        "phase": Phase.PENDING.value,
        "attempts": attempt,
        "runnerJob": job_name,
        "output": output,
        "conditions": conditions,
    }
    if not status.get("startTime"):
        patch["startTime"] = when
    return patch


def invalid_patch(field_message: str, when: str) -> dict[str, Any]:
    conditions = set_condition(None, "Validated", "False", "InvalidSpec", field_message, when)
    conditions = set_condition(conditions, "Failed", "True", "InvalidSpec", field_message, when)
    return {
        "phase": Phase.FAILED.value,
        "reason": "InvalidSpec",
        "message": field_message,
        "completionTime": when,
        "conditions": conditions,
    }


def succeeded_patch(status: dict[str, Any], when: str) -> dict[str, Any]:
    conditions = set_condition(status.get("conditions"), "Running", "False", "Finished", None, when)
    conditions = set_condition(conditions, "Complete", "True", "Succeeded", status.get("output"), when)
    patch: dict[str, Any] = {
        "phase": Phase.SUCCEEDED.value,
        "reason": None,
        "message": None,
        "completionTime": when,
        "conditions": conditions,
    }
    progress = status.get("progress")
    if progress and progress.get("slabsTotal"):
        total = progress["slabsTotal"]
        patch["progress"] = {"slabsDone": total, "percent": 100, "summary": progress_summary(total, total)}
    return patch


def failed_patch(status: dict[str, Any], reason: str, message: str, when: str) -> dict[str, Any]:
    conditions = set_condition(status.get("conditions"), "Running", "False", reason, None, when)
    conditions = set_condition(conditions, "Failed", "True", reason, message, when)
    return {
        "phase": Phase.FAILED.value,
        "reason": reason,
        "message": message,
        "completionTime": when,
        "conditions": conditions,
    }


def failure_record(
    attempt: int, reason: str, message: str, when: str, previous: list[dict[str, Any]] | None
) -> list[dict[str, Any]]:
    """The failure history with this attempt's record (replacing one already there: idempotent)."""
    records = [r for r in previous or () if r.get("attempt") != attempt]
    records.append({"attempt": attempt, "reason": reason, "message": message, "time": when})
    return records[-MAX_FAILURE_RECORDS:]


# ---------------------------------------------------------------------------------------------
# Runner-side builders (also used by ``h5ngff run`` to print what the operator would show)


def plan_summary(plan: Plan) -> dict[str, Any]:
    m = plan.memory
    return {
        "shape": list(plan.dataset.shape),
        "dtype": plan.dtype,
        "chunks": list(plan.chunks),
        "slab": list(plan.slab),
        "levels": len(plan.levels),
        "passes": len(plan.passes),
        "tasks": plan.n_tasks,
        "workers": plan.workers,
        "threadsPerWorker": plan.threads_per_worker,
        "memoryLimit": k8s_quantity(m.memory_limit),
        "podLimit": k8s_quantity(m.pod_limit),
        "memoryLimitBytes": m.memory_limit,
        "podLimitBytes": m.pod_limit,
        "predictedPeakBytes": m.predicted_peak,
        "allocator": plan.allocator,
    }


def planned_patch(plan: Plan, when: str) -> dict[str, Any]:
    return {
        "phase": Phase.PLANNED.value,
        "plan": plan_summary(plan),
        "progress": progress_status(0, plan.n_tasks, when=when),
    }


def progress_summary(done: int, total: int) -> str:
    return f"{done}/{total} ({percent(done, total)}%)"


def percent(done: int, total: int) -> int:
    # Floor, so 100% means done, never "99.6% rounded up".
    return 100 * done // total if total else 0


def progress_status(
    done: int, total: int, skipped: int = 0, bytes_read: int = 0, bytes_written: int = 0, when: str | None = None
) -> dict[str, Any]:
    out = {
        "slabsDone": done,
        "slabsTotal": total,
        "slabsSkipped": skipped,
        "percent": percent(done, total),
        "summary": progress_summary(done, total),
        "bytesRead": bytes_read,
        "bytesWritten": bytes_written,
    }
    if when:
        out["updateTime"] = when
    return out


def progress_patch(progress: Progress, when: str) -> dict[str, Any]:
    """A runner progress event as a status patch (phase Running while slabs are written)."""
    body = progress_status(
        progress.slabs_done,
        progress.slabs_total,
        progress.slabs_skipped,
        progress.bytes_read,
        progress.bytes_written,
        when,
    )
    return {"phase": Phase.RUNNING.value, "progress": body}


def runner_report(
    attempt: int, outcome: str, when: str, reason: str | None = None, message: str | None = None
) -> dict[str, Any]:
    report = {"attempt": attempt, "outcome": outcome, "reason": reason, "message": message, "time": when}
    return {"runner": {k: v for k, v in report.items() if v is not None}}


def result_summary(summary: dict[str, Any]) -> dict[str, Any]:
    """From ``RunSummary.to_dict()``: the figures worth keeping on the object."""
    peaks = [w.get("peak_rss", 0) for w in summary.get("workers", ())]
    return {
        "seconds": summary.get("seconds", 0.0),
        "bytesRead": summary.get("bytes_read", 0),
        "bytesWritten": summary.get("bytes_written", 0),
        "gbPerS": summary.get("gb_per_s", 0.0),
        "resumed": bool(summary.get("resumed")),
        "peakWorkerRssBytes": max(peaks, default=0),
    }


#: Applying and combining status patches (re-exported for the operator's modules and tests).
merge = apply_merge_patch
combine = deep_merge
