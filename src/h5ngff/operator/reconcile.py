"""The operator's decisions, as a pure function of what it observes.

``reconcile(observed) -> Decision`` looks at a ConversionJob's status, its runner Job of the
current attempt and that Job's pods, and says what to patch, which runner Job must exist, and
which event to post. The kopf handlers only gather the inputs and carry the decision out, so
every transition (retry, give up, succeed) is tested here without any API.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from .manifests import LABEL_ATTEMPT, runner_job_name
from .status import (
    PERMANENT_REASONS,
    TERMINAL_PHASES,
    failed_patch,
    failure_record,
    pending_patch,
    set_condition,
    succeeded_patch,
)

#: Pod termination reasons the kubelet reports when the kernel killed a container at its limit.
OOM_REASONS = frozenset({"OOMKilled"})


@dataclass(frozen=True)
class JobSummary:
    """What the operator needs from a runner Job (kept in a kopf index, so it must be small)."""

    name: str
    attempt: int
    state: str  #: pending, active, succeeded, failed
    reason: str | None = None
    message: str | None = None
    #: uid of the controlling ConversionJob: a Job left by a deleted namesake is not ours.
    owner_uid: str = ""


def job_summary(job: dict[str, Any]) -> JobSummary:
    meta = job.get("metadata") or {}
    status = job.get("status") or {}
    attempt = int((meta.get("labels") or {}).get(LABEL_ATTEMPT, "0") or 0)
    conditions = {c.get("type"): c for c in status.get("conditions") or () if c.get("status") == "True"}
    state = "pending"
    if "Complete" in conditions or status.get("succeeded"):
        state = "succeeded"
    elif "Failed" in conditions or (status.get("failed") and not status.get("active")):
        state = "failed"
    elif status.get("active"):
        state = "active"
    failed = conditions.get("Failed") or {}
    owner = next((r.get("uid", "") for r in meta.get("ownerReferences") or () if r.get("controller")), "")
    return JobSummary(meta.get("name", ""), attempt, state, failed.get("reason"), failed.get("message"), owner)


@dataclass(frozen=True)
class Observed:
    name: str
    status: dict[str, Any]
    backoff_limit: int
    output: str
    jobs: tuple[JobSummary, ...] = ()
    #: Pods of the current attempt's runner Job (only looked up once it failed).
    pods: tuple[dict[str, Any], ...] = ()
    pods_checked: bool = False
    now: str = ""
    #: Why the tenant policy (operator/policy.py) refuses this spec, or None. Checked first: a
    #: denied job gets no child at all.
    policy_denial: str | None = None


@dataclass(frozen=True)
class Decision:
    patch: dict[str, Any] = field(default_factory=dict)
    #: The attempt whose runner Job must exist (created if missing; an existing one is kept).
    ensure_attempt: int | None = None
    #: Resume instead of overwrite in that attempt (an earlier one may have written slabs).
    resume: bool = False
    #: Delete the DaskCluster an earlier attempt left behind before the next one starts.
    delete_cluster: bool = False
    #: (type, reason, message) of a Kubernetes Event to post, or None.
    event: tuple[str, str, str] | None = None
    #: The current runner Job failed and its pods must be looked at before deciding.
    needs_pods: bool = False


NOTHING = Decision()


def reconcile(o: Observed) -> Decision:
    status = o.status
    if status.get("phase") in TERMINAL_PHASES:
        return NOTHING
    if o.policy_denial:
        return _policy_denied(o)
    attempt = int(status.get("attempts") or 0)
    if attempt == 0:
        job = runner_job_name(o.name, 1)
        return Decision(pending_patch(status, 1, job, o.output, o.now), ensure_attempt=1,
                        event=("Normal", "RunnerCreated", f"Created runner Job {job} (attempt 1 of {o.backoff_limit + 1})."))
    job = next((j for j in o.jobs if j.attempt == attempt), None)
    if job is None:
        return Decision(_conditions_patch(status, o.now), ensure_attempt=attempt, resume=attempt > 1)
    if job.state == "succeeded":
        return Decision(succeeded_patch(status, o.now), event=("Normal", "Succeeded", f"Converted into {status.get('output') or o.output}."))
    if job.state == "failed":
        if not o.pods_checked and _runner_report(status, attempt) is None:
            return Decision(needs_pods=True)
        return _after_failure(o, attempt, job)
    return Decision(_conditions_patch(status, o.now))


def _policy_denied(o: Observed) -> Decision:
    """Failed with reason PolicyDenied: no runner Job is ensured, so nothing is created. A cluster
    an earlier attempt made (before the spec or the policy changed) is deleted."""
    attempted = int(o.status.get("attempts") or 0) > 0
    patch = failed_patch(o.status, "PolicyDenied", o.policy_denial or "", o.now)
    return Decision(patch, delete_cluster=attempted, event=("Warning", "PolicyDenied", o.policy_denial or ""))


def _after_failure(o: Observed, attempt: int, job: JobSummary) -> Decision:
    reason, message = failure_cause(o.status, attempt, job, o.pods)
    failures = failure_record(attempt, reason, message, o.now, o.status.get("failures"))
    if reason in PERMANENT_REASONS:
        patch = {**failed_patch(o.status, reason, message, o.now), "failures": failures}
        return Decision(patch, delete_cluster=True, event=("Warning", reason, message))
    if attempt <= o.backoff_limit:
        nxt = attempt + 1
        job_name = runner_job_name(o.name, nxt)
        note = f"Attempt {attempt} failed ({reason}: {message}); retrying as attempt {nxt} of {o.backoff_limit + 1}, resuming from the manifest."
        patch = {**pending_patch(o.status, nxt, job_name, o.output, o.now), "failures": failures, "runner": None, "reason": reason, "message": note}
        patch["conditions"] = set_condition(patch["conditions"], "Running", "False", reason, message, o.now)
        return Decision(patch, ensure_attempt=nxt, resume=True, delete_cluster=True, event=("Warning", "Retrying", note))
    total = f"{attempt} attempt(s) failed (backoffLimit {o.backoff_limit}); the last one: {reason}: {message}"
    patch = {**failed_patch(o.status, "BackoffLimitExceeded", total, o.now), "failures": failures}
    return Decision(patch, delete_cluster=True, event=("Warning", "BackoffLimitExceeded", total))


def _runner_report(status: dict[str, Any], attempt: int) -> dict[str, Any] | None:
    report = status.get("runner") or None
    if report and report.get("attempt") == attempt and report.get("outcome") == "Failed":
        return report
    return None


def failure_cause(status: dict[str, Any], attempt: int, job: JobSummary, pods: tuple[dict[str, Any], ...]) -> tuple[str, str]:
    """Why an attempt failed: the kubelet's word on an OOM-killed runner pod first (a killed
    runner cannot report), then the runner's own report, then the Job's condition."""
    oom = _oom_killed_pod(pods)
    if oom is not None:
        return "OOMKilled", oom
    report = _runner_report(status, attempt)
    if report is not None:
        return report.get("reason") or "RunnerFailed", report.get("message") or ""
    exited = _exited_pod(pods)
    if exited is not None:
        return "RunnerFailed", exited
    detail = ": ".join(x for x in (job.reason, job.message) if x) or "no reason given"
    return "RunnerFailed", f"Runner Job {job.name} failed ({detail})."


def _terminated(pod: dict[str, Any]):
    for cs in (pod.get("status") or {}).get("containerStatuses") or ():
        state = cs.get("state") or {}
        last = cs.get("lastState") or {}
        term = state.get("terminated") or last.get("terminated")
        if term:
            yield cs.get("name", "runner"), term


def _memory_limit(pod: dict[str, Any]) -> str:
    for c in (pod.get("spec") or {}).get("containers") or ():
        limit = ((c.get("resources") or {}).get("limits") or {}).get("memory")
        if limit:
            return str(limit)
    return "unknown"


def _oom_killed_pod(pods: tuple[dict[str, Any], ...]) -> str | None:
    for pod in pods:
        for container, term in _terminated(pod):
            if term.get("reason") in OOM_REASONS:
                name = (pod.get("metadata") or {}).get("name", "?")
                return (f"OOMKilled by the kernel: runner pod {name} (container {container}) exceeded its memory limit "
                        f"{_memory_limit(pod)} (exit code {term.get('exitCode', 137)}). The runner holds no slab data; "
                        f"report this with `h5ngff plan --json` output.")
    return None


def _exited_pod(pods: tuple[dict[str, Any], ...]) -> str | None:
    for pod in pods:
        for container, term in _terminated(pod):
            if term.get("exitCode", 0) != 0:
                name = (pod.get("metadata") or {}).get("name", "?")
                why = term.get("reason") or "Error"
                return f"Runner pod {name} exited with code {term.get('exitCode')} ({why}) before reporting; see `kubectl logs {name}`."
    return None


def _conditions_patch(status: dict[str, Any], now: str) -> dict[str, Any]:
    """Mirror the runner's phases into conditions (only the operator writes conditions)."""
    phase = status.get("phase")
    conditions = status.get("conditions")
    new = conditions
    if status.get("plan"):
        new = set_condition(new, "Planned", "True", "Planned", _plan_message(status["plan"]), now)
    if phase == "Running":
        new = set_condition(new, "Running", "True", "Writing", None, now)
    return {"conditions": new} if new != conditions else {}


def _plan_message(plan: dict[str, Any]) -> str:
    return (f"{plan.get('workers')} worker(s) x {plan.get('threadsPerWorker')} thread(s), pod limit {plan.get('podLimit')}, "
            f"Dask memory_limit {plan.get('memoryLimit')}, slab {plan.get('slab')}, {plan.get('tasks')} task(s)")
