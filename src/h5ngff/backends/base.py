"""What every backend gives the runner: a capacity for planning, and a session with a client."""

from __future__ import annotations

import logging
import os
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol

import dask
from distributed import Client

from ..planner.model import Capacity, Plan
from .diagnostics import WorkerReport, process_memory

log = logging.getLogger(__name__)


def dask_memory_config(plan: Plan) -> dict[str, Any]:
    """Dask's memory thresholds from the plan, as dask config keys."""
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
    }


def dask_env(config: dict[str, Any]) -> dict[str, str]:
    """The same config as DASK_* environment variables (for worker processes we spawn)."""
    env = {}
    for key, value in config.items():
        name = "DASK_" + key.upper().replace(".", "__").replace("-", "_")
        env[name] = str(value)
    return env


class MemorySampler:
    """Samples every worker's RSS through ``client.run`` in a background thread.

    It keeps the highest value seen per worker (a restarted worker's high-water mark would
    otherwise die with it) and a timeline for the memory report. Every sample costs the
    scheduler and the workers a round trip on the cores doing the conversion, so the interval is
    half a second and worker names are looked up only when an address is new.
    """

    def __init__(self, client: Client, interval: float = 0.5):
        self.client = client
        self.interval = interval
        self.peaks: dict[str, int] = {}
        #: (epoch seconds, worker name, RSS bytes)
        self.timeline: list[tuple[float, str, int]] = []
        self._names: dict[str, str] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="h5ngff-memory-sampler", daemon=True)

    def __enter__(self) -> "MemorySampler":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self.sample()

    def _loop(self) -> None:
        while not self._stop.wait(self.interval):
            self.sample()

    def _name(self, address: str) -> str:
        if address not in self._names:
            workers = self.client.scheduler_info(n_workers=-1)["workers"]
            self._names.update({addr: str(info.get("name", addr)) for addr, info in workers.items()})
        return self._names.get(address, address)

    def sample(self) -> None:
        try:
            figures = self.client.run(process_memory, on_error="ignore")
            now = time.time()  # absolute, so samples line up with progress events
            for address, mem in figures.items():
                if not isinstance(mem, dict):
                    continue
                name = mem.get("name") or self._name(address)
                self.peaks[name] = max(self.peaks.get(name, 0), mem["peak_rss"])
                self.timeline.append((now, name, mem["rss"]))
        except Exception:  # a worker that is restarting, a closing cluster: try again next time
            return


def _nothing() -> None:
    return None


@dataclass
class Session:
    """A running cluster for one conversion."""

    client: Client
    backend: str
    #: Per-worker figures the backend knows beyond RSS (cgroup peaks, OOM kills, restarts).
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

    def oom_kills(self) -> int:
        self.refresh()
        return sum(r.oom_kills for r in self.extra_reports.values())


class Backend(Protocol):
    name: str

    def capacity(self) -> Capacity: ...

    def session(self, plan: Plan, memory_conf: dict[str, Any]): ...


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


def config_context(plan: Plan, extra: dict[str, Any]):
    return dask.config.set({**dask_memory_config(plan), **extra})
