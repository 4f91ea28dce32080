"""The phases of a conversion, named once: progress events, the metrics and the ConversionJob
status all use these (a ``StrEnum``, so each member is also its plain string in JSON, YAML and
Prometheus labels).

A run (``runner.run_job``) goes Pending -> Planned -> Writing -> Finalizing -> Succeeded or Failed.
A ConversionJob's ``.status.phase`` folds Writing and Finalizing into Running, which is what the
operator and ``kubectl get`` show.
"""

from __future__ import annotations

from enum import StrEnum


class Phase(StrEnum):
    PENDING = "Pending"
    PLANNED = "Planned"
    #: A run only: slab tasks are being written.
    WRITING = "Writing"
    #: A run only: the NGFF metadata and the completion marker are being written.
    FINALIZING = "Finalizing"
    #: A ConversionJob only: its runner is writing or finalizing.
    RUNNING = "Running"
    SUCCEEDED = "Succeeded"
    FAILED = "Failed"


#: A run's phases, in order (progress events; the ``h5ngff_job_phase`` metric's label values).
RUN_PHASES: tuple[Phase, ...] = (
    Phase.PENDING,
    Phase.PLANNED,
    Phase.WRITING,
    Phase.FINALIZING,
    Phase.SUCCEEDED,
    Phase.FAILED,
)
#: A ConversionJob's ``.status.phase`` values (the CRD's enum; ``h5ngff_operator_conversionjobs``).
JOB_PHASES: tuple[Phase, ...] = (Phase.PENDING, Phase.PLANNED, Phase.RUNNING, Phase.SUCCEEDED, Phase.FAILED)
#: Phases after which nothing changes until the spec does.
TERMINAL_PHASES: frozenset[Phase] = frozenset({Phase.SUCCEEDED, Phase.FAILED})
#: A run's phases in which slabs are being written or finished (the operator forwards progress).
WRITING_PHASES: frozenset[Phase] = frozenset({Phase.WRITING, Phase.FINALIZING})


class ItemState(StrEnum):
    """A batch item's state (docs/batch.md, "Outcomes"): waiting and running while the batch runs,
    then its outcome."""

    #: Waiting for its turn.
    PENDING = "Pending"
    RUNNING = "Running"
    #: Converted by this run.
    DONE = "Done"
    #: Finished by an earlier run: nothing to do.
    COMPLETE = "Complete"
    #: Stopped before it started: a bad file, a plan that does not fit, a busy or foreign output.
    REFUSED = "Refused"
    #: Started and failed; a re-run resumes it.
    FAILED = "Failed"
    #: A --fail-fast batch stopped before it.
    NOT_RUN = "NotRun"


#: Every item state, in order (the ``h5ngff_batch_items`` metric's label values).
ITEM_STATES: tuple[ItemState, ...] = tuple(ItemState)
#: Items still to do: a batch with one of these is expected to make progress.
ITEMS_TO_DO: frozenset[ItemState] = frozenset({ItemState.PENDING, ItemState.RUNNING})
#: The outcomes that count as converted.
ITEMS_CONVERTED: frozenset[ItemState] = frozenset({ItemState.DONE, ItemState.COMPLETE})
