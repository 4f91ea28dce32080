"""One attempt of a ConversionJob: plan, convert, and report as status patches.

The runner pod (``h5ngff runner``) sends the patches to the API server; ``h5ngff run job.yaml``
merges them into a dict and prints the status the operator would show. Both run
``runner.plan_job``/``run_job``: the one code path.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from ..engine.write.output import check_output
from ..engine.progress import Progress
from ..errors import H5ngffError
from ..jobspec import ConversionJobSpec
from ..phases import WRITING_PHASES
from ..planner import DEFAULT_CONSTANTS, MemoryConstants
from ..runner import PlannedJob, RunSummary, plan_job, run_job
from .status import (
    PROGRESS_INTERVAL,
    failed_patch,
    merge,
    now,
    pending_patch,
    planned_patch,
    progress_patch,
    progress_status,
    result_summary,
    runner_report,
    succeeded_patch,
)

log = logging.getLogger(__name__)

#: Receives status patches; ``final`` marks the last one of an attempt (it must not be dropped).
Sink = Callable[[dict[str, Any], bool], None]


@dataclass
class AttemptResult:
    exit_code: int
    job: PlannedJob | None = None
    summary: RunSummary | None = None
    error: BaseException | None = None

    @property
    def succeeded(self) -> bool:
        return self.exit_code == 0


class ProgressForwarder:
    """Turns progress events into ``Running`` patches, at most one per ``interval`` seconds
    (a 10 000-slab job must not write 10 000 status updates); the first one always goes out."""

    def __init__(self, sink: Sink, interval: float = PROGRESS_INTERVAL):
        self.sink = sink
        self.interval = interval
        self._last = float("-inf")

    def __call__(self, progress: Progress) -> None:
        if progress.phase not in WRITING_PHASES:
            return  # Planned was reported with the plan; the outcome is reported by run_attempt
        if time.monotonic() - self._last < self.interval and progress.slabs_done < progress.slabs_total:
            return
        self._last = time.monotonic()
        self.sink(progress_patch(progress, now()), False)


@dataclass
class AttemptOptions:
    constants: MemoryConstants = DEFAULT_CONSTANTS
    #: More progress listeners (e.g. the CLI's progress bar).
    listeners: list[Callable[[Progress], None]] = field(default_factory=list)
    #: Called with the plan before the conversion starts (e.g. to print it).
    on_plan: Callable[[PlannedJob], None] | None = None
    progress_interval: float = PROGRESS_INTERVAL
    #: A metrics.exporter.MetricsExporter serving this attempt's metrics, or None.
    metrics: Any = None


def run_attempt(spec: ConversionJobSpec, backend, sink: Sink, attempt: int = 1, options: AttemptOptions | None = None) -> AttemptResult:
    """Plan and convert ``spec`` on ``backend``; every step goes to ``sink``. Never raises: an
    error becomes the attempt's Failed report (with its reason) and the exit code."""
    opts = options or AttemptOptions()
    job: PlannedJob | None = None
    try:
        job = plan_job(spec.conversion(), backend, opts.constants)
        check_output(job.plan, job.spec, job.source)  # refuse a conflicting output before any cluster starts
        for notice in job.notices:
            log.warning("%s", notice)
        sink(planned_patch(job.plan, now()), False)
        if opts.on_plan is not None:
            opts.on_plan(job)
        summary = run_job(job, backend, [ProgressForwarder(sink, opts.progress_interval), *opts.listeners], metrics=opts.metrics)
    except H5ngffError as exc:
        log.error("attempt %d failed (%s): %s", attempt, exc.reason, exc)
        sink(runner_report(attempt, "Failed", now(), exc.reason, str(exc)), True)
        return AttemptResult(exc.exit_code, job=job, error=exc)
    except Exception as exc:  # a bug: still tell the operator why this attempt ended
        log.exception("runner crashed")
        sink(runner_report(attempt, "Failed", now(), "RunnerError", f"{type(exc).__name__}: {exc}"), True)
        return AttemptResult(1, job=job, error=exc)
    sink(_succeeded(job, summary, attempt), True)
    return AttemptResult(0, job=job, summary=summary)


def _succeeded(job: PlannedJob, summary: RunSummary, attempt: int) -> dict[str, Any]:
    total = job.plan.n_tasks
    t = summary.totals
    return {
        "result": result_summary(summary.to_dict(brief=True)),
        "progress": progress_status(total, total, t.slabs_skipped if t else 0, t.bytes_read if t else 0, t.bytes_written if t else 0, now()),
        **runner_report(attempt, "Succeeded", now()),
    }


def run_locally(name: str, spec: ConversionJobSpec, backend, options: AttemptOptions | None = None) -> tuple[dict[str, Any], AttemptResult]:
    """``h5ngff run``: one attempt on ``backend``; returns the status the operator would show.

    One attempt only: locally there is no pod to lose, and a deterministic failure (the usual
    case) would fail again. The operator's retry rule is documented in docs/operator.md.
    """
    from .manifests import runner_job_name

    status: dict[str, Any] = merge({}, pending_patch({}, 1, runner_job_name(name, 1), spec.output.path, now()))

    def sink(patch: dict[str, Any], final: bool) -> None:
        nonlocal status
        status = merge(status, patch)

    result = run_attempt(spec, backend, sink, 1, options)
    if result.succeeded:
        status = merge(status, succeeded_patch(status, now()))
    else:
        status = merge(status, failed_patch(status, getattr(result.error, "reason", "RunnerError"), str(result.error), now()))
    return status, result
