"""spec -> plan -> backend -> engine: the one code path behind ``h5ngff convert``, ``h5ngff run``
and the Kubernetes runner Job."""

from __future__ import annotations

import logging
import time
from collections import Counter
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Any

from distributed.scheduler import KilledWorker

from . import __version__
from .backends.allocator import resolve_allocator
from .backends.base import MemorySampler
from .backends.diagnostics import ClusterEvents, WorkerReport, classify_failure
from .engine.driver import RunTotals, finish, run_conversion
from .engine.lock import output_lock
from .engine.output import prepare_output
from .engine.progress import Broadcast, Listener
from .engine.source import SourceIdentity
from .engine.sources import open_source
from .errors import H5ngffError, WorkersLostError
from .planner import DEFAULT_CONSTANTS, DatasetInfo, MemoryConstants, Plan, make_plan
from .spec import ConversionSpec

log = logging.getLogger(__name__)


@dataclass
class PlannedJob:
    spec: ConversionSpec
    dataset: DatasetInfo
    source: SourceIdentity
    plan: Plan
    notices: list[str] = field(default_factory=list)


def plan_job(spec: ConversionSpec, backend, constants: MemoryConstants = DEFAULT_CONSTANTS) -> PlannedJob:
    """Inspect the source (metadata only) and plan the conversion for ``backend``."""
    opened = open_source(spec)
    dataset, identity = opened.info, opened.identity
    allocator = resolve_allocator(spec.resources.allocator)
    notices = []
    if spec.resources.allocator == "jemalloc" and allocator != "jemalloc":
        notices.append("resources.allocator is jemalloc but libjemalloc.so.2 is not installed here; workers use glibc (apt-get install libjemalloc2).")
    spec = _with_cluster_budget(spec, backend)
    plan = make_plan(dataset, spec, backend.capacity(), constants, allocator)
    return PlannedJob(spec, dataset, identity, plan, notices + list(plan.notices))


def _with_cluster_budget(spec: ConversionSpec, backend) -> ConversionSpec:
    """On an existing cluster the workers are what they are: plan for their count and limit."""
    if getattr(backend, "name", "") != "external":
        return spec
    capacity = backend.capacity()
    resources = spec.resources.model_copy(update={"workers": capacity.default_workers, "threads_per_worker": max(1, capacity.cores // max(1, capacity.default_workers or 1))})
    limit = backend.memory_limit()
    if limit and spec.resources.memory_per_worker is None and spec.resources.memory_total is None:
        resources = resources.model_copy(update={"memory_per_worker": limit})
    return spec.model_copy(update={"resources": resources})


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
            "gb_per_s": round(self.gb_per_s, 3),
            "slabs_written": self.totals.slabs_written if self.totals else 0,
            "slabs_skipped": self.totals.slabs_skipped if self.totals else 0,
            "resumed": self.resumed,
            "stage_seconds": self.totals.stage_seconds if self.totals else {},
            "predicted_peak_per_worker": plan.memory.predicted_peak,
            "memory_limit_per_worker": plan.memory.memory_limit,
            "pod_limit_per_worker": plan.memory.pod_limit,
            "workers": [w.to_dict() for w in self.workers],
            "notices": self.job.notices,
        }
        if not brief:
            out["plan"] = plan.to_dict()
        return out


def run_job(job: PlannedJob, backend, listeners: list[Listener] | None = None, metrics=None) -> RunSummary:
    """Convert. Returns a summary; raises H5ngffError on failure (after emitting ``Failed``).

    ``metrics`` (a ``metrics.exporter.MetricsExporter``) hears every progress event and polls the
    cluster while it is up."""
    events = Broadcast(list(listeners or []) + ([metrics] if metrics is not None else []))
    events.emit(phase="Planned", slabs_total=job.plan.n_tasks, message="")
    summary = RunSummary("Failed", job)
    start, started = time.perf_counter(), time.time()
    try:
        # The driver holds the output's lock from before the output is inspected (or deleted by
        # overwrite) until its completion marker is written; Dask workers never take it.
        with output_lock(job.spec.output.path):
            _convert(job, backend, events, summary, metrics, start, started)
        return summary
    except H5ngffError as exc:
        summary.error = exc
        summary.seconds = time.perf_counter() - start
        exc.summary = summary  # the CLI's --json and --memory-report show a failed run's figures too
        events.emit(phase="Failed", message=str(exc))
        raise


def _convert(job: PlannedJob, backend, events: Broadcast, summary: RunSummary, metrics, start: float, started: float) -> None:
    output = prepare_output(job.plan, job.spec, job.source)
    summary.resumed = output.resumed
    if output.complete:
        summary.totals = RunTotals(slabs_skipped=job.plan.n_tasks)
        events.emit(phase="Succeeded", slabs_done=job.plan.n_tasks, slabs_skipped=job.plan.n_tasks, message="already complete")
        summary.status = "Succeeded"
        return
    failure = None
    with backend.session(job.plan) as session, (metrics.attached(session, job.plan) if metrics is not None else nullcontext()):
        sampler = MemorySampler(session.client)
        try:
            with sampler:
                try:
                    summary.totals = run_conversion(session.client, job.plan, job.spec, output, events)
                except (KilledWorker, WorkersLostError) as exc:
                    failure = exc
        finally:
            # On failure too: a worker's peak, cgroup peak and kills are what explain an OOMKilled run.
            _collect_workers(summary, job.plan, sampler, session, started)
    # The session has closed: the pods' counters are final (the backend re-read them after the
    # last process stopped), so the message, the JSON and the metrics give the same counts.
    if metrics is not None:
        metrics.settle(summary.workers)
    if failure is not None:
        pod_limit = session.pod_limit or job.plan.memory.pod_limit
        raise classify_failure(failure, summary.events, pod_limit, job.plan.memory.memory_limit, sum(w.oom_kills for w in summary.workers),
                               limit_name=getattr(session, "limit_name", "pod limit"), workers=summary.workers,
                               planned_limit=job.plan.memory.pod_limit) from None
    events.emit(phase="Finalizing")
    summary.seconds = time.perf_counter() - start
    summary.status = "Succeeded"
    finish(output, job.plan, job.spec, summary.to_dict(brief=True))
    events.emit(phase="Succeeded")


def _collect_workers(summary: RunSummary, plan: Plan, sampler: MemorySampler, session, since: float) -> None:
    try:
        summary.events = ClusterEvents.collect(session.client, since)
        summary.workers = _worker_reports(plan, sampler, session, summary.events)
        summary.timeline = sampler.timeline
        summary.pod_timeline = session.pod_timeline()
    except Exception:  # a broken cluster must not hide the error that broke it
        log.warning("Could not collect the workers' memory figures.", exc_info=True)


def _worker_reports(plan: Plan, sampler: MemorySampler, session, events: ClusterEvents) -> list[WorkerReport]:
    """One report per worker (per pod where pods are emulated): a restarted process is folded
    into the worker or pod it replaced, and its peak is the highest any of its processes reached."""
    session.refresh()
    pods = session.extra_reports
    kills = Counter(e.get("name") for e in events.oom_killed())
    terminations = Counter(e.get("name") for e in events.memory_restarts)
    last_peaks = events.terminated_peaks()
    names = set(sampler.peaks) | set(last_peaks)
    if pods:  # only pods exist: a name no pod has cannot be a worker of this run
        names = set(pods) | {n for n in names if n in pods}
    reports = []
    for name in sorted(names, key=_natural):
        report = pods.get(name) or WorkerReport(name=name, oom_kills=kills[name], memory_terminations=terminations[name])
        report.peak_rss = max(report.peak_rss, sampler.peaks.get(name, 0), last_peaks.get(name, 0))
        report.predicted_peak = plan.memory.predicted_peak
        report.memory_limit = plan.memory.memory_limit
        report.pod_limit = report.pod_limit or session.pod_limit or plan.memory.pod_limit
        reports.append(report)
    return reports


def _natural(name: str) -> tuple:
    digits = "".join(ch for ch in name if ch.isdigit())
    return (name.rstrip("0123456789"), int(digits) if digits else -1)
