"""The backend contract: what every backend gives the runner (a capacity and a fitted spec for
planning, then a session with a connected client), and the Dask settings every backend applies."""

from __future__ import annotations

import logging
import os
from collections import Counter
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Protocol, runtime_checkable

from distributed import Client

from ..errors import WorkerFailedError
from ..planner.model import Capacity, Plan
from ..spec import ConversionSpec
from .diagnostics import ClusterEvents, WorkerReport, classify_failure

log = logging.getLogger(__name__)

#: Workers for ``workers: auto`` where the backend has no core count to follow (a SLURM cluster,
#: Kubernetes): the planner sizes each worker, the scheduler places them.
REMOTE_DEFAULT_WORKERS = 4


def dask_memory_config(plan: Plan) -> dict[str, Any]:
    """Dask's worker settings from the plan (memory thresholds, retries, no profiler), as dask config keys."""
    t = plan.memory.thresholds
    return {
        "distributed.worker.memory.target": t.target,
        "distributed.worker.memory.spill": t.spill,
        "distributed.worker.memory.pause": t.pause,
        "distributed.worker.memory.terminate": t.terminate,
        "distributed.worker.memory.monitor-interval": f"{round(t.monitor_interval * 1000)}ms",
        # A slab that kills its worker is retried on another; a slab that kills every worker it
        # touches fails the run instead of looping forever.
        "distributed.scheduler.allowed-failures": 2,
        # Dask's statistical profiler wakes in every worker every 10 ms and walks the stack of the
        # running task while holding the GIL; only the Dask dashboard's profile page reads what it
        # gathers. Off, 227 MB conversions ran 7-12 % faster (python -m bench.worker_profiler).
        "distributed.worker.profile.enabled": False,
    }


def dask_env(config: dict[str, Any]) -> dict[str, str]:
    """The same config as DASK_* environment variables (for worker processes we spawn)."""
    env = {}
    for key, value in config.items():
        name = "DASK_" + key.upper().replace(".", "__").replace("-", "_")
        env[name] = str(value)
    return env


def _nothing() -> None:
    return None


@dataclass
class Session:
    """A running cluster for one conversion: what ``Backend.session`` yields.

    What differs between backends is data and methods here, never a name the runner tests: a
    backend that knows more about its workers than Dask does (pod emulation: cgroup peaks, OOM
    kills, whole-pod restarts) fills ``extra_reports``/``refresh``/``pod_timeline``; one that
    enforces a pod limit other than the plan's sets ``pod_limit``; one that can tell more about a
    failure (a scheduler's accounting, say) overrides ``diagnose``."""

    client: Client
    #: The backend's name, for logs and messages.
    backend: str
    #: Per-worker figures the backend knows beyond RSS (cgroup peaks, OOM kills, restarts), by
    #: worker name. Where it is not empty, these are all the workers there are (one per pod).
    extra_reports: dict[str, WorkerReport] = field(default_factory=dict)
    #: Re-reads the figures behind ``extra_reports`` (cgroup counters, nanny logs).
    refresh: Callable[[], None] = _nothing
    #: The pod limit actually enforced, where it differs from the plan's (an override).
    pod_limit: int | None = None
    #: (epoch seconds, pod name, non-reclaimable bytes) of every pod, where the backend samples
    #: its pods' cgroups itself (pod emulation).
    pod_timeline: Callable[[], list[tuple[float, str, int]]] = list
    #: What the enforced limit is called where this backend runs (messages name it).
    limit_name: str = "pod limit"

    def enforced_pod_limit(self, plan: Plan) -> int:
        """The pod (job) memory limit the workers run under: the backend's override, else the plan's."""
        return self.pod_limit or plan.memory.pod_limit

    def worker_reports(self, plan: Plan, peaks: dict[str, int], events: ClusterEvents) -> list[WorkerReport]:
        """One report per worker (per pod where the backend has pods): a restarted process is
        folded into the worker or pod it replaced, and its peak is the highest any of its
        processes reached. ``peaks`` are the sampled RSS high-water marks by worker name."""
        self.refresh()
        pods = self.extra_reports
        kills = _by_name(events.oom_killed())
        terminations = _by_name(events.memory_restarts)
        # A worker process that exits non-zero is restarted by its nanny, on every backend.
        restarts = _by_name(e for e in events.exits if e.get("exitcode") not in (0, None))
        last_peaks = events.terminated_peaks()
        names = set(peaks) | set(last_peaks) | set(restarts) | set(kills)
        if pods:  # only pods exist: a name no pod has cannot be a worker of this run
            names = set(pods) | {n for n in names if n in pods}
        reports = []
        for name in sorted(names, key=_natural):
            report = pods.get(name) or WorkerReport(name=name, oom_kills=kills[name], memory_terminations=terminations[name])
            report.nanny_restarts = max(report.nanny_restarts, restarts[name])
            report.peak_rss = max(report.peak_rss, peaks.get(name, 0), last_peaks.get(name, 0))
            report.predicted_peak = plan.memory.predicted_peak
            report.memory_limit = plan.memory.memory_limit
            report.pod_limit = report.pod_limit or self.enforced_pod_limit(plan)
            reports.append(report)
        return reports

    def diagnose(self, failure: BaseException, events: ClusterEvents, plan: Plan, workers: list[WorkerReport]) -> WorkerFailedError:
        """The error a run whose workers died fails with: who killed them, with the numbers."""
        kills = sum(w.oom_kills for w in workers)
        return classify_failure(failure, events, self.enforced_pod_limit(plan), plan.memory.memory_limit, kills,
                                limit_name=self.limit_name, workers=workers, planned_limit=plan.memory.pod_limit)


def _by_name(events: Iterable[dict[str, Any]]) -> Counter[str]:
    return Counter(str(e["name"]) for e in events if e.get("name") is not None)


def _natural(name: str) -> tuple:
    digits = "".join(ch for ch in name if ch.isdigit())
    return (name.rstrip("0123456789"), int(digits) if digits else -1)


@runtime_checkable
class Backend(Protocol):
    """Where the workers of a run come from. docs/backends.md is the contract in words;
    tests/backend_contract.py checks it against every backend, for real.

    A backend is built by ``backends.factory.make_backend`` (the one place that knows every
    backend by name) and used by ``runner``: ``fit`` and ``capacity`` before planning, then one
    ``session(plan)`` per run."""

    #: Short name for logs and messages ("local", "external", ...). Never tested by the runner.
    name: str
    #: True when ``session`` starts the workers itself, sized by the plan (its ``memory_limit``,
    #: threads and Dask thresholds), and stops every worker process when it exits. False for a
    #: cluster that exists before and after the session: the plan is fitted to its workers
    #: (``fit``) and the session leaves them running.
    owns_workers: bool

    def capacity(self) -> Capacity:
        """Cores, memory and default worker count for the choices a spec leaves on ``auto``."""
        ...

    def fit(self, spec: ConversionSpec) -> ConversionSpec:
        """The spec to plan with here: unchanged where the backend sizes its workers by the
        plan; the workers' real count, threads and memory limit where they are given."""
        ...

    def session(self, plan: Plan) -> AbstractContextManager[Session]:
        """A cluster of ``plan.workers`` connected workers (a client on it, our Dask plugins
        registered) for the duration of the ``with`` block."""
        ...


def machine_capacity(default_workers: int | None = None) -> Capacity:
    import psutil

    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    memory = psutil.virtual_memory().total
    from .cgroups import own_cgroup

    group = own_cgroup()
    try:
        limit = group.limit() if group else None
    except OSError:
        limit = None
    if limit:
        memory = min(memory, limit)
    return Capacity(cores=cores, memory_bytes=memory, default_workers=default_workers)

