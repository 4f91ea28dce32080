"""SIGTERM ends a run as Ctrl-C does.

``kill``, Kubernetes deleting a runner's pod and SLURM's ``scancel`` send SIGTERM, whose default
ends the process at once: the cluster was left to its own exit handlers (leaked-semaphore
warnings, workers orphaned for a moment), the output lock released only by the kernel, and the
exit status 143 was not in the table. With ``terminate_like_ctrl_c`` installed, SIGTERM raises
``Terminated``, a KeyboardInterrupt, in the main thread: every path that closes a cluster and
keeps finished slabs on Ctrl-C does the same for it, and the CLI exits 143 with one line.

While a cluster starts, Ctrl-C is held (``local.ctrl_c_after_start``: Dask cannot close a cluster
interrupted half-way through its start). SIGTERM is held there too, with ``hold_termination``,
and raised when the start is done. It is not blocked as SIGINT is, because blocked signals are
inherited: the workers would then ignore the SIGTERM with which their nanny stops them.
"""

from __future__ import annotations

import signal
import threading
from contextlib import contextmanager
from typing import Any, Iterator

from ..errors import ExitCode


class Terminated(KeyboardInterrupt):
    """The process was sent SIGTERM: it unwinds as a Ctrl-C does."""


_holding = 0
_pending = False


def _on_sigterm(signum: int, frame: Any) -> None:
    global _pending
    if _holding:
        _pending = True
        return
    raise Terminated


def terminate_like_ctrl_c() -> None:
    """Make SIGTERM raise ``Terminated`` (signal handlers can be set in the main thread only)."""
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _on_sigterm)


@contextmanager
def hold_termination() -> Iterator[None]:
    """Hold a SIGTERM that arrives inside the block, and raise it as ``Terminated`` after it."""
    global _holding, _pending
    _holding += 1
    try:
        yield
    finally:
        _holding -= 1
        if not _holding and _pending:
            _pending = False
            raise Terminated


def interrupted_exit(exc: KeyboardInterrupt) -> tuple[str, ExitCode]:
    """What the command prints (its first words, then ": re-run the same command to resume.")
    and exits with, for a Ctrl-C or a SIGTERM: the CLI's and the console script's one answer."""
    if isinstance(exc, Terminated):
        return "terminated (SIGTERM)", ExitCode.TERMINATED
    return "interrupted", ExitCode.INTERRUPTED
