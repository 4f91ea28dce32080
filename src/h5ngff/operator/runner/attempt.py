"""One attempt of a ConversionJob: the run sequence (``runner.execute``), reported as status patches.

The runner pod (``h5ngff runner``) sends the patches to the API server; ``h5ngff run job.yaml``
merges them into a dict and prints the status the operator would show. Both run
``runner.execute``, as ``h5ngff convert`` does: this module only turns its steps into patches.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable

from ...backends.base import Backend
from ...engine.progress import Listener, Progress
from ...errors import H5ngffError
from ...jobspec import ConversionJobSpec
from ...k8s import runner_job_name
from ...phases import WRITING_PHASES
from ...planner import DEFAULT_CONSTANTS, MemoryConstants
from ...runner import Linger, Outcome, PlannedJob, RunSummary, execute
from ..schema.status import (
    ConversionJobStatus,
    failed_patch,
    merge,
    now,
    pending_patch,
    progress_status,
    read_status,
    succeeded_patch,
)
from .reports import PROGRESS_INTERVAL, planned_patch, progress_patch, result_summary, runner_report

if TYPE_CHECKING:
    from ...metrics.exporter import MetricsExporter

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
    listeners: list[Listener] = field(default_factory=list)
    #: Called with the plan before the conversion starts (e.g. to print it).
    on_plan: Callable[[PlannedJob], None] | None = None
    progress_interval: float = PROGRESS_INTERVAL
    #: The exporter serving this attempt's metrics, or None.
    metrics: MetricsExporter | None = None
    #: How long ``metrics`` stay up once the attempt's outcome is reported.
    linger: Linger = field(default_factory=Linger)


def run_attempt(
    spec: ConversionJobSpec, backend: Backend, sink: Sink, attempt: int = 1, options: AttemptOptions | None = None
) -> AttemptResult:
    """Plan and convert ``spec`` on ``backend``; every step goes to ``sink``. Never raises: an
    error becomes the attempt's Failed report (with its reason) and the exit code."""
    opts = options or AttemptOptions()
    ended = Outcome()

    def planned(job: PlannedJob) -> None:
        for notice in job.notices:
            log.warning("%s", notice)
        sink(planned_patch(job.plan, now()), False)
        if opts.on_plan is not None:
            opts.on_plan(job)

    def end(outcome: Outcome) -> None:
        nonlocal ended
        ended = outcome
        _report(sink, attempt, outcome)

    try:
        summary = execute(
            spec.conversion(),
            backend,
            [ProgressForwarder(sink, opts.progress_interval), *opts.listeners],
            opts.metrics,
            constants=opts.constants,
            on_plan=planned,
            on_end=end,
            linger=opts.linger,
        )
    except Exception as exc:
        if ended.error is not exc:  # it failed before the run sequence began: report it here
            _report(sink, attempt, Outcome(error=exc))
        return AttemptResult(exc.exit_code if isinstance(exc, H5ngffError) else 1, job=ended.job, error=exc)
    return AttemptResult(0, job=ended.job, summary=summary)


def _report(sink: Sink, attempt: int, outcome: Outcome) -> None:
    """The attempt's last patch: Succeeded with the result, or Failed with the reason (a bug is a
    RunnerError: the operator still learns why this attempt ended). A Ctrl-C reports nothing."""
    exc = outcome.error
    if exc is None and outcome.job is not None and outcome.summary is not None:
        sink(_succeeded(outcome.job, outcome.summary, attempt), True)
    elif isinstance(exc, H5ngffError):
        log.error("attempt %d failed (%s): %s", attempt, exc.reason, exc)
        sink(runner_report(attempt, "Failed", now(), exc.reason, str(exc)), True)
    elif isinstance(exc, Exception):
        log.error("runner crashed", exc_info=exc)
        sink(runner_report(attempt, "Failed", now(), "RunnerError", f"{type(exc).__name__}: {exc}"), True)


def _succeeded(job: PlannedJob, summary: RunSummary, attempt: int) -> dict[str, Any]:
    total = job.plan.n_tasks
    t = summary.totals
    return {
        "result": result_summary(summary.to_dict(brief=True)),
        "progress": progress_status(
            total, total, t.slabs_skipped if t else 0, t.bytes_read if t else 0, t.bytes_written if t else 0, now()
        ),
        **runner_report(attempt, "Succeeded", now()),
    }


def run_locally(
    name: str, spec: ConversionJobSpec, backend: Backend, options: AttemptOptions | None = None
) -> tuple[dict[str, Any], AttemptResult]:
    """``h5ngff run``: one attempt on ``backend``; returns the status the operator would show.

    One attempt only: locally there is no pod to lose, and a deterministic failure (the usual
    case) would fail again. The operator's retry rule is documented in docs/operator.md.
    """
    status: dict[str, Any] = merge(
        {}, pending_patch(ConversionJobStatus(), 1, runner_job_name(name, 1), spec.output.path, now())
    )

    def sink(patch: dict[str, Any], final: bool) -> None:
        nonlocal status
        status = merge(status, patch)

    result = run_attempt(spec, backend, sink, 1, options)
    if result.succeeded:
        status = merge(status, succeeded_patch(read_status(ConversionJobStatus, status), now()))
    else:
        reason = getattr(result.error, "reason", "RunnerError")
        status = merge(status, failed_patch(read_status(ConversionJobStatus, status), reason, str(result.error), now()))
    return status, result
