"""Run one tool in its own process group and sample the memory of every process it starts.

Method: a thread polls the process tree (the tool's process and all its descendants, found with
psutil) every ``interval`` seconds. For each process it keeps the largest of (a) the RSS seen at
a poll and (b) the kernel's own high-water mark ``VmHWM`` from ``/proc/PID/status``. VmHWM is exact
up to the last poll before the process exits, so a short spike between two polls is not missed.
The tree total is the largest sum of the RSS seen at one poll (a sampled figure, no kernel
equivalent). Wall time runs from just before the process is started until it has exited.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import threading
import time
from dataclasses import asdict, dataclass, field

import psutil

log = logging.getLogger(__name__)

#: Processes below this peak (resource trackers, shells) are not counted as workers.
SMALL_PROCESS = 64 << 20


@dataclass
class ProcPeak:
    pid: int
    role: str  # "main" for the tool's own process, "child" for every descendant
    command: str
    peak_rss: int = 0


@dataclass
class Measured:
    returncode: int | None
    wall: float
    timed_out: bool
    procs: list[ProcPeak] = field(default_factory=list)
    tree_peak: int = 0
    samples: int = 0

    @property
    def peak_largest(self) -> int:
        """The largest peak of any single process (the figure comparable across tools)."""
        return max((p.peak_rss for p in self.procs), default=0)

    @property
    def workers(self) -> list[ProcPeak]:
        return [p for p in self.procs if p.role == "child" and p.peak_rss >= SMALL_PROCESS]

    @property
    def peak_worker(self) -> int:
        """Largest child process; the main process where the tool runs in one process."""
        return max((p.peak_rss for p in self.workers), default=self.peak_largest)

    def to_dict(self) -> dict:
        out = asdict(self)
        out.update(peak_largest=self.peak_largest, peak_worker=self.peak_worker, n_workers=len(self.workers))
        return out


def _hwm(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError):
        pass
    return 0


class TreeSampler(threading.Thread):
    def __init__(self, pid: int, interval: float):
        super().__init__(daemon=True, name="bench-rss-sampler")
        self.root = pid
        self.interval = interval
        self.procs: dict[int, ProcPeak] = {}
        self.tree_peak = 0
        self.samples = 0
        self._halt = threading.Event()
        self.seen: dict[int, psutil.Process] = {}

    def stop(self) -> None:
        self._halt.set()
        self.join()

    def run(self) -> None:
        try:
            root = psutil.Process(self.root)
        except psutil.NoSuchProcess:
            return
        while not self._halt.is_set():
            try:
                tree = [root] + root.children(recursive=True)
            except psutil.NoSuchProcess:
                break
            total = sum(self._sample(p) for p in tree)
            self.tree_peak = max(self.tree_peak, total)
            self.samples += 1
            self._halt.wait(self.interval)

    def _sample(self, proc: psutil.Process) -> int:
        try:
            rss = proc.memory_info().rss
            entry = self.procs.get(proc.pid)
            if entry is None:
                command = " ".join(proc.cmdline()[:6])[:160]
                entry = self.procs[proc.pid] = ProcPeak(proc.pid, "main" if proc.pid == self.root else "child", command)
                self.seen[proc.pid] = proc
            entry.peak_rss = max(entry.peak_rss, rss, _hwm(proc.pid))
            return rss
        except (psutil.NoSuchProcess, psutil.ZombieProcess, psutil.AccessDenied):
            return 0


def run_measured(
    argv: list[str],
    *,
    timeout: float,
    log_path: str,
    cwd: str | None = None,
    env: dict | None = None,
    interval: float = 0.05,
) -> Measured:
    """Run ``argv`` to completion (or ``timeout``), with its output in ``log_path``."""
    with open(log_path, "ab") as out:
        start = time.perf_counter()
        # A new session: on timeout the whole group (workers included) is killed, and nothing else.
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, cwd=cwd, env=env, start_new_session=True)
        sampler = TreeSampler(proc.pid, interval)
        sampler.start()
        timed_out = False
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            timed_out = True
            log.warning("timeout after %.0f s: %s", timeout, " ".join(argv))
            _kill_group(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                _kill_group(proc.pid, signal.SIGKILL)
                proc.wait()
        wall = time.perf_counter() - start
        sampler.stop()
    _kill_leftovers(sampler)
    return Measured(
        proc.returncode,
        wall,
        timed_out,
        sorted(sampler.procs.values(), key=lambda p: p.pid),
        sampler.tree_peak,
        sampler.samples,
    )


def _kill_leftovers(sampler: TreeSampler, grace: float = 3.0) -> None:
    """Workers a tool failed to shut down would skew the next tool's run. Only processes this
    run started are touched (psutil's is_running() also checks the start time, so a reused PID
    is left alone). Helpers such as multiprocessing's resource tracker exit on their own once
    their parent is gone, so they get ``grace`` seconds first."""
    alive = [p for p in sampler.seen.values() if _running(p)]
    _, alive = psutil.wait_procs(alive, timeout=grace)
    for proc in alive:
        try:
            log.warning("killing leftover process %d (%s)", proc.pid, sampler.procs[proc.pid].command)
            proc.kill()
        except psutil.Error:
            pass


def _running(proc: psutil.Process) -> bool:
    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _kill_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass
