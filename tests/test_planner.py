"""Planner table tests: the case that started the project, refusals, total budgets, HDF5 chunked
layouts, overridable constants, and one regression test per bug found (named after it).

Expected numbers are derived from the memory model's constants, not copied from a run.
"""

from __future__ import annotations

import json
import math

import pytest

from h5ngff.errors import BudgetTooSmallError, SpecError
from h5ngff.planner import DEFAULT_CONSTANTS, Capacity, DatasetInfo, MemoryConstants, make_plan
from h5ngff.spec import MIN_WORKER_MEMORY, parse_spec
from h5ngff.units import MiB, format_bytes
from test_planner_oracle import check_memory, check_notices, check_plan

MACHINE = Capacity(cores=2, memory_bytes=24 << 30)  # the test machines (docs/architecture.md)
BIG = Capacity(cores=8, memory_bytes=64 << 30)
HEADLINE = DatasetInfo((150, 3768, 2008), "<f4", 4)  # contiguous float32, 4.54 GB
HEADLINE_COMPRESSOR = {"codec": "blosc", "cname": "zstd", "clevel": 5, "shuffle": "bitshuffle"}


def spec(**sections):
    data = {"source": {"path": "in.h5", "dataset": "/volume/data"}, "output": {"path": "out.ome.zarr"}}
    for key, value in sections.items():
        data.setdefault(key, {}).update(value)
    return parse_spec(data)


def headline_spec(**resources):
    return spec(
        output={"chunks": [64, 64, 64], "compressor": HEADLINE_COMPRESSOR},
        pyramid={"levels": 1},
        resources={"workers": 8, "slab": [64, 704, 2008], **resources},
    )


# --- the case that started the project ----------------------------------------------------------


@pytest.fixture(scope="module")
def headline():
    s = headline_spec()
    plan = make_plan(HEADLINE, s, MACHINE)
    check_plan(plan, HEADLINE, s, MACHINE)
    return plan


def test_headline_slab_is_exactly_the_users(headline):
    assert headline.slab == (64, 704, 2008)
    assert len(headline.passes) == 1 and headline.passes[0].levels == (0,)
    assert headline.passes[0].grid == (math.ceil(150 / 64), math.ceil(3768 / 704), 1)
    assert headline.n_tasks == 18
    assert headline.notices == ()  # already aligned: no re-alignment notice
    assert headline.workers == 8 and headline.threads_per_worker == 1


def test_headline_explains_every_mib(headline):
    c = DEFAULT_CONSTANTS
    terms = {t.name: t.bytes for t in headline.memory.terms}
    assert list(terms) == [
        "interpreter",
        "slab buffers",
        "chunk and encode buffers",
        "window histogram",
        "hdf5 cache and decompression",
        "allocator slack",
    ]
    assert terms["slab buffers"] == 64 * 704 * 2008 * 4
    assert terms["interpreter"] == c.interpreter_baseline
    chunk = 64**3 * 4
    assert terms["chunk and encode buffers"] >= 2 * chunk  # a padded copy and its encoded bytes
    assert terms["hdf5 cache and decompression"] == c.hdf5_internal  # contiguous: no chunk cache
    dynamic = sum(v for k, v in terms.items() if k not in ("interpreter", "allocator slack"))
    assert 0 < terms["allocator slack"] <= 0.1 * dynamic
    assert headline.memory.predicted_peak == sum(terms.values())
    assert all(t.why for t in headline.memory.terms)
    pod = {t.name: t.bytes for t in headline.memory.pod_terms}
    assert list(pod) == ["dask terminate threshold", "nanny", "page cache and overshoot room"]
    assert pod["dask terminate threshold"] == math.ceil(c.terminate_fraction * headline.memory.memory_limit)
    assert pod["nanny"] == c.nanny
    assert pod["page cache and overshoot room"] == max(
        c.page_cache_floor, math.ceil(c.growth_rate * c.monitor_interval), pod["page cache and overshoot room"]
    )
    assert pod["page cache and overshoot room"] >= max(
        c.page_cache_floor, math.ceil(c.growth_rate * c.monitor_interval)
    )
    assert headline.memory.pod_limit == math.ceil(sum(pod.values()) / MiB) * MiB
    assert headline.memory.memory_limit == math.ceil(headline.memory.predicted_peak / c.planned_fraction / MiB) * MiB


def test_headline_dask_acts_before_the_kernel(headline):
    m = headline.memory
    t = m.thresholds
    assert m.predicted_peak <= t.planned * m.memory_limit < t.terminate * m.memory_limit < m.memory_limit < m.pod_limit
    # The nanny kills the worker at terminate x memory_limit; with the nanny's own RSS that is still
    # below the pod limit, so the kernel's OOM killer never gets there first.
    assert t.terminate * m.memory_limit + DEFAULT_CONSTANTS.nanny < m.pod_limit
    assert t.pause is False, "a paused worker never frees unmanaged slab memory: it would stall the run"
    assert t.planned < t.terminate < 1
    assert t.target is False and t.spill is False  # nothing to spill: slabs are streamed
    assert m.pod_limit % MiB == 0 and m.memory_limit % MiB == 0


def test_headline_to_dict_is_json(headline):
    d = json.loads(json.dumps(headline.to_dict()))
    assert d["n_tasks"] == 18
    assert d["passes"][0]["slab"] == [64, 704, 2008]
    assert d["memory"]["pod_limit_mib"] == headline.memory.pod_limit / MiB


def test_headline_threads_multiply_the_per_thread_terms():
    one = make_plan(HEADLINE, headline_spec(workers=2), MACHINE)
    two = make_plan(HEADLINE, headline_spec(workers=2, threadsPerWorker=2), MACHINE)
    slab_bytes = 64 * 704 * 2008 * 4
    t1 = {t.name: t.bytes for t in one.memory.terms}
    t2 = {t.name: t.bytes for t in two.memory.terms}
    assert t2["slab buffers"] == 2 * slab_bytes == 2 * t1["slab buffers"]
    assert t2["chunk and encode buffers"] == 2 * t1["chunk and encode buffers"]
    assert t2["interpreter"] == t1["interpreter"]
    assert two.inflight_per_worker == 2 * one.inflight_per_worker


# --- user slabs -----------------------------------------------------------------------------------


def test_user_slab_is_realigned_with_a_notice():
    s = headline_spec(slab=[60, 700, 2000])
    plan = make_plan(HEADLINE, s, MACHINE)
    check_plan(plan, HEADLINE, s, MACHINE)
    assert plan.slab == (64, 704, 2008)
    assert len(plan.notices) == 1
    assert "resources.slab (60, 700, 2000) re-aligned to (64, 704, 2008)" in plan.notices[0]


def test_user_slab_larger_than_the_array_is_clipped_without_notice():
    s = headline_spec(slab=[1000, 3768, 5000], memoryPerWorker="32Gi")
    plan = make_plan(HEADLINE, s, BIG)
    assert plan.slab == (150, 3768, 2008) and plan.n_tasks == 1
    assert plan.notices == ()


def test_regression_user_slab_notice_duplicated():
    """With memoryTotal and workers auto, each worker count tried left its own re-alignment
    notice behind: the plan said the slab went to (128, 384, 128) and to (278, 512, 512)."""
    ds = DatasetInfo((278, 1661, 2619), "|u1", 1)
    s = spec(
        output={"chunks": [128, 128, 128]},
        resources={"workers": "auto", "threadsPerWorker": 2, "memoryTotal": 702545920, "slab": [27, 305, 111]},
    )
    cap = Capacity(cores=7, memory_bytes=64 << 30)
    plan = make_plan(ds, s, cap)
    check_plan(plan, ds, s, cap)
    realigned = [n for n in plan.notices if "re-aligned" in n]
    assert len(realigned) == 1
    assert f"re-aligned to {plan.slab}" in realigned[0]


# --- refusals -----------------------------------------------------------------------------------


def _replan(ds, s, cap, **resources):
    data = s.to_wire()
    data["resources"] = {
        k: v for k, v in data["resources"].items() if k not in ("memoryPerWorker", "memoryTotal")
    } | resources
    return make_plan(ds, parse_spec(data), cap)


def test_refusal_names_the_smallest_budget_and_the_knob():
    s = headline_spec(memoryPerWorker="240Mi")
    with pytest.raises(BudgetTooSmallError) as info:
        make_plan(HEADLINE, s, MACHINE)
    err = info.value
    text = str(err)
    assert text.startswith(
        "resources.memoryPerWorker: 240.0 MiB per worker is too small: your slab (64, 704, 2008) (345.1 MiB)"
    )
    assert f"Raise resources.memoryPerWorker to at least {err.minimum_bytes // MiB}Mi" in text
    assert "a smaller resources.slab (or none, to let the planner choose)" in text
    assert err.reason == "BudgetTooSmall" and err.exit_code == 2
    # The number is right: it plans, and one MiB less does not.
    assert _replan(HEADLINE, s, MACHINE, memoryPerWorker=err.minimum_bytes).memory.pod_limit <= err.minimum_bytes
    with pytest.raises(BudgetTooSmallError):
        _replan(HEADLINE, s, MACHINE, memoryPerWorker=err.minimum_bytes - MiB)


def test_refusal_suggests_chunks_and_threads_only_where_they_matter():
    big_chunks = spec(
        output={"chunks": [128, 256, 256]},
        pyramid={"levels": 1},
        resources={"workers": 2, "threadsPerWorker": 4, "memoryPerWorker": "300Mi"},
    )
    with pytest.raises(BudgetTooSmallError) as info:
        make_plan(HEADLINE, big_chunks, MACHINE)
    assert "smaller output.chunks" in str(info.value) and "fewer resources.threadsPerWorker" in str(info.value)
    tiny = spec(
        output={"chunks": [8, 8]}, resources={"workers": 1, "threadsPerWorker": 2, "memoryPerWorker": MIN_WORKER_MEMORY}
    )
    with pytest.raises(BudgetTooSmallError) as info:
        make_plan(DatasetInfo((64, 64), "|u1", 1), tiny, MACHINE)
    # Fixed costs dominate: only the budget can help.
    assert "output.chunks" not in str(info.value) and "threadsPerWorker" not in str(info.value)


def test_refusal_without_a_budget_explains_the_default():
    tiny = Capacity(cores=2, memory_bytes=400 << 20)
    with pytest.raises(BudgetTooSmallError) as info:
        make_plan(HEADLINE, spec(pyramid={"levels": 1}, resources={"workers": 2}), tiny)
    text = str(info.value)
    assert "resources.memoryPerWorker: the default budget (80% of this machine's 400.0 MiB shared by 2 workers" in text
    assert "or use fewer resources.workers" in text


def test_regression_memory_total_refusal_named_memory_per_worker():
    """memoryTotal with a fixed worker count was refused as 'resources.memoryPerWorker: 125 MiB per
    worker', a field the user never set, with a per-worker figure as the minimum."""
    s = spec(resources={"workers": 4, "memoryTotal": "500Mi"})
    with pytest.raises(BudgetTooSmallError) as info:
        make_plan(HEADLINE, s, MACHINE)
    err = info.value
    assert str(err).startswith("resources.memoryTotal: 500.0 MiB for 4 workers (125.0 MiB each) is too small")
    assert f"at least {err.minimum_bytes // MiB}Mi ({err.minimum_bytes // 4 // MiB}Mi per worker)" in str(err)
    assert "fewer resources.workers" in str(err)
    assert err.minimum_bytes % 4 == 0
    plan = _replan(HEADLINE, s, MACHINE, memoryTotal=err.minimum_bytes)
    assert plan.workers == 4 and 4 * plan.memory.pod_limit <= err.minimum_bytes
    with pytest.raises(BudgetTooSmallError):
        _replan(HEADLINE, s, MACHINE, memoryTotal=err.minimum_bytes - MiB)


def test_regression_refusal_minimum_too_small_with_hdf5_straddle():
    """The refusal priced a slab that cuts HDF5 chunks without its chunk cache: it asked for
    310Mi, and 310Mi was refused again."""
    ds = DatasetInfo((512, 512, 512), "<f4", 4, hdf5_chunks=(512, 512, 16), hdf5_filters=("gzip",))
    s = spec(
        output={"chunks": [64, 64, 64]}, pyramid={"levels": 1}, resources={"workers": 2, "memoryPerWorker": "300Mi"}
    )
    with pytest.raises(BudgetTooSmallError) as info:
        make_plan(ds, s, MACHINE)
    minimum = info.value.minimum_bytes
    plan = _replan(ds, s, MACHINE, memoryPerWorker=minimum)
    check_plan(plan, ds, parse_spec(s.to_wire() | {"resources": {"workers": 2, "memoryPerWorker": minimum}}), MACHINE)
    with pytest.raises(BudgetTooSmallError):
        _replan(ds, s, MACHINE, memoryPerWorker=minimum - MiB)


def test_regression_refusal_minimum_not_the_smallest_for_a_pyramid():
    """With a pyramid, a little more budget lets pass 0 build every level, so the later pass that
    failed is not needed: the refusal asked for 280Mi where 279Mi plans."""
    ds = DatasetInfo((41, 58, 160), "<f8", 8)
    s = spec(
        output={"chunks": [41, 58, 79], "shards": [41, 58, 158]},
        resources={"workers": "auto", "memoryPerWorker": MIN_WORKER_MEMORY},
    )
    cap = Capacity(cores=1, memory_bytes=1 << 30)
    with pytest.raises(BudgetTooSmallError) as info:
        make_plan(ds, s, cap)
    minimum = info.value.minimum_bytes
    assert _replan(ds, s, cap, memoryPerWorker=minimum).memory.pod_limit <= minimum
    # Every budget below the minimum is refused, and each refusal names the same minimum.
    for below in range(max(minimum - 40 * MiB, MIN_WORKER_MEMORY), minimum, MiB):
        with pytest.raises(BudgetTooSmallError) as info:
            _replan(ds, s, cap, memoryPerWorker=below)
        assert info.value.minimum_bytes == minimum


# --- total budgets --------------------------------------------------------------------------------


@pytest.mark.parametrize("total_mib", [600, 1500, 2500, 6000])
def test_memory_total_picks_the_most_workers_that_fit(total_mib):
    s = spec(
        output={"chunks": [64, 64, 64]},
        pyramid={"levels": 1},
        resources={"workers": "auto", "memoryTotal": total_mib * MiB},
    )
    plan = make_plan(HEADLINE, s, BIG)
    check_plan(plan, HEADLINE, s, BIG)
    # An independent search: every explicit worker count, largest that plans within the total.
    fitting = []
    for w in range(1, BIG.cores + 1):
        try:
            p = _replan(HEADLINE, s, BIG, workers=w, memoryTotal=total_mib * MiB)
        except BudgetTooSmallError:
            continue
        assert w * p.memory.pod_limit <= total_mib * MiB
        fitting.append(w)
    assert plan.workers == max(fitting)
    assert plan.workers * plan.memory.pod_limit <= total_mib * MiB


def test_memory_total_too_small_for_one_worker():
    s = spec(pyramid={"levels": 1}, resources={"memoryTotal": MIN_WORKER_MEMORY})
    with pytest.raises(BudgetTooSmallError) as info:
        make_plan(HEADLINE, s, BIG)
    assert str(info.value).startswith(
        f"resources.memoryTotal: {format_bytes(MIN_WORKER_MEMORY)} cannot hold even one worker"
    )
    plan = _replan(HEADLINE, s, BIG, memoryTotal=info.value.minimum_bytes)
    assert plan.workers == 1


# --- HDF5 chunked layouts -------------------------------------------------------------------------

#: 100-voxel HDF5 chunks against 64-voxel output chunks: a slab holding both whole is 1600 wide.
CHUNKED = DatasetInfo((150, 3768, 2008), "<f4", 4, hdf5_chunks=(100, 100, 100), hdf5_filters=("shuffle", "gzip"))


def _whole(slab, chunks, shape) -> bool:
    return all(sl % h == 0 or sl == n for sl, h, n in zip(slab, chunks, shape))


def test_hdf5_slabs_are_whole_hdf5_chunks_where_the_budget_allows():
    s = spec(output={"chunks": [64, 64, 64]}, pyramid={"levels": 1}, resources={"workers": 2, "memoryPerWorker": "4Gi"})
    plan = make_plan(CHUNKED, s, MACHINE)
    check_plan(plan, CHUNKED, s, MACHINE)
    assert _whole(plan.slab, CHUNKED.hdf5_chunks, CHUNKED.shape), plan.slab
    assert _whole(plan.slab, (64, 64, 64), CHUNKED.shape)
    assert not plan.notices
    assert plan.hdf5_cache_bytes == 0  # whole chunks are decompressed once, no cache needed
    hdf5 = {t.name: t for t in plan.memory.terms}["hdf5 cache and decompression"]
    assert hdf5.bytes == DEFAULT_CONSTANTS.hdf5_internal + 2 * 100**3 * 4  # one compressed + one decompressed chunk


def test_hdf5_chunks_cut_by_a_small_budget_give_a_notice():
    s = spec(output={"chunks": [64, 64, 64]}, pyramid={"levels": 1}, resources={"workers": 2, "memoryPerWorker": "1Gi"})
    plan = make_plan(CHUNKED, s, MACHINE)
    check_plan(plan, CHUNKED, s, MACHINE)
    assert not _whole(plan.slab, CHUNKED.hdf5_chunks, CHUNKED.shape), plan.slab
    assert plan.notices == (
        "HDF5 chunks (100, 100, 100) do not fit whole in slabs under this budget; some are decompressed more than once. A larger memory budget avoids it.",
    )
    assert plan.hdf5_cache_bytes > 0  # the chunks a slab touches stay cached


def test_regression_plane_chunked_hdf5_refused_or_oversized():
    """One HDF5 chunk per plane, (1, 3768, 2008): whole-plane slabs (64 planes, 1.8 GiB) were skipped
    for being above the 512 MiB soft cap, and the slab that cuts planes was priced with a cache of
    65 x 2 x 2 planes instead of 64: a 9 GiB pod without a budget, and 8 GiB budgets refused."""
    ds = DatasetInfo((150, 3768, 2008), "<f4", 4, hdf5_chunks=(1, 3768, 2008), hdf5_filters=("gzip",))
    s = spec(output={"chunks": [64, 64, 64]}, pyramid={"levels": 1}, resources={"workers": 2, "memoryPerWorker": "6Gi"})
    plan = make_plan(ds, s, MACHINE)
    check_plan(plan, ds, s, MACHINE)
    assert plan.slab == (64, 3768, 2008) and plan.hdf5_cache_bytes == 0 and not plan.notices
    # Where whole planes are too few for the threads, the cut slab caches exactly the planes it
    # touches: 64 of them, not 65 x 2 x 2.
    many = spec(
        output={"chunks": [64, 64, 64]}, pyramid={"levels": 1}, resources={"workers": 8, "memoryPerWorker": "6Gi"}
    )
    plan = make_plan(ds, many, BIG)
    check_plan(plan, ds, many, BIG)
    assert plan.slab[0] == 64 and plan.hdf5_cache_bytes == 64 * 3768 * 2008 * 4


def test_regression_hdf5_notice_blamed_the_budget_without_one():
    """Whole HDF5 chunks can be cut for parallelism with no budget at all; the notice said
    'under this budget'."""
    ds = DatasetInfo((64, 4096, 4096), "|u1", 1, hdf5_chunks=(64, 4096, 4096), hdf5_filters=("gzip",))
    s = spec(output={"chunks": [64, 64, 64]}, pyramid={"levels": 1}, resources={"workers": 4})
    cap = Capacity(cores=4, memory_bytes=64 << 30, default_workers=4)  # Kubernetes-like: no budget
    plan = make_plan(ds, s, cap)
    check_plan(plan, ds, s, cap)
    assert plan.n_tasks >= 4
    assert len(plan.notices) == 1 and "under this budget" not in plan.notices[0]
    assert "fewer than the 4 threads" in plan.notices[0]


def test_regression_hdf5_notice_when_the_slab_cuts_no_chunk():
    """A slab picked without HDF5 alignment that still is whole HDF5 chunks (here the whole array)
    got the 'decompressed more than once' notice and a chunk cache it does not need."""
    ds = DatasetInfo((62, 119, 103), "|u1", 1, hdf5_chunks=(61, 23, 49), hdf5_filters=("gzip",))
    s = spec(output={"chunks": [128, 128, 128]}, resources={"workers": 1, "threadsPerWorker": 2})
    cap = Capacity(cores=2, memory_bytes=8 << 30)
    plan = make_plan(ds, s, cap)
    check_plan(plan, ds, s, cap)
    assert plan.slab == ds.shape
    # The one notice left says the chunks were clipped to the array, not that HDF5 chunks are
    # decompressed twice.
    assert [n for n in plan.notices if "decompressed more than once" in n] == [] and plan.hdf5_cache_bytes == 0
    assert len(plan.notices) == 1 and "output.chunks (128, 128, 128) became (62, 119, 103)" in plan.notices[0]


# --- layout regressions ----------------------------------------------------------------------------


def test_regression_shards_refused_when_chunk_clipped_to_array():
    """chunks [64,64,64] with shards [128,128,128] on a 10-deep array: the chunk was clipped to 10
    first and then 128 % 10 refused the shards the spec had accepted."""
    ds = DatasetInfo((10, 300, 300), "<u2", 2)
    s = spec(output={"chunks": [64, 64, 64], "shards": [128, 128, 128]})
    plan = make_plan(ds, s, MACHINE)
    check_plan(plan, ds, s, MACHINE)
    assert plan.chunks == (10, 64, 64) and plan.shards == (10, 128, 128)


def test_regression_single_unit_for_spatial_axes():
    """``--units micrometer`` (the CLI's 'one unit for all spatial axes') without --axes reached the
    planner as one unit for three axes and was refused."""
    plan = make_plan(DatasetInfo((2, 16, 64, 64), "<u2", 2), spec(image={"units": ["micrometer"]}), MACHINE)
    assert plan.axes == "czyx" and plan.units == ("", "micrometer", "micrometer", "micrometer")
    # A single time unit is not broadcast: that would be ambiguous.
    with pytest.raises(SpecError, match="image.units"):
        make_plan(DatasetInfo((2, 64, 64), "<u2", 2), spec(image={"axes": "tyx", "units": ["second"]}), MACHINE)


def test_regression_pass_peak_above_pause_threshold():
    """The worker's memory was taken from the pass with the largest pod limit, but another pass
    peaked higher: pass 1 at 2452 MiB against a memory_limit sized for pass 0 (2422 MiB), above its
    pause point. Found by a random search over large shapes (3 in 4000 plans)."""
    ds = DatasetInfo((815, 3560, 3613), "<f4", 4)
    s = spec(output={"chunks": [256, 256, 256]}, pyramid={"levels": 4}, resources={"workers": 6, "threadsPerWorker": 3})
    plan = make_plan(ds, s, BIG)
    assert len(plan.passes) > 1
    check_plan(plan, ds, s, BIG)
    m = plan.memory
    assert m.predicted_peak == max(p.predicted_peak for p in plan.passes)
    assert all(p.predicted_peak <= m.thresholds.planned * m.memory_limit for p in plan.passes)


def test_regression_small_plans_terminated_for_a_few_mib_of_baseline():
    """On a small plan the nanny's terminate threshold sat only 5 % (about 6 MiB) above the
    predicted peak, less than the interpreter baseline varies between installs: a fresh checkout,
    compiling bytecode in its workers, had them terminated in a loop. Small plans now keep a floor
    of room below the threshold; large plans keep the plain planned fraction (negative control)."""
    c = DEFAULT_CONSTANTS
    small = make_plan(DatasetInfo((16, 64, 64), "<u2", 2), spec(resources={"workers": 2}), MACHINE)
    m = small.memory
    assert m.thresholds.terminate * m.memory_limit - m.predicted_peak >= c.terminate_headroom_floor
    assert m.memory_limit > math.ceil(m.predicted_peak / c.planned_fraction / MiB) * MiB
    assert "of room below the terminate threshold" in m.memory_limit_why
    # Without the floor, the same plan has only a few MiB of room: what the floor is for.
    bare = make_plan(
        DatasetInfo((16, 64, 64), "<u2", 2),
        spec(resources={"workers": 2}),
        MACHINE,
        MemoryConstants(terminate_headroom_floor=0),
    )
    assert bare.memory.thresholds.terminate * bare.memory.memory_limit - bare.memory.predicted_peak < 8 * MiB
    # The headline case is large: the floor does not move it.
    big = make_plan(HEADLINE, headline_spec(), MACHINE).memory
    assert big.memory_limit == math.ceil(big.predicted_peak / c.planned_fraction / MiB) * MiB


def test_combined_worker_memory_still_fits_a_tight_budget():
    """Where the passes together overshoot, the planner re-plans under a lower budget."""
    ds = DatasetInfo((3789, 3926, 841), "<f4", 4)
    for budget in (900, 1200, 1700, 2500):
        s = spec(
            output={"chunks": [64, 64, 64]},
            resources={"workers": 2, "threadsPerWorker": 2, "memoryPerWorker": budget * MiB},
        )
        try:
            plan = make_plan(ds, s, BIG)
        except BudgetTooSmallError as exc:
            assert _replan(ds, s, BIG, memoryPerWorker=exc.minimum_bytes)
            continue
        check_memory(plan, s, BIG)
        check_notices(plan, ds)


# --- constants -------------------------------------------------------------------------------------


def test_constants_are_overridable_from_a_json_file(tmp_path, headline):
    path = tmp_path / "calibration.json"
    path.write_text(
        json.dumps({"interpreter_baseline": DEFAULT_CONSTANTS.interpreter_baseline + 100 * MiB, "nanny": 50 * MiB})
    )
    constants = MemoryConstants.from_file(path)
    assert constants.interpreter_baseline == DEFAULT_CONSTANTS.interpreter_baseline + 100 * MiB
    assert constants.nanny == 50 * MiB and constants.planned_fraction == DEFAULT_CONSTANTS.planned_fraction
    plan = make_plan(HEADLINE, headline_spec(), MACHINE, constants)
    terms = {t.name: t.bytes for t in plan.memory.terms}
    assert terms["interpreter"] == constants.interpreter_baseline
    # The baseline is outside the allocator's slack: the peak moves by exactly the override.
    assert plan.memory.predicted_peak == headline.memory.predicted_peak + 100 * MiB
    assert {t.name: t.bytes for t in plan.memory.pod_terms}["nanny"] == 50 * MiB


def test_constants_file_refuses_unknown_keys(tmp_path):
    path = tmp_path / "calibration.json"
    path.write_text(json.dumps({"interpreter_baseline": 1, "interpretor_baseline": 2}))
    with pytest.raises(SpecError) as info:
        MemoryConstants.from_file(path)
    assert info.value.field == "calibration"
    assert "Got unknown ['interpretor_baseline'] instead." in str(info.value)


def test_constants_file_must_be_json(tmp_path):
    path = tmp_path / "calibration.json"
    path.write_text("interpreter_baseline: 1")
    with pytest.raises(SpecError, match="calibration: Expected a readable JSON file of memory constants"):
        MemoryConstants.from_file(path)
    with pytest.raises(SpecError, match="calibration"):
        MemoryConstants.from_file(tmp_path / "missing.json")


def test_glibc_allocator_gets_more_slack(headline):
    plan = make_plan(HEADLINE, headline_spec(), MACHINE, allocator="glibc")
    slack = {t.name: t.bytes for t in plan.memory.terms}["allocator slack"]
    jemalloc = {t.name: t.bytes for t in headline.memory.terms}["allocator slack"]
    assert slack > jemalloc
    assert plan.allocator == "glibc"


# --- pyramids ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "ds, levels, axes, method",
    [
        (HEADLINE, 3, None, "mean"),
        (HEADLINE, "auto", None, "max"),
        (DatasetInfo((3, 2, 40, 512, 512), "<u2", 2), 4, "yx", "nearest"),
        (DatasetInfo((4096, 4096), "|u1", 1), "auto", None, "mean"),
    ],
)
def test_pyramid_plans_pass_the_oracle(ds, levels, axes, method):
    pyramid = {"levels": levels, "method": method} | ({"axes": axes} if axes else {})
    s = spec(pyramid=pyramid, resources={"workers": 2})
    plan = make_plan(ds, s, MACHINE)
    check_plan(plan, ds, s, MACHINE)
    if isinstance(levels, int):
        assert len(plan.levels) == levels
    # Level translations: mean/max move the voxel centre by half the block; nearest does not.
    top = plan.levels[-1]
    moved = [t for t, f in zip(top.translation, top.factors) if f > 1]
    assert all((t == 0) == (method == "nearest") for t in moved)


def test_auto_levels_stop_when_one_chunk_holds_the_smallest_level():
    plan = make_plan(HEADLINE, spec(output={"chunks": [64, 64, 64]}, resources={"workers": 2}), MACHINE)
    smallest = plan.levels[-1].shape
    above = plan.levels[-2].shape
    assert all(n <= c for n, c in zip(smallest, plan.chunks))
    assert any(n > c for n, c in zip(above, plan.chunks))


def test_empty_dimension_is_refused():
    with pytest.raises(
        Exception,
        match=r"source.dataset: Expected every dimension to hold at least one element. Got shape \(0, 10, 10\)",
    ):
        make_plan(DatasetInfo((0, 10, 10), "<u2", 2), spec(), MACHINE)


# --- uploads in flight to an object store (engine/stores/uploads.py) ------------------------------


def _upload_buffers(plan) -> int:
    return next(t.bytes for t in plan.memory.terms if t.name == "object store upload buffers")


def test_a_bucket_keeps_puts_in_flight_and_the_plan_counts_each():
    bucket = make_plan(
        HEADLINE, spec(output={"path": "s3://b/out.ome.zarr", "chunks": [64, 64, 64]}, pyramid={"levels": 1}), MACHINE
    )
    local = make_plan(HEADLINE, spec(output={"chunks": [64, 64, 64]}, pyramid={"levels": 1}), MACHINE)
    assert local.upload_depth == 0 and not any(t.name.startswith("object store") for t in local.memory.terms)
    # 1 MiB chunks: the window's most; each held whole with its request body (x2).
    assert bucket.upload_depth == 6
    unit = 64**3 * 4 + 16  # the encoded bound of one chunk (blosc's header)
    assert _upload_buffers(bucket) == bucket.threads_per_worker * (6 + 1) * 2 * unit
    # A user's choice replaces the planner's, and the plan follows it.
    one = make_plan(
        HEADLINE,
        spec(
            output={"path": "s3://b/o", "chunks": [64, 64, 64], "storageOptions": {"uploads_in_flight": "0"}},
            pyramid={"levels": 1},
        ),
        MACHINE,
    )
    assert one.upload_depth == 0 and _upload_buffers(one) == one.threads_per_worker * 2 * unit
    assert one.memory.predicted_peak < bucket.memory.predicted_peak


def test_large_shards_are_put_one_at_a_time():
    shards = make_plan(
        HEADLINE,
        spec(output={"path": "s3://b/o", "chunks": [64, 64, 64], "shards": [128, 128, 128]}, pyramid={"levels": 1}),
        MACHINE,
    )
    assert shards.upload_depth == 1  # 8 MiB shards: one in flight while the next is built
    big = make_plan(
        HEADLINE,
        spec(output={"path": "s3://b/o", "chunks": [64, 64, 64], "shards": [64, 256, 256]}, pyramid={"levels": 1}),
        MACHINE,
    )
    assert big.upload_depth == 0  # 16 MiB and above: synchronous, as before


def test_uploads_in_flight_must_be_a_small_count():
    for bad in ("33", "-1", "many"):
        with pytest.raises(SpecError, match="uploads_in_flight"):
            spec(output={"path": "s3://b/o", "storageOptions": {"uploads_in_flight": bad}})


def test_a_budget_too_small_for_uploads_in_flight_puts_one_at_a_time_and_says_so():
    def bucket(budget=None, **options):
        resources = {"workers": 2, "threadsPerWorker": 4, "slab": [64, 64, 2008]}
        if budget:
            resources["memoryPerWorker"] = budget
        return spec(
            output={"path": "s3://b/o", "chunks": [64, 64, 64], "storageOptions": options},
            pyramid={"levels": 1},
            resources=resources,
        )

    overlapped = make_plan(HEADLINE, bucket(), MACHINE)
    one_at_a_time = make_plan(HEADLINE, bucket(uploads_in_flight="0"), MACHINE)
    assert overlapped.upload_depth == 6 and overlapped.memory.pod_limit > one_at_a_time.memory.pod_limit
    between = f"{(overlapped.memory.pod_limit + one_at_a_time.memory.pod_limit) // 2 // MiB}Mi"
    plan = make_plan(HEADLINE, bucket(between), MACHINE)
    assert (
        plan.upload_depth == 0
        and plan.memory.pod_limit <= (overlapped.memory.pod_limit + one_at_a_time.memory.pod_limit) // 2
    )
    assert any("one PUT at a time" in n for n in plan.notices)
    # The user's own depth is kept: the refusal names it as a knob instead.
    with pytest.raises(BudgetTooSmallError, match="uploads_in_flight"):
        make_plan(HEADLINE, bucket(between, uploads_in_flight="6"), MACHINE)


# --- conversions that share the cluster (a batch's items in flight) ------------------------------


def test_an_item_beside_others_is_one_pass_of_one_slab_where_alone_it_is_several():
    """A 50 MB image on 2 workers: alone, the plan cuts it into slabs for both threads and leaves
    the lower levels to later passes (each re-reads the level above); beside another item, which
    fills the other thread, it reads the file once and builds the whole pyramid in memory."""
    ds = DatasetInfo((64, 442, 442), "<f4", 4)
    s = spec(output={"chunks": [64, 64, 64], "compressor": HEADLINE_COMPRESSOR}, resources={"workers": 2})
    alone = make_plan(ds, s, MACHINE)
    beside = make_plan(ds, s, MACHINE, at_once=2)
    for plan in (alone, beside):
        check_plan(plan, ds, s, MACHINE)
    assert [lv.shape for lv in beside.levels] == [lv.shape for lv in alone.levels] and len(alone.levels) == 4
    assert len(alone.passes) > 1 and alone.n_tasks > 2  # the negative control
    assert len(beside.passes) == 1 and beside.n_tasks == 1
    assert beside.passes[0].slab == ds.shape and beside.passes[0].levels == (0, 1, 2, 3)
    # Its memory is priced for the whole slab: more than alone, and still checked by the oracle.
    assert beside.memory.predicted_peak > alone.memory.predicted_peak
    # A share is of the threads: 8 threads beside one other item still want 4 slabs.
    wide = make_plan(
        DatasetInfo((256, 1024, 1024), "<f4", 4),
        s.model_copy(update={"resources": s.resources.model_copy(update={"workers": 8})}),
        BIG,
        at_once=2,
    )
    assert wide.passes[0].grid[0] * wide.passes[0].grid[1] * wide.passes[0].grid[2] >= 4
    with pytest.raises(ValueError, match="at_once"):
        make_plan(ds, s, MACHINE, at_once=0)


def test_a_user_slab_is_not_grown_for_more_levels_beside_other_items():
    """``resources.slab`` re-aligned up to build more levels in one pass is only done to keep every
    thread busy, in a batch as alone: the slab asked for is what the user's memory allows."""
    ds = DatasetInfo((32, 96, 80), "<f4", 4)
    s = spec(output={"chunks": [16, 64, 64]}, pyramid={"levels": 2}, resources={"workers": 2, "slab": [16, 96, 80]})
    for at_once in (1, 2):
        plan = make_plan(ds, s, MACHINE, at_once=at_once)
        assert plan.passes[0].slab == (16, 96, 80) and plan.passes[0].levels == (0,), at_once


def test_glibc_workers_are_planned_without_jemalloc_s_share_of_the_baseline():
    """The interpreter baseline is fitted to jemalloc workers (the image's allocator); glibc
    workers lack jemalloc's arenas, so their plans are that much lower, and nothing else moves."""
    s = spec(output={"chunks": [64, 64, 64]}, resources={"workers": 2})
    ds = DatasetInfo((64, 512, 512), "<u2", 2)
    je, gl = make_plan(ds, s, MACHINE, allocator="jemalloc"), make_plan(ds, s, MACHINE, allocator="glibc")
    for plan in (je, gl):
        check_plan(plan, ds, s, MACHINE)
    je_terms, gl_terms = ({t.name: t.bytes for t in p.memory.terms} for p in (je, gl))
    assert je_terms["interpreter"] == DEFAULT_CONSTANTS.interpreter_baseline
    assert je_terms["interpreter"] - gl_terms["interpreter"] == DEFAULT_CONSTANTS.jemalloc_baseline_share > 0
    assert [p.slab for p in je.passes] == [p.slab for p in gl.passes]
