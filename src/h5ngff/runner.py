"""spec -> plan -> backend -> engine: the one code path behind ``h5ngff convert``, ``h5ngff run``
and the Kubernetes runner Job.

``execute`` is the run sequence they share; ``plan_job`` and ``run_job`` are its two halves (the
plan commands and the tests call them alone)."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, ExitStack, nullcontext
from dataclasses import dataclass, field
from functools import partial
from typing import TYPE_CHECKING, Any, Protocol

from distributed.scheduler import KilledWorker

from . import __version__
from .backends.allocator import resolve_allocator
from .backends.base import Backend, Session
from .backends.diagnostics import ClusterEvents, WorkerReport
from .backends.shutdown import quiet_sync_cancel_race, quiet_repeated_death_log
from .engine.write.driver import RunTotals, finish, run_conversion
from .engine.write import faults
from .engine.write.tasks import end_of_conversion
from .engine.write.lock import output_lock, refuse_if_held
from .engine.write.output import check_output, prepare_output
from .engine.progress import Broadcast, Listener, Progress
from .engine.sources.base import SlabSource
from .engine.sources.hdf5 import SourceIdentity
from .engine.sources import open_source
from .engine.stores import open_object_reader
from .errors import H5ngffError, WorkersLostError
from .metrics.probes import ClusterPoller
from .phases import Phase
from .planner import DEFAULT_CONSTANTS, DatasetInfo, MemoryConstants, Plan, make_plan
from .spec import ConversionSpec

if TYPE_CHECKING:  # prometheus-client loads only where metrics are served
    from .metrics.exporter import MetricsExporter

log = logging.getLogger(__name__)


class RunMetrics(Protocol):
    """What one run asks of its metrics: ``metrics.exporter.MetricsExporter``, or a batch's view
    of it for one of the items it runs at once (batch.run)."""

    def __call__(self, progress: Progress) -> None: ...

    def attached(self, poller: ClusterPoller, plan: Plan) -> AbstractContextManager[Any]: ...

    def settle(self, workers: list[WorkerReport]) -> None: ...


@dataclass
class PlannedJob:
    spec: ConversionSpec
    dataset: DatasetInfo
    source: SourceIdentity
    plan: Plan
    notices: list[str] = field(default_factory=list)
    #: The workers' reader from the same inspection: the run builds its slab tasks on it rather
    #: than opening the file again (a batch's 50 MB item spent a third of its client time there).
    reader: SlabSource | None = None
    #: When it was prepared, the output was already finished by an earlier run of the same
    #: conversion (``check_output``): it needs no cluster (a batch whose items all are starts none).
    complete: bool = False


def plan_job(
    spec: ConversionSpec, backend: Backend, constants: MemoryConstants = DEFAULT_CONSTANTS, at_once: int = 1
) -> PlannedJob:
    """Inspect the source (metadata only) and plan the conversion for ``backend``, sharing its
    threads with ``at_once - 1`` other conversions (a batch's items in flight)."""
    opened = open_source(spec, objects=open_object_reader)
    dataset, identity = opened.info, opened.identity
    allocator = resolve_allocator(spec.resources.allocator)
    notices: list[str] = []
    if spec.resources.allocator == "jemalloc" and allocator != "jemalloc":
        notices.append(
            "resources.allocator is jemalloc but libjemalloc.so.2 is not installed here; workers use glibc (apt-get install libjemalloc2)."
        )
    spec = backend.fit(spec)
    plan = make_plan(dataset, spec, backend.capacity(), constants, allocator, at_once)
    return PlannedJob(spec, dataset, identity, plan, notices + list(plan.notices), opened.reader)


@dataclass
class RunSummary:
    status: str
    job: PlannedJob
    seconds: float = 0.0
    totals: RunTotals | None = None
    workers: list[WorkerReport] = field(default_factory=list)
    resumed: bool = False
    error: H5ngffError | None = None
    timeline: list[tuple[float, str, int]] = field(default_factory=list)
    #: (epoch seconds, pod name, non-reclaimable bytes): each pod's memory that cannot be reclaimed
    pod_timeline: list[tuple[float, str, int]] = field(default_factory=list)
    events: ClusterEvents = field(default_factory=ClusterEvents)
    #: (what the limit is called, bytes) where the backend enforced another limit than the plan's
    #: (``--pod-limit``, ``--slurm-job-mem``): the summary shows what held, and says so.
    limit_override: tuple[str, int] | None = None
    #: The output was finished by an earlier run: this one did nothing (a batch's Complete).
    already_complete: bool = False

    @property
    def gb_per_s(self) -> float:
        if not self.totals or not self.seconds:
            return 0.0
        return self.totals.bytes_read / self.seconds / 1e9

    def to_dict(self, brief: bool = False) -> dict[str, Any]:
        """The ``--json`` summary; ``brief`` leaves out the plan (for the output's own attributes)."""
        plan = self.job.plan
        out = {
            "h5ngff": __version__,
            "status": self.status,
            "reason": self.error.reason if self.error else None,
            "message": str(self.error) if self.error else None,
            "output": self.job.spec.output.path,
            "seconds": round(self.seconds, 3),
            "bytes_read": self.totals.bytes_read if self.totals else 0,
            "bytes_written": self.totals.bytes_written if self.totals else 0,
            "store_retries": self.totals.store_retries if self.totals else 0,
            "gb_per_s": round(self.gb_per_s, 3),
            "slabs_written": self.totals.slabs_written if self.totals else 0,
            "slabs_skipped": self.totals.slabs_skipped if self.totals else 0,
            "resumed": self.resumed,
            "stage_seconds": self.totals.stage_seconds if self.totals else {},
            "predicted_peak_per_worker": plan.memory.predicted_peak,
            "memory_limit_per_worker": plan.memory.memory_limit,
            "pod_limit_per_worker": self.limit_override[1] if self.limit_override else plan.memory.pod_limit,
            "planned_pod_limit_per_worker": plan.memory.pod_limit,
            "pod_limit_override": (
                {"limit": self.limit_override[0], "enforced": self.limit_override[1], "planned": plan.memory.pod_limit}
                if self.limit_override
                else None
            ),
            "workers": [w.to_dict() for w in self.workers],
            "notices": self.job.notices,
        }
        if not brief:
            out["plan"] = plan.to_dict()
        return out


@dataclass(frozen=True)
class Linger:
    """How long the metrics endpoint stays up once the run has ended, so that Prometheus scrapes
    the final values: ``seconds`` long, or with ``until_scraped`` until one scrape has read them
    (at most ``seconds``)."""

    seconds: float = 0.0
    until_scraped: bool = False


@dataclass
class Outcome:
    """How a run sequence ended, as ``execute`` hands it to ``on_end``: the job (None where
    planning failed), and the summary or the error."""

    job: PlannedJob | None = None
    summary: RunSummary | None = None
    error: BaseException | None = None


def execute(
    spec: ConversionSpec,
    backend: Backend,
    listeners: Sequence[Listener] = (),
    metrics: MetricsExporter | None = None,
    *,
    constants: MemoryConstants = DEFAULT_CONSTANTS,
    on_plan: Callable[[PlannedJob], None] | None = None,
    on_end: Callable[[Outcome], None] | None = None,
    linger: Linger = Linger(),
) -> RunSummary:
    """The run sequence of ``h5ngff convert``, ``h5ngff run`` and the runner Job; the callers
    keep only their input (flags, a manifest, the job's environment) and output (tables, status
    patches):

    1. plan ``spec`` for ``backend``;
    2. refuse an output another run is writing, or one that is not ours, before any cluster starts;
    3. add the backend's notices (``Backend.describe``) and hand the job to ``on_plan``;
    4. run it (``run_job``): every progress event goes to ``listeners`` and ``metrics``, which
       also sample the cluster while it is up; a listener that is a context manager (the progress
       bar) is open for the run only;
    5. hand the ``Outcome`` to ``on_end``, first: the outcome must not wait for step 6;
    6. keep ``metrics`` up for ``linger`` (the last scrape). A run that never started closes them
       at once: there are no final values to scrape.

    Returns the summary; raises what failed (an H5ngffError with its reason) once ``on_end`` has
    seen it."""
    outcome = Outcome()
    try:
        job = outcome.job = prepare_job(spec, backend, constants)
        if on_plan is not None:
            on_plan(job)
    except BaseException as exc:
        outcome.error = exc
        if on_end is not None:
            on_end(outcome)
        if metrics is not None:
            metrics.close()
        raise
    try:
        with ExitStack() as stack:
            for listener in listeners:
                if isinstance(listener, AbstractContextManager):
                    stack.enter_context(listener)
            outcome.summary = run_job(job, backend, listeners, metrics)
        return outcome.summary
    except BaseException as exc:
        outcome.error = exc
        raise
    finally:
        if on_end is not None:
            on_end(outcome)
        # A Ctrl-C ends the process now; a finished or failed run waits for its last scrape.
        if metrics is not None and (outcome.error is None or isinstance(outcome.error, Exception)):
            metrics.linger(linger.seconds, until_scraped=linger.until_scraped)


def prepare_job(
    spec: ConversionSpec, backend: Backend, constants: MemoryConstants = DEFAULT_CONSTANTS, at_once: int = 1
) -> PlannedJob:
    """Plan, and refuse what would fail later, before anything is shown or started (steps 1 to 3
    of ``execute``; a batch takes them for each of its items, ``at_once`` of them in flight)."""
    job = plan_job(spec, backend, constants, at_once)
    refuse_if_held(job.spec.output.path)  # another run writing it: refused before the plan is shown
    job.complete = check_output(job.plan, job.spec, job.source)  # a conflict: refused before the plan and the cluster
    job.notices.extend(backend.describe(job.spec, job.plan).notices)
    return job


def run_job(
    job: PlannedJob,
    backend: Backend,
    listeners: Sequence[Listener] | None = None,
    metrics: RunMetrics | None = None,
    cluster: Callable[[], AbstractContextManager[Session]] | None = None,
) -> RunSummary:
    """Convert. Returns a summary; raises H5ngffError on failure (after emitting ``Failed``).

    ``metrics`` hears every progress event and polls the cluster while it is up. ``cluster``
    gives the session to run on where it is not one of the backend's for this job alone (a
    batch's, planned for its largest item, started when an item first needs it)."""
    events = Broadcast([*(listeners or ()), *([metrics] if metrics is not None else [])])
    quiet_sync_cancel_race()  # a Ctrl-C must print one line, not distributed's NameError (backends/shutdown.py)
    quiet_repeated_death_log()  # a run whose workers died says so once, in its own error
    events.emit(phase=Phase.PLANNED, slabs_total=job.plan.n_tasks, message="")
    summary = RunSummary("Failed", job)
    start, started = time.perf_counter(), time.time()
    try:
        # The driver holds the output's lock from before the output is inspected (or deleted by
        # overwrite) until its completion marker is written; Dask workers never take it.
        with output_lock(job.spec.output.path, job.spec.output.storage_options) as guard:
            _convert(job, backend, events, summary, metrics, start, started, guard, cluster)
        return summary
    except H5ngffError as exc:
        summary.error = exc
        summary.seconds = time.perf_counter() - start
        _failed_totals(summary, events, exc)
        exc.summary = summary  # the CLI's --json and --memory-report show a failed run's figures too
        events.emit(phase=Phase.FAILED, message=str(exc))
        raise


def _convert(
    job: PlannedJob,
    backend: Backend,
    events: Broadcast,
    summary: RunSummary,
    metrics: RunMetrics | None,
    start: float,
    started: float,
    guard: Any,
    cluster: Callable[[], AbstractContextManager[Session]] | None,
) -> None:
    faults.crash_point("lock")
    output = prepare_output(job.plan, job.spec, job.source)
    summary.totals = RunTotals()  # the output is written from here on: a failed run reports what it wrote
    summary.resumed = output.resumed
    if output.complete:
        summary.already_complete = True
        summary.totals = RunTotals(slabs_skipped=job.plan.n_tasks)
        events.emit(
            phase=Phase.SUCCEEDED,
            slabs_done=job.plan.n_tasks,
            slabs_skipped=job.plan.n_tasks,
            message="already complete",
        )
        summary.status = "Succeeded"
        return
    failure = None
    opened: Session | None = None
    try:
        with cluster() if cluster is not None else backend.session(job.plan) as session:
            opened = session
            # The one sampler of the workers: the report's peaks and timeline, and the metrics.
            poller = ClusterPoller(session, job.plan)
            try:
                with (
                    metrics.attached(poller, job.plan) if metrics is not None else nullcontext(),
                    poller.running(at_start=cluster is None or metrics is not None),
                ):
                    try:
                        summary.totals = run_conversion(
                            session.client, job.plan, job.spec, output, events, guard, job.reader
                        )
                    except (KilledWorker, WorkersLostError) as exc:
                        failure = exc
            finally:
                # On failure too: a worker's peak, cgroup peak and kills are what explain an OOMKilled run.
                _collect_workers(summary, job.plan, poller, session, started)
                if cluster is None and session.workers_outlive_the_run:
                    _release_on_workers(session, job.spec.output.path)
    finally:
        # The session has closed: its backend re-read its figures after the last process stopped
        # (the kernel's last kills, slurmstepd's oom-kill lines). On a failure's way out too, the
        # summary's copies take them, so the message, the JSON and the metrics give the same
        # counts. A batch's shared session is still open (its items' figures: batch/run.py).
        if cluster is None and opened is not None:
            summary.workers = final_reports(summary.workers, opened, job.plan)
    if metrics is not None:
        metrics.settle(summary.workers)
    if failure is not None:
        raise session.diagnose(failure, summary.events, job.plan, summary.workers) from None
    events.emit(phase=Phase.FINALIZING)
    summary.seconds = time.perf_counter() - start
    summary.status = "Succeeded"
    guard.check()  # a lost lease: another run may own the prefix now, so no completion marker
    finish(output, job.plan, job.spec, summary.to_dict(brief=True))
    events.emit(phase=Phase.SUCCEEDED)


def _release_on_workers(session: Session, output: str) -> None:
    """An existing cluster's workers outlive the run: free what the conversion left on them (its
    buffers, its open HDF5 files with their caches, its output's stores), as a batch frees each
    item's. Without it every run on a long-lived cluster left its files open on the workers, about
    0.7 MiB per run, until they stood above any small plan (found by the suite's Prometheus batch
    test on its session cluster, which reached 240 MiB after 200 conversions)."""
    try:
        session.client.run(partial(end_of_conversion, output), on_error="return")
    except Exception as exc:  # noqa: BLE001 - a dying cluster: the run's own outcome stands
        log.debug("could not release %s on the workers: %s", output, exc)


def _failed_totals(summary: RunSummary, events: Broadcast, exc: H5ngffError) -> None:
    """A failed run's totals: the slabs it wrote (each recorded in the manifest before its
    progress event) and skipped, and their bytes. The driver's own count where its error carries
    one (``exc.totals``), else as the progress events counted them. None where the run failed
    before its output was prepared (nothing was written)."""
    if summary.totals is None:
        return
    if summary.totals.slabs_written or summary.totals.slabs_skipped:
        return  # run_conversion returned its own totals before the failure
    carried = getattr(exc, "totals", None)
    if isinstance(carried, RunTotals):
        summary.totals = carried
        return
    p = events.progress
    summary.totals = RunTotals(
        seconds=summary.seconds,
        slabs_written=max(0, p.slabs_done - p.slabs_skipped),
        slabs_skipped=p.slabs_skipped,
        bytes_read=p.bytes_read,
        bytes_written=p.bytes_written,
        store_retries=p.store_retries,
    )


def final_reports(workers: list[WorkerReport], session: Session, plan: Plan) -> list[WorkerReport]:
    """The summary's worker reports with the backend's figures as it read them last. Where
    collecting them failed (none), the backend's own, with the plan's figures."""
    if not workers:
        return [session.with_plan(report, plan) for report in session.extra_reports.values()]
    return [w.read_again(session.extra_reports[w.name]) if w.name in session.extra_reports else w for w in workers]


def _collect_workers(summary: RunSummary, plan: Plan, sampler: ClusterPoller, session: Session, since: float) -> None:
    try:
        summary.events = ClusterEvents.collect(session.client, since)
        summary.workers = session.worker_reports(plan, sampler.peaks, summary.events)
        summary.timeline = sampler.timeline
        summary.pod_timeline = session.pod_timeline()
        if session.pod_limit and session.pod_limit != plan.memory.pod_limit:
            summary.limit_override = (session.limit_name, session.pod_limit)
    except Exception:  # a broken cluster must not hide the error that broke it
        log.warning("Could not collect the workers' memory figures.", exc_info=True)
