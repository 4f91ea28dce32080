"""What happened to the workers: peak memory, restarts, and who killed a worker that died.

Works the same on every backend because it only uses Dask's own channels: ``client.run`` for
per-process figures, and scheduler events, which the nanny already logs when it terminates a
worker for memory (``worker-restart-memory``) and which our nanny plugin logs on every worker exit
(``h5ngff-worker-exit``, with the kernel's OOM-kill count of the nanny's cgroup).
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import asdict, dataclass, field, replace
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any

from distributed import Client
from distributed.core import Status
from distributed.diagnostics.plugin import NannyPlugin, WorkerPlugin

from ..errors import H5ngffError, NannyTerminatedError, OOMKilledError, WorkerFailedError
from ..units import format_bytes
from .cgroups import own_memory_limit, own_oom_kill_count
from .memory_monitor import CheaperMemoryCheck
from .shutdown import StopHeartbeat

log = logging.getLogger(__name__)

EXIT_TOPIC = "h5ngff-worker-exit"
MEMORY_RESTART_TOPIC = "worker-restart-memory"
#: A nanny in these states stops its worker on purpose: that exit is no death to report.
_NANNY_CLOSING = (Status.closing, Status.closed, Status.closing_gracefully)


class WorkerExitReporter(NannyPlugin):
    """Logs every worker-process exit to the scheduler, with the cgroup's OOM-kill count."""

    name = "h5ngff-worker-exit"
    idempotent = True

    def setup(self, nanny: Any) -> None:
        original = getattr(nanny, "_on_worker_exit", None)
        if original is None:  # a future distributed; the cgroup counters still tell OOM kills
            return

        async def on_exit(exitcode: int | None, _original: Any = original, _nanny: Any = nanny) -> Any:
            if _nanny.status in _NANNY_CLOSING:
                # An exit the nanny asked for (the cluster is closing). Reporting it raced the
                # nanny's closing connection pool and printed "Task exception was never
                # retrieved" (backends/shutdown.py); the run's events were read before the close.
                return await _original(exitcode)
            try:
                _nanny.log_event(
                    EXIT_TOPIC,
                    {
                        "worker": _nanny.worker_address,
                        "nanny": _nanny.address,
                        "name": str(_nanny.name),
                        "exitcode": exitcode,
                        "oom_kills": own_oom_kill_count(),
                        # The limit the kernel enforced on the nanny's cgroup: on an existing
                        # cluster it is the container's or pod's, which no plan of ours set.
                        "cgroup_limit": own_memory_limit(),
                        "time": time.time(),
                    },
                )
            except Exception:  # reporting must never stop the nanny from restarting its worker
                log.debug("could not log worker exit", exc_info=True)
            return await _original(exitcode)

        nanny._on_worker_exit = on_exit
        _record_peak_on_termination(nanny)


class QuietExpectedErrors(WorkerPlugin):
    """Drops a worker's "Compute Failed" log of a task that raised one of h5ngff's own errors
    (a full disk, an unreadable slab). The client re-raises the error and the CLI or the status
    shows its message; Dask's log only repeated it first, as an escaped traceback string. Any
    other exception (a bug) is still logged in full."""

    name = "h5ngff-quiet-expected-errors"
    idempotent = True

    def setup(self, worker: Any) -> None:
        logging.getLogger("distributed.worker").addFilter(drop_expected_failure)


def drop_expected_failure(record: logging.LogRecord) -> bool:
    """A logging filter: False (drop) for "Compute Failed" records of an H5ngffError."""
    if not str(record.msg).startswith("Compute Failed") or not isinstance(record.args, tuple) or len(record.args) < 4:
        return True
    exception_text = str(record.args[3])  # repr of the task's exception, e.g. "DiskFullError('No space …')"
    return exception_text.split("(", 1)[0] not in _error_names(H5ngffError)


def _error_names(cls: type[BaseException]) -> set[str]:
    return {cls.__name__}.union(*(_error_names(sub) for sub in cls.__subclasses__()))


def register_plugins(client: Client) -> None:
    """The plugins every backend's cluster runs: exit reports and a cheaper memory check
    (nannies), quiet expected errors and a quiet close (workers)."""
    client.register_plugin(WorkerExitReporter())
    client.register_plugin(QuietExpectedErrors())
    client.register_plugin(StopHeartbeat())
    client.register_plugin(CheaperMemoryCheck())


def _record_peak_on_termination(nanny: Any) -> None:
    """Add the worker's VmHWM to the nanny's ``worker-restart-memory`` event. The nanny logs that
    event just before it terminates the worker, so the kernel's high-water mark read here is the
    process's peak up to its last moments; a sampler would have missed the growth since its last
    sample (the nanny's own ``rss`` figure is only the RSS it compared with the threshold)."""
    original = nanny.log_event

    def log_event(topic: str, msg: Any, _original: Any = original, _nanny: Any = nanny) -> Any:
        if topic == MEMORY_RESTART_TOPIC and isinstance(msg, dict):
            try:
                pid = _nanny.process.process.pid
                msg["peak_rss"] = _status_bytes(f"/proc/{pid}/status").get("VmHWM", 0)
                msg["name"] = str(_nanny.name)
            except Exception:  # reporting must never stop the nanny from terminating its worker
                log.debug("could not read the terminated worker's peak", exc_info=True)
        return _original(topic, msg)

    nanny.log_event = log_event


def _status_bytes(path: str) -> dict[str, int]:
    status: dict[str, int] = {}
    with open(path) as f:
        for line in f:
            if line.startswith(("VmRSS:", "VmHWM:")):
                key, value = line.split(":", 1)
                status[key] = int(value.split()[0]) * 1024
    return status


def process_memory(dask_worker: Any = None) -> dict[str, Any]:
    """This process's current and peak RSS (kernel-tracked high-water mark), and the worker's own
    name (``client.run`` passes ``dask_worker``): a worker that is gone by the time its address
    would be looked up on the scheduler is still counted under its name, not as a new worker."""
    status = _status_bytes("/proc/self/status")
    out: dict[str, Any] = {"rss": status.get("VmRSS", 0), "peak_rss": status.get("VmHWM", 0), "pid": os.getpid()}
    if dask_worker is not None:
        out["name"] = str(dask_worker.name)
    return out


def reset_peak_rss(dask_worker: Any = None) -> bool:
    """Start this process's RSS high-water mark (VmHWM) again from its current RSS, so that the
    next ``process_memory`` reports the peak since now: a batch measures each of its items on
    the same workers (``/proc/PID/clear_refs``, value 5, Linux 4.0+). False where the kernel
    does not allow it; the peak then covers the items before too (never less than the truth)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def take_peak_rss(dask_worker: Any = None, release: Callable[[], object] | None = None) -> dict[str, Any]:
    """This worker's RSS high-water mark since the last reset, then a reset (``reset_peak_rss``):
    a batch with several items in flight cuts the workers' time into segments at each item's
    end, and each item's peak is the highest of the segments it ran in. A peak that rose and fell
    between the read and the reset (a few microseconds) would be missed.

    ``release`` runs first, in the same call (one round trip per item): what an ended item frees
    does not lower the mark read, and the mark starts again from what is left. A release that
    fails is reported in ``release_error``; the mark is read and started again all the same, or
    this segment's peak would be lost."""
    error = None
    if release is not None:
        try:
            release()
        except Exception as exc:  # reported by the caller; the peak must still be read
            error = f"{type(exc).__name__}: {exc}"
    figures = process_memory(dask_worker)
    if error is not None:
        figures["release_error"] = error
    figures["reset"] = reset_peak_rss()
    return figures


@dataclass
class WorkerReport:
    """Per-worker figures for the summary; cgroup fields are filled where pods are emulated."""

    name: str
    peak_rss: int = 0
    predicted_peak: int = 0
    memory_limit: int = 0
    pod_limit: int = 0
    cgroup_peak: int | None = None
    oom_kills: int = 0
    nanny_restarts: int = 0
    memory_terminations: int = 0
    #: Whole pods (nanny and worker) restarted after their nanny died, as kubelet would.
    pod_restarts: int = 0
    #: The pod's non-reclaimable peak: the most its cgroup held in anon + shmem + dirty +
    #: writeback + unevictable pages (memory.stat), sampled every 25 ms. This, not cgroup_peak
    #: (page cache fills any cgroup to its limit), is what the pod limit must cover.
    pod_nonreclaimable_peak: int | None = None
    #: What that peak was made of: anon, shmem, dirty, writeback, unevictable (bytes).
    pod_nonreclaimable_terms: dict[str, int] | None = None
    #: The most anon + shmem + unevictable memory the pod held: the part of the peak above that
    #: only a kill frees (dirty pages are written back and reclaimed under pressure instead).
    pod_pinned_peak: int | None = None
    #: The most dirty + writeback pages the pod held at once (the page-cache headroom it used).
    pod_dirty_peak: int | None = None
    #: The most anonymous memory the pod's nanny (and its resource tracker) held.
    nanny_anon_peak: int | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def then(self, later: "WorkerReport") -> "WorkerReport":
        """This worker's figures over its stretch and ``later``'s (the same worker's, over the
        next one): the higher of each peak, the counts added."""
        return self._with(later, lambda a, b: a + b)

    def read_again(self, final: "WorkerReport") -> "WorkerReport":
        """These figures with the backend's ``final`` ones over the same stretch, read again
        later (after the last process stopped): the higher of each peak and of each count."""
        return self._with(final, max)

    def _with(self, other: "WorkerReport", count: Callable[[int, int], int]) -> "WorkerReport":
        def most(a: int | None, b: int | None) -> int | None:
            return b if a is None else a if b is None else max(a, b)

        nonreclaimable = most(self.pod_nonreclaimable_peak, other.pod_nonreclaimable_peak)
        return replace(
            self,
            peak_rss=max(self.peak_rss, other.peak_rss),
            cgroup_peak=most(self.cgroup_peak, other.cgroup_peak),
            oom_kills=count(self.oom_kills, other.oom_kills),
            nanny_restarts=count(self.nanny_restarts, other.nanny_restarts),
            memory_terminations=count(self.memory_terminations, other.memory_terminations),
            pod_restarts=count(self.pod_restarts, other.pod_restarts),
            pod_nonreclaimable_peak=nonreclaimable,
            pod_nonreclaimable_terms=(
                self.pod_nonreclaimable_terms
                if nonreclaimable == self.pod_nonreclaimable_peak
                else other.pod_nonreclaimable_terms
            ),
            pod_pinned_peak=most(self.pod_pinned_peak, other.pod_pinned_peak),
            pod_dirty_peak=most(self.pod_dirty_peak, other.pod_dirty_peak),
            nanny_anon_peak=most(self.nanny_anon_peak, other.nanny_anon_peak),
        )

    def counted_since(self, before: "WorkerReport | None") -> "WorkerReport":
        """These figures with the counts (kills, restarts, terminations) less ``before``'s: what
        happened since a batch's item started, on a backend whose counts run from its start."""
        if before is None:
            return replace(self)
        return replace(
            self,
            oom_kills=max(0, self.oom_kills - before.oom_kills),
            nanny_restarts=max(0, self.nanny_restarts - before.nanny_restarts),
            memory_terminations=max(0, self.memory_terminations - before.memory_terminations),
            pod_restarts=max(0, self.pod_restarts - before.pod_restarts),
        )


@dataclass
class ClusterEvents:
    exits: list[dict[str, Any]] = field(default_factory=list)
    memory_restarts: list[dict[str, Any]] = field(default_factory=list)

    @classmethod
    def collect(cls, client: Client, since: float = 0.0) -> "ClusterEvents":
        """The events logged since ``since`` (epoch seconds): an external cluster keeps those of
        earlier runs."""
        try:
            exits = [msg for stamp, msg in client.get_events(EXIT_TOPIC) if stamp >= since and isinstance(msg, dict)]
            restarts = [
                msg
                for stamp, msg in client.get_events(MEMORY_RESTART_TOPIC)
                if stamp >= since and isinstance(msg, dict)
            ]
        except Exception:
            return cls()
        return cls(exits, restarts)

    def restarts_by_worker(self) -> dict[str, int]:
        """Per worker name, its processes that exited non-zero: the nanny restarts each, on every
        backend."""
        return dict(
            Counter(
                str(e["name"]) for e in self.exits if e.get("exitcode") not in (0, None) and e.get("name") is not None
            )
        )

    def cgroup_limits(self) -> dict[str, int]:
        """Per worker name, the memory limit its nanny's cgroup had at the worker's last exit
        (the exit reports carry it; a nanny in an unlimited cgroup reports none)."""
        return {
            str(e["name"]): int(e["cgroup_limit"])
            for e in self.exits
            if e.get("name") is not None and isinstance(e.get("cgroup_limit"), int)
        }

    def terminated_peaks(self) -> dict[str, int]:
        """Per worker name, the highest peak of a worker the nanny terminated for memory: the
        kernel's VmHWM read as the nanny decided (or the RSS it compared, on a nanny without our
        plugin)."""
        peaks: dict[str, int] = {}
        for event in self.memory_restarts:
            name = event.get("name")
            if name is not None:
                peaks[name] = max(peaks.get(name, 0), event.get("peak_rss") or 0, event.get("rss") or 0)
        return peaks

    def oom_killed(self) -> list[dict[str, Any]]:
        """Exits by SIGKILL that the nanny did not ask for and that came with an OOM kill."""
        killed = []
        baseline: dict[str, int] = {}
        for event in self.exits:
            nanny = event.get("nanny", "")
            kills = event.get("oom_kills") or 0
            if event.get("exitcode") == -9 and kills > baseline.get(nanny, 0):
                killed.append(event)
            baseline[nanny] = max(baseline.get(nanny, 0), kills)
        return killed


def classify_failure(
    exc: BaseException,
    events: ClusterEvents,
    pod_limit: int,
    memory_limit: int,
    oom_kills: int = 0,
    limit_name: str = "pod limit",
    workers: Sequence[WorkerReport] = (),
    planned_limit: int | None = None,
) -> WorkerFailedError:
    """Turn a KilledWorker into the reason a user can act on. The kernel's OOM kills are checked
    first: a nanny termination that follows an OOM kill does not hide it. ``oom_kills`` is the
    run's one count (the sum of the per-worker counts the summary reports), so the message never
    disagrees with the figures beside it."""
    kills = oom_kills
    terminations = len(events.memory_restarts)
    if kills:
        err: WorkerFailedError = OOMKilledError(
            f"OOMKilled by the kernel ({limit_name} {pod_limit >> 20} MiB): a worker used more than its {_whose(limit_name)} memory "
            f"limit and the kernel killed it, {kills} time(s).{_killed_figures(workers)} "
            + (
                f"The limit was set below the plan's {planned_limit >> 20} MiB (an override): drop the override."
                if planned_limit and pod_limit < planned_limit
                else "The plan's prediction was exceeded; raise resources.memoryPerWorker or report the case (h5ngff plan --json output helps)."
            ),
        )
    elif terminations:
        worst = max(e.get("rss", 0) for e in events.memory_restarts)
        err = NannyTerminatedError(
            f"Dask's nanny terminated a worker at {format_bytes(worst)}, above its terminate threshold "
            f"of memory_limit {format_bytes(memory_limit)}, {terminations} time(s). The task used more memory "
            f"than planned; raise resources.memoryPerWorker or use a smaller resources.slab.",
        )
    elif isinstance(exc, WorkerFailedError):
        err = exc
    else:
        err = WorkerFailedError(f"A Dask worker died repeatedly while running a slab ({exc}). Check the worker logs.")
    err.oom_kills = kills
    err.memory_terminations = terminations
    return err


def _whose(limit_name: str) -> str:
    return "job's" if limit_name.startswith("job") else "pod's"


def _killed_figures(workers: Sequence[WorkerReport]) -> str:
    """The killed workers' own figures: peak RSS against the prediction, and the cgroup's peak."""
    parts = []
    for w in workers:
        if w.oom_kills:
            cgroup = f", cgroup peak {format_bytes(w.cgroup_peak)}" if w.cgroup_peak else ""
            parts.append(
                f"{w.name}: {w.oom_kills} kill(s), peak RSS {format_bytes(w.peak_rss)} (predicted {format_bytes(w.predicted_peak)}{cgroup}, "
                f"limit {format_bytes(w.pod_limit)})"
            )
    return (" " + "; ".join(parts) + ".") if parts else ""
