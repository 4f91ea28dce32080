"""``h5ngff runner`` for a ConversionBatch attempt (a runner contract of kind ConversionBatch).

The contract (operator/contract.py) holds the batch's spec, the ids of the items this attempt
runs and of those it resumes (overwrite off). The runner plans each of them in its pod, sizes one
cluster for the largest plan and streams the items through it (``h5ngff.batch.run.run_batch``, as
``h5ngff convert`` with several sources does), and reports each item into ``status.itemReports``
of its own batch: Running when it starts, then Succeeded or Failed with the reason. The operator
alone turns reports into ``status.items`` (operator/controller/batchreconcile.py). Exit code: 0
when every item of the attempt succeeded, else that of the first failure.
"""

from __future__ import annotations

import logging
from typing import Any, Callable

from ...batch.items import BatchItem
from ...batch.run import COMPLETE, DONE, BatchHooks, BatchSummary, ItemResult, run_batch
from ...engine.progress import Listener
from ...errors import H5ngffError
from ...jobspec import BATCH_PLURAL
from ...spec import ConversionSpec
from ..contract import RunnerContract
from ..schema.batchspec import ConversionBatchSpec, PlannedItem, parse_batch_spec
from ..schema.status import bounded, now
from .attempt import ProgressForwarder
from .metrics import runner_exporter
from .reporter import StatusReporter
from .reports import result_summary

log = logging.getLogger(__name__)


def item_report(attempt: int, result: ItemResult) -> dict[str, Any]:
    """One item's report: Succeeded (converted now, or complete already) or Failed, and its figures."""
    report: dict[str, Any] = {
        "attempt": attempt,
        "outcome": "Succeeded" if result.status in (DONE, COMPLETE) else "Failed",
    }
    if result.error is not None:
        report.update(reason=result.error.reason, message=bounded(str(result.error)))
    elif not result.ok:
        report.update(reason="NotRun", message=f"The batch stopped before this item ({result.status}).")
    if result.summary is not None:
        report["result"] = result_summary(result.summary.to_dict())
    if result.job is not None:
        report.update(peakRssBytes=result.peak_rss, predictedPeakBytes=result.predicted_peak)
    return report


def main(contract: RunnerContract, backend_for: Callable[[RunnerContract, ConversionBatchSpec], Any]) -> int:
    """``backend_for``: runner.main.runner_backend, the one backend factory of a runner (it gives a
    backends.base.Backend)."""
    reporter = StatusReporter(contract.namespace, contract.name, plural=BATCH_PLURAL)
    run_ids = list(contract.items)

    def report(reports: dict[str, dict[str, Any]], final: bool = False) -> None:
        reporter({"itemReports": reports}, final)

    try:
        try:
            spec = parse_batch_spec(dict(contract.spec))
            backend = backend_for(contract, spec)
        except H5ngffError as exc:
            failed = {
                "attempt": contract.attempt,
                "outcome": "Failed",
                "reason": exc.reason,
                "message": bounded(str(exc)),
                "time": now(),
            }
            report({i: failed for i in run_ids}, True)
            return exc.exit_code
        planned = {p.id: p for p in spec.planned_items()}
        chosen = [planned[i] for i in run_ids if i in planned]
        resume = set(contract.resume)
        by_output = {p.item.output: p for p in chosen}
        log.info(
            "attempt %d of ConversionBatch %s/%s: %d item(s) on the %s backend",
            contract.attempt,
            contract.namespace,
            contract.name,
            len(chosen),
            backend.name,
        )

        def spec_for(item: BatchItem) -> ConversionSpec:
            p = by_output[item.output]
            conversion = p.spec.conversion()
            if p.id in resume and conversion.output.overwrite:  # a retry resumes what it wrote, never wipes it
                conversion = conversion.model_copy(
                    update={"output": conversion.output.model_copy(update={"overwrite": False})}
                )
            return conversion

        def item_id(result: ItemResult) -> str:
            return by_output[result.item.output].id

        def on_planned(summary: BatchSummary) -> None:
            refused = {item_id(r): item_report(contract.attempt, r) for r in summary.results if r.error is not None}
            if refused:
                report(refused)

        def listeners(result: ItemResult) -> list[Listener]:
            """Running when it starts, then its slabs (at most one report every few seconds)."""
            running = {"attempt": contract.attempt, "outcome": "Running", "time": now()}
            report({item_id(result): running})

            def progress(patch: dict[str, Any], final: bool) -> None:
                report({item_id(result): {**running, "time": now(), "progress": patch["progress"]}})

            return [ProgressForwarder(progress)]

        hooks = BatchHooks(
            on_planned=on_planned,
            listeners=listeners,
            on_item=lambda r: report({item_id(r): item_report(contract.attempt, r)}),
        )
        items = [p.item for p in chosen]
        outputs = [item.output for item in items]
        metrics = runner_exporter(contract, lambda exporter: _start_batch(exporter, len(outputs)))
        try:
            specs: Callable[[BatchItem], ConversionSpec] = spec_for
            if metrics is not None and metrics.batch is not None:
                hooks, specs = metrics.batch.around(hooks), metrics.batch.planning(spec_for)
            summary = run_batch(
                items, specs, backend, hooks=hooks, metrics=metrics, items_in_flight=spec.items_in_flight
            )
            if metrics is not None and metrics.batch is not None:
                metrics.batch.finished(summary)
            # Every item's last word (refused and not-run ones included), delivered before the exit
            # and before the metrics linger.
            report({item_id(r): item_report(contract.attempt, r) for r in summary.results}, True)
            if metrics is not None:
                metrics.linger(contract.metrics_linger, until_scraped=True)
        finally:
            if metrics is not None:
                metrics.close()
        return 0 if summary.ok else _first_failure(summary)
    finally:
        reporter.close()


def _start_batch(exporter: Any, items: int) -> None:
    exporter.start_batch(items)


def _first_failure(summary: BatchSummary) -> int:
    return next((r.error.exit_code for r in summary.results if r.error is not None), 1)


__all__ = ["main", "item_report", "PlannedItem"]
