"""Batch conversions (docs/batch.md): many files through one planned cluster.

Real HDF5 files, real LocalClusters (worker processes), the real command in subprocesses, and
the outputs read back through zarr-python against the sources."""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import zarr
from distributed import Client

from conftest import smooth, write_h5
from h5ngff.backends.local import LocalBackend
from h5ngff.batch import run as batch_run
from h5ngff.batch.items import batch_items
from h5ngff.batch.items import BatchItem
from h5ngff.batch.run import COMPLETE, DONE, NOT_RUN, REFUSED, run_batch
from h5ngff.planner.memory import SLAB_BUFFERS_TERM
from h5ngff.errors import ExitCode
from h5ngff.spec import parse_spec

pytestmark = [pytest.mark.integration, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[1]
H5NGFF = [sys.executable, "-m", "h5ngff.cli"]
ENV = {**os.environ, "PYTHONPATH": str(ROOT / "src") + os.pathsep + os.environ.get("PYTHONPATH", "")}
FLAGS = ["--workers", "2", "--chunks", "16,64,64", "--levels", "2"]


def h5ngff(*argv, cwd=None, env=None, timeout=180) -> subprocess.CompletedProcess:
    return subprocess.run(
        [*H5NGFF, *map(str, argv)], capture_output=True, text=True, timeout=timeout, cwd=cwd, env=env or ENV
    )


@pytest.fixture
def runs(tmp_path):
    """Four small files of two dtypes (f32, and u16 gzip-chunked) and one that is not HDF5."""
    day = tmp_path / "runs" / "day1"
    day.mkdir(parents=True)
    for i in range(4):
        if i % 2:
            write_h5(day / f"cell_{i}.h5", smooth((32, 96, 80), "float32", seed=i))
        else:
            write_h5(
                day / f"cell_{i}.h5", smooth((32, 96, 80), "uint16", seed=i), chunks=(8, 48, 40), compression="gzip"
            )
    return tmp_path


def read_back(output: Path) -> np.ndarray:
    return zarr.open_group(str(output), mode="r")["0"][...]


def source_of(h5: Path) -> np.ndarray:
    import h5py

    with h5py.File(h5, "r") as f:
        return f["/volume/data"][...]


def test_a_bad_item_among_good_ones_fails_alone_and_the_exit_code_says_so(runs):
    (runs / "runs" / "day1" / "cell_9.h5").write_text("not HDF5")
    proc = h5ngff("convert", "runs/day1/*.h5:/volume/data", "out/{stem}.ome.zarr", *FLAGS, "--json", cwd=runs)
    assert proc.returncode == ExitCode.FAILED, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    summary = json.loads(proc.stdout)
    by_source = {r["source"]: r for r in summary["results"]}
    assert by_source["runs/day1/cell_9.h5:/volume/data"]["status"] == REFUSED
    assert by_source["runs/day1/cell_9.h5:/volume/data"]["reason"] == "SourceUnreadable"
    assert [by_source[f"runs/day1/cell_{i}.h5:/volume/data"]["status"] for i in range(4)] == [DONE] * 4
    assert summary["cluster_starts"] == 1 and summary["done"] == 4 and summary["refused"] == 1
    for i in range(4):
        np.testing.assert_array_equal(
            read_back(runs / "out" / f"cell_{i}.ome.zarr"), source_of(runs / "runs" / "day1" / f"cell_{i}.h5")
        )
    assert not (runs / "out" / "cell_9.ome.zarr").exists()
    # Every good item's peak is measured and stays under what it is held to: its plan, and what
    # an item in flight beside it holds (two at a time by default).
    for r in summary["results"][:4]:
        assert 0 < r["peak_rss"] <= r["peak_bound"], r
        assert r["peak_bound"] >= r["predicted_peak"] + (r["beside_bytes"] if r["ran_beside"] else 0), r
    # Negative control of the exit code: without the bad file, the same command exits 0, and a
    # re-run finds every item complete without starting a cluster.
    (runs / "runs" / "day1" / "cell_9.h5").unlink()
    again = h5ngff("convert", "runs/day1/*.h5:/volume/data", "out/{stem}.ome.zarr", *FLAGS, "--json", cwd=runs)
    assert again.returncode == 0, again.stderr[-3000:]
    second = json.loads(again.stdout)
    assert second["complete"] == 4 and second["cluster_starts"] == 0


def test_fail_fast_stops_at_the_first_refusal(runs):
    (runs / "runs" / "day1" / "cell_0.h5").write_text("not HDF5")
    proc = h5ngff(
        "convert", "runs/day1/*.h5:/volume/data", "out/{stem}.ome.zarr", *FLAGS, "--json", "--fail-fast", cwd=runs
    )
    assert proc.returncode == ExitCode.FAILED
    statuses = [r["status"] for r in json.loads(proc.stdout)["results"]]
    assert statuses == [REFUSED, NOT_RUN, NOT_RUN, NOT_RUN]
    assert not (runs / "out").exists()
    # The tables say what happened: it read "No item of 4 could be planned", three never tried.
    tables = h5ngff("convert", "runs/day1/*.h5:/volume/data", "out/{stem}.ome.zarr", *FLAGS, "--fail-fast", cwd=runs)
    said = " ".join(tables.stdout.split())
    assert "No cluster started: of 4 item(s), 1 refused, 3 not tried (--fail-fast stopped the batch)." in said, said


def test_two_sources_mapped_to_one_output_are_refused_before_anything_starts(runs):
    other = runs / "runs" / "day2"
    other.mkdir()
    write_h5(other / "cell_0.h5", smooth((8, 32, 32)))
    proc = h5ngff("convert", "runs/*/*.h5:/volume/data", "out/{stem}.ome.zarr", *FLAGS, cwd=runs)
    assert proc.returncode == ExitCode.BAD_INPUT, proc.stderr
    assert "both written to 'out/cell_0.ome.zarr'" in proc.stderr and "Traceback" not in proc.stderr
    assert not (runs / "out").exists()
    # Negative control: a template that tells them apart runs.
    ok = h5ngff(
        "convert", "runs/*/*.h5:/volume/data", "out/{parent}/{stem}.ome.zarr", *FLAGS, "--no-progress", cwd=runs
    )
    assert ok.returncode == 0, ok.stderr[-3000:]
    assert (runs / "out" / "day2" / "cell_0.ome.zarr" / "zarr.json").exists()


def test_a_kill_mid_batch_then_a_rerun_resumes_byte_identical(runs, tmp_path):
    env = {**ENV, "H5NGFF_FAULTS": "slab_sleep=0.3"}
    argv = [
        *H5NGFF,
        "convert",
        "runs/day1/*.h5:/volume/data",
        "out/{stem}.ome.zarr",
        *FLAGS,
        "--slab",
        "16,96,80",
        "--no-progress",
    ]
    proc = subprocess.Popen(
        argv, cwd=runs, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True
    )
    try:
        # Killed once the third item has begun writing: it starts only when one of the first two
        # (two items in flight) has ended, so one is complete, the third partial.
        deadline = time.monotonic() + 120
        while (
            not list((runs / "out" / "cell_2.ome.zarr").rglob("c/*"))
            and time.monotonic() < deadline
            and proc.poll() is None
        ):
            time.sleep(0.05)
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    rerun = h5ngff(
        "convert",
        "runs/day1/*.h5:/volume/data",
        "out/{stem}.ome.zarr",
        *FLAGS,
        "--slab",
        "16,96,80",
        "--json",
        cwd=runs,
    )
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    results = json.loads(rerun.stdout)["results"]
    assert {r["status"] for r in results} <= {COMPLETE, DONE} and COMPLETE in {r["status"] for r in results[:2]}
    assert (results[2]["status"], results[2]["resumed"]) == (DONE, True)  # it went on from its manifest
    assert results[3]["status"] == DONE  # not finished at the kill (perhaps begun: two in flight)
    # The same batch, never interrupted, elsewhere: every file of every output has the same bytes.
    fresh = h5ngff(
        "convert",
        "runs/day1/*.h5:/volume/data",
        str(tmp_path / "fresh" / "{stem}.ome.zarr"),
        *FLAGS,
        "--slab",
        "16,96,80",
        "--no-progress",
        cwd=runs,
    )
    assert fresh.returncode == 0, fresh.stderr[-3000:]
    for i in range(4):
        resumed, clean = runs / "out" / f"cell_{i}.ome.zarr", tmp_path / "fresh" / f"cell_{i}.ome.zarr"
        files = sorted(p.relative_to(clean) for p in clean.rglob("*") if p.is_file())
        assert files == sorted(p.relative_to(resumed) for p in resumed.rglob("*") if p.is_file())
        assert all((clean / f).read_bytes() == (resumed / f).read_bytes() for f in files), i


class CountingBackend(LocalBackend):
    """The real local backend, counting the clusters it starts."""

    def __init__(self):
        super().__init__()
        self.starts = 0

    def session(self, plan):
        self.starts += 1
        return super().session(plan)


def _remove(output: str) -> None:
    out = Path(output)
    for child in sorted(out.rglob("*"), reverse=True):
        child.unlink() if child.is_file() else child.rmdir()
    out.rmdir()


def _specs(runs: Path, sizes: dict[str, tuple[int, ...]]):
    day = runs / "sized"
    day.mkdir()
    for name, shape in sizes.items():
        write_h5(day / f"{name}.h5", smooth(shape, "float32"))
    items = batch_items([str(day / "*.h5") + ":/volume/data"], str(runs / "sized-out" / "{stem}.ome.zarr"))

    def spec_for(item):
        path, _, dataset = item.source.rpartition(":")
        return parse_spec(
            {"source": {"path": path, "dataset": dataset}, "output": {"path": item.output}, "resources": {"workers": 2}}
        )

    return items, spec_for


def _largest_slab_buffers(plan) -> int:
    """A worker's slab buffers in the plan's pass that holds the most."""
    return max(sum(t.bytes for t in p.terms if t.name == SLAB_BUFFERS_TERM) for p in plan.passes)


def test_one_cluster_start_per_batch_and_each_item_under_its_own_plan(runs, monkeypatch):
    """Items 16x apart in size, one at a time: the cluster is planned for the largest, started
    once, and each item's busiest worker stays under its own (smaller) plan: the workers drop an
    item's buffers when it ends."""
    items, spec_for = _specs(runs, {"a_big": (64, 512, 512), "b_small": (16, 128, 128), "c_small": (16, 128, 128)})
    backend = CountingBackend()
    broadcasts: Counter[str] = Counter()
    run = Client.run

    def counted(self, function, *args, **kwargs):
        broadcasts[function.__name__] += 1
        return run(self, function, *args, **kwargs)

    monkeypatch.setattr(Client, "run", counted)
    summary = run_batch(items, spec_for, backend, items_in_flight=1)
    assert [r.status for r in summary.results] == [DONE, DONE, DONE]
    assert backend.starts == summary.cluster_starts == 1
    # The flight's own round trips to every worker: one at the cluster's start, then one per item
    # (its release and the marks together), not one at each item's start and two at its end.
    assert broadcasts["reset_peak_rss"] == 1 and broadcasts["take_peak_rss"] == 3, broadcasts
    assert broadcasts["end_of_conversion"] == 0, broadcasts
    monkeypatch.setattr(Client, "run", run)
    assert summary.sizing is summary.results[0]
    big, small = summary.results[0].job.plan, summary.results[1].job.plan
    assert small.memory.predicted_peak < big.memory.predicted_peak and small.workers == big.workers
    for r in summary.results:
        assert r.beside == [] and r.peak_bound == r.predicted_peak
        assert 0 < r.peak_rss <= r.predicted_peak, (r.item.source, r.peak_rss, r.predicted_peak)
    # Negative control 1: the same items as separate conversions start one cluster each.
    separate = CountingBackend()
    for item in items:
        run_batch([item], spec_for, separate)
    assert separate.starts == 0  # all complete now: nothing to start...
    for item in items:
        _remove(item.output)
        run_batch([item], spec_for, separate)
    assert separate.starts == 3
    # Negative control 2: without the release when an item ends, a small item run after the big
    # one holds the big one's slab buffers. Measured against the small items' own peaks in the
    # run above, not their plan: a forked worker's interpreter holds less than the planned one
    # (pages it shares with the fork server and never touches), so the big buffers can fit in
    # the margin; the rise itself is what shows the buffers are held.
    clean_small = max(r.peak_rss for r in summary.results[1:])
    held = _largest_slab_buffers(big) - _largest_slab_buffers(small)
    assert held >= 8 * 2**20, (_largest_slab_buffers(big), _largest_slab_buffers(small))
    for item in items[1:]:
        _remove(item.output)
    monkeypatch.setattr(batch_run, "end_of_conversion", lambda conversion, keep=0: None)
    leaky = run_batch(
        [BatchItem(items[0].source, items[0].path, str(runs / "again.ome.zarr")), *items[1:]],
        spec_for,
        CountingBackend(),
        items_in_flight=1,
    )
    assert [r.status for r in leaky.results] == [DONE, DONE, DONE]
    assert min(r.peak_rss for r in leaky.results[1:]) >= clean_small + held // 2, (
        [r.peak_rss for r in leaky.results],
        clean_small,
        held,
    )


def test_two_items_in_flight_share_the_workers_under_the_larger_plan(runs, monkeypatch):
    """Two items at once (the default): the small ones run beside the big one, and each item's
    busiest worker stays under the larger plan of what ran with it plus what the other item holds
    between its slabs. The outputs are the same bytes as one at a time."""
    items, spec_for = _specs(runs, {"a_big": (64, 512, 512), "b_small": (16, 128, 128), "c_small": (16, 128, 128)})
    backend = CountingBackend()
    summary = run_batch(items, spec_for, backend)
    assert summary.items_in_flight == 2 and backend.starts == summary.cluster_starts == 1
    assert [r.status for r in summary.results] == [DONE, DONE, DONE]
    big, b_small, _ = summary.results
    assert b_small in big.beside and big in b_small.beside  # they did run at once
    # Each item was planned to share the threads: one pass (its file read once), where alone the
    # big one would take more (the negative control).
    for r in summary.results:
        assert [p.levels for p in r.job.plan.passes] == [tuple(range(len(r.job.plan.levels)))], r.item.source
    alone = run_batch([items[0]], spec_for, CountingBackend())  # complete already: planned, not run
    assert alone.items_in_flight == 2 and len(alone.results[0].job.plan.passes) > 1
    plans = [r.job.plan for r in summary.results]
    assert b_small.beside_bytes == batch_run.beside_allowance(plans) >= batch_run.ITEM_BESIDE_BASE
    assert b_small.peak_bound == big.predicted_peak + b_small.beside_bytes > b_small.predicted_peak
    for r in summary.results:
        assert 0 < r.peak_rss <= r.peak_bound, (r.item.source, r.peak_rss, r.peak_bound)
    # Four asked in flight with two items to run: each is held to one other item's allowance,
    # not three (the negative control: the bound the flight would give four running items).
    pair = [BatchItem(i.source, i.path, str(runs / "pair" / Path(i.output).name)) for i in items[1:]]
    two = run_batch(pair, spec_for, CountingBackend(), items_in_flight=4)
    assert [r.status for r in two.results] == [DONE, DONE] and all(r.beside for r in two.results)
    allowance = batch_run.beside_allowance([r.job.plan for r in two.results])
    assert [r.beside_bytes for r in two.results] == [allowance, allowance] != [3 * allowance] * 2
    # What the others hold must fit below Dask's terminate threshold, or the items run one by
    # one (negative control: chunk caches of 1 GiB do not fit).
    cluster = summary.sizing.job.plan
    assert batch_run.fitting_in_flight(2, cluster, plans, batch_run.BatchSummary([])) == 2
    huge = [dataclasses.replace(p, hdf5_cache_bytes=1 << 30) for p in plans]
    told = batch_run.BatchSummary([])
    assert batch_run.fitting_in_flight(2, cluster, huge, told) == 1 and "one at a time" in told.notices[0]
    # Run one at a time for that reason, the items are planned again to fill the threads alone.
    monkeypatch.setattr(batch_run, "ITEM_BESIDE_BASE", 1 << 30)
    fallback = run_batch(items, spec_for, CountingBackend())
    assert fallback.items_in_flight == 1 and any("one at a time" in n for n in fallback.notices)
    assert len(fallback.results[0].job.plan.passes) > 1
    one_by_one = [BatchItem(i.source, i.path, str(runs / "serial" / Path(i.output).name)) for i in items]
    run_batch(one_by_one, spec_for, CountingBackend(), items_in_flight=1)
    for two, one in zip(items, one_by_one):
        files = sorted(p.relative_to(one.output) for p in Path(one.output).rglob("*") if p.is_file())
        assert files and files == sorted(p.relative_to(two.output) for p in Path(two.output).rglob("*") if p.is_file())
        assert all((Path(one.output) / f).read_bytes() == (Path(two.output) / f).read_bytes() for f in files)


def test_a_conversionbatch_manifest_runs_locally_with_the_operator_s_items(runs):
    """``h5ngff batch BATCH.yaml``: the ConversionBatch one would kubectl apply, run here: each
    item's own output or the template's, the flags over every item, a re-run complete."""
    manifest = runs / "batch.yaml"
    manifest.write_text(
        "apiVersion: h5ngff.dev/v1alpha1\nkind: ConversionBatch\nmetadata: {name: local}\nspec:\n"
        "  items:\n"
        "    - source: {path: runs/day1/cell_0.h5, dataset: /volume/data}\n"
        "    - source: {path: runs/day1/cell_1.h5, dataset: /volume/data}\n"
        "      output: out/retake.ome.zarr\n"
        "  output: {path: 'out/{stem}.ome.zarr'}\n"
        "  itemsInFlight: 1\n"
    )
    proc = h5ngff("batch", manifest, *FLAGS, "--json", cwd=runs)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads(proc.stdout)
    assert summary["items_in_flight"] == 1  # the manifest's (the flag would win)
    assert [(r["output"], r["status"]) for r in summary["results"]] == [
        ("out/cell_0.ome.zarr", DONE),
        ("out/retake.ome.zarr", DONE),
    ]
    np.testing.assert_array_equal(
        read_back(runs / "out" / "retake.ome.zarr"), source_of(runs / "runs" / "day1" / "cell_1.h5")
    )
    again = h5ngff("batch", manifest, *FLAGS, "--json", "--items-in-flight", "3", cwd=runs)
    assert again.returncode == 0 and json.loads(again.stdout)["complete"] == 2, again.stderr[-3000:]
    assert json.loads(again.stdout)["items_in_flight"] == 3
    # Negative control: a ConversionJob is not a batch, and the message says which kind it wants.
    job = runs / "job.yaml"
    job.write_text("apiVersion: h5ngff.dev/v1alpha1\nkind: ConversionJob\nmetadata: {name: j}\nspec: {}\n")
    wrong = h5ngff("batch", job, cwd=runs)
    assert (
        wrong.returncode == ExitCode.BAD_INPUT
        and "kind: ConversionBatch" in wrong.stderr
        and "Traceback" not in wrong.stderr
    )


def test_items_are_charged_the_pods_figures_of_the_segments_they_ran_in():
    """Pod emulation's own figures (batch/run.py, ``Session.take_segment``) go to the items
    running in each segment: peaks the highest, counts added. A round trip that fails at an
    item's end (a dying cluster) still ends the segment: its kill is that item's, not the next
    one's."""

    from h5ngff.backends.diagnostics import ClusterEvents, WorkerReport

    MiB = 1 << 20
    segments = iter(
        [
            {
                "w0": WorkerReport(
                    "w0", peak_rss=300 * MiB, pod_pinned_peak=250 * MiB, cgroup_peak=320 * MiB, oom_kills=1
                )
            },
            {"w0": WorkerReport("w0", peak_rss=90 * MiB, pod_pinned_peak=80 * MiB, oom_kills=1, nanny_restarts=1)},
            {"w0": WorkerReport("w0", peak_rss=60 * MiB, pod_pinned_peak=50 * MiB, cgroup_peak=70 * MiB)},
        ]
    )
    failing = {"now": False}

    class Client:
        status = "running"

        def run(self, function, release=None, on_error="raise"):
            if failing["now"]:
                raise OSError("the cluster is going")
            return {"tcp://w0": {"name": "w0", "peak_rss": 0}}

    flight = batch_run._Flight(None, None, None, batch_run.BatchSummary([]), batch_run.BatchHooks(), None)
    flight.session = SimpleNamespace(client=Client(), take_segment=lambda: next(segments))

    def item(output, events=()):
        result = batch_run.ItemResult(BatchItem("in.h5:/data", "in.h5", output))
        plan = SimpleNamespace(passes=[], threads_per_worker=1)
        result.job = SimpleNamespace(spec=SimpleNamespace(output=SimpleNamespace(path=output)), plan=plan)
        # What run_job's worker_reports gave: the session's figures since the pods started.
        whole = WorkerReport("w0", peak_rss=300 * MiB, predicted_peak=100 * MiB, oom_kills=5, pod_pinned_peak=250 * MiB)
        result.summary = SimpleNamespace(workers=[whole], events=ClusterEvents(exits=list(events)))
        flight._on_cluster.add(result)
        return result

    original = batch_run.end_of_conversion
    try:
        batch_run.end_of_conversion = lambda conversion, keep=0: None
        # Dask saw the last item's worker exit (its nanny restarted it) after the pods' segment
        # ended: the item's own count stands.
        big, small = item("big"), item("small")
        last = item("last", events=[{"name": "w0", "exitcode": -9}])
        with flight.lock:
            flight._begin(big)
            flight._begin(small)
        flight._end(big)  # segment 1: both were running
        failing["now"] = True
        flight._end(small)  # segment 2, although the round trip failed
        failing["now"] = False
        with flight.lock:
            flight._begin(last)
        flight._end(last)  # segment 3
    finally:
        batch_run.end_of_conversion = original
    (b,), (s,), (t,) = (r.summary.workers for r in (big, small, last))
    assert (b.peak_rss, b.pod_pinned_peak, b.oom_kills) == (300 * MiB, 250 * MiB, 1)
    # Both segments' kills (added, not the higher), the highest of their peaks.
    assert (s.peak_rss, s.pod_pinned_peak, s.oom_kills, s.nanny_restarts) == (300 * MiB, 250 * MiB, 2, 1)
    assert s.cgroup_peak == 320 * MiB and s.predicted_peak == 100 * MiB  # its own plan's figure stays
    assert (t.peak_rss, t.pod_pinned_peak, t.oom_kills, t.cgroup_peak) == (60 * MiB, 50 * MiB, 0, 70 * MiB)
    assert t.nanny_restarts == 1
    # Negative control: without segments (a backend with no figures of its own) an item keeps the
    # whole session's figures it was given.
    plain = batch_run._Flight(None, None, None, batch_run.BatchSummary([]), batch_run.BatchHooks(), None)
    plain.session = SimpleNamespace(client=Client(), take_segment=None)
    flight = plain
    try:
        batch_run.end_of_conversion = lambda conversion, keep=0: None
        alone = item("alone")
        with plain.lock:
            plain._begin(alone)
        plain._end(alone)
    finally:
        batch_run.end_of_conversion = original
    assert alone.summary.workers[0].oom_kills == 5 and alone.summary.workers[0].peak_rss == 300 * MiB


def test_a_batch_item_sees_the_session_with_the_counts_it_started_with():
    """Each item's cluster is a view of the batch's session whose ``reports_before`` hold the
    backend's figures as the item started: read again first where the backend reads local files
    (pod emulation), copies so later counts are not taken as the baseline."""
    from h5ngff.backends.base import Session
    from h5ngff.backends.diagnostics import WorkerReport

    reports = {"pod-0": WorkerReport("pod-0", oom_kills=1)}
    refreshed: list[int] = []

    def refresh():
        refreshed.append(1)
        reports["pod-0"].oom_kills = 2  # a kill read at the item's start

    session = Session(None, "local-pods", reports, refresh, take_segment=dict)
    flight = batch_run._Flight(None, None, None, batch_run.BatchSummary([]), batch_run.BatchHooks(), None)
    flight.session = session
    result = batch_run.ItemResult(BatchItem("in.h5:/data", "in.h5", "out.ome.zarr"))
    with flight._cluster_for(result)() as view:
        assert refreshed == [1] and view.reports_before["pod-0"].oom_kills == 2
        reports["pod-0"].oom_kills = 3  # the item's own kill
        assert view.reports_before["pod-0"].oom_kills == 2 and view.client is session.client
        assert view.extra_reports is reports  # the backend's figures themselves, read on
    assert result in flight._on_cluster
    # Negative control: a backend with no figures of its own to read (no segments) is not read
    # again at each item's start (SLURM's would cost a round trip to every worker).
    refreshed.clear()
    flight.session = Session(None, "slurm", reports, refresh)
    with flight._cluster_for(batch_run.ItemResult(BatchItem("b.h5:/d", "b.h5", "b.ome.zarr")))() as view:
        assert refreshed == [] and view.reports_before["pod-0"].oom_kills == 3


def test_worker_reports_count_a_batch_items_kills_from_its_start():
    """A batch item's view of the session (``reports_before``) takes the counts the pods had when
    the item started off its own, so its failure's message does not count an earlier item's kills."""
    from h5ngff.backends.base import Session
    from h5ngff.backends.diagnostics import ClusterEvents, WorkerReport

    pods = {"pod-0": WorkerReport("pod-0", oom_kills=3, nanny_restarts=4, memory_terminations=1, pod_restarts=1)}
    before = {"pod-0": WorkerReport("pod-0", oom_kills=2, nanny_restarts=4, memory_terminations=0, pod_restarts=1)}
    plan = SimpleNamespace(memory=SimpleNamespace(predicted_peak=1, memory_limit=2, pod_limit=3))
    (mine,) = Session(None, "local-pods", pods, reports_before=before).worker_reports(plan, {}, ClusterEvents())
    assert (mine.oom_kills, mine.nanny_restarts, mine.memory_terminations, mine.pod_restarts) == (1, 0, 1, 0)
    assert pods["pod-0"].oom_kills == 3  # the session's own report is not touched
    # Negative control: the session as a single run sees it, from the pods' start.
    (whole,) = Session(None, "local-pods", pods).worker_reports(plan, {}, ClusterEvents())
    assert whole.oom_kills == 3 and whole.nanny_restarts == 4


def test_the_ending_item_is_charged_the_segment_its_end_reads_and_a_failed_release_still_reads_it():
    """An item's end reads the workers' marks after its release: that segment is the item's own
    last one, so its peak must go to the item too (one at a time, nothing else is running), and a
    release that fails on a worker must not lose the mark (it is reported beside it)."""

    calls: list[dict] = []

    class Client:
        def run(self, function, release=None, on_error="raise"):
            calls.append({"function": function.__name__, "on_error": on_error})
            figures = function(release=release)  # this process stands in for the worker
            return {"tcp://w0": {**figures, "name": "w0", "peak_rss": 123 << 20}}

    flight = batch_run._Flight(None, None, None, batch_run.BatchSummary([]), batch_run.BatchHooks(), None)
    flight.session = SimpleNamespace(client=Client(), take_segment=None)  # no figures of its own (not pods)

    def item(output):
        worker = SimpleNamespace(name="w0", peak_rss=0)
        result = batch_run.ItemResult(BatchItem("in.h5:/data", "in.h5", output))
        result.job = SimpleNamespace(spec=SimpleNamespace(output=SimpleNamespace(path=output)), plan=None)
        result.summary = SimpleNamespace(workers=[worker])
        return result, worker

    released: list[str] = []
    original = batch_run.end_of_conversion
    try:
        batch_run.end_of_conversion = lambda conversion, keep=0: released.append(conversion)
        first, worker = item("a.ome.zarr")
        with flight.lock:
            flight._begin(first)
        flight._on_cluster.add(first)
        flight._end(first)
        assert released == ["a.ome.zarr"] and worker.peak_rss == 123 << 20, (released, worker)
        assert calls[-1] == {"function": "take_peak_rss", "on_error": "return"}

        def broken(conversion, keep=0):
            raise OSError("no such thing")

        batch_run.end_of_conversion = broken
        second, worker = item("b.ome.zarr")
        with flight.lock:
            flight._begin(second)
        flight._on_cluster.add(second)
        flight._end(second)
        assert worker.peak_rss == 123 << 20  # the mark was read all the same
        # Negative control: an item that never ran on the cluster is charged nothing.
        third, worker = item("c.ome.zarr")
        with flight.lock:
            flight._begin(third)
        flight._end(third)
        assert worker.peak_rss == 0 and len(calls) == 2
    finally:
        batch_run.end_of_conversion = original
