"""What a conversion pays for its embedded cluster: the local backend's session start (a
2-worker LocalCluster sized by a real plan, up and registered), the first task on every worker
(which imports the engine), and the session's close. The two exits side by side, rounds
interleaved: h5ngff's workers, which leave by ``os._exit`` once closed (``backends/worker_main``),
and workers that tear their interpreter down as Python normally does.

    .venv/bin/python -m bench.cluster_cost [--rounds 5]

Prints the median of each phase in seconds. Run it on a quiet machine: these are wall times.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from contextlib import contextmanager
from importlib.machinery import ModuleSpec
from typing import Iterator

import h5py
import numpy as np

from h5ngff.backends import local
from h5ngff.runner import plan_job
from h5ngff.spec import parse_spec

_fast_exit = local.workers_skip_main_module


@contextmanager
def _stock_exit() -> Iterator[None]:
    """The same guard, with a main module that does not skip the teardown."""
    with _fast_exit():
        main = sys.modules["__main__"]
        main.__dict__["__spec__"] = ModuleSpec("bench.stock_worker_main", None)
        yield


def _engine_loaded() -> bool:
    import h5ngff.engine.write.tasks  # noqa: F401  what a slab task's unpickling imports

    return True


def one_round(plan, exit_kind: str) -> dict[str, float]:
    local.workers_skip_main_module = _fast_exit if exit_kind == "h5ngff" else _stock_exit
    backend = local.LocalBackend()
    t0 = time.perf_counter()
    with backend.session(plan) as session:
        t1 = time.perf_counter()
        session.client.run(_engine_loaded)
        t2 = time.perf_counter()
    t3 = time.perf_counter()
    local.workers_skip_main_module = _fast_exit
    return {"start": t1 - t0, "first task": t2 - t1, "close": t3 - t2}


def tiny_plan(tmp: str, workers: int = 2):
    """A real plan of a tiny zero volume written in ``tmp``: sizes a cluster, converts in no time."""
    with h5py.File(f"{tmp}/in.h5", "w") as f:
        f.create_dataset("/volume/data", data=np.zeros((16, 64, 64), np.uint16))
    spec = parse_spec(
        {
            "source": {"path": f"{tmp}/in.h5", "dataset": "/volume/data"},
            "output": {"path": f"{tmp}/out.ome.zarr"},
            "resources": {"workers": workers},
        }
    )
    return plan_job(spec, local.LocalBackend()).plan


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.cluster_cost", description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=5)
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="h5ngff-cluster-cost-") as tmp:
        plan = tiny_plan(tmp)
        results: dict[str, list[dict[str, float]]] = {"h5ngff": [], "stock": []}
        for _ in range(args.rounds):
            for kind in results:
                results[kind].append(one_round(plan, kind))
    print(
        f"{'workers exit':16s} {'start s':>8s} {'first task s':>13s} {'close s':>8s}   (median of {args.rounds} rounds, 2 workers)"
    )
    for kind, rounds in results.items():
        med = {k: statistics.median(r[k] for r in rounds) for k in rounds[0]}
        label = "os._exit" if kind == "h5ngff" else "normal teardown"
        print(f"{label:16s} {med['start']:8.2f} {med['first task']:13.2f} {med['close']:8.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
