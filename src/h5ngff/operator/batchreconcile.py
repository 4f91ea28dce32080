"""A ConversionBatch's decisions, as a pure function of what the operator observes.

``reconcile_batch(observed) -> BatchDecision``: the items the spec lists now (each with its id,
an output hash, and the hash of its conversion), the status (``items`` as the operator last
decided, ``itemReports`` as the runner wrote them), the runner Job of the current attempt and,
when asked for, the output Leases of the items about to run and the batch's pods. The handlers
gather those and carry the decision out (operator/batchhandlers.py).

The GitOps rules (docs/operator.md, "ConversionBatch"):

* an item added to the list is converted (in the next attempt, if one is running);
* a Succeeded item never runs again while its conversion hash stays: an operator restart or
  upgrade changes neither the status nor the hash (it leaves defaults out, as a job's does);
* an item removed from the list is dropped from ``status.items`` (once no runner has it) and its
  output is left alone; its output Lease, if the batch held one, is given back;
* an edit that changes an item's conversion (its source, or a conversion field of the batch,
  which changes every item's) makes that item Pending again: it alone re-runs;
* one runner Job per attempt runs the items that were Pending when it started, each under its
  output's Lease; an item whose output another job or batch holds waits (reason OutputBusy).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping

from ..phases import Phase
from .diagnose import JobSummary, live_pods
from .manifests import runner_job_name
from .status import PERMANENT_REASONS

RUNNING, PENDING, SUCCEEDED, FAILED = (
    Phase.RUNNING.value,
    Phase.PENDING.value,
    Phase.SUCCEEDED.value,
    Phase.FAILED.value,
)


@dataclass(frozen=True)
class DesiredItem:
    """An item as the spec lists it now."""

    id: str
    source: str
    output: str
    conversion_hash: str
    lease_name: str


@dataclass(frozen=True)
class LeaseAnswer:
    """The output Lease of one item: taken (held) or someone else's (holder)."""

    name: str
    held: bool
    holder: str = ""


@dataclass(frozen=True)
class BatchObserved:
    name: str
    status: dict[str, Any]
    #: The items of a valid spec, in its order; None when the spec is invalid (nothing new starts).
    items: tuple[DesiredItem, ...] | None
    backoff_limit: int = 0
    jobs: tuple[JobSummary, ...] = ()
    now: str = ""
    generation: int = 1
    spec_error: str | None = None
    policy_denial: str | None = None
    #: Item id -> its output Lease, for the items about to run (None: not asked yet).
    leases: Mapping[str, LeaseAnswer] | None = None
    #: The current runner Job was looked up by name (the index did not have it).
    job_checked: bool = False
    pods: tuple[dict[str, Any], ...] = ()
    pods_checked: bool = False


@dataclass(frozen=True)
class BatchDecision:
    patch: dict[str, Any] = field(default_factory=dict)
    #: Look these up, then decide again: "leases" (acquire for ``acquire``), "job", "pods".
    needs: frozenset[str] = frozenset()
    #: Item ids whose output Leases to take (with "leases" in needs).
    acquire: tuple[str, ...] = ()
    #: Create the runner Job of this attempt (for ``patch["runningItems"]``), if it is not there.
    ensure_attempt: int | None = None
    #: Item ids the runner resumes (overwrite off): a retry never replaces what it wrote.
    resume: tuple[str, ...] = ()
    release_leases: tuple[str, ...] = ()
    delete_job: str | None = None
    delete_cluster: bool = False
    event: tuple[str, str, str] | None = None


NOTHING = BatchDecision()


def reconcile_batch(o: BatchObserved) -> BatchDecision:
    status = o.status
    attempt = int(status.get("attempts") or 0)
    running = list(status.get("runningItems") or ())
    items = {e["id"]: dict(e) for e in status.get("items") or ()}
    releases: list[str] = []
    events: list[tuple[str, str, str]] = []
    patch: dict[str, Any] = {}
    delete_job = None
    delete_cluster = False

    if o.policy_denial is not None:
        return _denied(o, items, running, attempt)

    # 1. The current attempt: fold the runner's reports in; at its end, every item it had ends.
    if running:
        job = next((j for j in o.jobs if j.name == status.get("runnerJob")), None)
        if job is None and not o.job_checked:
            return BatchDecision(needs=frozenset({"job"}))
        ended = (
            job is not None and job.state in ("succeeded", "failed") or job is None and bool(status.get("runnerJobUid"))
        )
        if job is None and not ended:  # asked for by a pass that did not live to see it: ask again (409 keeps one)
            return BatchDecision(ensure_attempt=attempt, resume=tuple(running))
        if job is not None and status.get("runnerJobUid") != job.uid and job.uid:
            patch["runnerJobUid"] = job.uid
        reports = {k: v for k, v in (status.get("itemReports") or {}).items() if v and v.get("attempt") == attempt}
        still = []
        for item_id in running:
            entry = items.get(item_id)
            report = reports.get(item_id)
            if entry is None:
                continue
            outcome = (report or {}).get("outcome")
            if outcome in (SUCCEEDED, FAILED):
                _finish(entry, report or {}, o, releases)
            elif ended:
                cause = (
                    job.message
                    if job is not None and job.message
                    else "the runner Job ended (or was deleted) before it reported on this item"
                )
                _finish(entry, {"outcome": FAILED, "reason": "RunnerFailed", "message": cause}, o, releases)
            else:
                if report and report.get("progress"):  # a running item's slabs, as last reported
                    entry["progress"] = report["progress"]
                still.append(item_id)
        if ended:
            still = []
            delete_cluster = True
            events.append(("Normal", "AttemptEnded", f"Runner attempt {attempt} ended."))
        running = still
        if not running:
            patch["runningItems"] = None

    # 2. The spec's items: added ones are Pending, changed ones Pending again, removed ones go.
    if o.items is not None:
        table: dict[str, dict[str, Any]] = {}
        for d in o.items:
            entry = items.pop(d.id, None)
            if entry is None:
                entry = {"id": d.id, "phase": PENDING, "conversionHash": d.conversion_hash, "attempts": 0}
            elif entry.get("conversionHash") != d.conversion_hash and d.id not in running:
                if entry.get("phase") != PENDING or entry.get("attempts"):
                    events.append(("Normal", "ItemChanged", f"{d.output}: its conversion changed; it runs again."))
                entry = {"id": d.id, "phase": PENDING, "conversionHash": d.conversion_hash, "attempts": 0}
            entry.update(source=d.source, output=d.output)
            table[d.id] = entry
        for item_id, entry in items.items():  # removed from the spec
            if item_id in running:
                table[item_id] = entry  # its runner has it: it goes when the attempt ends
            elif entry.get("outputLease"):
                releases.append(entry["outputLease"])
        items = table

    # 3. No attempt in flight and items pending: take their Leases and start one for those held.
    decision_start: int | None = None
    pending = [e for e in items.values() if e["phase"] == PENDING]
    if not running and pending and o.items is not None:
        if o.leases is None:
            return BatchDecision(needs=frozenset({"leases"}), acquire=tuple(e["id"] for e in pending))
        if attempt and not o.pods_checked:
            return BatchDecision(needs=frozenset({"pods"}), acquire=tuple(e["id"] for e in pending))
        lingering = live_pods(o.pods) if attempt else []
        held = []
        for entry in pending:
            lease = o.leases.get(entry["id"])
            if lease is not None and lease.held:
                held.append(entry["id"])
                entry.update(outputLease=lease.name, reason=None, message=None)
            else:
                holder = lease.holder if lease is not None else "unknown"
                entry.update(reason="OutputBusy", message=f"Waiting for the output, which {holder} is writing.")
                entry.pop("outputLease", None)
        if held and lingering:  # a previous attempt's pods still run: never two writers of one output
            patch["message"] = (
                f"Attempt {attempt + 1} waits for {len(lingering)} pod(s) of the previous attempt to exit: {', '.join(lingering[:5])}."
            )
            delete_cluster = True
        elif held:
            decision_start = attempt + 1
            for item_id in held:
                items[item_id].update(
                    phase=RUNNING, attempt=decision_start, attempts=int(items[item_id].get("attempts") or 0) + 1
                )
            running = held
            patch.update(
                attempts=decision_start,
                runnerJob=runner_job_name(o.name, decision_start),
                runnerJobUid=None,
                runningItems=held,
                itemReports={i: None for i in held if i in (status.get("itemReports") or {})} or None,
                message=None,
            )
            if not status.get("startTime"):
                patch["startTime"] = o.now
            events.append(
                (
                    "Normal",
                    "RunnerCreated",
                    f"Created runner Job {runner_job_name(o.name, decision_start)} for {len(held)} item(s).",
                )
            )
            if patch["itemReports"] is None:
                del patch["itemReports"]

    # 4. The batch as a whole.
    patch = {**_summary(o, list(items.values()), running, attempt), **patch}  # a waiting message of step 3 stands
    patch = {k: v for k, v in patch.items() if status.get(k) != v}
    if not patch and decision_start is None and not releases and not delete_cluster:
        return NOTHING
    resume = tuple(i for i in running if int(items[i].get("attempts") or 0) > 1) if decision_start else ()
    event = events[-1] if events else None
    return BatchDecision(
        patch,
        ensure_attempt=decision_start,
        resume=resume,
        release_leases=tuple(releases),
        delete_job=delete_job,
        delete_cluster=delete_cluster,
        event=event,
    )


def _finish(entry: dict[str, Any], report: dict[str, Any], o: BatchObserved, releases: list[str]) -> None:
    """An item's attempt ended: Succeeded, Failed for good, or Pending for a retry."""
    if entry.get("outputLease"):
        releases.append(entry.pop("outputLease"))
    reason = report.get("reason")
    for key in ("result", "progress", "peakRssBytes", "predictedPeakBytes"):
        if report.get(key) is not None:
            entry[key] = report[key]
    if report.get("outcome") == SUCCEEDED:
        entry.update(phase=SUCCEEDED, reason=None, message=None, completionTime=o.now)
    elif reason in PERMANENT_REASONS or int(entry.get("attempts") or 0) > o.backoff_limit:
        entry.update(phase=FAILED, reason=reason or "Failed", message=report.get("message"), completionTime=o.now)
    else:
        entry.update(phase=PENDING, reason=reason, message=f"Retrying: {report.get('message') or reason}")
    for key in [k for k, v in entry.items() if v is None]:
        del entry[key]


def _summary(o: BatchObserved, items: list[dict[str, Any]], running: list[str], attempt: int) -> dict[str, Any]:
    counts = {phase: sum(e["phase"] == phase for e in items) for phase in (PENDING, RUNNING, SUCCEEDED, FAILED)}
    out: dict[str, Any] = {
        "items": [{k: v for k, v in e.items() if v is not None} for e in items],
        "total": len(items),
        "succeeded": counts[SUCCEEDED],
        "failed": counts[FAILED],
        "running": counts[RUNNING],
        "pending": counts[PENDING],
        "observedGeneration": o.generation,
    }
    if o.spec_error is not None:
        out.update(
            reason="InvalidSpec", message=f"Generation {o.generation} is invalid; nothing new starts: {o.spec_error}"
        )
        if not attempt:
            out.update(phase=FAILED, completionTime=o.status.get("completionTime") or o.now)
            return out
    if running or counts[RUNNING]:
        out.update(phase=RUNNING, completionTime=None)
    elif counts[PENDING]:
        out.update(phase=PENDING, completionTime=None)
    else:
        out["phase"] = FAILED if counts[FAILED] else SUCCEEDED
        if o.status.get("phase") != out["phase"]:
            out["completionTime"] = o.now
    if o.spec_error is None:
        out.update(
            reason="ItemsFailed" if counts[FAILED] and out["phase"] == FAILED else None,
            message=f"{counts[FAILED]} of {len(items)} item(s) failed."
            if counts[FAILED] and out["phase"] == FAILED
            else None,
        )
    return out


def _denied(o: BatchObserved, items: dict[str, dict[str, Any]], running: list[str], attempt: int) -> BatchDecision:
    """PolicyDenied: nothing starts, an attempt in flight is stopped, every Lease goes back."""
    status = o.status
    denial = o.policy_denial or ""
    if (
        status.get("phase") == FAILED
        and status.get("reason") == "PolicyDenied"
        and status.get("message") == denial
        and not running
    ):
        return NOTHING
    releases = []
    for entry in items.values():
        if entry.get("outputLease"):
            releases.append(entry.pop("outputLease"))
        if entry["id"] in running:
            entry.update(
                phase=PENDING,
                reason="PolicyDenied",
                message="Stopped: the batch's spec is denied by the tenant policy.",
            )
    patch = {
        "phase": FAILED,
        "reason": "PolicyDenied",
        "message": denial,
        "completionTime": o.now,
        "runningItems": None,
        "items": list(items.values()) or None,
    }
    job = status.get("runnerJob") if running else None
    return BatchDecision(
        patch,
        release_leases=tuple(releases),
        delete_job=job,
        delete_cluster=bool(running),
        event=("Warning", "PolicyDenied", denial),
    )
