"""The plan prices the HDF5 read path the workers take ("Sources and memory, round three", item 6).

A dataset whose only filter is deflate is read chunk by chunk with ``read_direct_chunk`` and
libdeflate (engine.sources.inflate), which never fills HDF5's chunk cache. The planner is pure, so the
source description carries the engine's own decision (``engine.sources.inflate.direct_read``) as
``DatasetInfo.hdf5_direct_read``, and the plan prices a chunk cache only where HDF5's filter reads.
"""

from __future__ import annotations

import h5py
import numpy as np
import pytest

from conftest import requires_cgroups, smooth, spec_for
from h5ngff.engine.sources import inflate
from h5ngff.engine.sources import base as source_module
from h5ngff.engine.sources.hdf5 import inspect_source
from h5ngff.engine.sources import open_source
from h5ngff.planner import Capacity, DatasetInfo, make_plan
from h5ngff.planner.memory import DEFAULT_CONSTANTS
from h5ngff.units import MiB

pytestmark = pytest.mark.integration

ISSUE_SHAPE = (4, 64, 1024, 1024)
ISSUE_HDF5_CHUNKS = (1, 24, 100, 100)


def _issue_plan(direct: bool, allocator: str = "jemalloc"):
    """The issue's case: uint16 (4, 64, 1024, 1024), gzip chunks (1, 24, 100, 100), 3 levels."""
    ds = DatasetInfo(
        ISSUE_SHAPE, "<u2", 2, hdf5_chunks=ISSUE_HDF5_CHUNKS, hdf5_filters=("deflate",), hdf5_direct_read=direct
    )
    spec = spec_for(
        "in.h5", "out.ome.zarr", output={"chunks": [1, 64, 64, 64]}, pyramid={"levels": 3}, resources={"workers": 2}
    )
    return make_plan(ds, spec, Capacity(cores=2, memory_bytes=24 << 30), allocator=allocator)


def _hdf5_term(plan):
    return next(t for t in plan.passes[0].terms if t.name == "hdf5 cache and decompression")


@pytest.mark.parametrize("allocator", ["jemalloc", "glibc"])
def test_the_direct_chunk_path_is_priced_without_a_chunk_cache(allocator):
    """Same slab, both paths: HDF5's filter path keeps every chunk the slab cuts in its cache (and
    prices the filter's buffers on it); the direct path holds only one compressed and one inflated
    chunk per thread, and asks the workers for no cache at all."""
    filtered, direct = _issue_plan(False, allocator), _issue_plan(True, allocator)
    assert filtered.slab == direct.slab == (1, 64, 256, 1024)  # the slab cuts HDF5 chunks
    chunk = 24 * 100 * 100 * 2
    c = DEFAULT_CONSTANTS
    factor = c.hdf5_filtered_cache_factor if allocator == "jemalloc" else c.hdf5_filtered_cache_factor_glibc
    # h5py's filter path: the cache of every chunk the slab touches, at the filter's factor.
    assert filtered.hdf5_cache_bytes > 50 * MiB
    assert _hdf5_term(filtered).bytes == int(np.ceil(factor * filtered.hdf5_cache_bytes)) + c.hdf5_internal + 2 * chunk
    # The direct path: no cache; per thread (libdeflate inflates outside h5py's lock) two chunks.
    assert direct.hdf5_cache_bytes == 0
    assert _hdf5_term(direct).bytes == c.hdf5_internal + direct.threads_per_worker * 2 * chunk
    assert "libdeflate" in _hdf5_term(direct).why
    # The issue measured a busiest worker of 144.0 MiB on this plan (libdeflate): 247.9 MiB
    # predicted was 1.72x; the prediction must now be within 1.15x and still above it. The
    # filter path itself measured 245-250 MiB (round four): its plan must stay above that.
    if allocator == "jemalloc":
        assert 250.2 * MiB < filtered.memory.predicted_peak <= 1.15 * 245.3 * MiB
        assert 144.0 * MiB <= direct.memory.predicted_peak <= 1.15 * 144.0 * MiB
    assert direct.memory.pod_limit < filtered.memory.pod_limit


def test_without_straddling_both_paths_hold_the_same():
    """Where slabs hold whole HDF5 chunks there is no cache either way: the direct path differs
    only by its per-thread chunk buffers."""

    def plan(direct: bool, threads: int):
        ds = DatasetInfo(
            (2, 48, 512, 512),
            "<u2",
            2,
            hdf5_chunks=(1, 48, 512, 512),
            hdf5_filters=("deflate",),
            hdf5_direct_read=direct,
        )
        spec = spec_for(
            "in.h5",
            "out.ome.zarr",
            output={"chunks": [1, 48, 64, 64]},
            pyramid={"levels": 1},
            resources={"workers": 1, "threadsPerWorker": threads},
        )
        return make_plan(ds, spec, Capacity(cores=2, memory_bytes=24 << 30))

    chunk = 48 * 512 * 512 * 2
    assert plan(False, 1).hdf5_cache_bytes == plan(True, 1).hdf5_cache_bytes == 0
    assert _hdf5_term(plan(True, 1)).bytes == _hdf5_term(plan(False, 1)).bytes
    assert _hdf5_term(plan(True, 2)).bytes - _hdf5_term(plan(False, 2)).bytes == 2 * chunk


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("direct") / "in.h5")
    data = smooth((2, 30, 70, 90), "uint16", seed=5)
    with h5py.File(path, "w") as f:
        f.create_dataset("gzip", data=data, chunks=(1, 10, 16, 32), compression="gzip")
        f.create_dataset("shuffle", data=data, chunks=(1, 10, 16, 32), compression="gzip", shuffle=True)
        f.create_dataset("big", data=data.astype(">u2"), chunks=(1, 10, 16, 32), compression="gzip")
        f.create_dataset("plain", data=data, chunks=(1, 10, 16, 32))
        f.create_dataset("contiguous", data=data)
        f.create_dataset("c0", data=data[0], chunks=(10, 16, 32), compression="gzip")
        f.create_dataset("c1", data=data[1], chunks=(10, 16, 32), compression="gzip")
        f.create_dataset("s1", data=data[1], chunks=(10, 16, 32), compression="gzip", shuffle=True)
    return path, data


@pytest.mark.parametrize(
    ("name", "direct"), [("gzip", True), ("shuffle", False), ("big", False), ("plain", False), ("contiguous", False)]
)
def test_the_source_description_says_which_path_the_workers_take(files, name, direct, monkeypatch):
    """The planner's flag and the engine's read are one decision: read_slab goes through
    read_deflate exactly where inspect_source told the planner it would."""
    path, data = files
    info, _ = inspect_source(path, name)
    assert info.hdf5_direct_read is direct
    calls = []
    real = inflate.read_deflate
    monkeypatch.setattr(source_module, "read_deflate", lambda *a: (calls.append(a), real(*a))[1])
    region = (slice(0, 2), slice(3, 27), slice(5, 66), slice(7, 88))  # cuts chunks on every side
    source_module.close_files()
    got = source_module.read_plain(path, name, 0, region)
    np.testing.assert_array_equal(got, data[region])
    assert bool(calls) is direct
    source_module.close_files()


def test_switching_libdeflate_off_switches_the_plan_to_the_cache(files, monkeypatch):
    path, _ = files
    assert inspect_source(path, "gzip")[0].hdf5_direct_read
    monkeypatch.setenv(inflate.DISABLE_ENV, "1")
    assert not inspect_source(path, "gzip")[0].hdf5_direct_read


@pytest.mark.parametrize(("selection", "direct"), [("/c{0..1}", True), ("/mixed/c{0..1}", False)])
def test_stacked_pieces_are_direct_only_if_every_piece_is(files, selection, direct, tmp_path):
    path, _ = files
    if selection.startswith("/mixed"):  # a stack of one gzip and one shuffle+gzip piece
        with h5py.File(path, "a") as f:
            if "mixed" not in f:
                g = f.create_group("mixed")
                g["c0"] = f["c0"]
                g["c1"] = f["s1"]

    spec = spec_for(path, str(tmp_path / "o.ome.zarr"), dataset=selection)
    assert open_source(spec).info.hdf5_direct_read is direct


@pytest.mark.slow
@requires_cgroups
@pytest.mark.cgroup
@pytest.mark.parametrize("libdeflate", [True, False], ids=["direct chunks", "hdf5 filter"])
def test_a_gzip_source_stays_under_a_tight_plan_in_pod_limits(tmp_path_factory, tmp_path, libdeflate, monkeypatch):
    """Measured under enforced pod limits: the busiest worker stays under its prediction, and the
    prediction is within 1.2x of it on both read paths. Before, the direct path was priced for a
    chunk cache it never fills (the issue's case: 1.72x; this scaled-down one: about 1.3x)."""
    from h5ngff.backends.local import LocalPodsBackend
    from h5ngff.runner import plan_job, run_job

    if not libdeflate:
        monkeypatch.setenv(inflate.DISABLE_ENV, "1")  # inherited by the workers
    path = str(tmp_path_factory.mktemp("gzip-pod") / "in.h5")
    data = smooth((2, 48, 512, 512), "uint16", seed=6)
    with h5py.File(path, "w") as f:
        f.create_dataset("/volume/data", data=data, chunks=(1, 24, 100, 100), compression="gzip")
    out = str(tmp_path / "out.ome.zarr")
    spec = spec_for(path, out, output={"chunks": [1, 64, 64, 64]}, pyramid={"levels": 3}, resources={"workers": 1})
    backend = LocalPodsBackend()
    job = plan_job(spec, backend)
    assert job.plan.dataset.hdf5_direct_read is libdeflate
    assert (job.plan.hdf5_cache_bytes == 0) is libdeflate
    summary = run_job(job, backend)
    assert summary.status == "Succeeded"
    predicted = job.plan.memory.predicted_peak
    busiest = max(w.peak_rss for w in summary.workers)
    for w in summary.workers:
        assert w.oom_kills == 0 and w.memory_terminations == 0, w
    assert 0 < busiest <= predicted, f"measured {busiest / MiB:.1f} MiB > predicted {predicted / MiB:.1f} MiB"
    assert predicted <= 1.2 * busiest, f"predicted {predicted / MiB:.1f} MiB > 1.2 x measured {busiest / MiB:.1f} MiB"
