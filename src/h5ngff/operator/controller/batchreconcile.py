"""A ConversionBatch's decisions, as a pure function of what the controller observes.

``reconcile_batch(observed) -> BatchDecision``: the items the spec lists now (each with its id,
its output and the hash of its normalised conversion), the status (``items`` as the controller
last decided, ``itemReports`` as the runner wrote them), the runner Job of the current attempt
and, when asked for, the output Leases of the items about to run and the batch's pods. The
handlers gather those and carry the decision out (operator/controller/batchpass.py).

The status is read into its pydantic models (operator/schema/batchstatus.py) and goes through
typed steps, each one rule; the patch is the difference between what was read and what the
steps made of it:

1. ``_fold_attempt``: the runner's reports of the current attempt go into ``items``; at the end
   of the attempt (its Job ended, or vanished after it existed) every item it had ends;
2. ``_sync_items``: added items are Pending; one whose conversion changed is Pending again;
   removed ones leave ``items`` once no runner has them and their Lease is back;
3. ``_deny``: a spec the tenant policy refuses stops the attempt in flight and starts nothing;
4. ``_settle_leases``: a Lease goes back only when no pod of the batch can still write (toolkit's
   ``pods_gate``), for an item that will not run again (finished, removed, denied);
5. ``_start_attempt``: once the pods of the last attempt are gone, the pending items whose
   output Lease the batch holds (or takes now) run in the next attempt; an item keeps its Lease
   from its first attempt to its last, so a retry never runs without it.

The GitOps rules are docs/operator.md's "ConversionBatch lifecycle" table.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal, Mapping

from ...k8s import runner_job_name
from ..schema.batchstatus import BatchItemStatus, ConversionBatchStatus, ItemReport
from ..schema.status import PERMANENT_REASONS, bounded, dump_status, merge_diff, read_status
from .diagnose import JobSummary
from .toolkit import CurrentJob, Need, Wait, conversion_changed, current_job, pods_gate, without

ItemPhase = Literal["Pending", "Running", "Succeeded", "Failed"]
RUNNING: ItemPhase = "Running"
PENDING: ItemPhase = "Pending"
SUCCEEDED: ItemPhase = "Succeeded"
FAILED: ItemPhase = "Failed"
ENDED = (SUCCEEDED, FAILED)


@dataclass(frozen=True)
class DesiredItem:
    """An item as the spec lists it now."""

    id: str
    source: str
    output: str
    conversion_hash: str
    lease_name: str
    #: Hashes other builds computed for this same conversion (operator upgrades): never a change.
    accepted_hashes: tuple[str, ...] = ()


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
    #: Why this batch must not run because a ConversionJob of its name is older (names.py), or None.
    name_taken: str | None = None

    @property
    def refusal(self) -> tuple[str, str] | None:
        """(reason, message) when nothing of this batch may run: NameTaken, or PolicyDenied."""
        if self.name_taken is not None:
            return "NameTaken", self.name_taken
        if self.policy_denial is not None:
            return "PolicyDenied", self.policy_denial
        return None


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


@dataclass
class _Work:
    """One pass's working copy of the status, and what the steps decided so far."""

    old: dict[str, Any]
    status: ConversionBatchStatus
    items: dict[str, BatchItemStatus]
    running: list[str]
    releases: list[str] = field(default_factory=list)
    events: list[tuple[str, str, str]] = field(default_factory=list)
    removed: set[str] = field(default_factory=set)
    delete_job: str | None = None
    delete_cluster: bool = False
    denied: bool = False
    waiting: Wait | None = None
    ensure_attempt: int | None = None
    resume: tuple[str, ...] = ()

    @classmethod
    def read(cls, o: BatchObserved) -> "_Work":
        status = read_status(ConversionBatchStatus, o.status)
        items = {e.id: e for e in status.items or ()}
        return cls(dump_status(status), status, items, list(status.running_items or ()))

    @property
    def attempt(self) -> int:
        return int(self.status.attempts or 0)


def reconcile_batch(o: BatchObserved) -> BatchDecision:
    w = _Work.read(o)
    for step in (_fold_attempt, _sync_items, _deny, _settle_leases, _start_attempt):
        outcome = step(w, o)
        if isinstance(outcome, Need):
            return BatchDecision(needs=outcome.what)
        if isinstance(outcome, BatchDecision):
            return outcome
    return _decision(w, o)


# ---------------------------------------------------------------------------------------------
# 1. The attempt in flight


def _fold_attempt(w: _Work, o: BatchObserved) -> Need | BatchDecision | None:
    if not w.running:
        return None
    reports = {k: r for k, r in (w.status.item_reports or {}).items() if r is not None and r.attempt == w.attempt}
    cur = current_job(o.jobs, w.status.runner_job, w.status.runner_job_uid, bool(reports), o.job_checked)
    if isinstance(cur, Need):
        return cur
    if cur.state == "unknown":
        return _recreate(w, o)
    if cur.job is not None and cur.job.uid and w.status.runner_job_uid != cur.job.uid:
        w.status.runner_job_uid = cur.job.uid
    ended = cur.state in ("ended", "vanished")
    still = []
    for item_id in w.running:
        entry, report = w.items.get(item_id), reports.get(item_id)
        if entry is None:
            continue
        if report is not None and report.outcome in ENDED:
            _finish(entry, report, o)
        elif ended:
            _finish(entry, _runner_gone(w.attempt, cur), o)
        else:
            if report is not None and report.progress is not None:  # its slabs, as last reported
                entry.progress = report.progress
            still.append(item_id)
    if ended:
        still = []
        w.delete_cluster = True
        w.events.append(("Normal", "AttemptEnded", f"Runner attempt {w.attempt} ended."))
    w.running = still
    return None


def _recreate(w: _Work, o: BatchObserved) -> Need | BatchDecision | None:
    """The attempt's runner Job is missing and no runner spoke: asked for by a pass that did not
    live to see it. Ask again (409 keeps one) once no pod of an earlier one runs and every Lease
    of the attempt is (still, or again) held; overwrite off, since it may have run. A batch that
    may not run, or one whose Lease is someone else's now (released by a pass that died before its
    status write), ends the attempt instead: its items wait for the next one, which starts only
    under their Leases."""
    if o.refusal is None and o.items is not None:
        gate = pods_gate(o.pods, o.pods_checked)
        if isinstance(gate, Need):
            return gate
        if isinstance(gate, Wait):
            return BatchDecision(delete_cluster=True)
        if o.leases is None:
            return BatchDecision(needs=frozenset({"leases"}), acquire=tuple(w.running))
        if all((answer := o.leases.get(i)) is not None and answer.held for i in w.running):
            return BatchDecision(ensure_attempt=w.attempt, resume=tuple(w.running))
    for item_id in w.running:
        entry = w.items.get(item_id)
        if entry is not None:
            entry.phase, entry.reason = PENDING, "RunnerLost"
            entry.message = "Its runner Job was never seen; it runs in the next attempt, resuming."
    w.running = []
    return None


def _runner_gone(attempt: int, cur: CurrentJob) -> ItemReport:
    """An item the attempt had, without a last word from the runner: retryable."""
    if cur.state == "vanished":
        reason, cause = "RunnerDeleted", "the runner Job was deleted before it reported on this item"
    else:
        reason = "RunnerFailed"
        cause = (cur.job.message if cur.job else None) or "the runner Job ended before it reported on this item"
    return ItemReport(attempt=attempt, outcome="Failed", reason=reason, message=cause)


def _finish(entry: BatchItemStatus, report: ItemReport, o: BatchObserved) -> None:
    """An item's attempt ended: Succeeded, Failed for good, or Pending for a retry. Its Lease
    stays: it goes back once the attempt's pods are gone (``_settle_leases``), or with the retry."""
    for name in ("result", "progress", "peak_rss_bytes", "predicted_peak_bytes"):
        if getattr(report, name) is not None:
            setattr(entry, name, getattr(report, name))
    reason, message = report.reason, bounded(report.message)
    if report.outcome == SUCCEEDED:
        entry.phase, entry.reason, entry.message, entry.completion_time = SUCCEEDED, None, None, o.now
        entry.converted_hash = entry.conversion_hash  # what its output now holds complete
    elif reason in PERMANENT_REASONS or entry.attempts > o.backoff_limit:
        entry.phase, entry.reason, entry.message, entry.completion_time = FAILED, reason or "Failed", message, o.now
    else:
        entry.phase, entry.reason = PENDING, reason
        entry.message = bounded(f"Retrying: {message or reason}")


# ---------------------------------------------------------------------------------------------
# 2. The spec's items


def _sync_items(w: _Work, o: BatchObserved) -> None:
    if o.items is None:  # an invalid spec: nothing is added, changed or removed
        return
    table: dict[str, BatchItemStatus] = {}
    for d in o.items:
        entry = w.items.pop(d.id, None)
        if entry is None:
            entry = BatchItemStatus(
                id=d.id, source=d.source, output=d.output, phase=PENDING, conversion_hash=d.conversion_hash
            )
        elif entry.conversion_hash != d.conversion_hash and d.id not in w.running:
            entry = _changed(w, o, d, entry)
        entry.source, entry.output = d.source, d.output
        table[d.id] = entry
    for item_id, entry in w.items.items():  # removed from the spec
        if item_id in w.running or entry.output_lease:
            table[item_id] = entry  # its runner has it, or its Lease is not back yet
            w.removed.add(item_id)
    w.items = table


def _changed(w: _Work, o: BatchObserved, d: DesiredItem, entry: BatchItemStatus) -> BatchItemStatus:
    """An item whose recorded hash differs: a new conversion (Pending again, keeping a Lease it
    holds), the same one hashed by another build (adopted: nothing runs), or the one its output
    holds complete (an edit undone before it ran: Succeeded again, nothing runs)."""
    if not conversion_changed(
        entry.conversion_hash, d.conversion_hash, d.accepted_hashes, o.generation, w.status.observed_generation
    ):
        entry.conversion_hash = d.conversion_hash
        return entry
    if d.conversion_hash == entry.converted_hash:
        entry.conversion_hash, entry.phase, entry.reason, entry.message = d.conversion_hash, SUCCEEDED, None, None
        entry.completion_time = entry.completion_time or o.now
        return entry
    if entry.phase != PENDING or entry.attempts:
        w.events.append(("Normal", "ItemChanged", bounded(f"{d.output}: its conversion changed; it runs again.") or ""))
    return BatchItemStatus(
        id=d.id,
        source=d.source,
        output=d.output,
        phase=PENDING,
        conversion_hash=d.conversion_hash,
        output_lease=entry.output_lease,
        converted_hash=entry.converted_hash,
    )


# ---------------------------------------------------------------------------------------------
# 3.-5. Denial, Leases, the next attempt


def _deny(w: _Work, o: BatchObserved) -> None:
    """PolicyDenied or NameTaken: nothing starts, an attempt in flight is stopped; Leases go back
    once its pods are gone (``_settle_leases``)."""
    if o.refusal is None:
        return
    w.denied = True
    reason, message = o.refusal
    if (w.status.phase, w.status.reason, w.status.message) != (FAILED, reason, bounded(message)):
        w.events.append(("Warning", reason, bounded(message) or ""))
    if not w.running:
        return
    w.delete_job, w.delete_cluster = w.status.runner_job, True
    for item_id in w.running:
        entry = w.items.get(item_id)
        if entry is not None:
            entry.phase, entry.reason = PENDING, reason
            entry.message = f"Stopped: the batch is refused ({reason})."
    w.running = []


def _pods_gate(w: _Work, o: BatchObserved) -> Need | Wait | None:
    """toolkit.pods_gate for a batch step: a Wait is recorded on ``w`` (the DaskCluster is deleted
    again and the step waits); None once no pod of the batch may still write."""
    gate = pods_gate(o.pods, o.pods_checked)
    if isinstance(gate, Wait):
        w.waiting, w.delete_cluster = gate, True
    return gate


def _settle_leases(w: _Work, o: BatchObserved) -> Need | None:
    """Give back the Leases of items that will not run again, once no pod of the batch runs."""
    if w.running:
        return None  # an attempt in flight keeps every Lease it started with
    giving = [
        e
        for e in w.items.values()
        if e.output_lease and (e.phase in ENDED or e.id in w.removed or w.denied or e.phase == RUNNING)
    ]
    if not giving:
        return None
    gate = _pods_gate(w, o)
    if gate is not None:
        return gate if isinstance(gate, Need) else None
    for entry in giving:
        w.releases.append(entry.output_lease or "")
        entry.output_lease = None
    w.items = {k: e for k, e in w.items.items() if not (k in w.removed and k not in w.running)}
    w.removed = set()
    return None


def _start_attempt(w: _Work, o: BatchObserved) -> Need | BatchDecision | None:
    pending = [e for e in w.items.values() if e.phase == PENDING and e.id not in w.removed]
    if w.running or w.denied or o.items is None or not pending or w.waiting is not None:
        return None
    if w.attempt:
        gate = _pods_gate(w, o)
        if gate is not None:
            return gate if isinstance(gate, Need) else None
    if o.leases is None:
        return BatchDecision(needs=frozenset({"leases"}), acquire=tuple(e.id for e in pending))
    held = [e.id for e in pending if _take_lease(e, o.leases.get(e.id))]
    if held:
        _begin(w, o, held)
    return None


def _take_lease(entry: BatchItemStatus, lease: LeaseAnswer | None) -> bool:
    if lease is not None and lease.held:
        entry.output_lease, entry.reason, entry.message = lease.name, None, None
        return True
    holder = lease.holder if lease is not None else "unknown"
    entry.reason, entry.message = "OutputBusy", bounded(f"Waiting for the output, which {holder} is writing.")
    entry.output_lease = None
    return False


def _begin(w: _Work, o: BatchObserved, held: list[str]) -> None:
    nxt = w.attempt + 1
    for item_id in held:
        entry = w.items[item_id]
        entry.phase, entry.attempt, entry.attempts = RUNNING, nxt, entry.attempts + 1
        entry.converted_hash = None  # it writes now
    reports = w.status.item_reports or {}
    w.status.item_reports = {k: v for k, v in reports.items() if k not in held} or None
    w.status.attempts, w.status.runner_job, w.status.runner_job_uid = nxt, runner_job_name(o.name, nxt), None
    w.status.running_items, w.status.message = held, None
    w.status.start_time = w.status.start_time or o.now
    w.running, w.ensure_attempt = held, nxt
    w.resume = tuple(i for i in held if w.items[i].attempts > 1)
    w.events.append(("Normal", "RunnerCreated", f"Created runner Job {w.status.runner_job} for {len(held)} item(s)."))


# ---------------------------------------------------------------------------------------------
# The decision


def _decision(w: _Work, o: BatchObserved) -> BatchDecision:
    _summarise(w, o)
    new = dump_status(w.status)
    patch = merge_diff(w.old, new)
    kept = [e.output_lease for e in w.items.values() if e.output_lease]
    releases = without(w.releases, kept)
    if not patch and w.ensure_attempt is None and not releases and not w.delete_cluster and not w.delete_job:
        return NOTHING
    return BatchDecision(
        patch,
        ensure_attempt=w.ensure_attempt,
        resume=w.resume,
        release_leases=releases,
        delete_job=w.delete_job,
        delete_cluster=w.delete_cluster,
        event=w.events[-1] if w.events else None,
    )


def _summarise(w: _Work, o: BatchObserved) -> None:
    s = w.status
    listed = [e for k, e in w.items.items() if k not in w.removed]
    counts = {phase: sum(e.phase == phase for e in listed) for phase in (PENDING, RUNNING, SUCCEEDED, FAILED)}
    s.items = list(w.items.values()) or None
    s.running_items = w.running or None
    s.total, s.succeeded, s.failed = len(listed), counts[SUCCEEDED], counts[FAILED]
    s.running, s.pending, s.observed_generation = counts[RUNNING], counts[PENDING], o.generation
    before = s.phase
    if o.refusal is not None:
        s.phase, (s.reason, s.message) = FAILED, o.refusal
        s.message = bounded(s.message)
        s.completion_time = s.completion_time if before == FAILED else o.now
        return
    if o.spec_error is not None and not w.attempt:
        s.phase, s.reason = FAILED, "InvalidSpec"
        s.message = bounded(f"Generation {o.generation} is invalid; nothing new starts: {o.spec_error}")
        s.completion_time = s.completion_time or o.now
        return
    if w.running or counts[RUNNING]:
        s.phase, s.completion_time = RUNNING, None
    elif counts[PENDING] or w.waiting is not None:
        s.phase, s.completion_time = PENDING, None
    else:
        s.phase = FAILED if counts[FAILED] else SUCCEEDED
        s.completion_time = s.completion_time if before == s.phase else o.now
    _say_why(w, o, counts[FAILED], len(listed))


def _say_why(w: _Work, o: BatchObserved, failed: int, total: int) -> None:
    s = w.status
    if o.spec_error is not None:
        s.reason = "InvalidSpec"
        s.message = bounded(f"Generation {o.generation} is invalid; nothing new starts: {o.spec_error}")
    elif w.waiting is not None:
        s.reason, s.message = None, w.waiting.message(f"Attempt {w.attempt + 1}")
    elif failed and s.phase == FAILED:
        s.reason, s.message = "ItemsFailed", f"{failed} of {total} item(s) failed."
    else:
        s.reason, s.message = None, None
