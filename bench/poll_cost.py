"""What one poll of the run's one sampler (``metrics.probes.ClusterPoller``) costs the client.

    .venv/bin/python -m bench.poll_cost [--workers 2] [--polls 40]

Two kinds of poll, on a real LocalCluster with h5ngff's plugins:

1. light, what every run does every 0.5 s for its report: each worker's RSS (``client.run``);
2. full, what a run with ``--metrics-port`` does instead: the scheduler's view, the worker probe
   (RSS, SpillBuffer, cgroup), and the exit and memory-restart events.

Prints the median and 90th percentile wall time of each, in milliseconds.
"""

from __future__ import annotations

import argparse
import logging
import os
import statistics
import tempfile
import time

import h5py
import numpy as np
from distributed import Client, LocalCluster

from h5ngff.backends.base import Session
from h5ngff.backends.diagnostics import process_memory, register_plugins
from h5ngff.backends.local import LocalBackend
from h5ngff.metrics.probes import ClusterPoller
from h5ngff.runner import plan_job
from h5ngff.spec import parse_spec


def _timings(fn, polls: int) -> tuple[float, float]:
    fn()  # warm: the first call ships the function
    times = []
    for _ in range(polls):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    times.sort()
    return statistics.median(times) * 1000, times[int(0.9 * (len(times) - 1))] * 1000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--polls", type=int, default=40)
    args = parser.parse_args()
    directory = tempfile.mkdtemp(prefix="h5ngff-poll-")
    source = os.path.join(directory, "in.h5")
    with h5py.File(source, "w") as f:
        f["data"] = np.zeros((16, 64, 64), np.uint16)
    spec = parse_spec(
        {"source": {"path": source, "dataset": "/data"}, "output": {"path": os.path.join(directory, "out.ome.zarr")}}
    )
    plan = plan_job(spec, LocalBackend()).plan
    with (
        LocalCluster(
            n_workers=args.workers,
            threads_per_worker=1,
            processes=True,
            dashboard_address=None,
            silence_logs=logging.ERROR,
        ) as cluster,
        Client(cluster, set_as_default=False) as client,
    ):
        register_plugins(client)
        poller = ClusterPoller(Session(client, "local"), plan)
        for label, fn in (
            ("light (report only)", lambda: client.run(process_memory, on_error="ignore")),
            ("full (metrics listening)", poller.poll),
        ):
            median, p90 = _timings(fn, args.polls)
            print(f"{label}: median {median:.1f} ms, p90 {p90:.1f} ms ({args.workers} workers, {args.polls} polls)")


if __name__ == "__main__":
    main()
