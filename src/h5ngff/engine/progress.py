"""Progress events: one object, sent to every listener (progress bar, metrics, operator status)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable

from ..phases import Phase


@dataclass
class Progress:
    phase: str = Phase.PENDING  #: one of phases.RUN_PHASES
    slabs_done: int = 0
    slabs_total: int = 0
    #: Slabs found done in the manifest at start (resume), included in ``slabs_done``.
    slabs_skipped: int = 0
    bytes_read: int = 0
    bytes_written: int = 0
    #: Object store requests retried after a transient error (5xx, throttling, resets).
    store_retries: int = 0
    pass_index: int = 0
    passes: int = 0
    started: float = field(default_factory=time.time)
    message: str = ""

    @property
    def elapsed(self) -> float:
        return time.time() - self.started

    @property
    def fraction(self) -> float:
        return self.slabs_done / self.slabs_total if self.slabs_total else 0.0

    @property
    def read_throughput(self) -> float:
        """Source bytes per second since the start (bytes/s)."""
        return self.bytes_read / self.elapsed if self.elapsed > 0 else 0.0

    @property
    def eta_seconds(self) -> float | None:
        fresh = self.slabs_done - self.slabs_skipped
        if fresh <= 0 or self.slabs_done >= self.slabs_total:
            return None if self.slabs_done < self.slabs_total else 0.0
        return self.elapsed / fresh * (self.slabs_total - self.slabs_done)


Listener = Callable[[Progress], None]


class Broadcast:
    """Sends each update to every listener; a failing listener is logged, never fatal."""

    def __init__(self, listeners: list[Listener] | None = None):
        self.listeners = list(listeners or [])
        self.progress = Progress()

    def add(self, listener: Listener) -> None:
        self.listeners.append(listener)

    def emit(self, **changes: Any) -> Progress:
        for key, value in changes.items():
            setattr(self.progress, key, value)
        for listener in self.listeners:
            try:
                listener(self.progress)
            except Exception:  # a broken display must not fail a conversion
                import logging

                logging.getLogger(__name__).exception("progress listener failed")
        return self.progress
