"""The backend contract: what every backend gives the runner (a capacity and a fitted spec for
planning, a description of what it would do with the plan, then a session with a connected
client), and what every backend shares: the Dask settings it applies, the client it connects,
and the wait for its workers."""

from __future__ import annotations

import logging
import os
import time
from collections import Counter
from contextlib import AbstractContextManager
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Iterable, Protocol, runtime_checkable

from distributed import Client, LocalCluster

from ..errors import WorkerFailedError
from ..planner.model import Capacity, MemoryTerm, Plan
from ..spec import ConversionSpec
from .diagnostics import ClusterEvents, WorkerReport, classify_failure

log = logging.getLogger(__name__)

#: Workers for ``workers: auto`` where the backend has no core count to follow (a SLURM cluster,
#: Kubernetes): the planner sizes each worker, the scheduler places them.
REMOTE_DEFAULT_WORKERS = 4


#: How often each Dask server times its event loop (Dask's default: 20 ms).
TICK_INTERVAL = "500ms"


def dask_memory_config(plan: Plan) -> dict[str, Any]:
    """Dask's settings from the plan (memory thresholds, retries, no profiler, a slower event-loop
    timer), as dask config keys, for the scheduler, the nannies and the workers alike."""
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
        # Every Dask server (scheduler, nanny, worker) wakes every 20 ms by default only to time
        # its own event loop, for the "Event loop was unresponsive" log (after 3 s) and a
        # dashboard figure. An idle 2-worker LocalCluster spent 2-3 % of a core in its workers
        # and about 1.5 % in the client on it (docs/benchmarks.md, "Dask's housekeeping"); at
        # TICK_INTERVAL the log still fires, for a stall of 3 s or more.
        "distributed.admin.tick.interval": TICK_INTERVAL,
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
    #: Where the backend measures its workers itself (pod emulation): the figures of
    #: ``extra_reports`` over the stretch since the last call, by worker name, and a new stretch
    #: from now. A batch charges each item with the stretches it ran in; ``extra_reports`` hold
    #: the whole session's, which would charge every item with the largest item before it.
    take_segment: Callable[[], dict[str, WorkerReport]] | None = None
    #: A batch item's view of the batch's session: ``extra_reports`` as they stood when the item
    #: started, whose counts (kills, restarts, terminations) are not the item's.
    reports_before: dict[str, WorkerReport] = field(default_factory=dict)
    #: Whether the limit each nanny reads from its own memory cgroup is the one that holds: an
    #: existing cluster's workers run in containers or pods whose limits no plan of ours set, so
    #: its report quotes what the kernel enforced, not the plan's figure (issue 43).
    limits_from_workers: bool = False
    #: The workers outlive this run (an existing cluster's): what the run left on them is freed at
    #: its end (runner._release_on_workers), as a cluster of the run's own is closed.
    workers_outlive_the_run: bool = False

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
        restarts = events.restarts_by_worker()
        last_peaks = events.terminated_peaks()
        limits = events.cgroup_limits() if self.limits_from_workers else {}
        names = set(peaks) | set(last_peaks) | set(restarts) | set(kills)
        if pods:  # only pods exist: a name no pod has cannot be a worker of this run
            names = set(pods) | {n for n in names if n in pods}
        reports = []
        for name in sorted(names, key=_natural):
            # A copy: the pods' own reports stay the session's, and a batch's items each get
            # theirs. The runner reads the session's again once it has closed (runner.run_job).
            report = (
                replace(pods[name]).counted_since(self.reports_before.get(name))
                if name in pods
                else WorkerReport(
                    name=name,
                    oom_kills=kills[name],
                    memory_terminations=terminations[name],
                    pod_limit=limits.get(name, 0),
                )
            )
            report.nanny_restarts = max(report.nanny_restarts, restarts.get(name, 0))
            report.peak_rss = max(report.peak_rss, peaks.get(name, 0), last_peaks.get(name, 0))
            reports.append(self.with_plan(report, plan))
        return reports

    def with_plan(self, report: WorkerReport, plan: Plan) -> WorkerReport:
        """``report`` with the plan's figures beside its own: the predicted peak, Dask's
        memory_limit and the pod limit enforced (the pod's own where the backend set one)."""
        return replace(
            report,
            predicted_peak=plan.memory.predicted_peak,
            memory_limit=plan.memory.memory_limit,
            pod_limit=report.pod_limit or self.enforced_pod_limit(plan),
        )

    def diagnose(
        self, failure: BaseException, events: ClusterEvents, plan: Plan, workers: list[WorkerReport]
    ) -> WorkerFailedError:
        """The error a run whose workers died fails with: who killed them, with the numbers."""
        kills = sum(w.oom_kills for w in workers)
        # The limit the killed workers ran under, where they know it (an existing cluster's).
        killed_limits = [w.pod_limit for w in workers if w.oom_kills and w.pod_limit]
        return classify_failure(
            failure,
            events,
            max(killed_limits) if killed_limits and self.limits_from_workers else self.enforced_pod_limit(plan),
            plan.memory.memory_limit,
            kills,
            limit_name=self.limit_name,
            workers=workers,
            planned_limit=plan.memory.pod_limit,
        )


def _by_name(events: Iterable[dict[str, Any]]) -> Counter[str]:
    return Counter(str(e["name"]) for e in events if e.get("name") is not None)


def _natural(name: str) -> tuple[str, int]:
    digits = "".join(ch for ch in name if ch.isdigit())
    return (name.rstrip("0123456789"), int(digits) if digits else -1)


@dataclass(frozen=True)
class JobScript:
    """The batch script each worker job runs, where a backend submits one job per worker (SLURM),
    in the parts ``h5ngff plan`` explains."""

    header: tuple[str, ...]
    environment: tuple[str, ...]
    prologue: tuple[str, ...]
    command: str
    #: The job's ``--mem`` in bytes, and the terms it is made of (the plan's pod terms).
    mem_bytes: int
    mem_terms: tuple[MemoryTerm, ...]
    #: Why --mem differs from the plan (an override), or "".
    mem_override: str = ""
    shebang: str = "#!/usr/bin/env bash"

    def text(self) -> str:
        parts = [self.shebang, *self.header, "", *self.environment, *self.prologue, self.command]
        return "\n".join(parts) + "\n"


@dataclass(frozen=True)
class Description:
    """What a backend would do with a plan, beyond the plan itself: ``h5ngff plan`` shows it, and
    the run sequence (``runner.execute``) adds its notices before the plan is shown. The caller
    never asks which backend it has: a backend without a job script leaves it None."""

    #: Sentences about this plan on this backend (a memory budget beyond this machine or any node).
    notices: tuple[str, ...] = ()
    #: The script every worker job runs, where the backend submits one job per worker.
    job_script: JobScript | None = None


@runtime_checkable
class Backend(Protocol):
    """Where the workers of a run come from. docs/backends.md is the contract in words;
    tests/backend_contract.py checks it against every backend, for real.

    A backend is built by ``backends.factory.make_backend`` (the one place that knows every
    backend by name, and which of them start their own workers) and used by ``runner``: ``fit``
    and ``capacity`` before planning, ``describe`` once the plan is made, then one
    ``session(plan)`` per run."""

    #: Short name for logs and messages ("local", "external", ...). Never tested by the runner.
    name: str

    def capacity(self) -> Capacity:
        """Cores, memory and default worker count for the choices a spec leaves on ``auto``."""
        ...

    def fit(self, spec: ConversionSpec) -> ConversionSpec:
        """The spec to plan with here: unchanged where the backend sizes its workers by the
        plan; the workers' real count, threads and memory limit where they are given."""
        ...

    def describe(self, spec: ConversionSpec, plan: Plan) -> Description:
        """What this backend would do with ``plan`` (planned from ``spec``): notices, a job script.
        Starts nothing; may ask the cluster about itself (sinfo)."""
        ...

    def session(self, plan: Plan) -> AbstractContextManager[Session]:
        """A cluster of ``plan.workers`` connected workers (a client on it, our Dask plugins
        registered) for the duration of the ``with`` block."""
        ...


def connect(target: str | LocalCluster | Any, timeout: float | None = None) -> Client:
    """A client of our own on ``target`` (a scheduler address or a cluster object), never the
    process's default client: every backend connects through here."""
    client: Any = Client  # distributed's Client is untyped; typed once, here
    kwargs = {} if timeout is None else {"timeout": timeout}
    connected: Client = client(target, set_as_default=False, **kwargs)
    return connected


def local_cluster(**options: Any) -> LocalCluster:
    """A ``LocalCluster`` in this process (the local backends' workers, pod emulation's scheduler)."""
    start: Any = LocalCluster  # distributed's LocalCluster is untyped; typed once, here
    cluster: LocalCluster = start(**options)
    return cluster


def connected_workers(client: Client) -> int:
    """How many workers the scheduler has now."""
    info: dict[str, Any] = client.scheduler_info(n_workers=-1)
    return len(info["workers"])


def wait_for_workers(
    client: Client,
    n: int,
    timeout: float,
    on_timeout: Callable[[int], BaseException],
    check: Callable[[], None] = lambda: None,
    interval: float = 0.25,
) -> None:
    """Until ``n`` workers are connected: the one wait of every backend that starts workers.

    ``check`` runs between looks and raises where the backend already knows the workers will not
    come (a pod process that exited, a job that ended); after ``timeout`` seconds the error is
    ``on_timeout(connected)``, in the backend's own words."""
    deadline = time.monotonic() + timeout
    while (have := connected_workers(client)) < n:
        check()
        if time.monotonic() > deadline:
            raise on_timeout(have)
        time.sleep(interval)


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
