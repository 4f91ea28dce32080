"""The slab task, the only code that runs inside Dask workers.

One task reads its slab once, writes every chunk or shard it owns (whole, exactly once), builds
the pyramid levels its pass asks for from the slab in memory, and returns a small record. No array
ever travels through Dask: a task's argument and result are a few hundred bytes.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

import numpy as np

from ...errors import H5ngffError
from .chunkio import ArrayLayout, read_region, write_block
from . import faults
from ..buffers import (
    done_serving,
    give_back_freed_memory,
    keep_levels,
    level_buffer,
    release_conversion,
    working_for,
)
from .downsample import downsample, output_shape
from .checksums import FileChecksums
from .manifest import SlabRecord
from ..sources.base import SlabSource, close_files_of
from ..stores import forget_stores, store_retries
from .window import SampledHistogram, histogram_key, write_histogram


@dataclass(frozen=True)
class SlabTask:
    pass_index: int
    slab: tuple[int, ...]
    #: The slab's region in the source's coordinates (HDF5, or the level ``source_level``).
    region: tuple[slice, ...]
    #: The source container's reader for the first pass; the layout of the level read for later passes.
    source: SlabSource | ArrayLayout
    #: Layouts of the levels to write, in order. The first pass writes the slab itself first.
    levels: tuple[ArrayLayout, ...]
    #: The axes each downsampling step of this task halves, in order: one tuple per level built
    #: from the one below (``len(levels) - 1`` for the first pass, ``len(levels)`` for later ones);
    #: the anisotropy rule may halve different axes at different steps (planner.layout.HalvingRule).
    steps: tuple[tuple[bool, ...], ...]
    method: str
    #: Axis of the channels for per-channel min/max, or None (one window for all).
    channel_axis: int | None
    #: Where the first pass writes each slab's sampled histogram (engine.write.window), or None: a key
    #: prefix in the output's store (the store of ``levels``).
    stats_dir: str | None = None
    #: PUTs kept in flight while the next unit is encoded, for an object-store output (the plan's
    #: ``upload_depth``; 0 writes synchronously).
    upload_depth: int = 0
    #: The conversion this slab belongs to (its output): a worker thread's buffers serve one
    #: conversion at a time (engine.buffers.working_for), and a batch ends them by this name.
    conversion: str = ""

    @property
    def key(self) -> str:
        return f"h5ngff-slab-p{self.pass_index}-" + ".".join(str(i) for i in self.slab)


@dataclass
class SlabResult:
    record: SlabRecord
    bytes_read: int
    bytes_written: int
    seconds: dict[str, float] = field(default_factory=dict)
    #: Requests to the object store that were retried (transient errors) while this slab ran.
    store_retries: int = 0


class _MinMax:
    """Running min/max per channel over finite values, fed one chunk at a time; with a
    ``histogram``, also the chunk's sample for the quantile window (engine.write.window)."""

    def __init__(self, channel_axis: int | None, histogram: SampledHistogram | None = None):
        self.channel_axis = channel_axis
        self.histogram = histogram
        self.low: dict[int, float] = {}
        self.high: dict[int, float] = {}

    def __call__(self, block: np.ndarray, unit: tuple[slice, ...]) -> None:
        if self.channel_axis is None:
            self._update(0, block)
            return
        start = unit[self.channel_axis].start
        before = (slice(None),) * self.channel_axis
        for i in range(block.shape[self.channel_axis]):
            self._update(start + i, block[before + (i,)])  # a view: np.take copied every chunk

    def _update(self, channel: int, data: np.ndarray) -> None:
        if self.histogram is not None:
            self.histogram.add(channel, data)
        if data.dtype.kind == "b":
            lo, hi = float(data.min()), float(data.max())
        else:
            lo, hi = data.min(), data.max()
            if data.dtype.kind == "f" and not (np.isfinite(lo) and np.isfinite(hi)):
                finite = data[np.isfinite(data)]  # rare: NaN or Inf present
                if not finite.size:
                    return
                lo, hi = finite.min(), finite.max()
            lo, hi = lo.item(), hi.item()
        self.low[channel] = min(self.low.get(channel, lo), lo)
        self.high[channel] = max(self.high.get(channel, hi), hi)

    def stats(self) -> list[tuple[int, float, float]]:
        return [(c, self.low[c], self.high[c]) for c in sorted(self.low)]


def end_of_conversion(conversion: str, keep: int = 0) -> None:
    """On each worker, once one of a batch's items has ended (none of its slabs runs any more),
    while the next items may already run: its slab and level buffers go, the HDF5 files (with
    their chunk caches) that no item still running reads, and its output's stores. The items
    after it then hold what their own plans count, not a larger item's buffers on top. An idle
    thread's slab buffer of at most ``keep`` bytes stays for the next item's slab
    (``engine.buffers.release_conversion``)."""
    release_conversion(conversion, keep)  # no gc.collect: buffers and files are freed by refcount, and
    close_files_of(conversion)  # a full collection costs a worker 20-30 ms per item
    forget_stores(conversion)  # the conversion is named by its output's path
    give_back_freed_memory()


def run_slab(task: SlabTask) -> SlabResult:
    """Read, write and downsample one slab. Runs in a Dask worker. A failed slab's error carries
    the store retries it made (``store_retries``): a failed run reports them too."""
    retries_before = store_retries.mine()
    working_for(task.conversion)
    try:
        return _run_slab(task, retries_before)
    except H5ngffError as exc:
        exc.store_retries = store_retries.mine() - retries_before
        raise
    finally:
        done_serving()


def _run_slab(task: SlabTask, retries_before: int) -> SlabResult:
    seconds = {"read": 0.0, "write": 0.0, "downsample": 0.0}
    t0 = time.perf_counter()
    if isinstance(task.source, SlabSource):
        block = task.source.read(task.region)
        first_factor = 1
    else:
        block = read_region(task.source, task.region)
        first_factor = 2
    seconds["read"] = time.perf_counter() - t0
    bytes_read = block.nbytes
    injected = faults.at_slab_start()

    units: list[tuple[int, str, int]] = []
    crcs = FileChecksums()
    histogram = SampledHistogram(task.levels[0].dtype) if task.stats_dir and task.levels[0].level == 0 else None
    minmax = _MinMax(task.channel_axis, histogram)
    bytes_written = 0
    factors = tuple(1 for _ in task.region)  # per axis, the source voxels of one voxel of this level
    step_iter = iter(task.steps)
    # Every PUT of the slab is stored (or the slab fails) when this block exits, before the record
    # that names its units is returned (engine.stores.uploads).
    with task.levels[0].store().overlapped(task.upload_depth):
        for i, layout in enumerate(task.levels):
            if i > 0 or first_factor == 2:
                t = time.perf_counter()
                depth = i if first_factor == 1 else i + 1
                step = next(step_iter)
                target = level_buffer(depth, output_shape(block.shape, step), block.dtype)
                block = downsample(block, step, task.method, out=target)
                seconds["downsample"] += time.perf_counter() - t
                factors = tuple(f * 2 if d else f for f, d in zip(factors, step))
            origin = tuple(r.start // f for r, f in zip(task.region, factors))
            t = time.perf_counter()
            stats = minmax if layout.level == 0 else None
            for key, nbytes in write_block(layout, block, origin, on_chunk=stats, on_file=crcs.on_file(layout)):
                units.append((layout.level, key, nbytes))
                bytes_written += nbytes
            seconds["write"] += time.perf_counter() - t
        del block, injected
        if histogram is not None and task.stats_dir is not None:
            write_histogram(
                task.levels[0].store(),
                histogram_key(task.stats_dir, task.pass_index, task.slab),
                histogram.mode,
                histogram.sparse(),
            )
        t = time.perf_counter()
    seconds["write"] += time.perf_counter() - t  # the wait for the last PUTs
    keep_levels(len(task.levels) if first_factor == 2 else len(task.levels) - 1)
    record = SlabRecord(task.pass_index, task.slab, units, minmax.stats(), crcs.entries)
    return SlabResult(record, bytes_read, bytes_written, seconds, store_retries=store_retries.mine() - retries_before)


def expected_units(task: SlabTask) -> dict[int, set[str]]:
    """The files a task will write, per level: what resume checks against the manifest."""
    expected: dict[int, set[str]] = {}
    steps = iter(task.steps)
    factors = tuple(1 for _ in task.region)
    for i, layout in enumerate(task.levels):
        if i > 0 or not isinstance(task.source, SlabSource):
            factors = tuple(f * 2 if d else f for f, d in zip(factors, next(steps)))
        region = tuple(slice(r.start // f, math.ceil(r.stop / f)) for r, f in zip(task.region, factors))
        expected[layout.level] = {layout.key(idx) for idx in layout.units_in(region)}
    return expected
