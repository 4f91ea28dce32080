"""Run a batch: one plan per item, one cluster sized for the largest item's plan, started once,
and the items streamed through it, two at a time by default (docs/batch.md).

Each item goes through the same steps as one conversion (``runner.prepare_job`` then
``runner.run_job``: its own output lock, resume and completion marker), on the batch's cluster
instead of one of its own. An item that fails or is refused does not stop the others unless
``fail_fast`` is set.

Why two items at once: an item's passes run one after the other, and its lower levels are often
one slab each, so one item alone leaves most workers idle for much of its time; the next item's
slabs fill them. Every item is planned for the same workers and threads, and a worker runs one
slab per thread whatever item it belongs to, so a worker never holds more than the largest plan
among the items in flight counts (``ItemResult.peak_bound``). Each item is planned to fill only
its share of the threads (``make_plan``'s ``at_once``), so a small item is one pass of one slab:
its file read once and its whole pyramid built in memory, as the physical limit does.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from contextlib import AbstractContextManager, ExitStack, contextmanager, nullcontext
from dataclasses import dataclass, field, replace
from functools import partial
from typing import TYPE_CHECKING, Any, Callable, Iterator, Sequence

from ..backends.base import Backend, Session
from ..backends.diagnostics import ClusterEvents, WorkerReport, reset_peak_rss, take_peak_rss
from ..engine.buffers import capacity
from ..engine.progress import Listener, Progress
from ..engine.write.tasks import end_of_conversion
from ..errors import ExitCode, H5ngffError, PlanError
from ..metrics.probes import ClusterPoller
from ..phases import ITEMS_CONVERTED, ItemState
from ..planner import DEFAULT_CONSTANTS, MemoryConstants, Plan
from ..planner.memory import SLAB_BUFFERS_TERM
from ..runner import PlannedJob, RunSummary, prepare_job, run_job
from ..spec import ConversionSpec
from ..units import MiB, format_bytes
from .items import BatchItem

if TYPE_CHECKING:  # prometheus-client loads only where metrics are served
    from ..metrics.exporter import MetricsExporter

log = logging.getLogger(__name__)

#: Items converted at once on the batch's cluster unless the caller says otherwise: two keep the
#: workers busy through one item's single-slab passes (docs/batch.md, "Two items in flight").
DEFAULT_ITEMS_IN_FLIGHT = 2
#: What an item holds on a worker between its slabs, beside the item whose slab runs there: its
#: open HDF5 file (metadata, the file's own 1 MiB cache), its arrays' metadata and the allocator's
#: interleaving of the two. Measured 2-6 MiB on 50 MB items, 3.4 MiB above a plan on a fresh
#: install (docs/benchmarks.md, "Two items in flight"); its dataset's chunk cache comes on top.
ITEM_BESIDE_BASE = 8 << 20

#: An item's outcome (``phases.ItemState``; docs/batch.md, "Outcomes").
DONE, COMPLETE, REFUSED, FAILED, NOT_RUN = (
    ItemState.DONE,
    ItemState.COMPLETE,
    ItemState.REFUSED,
    ItemState.FAILED,
    ItemState.NOT_RUN,
)


@dataclass(eq=False)  # one object per item: compared and hashed by identity
class ItemResult:
    item: BatchItem
    status: ItemState = NOT_RUN
    job: PlannedJob | None = None
    summary: RunSummary | None = None
    error: H5ngffError | None = None
    #: The items whose slabs ran on the cluster while this one ran (several items in flight).
    beside: list["ItemResult"] = field(default_factory=list)
    #: What the items beside it may hold on a worker on top of the larger plan (``beside_allowance``).
    beside_bytes: int = 0

    @property
    def ok(self) -> bool:
        return self.status in ITEMS_CONVERTED

    @property
    def peak_rss(self) -> int:
        """The busiest worker's RSS peak while this item ran (each item's peak is measured anew)."""
        return max((w.peak_rss for w in self.summary.workers), default=0) if self.summary else 0

    @property
    def predicted_peak(self) -> int:
        return self.job.plan.memory.predicted_peak if self.job else 0

    @property
    def peak_bound(self) -> int:
        """What this item's busiest worker is held to: its own plan's peak or, where other items
        ran beside it, the largest plan's among them (a worker runs slabs of any of them, one per
        thread, and every plan is for the same threads) plus what the others hold between their
        slabs (``beside_bytes``)."""
        if not self.beside:
            return self.predicted_peak
        return max([self.predicted_peak, *(other.predicted_peak for other in self.beside)]) + self.beside_bytes

    def to_dict(self) -> dict[str, Any]:
        totals = self.summary.totals if self.summary else None
        return {
            "source": self.item.source,
            "output": self.item.output,
            "status": self.status,
            "reason": self.error.reason if self.error else None,
            "message": str(self.error) if self.error else None,
            "seconds": round(self.summary.seconds, 3) if self.summary else 0.0,
            "resumed": bool(self.summary and self.summary.resumed),
            "bytes_read": totals.bytes_read if totals else 0,
            "bytes_written": totals.bytes_written if totals else 0,
            "peak_rss": self.peak_rss,
            "predicted_peak": self.predicted_peak,
            "peak_bound": self.peak_bound,
            "beside_bytes": self.beside_bytes,
            "ran_beside": [other.item.output for other in self.beside],
            "pod_limit": self.job.plan.memory.pod_limit if self.job else 0,
        }


@dataclass
class BatchSummary:
    results: list[ItemResult]
    #: The item whose plan sized the cluster (the largest pod limit), None where no item planned.
    sizing: ItemResult | None = None
    cluster_starts: int = 0
    seconds: float = 0.0
    notices: list[str] = field(default_factory=list)
    items_in_flight: int = DEFAULT_ITEMS_IN_FLIGHT

    @property
    def ok(self) -> bool:
        return all(r.ok for r in self.results)

    def count(self, status: str) -> int:
        return sum(r.status == status for r in self.results)

    def cluster_dict(self) -> dict[str, Any] | None:
        """The one cluster the largest plan sizes (None where no item planned)."""
        plan = self.sizing.job.plan if self.sizing and self.sizing.job else None
        if plan is None or self.sizing is None:
            return None
        return {
            "sized_by": self.sizing.item.source,
            "workers": plan.workers,
            "threads_per_worker": plan.threads_per_worker,
            "pod_limit": plan.memory.pod_limit,
            "memory_limit": plan.memory.memory_limit,
        }

    def to_dict(self) -> dict[str, Any]:
        return {
            "status": "Succeeded" if self.ok else "Failed",
            "items": len(self.results),
            **{status.lower(): self.count(status) for status in (DONE, COMPLETE, REFUSED, FAILED, NOT_RUN)},
            "seconds": round(self.seconds, 3),
            "cluster_starts": self.cluster_starts,
            "items_in_flight": self.items_in_flight,
            "cluster": self.cluster_dict(),
            "results": [r.to_dict() for r in self.results],
            "notices": self.notices,
        }


@dataclass
class BatchHooks:
    """What the caller shows: the plan of the batch once every item is planned, a listener per
    item (its progress bar), and each item's result as it ends. ``listeners`` and ``on_item``
    are called from each item's own thread, several at once: they must be thread-safe."""

    on_planned: Callable[[BatchSummary], None] = lambda summary: None
    listeners: Callable[[ItemResult], Sequence[Listener]] = lambda result: ()
    on_item: Callable[[ItemResult], None] = lambda result: None


def run_batch(
    items: Sequence[BatchItem],
    spec_for: Callable[[BatchItem], ConversionSpec],
    backend: Backend,
    *,
    constants: MemoryConstants = DEFAULT_CONSTANTS,
    fail_fast: bool = False,
    hooks: BatchHooks | None = None,
    metrics: MetricsExporter | None = None,
    items_in_flight: int = DEFAULT_ITEMS_IN_FLIGHT,
) -> BatchSummary:
    """Plan every item, start one cluster for the largest plan, and convert the items on it in
    order, ``items_in_flight`` at a time. ``metrics`` serves the job and worker series of the
    item that started last among those running (docs/metrics.md, "Batches")."""
    hooks = hooks or BatchHooks()
    start = time.perf_counter()
    summary = plan_batch(
        items, spec_for, backend, constants=constants, fail_fast=fail_fast, items_in_flight=items_in_flight
    )
    runnable, plans = _runnable(summary)
    hooks.on_planned(summary)
    if runnable and not (fail_fast and summary.count(REFUSED)):
        assert summary.sizing is not None and summary.sizing.job is not None
        # No more items can run beside one another than there are to run: each item's bound
        # counts the allowances of the others that can actually be beside it.
        in_flight = min(summary.items_in_flight, len(runnable))
        with ExitStack() as stack:
            _Flight(backend, summary.sizing.job.plan, stack, summary, hooks, metrics).run(
                runnable, in_flight, fail_fast, (in_flight - 1) * beside_allowance(plans)
            )
    summary.seconds = time.perf_counter() - start
    return summary


def plan_batch(
    items: Sequence[BatchItem],
    spec_for: Callable[[BatchItem], ConversionSpec],
    backend: Backend,
    *,
    constants: MemoryConstants = DEFAULT_CONSTANTS,
    fail_fast: bool = False,
    items_in_flight: int = DEFAULT_ITEMS_IN_FLIGHT,
) -> BatchSummary:
    """Plan every item as ``run_batch`` would, starting nothing (``h5ngff plan`` of a glob shows
    this): each item's plan or refusal, the cluster the largest plan sizes, and how many items
    will run at once."""
    if items_in_flight < 1:
        raise ValueError(f"items_in_flight must be 1 or more, not {items_in_flight}")
    summary = BatchSummary([ItemResult(item) for item in items], items_in_flight=items_in_flight)
    at_once = min(items_in_flight, len(items))
    _plan_all(summary, spec_for, backend, constants, fail_fast, at_once)
    _, plans = _runnable(summary)
    if plans and summary.sizing is not None and summary.sizing.job is not None:
        fitted = fitting_in_flight(at_once, summary.sizing.job.plan, plans, summary)
        if fitted < at_once:  # planned to share the threads with items that will not run beside
            told = summary.notices
            summary.results, summary.sizing = [ItemResult(item) for item in items], None
            _plan_all(summary, spec_for, backend, constants, fail_fast, fitted)
            summary.notices = sorted({*summary.notices, *told})
            summary.items_in_flight = fitted
    return summary


def beside_allowance(plans: Sequence[Plan]) -> int:
    """What one item may hold on a worker between its slabs while another item's slab runs there:
    ``ITEM_BESIDE_BASE``, and the largest chunk cache an item's open dataset keeps (at least the
    1 MiB every dataset is opened with, times the planner's filtered-cache factor, glibc's: the
    larger)."""
    factor = DEFAULT_CONSTANTS.hdf5_filtered_cache_factor_glibc
    return ITEM_BESIDE_BASE + int(factor * max((max(p.hdf5_cache_bytes, 1 << 20) for p in plans), default=0))


def slab_share(plan: Plan) -> int:
    """The smallest slab buffer one worker thread holds in any of ``plan``'s passes, as the
    workers allocate it (``engine.buffers.capacity``): a spare buffer no larger is counted by the
    plan whatever the thread does next."""
    shares = [
        sum(t.bytes for t in p.terms if t.name == SLAB_BUFFERS_TERM) // max(plan.threads_per_worker, 1)
        for p in plan.passes
    ]
    return capacity(min(shares, default=0))


def fitting_in_flight(asked: int, cluster: Plan, plans: Sequence[Plan], summary: BatchSummary) -> int:
    """``asked``, or 1 where what the other items hold (``beside_allowance``) would not fit under
    the workers' terminate threshold above the largest plan: Dask would then restart a worker
    that is only doing what was asked (a notice says so)."""
    if asked <= 1:
        return asked
    extra = (asked - 1) * beside_allowance(plans)
    room = int(cluster.memory.thresholds.terminate * cluster.memory.memory_limit) - cluster.memory.predicted_peak
    if extra <= room:
        return asked
    summary.notices.append(
        f"Items run one at a time: {asked - 1} more item(s) in flight would hold {extra / MiB:.0f} MiB per worker "
        f"(their open HDF5 chunk caches), above the {room / MiB:.0f} MiB the workers keep below Dask's terminate threshold."
    )
    return 1


def _runnable(summary: BatchSummary) -> tuple[list[ItemResult], list[Plan]]:
    runnable = [r for r in summary.results if r.job is not None and r.status == NOT_RUN]
    return runnable, [r.job.plan for r in runnable if r.job is not None]


def _plan_all(
    summary: BatchSummary,
    spec_for: Callable[[BatchItem], ConversionSpec],
    backend: Backend,
    constants: MemoryConstants,
    fail_fast: bool,
    at_once: int,
) -> None:
    """Plan each item as one conversion would (same refusals), sharing the threads with the
    ``at_once - 1`` others in flight, then make every plan fit the one cluster: the same workers
    and threads as the largest plan, whose pod limit covers them all."""
    for result in summary.results:
        try:
            result.job = prepare_job(spec_for(result.item), backend, constants, at_once)
        except H5ngffError as exc:
            result.status, result.error = REFUSED, exc
            if fail_fast:
                return
    planned = [r for r in summary.results if r.job is not None]
    if not planned:
        return
    summary.sizing = max(planned, key=lambda r: (r.job.plan.memory.pod_limit, r.job.plan.memory.predicted_peak))  # type: ignore[union-attr]
    cluster = summary.sizing.job.plan  # type: ignore[union-attr]
    for result in planned:
        job = result.job
        assert job is not None
        if (job.plan.workers, job.plan.threads_per_worker) != (cluster.workers, cluster.threads_per_worker):
            # Planned for the batch's workers: its slabs are sized for the memory each one has.
            resources = job.spec.resources.model_copy(
                update={"workers": cluster.workers, "threads_per_worker": cluster.threads_per_worker}
            )
            try:
                result.job = prepare_job(
                    job.spec.model_copy(update={"resources": resources}), backend, constants, at_once
                )
            except H5ngffError as exc:
                result.job, result.status, result.error = None, REFUSED, exc
    for result in planned:
        if result.job is not None and result.job.plan.memory.pod_limit > cluster.memory.pod_limit:
            result.status = REFUSED
            result.error = PlanError(
                f"Its plan needs a pod limit of {format_bytes(result.job.plan.memory.pod_limit)}, above the "
                f"{format_bytes(cluster.memory.pod_limit)} of the batch's workers: convert it on its own."
            )
    summary.notices = sorted({n for r in planned if r.job for n in r.job.notices})


class _Flight:
    """The items in flight on the batch's one cluster. Each item runs ``runner.run_job`` in a
    thread of its own; this (the caller's) thread starts the items, starts the cluster when an
    item first needs it (a re-run whose items are all complete starts none; a backend may need
    the main thread to start: SLURM's installs a signal handler) and hears each item end.

    At each item's end its buffers and files go (``end_of_conversion``), so the items after it
    do not carry them, and in the same round trip every worker's RSS high-water mark is read and
    started again (``take_peak_rss``); the mark read goes to every item running then. Each item's
    peak is the highest of the segments it ran in, whatever ran beside it: never less than the
    truth. One broadcast per item: each costs the scheduler and every worker a round trip on the
    cores that convert (the batch's 50 MB items paid five before, about 35 ms of them)."""

    def __init__(
        self,
        backend: Backend,
        plan: Plan,
        stack: ExitStack,
        summary: BatchSummary,
        hooks: BatchHooks,
        metrics: MetricsExporter | None,
    ):
        self.backend, self.plan, self.stack, self.summary, self.hooks = backend, plan, stack, summary, hooks
        self.metrics = metrics
        self.session: Session | None = None
        self.beside_bytes = 0  # run() sets it
        #: From the items' threads to this one: ("start", _Reply), ("ended", result), ("crashed", exc).
        self._messages: queue.SimpleQueue[tuple[str, Any]] = queue.SimpleQueue()
        self._start_lock = threading.Lock()
        self.lock = threading.Lock()  # the fields below
        #: The items running, in the order they started (the last is the one the metrics show).
        self.running: list[ItemResult] = []
        #: The items still to start (none once a --fail-fast batch stops).
        self.pending: list[ItemResult] = []
        self.pollers: dict[ItemResult, tuple[ClusterPoller, Plan]] = {}
        self._overlapped: dict[ItemResult, list[ItemResult]] = {}
        self._on_cluster: set[ItemResult] = set()
        self._peaks: dict[ItemResult, dict[str, int]] = {}
        #: Where the backend measures its workers itself (pod emulation), its figures over the
        #: segments each item ran in, by worker name (``Session.take_segment``).
        self._segments: dict[ItemResult, dict[str, WorkerReport]] = {}

    def run(self, runnable: Sequence[ItemResult], items_in_flight: int, fail_fast: bool, beside_bytes: int) -> None:
        """``beside_bytes``: what the other items in flight may hold on a worker (``beside_allowance``)."""
        self.beside_bytes = beside_bytes
        with self.lock:
            self.pending = list(runnable)

        def launch() -> bool:
            with self.lock:
                result = self.pending.pop(0) if self.pending else None
                if result is not None:
                    # Running from here, not from its thread's start: an item's end between
                    # the two would leave it out of ``keep`` and of the others' beside lists.
                    self._begin(result)
            if result is None:
                return False
            name = f"h5ngff-item-{self.summary.results.index(result)}"
            threading.Thread(target=self._convert, args=(result,), name=name, daemon=True).start()
            return True

        active = 0
        while active < items_in_flight and launch():
            active += 1
        stopping = False
        while active:
            kind, payload = self._messages.get()
            if kind == "start":
                payload.answer(self._start)
            elif kind == "ended":
                active -= 1
                stopping = stopping or (fail_fast and not payload.ok)
                if stopping:
                    with self.lock:
                        self.pending.clear()
                if not stopping and launch():
                    active += 1
            else:  # an item's thread raised what no item should: the batch stops with it
                raise payload

    # -- in the caller's thread --------------------------------------------------------------

    def _start(self) -> Session:
        session = self.stack.enter_context(self.backend.session(self.plan))
        self.summary.cluster_starts += 1
        session.client.run(reset_peak_rss)  # the items' peaks, not the workers' start
        if session.take_segment is not None:
            session.take_segment()  # nor the pods' figures of it (their start, a restart in it)
        return session

    # -- in each item's thread ---------------------------------------------------------------

    def _convert(self, result: ItemResult) -> None:
        try:
            try:  # _begin ran at its launch
                _run_item(result, self.backend, self._cluster_for(result), self.hooks, self._metrics_for(result))
            finally:
                self._end(result)
            self.hooks.on_item(result)
            self._messages.put(("ended", result))
        except BaseException as exc:
            self._messages.put(("crashed", exc))

    def _cluster_for(self, result: ItemResult) -> Callable[[], AbstractContextManager[Session]]:
        def cluster() -> AbstractContextManager[Session]:
            with self._start_lock:
                if self.session is None:
                    reply = _Reply()
                    self._messages.put(("start", reply))
                    self.session = reply.wait()
            with self.lock:
                self._on_cluster.add(result)
            return nullcontext(self._item_view(self.session))

        return cluster

    @staticmethod
    def _item_view(session: Session) -> Session:
        """The batch's session as one item sees it: the backend's counts (kills, restarts,
        terminations) run from the cluster's start, so the item's figures and its failure's
        message count from what they stood at now. Pod emulation's are read again first (local
        files); a SLURM job's figures are as last read, a round trip to every worker away."""
        if session.take_segment is not None:
            session.refresh()
        # list(): SLURM's watcher thread may add a worker's name meanwhile.
        before = {name: replace(report) for name, report in list(session.extra_reports.items())}
        return replace(session, reports_before=before)

    def _begin(self, result: ItemResult) -> None:
        """Under ``lock``, as the item is launched. No mark is taken here: the segment running now
        began at the last item's end (or the cluster's start), and whatever ran in it since is an
        item still running, so beside this one. Charging this item the whole segment is never
        less than the truth."""
        self._overlapped[result] = list(self.running)
        for other in self.running:
            self._overlapped[other].append(result)
        self.running.append(result)

    def _end(self, result: ItemResult) -> None:
        with self.lock:
            if result in self._on_cluster and result.job is not None:
                # Its buffers and files go first, in the same round trip as the marks: a
                # high-water mark is not lowered by a free, so the peak read is still the item's
                # (it is still running: the segment ending now is its last), and the mark starts
                # again from what is left, so the items after it are not charged with memory it
                # held. Its slab buffers may stay for the next items' slabs where every item
                # still to run counts one at least as large (engine.buffers.release_conversion).
                # (A function of the engine's: one defined here would make every worker import
                # the runner.)
                after = [r for r in self.running if r is not result] + self.pending
                keep = min((slab_share(r.job.plan) for r in after if r.job), default=0)
                self._take_peaks(partial(end_of_conversion, result.job.spec.output.path, keep), result)
            self.running.remove(result)
            result.beside = [other for other in self._overlapped.pop(result) if other in self._on_cluster]
            result.beside_bytes = self.beside_bytes if result.beside else 0
            peaks = self._peaks.pop(result, {})
            segments = self._segments.pop(result, {})
        if result.summary is not None and segments and not result.summary.workers and result.job is not None:
            # Collecting its figures failed: the segments' are the item's all the same.
            assert self.session is not None  # segments come only from the session
            result.summary.workers = [self.session.with_plan(f, result.job.plan) for f in segments.values()]
        if result.summary is not None:
            for i, worker in enumerate(result.summary.workers):
                if worker.name in segments:
                    worker = result.summary.workers[i] = charged(worker, segments[worker.name], result.summary.events)
                worker.peak_rss = max(worker.peak_rss, peaks.get(worker.name, 0))

    def _take_peaks(self, release: Callable[[], object], ended: ItemResult) -> None:
        """Under ``lock``: free what ``ended`` held on the workers (``release``) and end the
        workers' current segment; its peaks go to every item running."""
        if self.session is None:
            return
        try:
            marks = self.session.client.run(take_peak_rss, release=release, on_error="return")
        except Exception as exc:  # a dying cluster: the next item's run says so
            # A client closing under it (a Ctrl-C or a SIGTERM ends the batch) is no news.
            closing = getattr(self.session.client, "status", None) in ("closing", "closed")
            log.log(
                logging.DEBUG if closing else logging.WARNING,
                "Could not release %s's buffers on the workers: %s",
                ended.item.output,
                type(exc).__name__,
            )
            log.debug("the release's error", exc_info=True)
            marks = {}
        # After the release, so the next segment starts without the ended item's buffers; and
        # even where the round trip failed, as a dying cluster's kills are the ended item's too.
        self._charge_segment()
        for address, mark in marks.items():
            if isinstance(mark, BaseException):  # a worker gone mid-call: its restart is reported
                log.debug("could not read %s's peak: %s", address, mark)
                continue
            if isinstance(mark, dict) and mark.get("release_error"):
                log.warning(
                    "Could not release %s's buffers on %s: %s", ended.item.output, address, mark["release_error"]
                )
            if isinstance(mark, dict) and mark.get("name"):
                for item in self.running:
                    peaks = self._peaks.setdefault(item, {})
                    peaks[mark["name"]] = max(peaks.get(mark["name"], 0), int(mark["peak_rss"]))

    def _charge_segment(self) -> None:
        """Under ``lock``: end the backend's current segment of its own figures (pod emulation);
        they go to every item running."""
        if self.session is None or self.session.take_segment is None:
            return
        for name, figures in self.session.take_segment().items():
            for item in self.running:
                segments = self._segments.setdefault(item, {})
                segments[name] = segments[name].then(figures) if name in segments else figures

    def _metrics_for(self, result: ItemResult) -> _ItemMetrics | None:
        return None if self.metrics is None else _ItemMetrics(self, result, self.metrics)

    def newest(self) -> ItemResult | None:
        """The item that started last among those running: the one the metrics show."""
        return self.running[-1] if self.running else None


def charged(worker: WorkerReport, segments: WorkerReport, events: ClusterEvents) -> WorkerReport:
    """An item's report of one worker: the backend's figures over the segments the item ran in
    (``segments``), not the session's, which hold every item before it (the largest one's peaks,
    its kills), with the item's own plan figures and what Dask told the item itself (``events``:
    a worker terminated for memory, a restart whose nanny's log line came after the segment)."""
    return replace(
        segments,
        predicted_peak=worker.predicted_peak,
        memory_limit=worker.memory_limit,
        pod_limit=worker.pod_limit,
        peak_rss=max(segments.peak_rss, events.terminated_peaks().get(worker.name, 0)),
        nanny_restarts=max(segments.nanny_restarts, events.restarts_by_worker().get(worker.name, 0)),
    )


class _Reply:
    """A cluster start asked of the caller's thread by an item's thread, and its answer."""

    def __init__(self) -> None:
        self._done = threading.Event()
        self._session: Session | None = None
        self._error: BaseException | None = None

    def answer(self, start: Callable[[], Session]) -> None:
        try:
            self._session = start()
        except BaseException as exc:  # the item that asked fails with it, as one conversion would
            self._error = exc
        self._done.set()

    def wait(self) -> Session:
        self._done.wait()
        if self._error is not None:
            raise self._error
        assert self._session is not None
        return self._session


class _ItemMetrics:
    """The exporter as one item's run sees it (``runner.RunMetrics``): with several items in
    flight, the job and worker series are those of the item that started last among those
    running; the others' events are not exported until it ends (the batch's own series count
    every item)."""

    def __init__(self, flight: _Flight, result: ItemResult, exporter: MetricsExporter):
        self.flight, self.result, self.exporter = flight, result, exporter

    def __call__(self, progress: Progress) -> None:
        if self.flight.newest() is self.result:
            self.exporter(progress)

    @contextmanager
    def attached(self, poller: ClusterPoller, plan: Plan) -> Iterator[_ItemMetrics]:
        flight = self.flight
        with flight.lock:
            flight.pollers[self.result] = (poller, plan)
            if flight.newest() is self.result:
                self.exporter.attach(poller, plan)
        try:
            yield self
        finally:
            with flight.lock:
                del flight.pollers[self.result]
                if self.exporter.detach(poller):  # it was shown: show the newest item still polled
                    follow = next((r for r in reversed(flight.running) if r in flight.pollers), None)
                    if follow is not None:
                        self.exporter.attach(*flight.pollers[follow])

    def settle(self, workers: list[WorkerReport]) -> None:
        if self.flight.newest() is self.result:
            self.exporter.settle(workers)


def _run_item(
    result: ItemResult,
    backend: Backend,
    cluster: Callable[[], AbstractContextManager[Session]],
    hooks: BatchHooks,
    metrics: _ItemMetrics | None,
) -> None:
    assert result.job is not None
    try:
        result.summary = run_job(result.job, backend, list(hooks.listeners(result)), metrics, cluster=cluster)
        # Complete only where an earlier run had finished it: a run that found every slab done
        # but wrote the completion marker itself did the last step (docs/batch.md, "Outcomes").
        result.status = COMPLETE if result.summary.already_complete else DONE
    except H5ngffError as exc:
        # Refused, not Failed, where the run stopped before it wrote anything for a reason that
        # refuses an item at planning too (a busy output found as it starts, a conflict).
        started = exc.summary is not None and exc.summary.totals is not None
        refused = exc.exit_code in (ExitCode.BAD_INPUT, ExitCode.OUTPUT_REFUSED) and not started
        result.status, result.error, result.summary = REFUSED if refused else FAILED, exc, exc.summary
