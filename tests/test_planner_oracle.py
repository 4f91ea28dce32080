"""A brute-force oracle for plans, written without the planner's own geometry helpers.

``check_plan`` enumerates every slab of every pass and every output chunk or shard of every level,
and asserts the invariants issue 2 asks for. The tests in this module are its negative controls:
plans corrupted on purpose must be rejected, so a passing property test means something.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import re
from collections import Counter

import pytest

from h5ngff.engine.write.chunkio import ArrayLayout
from h5ngff.engine.write.chunkio import shard_index_bytes as engine_shard_index_bytes
from h5ngff.planner import DEFAULT_CONSTANTS, Capacity, DatasetInfo, Plan, make_plan
from h5ngff.spec import ConversionSpec, parse_spec
from h5ngff.units import MiB
from reference import expected_buffer_terms, halving_steps

SPATIAL = "zyx"
#: Above this many output units (summed over levels) the per-unit enumeration is skipped in favour
#: of the exact per-axis check; the property tests draw shapes that stay below it.
MAX_ENUMERATED_UNITS = 60_000


class OracleError(AssertionError):
    pass


def _fail(message: str) -> None:
    raise OracleError(message)


def downsampled_axes(spec: ConversionSpec, axes: str) -> tuple[bool, ...]:
    chosen = spec.pyramid.axes if spec.pyramid.axes is not None else SPATIAL
    return tuple(a in chosen and a in SPATIAL for a in axes)


def pyramid_steps(spec: ConversionSpec, axes: str, scale, n_steps: int) -> list[tuple[bool, ...]]:
    """The halving rule by brute force: per step, the physical voxel size of every spatial axis
    (level-0 size x 2**halvings so far); halve those more than 1e-6 (relative) finer than the
    coarsest, or all of them when none is. ``pyramid.axes`` overrides: those axes every step."""
    if spec.pyramid.axes is not None:
        return [downsampled_axes(spec, axes)] * n_steps
    return halving_steps(axes, scale, n_steps)


def _step(steps, k: int) -> tuple[bool, ...]:
    """Step ``k`` of a per-step list, or a single tuple of axes used for every step."""
    return tuple(steps[k]) if steps and isinstance(steps[0], (tuple, list)) else tuple(steps)


def _factors(steps, base: int, level: int, ndim: int) -> list[int]:
    """Per axis, how many voxels of level ``base`` one voxel of ``level`` covers."""
    f = [1] * ndim
    for k in range(base, level):
        f = [x * 2 if d else x for x, d in zip(f, _step(steps, k))]
    return f


def expected_level_shapes(shape, steps, n_levels):
    shapes = [tuple(shape)]
    for k in range(n_levels - 1):
        shapes.append(tuple((s + 1) // 2 if d else s for s, d in zip(shapes[-1], _step(steps, k))))
    return shapes


def useful_levels(shape, down, steps=None) -> int:
    """Levels until every downsampled axis is one voxel (the most a spec may ask for); ``steps``
    (a function of the step index) where the axes differ per step."""
    n, current = 1, tuple(shape)
    while any(d and s > 1 for s, d in zip(current, down)):
        step = steps(n - 1) if steps else down
        current = tuple((s + 1) // 2 if d else s for s, d in zip(current, step))
        n += 1
    return n


def axis_intervals(n: int, size: int) -> list[tuple[int, int]]:
    """Regular intervals of ``size`` from 0, the last cut at ``n``: how the engine walks a grid."""
    out, start = [], 0
    while start < n:
        out.append((start, min(start + size, n)))
        start += size
    return out


def slab_boxes(src_shape, slab):
    per_axis = [axis_intervals(n, s) for n, s in zip(src_shape, slab)]
    return itertools.product(*per_axis)


def check_level_transforms(plan: Plan, spec: ConversionSpec, down) -> None:
    """Each level's factors are the product of its steps' halvings; its scale is level 0's times
    them; mean and max move its origin by half a block ((factor - 1) / 2 level-0 voxels)."""
    scale0 = plan.levels[0].scale
    shift = 0.0 if spec.pyramid.method == "nearest" else 0.5
    for lv in plan.levels:
        factors = tuple(_factors(down, 0, lv.index, len(scale0)))
        if lv.factors != factors:
            _fail(f"level {lv.index}: factors {lv.factors}, the steps {down[: lv.index]} give {factors}")
        if not all(math.isclose(a, s * f) for a, s, f in zip(lv.scale, scale0, factors)):
            _fail(f"level {lv.index}: scale {lv.scale}, expected {scale0} x {factors}")
        if not all(
            math.isclose(t, shift * (f - 1) * s, abs_tol=1e-12) for t, s, f in zip(lv.translation, scale0, factors)
        ):
            _fail(f"level {lv.index}: translation {lv.translation} for factors {factors}")


def check_chain(plan: Plan) -> None:
    """Levels 0..n-1 are each written by exactly one pass, in order; each pass reads the last level
    the previous pass wrote (pass 0 reads the HDF5 source)."""
    written = [k for p in plan.passes for k in p.levels]
    if written != list(range(len(plan.levels))):
        _fail(f"passes write levels {written}, expected each of 0..{len(plan.levels) - 1} once, in order")
    if plan.passes[0].source_level != -1 or plan.passes[0].levels[0] != 0:
        _fail(f"pass 0 must read HDF5 and write level 0, got {plan.passes[0]}")
    for prev, p in zip(plan.passes, plan.passes[1:]):
        if p.source_level != prev.levels[-1] or p.levels[0] != p.source_level + 1:
            _fail(
                f"pass {p.index} reads level {p.source_level} and writes {p.levels}; pass {prev.index} wrote {prev.levels}"
            )
    if [p.index for p in plan.passes] != list(range(len(plan.passes))):
        _fail(f"pass indices {[p.index for p in plan.passes]}")


def check_tiling(src_shape, slab, grid) -> None:
    """Slabs tile the source: along every axis the intervals partition [0, n) (the slab set is
    their product, so this is exact), and every slab is non-empty and inside the array."""
    if len(slab) != len(src_shape) or any(s < 1 for s in slab):
        _fail(f"slab {slab} for source {src_shape}")
    for axis, (n, s, g) in enumerate(zip(src_shape, slab, grid)):
        iv = axis_intervals(n, s)
        if len(iv) != g:
            _fail(f"axis {axis}: grid says {g} slabs, {n} / {s} needs {len(iv)}")
        covered = 0
        for a, b in iv:
            if a != covered or not a < b <= n:
                _fail(f"axis {axis}: slab interval {(a, b)} after {covered} (gap or overlap)")
            covered = b
        if covered != n:
            _fail(f"axis {axis}: slabs cover {covered} of {n}")
    volume = (
        sum(math.prod(b - a for a, b in box) for box in slab_boxes(src_shape, slab))
        if math.prod(grid) <= 20_000
        else math.prod(src_shape)
    )
    if volume != math.prod(src_shape):
        _fail(f"slab volumes sum to {volume}, the source holds {math.prod(src_shape)}")


def check_alignment(p, src_shape, unit, down) -> None:
    """Slab starts sit on multiples of the step: unit x 2 per level built whose step halves the axis."""
    built = len(p.levels) - (1 if p.source_level == -1 else 0)
    base = max(p.source_level, 0)
    factors = _factors(down, base, base + built, len(src_shape))
    for axis, (n, s, u, fa) in enumerate(zip(src_shape, p.slab, unit, factors)):
        step = u * fa
        for a, _ in axis_intervals(n, s):
            if a % step:
                _fail(
                    f"pass {p.index} axis {axis}: slab starts at {a}, not a multiple of the step {step} (unit {u}, {built} level(s) built)"
                )


def unit_owners(p, level: int, level_shape, src_shape, unit, down) -> Counter:
    """For every slab, the output units (chunks or shards) of ``level`` it writes; a slab that
    writes only part of a unit is an error by itself (two writers would share the unit)."""
    base = 0 if p.source_level == -1 else p.source_level
    factors = _factors(down, base, level, len(src_shape))
    owners: Counter = Counter()
    for box in slab_boxes(src_shape, p.slab):
        ranges = []
        for axis, ((a, b), u, fa, lk) in enumerate(zip(box, unit, factors, level_shape)):
            if a % fa:
                _fail(f"pass {p.index}: slab start {a} on axis {axis} cannot be downsampled {fa}x to level {level}")
            lo, hi = a // fa, -(-b // fa)
            if hi > lk:
                _fail(f"pass {p.index}: slab {box} writes level {level} up to {hi} on axis {axis}; the level has {lk}")
            if lo % u or (hi % u and hi != lk):
                _fail(
                    f"pass {p.index}: slab {box} writes [{lo}, {hi}) of level {level} on axis {axis}, part of a unit of {u}"
                )
            ranges.append(range(lo // u, -(-hi // u)))
        owners.update(itertools.product(*ranges))
    return owners


def check_unit_ownership(plan: Plan, spec: ConversionSpec, src_shapes, down) -> None:
    unit = plan.shards or plan.chunks
    shapes = [lv.shape for lv in plan.levels]
    total_units = sum(math.prod(-(-n // u) for n, u in zip(s, unit)) for s in shapes)
    for p in plan.passes:
        src_shape = src_shapes[p.index]
        for level in p.levels:
            if total_units > MAX_ENUMERATED_UNITS:
                _check_units_per_axis(p, level, shapes[level], src_shape, unit, down)
                continue
            owners = unit_owners(p, level, shapes[level], src_shape, unit, down)
            every = set(itertools.product(*(range(-(-n // u)) for n, u in zip(shapes[level], unit))))
            missing = every - set(owners)
            if missing:
                _fail(f"level {level}: {len(missing)} unit(s) have no writer, e.g. {sorted(missing)[0]}")
            extra = set(owners) - every
            if extra:
                _fail(f"level {level}: writes outside the level, e.g. {sorted(extra)[0]}")
            shared = [u for u, n in owners.items() if n != 1]
            if shared:
                _fail(f"level {level}: unit {shared[0]} has {owners[shared[0]]} writers")


def _check_units_per_axis(p, level, level_shape, src_shape, unit, down) -> None:
    base = 0 if p.source_level == -1 else p.source_level
    factors = _factors(down, base, level, len(src_shape))
    for axis, (n, lk, u, fa) in enumerate(zip(src_shape, level_shape, unit, factors)):
        owners = Counter()
        for a, b in axis_intervals(n, p.slab[axis]):
            lo, hi = a // fa, -(-b // fa)
            if a % fa or lo % u or (hi % u and hi != lk) or hi > lk:
                _fail(f"pass {p.index} axis {axis}: slab [{a}, {b}) writes [{lo}, {hi}) of level {level}, units of {u}")
            owners.update(range(lo // u, -(-hi // u)))
        if sorted(owners) != list(range(-(-lk // u))) or any(v != 1 for v in owners.values()):
            _fail(f"pass {p.index} axis {axis}: level {level} units owned {dict(owners)}")


def check_memory(plan: Plan, spec: ConversionSpec, capacity: Capacity) -> None:
    m = plan.memory
    r = spec.resources
    if sum(t.bytes for t in m.terms) != m.predicted_peak:
        _fail(f"terms sum to {sum(t.bytes for t in m.terms)}, predicted_peak is {m.predicted_peak}")
    if any(t.bytes < 0 for t in m.terms):
        _fail(f"negative term in {m.terms}")
    for p in plan.passes:
        # One worker configuration serves every pass: none may peak above the planned fraction,
        # the room below Dask's terminate threshold that the plan promises.
        if p.predicted_peak > m.thresholds.planned * m.memory_limit:
            _fail(
                f"pass {p.index} peaks at {p.predicted_peak / MiB:.1f} MiB, above planned x memory_limit {m.thresholds.planned * m.memory_limit / MiB:.1f} MiB"
            )
    # Dask must stop a worker before the kernel does: its terminate threshold sits below the pod
    # limit, which holds it and more (memory_limit itself may exceed the pod on big plans: Dask
    # never lets a worker reach it).
    threshold = math.ceil((m.thresholds.terminate or 1.0) * m.memory_limit)
    if not threshold < m.pod_limit or threshold not in [t.bytes for t in m.pod_terms]:
        _fail(
            f"the terminate threshold {threshold} must be a pod term below the pod limit {m.pod_limit}: {m.pod_terms}"
        )
    if sum(t.bytes for t in m.pod_terms) > m.pod_limit:
        _fail(f"pod terms {m.pod_terms} exceed the pod limit {m.pod_limit}")
    if r.memory_per_worker_bytes is not None and m.pod_limit > r.memory_per_worker_bytes:
        _fail(f"pod limit {m.pod_limit} exceeds memoryPerWorker {r.memory_per_worker_bytes}")
    if r.memory_total_bytes is not None and plan.workers * m.pod_limit > r.memory_total_bytes:
        _fail(f"{plan.workers} x pod limit {m.pod_limit} exceeds memoryTotal {r.memory_total_bytes}")
    if r.memory_per_worker is None and r.memory_total is None and capacity.default_workers is None:
        if plan.workers * m.pod_limit > capacity.memory_bytes:
            _fail(f"{plan.workers} x pod limit {m.pod_limit} exceeds the machine's {capacity.memory_bytes}")


def check_memory_terms(plan: Plan, spec: ConversionSpec) -> None:
    """Every pass's buffer terms, recomputed from the plan's geometry and the formula documented
    in docs/memory-model.md (reference.expected_buffer_terms), and checked against the engine's own
    shard layout: a shard costs its index per thread, never its bytes (issue 18)."""
    constants = DEFAULT_CONSTANTS
    zstd = spec.output.compressor.codec == "zstd" or (
        spec.output.compressor.codec == "blosc" and spec.output.compressor.blosc_cname == "zstd"
    )
    down = pyramid_steps(spec, plan.axes, plan.levels[0].scale, len(plan.levels) - 1)
    for p in plan.passes:
        terms = {t.name: t.bytes for t in p.terms}
        if len(terms) != len(p.terms):
            _fail(f"pass {p.index}: duplicate term names in {[t.name for t in p.terms]}")
        expected = expected_buffer_terms(
            p, plan.chunks, plan.shards, plan.dataset.itemsize, plan.threads_per_worker, down, zstd, constants
        )
        for name, value in expected.items():
            if terms.get(name) != value:
                _fail(f"pass {p.index}: term {name!r} is {terms.get(name)}, the documented formula gives {value}")
        extra = set(terms) - set(expected) - {"interpreter", "hdf5 cache and decompression", "allocator slack"}
        if extra:
            _fail(f"pass {p.index}: unexpected term(s) {sorted(extra)}")
        if plan.shards:
            layout = ArrayLayout(
                "unused", plan.levels[0].shape, plan.chunks, plan.shards, plan.dtype, 3, spec.output.compressor
            )
            engine_index = plan.threads_per_worker * 2 * engine_shard_index_bytes(layout)
            if terms["shard assembly"] != engine_index:
                _fail(
                    f"pass {p.index}: shard assembly {terms['shard assembly']} B, the engine holds {engine_index} B of index per worker"
                )
        slack = constants.allocator_slack_jemalloc if plan.allocator == "jemalloc" else constants.allocator_slack_glibc
        dynamic = sum(v for k, v in terms.items() if k not in ("interpreter", "allocator slack"))
        if terms["allocator slack"] != math.ceil(slack * dynamic):
            _fail(f"pass {p.index}: allocator slack {terms['allocator slack']}, expected {math.ceil(slack * dynamic)}")


def check_notices(plan: Plan, ds: DatasetInfo) -> None:
    """Notices describe the plan that was chosen, not an attempt that was thrown away."""
    if sum("re-aligned" in n for n in plan.notices) > 1:
        _fail(f"more than one re-alignment notice: {plan.notices}")
    for notice in plan.notices:
        found = re.search(r"re-aligned to \(([0-9, ]+)\)", notice)
        if found:
            slab = tuple(int(v) for v in found.group(1).split(","))
            if slab != plan.passes[0].slab:
                _fail(f"notice names slab {slab}, the plan reads {plan.passes[0].slab}: {notice}")
    if ds.hdf5_chunks:
        slab = plan.passes[0].slab
        cuts = any(s % h and s != n for s, h, n in zip(slab, ds.hdf5_chunks, ds.shape))
        noticed = any("HDF5 chunks" in n for n in plan.notices)
        if cuts != noticed:
            _fail(
                f"slab {slab} {'cuts' if cuts else 'does not cut'} HDF5 chunks {ds.hdf5_chunks}, notices: {plan.notices}"
            )
    elif any("HDF5 chunks" in n for n in plan.notices):
        _fail(f"HDF5 notice for contiguous data: {plan.notices}")


def check_plan(plan: Plan, ds: DatasetInfo, spec: ConversionSpec, capacity: Capacity) -> None:
    """Every invariant of issue 2 that a single plan must satisfy."""
    down = pyramid_steps(spec, plan.axes, plan.levels[0].scale, len(plan.levels) - 1)
    shapes = expected_level_shapes(ds.shape, down, len(plan.levels))
    if [lv.shape for lv in plan.levels] != shapes:
        _fail(f"level shapes {[lv.shape for lv in plan.levels]}, expected {shapes}")
    check_level_transforms(plan, spec, down)
    if isinstance(spec.pyramid.levels, int) and len(plan.levels) != spec.pyramid.levels:
        _fail(f"{len(plan.levels)} levels, the spec asks for {spec.pyramid.levels}")
    if spec.output.chunks and plan.chunks != tuple(min(c, n) for c, n in zip(spec.output.chunks, ds.shape)):
        _fail(f"chunks {plan.chunks} for spec chunks {spec.output.chunks} and shape {ds.shape}")
    unit = plan.shards or plan.chunks
    if plan.shards and any(s % c for s, c in zip(plan.shards, plan.chunks)):
        _fail(f"shards {plan.shards} are not multiples of chunks {plan.chunks}")
    check_chain(plan)
    src_shapes = [ds.shape if p.source_level == -1 else shapes[p.source_level] for p in plan.passes]
    for p, src in zip(plan.passes, src_shapes):
        check_tiling(src, p.slab, p.grid)
        check_alignment(p, src, unit, down)
    check_unit_ownership(plan, spec, src_shapes, down)
    check_memory(plan, spec, capacity)
    check_memory_terms(plan, spec)
    check_notices(plan, ds)
    if spec.resources.workers != "auto" and plan.workers != spec.resources.workers:
        _fail(f"{plan.workers} workers, the spec asks for {spec.resources.workers}")
    if plan.threads_per_worker != spec.resources.threads_per_worker:
        _fail(f"{plan.threads_per_worker} threads, the spec asks for {spec.resources.threads_per_worker}")


# --- negative controls: the oracle must reject broken plans ------------------------------------

CAP = Capacity(cores=4, memory_bytes=16 << 30)


def _spec(**sections) -> ConversionSpec:
    data = {"source": {"path": "in.h5", "dataset": "/d"}, "output": {"path": "o.zarr"}}
    for key, value in sections.items():
        data.setdefault(key, {}).update(value)
    return parse_spec(data)


@pytest.fixture(scope="module")
def good():
    ds = DatasetInfo((200, 1000, 600), "<u2", 2)
    spec = _spec(
        output={"chunks": [32, 64, 64]}, pyramid={"levels": 3}, resources={"workers": 2, "memoryPerWorker": "1Gi"}
    )
    plan = make_plan(ds, spec, CAP)
    check_plan(plan, ds, spec, CAP)
    return ds, spec, plan


def _with_pass(plan: Plan, index: int, **changes) -> Plan:
    passes = list(plan.passes)
    passes[index] = dataclasses.replace(passes[index], **changes)
    return dataclasses.replace(plan, passes=tuple(passes))


def test_oracle_accepts_a_real_plan(good):
    ds, spec, plan = good
    assert plan.n_tasks > 1 and len(plan.levels) == 3


def test_oracle_rejects_a_misaligned_slab(good):
    ds, spec, plan = good
    p = plan.passes[0]
    axis = next(a for a in range(3) if p.slab[a] > 32)
    slab = tuple(s - 32 if a == axis else s for a, s in enumerate(p.slab))
    grid = tuple(-(-n // s) for n, s in zip(ds.shape, slab))
    with pytest.raises(OracleError, match="step|part of a unit|writers"):
        check_plan(_with_pass(plan, 0, slab=slab, grid=grid), ds, spec, CAP)


def test_oracle_rejects_a_wrong_grid(good):
    ds, spec, plan = good
    p = plan.passes[0]
    grid = (p.grid[0] + 1,) + p.grid[1:]
    with pytest.raises(OracleError, match="grid says"):
        check_plan(_with_pass(plan, 0, grid=grid), ds, spec, CAP)


def test_oracle_rejects_a_broken_pass_chain(good):
    ds, spec, plan = good
    with pytest.raises(OracleError, match="levels|reads level"):
        check_plan(_with_pass(plan, 0, levels=(0,)), ds, spec, CAP) if len(plan.passes) == 1 else check_plan(
            _with_pass(plan, len(plan.passes) - 1, source_level=0), ds, spec, CAP
        )


def test_oracle_rejects_unit_with_two_writers():
    """Slab (16, 48, ...) with 32-wide chunks on y: the chunk at y 32..64 is split between slabs."""
    ds = DatasetInfo((32, 96, 64), "<u2", 2)
    spec = _spec(output={"chunks": [16, 32, 32]}, pyramid={"levels": 1}, resources={"workers": 1})
    plan = make_plan(ds, spec, CAP)
    broken = _with_pass(plan, 0, slab=(16, 48, 64), grid=(2, 2, 1))
    with pytest.raises(OracleError, match="step|part of a unit"):
        check_plan(broken, ds, spec, CAP)
    # Without the alignment check the ownership count alone still catches it.
    with pytest.raises(OracleError, match="part of a unit"):
        unit_owners(broken.passes[0], 0, ds.shape, ds.shape, plan.chunks, (True, True, True))


def test_oracle_rejects_memory_over_budget(good):
    ds, spec, plan = good
    over = dataclasses.replace(plan.memory, pod_limit=(1 << 30) + MiB)
    with pytest.raises(OracleError, match="exceeds memoryPerWorker"):
        check_memory(dataclasses.replace(plan, memory=over), spec, CAP)


def test_oracle_rejects_a_pass_that_would_pause_dask(good):
    ds, spec, plan = good
    low = dataclasses.replace(plan.memory, memory_limit=plan.memory.predicted_peak)
    with pytest.raises(OracleError, match="planned x memory_limit"):
        check_memory(dataclasses.replace(plan, memory=low), spec, CAP)


def test_oracle_rejects_a_stale_realign_notice(good):
    ds, spec, plan = good
    stale = dataclasses.replace(plan, notices=("resources.slab (1, 2, 3) re-aligned to (9, 9, 9) so that ...",))
    with pytest.raises(OracleError, match="notice names slab"):
        check_notices(stale, ds)


def test_oracle_rejects_duplicated_realign_notices(good):
    ds, spec, plan = good
    slab = plan.passes[0].slab
    twice = dataclasses.replace(
        plan,
        notices=(
            f"resources.slab (1, 2, 3) re-aligned to {slab} so",
            f"resources.slab (1, 2, 3) re-aligned to {slab} again",
        ),
    )
    with pytest.raises(OracleError, match="more than one"):
        check_notices(twice, ds)


def test_oracle_rejects_a_false_hdf5_notice(good):
    ds, spec, plan = good
    chunked = dataclasses.replace(ds, hdf5_chunks=plan.passes[0].slab)
    with pytest.raises(OracleError, match="does not cut"):
        check_notices(dataclasses.replace(plan, notices=("HDF5 chunks (1, 1, 1) do not fit whole",)), chunked)
    with pytest.raises(OracleError, match="cuts"):
        check_notices(plan, dataclasses.replace(ds, hdf5_chunks=(7, 7, 7)))


@pytest.fixture(scope="module")
def sharded():
    ds = DatasetInfo((256, 1024, 1024), "<f4", 4)
    spec = _spec(
        output={"chunks": [64, 64, 64], "shards": [128, 256, 256]},
        pyramid={"levels": 3},
        resources={"workers": 2, "threadsPerWorker": 2, "memoryPerWorker": "3Gi"},
    )
    plan = make_plan(ds, spec, CAP)
    check_plan(plan, ds, spec, CAP)
    assert len(plan.passes) >= 2, "a later pass must read shards"
    return ds, spec, plan


def _with_term(plan: Plan, name: str, value: int | None) -> Plan:
    """The plan with one term of every pass set to ``value`` (None: removed)."""
    passes = []
    for p in plan.passes:
        if value is None:
            terms = tuple(t for t in p.terms if t.name != name)
        else:
            terms = tuple(dataclasses.replace(t, bytes=value) if t.name == name else t for t in p.terms)
        passes.append(dataclasses.replace(p, terms=terms))
    return dataclasses.replace(plan, passes=tuple(passes))


def test_oracle_rejects_a_shard_held_whole(sharded):
    """The accounting this replaced: the encoded shard held per thread until written whole."""
    ds, spec, plan = sharded
    shard_bytes = math.prod(plan.shards) * 4
    old = plan.threads_per_worker * (64**3 * 4 + shard_bytes + 16 + 6 * MiB)
    with pytest.raises(OracleError, match="'chunk and encode buffers'"):
        check_memory_terms(_with_term(plan, "chunk and encode buffers", old), spec)


def test_oracle_rejects_a_missing_or_single_thread_shard_term(sharded):
    ds, spec, plan = sharded
    with pytest.raises(OracleError, match="'shard assembly' is None"):
        check_memory_terms(_with_term(plan, "shard assembly", None), spec)
    term = next(t.bytes for t in plan.passes[0].terms if t.name == "shard assembly")
    with pytest.raises(OracleError, match="'shard assembly'"):
        check_memory_terms(_with_term(plan, "shard assembly", term // plan.threads_per_worker), spec)


def test_oracle_rejects_a_shard_sized_read_buffer(sharded):
    """A later pass that reads a shard file whole (what the engine did before issue 18)."""
    ds, spec, plan = sharded
    shard_bytes = math.prod(plan.shards) * 4
    with pytest.raises(OracleError, match="'level read buffers'"):
        check_memory_terms(
            _with_term(plan, "level read buffers", plan.threads_per_worker * (shard_bytes + 16 + 64**3 * 4)), spec
        )


def test_oracle_rejects_a_shard_term_on_an_unsharded_plan(good):
    ds, spec, plan = good
    passes = tuple(
        dataclasses.replace(p, terms=p.terms + (dataclasses.replace(p.terms[0], name="shard assembly", bytes=4096),))
        for p in plan.passes
    )
    with pytest.raises(OracleError, match="unexpected term"):
        check_memory_terms(dataclasses.replace(plan, passes=passes), spec)
