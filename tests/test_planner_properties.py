"""Property tests: random datasets, specs and budgets, checked against the brute-force oracle in
``test_planner_oracle.py`` (which has its own negative controls).

The planner is pure, so shapes can be large (it never touches data); the oracle enumerates every
chunk or shard, so the strategies keep the number of units per axis small by drawing the shape
as a number of units times the unit plus a remainder.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import HealthCheck, assume, given, note, settings
from hypothesis import strategies as st

from h5ngff.errors import BudgetTooSmallError, PlanError, SpecError
from h5ngff.planner import Capacity, DatasetInfo, MemoryConstants, make_plan
from h5ngff.spec import parse_spec
from h5ngff.spec import MIN_WORKER_MEMORY
from h5ngff.units import MiB
from test_planner_oracle import check_plan, downsampled_axes, useful_levels

PROPERTY_SETTINGS = settings(
    max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much]
)

DTYPES = ["|u1", "<u2", "<i2", "<u4", "<f4", "<f8", "<i8", "|b1"]
AXES = {2: "yx", 3: "zyx", 4: "czyx", 5: "tczyx"}


@st.composite
def problems(draw):
    """A dataset (shape, dtype, HDF5 layout) and a spec dict for it, plus where the job runs."""
    ndim = draw(st.integers(2, 5))
    axes = AXES[ndim]
    chunks, shape, shards = [], [], []
    sharded = draw(st.booleans())
    for a in axes:
        spatial = a in "zyx"
        c = draw(st.integers(1, 96)) if spatial else draw(st.integers(1, 2))
        m = draw(st.integers(1, 3)) if sharded else 1
        units = draw(st.integers(0, 9 if spatial else 2))
        n = units * c * m + draw(st.integers(0 if units else 1, c * m))
        chunks.append(c)
        shards.append(c * m)
        shape.append(n)
    dtype = np.dtype(draw(st.sampled_from(DTYPES)))
    hdf5_chunks = None
    if draw(st.booleans()):
        hdf5_chunks = tuple(draw(st.integers(1, n)) for n in shape)
    filters = draw(st.sampled_from([(), ("gzip",), ("shuffle", "gzip"), ("blosc",)])) if hdf5_chunks else ()
    ds = DatasetInfo(tuple(shape), dtype.str, dtype.itemsize, hdf5_chunks=hdf5_chunks, hdf5_filters=filters)

    pyramid_axes = draw(st.sampled_from([None, "yx", "zyx", "zy", "x"]))
    if pyramid_axes is not None and any(a not in axes for a in pyramid_axes):
        pyramid_axes = None
    resources: dict = {
        "threadsPerWorker": draw(st.integers(1, 4)),
        "allocator": draw(st.sampled_from(["jemalloc", "glibc"])),
    }
    workers = draw(st.one_of(st.just("auto"), st.integers(1, 8)))
    resources["workers"] = workers
    budget = draw(st.sampled_from(["none", "perWorker", "total"]))
    if budget == "perWorker":
        resources["memoryPerWorker"] = draw(st.integers(MIN_WORKER_MEMORY // MiB, 3072)) * MiB
    elif budget == "total":
        resources["memoryTotal"] = draw(st.integers(MIN_WORKER_MEMORY // MiB, 8192)) * MiB
    if draw(st.integers(0, 3)) == 0:
        resources["slab"] = [draw(st.integers(1, n)) for n in shape]
    spec = {
        "source": {"path": "in.h5", "dataset": "/volume/data"},
        "output": {"path": "out.ome.zarr", "chunks": chunks},
        "pyramid": {
            "levels": draw(st.one_of(st.just("auto"), st.integers(1, 6))),
            "method": draw(st.sampled_from(["mean", "nearest", "max"])),
        },
        "resources": resources,
    }
    if sharded:
        spec["output"]["shards"] = shards
    if pyramid_axes:
        spec["pyramid"]["axes"] = pyramid_axes
    default_workers = draw(st.sampled_from([None, 4]))
    capacity = Capacity(
        cores=draw(st.integers(1, 8)), memory_bytes=draw(st.integers(1, 64)) << 30, default_workers=default_workers
    )
    allocator = resources["allocator"]
    return ds, spec, capacity, allocator


def _plan(ds, spec_dict, capacity, allocator):
    return make_plan(ds, parse_spec(spec_dict), capacity, allocator=allocator)


def _with_resources(spec_dict, **changes):
    resources = {k: v for k, v in spec_dict["resources"].items() if k not in ("memoryPerWorker", "memoryTotal")}
    resources.update(changes)
    return {**spec_dict, "resources": resources}


@pytest.mark.slow
@PROPERTY_SETTINGS
@given(problems())
def test_every_plan_satisfies_the_oracle(problem):
    ds, spec_dict, capacity, allocator = problem
    spec = parse_spec(spec_dict)
    note(f"dataset {ds}\nspec {spec_dict}\ncapacity {capacity}")
    down = downsampled_axes(spec, AXES[ds.ndim])
    try:
        plan = make_plan(ds, spec, capacity, allocator=allocator)
    except BudgetTooSmallError as exc:
        _check_refusal(ds, spec_dict, capacity, allocator, exc)
        return
    except SpecError as exc:
        # Only a level count beyond one voxel is a planner-time error for these specs.
        assert exc.field == "pyramid.levels", exc
        assert spec.pyramid.levels != "auto" and spec.pyramid.levels > useful_levels(ds.shape, down), exc
        return
    if spec.pyramid.levels != "auto":
        assert spec.pyramid.levels <= useful_levels(ds.shape, down)
    check_plan(plan, ds, spec, capacity)
    # Deterministic: the same inputs give an equal plan (and equal JSON).
    again = make_plan(ds, parse_spec(spec_dict), capacity, allocator=allocator)
    assert again == plan
    assert again.to_dict() == plan.to_dict()
    if spec.resources.memory_total is not None and spec.resources.workers == "auto":
        _check_most_workers(ds, spec_dict, capacity, allocator, plan)


def _check_refusal(ds, spec_dict, capacity, allocator, exc: BudgetTooSmallError) -> None:
    """The smallest budget a refusal names is enough, and one MiB less is not."""
    r = spec_dict["resources"]
    field = "memoryTotal" if "memoryTotal" in r else "memoryPerWorker"
    assert exc.minimum_bytes % MiB == 0
    assert f"{exc.minimum_bytes // MiB}Mi" in str(exc), str(exc)
    if "memoryTotal" in r or "memoryPerWorker" in r:
        assert f"resources.{field}" in str(exc), str(exc)
        given_budget = r[field]
    else:
        given_budget = None  # the local default budget: the user's knob is memoryPerWorker
    assert given_budget is None or exc.minimum_bytes > given_budget
    enough = _with_resources(spec_dict, **{field: exc.minimum_bytes})
    plan = _plan(ds, enough, capacity, allocator)
    check_plan(plan, ds, parse_spec(enough), capacity)
    less = exc.minimum_bytes - MiB
    if less >= MIN_WORKER_MEMORY:
        with pytest.raises(BudgetTooSmallError):
            _plan(ds, _with_resources(spec_dict, **{field: less}), capacity, allocator)


def _check_most_workers(ds, spec_dict, capacity, allocator, plan) -> None:
    """memoryTotal with workers auto picks the most workers that fit (up to the machine's)."""
    most = capacity.default_workers or max(1, capacity.cores // spec_dict["resources"]["threadsPerWorker"])
    assert 1 <= plan.workers <= most
    if plan.workers < most:
        more = {**spec_dict, "resources": {**spec_dict["resources"], "workers": plan.workers + 1}}
        with pytest.raises(BudgetTooSmallError):
            _plan(ds, more, capacity, allocator)


@settings(max_examples=60, deadline=None)
@given(
    st.integers(256, 4096).map(lambda n: n * MiB),
    st.integers(1, 64).map(lambda n: n * MiB),
    st.integers(1, 64).map(lambda n: n * MiB),
    st.floats(0.5, 0.9),
)
def test_overridden_constants_still_hold_the_oracle(budget, baseline, nanny, pause):
    """Calibration changes the constants; the invariants must not depend on the defaults."""
    constants = MemoryConstants().with_overrides(
        {
            "interpreter_baseline": baseline,
            "nanny": nanny,
            "page_cache_floor": 8 * MiB,
            "planned_fraction": pause,
            "terminate_fraction": min(0.99, pause + 0.05),
        }
    )
    ds = DatasetInfo((300, 1500, 1100), "<u2", 2, hdf5_chunks=(30, 250, 250), hdf5_filters=("gzip",))
    spec_dict = {
        "source": {"path": "in.h5", "dataset": "/d"},
        "output": {"path": "o.zarr", "chunks": [32, 64, 64]},
        "pyramid": {"levels": 3},
        "resources": {"workers": 3, "memoryPerWorker": budget},
    }
    capacity = Capacity(cores=4, memory_bytes=32 << 30)
    try:
        plan = make_plan(ds, parse_spec(spec_dict), capacity, constants)
    except BudgetTooSmallError as exc:
        ok = make_plan(
            ds, parse_spec(_with_resources(spec_dict, memoryPerWorker=exc.minimum_bytes)), capacity, constants
        )
        assert ok.memory.pod_limit <= exc.minimum_bytes
        return
    check_plan(plan, ds, parse_spec(spec_dict), capacity)
    assert plan.memory.predicted_peak <= pause * plan.memory.memory_limit


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 4), st.sampled_from(["|u1", "<u2", "<f4", "<f8"]), st.integers(1, 4), st.integers(1, 4))
def test_a_shard_costs_its_index_not_its_bytes(threads, dtype, grow_y, grow_x):
    """Growing the shard (same chunks, same slab) adds only index bytes to the predicted peak: the
    engine streams a shard's chunks to its file and reads them back one at a time (issue 18)."""
    itemsize = np.dtype(dtype).itemsize
    ds = DatasetInfo((128, 1024, 1024), np.dtype(dtype).str, itemsize)

    def peak(shards):
        spec = {
            "source": {"path": "in.h5", "dataset": "/d"},
            "output": {"path": "o.zarr", "chunks": [32, 64, 64], "shards": shards},
            "pyramid": {"levels": 2},
            "resources": {"workers": 1, "threadsPerWorker": threads, "slab": [128, 1024, 1024]},
        }
        plan = _plan(ds, spec, Capacity(cores=4, memory_bytes=64 << 30), "jemalloc")
        check_plan(plan, ds, parse_spec(spec), Capacity(cores=4, memory_bytes=64 << 30))
        return plan.memory.predicted_peak, math.prod(s // c for s, c in zip(shards, [32, 64, 64]))

    small, n_small = peak([32, 64, 64])
    large, n_large = peak([128, 64 * grow_y * 2, 64 * grow_x * 2])
    index_growth = threads * 2 * 16 * (n_large - n_small)
    assert large - small <= math.ceil(1.06 * index_growth) + 1


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 6), st.integers(1, 4), st.integers(300, 2000))
def test_more_budget_never_means_more_slabs(workers, threads, budget_mib):
    """A larger budget can only keep or grow the slab: the plan is monotone in the budget."""
    ds = DatasetInfo((150, 3768, 2008), "<f4", 4)
    base = {
        "source": {"path": "in.h5", "dataset": "/d"},
        "output": {"path": "o.zarr", "chunks": [64, 64, 64]},
        "pyramid": {"levels": 1},
        "resources": {"workers": workers, "threadsPerWorker": threads},
    }
    capacity = Capacity(cores=8, memory_bytes=64 << 30)
    plans = []
    for b in (budget_mib, budget_mib * 2):
        try:
            plans.append(_plan(ds, _with_resources(base, memoryPerWorker=b * MiB), capacity, "jemalloc"))
        except BudgetTooSmallError:
            plans.append(None)
    small, large = plans
    assume(small is not None)
    assert large is not None
    assert math.prod(large.slab) >= math.prod(small.slab)


@pytest.mark.slow
def test_property_strategy_reaches_the_interesting_cases():
    """Guard against a strategy that never produces refusals, multi-pass plans or HDF5 chunks."""
    seen = {
        "refused": 0,
        "multipass": 0,
        "multislab": 0,
        "hdf5": 0,
        "notice": 0,
        "sharded": 0,
        "sharded multipass": 0,
        "sharded threads": 0,
    }

    @settings(
        max_examples=150, deadline=None, database=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow]
    )
    @given(problems())
    def sample(problem):
        ds, spec_dict, capacity, allocator = problem
        try:
            plan = _plan(ds, spec_dict, capacity, allocator)
        except BudgetTooSmallError:
            seen["refused"] += 1
            return
        except PlanError:
            return
        except SpecError:
            return
        seen["multipass"] += len(plan.passes) > 1
        seen["multislab"] += plan.n_tasks > 1
        seen["hdf5"] += ds.hdf5_chunks is not None
        seen["notice"] += bool(plan.notices)
        # Shards: the oracle's memory check must see them written, read back by a later pass, and
        # assembled by several threads at once (its term is per thread).
        seen["sharded"] += plan.shards is not None
        seen["sharded multipass"] += plan.shards is not None and len(plan.passes) > 1
        seen["sharded threads"] += plan.shards is not None and plan.threads_per_worker > 1

    sample()
    assert all(v > 0 for v in seen.values()), seen
