"""The client side of a conversion: turn passes into slab tasks, feed them to the cluster with a
bound on tasks in flight, record each finished slab in the manifest, then write the metadata."""

from __future__ import annotations

import io
import logging
import threading
import time
import uuid
from concurrent.futures import CancelledError
from dataclasses import dataclass, field, replace
from itertools import islice
from typing import Any, Callable, Iterable, Iterator, Protocol

from distributed import Client, Future, as_completed

from ...errors import H5ngffError, WorkersLostError
from ...phases import Phase
from ...planner.grid import grid_indices, region
from ...planner.layout import level_steps
from ...planner.model import Plan
from ...spec import ConversionSpec
from .output import Output, finish_output
from ..progress import Broadcast
from ..stores import open_object_reader, store_retries
from ..sources import slab_source
from .chunkio import ArrayLayout
from ..sources.base import SlabSource
from .tasks import SlabResult, SlabTask, expected_units, run_slab
from .manifest import MANIFEST_DIR
from . import faults
from .window import histogram_key, windows

log = logging.getLogger(__name__)


class Guard(Protocol):
    """The output lock's guard (``engine.write.lock.output_lock`` yields one): raises once the lock is
    lost (a bucket's lease not renewed in time), and calls back when that happens."""

    def check(self) -> None: ...

    def on_lost(self, callback: Callable[[], None]) -> Callable[[], None]: ...


@dataclass
class RunTotals:
    seconds: float = 0.0
    slabs_written: int = 0
    slabs_skipped: int = 0
    bytes_read: int = 0
    bytes_written: int = 0
    #: Object store requests retried after transient errors (engine.stores.base.retrying).
    store_retries: int = 0
    stage_seconds: dict[str, float] = field(default_factory=lambda: {"read": 0.0, "write": 0.0, "downsample": 0.0})


def build_tasks(
    plan: Plan, spec: ConversionSpec, output: Output, pass_index: int, reader: SlabSource | None = None
) -> Iterator[SlabTask]:
    """The pass's slab tasks. ``reader``: the source's reader from the planning inspection, where
    the caller has it (else the source is opened again here)."""
    p = plan.passes[pass_index]
    # The steps this pass builds: from the level it reads (0 for the HDF5 source) to its last.
    steps = level_steps(plan.levels)[max(p.source_level, 0) : p.levels[-1]]
    # The first pass reads the HDF5 source; later ones read a level an earlier pass wrote.
    source: SlabSource | ArrayLayout
    if p.source_level == -1:
        opened = reader if reader is not None else slab_source(spec, plan.hdf5_cache_bytes, open_object_reader)
        # Absolute, as the output's layouts are: a worker's working directory is its own.
        source = replace(opened.absolute(), cache_bytes=plan.hdf5_cache_bytes)
        src_shape = plan.dataset.shape
    else:
        source = output.layouts[p.source_level]
        src_shape = source.shape
    levels = tuple(output.layouts[k] for k in p.levels)
    channel_axis = plan.axes.index("c") if "c" in plan.axes else None
    stats_dir = histogram_dir(output) if p.source_level == -1 else None
    for index in grid_indices(p.grid):
        task_region = region(src_shape, p.slab, index)
        yield SlabTask(
            pass_index,
            index,
            task_region,
            source.for_region(task_region) if isinstance(source, SlabSource) else source,
            levels,
            steps,
            spec.pyramid.method,
            channel_axis,
            stats_dir,
            plan.upload_depth,
            spec.output.path,
        )


def histogram_dir(output: Output) -> str:
    """Per-slab histograms live beside the manifest and go with it when the output is finished
    (a key prefix in the output's store)."""
    return f"{MANIFEST_DIR}/hist"


def pending_tasks(tasks: Iterable[SlabTask], verified: dict[int, set[str]]) -> tuple[list[SlabTask], int]:
    """Tasks whose files are not all vouched for by the manifest, and how many were skipped."""
    todo, skipped = [], 0
    for task in tasks:
        if all(keys <= verified.get(level, set()) for level, keys in expected_units(task).items()):
            skipped += 1
        else:
            todo.append(task)
    return todo, skipped


def run_conversion(
    client: Client,
    plan: Plan,
    spec: ConversionSpec,
    output: Output,
    events: Broadcast,
    guard: Guard | None = None,
    reader: SlabSource | None = None,
) -> RunTotals:
    """Run every pass, then finish the output. Raises the first task error (after cancelling the rest).

    ``guard`` (engine.write.lock's): once the output's lock is lost the slabs are cancelled and its
    error raised; no slab is recorded after that."""
    totals = RunTotals()
    start = time.perf_counter()
    level_paths = {layout.level: layout.path for layout in output.layouts}
    verified = output.manifest.verified_units(level_paths) if output.resumed else {}
    passes = [pending_tasks(build_tasks(plan, spec, output, i, reader), verified) for i in range(len(plan.passes))]
    total = plan.n_tasks
    skipped = sum(s for _, s in passes)
    totals.slabs_skipped = skipped
    events.emit(
        phase=Phase.WRITING,
        slabs_total=total,
        slabs_done=skipped,
        slabs_skipped=skipped,
        passes=len(plan.passes),
        started=time.time(),
    )
    if skipped:
        log.info("Resume: %d of %d slab(s) are recorded and intact; %d to write.", skipped, total, total - skipped)
    driver_retries = store_retries.mine()  # the manifest's PUTs are this thread's
    try:
        _run_passes(client, plan, output, events, passes, totals, guard)
    except H5ngffError as exc:
        # A failed run's figures too (runner: exc.totals): the failed slab's retries and ours.
        totals.store_retries += exc.store_retries + store_retries.mine() - driver_retries
        totals.seconds = time.perf_counter() - start
        exc.totals = totals
        raise
    totals.store_retries += store_retries.mine() - driver_retries
    totals.seconds = time.perf_counter() - start
    return totals


def _run_passes(
    client: Client,
    plan: Plan,
    output: Output,
    events: Broadcast,
    passes: list[tuple[list[SlabTask], int]],
    totals: RunTotals,
    guard: Guard | None,
) -> None:
    token = uuid.uuid4().hex[:8]
    for pass_index, (todo, _) in enumerate(passes):
        events.emit(pass_index=pass_index)
        for result in _stream(client, todo, plan.inflight_total, token, guard):
            if guard is not None:
                guard.check()
            faults.crash_point("slab")
            output.manifest.append([result.record])
            _accumulate(totals, result)
            p = events.progress
            events.emit(
                slabs_done=p.slabs_done + 1,
                bytes_read=p.bytes_read + result.bytes_read,
                bytes_written=p.bytes_written + result.bytes_written,
                store_retries=p.store_retries + result.store_retries,
            )


def finish(output: Output, plan: Plan, spec: ConversionSpec, summary: dict[str, Any] | None = None) -> None:
    """Metadata and completion marker, last of all. ``summary`` (the run's figures) is not
    written into the image: it changes every run, and an output's objects must be the same bytes
    however it was written (uninterrupted or resumed). The --json summary carries it."""
    channels = plan.dataset.shape[plan.axes.index("c")] if "c" in plan.axes else 1
    faults.crash_point("finish")
    finish_output(output, plan, spec, list(channel_windows(output, channels)))  # a list of tuple[float, ...]


def channel_windows(output: Output, channels: int) -> list[tuple[float, float, float, float]]:
    """(min, max, start, end) per channel from the slabs the manifest records (engine.write.window)."""
    return windows(output.manifest.windows(channels), _histograms(output))


def _histograms(output: Output) -> Iterator[io.BytesIO]:
    """Each recorded slab's histogram, read from the output's store one at a time (thousands of
    slabs' counts are never held together)."""
    store = output.store()
    for record in output.manifest.records:
        if record.stats:
            key = histogram_key(histogram_dir(output), record.pass_index, record.slab)
            try:
                yield io.BytesIO(store.get(key))
            except KeyError:  # a manifest written before histograms existed: the window covers the rest
                log.warning(
                    "No histogram for slab %s (%s/%s); the window is taken from the other slabs.",
                    record.slab,
                    store.root,
                    key,
                )


def _accumulate(totals: RunTotals, result: SlabResult) -> None:
    totals.slabs_written += 1
    totals.bytes_read += result.bytes_read
    totals.bytes_written += result.bytes_written
    totals.store_retries += result.store_retries
    for stage, seconds in result.seconds.items():
        totals.stage_seconds[stage] = totals.stage_seconds.get(stage, 0.0) + seconds


#: With no worker at all for this long, the run fails instead of waiting forever: every worker
#: died (e.g. a whole pod was OOM-killed) and nothing brought one back.
NO_WORKERS_TIMEOUT = 60.0


class _NoWorkersWatchdog:
    """A background thread that notices a cluster which has lost every worker. When it trips it
    cancels the run's futures, which wakes the waiting client (no polling in the result loop)."""

    def __init__(self, client: Client, timeout: float, cancel: Callable[[], None]):
        self.client = client
        self.timeout = timeout
        self.cancel = cancel
        self.tripped = False
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="h5ngff-no-workers-watchdog", daemon=True)

    def __enter__(self) -> "_NoWorkersWatchdog":
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()

    def _watch(self) -> None:
        empty_since = None
        while not self._stop.wait(1.0):
            try:
                workers = len(self.client.scheduler_info(n_workers=-1)["workers"])
            except Exception:  # a busy scheduler is not a lost cluster
                continue
            if workers:
                empty_since = None
                continue
            empty_since = empty_since or time.monotonic()
            if time.monotonic() - empty_since > self.timeout:
                self.tripped = True
                self.cancel()
                return

    def error(self) -> WorkersLostError:
        return WorkersLostError(f"No Dask worker for {self.timeout:.0f} s: every worker died and none came back.")


def _stream(
    client: Client, tasks: list[SlabTask], inflight: int, token: str, guard: Guard | None = None
) -> Iterator[SlabResult]:
    """Yield results as tasks finish, keeping at most ``inflight`` submitted at any time.

    Submitting everything at once would let the scheduler hold thousands of tasks and decide the
    order; the bound keeps memory, ordering and cancellation in the client's hands.
    """
    queue = iter(tasks)

    def submit(task: SlabTask) -> Future[SlabResult]:
        future: Future[SlabResult] = client.submit(run_slab, task, key=f"{task.key}-{token}", pure=False)
        return future

    # distributed leaves as_completed, its add() and Client.cancel unannotated.
    futures = as_completed([submit(t) for t in islice(queue, inflight)], loop=client.loop, with_results=False)  # type: ignore[no-untyped-call]

    def cancel_all() -> None:
        client.cancel(list(futures.futures))  # type: ignore[no-untyped-call]

    forget = guard.on_lost(cancel_all) if guard is not None else (lambda: None)
    with _NoWorkersWatchdog(client, NO_WORKERS_TIMEOUT, cancel_all) as watchdog:
        try:
            for future in futures:
                if watchdog.tripped:
                    raise watchdog.error()
                result = future.result()
                future.release()
                following = next(queue, None)
                if following is not None:
                    futures.add(submit(following))  # type: ignore[no-untyped-call]
                yield result
        except CancelledError:
            if watchdog.tripped:
                raise watchdog.error() from None
            if guard is not None:
                guard.check()  # cancelled because the output's lease was lost: say so
            raise
        finally:
            forget()
            remaining = list(futures.futures)
            if remaining:
                client.cancel(remaining)  # type: ignore[no-untyped-call]
