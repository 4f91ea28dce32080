"""Why a runner attempt failed, or why its pod does not start: read from what Kubernetes reports.

Pure functions of API objects (pods, Events, the runner's report): the kubelet's word on an
OOM-killed container comes first (a killed runner cannot report), then the runner's own report,
then the exit code, then the Job controller's condition. A pod that does not start is explained
by the scheduler (``PodScheduled=False``, Unschedulable), the kubelet (image pulls) or the Job
controller's ``FailedCreate`` Event (e.g. a Pod Security admission rejection).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterator

from ...k8s import LABEL_ATTEMPT, LABEL_COMPONENT
from ...phases import TERMINAL_PHASES
from ..schema.status import ConversionJobStatus, RunnerReport

#: Pod termination reasons the kubelet reports when the kernel killed a container at its limit.
OOM_REASONS = frozenset({"OOMKilled"})
#: Kubernetes' own Pod phases after which a pod runs no more (not h5ngff.phases, though spelled alike).
POD_ENDED = frozenset({"Succeeded", "Failed"})
#: Container waiting reasons that mean the container will not start by itself soon.
STUCK_WAITING = frozenset(
    {"ErrImagePull", "ImagePullBackOff", "InvalidImageName", "CreateContainerConfigError", "CreateContainerError"}
)


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
    #: The Job's own uid (its name if the API gave none), to tell "deleted" from "not yet seen".
    uid: str = ""


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
    name = meta.get("name", "")
    return JobSummary(name, attempt, state, failed.get("reason"), failed.get("message"), owner, meta.get("uid") or name)


def runner_report(status: ConversionJobStatus, attempt: int) -> RunnerReport | None:
    """The runner's own account of ``attempt``, if it delivered one."""
    report = status.runner
    if report is not None and report.attempt == attempt and report.outcome in TERMINAL_PHASES:
        return report
    return None


def failure_cause(
    status: ConversionJobStatus, attempt: int, job: JobSummary | None, pods: tuple[dict[str, Any], ...]
) -> tuple[str, str]:
    """Why an attempt failed: the kubelet's word on an OOM-killed runner pod first (a killed
    runner cannot report), then the runner's own report, then the Job's condition."""
    pods = tuple(p for p in pods if is_runner_pod(p, attempt))
    oom = _oom_killed_pod(pods)
    if oom is not None:
        return "OOMKilled", oom
    report = runner_report(status, attempt)
    if report is not None and report.outcome == "Failed":
        return report.reason or "RunnerFailed", report.message or ""
    exited = _exited_pod(pods)
    if exited is not None:
        return "RunnerFailed", exited
    if job is None:
        return "RunnerDeleted", (
            f"The runner Job of attempt {attempt} was deleted while it ran (by hand, or its pod was "
            f"evicted with it) before the runner reported an outcome."
        )
    detail = ": ".join(x for x in (job.reason, job.message) if x) or "no reason given"
    if not pods:
        detail += "; its pod is gone (deleted or evicted)"
    return "RunnerFailed", f"Runner Job {job.name} failed ({detail})."


def is_runner_pod(pod: dict[str, Any], attempt: int | None = None) -> bool:
    labels = (pod.get("metadata") or {}).get("labels") or {}
    if labels.get(LABEL_COMPONENT) != "runner":
        return False
    return attempt is None or labels.get(LABEL_ATTEMPT) == str(attempt)


def live_pods(pods: tuple[dict[str, Any], ...]) -> list[str]:
    """Names of pods that may still run (and write): not yet Succeeded or Failed."""
    return sorted(
        (p.get("metadata") or {}).get("name", "?")
        for p in pods
        if (p.get("status") or {}).get("phase") not in POD_ENDED
    )


def start_problem(
    pods: tuple[dict[str, Any], ...], events: tuple[dict[str, Any], ...], job_name: str
) -> tuple[str, str] | None:
    """(reason, message) when the runner's pod cannot start, in the words of who stops it."""
    for pod in pods:
        name = (pod.get("metadata") or {}).get("name", "?")
        status = pod.get("status") or {}
        for cond in status.get("conditions") or ():
            if (
                cond.get("type") == "PodScheduled"
                and cond.get("status") == "False"
                and cond.get("reason") == "Unschedulable"
            ):
                return (
                    "Unschedulable",
                    f"Runner pod {name} cannot be scheduled: {cond.get('message') or 'no reason given'}",
                )
        for cs in status.get("containerStatuses") or ():
            waiting = (cs.get("state") or {}).get("waiting") or {}
            if waiting.get("reason") in STUCK_WAITING:
                return waiting[
                    "reason"
                ], f"Runner pod {name} cannot start its container: {waiting.get('message') or waiting['reason']}"
    if not pods:
        for event in reversed(events):
            involved = event.get("involvedObject") or {}
            if event.get("reason") == "FailedCreate" and involved.get("name") == job_name:
                return (
                    "FailedCreate",
                    f"The Job controller cannot create the pod of runner Job {job_name}: {event.get('message') or ''}".rstrip(
                        ": "
                    ),
                )
    return None


def _terminated(pod: dict[str, Any]) -> Iterator[tuple[str, dict[str, Any]]]:
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
                return (
                    f"OOMKilled by the kernel: runner pod {name} (container {container}) exceeded its memory limit "
                    f"{_memory_limit(pod)} (exit code {term.get('exitCode', 137)}). The runner holds no slab data; "
                    f"report this with `h5ngff plan --json` output."
                )
    return None


def _exited_pod(pods: tuple[dict[str, Any], ...]) -> str | None:
    for pod in pods:
        for _container, term in _terminated(pod):
            if term.get("exitCode", 0) != 0:
                name = (pod.get("metadata") or {}).get("name", "?")
                why = term.get("reason") or "Error"
                return f"Runner pod {name} exited with code {term.get('exitCode')} ({why}) before reporting; see `kubectl logs {name}`."
    return None
