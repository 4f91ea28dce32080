"""The client process of a ``bench.scaling`` run: ``h5ngff convert`` exactly as its console
script runs it (``h5ngff.entry.main``: the workers' fork server started early, then the CLI),
with timestamps and a task recorder attached from outside, so that no h5ngff source changes:

    python -m bench.scaling_client RECORD.json convert SRC:/volume/data OUT --json --workers 2 ...

What is added, all in this (the client's) process:

* the wall clock (epoch seconds) when ``__main__`` starts (the interpreter is up, h5ngff not yet
  imported), when planning is done (``runner.run_job`` entered), when the cluster is up
  (``runner.run_conversion`` entered), when every slab has come back (``runner._collect_workers``
  entered, the cluster still up), when the cluster has closed (``runner.finish`` entered), when
  the metadata is written (``runner.finish`` returned) and when ``main`` returns;
* a scheduler plugin (the scheduler of the embedded cluster runs in this process), installed
  with ``client.run_on_scheduler`` before the first slab is submitted. It keeps, per task, the
  order in which the scheduler first saw it (the submitted order) and the worker's own
  ``startstops`` of the ``compute`` action (epoch seconds on the worker, the same clock on one
  machine): when the slab function started and stopped running;
* the names of this process's threads (``native_id`` -> name), so ``bench.scaling`` can tell the
  event-loop thread (scheduler, nannies and the client's comms share it) from the main thread;
* ``getrusage`` of this process and of its waited-for children (the workers, which the nannies
  join) when ``main`` returns.

The record is written when ``main`` returns; the process then exits as the console script does
(``sys.exit``), interpreter teardown included. ``BENCH_SCALING_LATE_SERVER=1`` is the control for
the early fork server: the first worker starts it, as before the entry point did.
"""

from __future__ import annotations

import time

T_MAIN = time.time()  # noqa: E402  (before every import below: they are part of the start-up)

import json  # noqa: E402
import os  # noqa: E402
import resource  # noqa: E402
import sys  # noqa: E402
import threading  # noqa: E402
from typing import Any  # noqa: E402

from distributed.diagnostics.plugin import SchedulerPlugin  # noqa: E402

PLUGIN_NAME = "bench-scaling-task-recorder"


class TaskRecorder(SchedulerPlugin):
    """Submitted order and compute start/stop of every task the scheduler sees."""

    name = PLUGIN_NAME

    def __init__(self) -> None:
        self.order: dict[str, tuple[int, float]] = {}
        self.finished: list[dict[str, Any]] = []

    def transition(self, key, start, finish, *args, stimulus_id=None, **kwargs) -> None:  # type: ignore[override]
        name = str(key)
        if name not in self.order:
            self.order[name] = (len(self.order), time.time())
        if start == "processing" and finish in ("memory", "erred"):
            compute = [s for s in kwargs.get("startstops", ()) if s.get("action") == "compute"]
            self.finished.append(
                {
                    "key": name,
                    "state": finish,
                    "worker": str(kwargs.get("worker", "")),
                    "start": min((s["start"] for s in compute), default=None),
                    "stop": max((s["stop"] for s in compute), default=None),
                }
            )

    def collect(self) -> list[dict[str, Any]]:
        out = []
        for record in self.finished:
            index, seen = self.order.get(record["key"], (-1, float("nan")))
            out.append({**record, "submitted": index, "seen": seen})
        return out


def _install(dask_scheduler=None) -> bool:
    dask_scheduler.add_plugin(TaskRecorder(), name=PLUGIN_NAME)
    return True


def _collect(dask_scheduler=None) -> list[dict[str, Any]]:
    plugin = dask_scheduler.plugins.get(PLUGIN_NAME)
    return plugin.collect() if plugin is not None else []


RECORD: dict[str, Any] = {"marks": {"main": T_MAIN}, "threads": {}, "tasks": []}


def _mark(name: str) -> None:
    RECORD["marks"].setdefault(name, time.time())
    for thread in threading.enumerate():
        if thread.native_id is not None:
            RECORD["threads"][str(thread.native_id)] = thread.name


def _usage(who: int) -> dict[str, float]:
    r = resource.getrusage(who)
    return {"user": r.ru_utime, "system": r.ru_stime}


def install_hooks() -> None:
    """Wrap four functions of ``h5ngff.runner`` (looked up there at call time)."""
    from h5ngff import runner

    run_job, run_conversion, collect_workers, finish = (
        runner.run_job,
        runner.run_conversion,
        runner._collect_workers,
        runner.finish,
    )

    def hooked_run_job(*args, **kwargs):
        _mark("planned")
        return run_job(*args, **kwargs)

    def hooked_run_conversion(client, *args, **kwargs):
        _mark("cluster_up")
        client.run_on_scheduler(_install)
        _mark("recorder_installed")
        return run_conversion(client, *args, **kwargs)

    def hooked_collect_workers(summary, plan, sampler, session, since):
        _mark("slabs_done")
        try:
            RECORD["tasks"] = session.client.run_on_scheduler(_collect)
        except Exception as exc:  # the measurement must not change how a failed run ends
            RECORD["tasks_error"] = repr(exc)
        _mark("tasks_collected")
        return collect_workers(summary, plan, sampler, session, since)

    def hooked_finish(*args, **kwargs):
        _mark("cluster_closed")
        try:
            return finish(*args, **kwargs)
        finally:
            _mark("metadata_written")

    runner.run_job = hooked_run_job  # type: ignore[assignment]
    runner.run_conversion = hooked_run_conversion  # type: ignore[assignment]
    runner._collect_workers = hooked_collect_workers  # type: ignore[assignment]
    runner.finish = hooked_finish  # type: ignore[assignment]


def main(argv: list[str]) -> int:
    record_path, cli_argv = argv[0], argv[1:]
    from h5ngff import entry

    if os.environ.get("BENCH_SCALING_LATE_SERVER") != "1":  # the control: the first worker starts it
        entry.start_fork_server_early(cli_argv)  # as the console script does, before the CLI's imports
    from h5ngff import cli

    _mark("cli_imported")
    install_hooks()
    code = 1
    try:
        code = cli.main(cli_argv)
    finally:
        _mark("main_returned")
        RECORD.update(
            code=code, rusage_self=_usage(resource.RUSAGE_SELF), rusage_children=_usage(resource.RUSAGE_CHILDREN)
        )
        with open(record_path, "w") as f:
            json.dump(RECORD, f)
    return code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
