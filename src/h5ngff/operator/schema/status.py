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
import copy
from typing import Any, Literal, Mapping, Sequence, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError
from pydantic.alias_generators import to_camel

from ...patches import apply_merge_patch, deep_merge

# Status patches carry plain strings (``.value``): ``h5ngff run`` prints them with yaml.safe_dump.
from ...phases import Phase

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


#: The longest ``message`` any status field, condition or Event of ours carries. A message quotes
#: what the user wrote (a path, a template, the API server's answer), and the whole object must
#: stay far below etcd's 1.5 MiB; 4 KiB holds any message we write with its quotes.
MAX_MESSAGE = 4096


def bounded(message: str | None, limit: int = MAX_MESSAGE) -> str | None:
    """``message`` cut to ``limit`` characters, saying how much was cut (None stays None)."""
    if message is None or len(message) <= limit:
        return message
    note = f"... ({len(message) - limit} more characters)"
    return message[: limit - len(note)] + note


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


M = TypeVar("M", bound=BaseModel)
#: At most this many unreadable fields are dropped before a status counts as unreadable.
MAX_DROPPED = 64


def read_status(model: type[M], data: Mapping[str, Any] | None) -> M:
    """``data`` (a ``.status`` as the API holds it) as ``model``; a field this build cannot read
    (written by hand, or by another release) is left out of the view rather than stopping every
    pass, and an entry of a list that lacks a required field goes with it."""
    work = copy.deepcopy(dict(data or {}))
    for _ in range(MAX_DROPPED):
        try:
            return model.model_validate(work)
        except ValidationError as exc:
            error = exc.errors()[0]
            loc = tuple(error["loc"])
            if not _drop(work, loc[:-1] if error["type"] == "missing" else loc):
                raise
    return model.model_validate({})


def _drop(node: Any, loc: tuple[Any, ...]) -> bool:
    """Remove the element at ``loc`` (keys and list indexes) from ``node``; False if there is none."""
    if not loc:
        return False
    for part in loc[:-1]:
        try:
            node = node[part]
        except (KeyError, IndexError, TypeError):
            return False
    try:
        del node[loc[-1]]
    except (KeyError, IndexError, TypeError):
        return False
    return True


def dump_status(model: BaseModel) -> dict[str, Any]:
    """A status model as the API holds it: camelCase keys, no nulls."""
    out: dict[str, Any] = model.model_dump(by_alias=True, exclude_none=True, mode="json")
    return out


def merge_diff(old: Mapping[str, Any], new: Mapping[str, Any]) -> dict[str, Any]:
    """The merge patch (RFC 7386) that turns ``old`` into ``new``: changed keys, nested objects
    recursively, a removed key as None. Lists are replaced whole, as merge patches do."""
    patch: dict[str, Any] = {}
    for key in dict.fromkeys([*old, *new]):
        before, after = old.get(key), new.get(key)
        if before == after:
            continue
        if isinstance(before, Mapping) and isinstance(after, Mapping):
            patch[key] = merge_diff(before, after)
        else:
            patch[key] = after
    return patch


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
    converted_hash: str | None = Field(
        None,
        description="The conversionHash the output holds complete: the last run's that succeeded, until a run that "
        "writes that output starts; a spec asking for it again runs nothing.",
    )
    converted_output: str | None = Field(
        None, description="The output Lease name of the output that holds convertedHash."
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
        "message": bounded(message),
        "lastTransitionTime": when if changed else (old or {}).get("lastTransitionTime", when),
        "observedGeneration": generation if generation is not None else (old or {}).get("observedGeneration"),
    }
    out.append({k: v for k, v in entry.items() if v is not None})
    return out


def condition(status: ConversionJobStatus, type_: str) -> Condition | None:
    return next((c for c in status.conditions or () if c.type == type_), None)


def patch_list(entries: Sequence[BaseModel] | None) -> list[dict[str, Any]] | None:
    """A list field of a status model (conditions, failures) as the API holds it: the builders
    extend it into the new list a merge patch carries (which replaces a list whole)."""
    return None if entries is None else [dump_status(e) for e in entries]


def at_generation(conditions: list[dict[str, Any]] | None, generation: int) -> list[dict[str, Any]]:
    """Every condition stamped with ``generation``: the outcome they state holds for it too."""
    return [{**c, "observedGeneration": generation} for c in conditions or ()]


# ---------------------------------------------------------------------------------------------
# Operator-side builders


def pending_patch(status: ConversionJobStatus, attempt: int, job_name: str, output: str, when: str) -> dict[str, Any]:
    """A runner attempt was (or is about to be) started."""
    conditions = set_condition(patch_list(status.conditions), "Validated", "True", "SpecValid", None, when)
    patch: dict[str, Any] = {
        "phase": Phase.PENDING.value,
        "attempts": attempt,
        "runnerJob": job_name,
        "output": output,
        "conditions": conditions,
    }
    if not status.start_time:
        patch["startTime"] = when
    return patch


def invalid_patch(field_message: str, when: str) -> dict[str, Any]:
    conditions = set_condition(None, "Validated", "False", "InvalidSpec", field_message, when)
    conditions = set_condition(conditions, "Failed", "True", "InvalidSpec", field_message, when)
    return {
        "phase": Phase.FAILED.value,
        "reason": "InvalidSpec",
        "message": bounded(field_message),
        "completionTime": when,
        "conditions": conditions,
    }


def succeeded_patch(status: ConversionJobStatus, when: str) -> dict[str, Any]:
    conditions = set_condition(patch_list(status.conditions), "Running", "False", "Finished", None, when)
    conditions = set_condition(conditions, "Complete", "True", "Succeeded", status.output, when)
    patch: dict[str, Any] = {
        "phase": Phase.SUCCEEDED.value,
        "reason": None,
        "message": None,
        "completionTime": when,
        "conditions": conditions,
    }
    if status.progress is not None and status.progress.slabs_total:
        total = status.progress.slabs_total
        patch["progress"] = {"slabsDone": total, "percent": 100, "summary": progress_summary(total, total)}
    return patch


def failed_patch(status: ConversionJobStatus, reason: str, message: str, when: str) -> dict[str, Any]:
    conditions = set_condition(patch_list(status.conditions), "Running", "False", reason, None, when)
    conditions = set_condition(conditions, "Failed", "True", reason, message, when)
    return {
        "phase": Phase.FAILED.value,
        "reason": reason,
        "message": bounded(message),
        "completionTime": when,
        "conditions": conditions,
    }


def failure_record(
    attempt: int, reason: str, message: str, when: str, previous: list[dict[str, Any]] | None
) -> list[dict[str, Any]]:
    """The failure history with this attempt's record (replacing one already there: idempotent)."""
    records = [r for r in previous or () if r.get("attempt") != attempt]
    records.append({"attempt": attempt, "reason": reason, "message": bounded(message), "time": when})
    return records[-MAX_FAILURE_RECORDS:]


def progress_summary(done: int, total: int) -> str:
    return f"{done}/{total} ({percent(done, total)}%)"


def percent(done: int, total: int) -> int:
    # Floor, so 100% means done, never "99.6% rounded up".
    return 100 * done // total if total else 0


def progress_status(
    done: int, total: int, skipped: int = 0, bytes_read: int = 0, bytes_written: int = 0, when: str | None = None
) -> dict[str, Any]:
    """``status.progress`` (a job's, or a batch item's): written by the runner, completed by the
    operator's Succeeded patch."""
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


#: Applying and combining status patches (re-exported for the operator's modules and tests).
merge = apply_merge_patch
combine = deep_merge
