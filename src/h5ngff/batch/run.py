"""Run a batch: one plan per item, one cluster sized for the largest item's plan, started once,
and the items streamed through it (docs/batch.md).

Each item goes through the same steps as one conversion (``runner.prepare_job`` then
``runner.run_job``: its own output lock, resume and completion marker), on the batch's cluster
instead of one of its own. An item that fails or is refused does not stop the others unless
``fail_fast`` is set.
"""

from __future__ import annotations

import time
from contextlib import AbstractContextManager, ExitStack, nullcontext
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Sequence

from ..backends.base import Backend, Session
from ..backends.diagnostics import reset_peak_rss
from ..engine.progress import Listener
from ..engine.write.tasks import release_between_conversions
from ..errors import H5ngffError, PlanError
from ..phases import ITEMS_CONVERTED, ItemState
from ..planner import DEFAULT_CONSTANTS, MemoryConstants, Plan
from ..runner import PlannedJob, RunSummary, prepare_job, run_job
from ..spec import ConversionSpec
from ..units import format_bytes
from .items import BatchItem

if TYPE_CHECKING:  # prometheus-client loads only where metrics are served
    from ..metrics.exporter import MetricsExporter

#: An item's outcome (``phases.ItemState``; docs/batch.md, "Outcomes").
DONE, COMPLETE, REFUSED, FAILED, NOT_RUN = (
    ItemState.DONE,
    ItemState.COMPLETE,
    ItemState.REFUSED,
    ItemState.FAILED,
    ItemState.NOT_RUN,
)


@dataclass
class ItemResult:
    item: BatchItem
    status: ItemState = NOT_RUN
    job: PlannedJob | None = None
    summary: RunSummary | None = None
    error: H5ngffError | None = None

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

    @property
    def ok(self) -> bool:
        return all(r.ok for r in self.results)

    def count(self, status: str) -> int:
        return sum(r.status == status for r in self.results)

    def to_dict(self) -> dict[str, Any]:
        plan = self.sizing.job.plan if self.sizing and self.sizing.job else None
        return {
            "status": "Succeeded" if self.ok else "Failed",
            "items": len(self.results),
            **{status.lower(): self.count(status) for status in (DONE, COMPLETE, REFUSED, FAILED, NOT_RUN)},
            "seconds": round(self.seconds, 3),
            "cluster_starts": self.cluster_starts,
            "cluster": None
            if plan is None
            else {
                "sized_by": self.sizing.item.source if self.sizing else None,
                "workers": plan.workers,
                "threads_per_worker": plan.threads_per_worker,
                "pod_limit": plan.memory.pod_limit,
                "memory_limit": plan.memory.memory_limit,
            },
            "results": [r.to_dict() for r in self.results],
            "notices": self.notices,
        }


@dataclass
class BatchHooks:
    """What the caller shows: the plan of the batch once every item is planned, a listener per
    item (its progress bar), and each item's result as it ends."""

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
) -> BatchSummary:
    """Plan every item, start one cluster for the largest plan, and convert the items on it in order.
    ``metrics`` serves each item's job and worker series while it runs (docs/metrics.md, "Batches")."""
    hooks = hooks or BatchHooks()
    start = time.perf_counter()
    summary = BatchSummary([ItemResult(item) for item in items])
    _plan_all(summary, spec_for, backend, constants, fail_fast)
    hooks.on_planned(summary)
    runnable = [r for r in summary.results if r.job is not None and r.status == NOT_RUN]
    if runnable and not (fail_fast and summary.count(REFUSED)):
        assert summary.sizing is not None and summary.sizing.job is not None
        with ExitStack() as stack:
            cluster = _OneCluster(backend, summary.sizing.job.plan, stack, summary)
            for result in runnable:
                _run_item(result, backend, cluster, hooks, metrics)
                if fail_fast and not result.ok:
                    break
    summary.seconds = time.perf_counter() - start
    return summary


def _plan_all(
    summary: BatchSummary,
    spec_for: Callable[[BatchItem], ConversionSpec],
    backend: Backend,
    constants: MemoryConstants,
    fail_fast: bool,
) -> None:
    """Plan each item as one conversion would (same refusals), then make every plan fit the one
    cluster: the same workers and threads as the largest plan, whose pod limit covers them all."""
    for result in summary.results:
        try:
            result.job = prepare_job(spec_for(result.item), backend, constants)
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
                result.job = prepare_job(job.spec.model_copy(update={"resources": resources}), backend, constants)
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


class _OneCluster:
    """The batch's one cluster, started when the first item needs it (a re-run whose items are
    all complete starts none), and ready for each next item: the last item's buffers and files
    go, then each worker's RSS high-water mark starts again from what it holds now, so an item's
    peak is its own."""

    def __init__(self, backend: Backend, plan: Plan, stack: ExitStack, summary: BatchSummary):
        self.backend, self.plan, self.stack, self.summary = backend, plan, stack, summary
        self.session: Session | None = None

    def __call__(self) -> AbstractContextManager[Session]:
        if self.session is None:
            self.session = self.stack.enter_context(self.backend.session(self.plan))
            self.summary.cluster_starts += 1
        self.session.client.run(release_between_conversions)
        self.session.client.run(reset_peak_rss)
        return nullcontext(self.session)


def _run_item(
    result: ItemResult, backend: Backend, cluster: _OneCluster, hooks: BatchHooks, metrics: MetricsExporter | None
) -> None:
    assert result.job is not None
    try:
        result.summary = run_job(result.job, backend, list(hooks.listeners(result)), metrics, cluster=cluster)
        totals = result.summary.totals
        result.status = (
            COMPLETE
            if totals is not None and not totals.slabs_written and totals.slabs_skipped == result.job.plan.n_tasks
            else DONE
        )
    except H5ngffError as exc:
        result.status, result.error, result.summary = FAILED, exc, exc.summary
    hooks.on_item(result)
