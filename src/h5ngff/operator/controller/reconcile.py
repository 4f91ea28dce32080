"""The operator's decisions, as a pure function of what it observes.

``reconcile(observed) -> Decision`` looks at a ConversionJob's spec (its generation and the hash
of its conversion fields), its status, the runner Job of the current attempt and, when asked
for, the pods, Events and output Lease; it says what to patch, which runner Job must exist or
go, and which event to post. The kopf handlers only gather the inputs and carry the decision
out, so every lifecycle rule (docs/operator.md, "Lifecycle") is tested here without any API.

A *run* is the conversion of one spec: attempts 1..n of it (retries), until Succeeded or Failed.
The recorded outcome of a run is final: only an edit that changes the conversion starts a new
run; children that vanish never do.

This module decides which case a pass is (a spec refused, invalid, changed, a run finished or in
flight) and starts runs; ``inflight.py`` follows a run in flight and ``jobdecision.py`` holds the
inputs, the decision and the steps that end a run. The steps a ConversionBatch shares are in
``toolkit.py``.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from .diagnose import (  # noqa: F401  (re-exported: tests and handlers read them from here)
    JobSummary,
    failure_cause,
    job_summary,
    live_pods,
    runner_report,
    start_problem,
)
from ...k8s import runner_job_name
from ...phases import TERMINAL_PHASES, Phase
from .toolkit import conversion_changed
from ..schema.status import (
    ConversionJobStatus,
    bounded,
    at_generation,
    condition,
    invalid_patch,
    patch_list,
    set_condition,
    succeeded_patch,
)

from .inflight import in_flight
from .jobdecision import (  # noqa: F401  (re-exported: tests and passes read them from here)
    NOTHING,
    converted_fields,
    RUN_FIELDS,
    Decision,
    Observed,
    current_job_of,
    ended,
    final,
    in_flight_now,
    patched,
    run_fields_cleared,
    succeeded,
    waiting_for_output,
)


def reconcile(o: Observed) -> Decision:
    status = o.status
    if o.spec_error is not None:
        decision = _invalid(o, o.spec_error)
    elif _refusal(o) is not None and (_conversion_changed(o) or in_flight_now(status)):
        decision = _refused(o, *(_refusal(o) or ("", "")))
    elif _conversion_changed(o):
        decision = _new_run(o)
    elif status.phase in TERMINAL_PHASES:
        decision = _settled(o)
    else:
        decision = in_flight(o, can_start=True)
    if o.spec_error is None:
        decision = _validated(o, decision)
    return _stamp(o, decision)


def _stamp(o: Observed, d: Decision) -> Decision:
    """Every status write says which generation it describes (``observedGeneration``, also on
    each condition), so a GitOps tool never reads an old outcome as the current spec's."""
    writing = bool(d.patch) or o.status.observed_generation != o.generation
    adopt = _adopt_hash(o, writing)
    if d.needs or not (writing or adopt):
        return d
    patch = dict(d.patch)
    patch["observedGeneration"] = o.generation
    patch["conditions"] = at_generation(
        patch["conditions"] if "conditions" in patch else patch_list(o.status.conditions), o.generation
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
    if not status.attempts:
        return True  # never started
    if waiting_for_output(status):
        return True
    accepted = (o.legacy_conversion, *o.other_conversions)
    return conversion_changed(status.conversion_hash, o.conversion, accepted, o.generation, _compared_at(status))


def _compared_at(status: ConversionJobStatus) -> int | None:
    if status.conversion_generation is not None:
        return status.conversion_generation
    # A status from a build before conversionGeneration: it stamped observedGeneration on every
    # write, and one stopping a run for a changed spec (SpecChanged) had not compared it yet.
    return None if status.reason == "SpecChanged" else status.observed_generation


def _adopt_hash(o: Observed, writing: bool) -> dict[str, Any]:
    """The spec was compared at this generation and is the same conversion: record today's hash
    and the generation (with a write that happens anyway, or when the hash differs), so the
    next edit is compared with a hash this build computes."""
    status = o.status
    if not o.conversion or not status.attempts or _conversion_changed(o):
        return {}
    differs = status.conversion_hash != o.conversion
    if not differs and (status.conversion_generation == o.generation or not writing):
        return {}
    return {"conversionHash": o.conversion, "conversionGeneration": o.generation}


def _new_run(o: Observed) -> Decision:
    """The conversion changed (or never ran): stop what runs, wait for its pods, take the
    output's Lease, then start attempt 1 of the new run. A run whose runner reported success
    before the edit was noticed is remembered as converted (its output holds it)."""
    remembered = _reported_success(o)
    if not remembered:
        return _new_run_steps(o)
    o = dataclasses.replace(o, status=patched(o.status, remembered))
    d = _new_run_steps(o)
    return d if d.needs else dataclasses.replace(d, patch={**remembered, **d.patch})


def _reported_success(o: Observed) -> dict[str, Any]:
    status = o.status
    attempt = status.attempts or 0
    report = runner_report(status, attempt) if attempt else None
    if not (report and report.outcome == "Succeeded" and status.conversion_hash):
        return {}
    fields = converted_fields(o)
    return {} if status.converted_hash == fields["convertedHash"] else fields


def _new_run_steps(o: Observed) -> Decision:
    status = o.status
    job = current_job_of(o)
    if job is not None and in_flight_now(status):
        message = f"The conversion changed in generation {o.generation}: stopping attempt {status.attempts} (runner Job {job.name}) to start a new run."
        patch = {
            "phase": Phase.PENDING.value,
            "reason": "SpecChanged",
            "message": message,
            "conditions": set_condition(
                patch_list(status.conditions), "Running", "False", "SpecChanged", message, o.now
            ),
        }
        return Decision(patch, delete_job=job.name, delete_cluster=True, event=("Normal", "SpecChanged", message))
    if status.attempts and not o.pods_checked:
        return Decision(needs=frozenset({"pods"}))
    running = live_pods(o.pods)
    if running:
        message = f"Waiting for {len(running)} pod(s) of the stopped run to exit before the new run starts: {', '.join(running[:5])}."
        return Decision(
            {"reason": "SpecChanged", "message": message} if status.message != message else {},
            delete_cluster=True,
        )
    if o.conversion and status.converted_hash == o.conversion:
        return _converted(o)
    old_lease = status.output_lease
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
        "completionTime": status.completion_time or o.now,
    }
    return ended(o, Decision(patch, event=("Normal", "Succeeded", message)), ask=True)


def _output_busy(o: Observed, release: str | None) -> Decision:
    status = o.status
    since = f" since {o.lease.since}" if o.lease.since else ""
    message = (
        f"Waiting for the output {o.output}: ConversionJob {o.lease.holder or '?'} writes it (Lease {o.lease.name}{since}). "
        f"This job starts when that one ends or is deleted."
    )
    patch: dict[str, Any] = {}
    if status.reason != "OutputBusy" or status.message != message:
        patch = {
            "phase": Phase.PENDING.value,
            "reason": "OutputBusy",
            "message": message,
            "output": o.output,
            # The earlier run's attempt is over (its pods are gone): none is current until this
            # run starts, so an edit back to that run's spec never takes its attempt up again.
            "runnerJob": None,
            "runnerJobUid": None,
            "conditions": set_condition(
                patch_list(status.conditions), "OutputLease", "False", "OutputBusy", message, o.now
            ),
        }
        if release:
            patch["outputLease"] = None
    event = ("Normal", "OutputBusy", message) if status.reason != "OutputBusy" else None
    return Decision(patch, release_lease=release, event=event)


def _start_run(o: Observed, release: str | None) -> Decision:
    status = o.status
    attempt = (status.attempts or 0) + 1
    job = runner_job_name(o.name, attempt)
    conditions = set_condition(None, "Validated", "True", "SpecValid", None, o.now)
    conditions = set_condition(conditions, "OutputLease", "True", "Held", o.lease.name, o.now)
    patch = run_fields_cleared(status)
    if status.converted_output == o.lease.name:  # this run writes the output that held it
        patch.update(convertedHash=None, convertedOutput=None)
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
    if status.phase == Phase.FAILED.value and status.reason == reason and status.message == bounded(message):
        return _settled(o)
    job = current_job_of(o) if in_flight_now(status) else None
    d = final(o, reason, message, delete_job=job.name if job else None)
    return d if status.attempts else dataclasses.replace(d, delete_cluster=False)


def _settled(o: Observed) -> Decision:
    """A finished run stays finished: only its generation stamp may change (an edit that did not
    change the conversion), and its Lease goes back once its pods are gone (``ended``)."""
    return ended(o, NOTHING, ask=True)


def _invalid(o: Observed, error: str) -> Decision:
    """An invalid spec never starts anything. A job that never ran fails with InvalidSpec. A run
    in flight continues to its end, without retries (no Running -> Failed -> Running flapping);
    a finished run keeps its outcome. Validated=False (and one Warning Event) names the field."""
    status = o.status
    if not status.attempts:
        if status.reason == "InvalidSpec" and status.observed_generation == o.generation:
            return NOTHING
        return Decision(invalid_patch(error, o.now), event=("Warning", "InvalidSpec", error))
    d = in_flight(o, can_start=False) if in_flight_now(status) else _settled(o)
    if d.needs:
        return d
    cond = condition(status, "Validated")
    if cond is not None and cond.status == "False" and cond.message == error:
        return d
    base = d.patch["conditions"] if "conditions" in d.patch else patch_list(status.conditions)
    conditions = set_condition(base, "Validated", "False", "InvalidSpec", error, o.now)
    kept = (
        "the running attempt continues with the previous spec"
        if in_flight_now(status)
        else f"the {status.phase} outcome stands"
    )
    message = f"Generation {o.generation} is invalid; {kept}: {error}"
    return dataclasses.replace(
        d, patch={**d.patch, "conditions": conditions}, event=d.event or ("Warning", "InvalidSpec", message)
    )


def _validated(o: Observed, d: Decision) -> Decision:
    """A valid spec after an invalid edit: Validated is True again."""
    cond = condition(o.status, "Validated")
    if d.needs or cond is None or cond.status == "True" or "attempts" in d.patch and d.patch.get("firstAttempt"):
        return d
    base = d.patch["conditions"] if "conditions" in d.patch else patch_list(o.status.conditions)
    return dataclasses.replace(
        d, patch={**d.patch, "conditions": set_condition(base, "Validated", "True", "SpecValid", None, o.now)}
    )
