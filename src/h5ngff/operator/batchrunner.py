"""``h5ngff runner`` for a ConversionBatch attempt (``H5NGFF_KIND=ConversionBatch``).

The operator puts the batch's spec in ``H5NGFF_SPEC`` and the ids of the items this attempt runs
in ``H5NGFF_ITEMS`` (those it resumes, overwrite off, in ``H5NGFF_RESUME``). The runner plans
each of them in its pod, sizes one cluster for the largest plan and streams the items through it
(``h5ngff.batch.run.run_batch``, as ``h5ngff convert`` with several sources does), and reports
each item into ``status.itemReports`` of its own batch: Running when it starts, then Succeeded or
Failed with the reason. The operator alone turns reports into ``status.items`` (batchreconcile).
Exit code: 0 when every item of the attempt succeeded, else that of the first failure.
"""

from __future__ import annotations

import json
import logging
import os
from typing import Any, Callable, Protocol, TypeVar

from ..batch.items import BatchItem
from ..batch.run import COMPLETE, DONE, BatchHooks, BatchSummary, ItemResult, run_batch
from ..errors import H5ngffError, SpecError
from ..spec import ConversionSpec
from ..engine.progress import Listener
from .attempt import ProgressForwarder
from .batchspec import BATCH_PLURAL, ITEMS_ENV, RESUME_ENV, ConversionBatchSpec, PlannedItem, parse_batch_spec
from .manifests import SPEC_ENV
from .reporter import StatusReporter
from .runner_metrics import metrics_linger, runner_exporter
from .status import now, result_summary

log = logging.getLogger(__name__)


def batch_spec_from_env() -> ConversionBatchSpec:
    text = os.environ.get(SPEC_ENV)
    if not text:
        raise SpecError(
            "", f"Expected the batch's spec as JSON in ${SPEC_ENV} (the operator sets it). Got nothing instead."
        )
    try:
        return parse_batch_spec(json.loads(text))
    except json.JSONDecodeError as exc:
        raise SpecError("", f"Expected JSON in ${SPEC_ENV}. Got invalid JSON instead ({exc}).") from None


def _ids(name: str) -> list[str]:
    return [i for i in (os.environ.get(name) or "").split(",") if i]


def item_report(attempt: int, result: ItemResult) -> dict[str, Any]:
    """One item's report: Succeeded (converted now, or complete already) or Failed, and its figures."""
    report: dict[str, Any] = {
        "attempt": attempt,
        "outcome": "Succeeded" if result.status in (DONE, COMPLETE) else "Failed",
    }
    if result.error is not None:
        report.update(reason=result.error.reason, message=str(result.error)[:2000])
    elif not result.ok:
        report.update(reason="NotRun", message=f"The batch stopped before this item ({result.status}).")
    if result.summary is not None:
        report["result"] = result_summary(result.summary.to_dict())
    if result.job is not None:
        report.update(peakRssBytes=result.peak_rss, predictedPeakBytes=result.predicted_peak)
    return report


class Args(Protocol):
    """runner_cmd.RunnerArgs (which calls this module: it is not imported here)."""

    @property
    def namespace(self) -> str: ...
    @property
    def name(self) -> str: ...
    @property
    def uid(self) -> str: ...
    @property
    def attempt(self) -> int: ...


A = TypeVar("A", bound=Args)


def main(args: A, backend_for: Callable[[A, ConversionBatchSpec], Any]) -> int:
    """``backend_for``: runner_cmd.runner_backend, the one backend factory of a runner (it gives a
    backends.base.Backend; this module stays off h5ngff.backends, as the operator's modules do)."""
    reporter = StatusReporter(args.namespace, args.name, plural=BATCH_PLURAL)
    run_ids = _ids(ITEMS_ENV)

    def report(reports: dict[str, dict[str, Any]], final: bool = False) -> None:
        reporter({"itemReports": reports}, final)

    try:
        try:
            spec = batch_spec_from_env()
            backend = backend_for(args, spec)
        except H5ngffError as exc:
            failed = {
                "attempt": args.attempt,
                "outcome": "Failed",
                "reason": exc.reason,
                "message": str(exc)[:2000],
                "time": now(),
            }
            report({i: failed for i in run_ids}, True)
            return exc.exit_code
        planned = {p.id: p for p in spec.planned_items()}
        chosen = [planned[i] for i in run_ids if i in planned]
        resume = set(_ids(RESUME_ENV))
        by_output = {p.item.output: p for p in chosen}
        log.info(
            "attempt %d of ConversionBatch %s/%s: %d item(s) on the %s backend",
            args.attempt,
            args.namespace,
            args.name,
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
            refused = {item_id(r): item_report(args.attempt, r) for r in summary.results if r.error is not None}
            if refused:
                report(refused)

        def listeners(result: ItemResult) -> list[Listener]:
            """Running when it starts, then its slabs (at most one report every few seconds)."""
            running = {"attempt": args.attempt, "outcome": "Running", "time": now()}
            report({item_id(result): running})

            def progress(patch: dict[str, Any], final: bool) -> None:
                report({item_id(result): {**running, "time": now(), "progress": patch["progress"]}})

            return [ProgressForwarder(progress)]

        hooks = BatchHooks(
            on_planned=on_planned,
            listeners=listeners,
            on_item=lambda r: report({item_id(r): item_report(args.attempt, r)}),
        )
        items = [p.item for p in chosen]
        outputs = [item.output for item in items]
        metrics = runner_exporter(lambda exporter, port: exporter.for_batch(outputs, port))
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
            report({item_id(r): item_report(args.attempt, r) for r in summary.results}, True)
            if metrics is not None:
                metrics.linger(metrics_linger(), until_scraped=True)
        finally:
            if metrics is not None:
                metrics.close()
        return 0 if summary.ok else _first_failure(summary)
    finally:
        reporter.close()


def _first_failure(summary: BatchSummary) -> int:
    return next((r.error.exit_code for r in summary.results if r.error is not None), 1)


__all__ = ["main", "item_report", "batch_spec_from_env", "PlannedItem"]
