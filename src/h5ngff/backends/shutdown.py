"""A quiet end of a run: no tracebacks from Dask's own shutdown races, with any worker count.

A cluster already closes in a sound order (``SpecCluster.close``: the client's futures are
released, the scheduler retires every worker, each nanny stops its worker process and waits for
it, and only then does the scheduler close), yet a 16-worker conversion printed tracebacks at its
end, more often the busier the machine. Three races, each fixed where it starts:

* ``Failed to communicate with scheduler during heartbeat`` (``CommClosedError``, an ERROR of
  ``distributed.worker``): ``Worker.close`` stops the heartbeat's periodic callback but not a
  heartbeat already waiting for the scheduler's reply, and then closes its connection pool under
  it. Under CPU load a reply takes long enough that one of 16 workers is often caught (3 runs in
  8 with 4 CPU burners on 2 cores). ``StopHeartbeat`` (a worker plugin: ``Worker.close`` tears the
  plugins down before it closes its connections) stops the heartbeat and cancels one in flight.
* ``Task exception was never retrieved … Nanny._log_event … ConnectionPool closing``: our nanny
  plugin reported every worker exit to the scheduler, the ones the nanny itself asked for at
  shutdown too, in a fire-and-forget task that the nanny's closing connection pool failed. It is
  printed only when the garbage collector reaches the failed task before the process exits, so
  some runs showed all 16 and most none. The report is now skipped for the exits a closing nanny
  asked for (``diagnostics.WorkerExitReporter``); the run's events are read before the cluster
  closes, so nothing read them.
* ``NameError: cannot access free variable 'future'`` after a Ctrl-C (a tornado "Exception in
  callback" ERROR): a bug in ``distributed.utils.sync``. Its KeyboardInterrupt handler schedules
  ``cancel()``, which reads the not yet assigned ``future`` when the interrupt lands before the
  event loop has started the call (a window that widens under load). Had ``future`` been bound
  (to None, as distributed 2022.02 did), ``cancel()`` would have done nothing, so the failure
  changes nothing: ``quiet_sync_cancel_race`` drops exactly these records in the client process.
"""

from __future__ import annotations

import asyncio
import logging
import os
from typing import Any

from distributed.diagnostics.plugin import WorkerPlugin

#: tornado's logger of exceptions raised by event-loop callbacks.
TORNADO_CALLBACKS = "tornado.application"


class StopHeartbeat(WorkerPlugin):
    """Stops the worker's heartbeat, and a heartbeat in flight, before the worker closes its
    connections (see the module docstring). Cancelling is safe: a closing worker needs no
    heartbeat, and the scheduler already handles a heartbeat connection that goes away (it did
    whenever the worker closed the pool under the request)."""

    name = "h5ngff-stop-heartbeat"
    idempotent = True

    def __init__(self) -> None:
        self._in_flight: asyncio.Task[Any] | None = None

    def setup(self, worker: Any) -> None:
        periodic = worker.periodic_callbacks.get("heartbeat")
        if periodic is None:  # a future distributed without it: nothing to stop
            return
        beat = periodic.callback

        async def tracked_heartbeat() -> None:
            self._in_flight = asyncio.current_task()
            try:
                await beat()
            finally:
                self._in_flight = None

        periodic.callback = tracked_heartbeat

    async def teardown(self, worker: Any) -> None:
        periodic = worker.periodic_callbacks.get("heartbeat")
        if periodic is not None:
            periodic.stop()
        task = self._in_flight
        # Not the heartbeat itself: a heartbeat that learns the scheduler forgot the worker closes
        # the worker from inside it, and this teardown then runs in that very task.
        if task is None or task.done() or task is asyncio.current_task():
            return
        task.cancel()
        await asyncio.wait({task})


def is_sync_cancel_race(record: logging.LogRecord) -> bool:
    """True for tornado's log of ``distributed.utils.sync``'s ``cancel`` failing with a NameError
    on its unassigned ``future`` (and nothing else: another NameError, or one raised elsewhere, is
    a bug that must be seen)."""
    if not record.exc_info or not isinstance(record.exc_info[1], NameError):
        return False
    tb = record.exc_info[2]
    if tb is None:
        return False
    while tb.tb_next is not None:
        tb = tb.tb_next
    code = tb.tb_frame.f_code
    return (
        code.co_name == "cancel"
        and code.co_filename.endswith(os.path.join("distributed", "utils.py"))
        and "'future'" in str(record.exc_info[1])
    )


def _drop_sync_cancel_race(record: logging.LogRecord) -> bool:
    return not is_sync_cancel_race(record)


def quiet_sync_cancel_race() -> None:
    """Drop the log of distributed's ``sync`` cancel race in this (the client's) process. Idempotent."""
    logger = logging.getLogger(TORNADO_CALLBACKS)
    if _drop_sync_cancel_race not in logger.filters:
        logger.addFilter(_drop_sync_cancel_race)


#: Dask's scheduler, which a LocalCluster runs in the client's process.
SCHEDULER_LOG = "distributed.scheduler"


def is_repeated_death_log(record: logging.LogRecord) -> bool:
    """Dask's "Task ... marked as failed because N workers died while trying to run it"."""
    return (
        record.name == SCHEDULER_LOG
        and isinstance(record.msg, str)
        and record.msg.startswith("Task %s marked as failed because %d workers died")
    )


def _drop_repeated_death(record: logging.LogRecord) -> bool:
    # Dropped at the default verbosity only (distributed's loggers at ERROR, cli.main): the run's
    # own error says the same with its cause and figures (OOMKilled, NannyTerminated), and this
    # line, with its own timestamp and a task key, came before it as if it were another failure.
    quiet = logging.getLogger("distributed").getEffectiveLevel() >= logging.ERROR
    return not (quiet and is_repeated_death_log(record))


def quiet_repeated_death_log() -> None:
    """Drop Dask's log of a task whose workers died, in this process, where h5ngff reports it. Idempotent."""
    logger = logging.getLogger(SCHEDULER_LOG)
    if _drop_repeated_death not in logger.filters:
        logger.addFilter(_drop_repeated_death)
