"""CPU work of a conversion against the limit's, measured in one process: a figure a busy machine
does not distort much (process CPU time, not wall time), for issue 16.

    PYTHONPATH=src .venv/bin/python -m bench.cpu_work --scale 0.05 --cases f32,f32-sparse,u16-4d [--levels 1,3] [--repeat 3]

Every slab task of the planned conversion runs in this process, one after another (no Dask:
cluster start, scheduling and the memory monitor are left out), and the limit (bench.limit) runs
on the same input; each is timed with ``time.process_time``, the rounds interleaved, the least
kept. The ratio h5ngff CPU / limit CPU is the work h5ngff does beyond the limit's; on 2 quiet
cores the wall-time ratio adds parallel efficiency and Dask's share on top of it.
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time

from numcodecs import blosc
from h5ngff.backends.local import LocalBackend
from h5ngff.engine.write.driver import build_tasks, channel_windows
from h5ngff.engine.write.output import prepare_output
from h5ngff.engine.write.tasks import run_slab
from h5ngff.runner import plan_job
from h5ngff.spec import parse_spec

from .config import CHUNK, build_cases
from .data import ensure_input
from .limit import measure_limit


def h5ngff_cpu(source: str, dataset: str, out: str, levels: int, chunks: tuple[int, ...]) -> dict:
    # A Dask worker runs slab tasks off its main thread, where numcodecs gives blosc one internal
    # thread; here they run on the main thread, where blosc would use its global thread pool
    # (about 9 % more CPU per chunk on 2 cores). One thread, as in the workers and the limit.
    blosc.use_threads = False
    spec = parse_spec(
        {
            "source": {"path": source, "dataset": dataset},
            "output": {"path": out, "chunks": list(chunks)},
            "pyramid": {"levels": levels, "method": "mean"},
        }
    )
    job = plan_job(spec, LocalBackend())
    output = prepare_output(job.plan, job.spec, job.source)
    stages = {"read": 0.0, "write": 0.0, "downsample": 0.0}
    cpu0 = time.process_time()
    for index in range(len(job.plan.passes)):
        for task in build_tasks(job.plan, job.spec, output, index):
            result = run_slab(task)
            output.manifest.append([result.record])
            for k, v in result.seconds.items():
                stages[k] += v
    channels = job.plan.dataset.shape[job.plan.axes.index("c")] if "c" in job.plan.axes else 1
    channel_windows(output, channels)
    return {"cpu": time.process_time() - cpu0, "stages": stages, "tasks": job.plan.n_tasks}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.cpu_work")
    p.add_argument("--scale", type=float, default=0.05)
    p.add_argument("--cases", default="f32,f32-sparse,u16-4d")
    p.add_argument("--levels", default="1,3")
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--data-dir", default=os.path.join(os.path.dirname(__file__), "data"))
    args = p.parse_args(argv)
    cases = build_cases(args.scale)
    work = tempfile.mkdtemp(prefix="h5ngff-cpu-work-")
    try:
        for name in args.cases.split(","):
            case = cases[name]
            source, _ = ensure_input(case, args.scale, args.data_dir)
            chunks = case.chunks
            best: dict[str, float] = {}
            for number in range(args.repeat):
                # Fresh paths per round: the engine caches the directories it has made.
                limit = measure_limit(source, case.dataset, os.path.join(work, f"limit-{name}-{number}"), chunks)
                best["limit"] = min(best.get("limit", 1e9), limit["cpu_seconds"])
                for levels in (int(v) for v in args.levels.split(",")):
                    out = os.path.join(work, f"h5ngff-{name}-{levels}-{number}")
                    r = h5ngff_cpu(source, case.dataset, out, levels, chunks)
                    shutil.rmtree(out, ignore_errors=True)
                    key = f"h5ngff {levels} level(s)"
                    if r["cpu"] < best.get(key, 1e9):
                        best[key] = r["cpu"]
                        best[key + " stages"] = r["stages"]  # type: ignore[assignment]
            print(f"[{name}] {case.describe()}, chunks {CHUNK}^3, best of {args.repeat} (process CPU s):")
            print(f"  limit: {best['limit']:.2f} s")
            for key, value in best.items():
                if key != "limit" and not key.endswith("stages"):
                    stages = ", ".join(f"{k} {v:.2f}" for k, v in best[key + " stages"].items())  # type: ignore[union-attr]
                    print(
                        f"  {key}: {value:.2f} s = {value / best['limit']:.2f}x the limit's CPU (task wall stages: {stages})"
                    )
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
