"""A batch's metrics: its items by state, its slabs done against planned, and when it last made
progress (docs/metrics.md, "Batches").

``BatchMetrics`` is fed by the batch's hooks (``batch.run.BatchHooks``: ``on_planned``, a listener
per item, ``on_item``) and by ``finished`` once the batch has returned. The batch layer sits above
this one, so nothing here imports it: the summary and item results are read through the few
attributes below (``Protocol``), and ``around`` wraps the caller's hooks object without naming
its class.

Progress is any step of the batch: an item's planning starting (``planning``), an item starting
or ending, or the running item finishing a slab or changing phase. The no-progress alert
(``H5ngffBatchNoProgress``) compares the last one with the clock while items are still to do.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Protocol, Sequence, TypeVar

from ..engine.progress import Listener, Progress
from ..phases import ItemState

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

log = logging.getLogger(__name__)

#: An item's state as exported (``phases.ItemState``): Pending and Running while the batch runs,
#: then its outcome. NotRun only once the batch has ended: a --fail-fast batch stopped before it.
PENDING, RUNNING, NOT_RUN = ItemState.PENDING, ItemState.RUNNING, ItemState.NOT_RUN


class ItemView(Protocol):
    """What is read of a ``batch.run.ItemResult``."""

    @property
    def status(self) -> str: ...

    @property
    def job(self) -> Any: ...  # a runner.PlannedJob, or None where the item was refused


class BatchView(Protocol):
    """What is read of a ``batch.run.BatchSummary``."""

    @property
    def results(self) -> Sequence[ItemView]: ...


@dataclass(frozen=True)
class BatchFigures:
    """What one scrape shows of the batch (immutable: the exporter copies its state under a lock)."""

    states: tuple[str, ...]
    #: Slab tasks per item, 0 until it is planned (and for a refused item).
    planned_slabs: tuple[int, ...]
    #: Slab tasks each item has finished, resumed ones included; never goes down.
    slabs_done: tuple[int, ...]
    last_progress: float
    #: Every item is planned (``on_planned`` has run): the planned slabs are the batch's.
    planned: bool = False


Hooks = TypeVar("Hooks", bound="DataclassInstance")
Item = TypeVar("Item")
Spec = TypeVar("Spec")


class BatchMetrics:
    """One batch's figures, published to its exporter's state after every change. Every entry
    point logs and swallows its own errors: a broken metric must not stop a batch."""

    def __init__(self, items: int, publish: Callable[[BatchFigures], None]):
        self._publish = publish
        self._lock = threading.Lock()
        self._states: list[str] = [PENDING] * items
        self._planned = [0] * items
        self._done = [0] * items
        self._index: dict[int, int] = {}  # id(ItemResult) -> position, from on_planned
        self._was_planned = False
        self._figures: BatchFigures | None = None
        self._update(lambda: True)  # the clock starts with the batch

    # -- the hooks --------------------------------------------------------------------------

    def planning(self, spec_for: Callable[[Item], Spec]) -> Callable[[Item], Spec]:
        """``spec_for`` (run_batch's), marking progress each time an item's planning starts: a
        batch of hundreds of files plans for a while before its first item runs."""

        def spec(item: Item) -> Spec:
            self._update(lambda: True)
            return spec_for(item)

        return spec

    def on_planned(self, summary: BatchView) -> None:
        def change() -> bool:
            self._index = {id(r): i for i, r in enumerate(summary.results)}
            for i, result in enumerate(summary.results):
                if result.status == NOT_RUN:  # to run: its slabs are the batch's to do
                    self._planned[i] = result.job.plan.n_tasks if result.job is not None else 0
                else:  # refused while planning (some keep a plan that did not fit the cluster)
                    self._states[i] = result.status
            self._was_planned = True
            return True

        self._update(change)

    def listener(self, result: ItemView) -> Listener:
        """The item's progress listener: Running from its first event; its slabs. A phase change
        or a finished slab is progress, as for one conversion."""
        seen: list[tuple[str, int]] = []

        def listen(progress: Progress) -> None:
            def change() -> bool:
                i = self._index[id(result)]
                if self._states[i] == PENDING:
                    self._states[i] = RUNNING
                self._planned[i] = progress.slabs_total or self._planned[i]
                self._done[i] = max(self._done[i], progress.slabs_done)
                step = (str(progress.phase), progress.slabs_done)
                moved = not seen or seen[-1] != step
                seen[:] = [step]
                return moved

            self._update(change)

        return listen

    def listeners(self, result: ItemView) -> list[Listener]:
        return [self.listener(result)]

    def on_item(self, result: ItemView) -> None:
        def change() -> bool:
            i = self._index[id(result)]
            self._states[i] = result.status
            if result.status == ItemState.COMPLETE:  # finished by an earlier run: every slab is done
                self._done[i] = max(self._done[i], self._planned[i])
            return True

        self._update(change)

    def finished(self, summary: BatchView) -> None:
        """The batch has returned: every item has its final state (NotRun where a --fail-fast
        batch stopped before it), so no item is left to do."""

        def change() -> bool:
            for i, result in enumerate(summary.results):
                self._states[i] = result.status
            return True

        self._update(change)

    def around(self, hooks: Hooks) -> Hooks:
        """The caller's ``BatchHooks`` with these metrics fed first: one call for the CLI and
        the operator's batch runner."""
        inner: Any = hooks

        def on_planned(summary: BatchView) -> None:
            self.on_planned(summary)
            inner.on_planned(summary)

        def listeners(result: ItemView) -> list[Listener]:
            return [*self.listeners(result), *inner.listeners(result)]

        def on_item(result: ItemView) -> None:
            self.on_item(result)
            inner.on_item(result)

        return dataclasses.replace(hooks, on_planned=on_planned, listeners=listeners, on_item=on_item)

    # -- publishing --------------------------------------------------------------------------

    def _update(self, change: Callable[[], bool]) -> None:
        """Apply ``change`` (True when it is progress) and publish the figures."""
        try:
            with self._lock:
                moved = change()
                last = time.time() if moved or self._figures is None else self._figures.last_progress
                self._figures = BatchFigures(
                    tuple(self._states), tuple(self._planned), tuple(self._done), last, self._was_planned
                )
                self._publish(self._figures)  # under the lock: figures reach the exporter in order
        except Exception:
            log.exception("batch metrics: an update failed")

    def figures(self) -> BatchFigures | None:
        with self._lock:
            return self._figures
