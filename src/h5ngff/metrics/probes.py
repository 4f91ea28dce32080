"""What the metrics exporter reads from a running Dask cluster, from the client side.

``ClusterPoller`` is the one sampler of a run's workers: the runner's per-worker peaks and memory
timeline and the Prometheus exporter's figures come from the same polls. One poll gathers, per
worker:

* from the **scheduler** (``run_on_scheduler``): name, nanny, status, Dask ``memory_limit`` and the
  scheduler's own ``MemoryState`` (process, managed, unmanaged old/recent, spilled), i.e. exactly
  the numbers Dask's dashboard shows;
* from the **worker itself** (``client.run``): its RSS and RSS high-water mark, its SpillBuffer
  counters, and its memory cgroup (usage, working set, limit, OOM kills) where readable;
* from **scheduler events**: worker exits logged by our nanny plugin (restarts, OOM kills) and the
  nanny's own ``worker-restart-memory`` terminations, since the exporter was attached.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from collections import Counter
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

from ..backends.base import Session
from ..backends.cgroups import own_cgroup
from ..backends.diagnostics import EXIT_TOPIC, MEMORY_RESTART_TOPIC, ClusterEvents, process_memory
from ..planner.model import Plan

log = logging.getLogger(__name__)

#: SpillBuffer activities exported (distributed's own label values); absent ones are 0.
SPILL_ACTIVITIES = ("disk-write", "disk-read")
#: Seconds between polls of a run's workers: often enough for the memory timeline (a slab task
#: takes seconds) and under any Prometheus scrape interval; one poll is four small round trips.
SAMPLE_INTERVAL = 0.5
#: How long the end of ``running`` waits for the final poll before giving up on a broken cluster.
FINAL_POLL_TIMEOUT = 10.0
#: How long one round trip of a poll waits for the workers. One whose task holds the GIL (a C
#: extension that never releases it) cannot answer; unbounded, it stalled every figure of the run.
POLL_TIMEOUT = 5.0


@dataclass
class CgroupFigures:
    #: host:device:inode of the cgroup directory: unique per cgroup even inside cgroup namespaces,
    #: where every container sees its own group as "/".
    identity: str
    usage: int
    working_set: int
    limit: int | None
    oom_kills: int
    #: anon + shmem + dirty + writeback + unevictable: what the pod cannot give back
    nonreclaimable: int | None = None


@dataclass
class WorkerFigures:
    name: str
    address: str
    nanny: str | None = None
    status: str = "running"
    memory_limit: int | None = None
    #: Dask's MemoryState as the scheduler computes it (process = managed + unmanaged_old + unmanaged_recent).
    process: int = 0
    managed: int = 0
    unmanaged_old: int = 0
    unmanaged_recent: int = 0
    spilled: int = 0
    rss: int | None = None
    peak_rss: int | None = None
    spill: dict[tuple[str, str], float] = field(default_factory=dict)
    cgroup: CgroupFigures | None = None


@dataclass
class ClusterSnapshot:
    time: float
    #: Workers the scheduler knows now, by name.
    workers: dict[str, WorkerFigures] = field(default_factory=dict)
    #: Counters by worker name; they include workers that have since gone.
    nanny_restarts: dict[str, int] = field(default_factory=dict)
    oom_kills: dict[str, int] = field(default_factory=dict)
    memory_terminations: dict[str, int] = field(default_factory=dict)
    #: Effective pod limit by worker name (emulated pods report their own; else the plan's).
    pod_limits: dict[str, int] = field(default_factory=dict)
    #: Highest non-reclaimable memory of each worker's pod so far, by worker name.
    pod_nonreclaimable_peaks: dict[str, int] = field(default_factory=dict)


def scheduler_view_function() -> Callable[..., dict[str, dict[str, Any]]]:
    """The function run on the scheduler, defined locally on purpose: cloudpickle then ships it
    by value, so a scheduler without h5ngff installed (``--scheduler``) can still run it."""

    def scheduler_view(dask_scheduler) -> dict[str, dict[str, Any]]:
        out = {}
        for address, ws in dask_scheduler.workers.items():
            memory = ws.memory
            out[address] = {
                "name": str(ws.name),
                "nanny": ws.nanny,
                "status": getattr(ws.status, "name", str(ws.status)),
                "memory_limit": ws.memory_limit,
                "process": memory.process,
                "managed": memory.managed,
                "unmanaged_old": memory.unmanaged_old,
                "unmanaged_recent": memory.unmanaged_recent,
                "spilled": memory.spilled,
            }
        return out

    return scheduler_view


def cgroup_identity(path: str) -> str:
    st = os.stat(path)
    return f"{socket.gethostname()}:{st.st_dev}:{st.st_ino}"


def read_own_cgroup() -> CgroupFigures | None:
    """This process's memory cgroup counters, or None where there is none or it is unreadable."""
    group = own_cgroup()
    if group is None:
        return None
    try:
        return CgroupFigures(
            cgroup_identity(group.path),
            group.usage(),
            group.working_set(),
            group.limit(),
            group.oom_kills(),
            sum(group.nonreclaimable().values()),
        )
    except OSError:
        return None


def worker_probe(dask_worker=None) -> dict[str, Any]:
    """Runs on each worker (``client.run``): what only the worker process can see."""
    figures: dict[str, Any] = dict(process_memory(dask_worker))
    data = getattr(dask_worker, "data", None)
    # SpillBuffer's counters: absent when spilling is disabled (target and spill False).
    metrics = getattr(data, "cumulative_metrics", None) or {}
    figures["spill"] = {key: float(value) for key, value in metrics.items()}
    figures["cgroup"] = read_own_cgroup()
    return figures


class ClusterPoller:
    """The one sampler of a run's workers: ``poll()`` reads one ClusterSnapshot; ``running()``
    polls in a background thread for as long as the session is up.

    It serves both readers of the workers' memory: the run's report (each worker's highest RSS,
    kept across restarts because a restarted worker's high-water mark would otherwise die with
    it, and an RSS timeline for the memory report) and the metrics exporter (every snapshot, to
    its listeners). Every poll costs the scheduler and the workers round trips on the cores
    doing the conversion, hence half a second between polls, and one round trip (each worker's
    RSS) where nobody listens for the full snapshot."""

    def __init__(self, session: Session, plan: Plan):
        self.client = session.client
        self.planned_pod_limit = session.enforced_pod_limit(plan)
        self.extra_reports = session.extra_reports
        #: A batch item's view: the counts the backend had when the item started are not its own.
        self.reports_before = session.reports_before
        self.refresh = session.refresh
        #: Events older than this belong to earlier runs on the same (external) cluster.
        self.since = time.time()
        own = read_own_cgroup()
        self.own_cgroup = own.identity if own else None
        self.names: dict[str, str] = {}  # worker or nanny address -> worker name
        #: Highest polled non-reclaimable memory per worker name (a lower bound between polls).
        self.nonreclaimable_peaks: dict[str, int] = {}
        #: Highest RSS high-water mark of any process of each worker name.
        self.peaks: dict[str, int] = {}
        #: (epoch seconds, worker name, RSS bytes), for the memory report.
        self.timeline: list[tuple[float, str, int]] = []
        #: Called with each snapshot, or None for a poll that failed (the exporter counts those).
        self.listeners: list[Callable[[ClusterSnapshot | None], None]] = []
        self._scheduler_view = scheduler_view_function()
        self._stop = threading.Event()

    @contextmanager
    def running(self, interval: float = SAMPLE_INTERVAL, at_start: bool = True) -> Iterator["ClusterPoller"]:
        """Poll at once (unless ``at_start`` is False), every ``interval`` s, and once more at the
        end while the cluster is up. A batch's item skips the first poll where no metrics are
        exported: the cluster was read as the item before it ended, and a 50 MB item's whole run
        is a few polls long (an exporter shows the newest item's workers at once, so it polls)."""
        self._stop.clear()
        thread = threading.Thread(
            target=self._loop, args=(interval, at_start), name="h5ngff-cluster-poller", daemon=True
        )
        thread.start()
        try:
            yield self
        finally:
            self._stop.set()
            thread.join(timeout=FINAL_POLL_TIMEOUT + interval)
            if thread.is_alive():
                log.warning(
                    "The final cluster poll did not finish in %.0f s; the figures end at the previous one.",
                    FINAL_POLL_TIMEOUT,
                )

    def _loop(self, interval: float, at_start: bool) -> None:
        if at_start:
            self._sample()
        while not self._stop.wait(interval):
            self._sample()
        self._sample()  # the final state, while the cluster is still up

    def _sample(self) -> None:
        listeners = list(self.listeners)
        try:
            if not listeners:  # the report alone needs each worker's RSS: one round trip
                self._record_memory(
                    time.time(), self.client.run(process_memory, on_error="ignore", callback_timeout=POLL_TIMEOUT)
                )
                return
            snapshot: ClusterSnapshot | None = self.poll()
        except Exception as exc:  # a restarting worker, a dying cluster: must not stop the run
            log.debug("cluster poll failed: %s", exc)
            snapshot = None
        for listener in listeners:
            listener(snapshot)

    def poll(self) -> ClusterSnapshot:
        view = self.client.run_on_scheduler(self._scheduler_view, callback_timeout=POLL_TIMEOUT)
        probes = self.client.run(worker_probe, on_error="ignore", callback_timeout=POLL_TIMEOUT)
        snapshot = ClusterSnapshot(time=time.time())
        for address, info in view.items():
            name = info["name"]
            self.names[address] = name
            if info.get("nanny"):
                self.names[info["nanny"]] = name
            worker = WorkerFigures(address=address, **info)
            probe = probes.get(address)
            if isinstance(probe, dict):
                worker.rss, worker.peak_rss, worker.spill, worker.cgroup = (
                    probe["rss"],
                    probe["peak_rss"],
                    probe["spill"],
                    probe["cgroup"],
                )
            snapshot.workers[name] = worker
        self._record_memory(snapshot.time, probes)
        self._drop_shared_cgroups(snapshot)
        for name, worker in snapshot.workers.items():
            if worker.cgroup is not None and worker.cgroup.nonreclaimable is not None:
                self.nonreclaimable_peaks[name] = max(
                    self.nonreclaimable_peaks.get(name, 0), worker.cgroup.nonreclaimable
                )
        self._count_events(snapshot)
        return snapshot

    def _record_memory(self, now: float, probes: dict[str, Any]) -> None:
        """Peaks and timeline by the name each worker reports itself: a worker that has left the
        scheduler's view by the time of the poll is still counted under its own name."""
        for address, probe in probes.items():
            if not isinstance(probe, dict):
                continue
            name = probe.get("name") or self._name(address)
            self.peaks[name] = max(self.peaks.get(name, 0), probe["peak_rss"])
            self.timeline.append((now, name, probe["rss"]))

    def _drop_shared_cgroups(self, snapshot: ClusterSnapshot) -> None:
        """A cgroup shared with this client or with another worker is not the worker's pod: its
        counters would describe the whole machine (plain LocalCluster), so they are left out."""
        seen = Counter(w.cgroup.identity for w in snapshot.workers.values() if w.cgroup)
        for worker in snapshot.workers.values():
            if worker.cgroup and (worker.cgroup.identity == self.own_cgroup or seen[worker.cgroup.identity] > 1):
                worker.cgroup = None

    def _count_events(self, snapshot: ClusterSnapshot) -> None:
        events = ClusterEvents(self._recent(EXIT_TOPIC), self._recent(MEMORY_RESTART_TOPIC))
        # A worker that exits cleanly (0) is closing with its nanny, which does not restart it.
        restarts = Counter(self._name(e.get("nanny")) for e in events.exits if e.get("exitcode") not in (0, None))
        ooms = Counter(e.get("name") or self._name(e.get("nanny")) for e in events.oom_killed())
        terminations = Counter(self._name(e.get("worker")) for e in events.memory_restarts)
        if self.refresh is not None:
            self.refresh()  # pod emulation: re-read cgroup OOM counters and nanny logs
        names = set(snapshot.workers) | set(restarts) | set(ooms) | set(terminations) | set(self.extra_reports)
        for name in names:
            report = self.extra_reports.get(name)
            if report is not None:
                report = report.counted_since(self.reports_before.get(name))
            snapshot.nanny_restarts[name] = max(restarts[name], getattr(report, "nanny_restarts", 0))
            snapshot.oom_kills[name] = max(ooms[name], getattr(report, "oom_kills", 0))
            snapshot.memory_terminations[name] = max(terminations[name], getattr(report, "memory_terminations", 0))
            snapshot.pod_limits[name] = getattr(report, "pod_limit", 0) or self.planned_pod_limit
            # Emulated pods are sampled every 25 ms by the backend; elsewhere the polls' maximum.
            peak = max(self.nonreclaimable_peaks.get(name, 0), getattr(report, "pod_nonreclaimable_peak", None) or 0)
            if peak:
                snapshot.pod_nonreclaimable_peaks[name] = peak

    def _recent(self, topic: str) -> list[dict[str, Any]]:
        return [msg for stamp, msg in self.client.get_events(topic) if stamp >= self.since and isinstance(msg, dict)]

    def _name(self, address: str | None) -> str:
        return self.names.get(address or "", address or "unknown")
