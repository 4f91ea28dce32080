"""A ConversionJob's run in flight: its runner Job of the current attempt there, ended, gone or
missing; retries and their backoff; a pod that does not start; the deadline (reconcile.py calls
``in_flight``)."""

from __future__ import annotations

from .diagnose import (  # noqa: F401  (re-exported: tests and handlers read them from here)
    JobSummary,
    failure_cause,
    job_summary,
    live_pods,
    runner_report,
    start_problem,
)
from ...k8s import LABEL_ATTEMPT, runner_job_name
from ...phases import Phase
from ..schema.status import (
    PERMANENT_REASONS,
    START_REASONS,
    add_seconds,
    ConversionJobStatus,
    failure_record,
    patch_list,
    seconds_between,
    set_condition,
)

from .jobdecision import (
    NOTHING,
    Decision,
    Observed,
    conditions_patch,
    current_job_of,
    final,
    merged,
    succeeded,
)


def in_flight(o: Observed, can_start: bool) -> Decision:
    status = o.status
    attempt = status.attempts or 0
    job = current_job_of(o)
    overdue = _deadline_passed(o)
    if overdue is not None:
        return final(
            o, "DeadlineExceeded", overdue, delete_job=job.name if job and job.state in ("pending", "active") else None
        )
    if job is None:
        return _without_job(o, attempt, can_start)
    seen = {"runnerJobUid": job.uid} if status.runner_job_uid != job.uid else {}
    report = runner_report(status, attempt)
    if job.state == "succeeded" or job.state == "failed" and report and report.outcome == "Succeeded":
        # The runner reports success after the output's completion marker, as its last act: a pod
        # that dies after that (OOMKilled while its metrics linger, evicted) ends no conversion.
        return succeeded(o)
    if job.state == "failed":
        if not o.pods_checked and not (report and report.outcome == "Failed"):
            return Decision(needs=frozenset({"pods"}))
        reason, message = failure_cause(status, attempt, job, o.pods)
        return _after_failure(o, attempt, reason, message, can_start)
    if status.phase == Phase.PENDING.value:
        return merged(_waiting_to_start(o, job), seen)
    return Decision({**conditions_patch(status, o.now), **seen})


def _without_job(o: Observed, attempt: int, can_start: bool) -> Decision:
    """No runner Job of the current attempt: not created yet (a retry in its backoff), refused,
    or gone. Every status write that starts an attempt precedes its Job's create, and the Job's
    uid is recorded right after it, so a missing Job is one of: seen (uid) or reported on by its
    runner, hence deleted; or asked for by a pass that did not live to record it."""
    status = o.status
    report = runner_report(status, attempt)
    if status.runner_job_uid or report is not None or _runner_spoke(status, attempt):
        # it existed: deleted (or its TTL ran out)
        if not o.job_checked:  # or the watch has not caught up (a replica that just took over): ask
            return Decision(needs=frozenset({"job"}))
        if report is not None and report.outcome == "Succeeded":
            return succeeded(o)  # it finished before it vanished: that outcome stands
        if report is None and not o.pods_checked:
            return Decision(needs=frozenset({"pods"}))
        reason, message = failure_cause(status, attempt, None, o.pods)
        return _after_failure(
            o, attempt, reason, message, can_start, event_reason="RunnerDeleted" if reason == "RunnerDeleted" else None
        )
    if o.create_rejected is not None:
        return _rejected(o, attempt, o.create_rejected)
    if not can_start:
        return final(o, "InvalidSpec", f"Attempt {attempt} cannot start: {o.spec_error}")
    retry_at = status.next_retry_time
    if retry_at and seconds_between(o.now, retry_at) > 0:
        return Decision(conditions_patch(status, o.now))
    first = status.first_attempt or 1
    # The run's first attempt is asked for in the pass that starts the run; finding it missing
    # later means that pass may have created it, and it may have run and been deleted since.
    unsure = attempt == first and not o.known_uncreated
    if unsure and not o.job_checked:
        return Decision(needs=frozenset({"job"}))
    if not o.pods_checked:
        return Decision(needs=frozenset({"pods"}))
    running = live_pods(o.pods)
    if running:  # an earlier attempt's pods still run: never two writers of one output
        message = f"Attempt {attempt} waits for {len(running)} pod(s) of the previous attempt to exit: {', '.join(running[:5])}."
        return Decision({"message": message} if status.message != message else {}, delete_cluster=True)
    if o.lease is None:  # an attempt runs only under the Lease: take it (again) first, idempotently
        return Decision(needs=frozenset({"lease"}))
    if not o.lease.held:
        return _lease_lost(o)
    patch = {"nextRetryTime": None} if retry_at else {}
    event = None
    if unsure:  # overwrite never follows from not knowing: the output may hold this run's own slabs
        event = (
            "Warning",
            "RunnerRecreated",
            f"Runner Job {runner_job_name(o.name, attempt)} of attempt {attempt} is missing and the operator "
            f"cannot tell whether it ran (it stopped between creating the Job and recording it); created again with overwrite off, "
            f"resuming from the output's manifest.",
        )
    return Decision(
        {**patch, **conditions_patch(status, o.now)},
        ensure_attempt=attempt,
        resume=attempt > first or unsure,
        event=event,
    )


def _lease_lost(o: Observed) -> Decision:
    """The run's Lease is someone else's: it went back while the run was being stopped and the
    operator died before the status said so. This run's attempts are over; a new run waits for
    the output (``waiting_for_output``), as after an edit."""
    status = o.status
    message = (
        f"The output {o.output} is held by {o.lease.holder or '?'} (Lease {o.lease.name}); attempt "
        f"{status.attempts} does not start, and the run starts again once the output is free."
    )
    patch = {
        "phase": Phase.PENDING.value,
        "reason": "OutputBusy",
        "message": message,
        "runnerJob": None,
        "runnerJobUid": None,
        "outputLease": None,
        "nextRetryTime": None,
        "conditions": set_condition(
            patch_list(status.conditions), "OutputLease", "False", "OutputBusy", message, o.now
        ),
    }
    return Decision(patch, event=("Warning", "OutputBusy", message))


def _runner_spoke(status: ConversionJobStatus, attempt: int) -> bool:
    """The runner of the run's first attempt reported a phase, plan or progress (a retry's
    report cannot be told from its predecessor's, but a retry resumes anyway)."""
    if attempt != (status.first_attempt or 1):
        return False
    return status.phase in (Phase.PLANNED, Phase.RUNNING) or status.plan is not None or status.progress is not None


def _rejected(o: Observed, attempt: int, message: str) -> Decision:
    """Kubernetes refused the runner Job (HTTP 4xx): no retry can change that, the spec must."""
    text = (
        f"Kubernetes refused runner Job {runner_job_name(o.name, attempt)} of attempt {attempt}: {message}. "
        f"Fix spec.pod (volumes, volumeMounts, image) and apply it again."
    )
    return final(
        o, "Rejected", text, failures=failure_record(attempt, "Rejected", text, o.now, patch_list(o.status.failures))
    )


def _waiting_to_start(o: Observed, job: JobSummary) -> Decision:
    """The runner Job exists but the runner has not reported yet: say why its pod does not run."""
    if not o.pods_checked:
        return Decision(needs=frozenset({"pods", "events"}))
    status = o.status
    attempt = status.attempts or 0
    pods = tuple(
        p for p in o.pods if ((p.get("metadata") or {}).get("labels") or {}).get(LABEL_ATTEMPT) == str(attempt)
    )
    problem = start_problem(pods, o.events, job.name)
    if problem is None:
        if status.reason in START_REASONS:  # it got going after all
            return Decision(
                {
                    "reason": None,
                    "message": None,
                    "conditions": set_condition(
                        patch_list(status.conditions), "Running", "False", "Starting", None, o.now
                    ),
                }
            )
        return Decision(conditions_patch(status, o.now))
    reason, message = problem
    if status.reason == reason and status.message == message:
        return NOTHING
    patch = {
        "reason": reason,
        "message": message,
        "conditions": set_condition(patch_list(status.conditions), "Running", "False", reason, message, o.now),
    }
    return Decision(patch, event=("Warning", reason, message) if status.reason != reason else None)


def _deadline_passed(o: Observed) -> str | None:
    start = o.status.start_time
    if not o.deadline_seconds or not start or not o.now:
        return None
    took = seconds_between(start, o.now)
    if took < o.deadline_seconds:
        return None
    waiting = f" (it was waiting: {o.status.reason}: {o.status.message})" if o.status.reason in START_REASONS else ""
    return (
        f"The run took longer than spec.activeDeadlineSeconds ({o.deadline_seconds} s; started {start}, {took:.0f} s ago){waiting}. "
        f"Its runner and Dask cluster were stopped; raise the deadline or fix the cause to run it again."
    )


def _after_failure(
    o: Observed, attempt: int, reason: str, message: str, can_retry: bool, event_reason: str | None = None
) -> Decision:
    status = o.status
    failures = failure_record(attempt, reason, message, o.now, patch_list(status.failures))
    if reason in PERMANENT_REASONS:
        return final(o, reason, message, failures=failures)
    first = status.first_attempt or 1
    run_attempts = attempt - first + 1
    if not can_retry:
        return final(
            o,
            reason,
            f"Attempt {attempt} failed ({reason}: {message}); not retried, because the spec of "
            f"generation {o.generation} is invalid: {o.spec_error}",
            failures=failures,
        )
    if run_attempts > o.backoff_limit:
        total = f"{run_attempts} attempt(s) failed (backoffLimit {o.backoff_limit}); the last one: {reason}: {message}"
        return final(o, "BackoffLimitExceeded", total, failures=failures)
    nxt = attempt + 1
    delay = o.retry_delays[min(run_attempts, len(o.retry_delays)) - 1] if o.retry_delays else 0
    note = (
        f"Attempt {attempt} failed ({reason}: {message}); retrying as attempt {nxt} ({run_attempts + 1} of {o.backoff_limit + 1}) "
        f"in {delay} s, resuming from the manifest."
    )
    patch = {
        "phase": Phase.PENDING.value,
        "attempts": nxt,
        "runnerJob": runner_job_name(o.name, nxt),
        "runnerJobUid": None,
        "nextRetryTime": add_seconds(o.now, delay),
        "failures": failures,
        "runner": None,
        "reason": reason,
        "message": note,
        "conditions": set_condition(patch_list(status.conditions), "Running", "False", reason, message, o.now),
    }
    return Decision(patch, delete_cluster=True, event=("Warning", event_reason or "Retrying", note))
