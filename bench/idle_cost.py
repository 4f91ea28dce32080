"""What an idle embedded cluster costs: the local backend's session (sized by a real plan, its
workers forked or spawned as in a run) is started, left idle, and the CPU of the client process
(where a LocalCluster runs the scheduler and the nannies) and of every other process of the run
(workers, the fork server, multiprocessing's resource tracker) is read from the kernel over that
time. Everything it spends is Dask's housekeeping: periodic callbacks, heartbeats, monitors.

    PYTHONPATH=src .venv/bin/python -m bench.idle_cost [--workers 2] [--seconds 8] [--rounds 3]

Prints each round's figures in per cent of one core. Run it on a quiet machine, and alternate it
with the code it is compared with (a ``git worktree`` of the other commit): this is a few per cent
of a core, and a busy machine moves it as much.
"""

from __future__ import annotations

import argparse
import tempfile
import time

import psutil

from h5ngff.backends.local import LocalBackend

from .cluster_cost import tiny_plan


def _cpu(process: psutil.Process) -> float:
    try:
        times = process.cpu_times()
    except psutil.Error:
        return 0.0
    return times.user + times.system


def one_round(plan, seconds: float) -> dict[str, float]:
    me = psutil.Process()
    with LocalBackend().session(plan):
        time.sleep(1.0)  # the workers' first heartbeats and registrations are not idle time
        # Every descendant: the fork server is a child and forks the workers (spawned workers are
        # children of the nannies, in this process).
        others = me.children(recursive=True)
        before = {p.pid: _cpu(p) for p in [me, *others]}
        t0 = time.monotonic()
        time.sleep(seconds)
        elapsed = time.monotonic() - t0
        after = {p.pid: _cpu(p) for p in [me, *others]}
    client = after[me.pid] - before[me.pid]
    rest = sum(after[p.pid] - before[p.pid] for p in others)
    return {"client": 100 * client / elapsed, "others": 100 * rest / elapsed, "processes": len(others)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.idle_cost", description=__doc__.split("\n\n")[0])
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--seconds", type=float, default=8.0)
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="h5ngff-idle-cost-") as tmp:
        plan = tiny_plan(tmp, args.workers)
        print(f"idle {args.workers}-worker cluster, {args.seconds:g} s a round, % of one core:")
        for number in range(args.rounds):
            r = one_round(plan, args.seconds)
            print(
                f"  round {number + 1}: client (scheduler, nannies) {r['client']:.2f} %, "
                f"{r['processes']} other processes (workers, fork server, tracker) {r['others']:.2f} %"
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
