"""``make_plan``: dataset facts + spec + capacity -> a frozen Plan, or a refusal that says why.

The plan is a sequence of passes. Pass 0 streams the HDF5 dataset in slabs and writes level 0
and as many pyramid levels as a slab can hold; each later pass streams the last written level and
builds the next ones. Slabs are as large as the memory budget allows, capped so that every
thread has work and no slab is absurdly large.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..errors import BudgetTooSmallError, SpecError, UnsupportedDatasetError
from ..spec import ConversionSpec
from ..units import MiB, format_bytes
from .grid import align_up, clip, grid_shape, greedy_slab, slab_step
from .layout import (
    build_levels,
    resolve_axes,
    resolve_chunks,
    resolve_downsampled,
    resolve_levels,
    resolve_scale_units,
)
from .memory import DEFAULT_CONSTANTS, MemoryConstants, PassShape, pass_terms, slab_output_bytes, worker_memory
from .model import Capacity, DatasetInfo, Pass, Plan, Shape, WorkerMemory

#: Above this a bigger slab reads no faster but holds more memory and leaves fewer tasks to
#: balance; a user's explicit ``slab`` may exceed it.
MAX_SLAB_BYTES = 512 * MiB
#: Without a budget, local workers share this fraction of the machine's memory; the rest is
#: for the client, the scheduler and the page cache.
LOCAL_MEMORY_FRACTION = 0.8
#: Workers for ``workers: auto`` where the capacity names no default (e.g. Kubernetes).
FALLBACK_WORKERS = 4
#: Elements of the float64 strip the mean accumulates at a time (8 MiB).
MEAN_STRIP_ELEMENTS = 1 << 20
#: Slabs per thread the planner aims for: the last slabs of a run leave cores idle for about half
#: a slab's time, so many smaller slabs finish evenly; 8 keeps that tail near 6% of the run.
SLABS_PER_THREAD = 8
#: ...but no slab below this: smaller reads and tasks start to cost more than they balance.
MIN_BALANCED_SLAB_BYTES = 16 * MiB
#: Tasks kept submitted per worker thread: one running and one ready, so no worker idles between
#: slabs while the client holds the rest.
INFLIGHT_PER_THREAD = 2


@dataclass(frozen=True)
class _Context:
    """What every pass of one plan shares."""

    ds: DatasetInfo
    unit: Shape
    chunks: Shape
    shards: Shape | None
    downsampled: tuple[bool, ...]
    threads: int
    total_threads: int
    budget: int | None
    allocator: str
    constants: MemoryConstants

    @property
    def itemsize(self) -> int:
        return self.ds.itemsize


def make_plan(
    ds: DatasetInfo,
    spec: ConversionSpec,
    capacity: Capacity,
    constants: MemoryConstants = DEFAULT_CONSTANTS,
    allocator: str = "jemalloc",
) -> Plan:
    """Plan a conversion. ``allocator`` is what the workers will run with (after ``auto``)."""
    _check_dataset(ds)
    axes = resolve_axes(spec, ds)
    scale, units = resolve_scale_units(spec, ds, axes)
    chunks, shards = resolve_chunks(spec, ds, axes)
    downsampled = resolve_downsampled(spec, axes)
    n_levels = resolve_levels(spec, ds.shape, chunks, downsampled)
    levels = build_levels(ds.shape, scale, downsampled, n_levels, spec.pyramid.method)
    threads = spec.resources.threads_per_worker
    notices: list[str] = []

    def plan_with(workers: int, budget: int | None) -> tuple[tuple[Pass, ...], WorkerMemory, int]:
        ctx = _Context(ds, shards or chunks, chunks, shards, downsampled, threads, workers * threads, budget, allocator, constants)
        return _plan_passes(ctx, [lv.shape for lv in levels], spec.resources.slab, notices)

    workers, budget = _workers_and_budget(spec, capacity, threads)
    if spec.resources.memory_total_bytes is not None and spec.resources.workers == "auto":
        passes, memory, cache, workers = _fit_total_budget(plan_with, workers, spec.resources.memory_total_bytes)
    else:
        passes, memory, cache = plan_with(workers, budget)
    return Plan(
        dataset=ds,
        axes=axes,
        units=units,
        dtype=ds.dtype,
        chunks=chunks,
        shards=shards,
        levels=levels,
        passes=passes,
        workers=workers,
        threads_per_worker=threads,
        inflight_per_worker=INFLIGHT_PER_THREAD * threads,
        memory=memory,
        hdf5_cache_bytes=cache,
        allocator=allocator,
        notices=tuple(dict.fromkeys(notices)),
    )


def _check_dataset(ds: DatasetInfo) -> None:
    if any(n == 0 for n in ds.shape):
        raise UnsupportedDatasetError(f"source.dataset: Expected every dimension to hold at least one element. Got shape {ds.shape} instead.")


def _workers_and_budget(spec: ConversionSpec, capacity: Capacity, threads: int) -> tuple[int, int | None]:
    r = spec.resources
    if r.workers == "auto":
        workers = max(1, capacity.cores // threads) if capacity.default_workers is None else capacity.default_workers
    else:
        workers = r.workers
    if r.memory_per_worker_bytes is not None:
        return workers, r.memory_per_worker_bytes
    if r.memory_total_bytes is not None:
        return workers, r.memory_total_bytes // workers
    if capacity.default_workers is None:
        return workers, int(capacity.memory_bytes * LOCAL_MEMORY_FRACTION) // workers
    return workers, None


def _fit_total_budget(plan_with, max_workers: int, total: int):
    """Most workers whose plans fit ``total`` together: parallelism beats bigger slabs."""
    last_error = None
    for workers in range(max_workers, 0, -1):
        try:
            passes, memory, cache = plan_with(workers, total // workers)
            return passes, memory, cache, workers
        except BudgetTooSmallError as exc:
            last_error = exc
    assert last_error is not None
    raise BudgetTooSmallError(
        f"resources.memoryTotal: {format_bytes(total)} cannot hold even one worker; it needs at least "
        f"{format_bytes(last_error.minimum_bytes)} (the smallest slab's pod limit). Raise memoryTotal, or use smaller output.chunks.",
        last_error.minimum_bytes,
    )


def _plan_passes(ctx: _Context, level_shapes: list[Shape], user_slab: list[int] | None, notices: list[str]) -> tuple[tuple[Pass, ...], WorkerMemory, int]:
    passes: list[Pass] = []
    memories: list[WorkerMemory] = []
    cache = 0
    source = -1  # the HDF5 dataset; later passes read the last level written
    top = len(level_shapes) - 1
    while source < top:
        src_shape = level_shapes[max(source, 0)]
        remaining = top - max(source, 0)
        p, mem, pass_cache = _plan_one_pass(ctx, len(passes), source, src_shape, remaining, user_slab if source == -1 else None, notices)
        passes.append(p)
        memories.append(mem)
        cache = max(cache, pass_cache)
        source = p.levels[-1]
    worst = max(memories, key=lambda m: (m.pod_limit, m.predicted_peak))
    return tuple(passes), worst, cache


def _plan_one_pass(ctx: _Context, index: int, source: int, src_shape: Shape, remaining: int, user_slab: list[int] | None, notices: list[str]):
    from_hdf5 = source == -1
    built_min = 0 if from_hdf5 else 1
    storage = ctx.ds.hdf5_chunks if from_hdf5 else None
    first_level = 0 if from_hdf5 else source + 1
    refusal: BudgetTooSmallError | None = None
    for built in range(remaining, built_min - 1, -1):
        for align_storage in ((True, False) if storage else (False,)):
            step = slab_step(ctx.unit, ctx.downsampled, built, storage if align_storage else None)
            min_slab = clip(step, src_shape)
            last_chance = built == built_min and not (align_storage and storage)
            if user_slab is None and not _acceptable(ctx, src_shape, min_slab, last_chance):
                continue
            fits = _fits(ctx, from_hdf5, built, not align_storage)
            if user_slab is not None:
                slab, realigned = _user_slab(user_slab, step, src_shape)
                if not last_chance and math.prod(grid_shape(src_shape, slab)) < min(ctx.total_threads, _most_slabs(user_slab, src_shape)):
                    continue
            elif not fits(min_slab):
                refusal = _smaller(refusal, _refusal(ctx, min_slab, from_hdf5, built))
                continue
            else:
                slab, realigned = greedy_slab(src_shape, step, fits, _max_elements(ctx, src_shape, min_slab)), None
            if not fits(slab):
                refusal = _smaller(refusal, _refusal(ctx, slab, from_hdf5, built, user=user_slab is not None))
                continue
            if realigned:
                notices.append(realigned)
            if storage and from_hdf5 and not align_storage:
                notices.append(
                    f"HDF5 chunks {ctx.ds.hdf5_chunks} do not fit whole in slabs under this budget; some are decompressed more than once. A larger memory budget avoids it."
                )
            shape = _pass_shape(ctx, slab, from_hdf5, built, not align_storage)
            terms = pass_terms(shape, ctx.allocator, ctx.constants)
            memory = worker_memory(terms, ctx.threads * slab_output_bytes(shape), ctx.constants)
            levels = tuple(range(first_level, first_level + built + (1 if from_hdf5 else 0)))
            return Pass(index, source, levels, slab, grid_shape(src_shape, slab), terms), memory, shape.hdf5_cache_bytes
    assert refusal is not None
    raise refusal


def _acceptable(ctx: _Context, src_shape: Shape, min_slab: Shape, last_chance: bool) -> bool:
    """Whether building ``built`` levels in this pass is worth trying before fewer levels."""
    if last_chance:
        return True
    slab_bytes = math.prod(min_slab) * ctx.itemsize
    if slab_bytes > MAX_SLAB_BYTES:
        return False
    # Fewer slabs than threads leaves cores idle; fewer levels per pass is cheaper than that.
    return math.prod(grid_shape(src_shape, min_slab)) >= ctx.total_threads


def _max_elements(ctx: _Context, src_shape: Shape, min_slab: Shape) -> int:
    balanced = max(math.prod(src_shape) // (SLABS_PER_THREAD * ctx.total_threads), MIN_BALANCED_SLAB_BYTES // ctx.itemsize)
    return max(math.prod(min_slab), min(MAX_SLAB_BYTES // ctx.itemsize, balanced))


def _user_slab(user_slab: list[int], step: Shape, src_shape: Shape) -> tuple[Shape, str | None]:
    if len(user_slab) != len(src_shape):
        raise SpecError("resources.slab", f"Expected {len(src_shape)} entries, one per axis. Got {user_slab} instead.")
    requested = clip(tuple(user_slab), src_shape)
    slab = align_up(requested, step, src_shape)
    if slab == requested:
        return slab, None
    return slab, (
        f"resources.slab {tuple(user_slab)} re-aligned to {slab} so that every output chunk or shard of "
        f"every level this pass builds has exactly one writer."
    )


def _most_slabs(user_slab: list[int], src_shape: Shape) -> int:
    return math.prod(grid_shape(src_shape, clip(tuple(user_slab), src_shape)))


def _pass_shape(ctx: _Context, slab: Shape, from_hdf5: bool, built: int, straddles: bool) -> PassShape:
    elements = math.prod(slab)
    reduction = 2 ** sum(ctx.downsampled)
    hdf5_chunks = ctx.ds.hdf5_chunks if from_hdf5 else None
    hdf5_chunk_bytes = math.prod(hdf5_chunks) * ctx.itemsize if hdf5_chunks else None
    cache = 0
    if hdf5_chunks and straddles:
        # Keep every HDF5 chunk a slab touches in the cache, so each is decompressed once per slab.
        touched = math.prod(-(-s // h) + 1 for s, h in zip(slab, hdf5_chunks))
        cache = touched * hdf5_chunk_bytes
    return PassShape(
        slab_elements=elements,
        itemsize=ctx.itemsize,
        threads=ctx.threads,
        chunk_bytes=math.prod(ctx.chunks) * ctx.itemsize,
        shard_bytes=math.prod(ctx.shards) * ctx.itemsize if ctx.shards else None,
        reduction=reduction,
        levels_built=built,
        strip_elements=min(elements // reduction, MEAN_STRIP_ELEMENTS) if built else 0,
        from_hdf5=from_hdf5,
        hdf5_chunk_bytes=hdf5_chunk_bytes,
        hdf5_filtered=bool(ctx.ds.hdf5_filters),
        hdf5_cache_bytes=cache,
    )


def _memory_for(ctx: _Context, slab: Shape, from_hdf5: bool, built: int, straddles: bool) -> WorkerMemory:
    shape = _pass_shape(ctx, slab, from_hdf5, built, straddles)
    terms = pass_terms(shape, ctx.allocator, ctx.constants)
    return worker_memory(terms, ctx.threads * slab_output_bytes(shape), ctx.constants)


def _fits(ctx: _Context, from_hdf5: bool, built: int, straddles: bool):
    def fits(slab: Shape) -> bool:
        return ctx.budget is None or _memory_for(ctx, slab, from_hdf5, built, straddles).pod_limit <= ctx.budget

    return fits


def _smaller(a: BudgetTooSmallError | None, b: BudgetTooSmallError) -> BudgetTooSmallError:
    """The refusal that asks for the least memory: the one worth quoting to the user."""
    return b if a is None or b.minimum_bytes < a.minimum_bytes else a


def _refusal(ctx: _Context, slab: Shape, from_hdf5: bool, built: int, user: bool = False) -> BudgetTooSmallError:
    need = _memory_for(ctx, slab, from_hdf5, built, straddles=False)
    what = f"your slab {slab}" if user else f"the smallest slab {slab}"
    knobs = "a smaller resources.slab (or none, to let the planner choose)" if user else "smaller output.chunks"
    if ctx.threads > 1:
        knobs += ", or fewer resources.threadsPerWorker"
    return BudgetTooSmallError(
        f"resources.memoryPerWorker: {format_bytes(ctx.budget or 0)} per worker is too small: {what} "
        f"({format_bytes(math.prod(slab) * ctx.itemsize)}) needs a pod limit of {format_bytes(need.pod_limit)} "
        f"(predicted worker peak {format_bytes(need.predicted_peak)}). Raise the budget to at least "
        f"{math.ceil(need.pod_limit / MiB)}Mi, or use {knobs}.",
        need.pod_limit,
    )
