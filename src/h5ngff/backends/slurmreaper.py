"""Cancels a run's SLURM jobs when the process that submitted them dies, however it dies.

The scheduler lives in the h5ngff process: when that process is SIGKILLed (or its machine's OOM
killer picks it) no ``finally`` runs, and the worker jobs would hold their memory and CPUs until
their death timeout. This watcher, started in its own session so a terminal's Ctrl-C does not
reach it, polls the submitter and runs ``scancel --name`` once it is gone.

    python -m h5ngff.backends.slurmreaper PID JOB_NAME
"""

from __future__ import annotations

import os
import signal
import sys
import time

from .slurmctl import cancel_by_name, stop_by_name

POLL_SECONDS = 0.25


def _start_time(pid: int) -> str | None:
    """The process's start time (field 22 of /proc/PID/stat): a reused pid has another."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def watch(pid: int, job_name: str) -> None:
    started = _start_time(pid)
    while started is not None and _start_time(pid) == started:
        time.sleep(POLL_SECONDS)
    stop_by_name(job_name)  # running jobs end within seconds (no KillWait), leaving nothing on the node
    cancel_by_name(job_name)  # anything still queued (a job whose submission was answered late)


def main(argv: list[str]) -> int:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # SIGTERM from the session means "the run closed its jobs itself": leave quietly.
    signal.signal(signal.SIGTERM, lambda *_: os._exit(0))
    watch(int(argv[0]), argv[1])
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
