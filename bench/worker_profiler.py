"""What Dask's statistical profiler costs a conversion: the same conversion on the embedded
LocalCluster with the profiler on (Dask's default) and off (h5ngff's setting,
``backends.base.dask_memory_config``), rounds interleaved.

    .venv/bin/python -m bench.worker_profiler [--scale 0.05] [--cases f32,u16-4d] [--rounds 3]

Prints, per case and setting, the median wall time of ``run_job`` and the median CPU seconds of
the worker processes (their rusage, start-up included) and of this process (scheduler, nannies,
client). CPU seconds are the figure to read on a busy machine.
"""

from __future__ import annotations

import argparse
import os
import resource
import shutil
import statistics
import tempfile
import time

from h5ngff.backends import local
from h5ngff.backends.base import dask_memory_config
from h5ngff.runner import plan_job, run_job
from h5ngff.spec import parse_spec

from .config import build_cases
from .data import ensure_input


def _cpu(who: int) -> float:
    r = resource.getrusage(who)
    return r.ru_utime + r.ru_stime


def one_run(source: str, dataset: str, profiler: bool) -> dict[str, float]:
    local.dask_memory_config = lambda plan: {**dask_memory_config(plan), "distributed.worker.profile.enabled": profiler}
    work = tempfile.mkdtemp(prefix="h5ngff-profiler-")
    try:
        spec = parse_spec(
            {
                "source": {"path": source, "dataset": dataset},
                "output": {"path": f"{work}/out.ome.zarr"},
                "pyramid": {"levels": 1},
            }
        )
        backend = local.LocalBackend()
        job = plan_job(spec, backend)
        children, own, start = _cpu(resource.RUSAGE_CHILDREN), _cpu(resource.RUSAGE_SELF), time.perf_counter()
        run_job(job, backend)
        return {
            "wall": time.perf_counter() - start,
            "workers cpu": _cpu(resource.RUSAGE_CHILDREN) - children,
            "driver cpu": _cpu(resource.RUSAGE_SELF) - own,
        }
    finally:
        local.dask_memory_config = dask_memory_config
        shutil.rmtree(work, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.worker_profiler", description=__doc__.split("\n\n")[0])
    p.add_argument("--scale", type=float, default=0.05)
    p.add_argument("--cases", default="f32,u16-4d")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--data-dir", default=os.path.join(os.path.dirname(__file__), "data"))
    args = p.parse_args(argv)
    cases = build_cases(args.scale)
    print(
        f"{'case':8s} {'profiler':9s} {'wall s':>7s} {'workers CPU s':>14s} {'driver CPU s':>13s}   (median of {args.rounds})"
    )
    for name in args.cases.split(","):
        case = cases[name]
        source, _ = ensure_input(case, args.scale, args.data_dir)
        runs: dict[bool, list[dict[str, float]]] = {True: [], False: []}
        for _ in range(args.rounds):
            for profiler in (True, False):
                runs[profiler].append(one_run(str(source), case.dataset, profiler))
        for profiler, rounds in runs.items():
            med = {k: statistics.median(r[k] for r in rounds) for k in rounds[0]}
            print(
                f"{name:8s} {'on' if profiler else 'off':9s} {med['wall']:7.2f} {med['workers cpu']:14.2f} {med['driver cpu']:13.2f}"
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
