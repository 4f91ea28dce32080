"""A cheaper check in the nanny's memory monitor, with Dask's own action unchanged.

Dask's nanny reads its worker's RSS every ``monitor-interval`` and terminates the worker above the
terminate threshold. h5ngff plans that interval short (20 ms: the pod limit's overshoot room is
the growth between two checks, planner/memory.py), and each check builds a new
``psutil.Process`` (it reads ``/proc/PID/stat`` to learn the process's start time) and then reads
``/proc/PID/statm``: about 30 us of Python, 50 times a second per worker. In a ``LocalCluster``
every nanny runs on the client's event loop, beside the scheduler: with 16 workers that is 800
checks a second on the thread that hands out the tasks.

``CheaperMemoryCheck`` keeps one descriptor open on the worker's ``/proc/PID/statm`` and reads
the resident size from it (one ``pread``, about 2 us: the same figure psutil reports as ``rss``).
Only when that figure is above the threshold, or cannot be read, does it call Dask's own check,
which reads the RSS again and does what it always did (logs ``worker-restart-memory``,
terminates, and kills a worker that outlives its terminate). Below the threshold Dask's check
does nothing either, so what a worker is allowed is exactly what it was.

A descriptor on a ``/proc/PID`` file belongs to that process, not to its number: once the
process has exited, reading it fails (even if the number is reused), and the probe opens the new
worker's file on the next check.
"""

from __future__ import annotations

import os
from typing import Any, Callable

from distributed.diagnostics.plugin import NannyPlugin

PAGE = os.sysconf("SC_PAGE_SIZE")


class StatmProbe:
    """The resident bytes of one process, read from an open ``/proc/PID/statm``."""

    def __init__(self) -> None:
        self.pid: int | None = None
        self._fd: int | None = None

    def rss(self, pid: int | None) -> int | None:
        """Resident bytes of ``pid``, or None where it cannot be read (no process yet, exited)."""
        if pid is None:
            self.close()
            return None
        try:
            if pid != self.pid or self._fd is None:
                self.close()
                self._fd = os.open(f"/proc/{pid}/statm", os.O_RDONLY | os.O_CLOEXEC)
                self.pid = pid
            # statm: size resident shared text lib data dt, in pages; psutil's rss is field two.
            return int(os.pread(self._fd, 128, 0).split()[1]) * PAGE
        except (OSError, IndexError, ValueError):
            self.close()
            return None

    def close(self) -> None:
        if self._fd is not None:
            try:
                os.close(self._fd)
            except OSError:
                pass
        self._fd = self.pid = None


def cheaper_check(
    full_check: Callable[[], Any], worker_pid: Callable[[], int | None], threshold: float, probe: StatmProbe
) -> Callable[[], Any]:
    """The periodic callback: Dask's ``full_check`` only where the worker's RSS is above
    ``threshold`` bytes or unreadable. What it returns is returned: should Dask's check become a
    coroutine (the worker side's already is), tornado's PeriodicCallback awaits it."""

    def check() -> Any:
        rss = probe.rss(worker_pid())
        if rss is None or rss > threshold:
            return full_check()
        return None

    return check


def _worker_pid(nanny: Any) -> int | None:
    process = getattr(nanny.process, "process", None) if nanny.process is not None else None
    return getattr(process, "pid", None)


class CheaperMemoryCheck(NannyPlugin):
    """Puts ``cheaper_check`` in front of the nanny's memory monitor (see the module docstring)."""

    name = "h5ngff-cheaper-memory-check"
    idempotent = True

    def setup(self, nanny: Any) -> None:
        periodic = nanny.periodic_callbacks.get("memory_monitor")
        manager = getattr(nanny, "memory_manager", None)
        limit = getattr(manager, "memory_limit", None)
        fraction = getattr(manager, "memory_terminate_fraction", False)
        if periodic is None or not limit or fraction is False:  # no monitor, or a future distributed
            return
        # On the nanny, not the plugin: one plugin object may be set up on several nannies.
        probe = StatmProbe()
        nanny._h5ngff_memory_check = (periodic, periodic.callback, probe)
        # Dask terminates above memory_limit * terminate (worker_memory.NannyMemoryManager).
        periodic.callback = cheaper_check(periodic.callback, lambda: _worker_pid(nanny), limit * fraction, probe)

    def teardown(self, nanny: Any) -> None:
        # A closing nanny tears its plugins down before it stops its worker and, later, its
        # periodic callbacks: Dask's own check goes back first, or the next tick would open the
        # descriptor again and nothing would close it.
        installed = getattr(nanny, "_h5ngff_memory_check", None)
        if installed is not None:
            periodic, original, probe = installed
            periodic.callback = original
            probe.close()
