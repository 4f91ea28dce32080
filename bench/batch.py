"""A batch of many files through one cluster against one ``h5ngff convert`` per file and against
the physical limit for the same bytes, in the same run (issue 30, docs/benchmarks.md).

    .venv/bin/python -m bench.batch [--files 200] [--mb 50] [--sample 10] [--repeat 1] [--result r.json]

The inputs: N files of M MB each, float32 contiguous and uint16 chunked-gzip alternating
(``h5ngff.sample``: smooth structure plus sensor noise, so they compress like real images; the
first 10 each with its own seed, the others copies of them), generated once and cached under
``--data-dir``. Every tool writes the benchmark's chunks and codec
(64 per axis, blosc zstd:5 bitshuffle) and the default pyramid (``--levels auto``) on the local
default backend. Measured, page cache warm before each:

1. the batch: ``h5ngff convert 'DIR/*.h5:/volume/data' 'OUT/{stem}.ome.zarr'``, one command, timed
   end to end (interpreter start and imports included, as for every separate run);
2. separate runs: ``h5ngff convert FILE:/volume/data OUT/STEM.ome.zarr`` once per file. With more
   files than ``--sample``, only a sample is run (evenly spread, both dtypes alike) and the total
   is extrapolated linearly (mean per run x N); the output says so;
3. the physical limit (bench/limit.py): read, extract, encode and write of every file, with the
   same pyramid floor as the batch's outputs, split over the cores (whole files, both dtypes in
   every part) in processes started together; the parts' mean, what an even split takes.
   Measured after each round's batch and once more at the end; the fastest is kept.

With ``--repeat R`` the rounds (batch, limit, separate runs) are interleaved and each keeps its
fastest round: other work on the machine can only slow a measurement down.

A sample of the batch's outputs and of the limit's is verified against the sources (level 0
exact, the levels below mean-exact: bench/verify.py), so neither can be fast by being wrong.
Targets: batch <= 0.2x the separate runs, and <= 1.3x the limit. Exit 0 when both are met.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import subprocess
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context

from h5ngff.sample import write_sample

from .config import CHUNK, CODEC_TEXT, REPO_DIR, Case, available_cores
from .data import warm_page_cache
from .limit import measure_limit
from .verify import verify

HERE = os.path.dirname(os.path.abspath(__file__))
TARGET_SEPARATE, TARGET_LIMIT = 0.2, 1.3
DATASET = "/volume/data"
FLAGS = ["--chunks", f"{CHUNK},{CHUNK},{CHUNK}", "--compressor", "zstd:5:bitshuffle"]
#: Bump when the generated files change, so cached inputs are rebuilt.
GENERATOR_VERSION = 2
#: Files generated with their own seed; the others are copies of them (the same dtype and layout):
#: generating 10 GB of sample data on 2 cores would take longer than the benchmark itself, and a
#: converter's work per file does not depend on which seed made it.
UNIQUE_FILES = 10


def file_case(index: int, mb: float) -> Case:
    """File ``index``: float32 contiguous when even, uint16 chunked gzip when odd; z is 64 (one
    chunk deep), y and x square (at least a chunk), M MB either way."""
    dtype, itemsize = ("float32", 4) if index % 2 == 0 else ("uint16", 2)
    yx = max(CHUNK, round(math.sqrt(mb * 1e6 / itemsize / CHUNK)))
    shape = (CHUNK, yx, yx)
    if index % 2 == 0:
        return Case(f"f32-{index}", "float32 contiguous", shape, dtype, "zyx", None, None)
    return Case(f"u16-{index}", "uint16 chunked gzip", shape, dtype, "zyx", (32, min(128, yx), min(128, yx)), "gzip")


def ensure_inputs(files: int, mb: float, data_dir: str) -> list[tuple[str, Case]]:
    """The N files (cached: a folder per N and M with a stamp written last)."""
    folder = os.path.join(data_dir, f"batch-{files}x{mb:g}MB")
    stamp = os.path.join(folder, "inputs.json")
    identity = {"generator": GENERATOR_VERSION, "files": files, "mb": mb}
    inputs = [(os.path.join(folder, f"cell_{i:04d}.h5"), file_case(i, mb)) for i in range(files)]
    try:
        with open(stamp) as f:
            if json.load(f) == identity:
                return inputs
    except (OSError, ValueError):
        pass
    os.makedirs(folder, exist_ok=True)
    print(
        f"generating {files} files of {mb:g} MB in {folder} ({min(files, UNIQUE_FILES)} distinct, the rest copies of them)",
        flush=True,
    )
    for i, (path, case) in enumerate(inputs):
        if i < UNIQUE_FILES:
            write_sample(
                path, DATASET, case.shape, case.dtype, chunks=case.hdf5_chunks, compression=case.compression, seed=i
            )
        else:  # a file of its own (its own inode and page cache) with the bytes of one of the same dtype
            shutil.copyfile(inputs[i % UNIQUE_FILES][0], path)
    with open(stamp, "w") as f:
        json.dump(identity, f)
    return inputs


def _h5ngff(*argv: str) -> tuple[float, subprocess.CompletedProcess]:
    cmd = [sys.executable, "-m", "h5ngff.cli", *argv]
    start = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False, cwd=REPO_DIR)
    took = time.perf_counter() - start
    if proc.returncode:
        raise SystemExit(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    return took, proc


def _warm(inputs: list[tuple[str, Case]]) -> None:
    for path, _ in inputs:
        warm_page_cache(path)


def _levels_of(output: str) -> int:
    with open(os.path.join(output, "zarr.json")) as f:
        return len(json.load(f)["attributes"]["ome"]["multiscales"][0]["datasets"])


def run_batch(inputs: list[tuple[str, Case]], out: str, in_flight: int | None = None) -> tuple[float, dict]:
    shutil.rmtree(out, ignore_errors=True)
    _warm(inputs)
    folder = os.path.dirname(inputs[0][0])
    extra = ["--items-in-flight", str(in_flight)] if in_flight else []
    took, proc = _h5ngff(
        "convert",
        f"{folder}/*.h5:{DATASET}",
        os.path.join(out, "{stem}.ome.zarr"),
        *FLAGS,
        *extra,
        "--json",
        "--no-progress",
    )
    return took, json.loads(proc.stdout)


def sample_indices(files: int, sample: int) -> list[int]:
    """Every file when there are at most ``sample``; else ``sample`` spread evenly, alternating
    even (float32) and odd (uint16) files so both dtypes are sampled alike."""
    if files <= sample:
        return list(range(files))
    picks = []
    for j in range(sample):
        i = j * files // sample
        if i % 2 != j % 2:
            i = i + 1 if i + 1 < files else i - 1
        picks.append(i)
    return sorted(set(picks))


def run_separate(inputs: list[tuple[str, Case]], picks: list[int], out: str) -> list[float]:
    shutil.rmtree(out, ignore_errors=True)
    os.makedirs(out)
    _warm([inputs[i] for i in picks])
    times = []
    for i in picks:
        path, _ = inputs[i]
        stem = os.path.splitext(os.path.basename(path))[0]
        took, _ = _h5ngff(
            "convert", f"{path}:{DATASET}", os.path.join(out, f"{stem}.ome.zarr"), *FLAGS, "--no-progress"
        )
        times.append(took)
    return times


def _limit_part(files: list[tuple[str, int]], out: str) -> dict:
    """One core's share of the limit: each file measured in turn (its own output)."""
    total = 0.0
    bytes_in = 0
    for path, levels in files:
        stem = os.path.splitext(os.path.basename(path))[0]
        r = measure_limit(path, DATASET, os.path.join(out, f"{stem}.zarr"), (CHUNK, CHUNK, CHUNK), levels=levels)
        total += r["total"]
        bytes_in += r["bytes_in"]
    return {"total": total, "bytes_in": bytes_in}


def run_limit(inputs: list[tuple[str, Case]], levels: list[int], cores: int, out: str) -> tuple[float, list[float]]:
    """The parts' mean; files go to parts in pairs (one float32, one uint16) so every part has both."""
    shutil.rmtree(out, ignore_errors=True)
    _warm(inputs)
    parts: list[list[tuple[str, int]]] = [[] for _ in range(cores)]
    for i, ((path, _), n) in enumerate(zip(inputs, levels)):
        parts[(i // 2) % cores].append((path, n))
    with ProcessPoolExecutor(max_workers=cores, mp_context=get_context("spawn")) as pool:
        results = list(pool.map(_limit_part, parts, [out] * cores))
    totals = [r["total"] for r in results]
    return sum(totals) / len(totals), totals


def verify_sample(
    inputs: list[tuple[str, Case]], picks: list[int], out: str, suffix: str, levels: list[int]
) -> str | None:
    """None when every sampled output is right, else the first problem."""
    for i in picks:
        path, case = inputs[i]
        stem = os.path.splitext(os.path.basename(path))[0]
        verdict = verify(os.path.join(out, stem + suffix), path, case, levels[i], "mean")
        if not verdict.ok:
            return f"{stem}{suffix}: {verdict.message}"
    return None


def _commit() -> str:
    proc = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=REPO_DIR, check=False
    )
    dirty = subprocess.run(
        ["git", "status", "--porcelain", "--untracked-files=no"],
        capture_output=True,
        text=True,
        cwd=REPO_DIR,
        check=False,
    )
    return (proc.stdout.strip() or "unknown") + ("+dirty" if dirty.stdout.strip() else "")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m bench.batch", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--files", type=int, default=200)
    ap.add_argument("--mb", type=float, default=50.0, help="Megabytes (1e6 bytes) of image data per file.")
    ap.add_argument(
        "--sample", type=int, default=10, help="Separate runs timed at most; with more files the total is extrapolated."
    )
    ap.add_argument("--repeat", type=int, default=1, help="Rounds (interleaved); each measurement keeps its fastest.")
    ap.add_argument(
        "--cores",
        type=int,
        default=available_cores(),
        help="Cores the limit is split over (default: this process's affinity).",
    )
    ap.add_argument(
        "--one-at-a-time",
        action="store_true",
        help="Also run the batch with --items-in-flight 1 each round (the default is 2): what the overlap gains.",
    )
    ap.add_argument("--data-dir", default=os.path.join(HERE, "data"))
    ap.add_argument("--work-dir", default=os.path.join(os.environ.get("TMPDIR", "/tmp"), "h5ngff-bench-batch"))
    ap.add_argument("--result", help="Write the figures as JSON here.")
    args = ap.parse_args(argv)
    if args.files < 2 or args.sample < 1 or args.repeat < 1:
        ap.error("Expected --files >= 2, --sample >= 1 and --repeat >= 1.")
    command = "python -m bench.batch " + " ".join(argv if argv is not None else sys.argv[1:])
    inputs = ensure_inputs(args.files, args.mb, args.data_dir)
    gb = sum(math.prod(c.shape) * (4 if c.dtype == "float32" else 2) for _, c in inputs) / 1e9
    work = args.work_dir
    os.makedirs(work, exist_ok=True)
    picks = sample_indices(args.files, args.sample)
    checked = sample_indices(args.files, min(args.sample, 4))

    # Rounds interleaved (batch, limit, separate runs), the limit once more at the end; each is
    # kept at its fastest round: other work on the machine can only slow a measurement down.
    batch_times: list[float] = []
    serial_times: list[float] = []
    limit_times: list[float] = []
    limit_parts: list[list[float]] = []
    separate_rounds: list[list[float]] = []
    problems: list[str] = []
    levels: list[int] = []
    summary: dict = {}
    for round_ in range(args.repeat):
        took, summary_now = run_batch(inputs, os.path.join(work, "batch"))
        batch_times.append(took)
        if round_ == 0:
            levels = [
                _levels_of(os.path.join(work, "batch", os.path.splitext(os.path.basename(p))[0] + ".ome.zarr"))
                for p, _ in inputs
            ]
            problems.append(verify_sample(inputs, checked, os.path.join(work, "batch"), ".ome.zarr", levels) or "")
        if took == min(batch_times):
            summary = summary_now
        shutil.rmtree(os.path.join(work, "batch"), ignore_errors=True)
        if args.one_at_a_time:
            serial_times.append(run_batch(inputs, os.path.join(work, "serial"), 1)[0])
            shutil.rmtree(os.path.join(work, "serial"), ignore_errors=True)
        limit_s, parts = run_limit(inputs, levels, args.cores, os.path.join(work, "limit"))
        limit_times.append(limit_s)
        limit_parts.append(parts)
        if round_ == 0:
            problems.append(verify_sample(inputs, checked, os.path.join(work, "limit"), ".zarr", levels) or "")
        shutil.rmtree(os.path.join(work, "limit"), ignore_errors=True)
        separate_rounds.append(run_separate(inputs, picks, os.path.join(work, "separate")))
        if round_ == 0:
            problems.append(
                verify_sample(
                    inputs,
                    [i for i in checked if i in picks] or picks[:1],
                    os.path.join(work, "separate"),
                    ".ome.zarr",
                    levels,
                )
                or ""
            )
        shutil.rmtree(os.path.join(work, "separate"), ignore_errors=True)
    limit_s, parts = run_limit(inputs, levels, args.cores, os.path.join(work, "limit"))
    limit_times.append(limit_s)
    limit_parts.append(parts)
    shutil.rmtree(os.path.join(work, "limit"), ignore_errors=True)

    batch_s, limit_s = min(batch_times), min(limit_times)
    separate = min(separate_rounds, key=sum)
    sampled = len(picks) < args.files
    per_run = sum(separate) / len(separate)
    separate_s = per_run * args.files
    vs_separate, vs_limit = batch_s / separate_s, batch_s / limit_s
    # Against what each item is held to: its plan, or the larger plan of an item that ran beside it.
    worst_peak = max((r["peak_rss"] / r["peak_bound"] for r in summary["results"] if r["peak_bound"]), default=0.0)
    beside = sum(1 for r in summary["results"] if r["ran_beside"])
    # The items' own times (each from planned to its output complete); with items in flight they overlap.
    items_s = sum(r["seconds"] for r in summary["results"])
    problems = [p for p in problems if p]
    ok = summary["status"] == "Succeeded" and not problems

    def rounds(times: list[float]) -> str:
        return ", ".join(f"{t:.2f}" for t in times)

    print(f"command: {command}")
    print(
        f"commit {_commit()}, {args.cores} core(s), load average {os.getloadavg()[0]:.1f} at the end, {args.repeat} round(s), fastest kept"
    )
    print(
        f"inputs: {args.files} files x {args.mb:g} MB ({gb:.3f} GB; float32 contiguous and uint16 chunked gzip alternating), "
        f"{CHUNK}^3 chunks, {CODEC_TEXT}, levels auto ({min(levels)}-{max(levels)}), local default backend"
    )
    print(
        f"  batch     {batch_s:8.2f} s  one command (rounds {rounds(batch_times)}), {summary['cluster_starts']} cluster start(s), "
        f"{summary['done']} done of {summary['items']}, {gb / batch_s:.3f} GB/s, {summary['items_in_flight']} item(s) in flight, "
        f"busiest worker at {worst_peak:.2f}x the plan it is held to"
    )
    print(
        f"            {items_s:8.2f} s  the items' own times summed (mean {items_s / len(summary['results']):.3f} s; "
        f"{beside} item(s) ran beside another)"
    )
    if serial_times:
        print(
            f"  one by one {min(serial_times):7.2f} s  the same batch with --items-in-flight 1 (rounds {rounds(serial_times)}): "
            f"{min(serial_times) / limit_s:.2f}x the limit"
        )
    how = (
        f"extrapolated from a sample of {len(picks)} runs (mean {per_run:.2f} s x {args.files})"
        if sampled
        else f"{len(picks)} runs, mean {per_run:.2f} s"
    )
    print(
        f"  separate  {separate_s:8.2f} s  {how}; rounds' totals {rounds([sum(r) / len(r) * args.files for r in separate_rounds])}"
    )
    print(
        f"  limit     {limit_s:8.2f} s  on {args.cores} cores (parts' mean; measured {rounds(limit_times)} s, "
        f"parts {'; '.join(rounds(p) for p in limit_parts)})"
    )
    met_separate, met_limit = vs_separate <= TARGET_SEPARATE, vs_limit <= TARGET_LIMIT
    print(
        f"  batch / separate = {vs_separate:.3f}  (target <= {TARGET_SEPARATE}: {'met' if met_separate else 'MISSED'})"
    )
    print(f"  batch / limit    = {vs_limit:.2f}  (target <= {TARGET_LIMIT}: {'met' if met_limit else 'MISSED'})")
    print(
        f"  outputs verified (files {', '.join(map(str, checked))}): "
        + ("; ".join(problems) if problems else "batch, limit and separate exact")
    )
    if args.result:
        with open(args.result, "w") as f:
            json.dump(
                {
                    "command": command,
                    "commit": _commit(),
                    "files": args.files,
                    "mb": args.mb,
                    "gb": gb,
                    "cores": args.cores,
                    "repeat": args.repeat,
                    "levels": levels,
                    "batch_seconds": batch_s,
                    "batch_rounds": batch_times,
                    "batch_items_seconds": items_s,
                    "items_in_flight": summary["items_in_flight"],
                    "items_beside_another": beside,
                    "one_at_a_time_rounds": serial_times,
                    "cluster_starts": summary["cluster_starts"],
                    "done": summary["done"],
                    "separate_seconds": separate_s,
                    "separate_sampled": sampled,
                    "separate_runs": separate,
                    "separate_rounds": separate_rounds,
                    "separate_picks": picks,
                    "limit_seconds": limit_s,
                    "limit_measurements": limit_times,
                    "limit_parts": limit_parts,
                    "batch_vs_separate": vs_separate,
                    "batch_vs_limit": vs_limit,
                    "worst_peak_vs_plan": worst_peak,
                    "problems": problems,
                    "ok": ok,
                },
                f,
                indent=1,
            )
    return 0 if ok and met_separate and met_limit else 1


if __name__ == "__main__":
    raise SystemExit(main())
