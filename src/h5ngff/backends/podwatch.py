"""Pod-level truth: what each emulated pod really holds, sampled from the kernel.

A pod cgroup's ``max_usage_in_bytes`` always reaches its limit, because clean page cache (the
HDF5 input, chunk files already written back) fills any cgroup and is reclaimed on demand: it says
nothing about the memory the pod needs. What the pod cannot give back is its non-reclaimable
memory (anon + shmem + dirty + writeback + unevictable in its memory.stat, see
``cgroups.NONRECLAIMABLE_KEYS``). The kernel keeps no high-water mark of that sum, so this module
samples it every ``SAMPLE_INTERVAL`` and keeps the maximum per pod. Alongside it reads, per process
in the pod:

* the worker's ``VmHWM``: the kernel's own high-water mark of its RSS, read until the process
  exits, so a terminated or killed worker keeps the peak of its last moments;
* the anonymous memory of the pod's other processes (the nanny and its resource tracker): the
  measurement behind the plan's ``nanny`` term;
* the kernel log's OOM-kill record of every pod process the kernel killed: its RSS at the kill,
  the kernel's own figure, which no sampler can miss.
"""

from __future__ import annotations

import logging
import os
import re
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from .cgroups import MemoryCgroup, nonreclaimable_terms

log = logging.getLogger(__name__)

#: Seconds between samples of up to PODS_AT_FULL_RATE pods; more pods stretch it in proportion.
#: One pod's sample costs about 0.35 ms of CPU (measured: 2-4 small /proc and cgroup files, 25 us
#: each to read, and Python around them), so 2 pods take 3 % of one core, 8 pods (every 50 ms)
#: 6 %. Between two samples a task growing at 1 GiB/s adds 25-50 MiB; peaks of the worker itself
#: are not lost in between (VmHWM is the kernel's own high-water mark).
SAMPLE_INTERVAL = 0.025
PODS_AT_FULL_RATE = 4
#: One timeline point per pod per this many seconds: the maximum since the previous point, so the
#: memory report shows every peak without holding 40 points a second.
TIMELINE_INTERVAL = 0.25
#: The nanny's and resource tracker's memory changes slowly: read it every this many samples.
NANNY_EVERY = 4

KILLED = re.compile(
    r"Killed process (\d+) \(([^)]*)\) total-vm:(\d+)kB, anon-rss:(\d+)kB, file-rss:(\d+)kB, shmem-rss:(\d+)kB"
)


STATUS_FIELD = re.compile(rb"^(VmRSS|VmHWM|RssAnon):\s+(\d+) kB", re.M)
STAT_LINE = re.compile(rb"^(\w+) (\d+)$", re.M)


def _read_bytes(path: str) -> bytes:
    # One read of the whole file, parsed with a regular expression: 40 samples a second of every
    # pod must stay a small cost on the cores doing the conversion.
    fd = os.open(path, os.O_RDONLY)
    try:
        return os.read(fd, 65536)
    finally:
        os.close(fd)


def read_status(pid: int) -> dict[str, int]:
    """VmRSS, VmHWM and RssAnon of a process, in bytes ({} once it is gone or has no memory)."""
    try:
        text = _read_bytes(f"/proc/{pid}/status")
    except OSError:
        return {}
    return {key.decode(): int(value) * 1024 for key, value in STATUS_FIELD.findall(text)}


def read_nonreclaimable(cgroup: MemoryCgroup) -> dict[str, int]:
    """The pod's non-reclaimable terms from its memory.stat (bytes)."""
    stat = {key.decode(): int(value) for key, value in STAT_LINE.findall(_read_bytes(f"{cgroup.path}/memory.stat"))}
    return nonreclaimable_terms(stat, cgroup.version)


def _cmdline(pid: int) -> bytes | None:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read()
    except OSError:
        return None


#: Roles that may still change: read the process again at the next sample.
PROVISIONAL_ROLES = frozenset({"clone", "unknown"})


def process_role(pid: int, nanny_pid: int) -> str:
    """``nanny`` (the dask-worker CLI process), ``worker`` (the process the nanny spawned to run
    tasks: multiprocessing's ``spawn_main``), ``clone`` (a child between fork and exec: it still
    shows the nanny's command line, and its anonymous pages are the nanny's, shared copy-on-write,
    so counting them would count the nanny twice), ``unknown`` (no command line to read: a process
    in the middle of exec shows an empty one, as does a zombie; filing it as ``other`` for good
    lost a worker's peak and added it to the nanny's) or ``other`` (the resource tracker)."""
    if pid == nanny_pid:
        return "nanny"
    cmdline = _cmdline(pid)
    if not cmdline:
        return "unknown"
    if b"spawn_main" in cmdline:
        return "worker"
    return "clone" if cmdline == _cmdline(nanny_pid) else "other"


@dataclass
class PodPeaks:
    """The highest figures one pod reached, over every process it ran (in the whole session, or
    in one segment of it: see ``PodWatcher.take_segment``)."""

    #: max over samples of anon + shmem + dirty + writeback + unevictable (bytes)
    nonreclaimable: int = 0
    #: those terms in the sample that set ``nonreclaimable``
    terms_at_peak: dict[str, int] = field(default_factory=dict)
    #: max over samples of anon + shmem + unevictable: the part only a kill can free. Dirty and
    #: writeback pages are not in it: under the pod's memory pressure the kernel writes them back
    #: and reclaims them (slower, not killed), so they grow into whatever room the pod has.
    pinned: int = 0
    #: max over samples of dirty + writeback: the page-cache headroom the pod really used
    dirty: int = 0
    #: max over samples of the anonymous memory of the pod's processes other than the worker
    nanny_anon: int = 0
    #: max VmHWM of the pod's worker processes (restarted ones included)
    worker_hwm: int = 0
    #: RSS (anon + file + shmem) of every pod process the kernel OOM-killed, from its kill record
    killed_rss: dict[int, int] = field(default_factory=dict)
    samples: int = 0

    def report_fields(self) -> dict[str, Any]:
        """These peaks as a WorkerReport's pod fields (None where no sample saw any)."""
        return {
            "pod_nonreclaimable_peak": self.nonreclaimable or None,
            "pod_nonreclaimable_terms": dict(self.terms_at_peak) or None,
            "pod_pinned_peak": self.pinned or None,
            "pod_dirty_peak": self.dirty,
            "nanny_anon_peak": self.nanny_anon or None,
        }

    def note(self, terms: dict[str, int], total: int) -> None:
        """One sample of the pod's cgroup (``terms``: read_nonreclaimable; ``total``: their sum)."""
        self.samples += 1
        if total > self.nonreclaimable:
            self.nonreclaimable, self.terms_at_peak = total, terms
        self.dirty = max(self.dirty, terms["dirty"] + terms["writeback"])
        self.pinned = max(self.pinned, terms["anon"] + terms["shmem"] + terms["unevictable"])

    def note_kill(self, pid: int, worker: bool, anon: int, file: int, shmem: int, beside_worker: int) -> None:
        """The kernel's record of an OOM kill in the pod."""
        self.killed_rss[pid] = anon + file + shmem
        if worker:
            self.worker_hwm = max(self.worker_hwm, anon + file + shmem)
            # At the kill the pod held at least the victim's pinned pages and the rest of the
            # pod's anonymous memory: the kernel's figure beats a sample taken up to one interval
            # before.
            self.nonreclaimable = max(self.nonreclaimable, anon + shmem + beside_worker)
            self.pinned = max(self.pinned, anon + shmem + beside_worker)


@dataclass
class _Watched:
    cgroup: MemoryCgroup
    nanny_pid: int
    peaks: PodPeaks
    #: The same figures since the last ``PodWatcher.take_segment``.
    segment: PodPeaks = field(default_factory=PodPeaks)
    roles: dict[int, str] = field(default_factory=dict)
    hwm: dict[int, int] = field(default_factory=dict)
    point: int = 0
    point_time: float = 0.0
    #: anonymous memory of the pod's processes other than the worker, at the last sample
    beside_worker: int = 0


class KernelLog:
    """New records of the kernel log (/dev/kmsg) since this object was made; empty where the log is
    unreadable (no root, a container without it)."""

    def __init__(self) -> None:
        try:
            self._fd: int | None = os.open("/dev/kmsg", os.O_RDONLY | os.O_NONBLOCK)
            os.lseek(self._fd, 0, os.SEEK_END)
        except OSError:
            self._fd = None

    def read(self) -> list[str]:
        lines = []
        while self._fd is not None:
            try:
                record = os.read(self._fd, 8192)
            except BlockingIOError:
                break
            except BrokenPipeError:  # records overwritten before we read them: go on with the next
                continue
            except OSError:
                break
            if not record:
                break
            lines.append(record.decode(errors="replace").split(";", 1)[-1].strip())
        return lines

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


class PodWatcher:
    """Samples every watched pod in a background thread; ``peaks[name]`` and ``timeline`` hold the
    results (timeline: (epoch seconds, pod name, non-reclaimable bytes))."""

    def __init__(self, interval: float = SAMPLE_INTERVAL):
        self.interval = interval
        self.timeline: list[tuple[float, str, int]] = []
        self._pods: dict[str, _Watched] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._kmsg = KernelLog()
        self._thread = threading.Thread(target=self._loop, name="h5ngff-pod-watcher", daemon=True)

    @property
    def peaks(self) -> dict[str, PodPeaks]:
        return {name: w.peaks for name, w in self._pods.items()}

    def watch(self, name: str, cgroup: MemoryCgroup, nanny_pid: int) -> None:
        """Start (or, for a restarted pod, go on) watching pod ``name``; its peaks carry over."""
        with self._lock:
            old = self._pods.get(name)
            if old is None:
                self._pods[name] = _Watched(cgroup, nanny_pid, PodPeaks())
            else:
                old.cgroup, old.nanny_pid = cgroup, nanny_pid

    def take_segment(self) -> dict[str, PodPeaks]:
        """Each pod's peaks since the last call (or since it was first watched), and a new
        segment from now. A batch charges each item with the segments it ran in."""
        self.sample()  # the segment's last moments
        with self._lock:
            out = {}
            for name, pod in self._pods.items():
                # The nanny's memory is steady and sampled only every NANNY_EVERY samples: a
                # segment starts from its last figure, so a short one is not left without it.
                out[name], pod.segment = pod.segment, PodPeaks(nanny_anon=pod.beside_worker)
            return out

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5)
        self.sample()
        self._kmsg.close()

    def _loop(self) -> None:
        while not self._stop.wait(self.interval * max(1.0, len(self._pods) / PODS_AT_FULL_RATE)):
            self.sample()

    def sample(self) -> None:
        now = time.time()
        with self._lock:
            for name, pod in self._pods.items():
                try:
                    self._sample_pod(name, pod, now)
                except OSError:  # a cgroup being removed at shutdown
                    pass
            self._read_kernel_log()

    def _sample_pod(self, name: str, pod: _Watched, now: float) -> None:
        terms = read_nonreclaimable(pod.cgroup)
        total = sum(terms.values())
        peaks, segment = pod.peaks, pod.segment
        peaks.note(terms, total)
        segment.note(terms, total)
        beside_worker = 0
        # The worker's high-water mark at every sample (its last moments matter); the nanny's
        # steady memory every NANNY_EVERY samples, which keeps a sample cheap.
        nanny_turn = peaks.samples % NANNY_EVERY == 1
        for pid in pod.cgroup.pids():
            role = pod.roles.get(pid)
            if role is None or role in PROVISIONAL_ROLES:  # a spawned child is a clone, then mid-exec, then itself
                role = pod.roles[pid] = process_role(pid, pod.nanny_pid)
            if role == "worker":
                # The kernel's mark, not the highest read: a batch resets it between items.
                hwm = read_status(pid).get("VmHWM", 0)
                pod.hwm[pid] = max(pod.hwm.get(pid, 0), hwm)
                peaks.worker_hwm = max(peaks.worker_hwm, pod.hwm[pid])
                segment.worker_hwm = max(segment.worker_hwm, hwm)
            elif role not in PROVISIONAL_ROLES and nanny_turn:
                beside_worker += read_status(pid).get("RssAnon", 0)
        if nanny_turn:
            pod.beside_worker = beside_worker
            peaks.nanny_anon = max(peaks.nanny_anon, beside_worker)
            segment.nanny_anon = max(segment.nanny_anon, beside_worker)
        pod.point = max(pod.point, total)
        if now - pod.point_time >= TIMELINE_INTERVAL:
            self.timeline.append((now, name, pod.point))
            pod.point, pod.point_time = 0, now

    def _read_kernel_log(self) -> None:
        for line in self._kmsg.read():
            match = KILLED.search(line)
            if not match:
                continue
            pid = int(match.group(1))
            anon, file, shmem = (int(match.group(i)) * 1024 for i in (4, 5, 6))
            for pod in self._pods.values():
                if pid not in pod.roles:
                    continue
                for peaks in (pod.peaks, pod.segment):
                    peaks.note_kill(pid, pod.roles[pid] == "worker", anon, file, shmem, pod.beside_worker)
