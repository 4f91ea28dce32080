"""What the command line lets through of Dask's own logs."""

from __future__ import annotations

import logging

import distributed  # noqa: F401  (installs Dask's logging config, as the CLI's main does first)

from h5ngff.cli import quiet_dask_logs


class Kept(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def test_the_schedulers_broadcast_failures_show_only_with_verbose():
    """h5ngff's polls ask Dask to ignore a worker that is gone; Dask logs each as an ERROR anyway,
    and on a run the kernel kills those lines came before the one that says what happened."""
    dask_logger = logging.getLogger("distributed")
    scheduler = logging.getLogger("distributed.scheduler")
    level = dask_logger.level
    kept = Kept()
    scheduler.addHandler(kept)
    failed = "broadcast to tcp://127.0.0.1:40441 failed: CommClosedError: in <TCP (closed)>: ConnectionResetError"
    try:
        quiet_dask_logs(0)
        scheduler.error(failed)
        # The control: any other error of the scheduler still shows, through the same handler.
        scheduler.error("Workers don't have promised key: ['tcp://127.0.0.1:1']")
        assert kept.messages == ["Workers don't have promised key: ['tcp://127.0.0.1:1']"]
        kept.messages.clear()
        quiet_dask_logs(1)  # -v: everything Dask says at WARNING and above
        scheduler.error(failed)
        assert kept.messages == [failed]
    finally:
        scheduler.removeHandler(kept)
        quiet_dask_logs(1)  # no filter left for the tests that follow
        dask_logger.setLevel(level)
