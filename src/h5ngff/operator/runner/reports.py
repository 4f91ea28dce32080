"""What a runner pod writes into its ConversionJob's ``.status`` (operator/schema/status.py says
who writes what): the plan, progress, the result and its own account of the attempt. Pure
builders; ``h5ngff run job.yaml`` uses them too, to print the status the operator would show."""

from __future__ import annotations

from typing import Any

from ...engine.progress import Progress
from ...phases import Phase
from ...planner.model import Plan
from ...units import k8s_quantity
from ..schema.status import bounded, progress_status

#: The runner's ``progress`` patches are rate-limited to one per this many seconds (phase
#: changes always go through): a 10 000-slab run must not write 10 000 status updates.
PROGRESS_INTERVAL = 2.0


def plan_summary(plan: Plan) -> dict[str, Any]:
    m = plan.memory
    return {
        "shape": list(plan.dataset.shape),
        "dtype": plan.dtype,
        "chunks": list(plan.chunks),
        "slab": list(plan.slab),
        "levels": len(plan.levels),
        "passes": len(plan.passes),
        "tasks": plan.n_tasks,
        "workers": plan.workers,
        "threadsPerWorker": plan.threads_per_worker,
        "memoryLimit": k8s_quantity(m.memory_limit),
        "podLimit": k8s_quantity(m.pod_limit),
        "memoryLimitBytes": m.memory_limit,
        "podLimitBytes": m.pod_limit,
        "predictedPeakBytes": m.predicted_peak,
        "allocator": plan.allocator,
    }


def planned_patch(plan: Plan, when: str) -> dict[str, Any]:
    return {
        "phase": Phase.PLANNED.value,
        "plan": plan_summary(plan),
        "progress": progress_status(0, plan.n_tasks, when=when),
    }


def progress_patch(progress: Progress, when: str) -> dict[str, Any]:
    """A runner progress event as a status patch (phase Running while slabs are written)."""
    body = progress_status(
        progress.slabs_done,
        progress.slabs_total,
        progress.slabs_skipped,
        progress.bytes_read,
        progress.bytes_written,
        when,
    )
    return {"phase": Phase.RUNNING.value, "progress": body}


def runner_report(
    attempt: int, outcome: str, when: str, reason: str | None = None, message: str | None = None
) -> dict[str, Any]:
    report = {"attempt": attempt, "outcome": outcome, "reason": reason, "message": bounded(message), "time": when}
    return {"runner": {k: v for k, v in report.items() if v is not None}}


def result_summary(summary: dict[str, Any]) -> dict[str, Any]:
    """From ``RunSummary.to_dict()``: the figures worth keeping on the object."""
    peaks = [w.get("peak_rss", 0) for w in summary.get("workers", ())]
    return {
        "seconds": summary.get("seconds", 0.0),
        "bytesRead": summary.get("bytes_read", 0),
        "bytesWritten": summary.get("bytes_written", 0),
        "gbPerS": summary.get("gb_per_s", 0.0),
        "resumed": bool(summary.get("resumed")),
        "peakWorkerRssBytes": max(peaks, default=0),
    }
