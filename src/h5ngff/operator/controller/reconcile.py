"""The operator's decisions, as a pure function of what it observes.

``reconcile(observed) -> Decision`` looks at a ConversionJob's spec (its generation and the hash
of its conversion fields), its status, the runner Job of the current attempt and, when asked
for, the pods, Events and output Lease; it says what to patch, which runner Job must exist or
go, and which event to post. The kopf handlers only gather the inputs and carry the decision
out, so every lifecycle rule (docs/operator.md, "Lifecycle") is tested here without any API.

A *run* is the conversion of one spec: attempts 1..n of it (retries), until Succeeded or Failed.
The recorded outcome of a run is final: only an edit that changes the conversion starts a new
run; children that vanish never do.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from .diagnose import (  # noqa: F401  (re-exported: tests and handlers read them from here)
    JobSummary,
    failure_cause,
    job_summary,
    live_pods,
    runner_report,
    start_problem,
)
from ...k8s import LABEL_ATTEMPT, runner_job_name
from ...phases import TERMINAL_PHASES, Phase
from .toolkit import Need, Wait, conversion_changed, pods_gate
from ..schema.status import (
    bounded,
    PERMANENT_REASONS,
    START_REASONS,
    add_seconds,
    at_generation,
    condition,
    failed_patch,
    failure_record,
    invalid_patch,
    seconds_between,
    set_condition,
    succeeded_patch,
)

#: Status fields that describe one run; a new run starts without them.
RUN_FIELDS = (
    "plan",
    "progress",
    "result",
    "runner",
    "failures",
    "reason",
    "message",
    "completionTime",
    "nextRetryTime",
    "runnerJobUid",
    "convertedHash",
)


@dataclass(frozen=True)
class Observed:
    name: str
    status: dict[str, Any]
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


def reconcile(o: Observed) -> Decision:
    status = o.status
    if o.spec_error is not None:
        decision = _invalid(o, o.spec_error)
    elif _refusal(o) is not None and (_conversion_changed(o) or _in_flight_now(status)):
        decision = _refused(o, *(_refusal(o) or ("", "")))
    elif _conversion_changed(o):
        decision = _new_run(o)
    elif status.get("phase") in TERMINAL_PHASES:
        decision = _settled(o)
    else:
        decision = _in_flight(o, can_start=True)
    if o.spec_error is None:
        decision = _validated(o, decision)
    return _stamp(o, decision)


def _stamp(o: Observed, d: Decision) -> Decision:
    """Every status write says which generation it describes (``observedGeneration``, also on
    each condition), so a GitOps tool never reads an old outcome as the current spec's."""
    writing = bool(d.patch) or o.status.get("observedGeneration") != o.generation
    adopt = _adopt_hash(o, writing)
    if d.needs or not (writing or adopt):
        return d
    patch = dict(d.patch)
    patch["observedGeneration"] = o.generation
    patch["conditions"] = at_generation(
        patch["conditions"] if "conditions" in patch else o.status.get("conditions"), o.generation
    )
    for key, value in adopt.items():
        patch.setdefault(key, value)
    return dataclasses.replace(d, patch=patch)


def _conversion_changed(o: Observed) -> bool:
    """A new run starts only for a new generation whose normalised conversion differs
    (toolkit.conversion_changed): writing a default out, removing one, an operator upgrade that
    adds a defaulted field or changes the hash formula never starts a run, let alone one with
    overwrite. A run wanted but not started (waiting for its output) is still wanted, whatever
    the spec says now: no attempt of an earlier run is taken up again (issue 41)."""
    status = o.status
    if not int(status.get("attempts") or 0):
        return True  # never started
    if _waiting_for_output(status):
        return True
    accepted = (o.legacy_conversion, *o.other_conversions)
    return conversion_changed(status.get("conversionHash"), o.conversion, accepted, o.generation, _compared_at(status))


def _compared_at(status: dict[str, Any]) -> int | None:
    if "conversionGeneration" in status:
        return int(status["conversionGeneration"])
    # A status from a build before conversionGeneration: it stamped observedGeneration on every
    # write, and one stopping a run for a changed spec (SpecChanged) had not compared it yet.
    return None if status.get("reason") == "SpecChanged" else status.get("observedGeneration")


def _adopt_hash(o: Observed, writing: bool) -> dict[str, Any]:
    """The spec was compared at this generation and is the same conversion: record today's hash
    and the generation (with a write that happens anyway, or when the hash differs), so the
    next edit is compared with a hash this build computes."""
    status = o.status
    if not o.conversion or not int(status.get("attempts") or 0) or _conversion_changed(o):
        return {}
    differs = status.get("conversionHash") != o.conversion
    if not differs and (status.get("conversionGeneration") == o.generation or not writing):
        return {}
    return {"conversionHash": o.conversion, "conversionGeneration": o.generation}


def _in_flight_now(status: dict[str, Any]) -> bool:
    """An attempt of a run is current: started, not ended, and not given up for a new run that
    waits for its output."""
    return (
        status.get("phase") not in TERMINAL_PHASES
        and int(status.get("attempts") or 0) > 0
        and not _waiting_for_output(status)
    )


def _waiting_for_output(status: dict[str, Any]) -> bool:
    """A new run waits for its output's Lease (``_output_busy``, which forgets the earlier run's
    runner Job: that attempt is over, its pods gone)."""
    return status.get("reason") == "OutputBusy" and not status.get("runnerJob") and int(status.get("attempts") or 0) > 0


def _current_job(o: Observed) -> JobSummary | None:
    attempt = int(o.status.get("attempts") or 0)
    return next((j for j in o.jobs if j.attempt == attempt), None)


# ---------------------------------------------------------------------------------------------
# Starting runs


def _new_run(o: Observed) -> Decision:
    """The conversion changed (or never ran): stop what runs, wait for its pods, take the
    output's Lease, then start attempt 1 of the new run."""
    status = o.status
    job = _current_job(o)
    if job is not None and _in_flight_now(status):
        message = f"The conversion changed in generation {o.generation}: stopping attempt {status.get('attempts')} (runner Job {job.name}) to start a new run."
        patch = {
            "phase": Phase.PENDING.value,
            "reason": "SpecChanged",
            "message": message,
            "conditions": set_condition(status.get("conditions"), "Running", "False", "SpecChanged", message, o.now),
        }
        return Decision(patch, delete_job=job.name, delete_cluster=True, event=("Normal", "SpecChanged", message))
    if int(status.get("attempts") or 0) and not o.pods_checked:
        return Decision(needs=frozenset({"pods"}))
    running = live_pods(o.pods)
    if running:
        message = f"Waiting for {len(running)} pod(s) of the stopped run to exit before the new run starts: {', '.join(running[:5])}."
        return Decision(
            {"reason": "SpecChanged", "message": message} if status.get("message") != message else {},
            delete_cluster=True,
        )
    if o.conversion and status.get("convertedHash") == o.conversion:
        return _converted(o)
    old_lease = status.get("outputLease")
    release = old_lease if old_lease and old_lease != o.lease_name else None
    if o.lease is None:
        return Decision(needs=frozenset({"lease"}), release_lease=release)
    if not o.lease.held:
        return _output_busy(o, release)
    return _start_run(o, release)


def _converted(o: Observed) -> Decision:
    """The spec asks again for the conversion the output holds complete (``convertedHash``: no
    run has written since it succeeded, e.g. an edit that waited for the output and was undone):
    Succeeded again, nothing runs."""
    status = o.status
    message = f"Generation {o.generation} asks for the conversion {o.output} already holds; nothing runs."
    patch = {
        **succeeded_patch(status, o.now),
        "conversionHash": o.conversion,
        "conversionGeneration": o.generation,
        "completionTime": status.get("completionTime") or o.now,
    }
    return _ended(o, Decision(patch, event=("Normal", "Succeeded", message)), ask=True)


def _output_busy(o: Observed, release: str | None) -> Decision:
    status = o.status
    since = f" since {o.lease.since}" if o.lease.since else ""
    message = (
        f"Waiting for the output {o.output}: ConversionJob {o.lease.holder or '?'} writes it (Lease {o.lease.name}{since}). "
        f"This job starts when that one ends or is deleted."
    )
    patch: dict[str, Any] = {}
    if status.get("reason") != "OutputBusy" or status.get("message") != message:
        patch = {
            "phase": Phase.PENDING.value,
            "reason": "OutputBusy",
            "message": message,
            "output": o.output,
            # The earlier run's attempt is over (its pods are gone): none is current until this
            # run starts, so an edit back to that run's spec never takes its attempt up again.
            "runnerJob": None,
            "runnerJobUid": None,
            "conditions": set_condition(status.get("conditions"), "OutputLease", "False", "OutputBusy", message, o.now),
        }
        if release:
            patch["outputLease"] = None
    event = ("Normal", "OutputBusy", message) if status.get("reason") != "OutputBusy" else None
    return Decision(patch, release_lease=release, event=event)


def _start_run(o: Observed, release: str | None) -> Decision:
    status = o.status
    attempt = int(status.get("attempts") or 0) + 1
    job = runner_job_name(o.name, attempt)
    conditions = set_condition(None, "Validated", "True", "SpecValid", None, o.now)
    conditions = set_condition(conditions, "OutputLease", "True", "Held", o.lease.name, o.now)
    patch: dict[str, Any] = {name: None for name in RUN_FIELDS if status.get(name) is not None}
    patch.update(
        {
            "phase": Phase.PENDING.value,
            "attempts": attempt,
            "firstAttempt": attempt,
            "runnerJob": job,
            "output": o.output,
            "conversionHash": o.conversion,
            "conversionGeneration": o.generation,
            "outputLease": o.lease.name,
            "startTime": o.now,
            "conditions": conditions,
        }
    )
    run = "" if attempt == 1 else f" for the changed spec (generation {o.generation})"
    message = f"Created runner Job {job} (attempt 1 of {o.backoff_limit + 1}){run}."
    return Decision(patch, ensure_attempt=attempt, release_lease=release, event=("Normal", "RunnerCreated", message))


# ---------------------------------------------------------------------------------------------
# A run in flight


def _in_flight(o: Observed, can_start: bool) -> Decision:
    status = o.status
    attempt = int(status.get("attempts") or 0)
    job = _current_job(o)
    overdue = _deadline_passed(o)
    if overdue is not None:
        return _final(
            o, "DeadlineExceeded", overdue, delete_job=job.name if job and job.state in ("pending", "active") else None
        )
    if job is None:
        return _without_job(o, attempt, can_start)
    seen = {"runnerJobUid": job.uid} if status.get("runnerJobUid") != job.uid else {}
    report = runner_report(status, attempt)
    if job.state == "succeeded" or job.state == "failed" and report and report.get("outcome") == "Succeeded":
        # The runner reports success after the output's completion marker, as its last act: a pod
        # that dies after that (OOMKilled while its metrics linger, evicted) ends no conversion.
        return _succeeded(o)
    if job.state == "failed":
        if not o.pods_checked and not (report and report.get("outcome") == "Failed"):
            return Decision(needs=frozenset({"pods"}))
        reason, message = failure_cause(status, attempt, job, o.pods)
        return _after_failure(o, attempt, reason, message, can_start)
    if status.get("phase") == Phase.PENDING:
        return _merge(_waiting_to_start(o, job), seen)
    return Decision({**_conditions_patch(status, o.now), **seen})


def _without_job(o: Observed, attempt: int, can_start: bool) -> Decision:
    """No runner Job of the current attempt: not created yet (a retry in its backoff), refused,
    or gone. Every status write that starts an attempt precedes its Job's create, and the Job's
    uid is recorded right after it, so a missing Job is one of: seen (uid) or reported on by its
    runner, hence deleted; or asked for by a pass that did not live to record it."""
    status = o.status
    report = runner_report(status, attempt)
    if (
        status.get("runnerJobUid") or report is not None or _runner_spoke(status, attempt)
    ):  # it existed: deleted (or its TTL ran out)
        if not o.job_checked:  # or the watch has not caught up (a replica that just took over): ask
            return Decision(needs=frozenset({"job"}))
        if report is not None and report.get("outcome") == "Succeeded":
            return _succeeded(o)  # it finished before it vanished: that outcome stands
        if report is None and not o.pods_checked:
            return Decision(needs=frozenset({"pods"}))
        reason, message = failure_cause(status, attempt, None, o.pods)
        return _after_failure(
            o, attempt, reason, message, can_start, event_reason="RunnerDeleted" if reason == "RunnerDeleted" else None
        )
    if o.create_rejected is not None:
        return _rejected(o, attempt, o.create_rejected)
    if not can_start:
        return _final(o, "InvalidSpec", f"Attempt {attempt} cannot start: {o.spec_error}")
    retry_at = status.get("nextRetryTime")
    if retry_at and seconds_between(o.now, retry_at) > 0:
        return Decision(_conditions_patch(status, o.now))
    first = int(status.get("firstAttempt") or 1)
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
        return Decision({"message": message} if status.get("message") != message else {}, delete_cluster=True)
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
        {**patch, **_conditions_patch(status, o.now)},
        ensure_attempt=attempt,
        resume=attempt > first or unsure,
        event=event,
    )


def _lease_lost(o: Observed) -> Decision:
    """The run's Lease is someone else's: it went back while the run was being stopped and the
    operator died before the status said so. This run's attempts are over; a new run waits for
    the output (``_waiting_for_output``), as after an edit."""
    status = o.status
    message = (
        f"The output {o.output} is held by {o.lease.holder or '?'} (Lease {o.lease.name}); attempt "
        f"{status.get('attempts')} does not start, and the run starts again once the output is free."
    )
    patch = {
        "phase": Phase.PENDING.value,
        "reason": "OutputBusy",
        "message": message,
        "runnerJob": None,
        "runnerJobUid": None,
        "outputLease": None,
        "nextRetryTime": None,
        "conditions": set_condition(status.get("conditions"), "OutputLease", "False", "OutputBusy", message, o.now),
    }
    return Decision(patch, event=("Warning", "OutputBusy", message))


def _runner_spoke(status: dict[str, Any], attempt: int) -> bool:
    """The runner of the run's first attempt reported a phase, plan or progress (a retry's
    report cannot be told from its predecessor's, but a retry resumes anyway)."""
    if attempt != int(status.get("firstAttempt") or 1):
        return False
    return status.get("phase") in (Phase.PLANNED, Phase.RUNNING) or bool(status.get("plan") or status.get("progress"))


def _rejected(o: Observed, attempt: int, message: str) -> Decision:
    """Kubernetes refused the runner Job (HTTP 4xx): no retry can change that, the spec must."""
    text = (
        f"Kubernetes refused runner Job {runner_job_name(o.name, attempt)} of attempt {attempt}: {message}. "
        f"Fix spec.pod (volumes, volumeMounts, image) and apply it again."
    )
    return _final(
        o, "Rejected", text, failures=failure_record(attempt, "Rejected", text, o.now, o.status.get("failures"))
    )


def _waiting_to_start(o: Observed, job: JobSummary) -> Decision:
    """The runner Job exists but the runner has not reported yet: say why its pod does not run."""
    if not o.pods_checked:
        return Decision(needs=frozenset({"pods", "events"}))
    status = o.status
    attempt = int(status.get("attempts") or 0)
    pods = tuple(
        p for p in o.pods if ((p.get("metadata") or {}).get("labels") or {}).get(LABEL_ATTEMPT) == str(attempt)
    )
    problem = start_problem(pods, o.events, job.name)
    if problem is None:
        if status.get("reason") in START_REASONS:  # it got going after all
            return Decision(
                {
                    "reason": None,
                    "message": None,
                    "conditions": set_condition(status.get("conditions"), "Running", "False", "Starting", None, o.now),
                }
            )
        return Decision(_conditions_patch(status, o.now))
    reason, message = problem
    if status.get("reason") == reason and status.get("message") == message:
        return NOTHING
    patch = {
        "reason": reason,
        "message": message,
        "conditions": set_condition(status.get("conditions"), "Running", "False", reason, message, o.now),
    }
    return Decision(patch, event=("Warning", reason, message) if status.get("reason") != reason else None)


def _deadline_passed(o: Observed) -> str | None:
    start = o.status.get("startTime")
    if not o.deadline_seconds or not start or not o.now:
        return None
    took = seconds_between(start, o.now)
    if took < o.deadline_seconds:
        return None
    waiting = (
        f" (it was waiting: {o.status.get('reason')}: {o.status.get('message')})"
        if o.status.get("reason") in START_REASONS
        else ""
    )
    return (
        f"The run took longer than spec.activeDeadlineSeconds ({o.deadline_seconds} s; started {start}, {took:.0f} s ago){waiting}. "
        f"Its runner and Dask cluster were stopped; raise the deadline or fix the cause to run it again."
    )


def _ended(o: Observed, d: Decision, ask: bool = False) -> Decision:
    """A run that ended (``d`` records its end, or it ended earlier) gives its Lease back only
    once no pod of it can still write: the runner pod and every Dask pod gone (toolkit's
    ``pods_gate``). Until then the DaskCluster is deleted again, a runner Job still running is
    deleted, and the OutputLease condition says what the Lease waits for. The pass that records
    the end does not wait for a pod listing (``ask`` False): the Lease then goes back in a
    later pass over the finished run."""
    lease = o.status.get("outputLease")
    if d.needs or not lease:
        return d
    gate = pods_gate(o.pods, o.pods_checked)
    if isinstance(gate, Need):
        return Decision(needs=gate.what) if ask else d
    base = d.patch["conditions"] if "conditions" in d.patch else o.status.get("conditions")
    if isinstance(gate, Wait):
        text = gate.message(f"Giving back the output Lease {lease}")
        conditions = set_condition(base, "OutputLease", "True", "Draining", text, o.now)
        patch = {**d.patch, "conditions": conditions} if conditions != base else d.patch
        job = _current_job(o)
        running = job.name if job is not None and job.state in ("pending", "active") else None
        return dataclasses.replace(d, patch=patch, delete_cluster=True, delete_job=d.delete_job or running)
    patch = {**d.patch, "outputLease": None}
    if condition(o.status, "OutputLease"):
        patch["conditions"] = set_condition(base, "OutputLease", "False", "Released", None, o.now)
    return dataclasses.replace(d, patch=patch, release_lease=lease)


def _succeeded(o: Observed) -> Decision:
    # What the output now holds complete: an edit back to it later runs nothing (``_converted``).
    converted = o.status.get("conversionHash") or o.conversion or None
    patch = {**succeeded_patch(o.status, o.now), "nextRetryTime": None, "convertedHash": converted}
    event = ("Normal", "Succeeded", f"Converted into {o.status.get('output') or o.output}.")
    return _ended(o, Decision(patch, event=event))


def _final(o: Observed, reason: str, message: str, delete_job: str | None = None, failures: Any = None) -> Decision:
    patch = {**failed_patch(o.status, reason, message, o.now), "nextRetryTime": None}
    if failures is not None:
        patch["failures"] = failures
    event = ("Warning", reason, bounded(message) or "")
    return _ended(o, Decision(patch, delete_job=delete_job, delete_cluster=True, event=event))


def _refusal(o: Observed) -> tuple[str, str] | None:
    """(reason, message) when this job must not run: an older ConversionBatch has its name
    (NameTaken), or the tenant policy refuses its spec (PolicyDenied)."""
    if o.name_taken is not None:
        return "NameTaken", o.name_taken
    if o.policy_denial is not None:
        return "PolicyDenied", o.policy_denial
    return None


def _refused(o: Observed, reason: str, message: str) -> Decision:
    """Failed with ``reason``: no runner Job, Lease or DaskCluster is created, and the children of
    a run in flight (its spec was edited, or the policy tightened) are deleted; its Lease goes
    back once their pods are gone. A job that never ran deletes nothing: with NameTaken, what
    its name names is the other object's."""
    status = o.status
    if (
        status.get("phase") == Phase.FAILED
        and status.get("reason") == reason
        and status.get("message") == bounded(message)
    ):
        return _settled(o)
    job = _current_job(o) if _in_flight_now(status) else None
    d = _final(o, reason, message, delete_job=job.name if job else None)
    return d if int(status.get("attempts") or 0) else dataclasses.replace(d, delete_cluster=False)


def _after_failure(
    o: Observed, attempt: int, reason: str, message: str, can_retry: bool, event_reason: str | None = None
) -> Decision:
    status = o.status
    failures = failure_record(attempt, reason, message, o.now, status.get("failures"))
    if reason in PERMANENT_REASONS:
        return _final(o, reason, message, failures=failures)
    first = int(status.get("firstAttempt") or 1)
    run_attempts = attempt - first + 1
    if not can_retry:
        return _final(
            o,
            reason,
            f"Attempt {attempt} failed ({reason}: {message}); not retried, because the spec of "
            f"generation {o.generation} is invalid: {o.spec_error}",
            failures=failures,
        )
    if run_attempts > o.backoff_limit:
        total = f"{run_attempts} attempt(s) failed (backoffLimit {o.backoff_limit}); the last one: {reason}: {message}"
        return _final(o, "BackoffLimitExceeded", total, failures=failures)
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
        "conditions": set_condition(status.get("conditions"), "Running", "False", reason, message, o.now),
    }
    return Decision(patch, delete_cluster=True, event=("Warning", event_reason or "Retrying", note))


# ---------------------------------------------------------------------------------------------
# Finished runs and invalid specs


def _settled(o: Observed) -> Decision:
    """A finished run stays finished: only its generation stamp may change (an edit that did not
    change the conversion), and its Lease goes back once its pods are gone (``_ended``)."""
    return _ended(o, NOTHING, ask=True)


def _invalid(o: Observed, error: str) -> Decision:
    """An invalid spec never starts anything. A job that never ran fails with InvalidSpec. A run
    in flight continues to its end, without retries (no Running -> Failed -> Running flapping);
    a finished run keeps its outcome. Validated=False (and one Warning Event) names the field."""
    status = o.status
    if not int(status.get("attempts") or 0):
        if status.get("reason") == "InvalidSpec" and status.get("observedGeneration") == o.generation:
            return NOTHING
        return Decision(invalid_patch(error, o.now), event=("Warning", "InvalidSpec", error))
    d = _in_flight(o, can_start=False) if _in_flight_now(status) else _settled(o)
    if d.needs:
        return d
    cond = condition(status, "Validated") or {}
    if cond.get("status") == "False" and cond.get("message") == error:
        return d
    base = d.patch["conditions"] if "conditions" in d.patch else status.get("conditions")
    conditions = set_condition(base, "Validated", "False", "InvalidSpec", error, o.now)
    kept = (
        "the running attempt continues with the previous spec"
        if _in_flight_now(status)
        else f"the {status.get('phase')} outcome stands"
    )
    message = f"Generation {o.generation} is invalid; {kept}: {error}"
    return dataclasses.replace(
        d, patch={**d.patch, "conditions": conditions}, event=d.event or ("Warning", "InvalidSpec", message)
    )


def _validated(o: Observed, d: Decision) -> Decision:
    """A valid spec after an invalid edit: Validated is True again."""
    cond = condition(o.status, "Validated")
    if d.needs or cond is None or cond.get("status") == "True" or "attempts" in d.patch and d.patch.get("firstAttempt"):
        return d
    base = d.patch["conditions"] if "conditions" in d.patch else o.status.get("conditions")
    return dataclasses.replace(
        d, patch={**d.patch, "conditions": set_condition(base, "Validated", "True", "SpecValid", None, o.now)}
    )


# ---------------------------------------------------------------------------------------------


def _merge(d: Decision, patch: dict[str, Any]) -> Decision:
    return dataclasses.replace(d, patch={**patch, **d.patch}) if patch and not d.needs else d


def _conditions_patch(status: dict[str, Any], now: str) -> dict[str, Any]:
    """Mirror the runner's phases into conditions (only the operator writes conditions)."""
    phase = status.get("phase")
    conditions = status.get("conditions")
    new = conditions
    if status.get("plan"):
        new = set_condition(new, "Planned", "True", "Planned", _plan_message(status["plan"]), now)
    if phase == Phase.RUNNING:
        new = set_condition(new, "Running", "True", "Writing", None, now)
    return {"conditions": new} if new != conditions else {}


def _plan_message(plan: dict[str, Any]) -> str:
    return (
        f"{plan.get('workers')} worker(s) x {plan.get('threadsPerWorker')} thread(s), pod limit {plan.get('podLimit')}, "
        f"Dask memory_limit {plan.get('memoryLimit')}, slab {plan.get('slab')}, {plan.get('tasks')} task(s)"
    )
