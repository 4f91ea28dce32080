"""Where a worker's CPU goes: inside the slab tasks, or in Dask around them. One real conversion
on the local backend; every worker counts the CPU its task threads spend in ``run_slab``
(``time.thread_time``), and at the end its whole process's CPU is read from the kernel (also
per thread, in the JSON-able figures ``run_counted`` returns). The limit (``bench.limit``) and the same slab work in one process without Dask
(``bench.cpu_work``) run before it on the same input, so the three compare within a minute.

    PYTHONPATH=src .venv/bin/python -m bench.task_cpu [--scale 1] [--workers 2] [--case f32] [--rounds 2]

What it answers: whether a Dask worker's slab tasks cost more CPU than the same tasks in one
process (they do not: docs/benchmarks.md), and how much a worker spends outside its tasks (its
start, heartbeats, comms). The client process (scheduler, nannies, planning) is bench.scaling's.
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import threading
import time
from contextlib import contextmanager
from typing import Any, Iterator

from distributed.diagnostics.plugin import WorkerPlugin

from h5ngff.backends.local import LocalBackend
from h5ngff.runner import plan_job, run_job
from h5ngff.spec import parse_spec

from .config import CODEC, build_cases
from .cpu_work import h5ngff_cpu
from .data import ensure_input
from .limit import measure_limit


class CountTaskCpu(WorkerPlugin):
    """Wraps ``run_slab`` in the worker: the driver submits it by reference (module and name),
    so the worker resolves the wrapped function when it unpickles each task."""

    name = "h5ngff-bench-task-cpu"

    def setup(self, worker: Any) -> None:
        import h5ngff.engine.write.tasks as tasks

        run_slab = tasks.run_slab
        counted = {"cpu": 0.0, "tasks": 0}
        lock = threading.Lock()

        def counting(task: Any) -> Any:
            start = time.thread_time()
            try:
                return run_slab(task)
            finally:
                with lock:
                    counted["cpu"] += time.thread_time() - start
                    counted["tasks"] += 1

        tasks.run_slab = counting
        worker.h5ngff_task_cpu = counted


def worker_figures(dask_worker: Any) -> dict[str, Any]:
    """This worker process's CPU (user + system, from the kernel), by thread name, and its tasks'."""
    tick = os.sysconf("SC_CLK_TCK")
    threads: dict[str, float] = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            with open(f"/proc/self/task/{tid}/comm") as f:
                name = f.read().strip()
        except OSError:  # a thread that ended meanwhile
            continue
        threads[name] = threads.get(name, 0.0) + (int(fields[11]) + int(fields[12])) / tick
    times = os.times()
    return {"process": times.user + times.system, "threads": threads, **dask_worker.h5ngff_task_cpu}


def run_counted(source: str, dataset: str, out: str, chunks: tuple[int, ...], workers: int) -> dict[str, Any]:
    spec = parse_spec(
        {
            "source": {"path": source, "dataset": dataset},
            "output": {"path": out, "chunks": list(chunks), "compressor": {"codec": "blosc", **CODEC}},
            "pyramid": {"levels": 1},
            "resources": {"workers": workers},
        }
    )
    backend = LocalBackend()
    job = plan_job(spec, backend)
    figures: dict[str, Any] = {}
    session = backend.session

    @contextmanager
    def counted_session(plan: Any) -> Iterator[Any]:
        with session(plan) as s:
            s.client.register_plugin(CountTaskCpu())
            yield s
            figures.update(s.client.run(worker_figures))

    backend.session = counted_session  # type: ignore[method-assign]
    start = time.perf_counter()
    summary = run_job(job, backend)
    if summary.status != "Succeeded":
        raise SystemExit(f"the conversion failed: {summary.status}")
    return {"wall": time.perf_counter() - start, "workers": figures}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.task_cpu")
    p.add_argument("--scale", type=float, default=1.0)
    p.add_argument("--case", default="f32")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--data-dir", default=os.path.join(os.path.dirname(__file__), "data"))
    args = p.parse_args(argv)
    case = build_cases(args.scale)[args.case]
    source, _ = ensure_input(case, args.scale, args.data_dir)
    work = tempfile.mkdtemp(prefix="h5ngff-task-cpu-")
    print(f"[{case.name}] {case.describe()}, {args.workers} workers, chunks {case.chunks}")
    print(
        "| round | limit CPU s | slab work in one process | Dask workers: in tasks | outside tasks | x the limit (in tasks / whole workers) |"
    )
    print("|---|---|---|---|---|---|")
    try:
        for number in range(1, args.rounds + 1):
            out = os.path.join(work, f"r{number}")
            limit = measure_limit(source, case.dataset, out + "-limit", case.chunks)["cpu_seconds"]
            alone = h5ngff_cpu(source, case.dataset, out + "-alone", 1, case.chunks)["cpu"]
            run = run_counted(source, case.dataset, out + "-dask", case.chunks, args.workers)
            in_tasks = sum(w["cpu"] for w in run["workers"].values())
            whole = sum(w["process"] for w in run["workers"].values())
            print(
                f"| {number} | {limit:.2f} | {alone:.2f} ({alone / limit:.2f}x) | {in_tasks:.2f} | {whole - in_tasks:.2f} "
                f"({len(run['workers'])} workers) | {in_tasks / limit:.2f}x / {whole / limit:.2f}x |",
                flush=True,
            )
            for name in os.listdir(work):
                shutil.rmtree(os.path.join(work, name), ignore_errors=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
