"""The benchmark harness at a tiny scale: it measures real processes, and its verification
catches a fast wrong result (the negative control), so a table it prints can be trusted."""

from __future__ import annotations

import json
import math
import os
import re
import sys
import textwrap

import numpy as np
import pytest
import zarr

from bench.cli import run_and_report
from bench.config import Case
from bench.measure import run_measured
from bench.peers.common import zarr_blosc
from bench.runs import DEFAULT_RUNS, RunSpec
from bench.suite import RunResult, SuiteConfig
from bench.verify import verify

from conftest import write_h5

pytestmark = pytest.mark.integration

SCALE = 0.002  # (150, 168, 90) float32, 9 MB

WRONG_PEER = """\
import h5py, zarr
from bench.peers.common import peer_main, zarr_blosc

def convert(args):
    with h5py.File(args.source, "r") as f:
        data = f[args.dataset][...]
    data[tuple(n // 2 for n in data.shape)] += 1  # one voxel off: fast, and wrong
    zarr.create_array(args.out, data=data, chunks=args.chunks, compressors=zarr_blosc(), fill_value=0)

raise SystemExit(peer_main(convert))
"""


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    """One tiny run: the limit, h5ngff (one level and a pyramid), tensorstore and a deliberately wrong peer."""
    tmp = tmp_path_factory.mktemp("bench")
    script = tmp / "wrong_peer.py"
    script.write_text(WRONG_PEER)
    runs = [r for r in DEFAULT_RUNS if r.id in ("h5ngff", "h5ngff-pyramid", "tensorstore")]
    runs.append(RunSpec("wrong", "wrong", "deliberately wrong copy", (str(script),)))
    cfg = SuiteConfig(
        scale=SCALE,
        cases=["f32"],
        runs=runs,
        data_dir=str(tmp / "data"),
        work_dir=str(tmp / "out"),
        results_dir=str(tmp / "results"),
        cores=2,
        timeout=120,
    )
    assert run_and_report(cfg, command="pytest smoke", started="smoke") == 0
    with open(tmp / "results" / "results.json") as f:
        data = json.load(f)
    return tmp / "results", data["cases"][0]


def _run(case: dict, run_id: str) -> dict:
    return next(r for r in case["runs"] if r["id"] == run_id)


@pytest.mark.slow
def test_limit_is_measured_per_stage_and_its_output_verified(smoke):
    _, case = smoke
    limit = case["limit"]
    assert all(limit["stages"][s] > 0 for s in ("read", "extract", "encode", "write"))
    assert limit["seconds"] == pytest.approx(limit["total"] / 2)
    # Measured before and after the tools; the faster measurement is the limit.
    assert len(limit["totals"]) == 2 and limit["total"] == min(limit["totals"])
    assert limit["ok"] and limit["verified"] == "L0 exact"
    # Real data compresses a few times over, not 1x (noise) and not 50x (zeros).
    assert 1.5 < limit["bytes_in"] / limit["bytes_out"] < 8


@pytest.mark.slow
def test_a_pyramid_run_is_set_against_the_pyramids_floor(smoke):
    """The floor of the pyramid is measured like the limit (before and after the tools, the faster
    kept; on one core and on 2 at once), verified mean-exact, and each pyramid run is reported
    against it."""
    results, case = smoke
    limit = case["limit"]
    assert limit["pyramid_levels"] == 3 and len(limit["pyramid_totals"]) == 2
    assert limit["pyramid_total"] == min(limit["pyramid_totals"]) and limit["pyramid_stages"]["downsample"] > 0
    assert limit["pyramid_parallel"] > 0
    pyramid = _run(case, "h5ngff-pyramid")
    assert pyramid["status"] == "ok" and pyramid["message"] == "L0 exact; L1-2 mean exact"
    table = (results / "results.md").read_text()
    floor = limit["pyramid_total"] / 2
    assert (
        f"against the 3-level pyramid's floor ({floor:.2f} s on 2 cores): h5ngff-pyramid {pyramid['seconds']:.2f} s"
        in table
    )
    assert "The floor of the 3-level mean pyramid" in table


@pytest.mark.slow
def test_tools_are_timed_measured_and_verified(smoke):
    _, case = smoke
    h5ngff, ts = _run(case, "h5ngff"), _run(case, "tensorstore")
    for r in (h5ngff, ts):
        assert r["status"] == "ok", r["message"]
        assert r["message"] == "L0 exact"
        assert 0 < r["seconds"] < r["wall"]
        assert r["ratio_limit"] == pytest.approx(r["seconds"] / case["limit"]["seconds"])
    # h5ngff runs Dask worker processes: each is measured, and the plan's prediction is recorded.
    assert h5ngff["memory"]["n_workers"] >= 1
    assert h5ngff["memory"]["peak_worker"] > 50e6
    assert h5ngff["extra"]["predicted_peak_per_worker"] > 0
    assert h5ngff["ratio_h5ngff"] == pytest.approx(1.0)
    assert ts["memory"]["peak_largest"] > 50e6


@pytest.mark.slow
def test_a_fast_wrong_result_is_failed_not_counted(smoke):
    results, case = smoke
    wrong = _run(case, "wrong")
    assert wrong["status"] == "FAILED"
    assert "differs from the source in 1 voxels" in wrong["message"]
    assert wrong["ratio_limit"] is None and wrong["ratio_h5ngff"] is None
    table = (results / "results.md").read_text()
    assert "**FAILED**: level 0 differs" in table
    assert (results / "plot.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def _pyramid(path, levels: list[np.ndarray]) -> str:
    root = zarr.open_group(str(path), mode="w")
    for i, data in enumerate(levels):
        root.create_array(str(i), data=data, chunks=tuple(min(64, n) for n in data.shape), compressors=zarr_blosc())
    root.attrs["ome"] = {
        "version": "0.5",
        "multiscales": [{"datasets": [{"path": str(i)} for i in range(len(levels))]}],
    }
    return str(path)


def test_pyramid_verification_tells_mean_from_nearest(tmp_path):
    """A pyramid level built by picking voxels is caught when the tool claims a mean."""
    case = Case("t", "test", (64, 96, 80), "float32", "zyx", None, None)
    rng = np.random.default_rng(1)
    data = (np.round(rng.random(case.shape) * 1024) / 1024).astype(np.float32)
    source = write_h5(tmp_path / "src.h5", data)
    mean = data.reshape(32, 2, 48, 2, 40, 2).astype(np.float64).mean(axis=(1, 3, 5)).astype(np.float32)
    good = verify(_pyramid(tmp_path / "good.zarr", [data, mean]), source, case, 2, "mean")
    nearest = verify(_pyramid(tmp_path / "nearest.zarr", [data, data[::2, ::2, ::2]]), source, case, 2, "mean")
    assert good.ok and good.message == "L0 exact; L1 mean exact"
    assert not nearest.ok and "level 1 differs from the mean" in nearest.message
    # Shape-only methods (gaussian) accept the same level, so the check above is the mean check.
    assert verify(_pyramid(tmp_path / "nearest2.zarr", [data, data[::2, ::2, ::2]]), source, case, 2, "shape").ok


@pytest.mark.slow
def test_memory_is_sampled_per_process(tmp_path):
    """A child that holds 300 MB is measured as such; its parent stays small."""
    code = textwrap.dedent("""
        import multiprocessing as mp, time
        def hold():
            block = b"\x01" * (300 << 20)  # touched, so resident (calloc pages would not be)
            time.sleep(0.5)
        if __name__ == "__main__":
            p = mp.get_context("spawn").Process(target=hold); p.start(); p.join()
    """)
    script = tmp_path / "hold.py"
    script.write_text(code)
    m = run_measured([sys.executable, str(script)], timeout=60, log_path=str(tmp_path / "log"))
    assert m.returncode == 0 and not m.timed_out
    child = max((p for p in m.procs if p.role == "child"), key=lambda p: p.peak_rss)
    main = next(p for p in m.procs if p.role == "main")
    assert child.peak_rss > 300 << 20
    assert main.peak_rss < 200 << 20
    assert m.peak_worker == child.peak_rss and m.tree_peak > 300 << 20


@pytest.mark.slow
def test_a_hung_tool_is_killed_at_the_timeout(tmp_path):
    script = tmp_path / "hang.py"
    script.write_text("import time\ntime.sleep(60)\n")
    m = run_measured([sys.executable, str(script)], timeout=1, log_path=str(tmp_path / "log"))
    assert m.timed_out and m.wall < 15
    assert (
        not os.path.exists(f"/proc/{m.procs[0].pid}") or open(f"/proc/{m.procs[0].pid}/stat").read().split()[2] == "Z"
    )


def _round(status: str, seconds: float | None, peak: int) -> RunResult:
    return RunResult("f32", "tool", "tool", "tool", 1, status, "", seconds=seconds, memory={"peak_largest": peak})


def test_repeated_rounds_keep_the_fastest_time_and_the_highest_memory():
    from bench.suite import combine_rounds

    best = combine_rounds([_round("ok", 20.0, 100), _round("ok", 15.0, 90), _round("ok", 18.0, 120)])
    assert best.seconds == 15.0 and best.rounds == [20.0, 15.0, 18.0]
    assert best.memory["peak_largest"] == 120  # memory is not allowed to look better by picking a round


def test_one_failed_round_fails_the_tool_however_fast_the_others_were():
    from bench.suite import combine_rounds

    result = combine_rounds([_round("ok", 10.0, 100), _round("FAILED", 5.0, 100)])
    assert result.status == "FAILED" and result.seconds == 5.0 and result.rounds == [10.0, 5.0]
    # Negative control: with every round ok the same rounds give an ok result.
    assert combine_rounds([_round("ok", 10.0, 100), _round("ok", 5.0, 100)]).status == "ok"


@pytest.mark.slow
@pytest.mark.parametrize("name", ["imaris", "bdv"])
def test_container_cases_are_verified_against_an_independent_reader(tmp_path, name):
    """The Imaris and BDV cases (issue 15): the generated container reads back, through its
    independent reader, as the image the verifier compares with; a copy that keeps Imaris's block
    padding or BDV's raw int16 is failed (the negative controls)."""
    from bench.config import build_cases
    from bench.containers import data_files, open_image
    from bench.data import ensure_input
    from bench.peers.common import source_array

    case = build_cases(SCALE)[name]
    source, meta = ensure_input(case, SCALE, str(tmp_path / "data"))
    assert [os.path.exists(p) for p in data_files(source)] == [True] * len(data_files(source))
    with source_array(source, case.dataset) as independent:
        expected = independent.compute()
    with open_image(source, case) as image:
        assert image.shape == case.shape == expected.shape and expected.dtype == np.uint16
        np.testing.assert_array_equal(image[(slice(None),) * 4], expected)
    assert 1.2 < meta["blosc_ratio"] < 6

    def copy(data: np.ndarray, out: str) -> str:
        zarr.create_array(str(tmp_path / out), data=data, chunks=case.chunks, compressors=zarr_blosc(), fill_value=0)
        return str(tmp_path / out)

    assert verify(copy(expected, "good.zarr"), source, case, 1, "mean").message == "L0 exact"
    import h5py

    with h5py.File(data_files(source)[-1], "r") as f:
        if name == "imaris":  # the stored blocks, padding included
            raw = np.stack([f[f"DataSet/ResolutionLevel 0/TimePoint 0/Channel {c}/Data"][...] for c in range(2)])
            bad = verify(copy(raw, "bad.zarr"), source, case, 1, "mean").message
            assert bad.startswith("level 0 is (2, 64, 128, 160) uint16, expected (2, 64, 92, 92)"), bad
        else:  # the stored int16, not BDV's uint16
            raw = np.stack([f[f"t00000/s{c:02d}/0/cells"][...] for c in range(2)])
            bad = verify(copy(raw, "bad.zarr"), source, case, 1, "mean").message
            assert bad.startswith("level 0 is (2, 64, 92, 92) int16, expected (2, 64, 92, 92) uint16"), bad


@pytest.mark.slow
@pytest.mark.parametrize(
    "shape, hdf5", [((150, 600, 90), {}), ((2, 40, 130, 70), {"chunks": (1, 32, 64, 64), "compression": "gzip"})]
)
def test_pyramid_limit_writes_every_level_exactly_and_times_the_halving(tmp_path, shape, hdf5):
    """The pyramid's floor is a real, verified pyramid (levels mean-exact, so it cannot be fast by
    being wrong), with every chunk of every level encoded and the halving timed apart."""
    import math

    from bench.limit import measure_limit

    axes = "zyx" if len(shape) == 3 else "czyx"
    case = Case("t", "test", shape, "uint16", axes, hdf5.get("chunks"), hdf5.get("compression"))
    rng = np.random.default_rng(2)
    data = rng.integers(0, 4000, size=shape, dtype=np.uint16)
    source = write_h5(tmp_path / "src.h5", data, **hdf5)
    chunks = case.chunks
    out = str(tmp_path / "limit.zarr")
    result = measure_limit(source, "/volume/data", out, chunks, levels=3)
    verdict = verify(out, source, case, 3, "mean")
    assert verdict.ok and verdict.message == "L0 exact; L1-2 mean exact", verdict.message
    assert result["stages"]["downsample"] > 0 and result["levels"] == 3
    level_shapes = [shape]
    for _ in range(2):
        level_shapes.append(tuple(n if i < len(shape) - 3 else -(-n // 2) for i, n in enumerate(level_shapes[-1])))
    assert result["chunks"] == sum(math.prod(-(-n // c) for n, c in zip(s, chunks)) for s in level_shapes)
    # The floor of one level is the same measurement as before: level 0 only, at the array's root.
    single = measure_limit(source, "/volume/data", str(tmp_path / "one.zarr"), chunks)
    assert (
        single["chunks"] == math.prod(-(-n // c) for n, c in zip(shape, chunks))
        and "downsample" not in single["stages"]
    )
    assert verify(str(tmp_path / "one.zarr"), source, case, 1, "mean").ok
    # Split over 2 processes, each builds the pyramid of its band of rows: together the same output.
    split = str(tmp_path / "split.zarr")
    parts = [measure_limit(source, "/volume/data", split, chunks, part=(i, 2), levels=3) for i in range(2)]
    assert sum(p["chunks"] for p in parts) == result["chunks"]
    assert verify(split, source, case, 3, "mean").message == "L0 exact; L1-2 mean exact"
    for k in range(3):
        assert np.array_equal(zarr.open_array(f"{split}/{k}")[...], zarr.open_array(f"{out}/{k}")[...])


# bench.scaling: the tail's list scheduling (pure) and one tiny measured run.


def _brute_force_makespan(durations: list[int], workers: int) -> int:
    """Step through time one unit at a time; a free worker takes the next task in order."""
    queue, left, t = list(durations), [0] * workers, 0
    while queue or any(left):
        for i in range(workers):
            if left[i] == 0 and queue:
                left[i] = queue.pop(0)
        t += 1
        left = [max(0, r - 1) for r in left]
    return t


def test_makespan_is_list_scheduling_in_the_given_order():
    from bench.scaling import makespan

    rng = np.random.default_rng(0)
    for _ in range(300):
        durations = [int(d) for d in rng.integers(1, 9, size=int(rng.integers(1, 12)))]
        workers = int(rng.integers(1, 6))
        assert makespan(durations, workers) == _brute_force_makespan(durations, workers)
    assert makespan([3.0] * 10, 4) == 9.0  # ceil(10 / 4) rounds of equal tasks
    assert makespan([2.0, 5.0, 1.0], 8) == 5.0  # more workers than tasks: the longest task
    assert makespan([2.0, 5.0, 1.0], 1) == 8.0  # one worker: the sum
    assert makespan([], 4) == 0.0
    with pytest.raises(ValueError):
        makespan([1.0], 0)
    # A worker that joins late (ready at 10) takes nothing while the other is free sooner.
    assert makespan([2.0, 2.0, 2.0], 2, ready=[0.0, 10.0]) == 6.0
    assert makespan([2.0, 2.0, 2.0], 2, ready=[0.0, 1.0]) == 4.0


def test_largest_first_and_passes():
    from bench.scaling import makespan_passes, tail_rows

    tasks = [(0, 1.0)] * 4 + [(0, 4.0)]  # the long task last: the classic bad order
    assert makespan_passes(tasks, 2, "submitted") == 6.0
    assert makespan_passes(tasks, 2, "largest-first") == 4.0
    # Passes are barriers: pass 1 starts when pass 0's last task ends.
    assert makespan_passes([(0, 3.0), (0, 1.0), (1, 2.0), (1, 2.0)], 2) == 3.0 + 2.0
    (row,) = tail_rows(tasks, [2])
    assert row["ideal"] == 4.0 and row["longest"] == 4.0
    assert row["submitted_x"] == 1.5 and row["largest_first_x"] == 1.0


def test_each_scaling_run_is_also_set_against_its_own_rounds_limit():
    """The machine's speed drifts between rounds: a run is set against the limit measured just
    before it, not only the least of all rounds."""
    from bench.scaling import paired_ratio

    limits = [{"cpu_seconds": 16.0}, {"cpu_seconds": 20.0}]
    second = {"round": 2, "cpu_exact": {"tree": 22.0}}
    assert paired_ratio(second, limits) == pytest.approx(1.1)
    assert paired_ratio({"round": 1, "cpu_exact": {"tree": 22.0}}, limits) == pytest.approx(1.375)
    assert paired_ratio(second, []) is None  # --no-limit


@pytest.mark.slow
def test_scaling_tool_accounts_every_process_and_stamps_the_fixed_costs(tmp_path):
    """One tiny conversion with 2 workers through bench.scaling, in its own process (it makes
    itself a child subreaper)."""
    import subprocess

    result = tmp_path / "scaling.json"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(["src", "."])}
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "bench.scaling",
            "--scale",
            str(SCALE),
            "--workers",
            "2",
            "--tail-workers",
            "1,2,64",
            "--data-dir",
            str(tmp_path / "data"),
            "--result",
            str(result),
        ],
        cwd=root,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert "#### 3. The tail" in done.stdout and "x its round's limit" in done.stdout
    doc = json.loads(result.read_text())
    assert doc["subreaper"] and doc["limit_cpu"] > 0
    (run,) = doc["runs"]
    assert run["returncode"] == 0 and run["verified"]["ok"]
    # Two workers and the fork server they are forked from (backends/forkserver.py), and one more
    # for each worker restarted (under load a nanny may restart one: the run still succeeds).
    workers = [p for p in run["processes"] if p["kind"] == "worker"]
    assert run["processes_by_kind"]["client"] == 1
    assert run["processes_by_kind"]["worker"] == 3 + run["worker_restarts"], workers
    exact = run["cpu_exact"]
    # The kernel's figures hold together: the tree contains the client and what it waited for;
    # the fork server and its workers are waited for by the tool, after the client: the rest.
    assert exact["tree"] >= exact["client_and_waited"] >= exact["client_self"] > 0
    # The workers' exact figure holds what was sampled of the workers (each up to its last poll).
    assert 0.1 < run["cpu_sampled_by_kind"]["worker"] <= exact["workers_waited"] + 0.05
    assert exact["workers_waited"] > 0.1  # the workers' imports alone
    # Sampled per process, each up to its last poll: never more than the exact total.
    assert 0 < run["cpu_sampled_total"] <= exact["tree"] + 0.05
    s = run["stamps"]
    # The stamps the tool and the client take on this machine's clock, each after the one before
    # in cause and effect, are in order whatever the load. The task stamps are the workers' compute
    # times as Dask corrects them by its estimate of each worker's clock offset: they are checked
    # only against each other (a loaded machine once put the last task end after the client's
    # next stamp, and a 50 ms allowance is a wall-clock order that load can change, issue 42).
    order = [
        "launched",
        "main",
        "cli_imported",
        "planned",
        "cluster_up",
        "cluster_closed",
        "metadata_written",
        "main_returned",
        "exited",
    ]
    stamps = [s[k] for k in order]
    assert all(b >= a for a, b in zip(stamps, stamps[1:])), list(zip(order, stamps))
    assert s["first_task_start"] <= s["last_task_end"]
    assert run["head"]["wall"] > 0 and run["tail"]["wall"] > 0 and 0 < run["head"]["cpu"] < exact["tree"]
    assert len(run["task_seconds"]) == run["plan"]["n_tasks"] == run["summary"]["slabs_written"]
    assert [r["workers"] for r in run["tail_rows"]] == [1, 2, 64]
    assert run["tail_rows"][0]["submitted"] == pytest.approx(sum(run["task_seconds"]))


@pytest.mark.slow
def test_batch_bench_times_the_batch_the_separate_runs_and_the_limit_on_the_same_files(tmp_path):
    """bench/batch.py at a tiny size: one cluster for the batch, the separate runs sampled and
    extrapolated (both dtypes in the sample), the limit measured twice, every output verified."""
    from bench import batch

    result = tmp_path / "batch.json"
    code = batch.main(
        [
            "--files",
            "4",
            "--mb",
            "1",
            "--sample",
            "2",
            "--data-dir",
            str(tmp_path / "data"),
            "--work-dir",
            str(tmp_path / "work"),
            "--result",
            str(result),
        ]
    )
    r = json.loads(result.read_text())
    assert code in (0, 1)  # the targets are not the smoke test's business at 4 MB
    assert r["ok"] and not r["problems"] and r["cluster_starts"] == 1 and r["done"] == 4
    assert r["separate_sampled"] and len(r["separate_runs"]) == 2 and {i % 2 for i in r["separate_picks"]} == {0, 1}
    assert r["separate_seconds"] == pytest.approx(sum(r["separate_runs"]) / 2 * 4)
    assert r["limit_seconds"] == min(r["limit_measurements"]) > 0 and len(r["limit_parts"][0]) == 2
    assert r["batch_vs_separate"] == pytest.approx(r["batch_seconds"] / r["separate_seconds"])
    assert r["command"].startswith("python -m bench.batch --files 4")
    assert not os.path.exists(tmp_path / "work" / "batch"), "the outputs are removed once verified"


def test_batch_bench_samples_both_dtypes_evenly():
    from bench.batch import file_case, sample_indices

    assert sample_indices(6, 10) == list(range(6))
    picks = sample_indices(200, 10)
    assert len(picks) == 10 and sum(i % 2 for i in picks) == 5 and picks[0] == 0 and picks[-1] >= 180
    assert [file_case(i, 50).dtype for i in (0, 1)] == ["float32", "uint16"]
    assert [math.prod(file_case(i, 50).shape) * (4, 2)[i] / 1e6 for i in (0, 1)] == [pytest.approx(50, rel=0.01)] * 2


@pytest.mark.slow
def test_idle_cost_reads_the_client_and_the_cluster_processes(capsys):
    from bench.idle_cost import main as idle_cost

    # 3 s: idle workers now use under 1 % of a core together, and the kernel counts CPU in 10 ms
    # ticks, so half a second could read 0.
    assert idle_cost(["--workers", "2", "--seconds", "3", "--rounds", "1"]) == 0
    line = capsys.readouterr().out.splitlines()[-1]
    # The fork server (or none, with spawned workers) and 2 workers at least, each figure a share of a core.
    match = re.search(r"client \(scheduler, nannies\) ([\d.]+) %, (\d+) other processes .* ([\d.]+) %", line)
    assert match, line
    client, processes, others = float(match[1]), int(match[2]), float(match[3])
    assert processes >= 2 and 0 < client < 100 and 0 < others < 100 * processes, line


@pytest.mark.slow
def test_task_cpu_counts_each_workers_tasks_inside_its_whole_cpu(tmp_path):
    """bench.task_cpu on a tiny file: every worker counted its slab tasks, and what the tasks
    spent is part of (never more than) what the kernel counted for the worker's process."""
    from bench.task_cpu import run_counted

    source = write_h5(tmp_path / "in.h5", np.arange(64 * 128 * 128, dtype="float32").reshape(64, 128, 128))
    run = run_counted(source, "/volume/data", str(tmp_path / "out.zarr"), (32, 32, 32), workers=2)
    assert len(run["workers"]) == 2
    assert sum(w["tasks"] for w in run["workers"].values()) >= 1, run  # a 4 MiB image is one slab
    for figures in run["workers"].values():
        assert 0 <= figures["cpu"] <= figures["process"], figures
        assert figures["process"] >= sum(figures["threads"].values()) - 0.05, figures  # ended threads are not listed
    assert sum(w["cpu"] for w in run["workers"].values()) > 0
    assert zarr.open_array(str(tmp_path / "out.zarr" / "0"), mode="r")[:].sum() == pytest.approx(
        float(np.arange(64 * 128 * 128, dtype="float64").sum()), rel=1e-6
    )
