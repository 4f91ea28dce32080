"""A ConversionBatch's ``.status``: its schema (the CRD's) and the runner's per-item report.

Who writes what (so two writers never replace each other's lists; a merge patch replaces a
list whole):

* the runner writes only ``itemReports``, a map from item id to its report of the current
  attempt (a map, so each item's report is its own merge-patch key);
* the operator writes everything else, ``items`` above all: it folds the reports in, and it
  alone decides what runs (docs/operator.md, ConversionBatch).
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from .status import Condition, ProgressStatus, ResultSummary, _Status


class ItemReport(_Status):
    """The runner's account of one item in one attempt."""

    attempt: int
    outcome: Literal["Running", "Succeeded", "Failed"]
    reason: str | None = None
    message: str | None = None
    time: str | None = Field(None, description="When the runner wrote this report.")
    result: ResultSummary | None = None
    progress: ProgressStatus | None = Field(
        None, description="Its slabs while it runs, at most one report per item every few seconds."
    )
    peak_rss_bytes: int | None = Field(None, description="The busiest worker's RSS peak while this item ran.")
    predicted_peak_bytes: int | None = Field(None, description="The item's own plan's predicted worker peak.")


class BatchItemStatus(_Status):
    """One item as the operator last decided about it."""

    id: str = Field(description="The item's id: a hash of its output (an item is known by its output).")
    source: str = Field(description="FILE:/dataset")
    output: str
    phase: Literal["Pending", "Running", "Succeeded", "Failed"]
    reason: str | None = Field(
        None,
        description="Why the item waits or failed: OutputBusy (another ConversionJob or ConversionBatch holds its output), "
        "SourceUnreadable, BudgetTooSmall, OOMKilled, ...",
    )
    message: str | None = None
    conversion_hash: str = Field(
        description="Hash of what the user wrote for this item's conversion; an edit that changes it re-runs the item."
    )
    attempts: int = Field(0, description="Runner attempts that ran this item (for this conversionHash).")
    attempt: int | None = Field(None, description="The batch attempt that last ran the item.")
    output_lease: str | None = Field(None, description="The output Lease this batch holds for the item while it runs.")
    converted_hash: str | None = Field(
        None,
        description="The conversionHash the item's output holds complete, until it runs again; a spec asking for it "
        "again runs nothing.",
    )
    completion_time: str | None = None
    progress: ProgressStatus | None = Field(None, description="Its slabs done, as the runner last reported them.")
    result: ResultSummary | None = None
    peak_rss_bytes: int | None = None
    predicted_peak_bytes: int | None = None


class ConversionBatchStatus(_Status):
    """The observed state of a ConversionBatch."""

    phase: Literal["Pending", "Running", "Succeeded", "Failed"] | None = None
    reason: str | None = Field(
        None, description="Why the batch failed as a whole: InvalidSpec, PolicyDenied; or ItemsFailed."
    )
    message: str | None = None
    total: int | None = Field(None, description="Items in the spec.")
    succeeded: int | None = None
    failed: int | None = None
    running: int | None = None
    pending: int | None = Field(None, description="Items waiting to run (OutputBusy ones included).")
    attempts: int | None = Field(
        None, description="Runner attempts started so far; each runs the items pending when it starts."
    )
    runner_job: str | None = Field(None, description="Name of the current (or last) attempt's runner Job.")
    runner_job_uid: str | None = None
    running_items: list[str] | None = Field(None, description="Ids of the items the current attempt runs.")
    start_time: str | None = None
    completion_time: str | None = None
    items: list[BatchItemStatus] | None = None
    item_reports: dict[str, ItemReport] | None = Field(
        None, description="Written by the runner: item id -> its report of the current attempt."
    )
    conditions: list[Condition] | None = None
    observed_generation: int | None = None
