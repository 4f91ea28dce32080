"""``make_plan``: dataset facts + spec + capacity -> a frozen Plan, or a refusal that says why.

The plan is a sequence of passes. Pass 0 streams the HDF5 dataset in slabs and writes level 0
and as many pyramid levels as a slab can hold; each later pass streams the last written level and
builds the next ones. Slabs are as large as the memory budget allows, capped so that every
thread has work and no slab is absurdly large. Where other conversions share the cluster's threads
(a batch's items in flight), each plan fills only its share of them, and leaves its idle tail to
the others: small items then take one pass and one slab each, as a whole file read once.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, replace

from ..codecs_table import context as codec_context
from ..errors import BudgetTooSmallError, SpecError, UnsupportedDatasetError
from ..spec import UPLOADS_IN_FLIGHT, ConversionSpec, url_scheme
from ..units import MiB, format_bytes
from .grid import align_up, clip, grid_shape, greedy_slab, slab_step
from .layout import (
    build_levels,
    clipped_notices,
    resolve_axes,
    resolve_chunks,
    Steps,
    halving_rule,
    resolve_levels,
    resolve_scale_units,
    step_reduction,
)
from .memory import (
    DEFAULT_CONSTANTS,
    STRIP_ELEMENTS,
    MemoryConstants,
    PassShape,
    pass_terms,
    slab_output_bytes,
    upload_depth,
    worker_memory,
)
from .model import Capacity, DatasetInfo, MemoryTerm, Pass, Plan, Shape, WorkerMemory

#: Above this a bigger slab reads no faster but holds more memory and leaves fewer tasks to
#: balance; a user's explicit ``slab`` may exceed it.
MAX_SLAB_BYTES = 512 * MiB
#: Without a budget, local workers share this fraction of the machine's memory; the rest is
#: for the client, the scheduler and the page cache.
LOCAL_MEMORY_FRACTION = 0.8
#: Slabs per thread the planner aims for: the last slabs of a run leave cores idle for about half
#: a slab's time, so many smaller slabs finish evenly; 8 keeps that tail near 6% of the run.
SLABS_PER_THREAD = 8
#: ...but no slab below this: smaller reads and tasks start to cost more than they balance.
MIN_BALANCED_SLAB_BYTES = 16 * MiB
#: A slab of whole rows this size already reads and converts at full speed: on the 4.5 GB
#: reference case, slabs of 33, 66, 132 and 263 MB all converted in 30-34 s, within the
#: machine's noise (docs/benchmarks.md), while a worker's memory grows with the slab. So the
#: planner stops growing slabs here unless the pyramid's alignment needs more; ``resources.slab``
#: still takes any size the budget allows.
TARGET_SLAB_BYTES = 64 * MiB
#: Re-plans with a lowered budget when the passes together overshoot it (see ``_plan_worker``).
MAX_REPLANS = 8
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
    #: ``steps[k]``: the axes halved from level k to level k+1 (layout.HalvingRule).
    steps: Steps
    threads: int
    total_threads: int
    budget: int | None
    allocator: str
    constants: MemoryConstants
    #: The output codec is zstd (inside blosc or plain), whose compression context is large.
    zstd: bool = False
    #: The output is an object store (s3://): units are buffered whole and PUT (engine.stores).
    object_store: bool = False
    #: PUTs each thread keeps in flight (object stores; upload_depth_for).
    upload_depth: int = 0
    #: Conversions that share the cluster's threads at once (a batch's items in flight).
    at_once: int = 1

    @property
    def fill_threads(self) -> int:
        """The threads this conversion must keep busy: all of them alone, else its share."""
        return -(-self.total_threads // self.at_once)

    @property
    def itemsize(self) -> int:
        return self.ds.itemsize


def make_plan(
    ds: DatasetInfo,
    spec: ConversionSpec,
    capacity: Capacity,
    constants: MemoryConstants = DEFAULT_CONSTANTS,
    allocator: str = "jemalloc",
    at_once: int = 1,
) -> Plan:
    """Plan a conversion. ``allocator`` is what the workers will run with (after ``auto``).
    ``at_once``: conversions that will share the cluster's threads (a batch's items in flight)."""
    if at_once < 1:
        raise ValueError(f"at_once must be 1 or more, not {at_once}")
    _check_dataset(ds)
    axes = resolve_axes(spec, ds)
    scale, units = resolve_scale_units(spec, ds, axes)
    chunks, shards = resolve_chunks(spec, ds, axes)
    rule = halving_rule(spec, axes, scale)
    n_levels = resolve_levels(spec, ds.shape, chunks, rule)
    steps = rule.steps(n_levels - 1)
    levels = build_levels(ds.shape, scale, steps, spec.pyramid.method)
    threads = spec.resources.threads_per_worker
    depth = upload_depth_for(spec, math.prod(shards or chunks) * ds.itemsize)

    def plan_with(workers: int, budget: int | None) -> _Attempt:
        ctx = _Context(
            ds,
            shards or chunks,
            chunks,
            shards,
            steps,
            threads,
            workers * threads,
            budget,
            allocator,
            constants,
            _uses_zstd(spec),
            url_scheme(spec.output.path) is not None,
            depth,
            at_once,
        )
        return _plan_worker(ctx, [lv.shape for lv in levels], spec.resources.slab)

    workers, budget = _workers_and_budget(spec, capacity, threads)
    # With ``workers: auto`` a total budget is shared by as many workers as it can hold.
    auto_total = spec.resources.memory_total_bytes if spec.resources.workers == "auto" else None

    def fit() -> tuple[_Attempt, int]:
        if auto_total is not None:
            return _fit_total_budget(plan_with, workers, auto_total)
        return plan_with(workers, budget), workers

    try:
        try:
            (passes, memory, cache, notices), workers = fit()
        except _NoSlabFits:
            # Overlapped uploads are a speed-up, not a need: where the planner chose them and the
            # budget cannot hold them, upload one unit at a time (as a directory is written).
            if not depth or spec.output.uploads_in_flight is not None:
                raise
            wanted, depth = depth, 0
            (passes, memory, cache, notices), workers = fit()
            notices.append(
                f"uploads: one PUT at a time per thread: the memory budget cannot also hold {wanted} uploads in flight, "
                f"which hide the store's round trips; raise the budget to overlap them."
            )
    except _NoSlabFits as exc:
        tried = 1 if auto_total is not None else workers
        raise _budget_refusal(
            exc, plan_with, spec, capacity, tried, auto_total if auto_total is not None else budget
        ) from None
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
        notices=tuple(dict.fromkeys(list(ds.notices) + clipped_notices(spec, ds, chunks, shards) + notices)),
        upload_depth=depth,
    )


def upload_depth_for(spec: ConversionSpec, unit_bytes: int) -> int:
    """PUTs each worker thread keeps in flight: none for a directory; for a bucket, the
    ``uploads_in_flight`` storage option, else the planner's choice for the unit's size."""
    if url_scheme(spec.output.path) is None:
        return 0
    chosen = spec.output.uploads_in_flight
    return chosen if chosen is not None else upload_depth(unit_bytes)


def _uses_zstd(spec: ConversionSpec) -> bool:
    """Whether the encoder keeps a zstd context per thread (the codec table's memory term)."""
    c = spec.output.compressor
    return codec_context(c.codec, c.blosc_cname) == "zstd"


def _check_dataset(ds: DatasetInfo) -> None:
    if any(n == 0 for n in ds.shape):
        raise UnsupportedDatasetError(
            f"source.dataset: Expected every dimension to hold at least one element. Got shape {ds.shape} instead."
        )


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


_Attempt = tuple[tuple[Pass, ...], WorkerMemory, int, list[str]]
_PlanWith = Callable[[int, "int | None"], _Attempt]
_Fits = Callable[[Shape], bool]


class _NoSlabFits(BudgetTooSmallError):
    """One attempt's refusal: what did not fit and which knobs would shrink it. ``make_plan``
    turns it into the public BudgetTooSmallError that names the user's budget field."""

    def __init__(self, what: str, minimum_bytes: int, knobs: list[str]):
        self.what = what
        self.knobs = knobs
        super().__init__(what, minimum_bytes)


def _fit_total_budget(plan_with: _PlanWith, max_workers: int, total: int) -> tuple[_Attempt, int]:
    """Most workers whose plans fit ``total`` together: parallelism beats bigger slabs."""
    for workers in range(max_workers, 1, -1):
        try:
            return plan_with(workers, total // workers), workers
        except BudgetTooSmallError:
            pass
    return plan_with(1, total), 1


def _smallest_budget(works: Callable[[int], bool], failed: int, hint: int) -> int:
    """The smallest whole-MiB per-worker budget that plans, above one that did not.

    ``hint`` (the smallest candidate slab's pod limit) is not always it: with more budget an
    earlier pass may build more levels and change what the later passes need, so search. Pod limits
    are whole MiB, so a budget behaves like its whole-MiB floor."""
    lo = failed // MiB
    hi = max(math.ceil(hint / MiB), lo + 1)
    while not works(hi * MiB):
        lo, hi = hi, hi * 2
        if hi > 1 << 40:  # no budget plans: report the hint rather than search forever
            return hint
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if works(mid * MiB) else (mid, hi)
    return hi * MiB


def _budget_refusal(
    exc: _NoSlabFits, plan_with: _PlanWith, spec: ConversionSpec, capacity: Capacity, workers: int, budget: int | None
) -> BudgetTooSmallError:
    """The refusal a user sees: the smallest budget that really plans, in the field they set."""

    def works(per_worker: int) -> bool:
        try:
            plan_with(workers, per_worker)
        except BudgetTooSmallError:
            return False
        return True

    # A refusal needs a budget to refuse against: without one every slab fits.
    assert budget is not None
    per_worker = _smallest_budget(works, budget, exc.minimum_bytes)
    r = spec.resources
    knobs = list(exc.knobs)
    if spec.output.uploads_in_flight:
        knobs.append(
            f"a smaller output.storageOptions.{UPLOADS_IN_FLIGHT} (each upload in flight holds a chunk or shard)"
        )
    if r.memory_total_bytes is not None:
        field, minimum = "resources.memoryTotal", workers * per_worker
        if r.workers == "auto":
            given = f"{format_bytes(r.memory_total_bytes)} cannot hold even one worker"
        else:
            given = (
                f"{format_bytes(r.memory_total_bytes)} for {workers} workers ({format_bytes(budget)} each) is too small"
            )
            knobs.insert(0, "fewer resources.workers (or 'auto', to let the planner choose)")
    elif r.memory_per_worker_bytes is not None:
        field, minimum = "resources.memoryPerWorker", per_worker
        given = f"{format_bytes(budget)} per worker is too small"
    else:
        field, minimum = "resources.memoryPerWorker", per_worker
        given = (
            f"the default budget ({LOCAL_MEMORY_FRACTION:.0%} of this machine's {format_bytes(capacity.memory_bytes)} "
            f"shared by {workers} workers, {format_bytes(budget)} each) is too small"
        )
        knobs.insert(0, "fewer resources.workers")
    advice = "".join(f", or use {k}" for k in knobs)
    each = f" ({per_worker // MiB}Mi per worker)" if r.memory_total_bytes is not None and workers > 1 else ""
    return BudgetTooSmallError(
        f"{field}: {given}: {exc.what}. Raise {field} to at least {minimum // MiB}Mi{each}{advice}.", minimum
    )


def _plan_worker(ctx: _Context, level_shapes: list[Shape], user_slab: list[int] | None) -> _Attempt:
    """All passes under one worker configuration, whose pod must fit the budget as a whole.

    Each pass is fitted to the budget alone, but one worker serves them all: its memory_limit must
    cover the highest peak and its pod the largest page cache, which can come from different passes.
    Where that overshoots, plan the passes again under a budget lowered by the overshoot."""
    budget = ctx.budget
    memory: WorkerMemory | None = None
    for _ in range(MAX_REPLANS):
        # Notices belong to one attempt: a failed attempt (another worker count or budget) must
        # not leave its re-alignment or HDF5 notice on the plan that is finally chosen.
        notices: list[str] = []
        passes, memory, cache = _plan_passes(ctx, level_shapes, user_slab, notices)
        if budget is None or ctx.budget is None or memory.pod_limit <= budget:
            return passes, memory, cache, notices
        ctx = replace(ctx, budget=ctx.budget - (memory.pod_limit - budget))
    assert memory is not None  # MAX_REPLANS > 0
    raise _NoSlabFits(f"the passes together need a pod limit of {format_bytes(memory.pod_limit)}", memory.pod_limit, [])


def _plan_passes(
    ctx: _Context, level_shapes: list[Shape], user_slab: list[int] | None, notices: list[str]
) -> tuple[tuple[Pass, ...], WorkerMemory, int]:
    passes: list[Pass] = []
    peaks: list[tuple[tuple[MemoryTerm, ...], int]] = []  # (terms, bytes written per wave) of each pass
    cache = 0
    source = -1  # the HDF5 dataset; later passes read the last level written
    top = len(level_shapes) - 1
    while source < top:
        src_shape = level_shapes[max(source, 0)]
        remaining = top - max(source, 0)
        p, written, pass_cache = _plan_one_pass(
            ctx, len(passes), source, src_shape, remaining, user_slab if source == -1 else None, notices
        )
        passes.append(p)
        peaks.append((p.terms, written))
        cache = max(cache, pass_cache)
        source = p.levels[-1]
    # The worker's terms are those of the pass that peaks highest; its page cache headroom is that
    # of the pass that writes most per wave.
    highest = max(passes, key=lambda p: p.predicted_peak)
    memory = worker_memory(highest.terms, max(w for _, w in peaks), ctx.constants)
    return tuple(passes), memory, cache


def _plan_one_pass(
    ctx: _Context,
    index: int,
    source: int,
    src_shape: Shape,
    remaining: int,
    user_slab: list[int] | None,
    notices: list[str],
) -> tuple[Pass, int, int]:
    from_hdf5 = source == -1
    built_min = 0 if from_hdf5 else 1
    storage = ctx.ds.hdf5_chunks if from_hdf5 else None
    first_level = 0 if from_hdf5 else source + 1
    base = max(source, 0)  # the level the pass reads (level 0 for the HDF5 source)
    refusal: _NoSlabFits | None = None
    unaligned_because = "budget"
    for built in range(remaining, built_min - 1, -1):
        for align_storage in (True, False) if storage else (False,):
            step = slab_step(ctx.unit, ctx.steps[base : base + built], storage if align_storage else None)
            min_slab = clip(step, src_shape)
            last_chance = built == built_min and not (align_storage and storage)
            # Past the size cap, whole HDF5 chunks still beat a slab that cuts them, which must
            # cache every chunk it touches; the cap only stops extra levels from growing slabs.
            size_cap = not (built == built_min and align_storage and storage)
            if user_slab is None and not _acceptable(
                ctx, src_shape, min_slab, last_chance, size_cap, _slabs_wanted(ctx, built, from_hdf5)
            ):
                unaligned_because = "shape" if align_storage else unaligned_because
                continue
            fits = _fits(ctx, from_hdf5, base, built, not align_storage)
            if user_slab is not None:
                slab, realigned = _user_slab(user_slab, step, src_shape)
                # All the threads, even beside other items: a slab re-aligned up for more levels
                # is larger than the one asked for, so only parallelism may justify it.
                if not last_chance and math.prod(grid_shape(src_shape, slab)) < min(
                    ctx.total_threads, _most_slabs(user_slab, src_shape)
                ):
                    unaligned_because = "shape" if align_storage else unaligned_because
                    continue
            elif not fits(min_slab):
                refusal = _smaller(refusal, _refusal(ctx, min_slab, from_hdf5, base, built, not align_storage))
                continue
            else:
                target = min_slab
                if from_hdf5 and storage is None:
                    rows = _whole_rows(
                        ctx, src_shape, min_slab, fits, last_chance, _slabs_wanted(ctx, built, from_hdf5)
                    )
                    if rows is None and not last_chance:
                        continue  # fewer levels in this pass keep the reads in whole rows
                    target = rows or min_slab
                limit = max(_max_elements(ctx, src_shape, min_slab), math.prod(target))
                slab, realigned = greedy_slab(src_shape, step, fits, limit), None
            if not fits(slab):
                refusal = _smaller(
                    refusal, _refusal(ctx, slab, from_hdf5, base, built, not align_storage, user=user_slab is not None)
                )
                continue
            if realigned:
                notices.append(realigned)
            # A slab chosen without HDF5 alignment may still be whole HDF5 chunks (e.g. the whole
            # array): then it cuts none, needs no chunk cache and deserves no notice.
            straddles = (
                storage is not None
                and not align_storage
                and any(s % h and s != n for s, h, n in zip(slab, storage, src_shape))
            )
            if straddles:
                notices.append(_unaligned_notice(ctx, unaligned_because))
            shape = _pass_shape(ctx, slab, from_hdf5, base, built, straddles)
            terms = pass_terms(shape, ctx.allocator, ctx.constants)
            levels = tuple(range(first_level, first_level + built + (1 if from_hdf5 else 0)))
            written = ctx.threads * slab_output_bytes(shape)
            return (
                Pass(index, source, levels, slab, grid_shape(src_shape, slab), terms),
                written,
                shape.hdf5_cache_bytes,
            )
    assert refusal is not None
    raise refusal


def _slabs_wanted(ctx: _Context, built: int, from_hdf5: bool) -> int:
    """Slabs a pass should have before it builds ``built`` levels rather than fewer.

    Leaving a level to a later pass costs re-reading the level below it. For the first level
    built from HDF5 that is the whole volume again, so any pass that keeps every thread busy is
    worth it. For deeper levels the re-read is 1/8 of that or less, cheaper than the idle tail of
    a pass with few, large slabs, so those need the planner's full share of slabs per thread.

    Where other conversions run beside this one, a pass's idle tail is theirs to fill: filling its
    share of the threads is enough for every level, and each level re-read (a pass, its tasks and
    the decode of what was just encoded) is work saved (docs/batch.md, "One pass per item")."""
    if ctx.at_once > 1 or (from_hdf5 and built <= 1):
        return ctx.fill_threads
    return SLABS_PER_THREAD * ctx.fill_threads


def _acceptable(
    ctx: _Context, src_shape: Shape, min_slab: Shape, last_chance: bool, size_cap: bool = True, wanted: int = 1
) -> bool:
    """Whether building ``built`` levels in this pass is worth trying before fewer levels."""
    if last_chance:
        return True
    slab_bytes = math.prod(min_slab) * ctx.itemsize
    if size_cap and slab_bytes > MAX_SLAB_BYTES:
        return False
    return math.prod(grid_shape(src_shape, min_slab)) >= wanted


def _whole_rows(
    ctx: _Context, src_shape: Shape, min_slab: Shape, fits: _Fits, last_chance: bool, wanted: int
) -> Shape | None:
    """The smallest slab that spans whole rows of a contiguous dataset, if it is worth it.

    Contiguous HDF5 is stored row after row: a slab cut inside the last axis reads thousands of
    short runs (one pread each; 1 KiB runs made the read stage 3x slower in our benchmark) and
    extracts chunks from scattered memory. Whole rows are worth fewer levels per pass, but not a
    cluster left idle: they need ``wanted`` slabs (any number on the last chance) and must fit the budget and the size cap."""
    rows = min_slab[:-1] + (src_shape[-1],)
    if rows == min_slab:
        return rows
    if math.prod(rows) * ctx.itemsize > MAX_SLAB_BYTES or not fits(rows):
        return None
    enough = math.prod(grid_shape(src_shape, rows)) >= wanted
    return rows if enough or last_chance else None


def _max_elements(ctx: _Context, src_shape: Shape, min_slab: Shape) -> int:
    balanced = min(math.prod(src_shape) // (SLABS_PER_THREAD * ctx.fill_threads), TARGET_SLAB_BYTES // ctx.itemsize)
    balanced = max(balanced, MIN_BALANCED_SLAB_BYTES // ctx.itemsize)
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


def _pass_shape(ctx: _Context, slab: Shape, from_hdf5: bool, base: int, built: int, straddles: bool) -> PassShape:
    """The pass that reads level ``base`` (0 for the HDF5 source) and builds ``built`` levels
    above it, each step with its own reduction (4 for a step that halves only y and x)."""
    elements = math.prod(slab)
    reductions = tuple(step_reduction(s) for s in ctx.steps[base : base + built])
    hdf5_chunks = ctx.ds.hdf5_chunks if from_hdf5 else None
    hdf5_chunk_bytes = math.prod(hdf5_chunks) * ctx.itemsize if hdf5_chunks else None
    cache = 0
    remote = from_hdf5 and ctx.ds.remote_request_bytes > 0
    span = _remote_span_bytes(ctx, slab) if remote else 0
    # A bucket source's chunks are fetched and decoded one by one (engine.sources.ranged): no cache.
    direct = from_hdf5 and (ctx.ds.hdf5_direct_read or remote)
    # The direct-chunk path (engine.sources.inflate) reads every chunk a slab touches once per slab without
    # HDF5's chunk cache, so it needs none; HDF5's own filter path keeps them in the cache.
    if hdf5_chunks and straddles and not direct:
        # Keep every HDF5 chunk a slab touches in the cache, so each is decompressed once per slab.
        touched = math.prod(_chunks_touched(s, h, n) for s, h, n in zip(slab, hdf5_chunks, ctx.ds.shape))
        cache = touched * math.prod(hdf5_chunks) * ctx.itemsize
    return PassShape(
        slab_elements=elements,
        itemsize=ctx.itemsize,
        threads=ctx.threads,
        chunk_bytes=math.prod(ctx.chunks) * ctx.itemsize,
        shard_bytes=math.prod(ctx.shards) * ctx.itemsize if ctx.shards else None,
        reductions=reductions,
        strip_elements=min(elements // reductions[0], STRIP_ELEMENTS) if built else 0,
        from_hdf5=from_hdf5,
        hdf5_chunk_bytes=hdf5_chunk_bytes,
        hdf5_filtered=bool(ctx.ds.hdf5_filters),
        hdf5_cache_bytes=cache,
        zstd=ctx.zstd,
        object_store=ctx.object_store,
        upload_depth=ctx.upload_depth,
        hdf5_direct=direct,
        open_files=min(ctx.threads, ctx.ds.source_files) if from_hdf5 else 1,
        remote_in_flight=ctx.ds.remote_in_flight if remote else 0,
        remote_request_bytes=max(ctx.ds.remote_stored_chunk_bytes, min(ctx.ds.remote_request_bytes, span))
        if remote
        else 0,
        remote_span_bytes=span,
    )


def _remote_span_bytes(ctx: _Context, slab: Shape) -> int:
    """The most bytes one slab's ranged GETs bring together (engine.sources.ranged): its chunks,
    each at most the largest stored chunk, with a coalescing gap after each; or its run of a
    contiguous dataset. A small slab is not priced as 8 MiB requests."""
    ds = ctx.ds
    gap = ds.remote_gap_bytes
    if ds.hdf5_chunks:
        touched = math.prod(_chunks_touched(s, h, n) for s, h, n in zip(slab, ds.hdf5_chunks, ds.shape))
        return touched * (ds.remote_stored_chunk_bytes + gap)
    return math.prod(slab) * ctx.itemsize + gap


def _chunks_touched(slab: int, chunk: int, size: int) -> int:
    """The most HDF5 chunks one slab touches along an axis. Slabs start on multiples of their
    extent, so a slab that is a multiple of the chunk touches exactly slab/chunk; otherwise one
    more where it straddles a boundary; never more than the axis holds."""
    exact = slab // chunk if slab % chunk == 0 else -(-slab // chunk) + 1
    return min(exact, -(-size // chunk))


def _memory_for(ctx: _Context, slab: Shape, from_hdf5: bool, base: int, built: int, straddles: bool) -> WorkerMemory:
    shape = _pass_shape(ctx, slab, from_hdf5, base, built, straddles)
    terms = pass_terms(shape, ctx.allocator, ctx.constants)
    return worker_memory(terms, ctx.threads * slab_output_bytes(shape), ctx.constants)


def _fits(ctx: _Context, from_hdf5: bool, base: int, built: int, straddles: bool) -> _Fits:
    def fits(slab: Shape) -> bool:
        return ctx.budget is None or _memory_for(ctx, slab, from_hdf5, base, built, straddles).pod_limit <= ctx.budget

    return fits


def _smaller(a: _NoSlabFits | None, b: _NoSlabFits) -> _NoSlabFits:
    """The refusal that asks for the least memory: the one worth quoting to the user."""
    return b if a is None or b.minimum_bytes < a.minimum_bytes else a


def _refusal(
    ctx: _Context, slab: Shape, from_hdf5: bool, base: int, built: int, straddles: bool, user: bool = False
) -> _NoSlabFits:
    # Price the slab exactly as it was tried: a slab that cuts HDF5 chunks also holds their cache.
    need = _memory_for(ctx, slab, from_hdf5, base, built, straddles)
    slab_bytes = math.prod(slab) * ctx.itemsize
    what = (
        f"{'your' if user else 'the smallest'} slab {slab} ({format_bytes(slab_bytes)}) needs a pod limit of "
        f"{format_bytes(need.pod_limit)} (predicted worker peak {format_bytes(need.predicted_peak)})"
    )
    knobs = []
    if user:
        knobs.append("a smaller resources.slab (or none, to let the planner choose)")
    # Smaller chunks or fewer threads only help where the slabs are a real part of the need; for
    # tiny slabs the fixed terms (interpreter, nanny, page cache floor) dominate.
    if ctx.threads * slab_bytes * 10 >= need.pod_limit:
        if not user:
            knobs.append("smaller output.chunks")
        if ctx.threads > 1:
            knobs.append("fewer resources.threadsPerWorker")
    return _NoSlabFits(what, need.pod_limit, knobs)


def _unaligned_notice(ctx: _Context, because: str) -> str:
    if because == "budget":
        why = "do not fit whole in slabs under this budget"
        fix = "A larger memory budget avoids it."
    else:
        why = f"are cut by the slabs: whole HDF5 chunks would make slabs above {format_bytes(MAX_SLAB_BYTES)} or fewer than the {ctx.fill_threads} threads"
        fix = "Fewer workers or threads, or HDF5 chunks closer to the output chunks, avoid it."
    return f"HDF5 chunks {ctx.ds.hdf5_chunks} {why}; some are decompressed more than once. {fix}"
