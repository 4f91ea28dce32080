"""Ranged GETs of one object with a bounded window of them in flight per calling thread.

A source in a bucket is read as byte ranges (engine.sources.ranged): one slab needs tens to
thousands of HDF5 chunks, already coalesced by the reader into a few requests of at most a few
MiB. One request at a time would leave the worker waiting a round trip per request (a few ms on
loopback, 20-50 ms to AWS), so ``FetchWindow.fetch`` keeps up to ``in_flight`` of them running on
a small pool while the calling thread decodes the bodies that have arrived, in order.

What it guarantees:
- bodies are yielded in the order of the ranges asked for;
- at most ``in_flight`` requests run at once, and at most ``in_flight + 1`` bodies are held (the
  one the caller is decoding and those in flight): the memory plan counts exactly that
  (planner/memory.py ``source_range_terms``);
- the first failed request (after its own retries) is raised in the calling thread once the
  bodies before it are consumed; the requests after it are cancelled or waited for, never left
  running behind a failed slab;
- retries made by the pool's threads are credited to the calling thread (``store_retries``), where
  the slab task counts them for the metrics.
"""

from __future__ import annotations

import threading
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable, Iterator, Sequence

from .base import store_retries

#: Pool threads: every reading thread's window at the largest ``in_flight`` the readers use on the
#: largest worker we plan; idle ones cost nothing.
POOL_THREADS = 64

_Result = tuple[int, bytes | None, BaseException | None]


class FetchWindow:
    """One per store (and so per process and bucket): the pool the ranged GETs run on."""

    def __init__(self, name: str):
        self._name = name
        self._pool: ThreadPoolExecutor | None = None
        self._lock = threading.Lock()

    def fetch(
        self, get: Callable[[int, int], bytes], ranges: Sequence[tuple[int, int]], in_flight: int
    ) -> Iterator[bytes]:
        """``get(start, length)`` of every range, at most ``in_flight`` at once, yielded in order."""
        if in_flight <= 1:
            return (get(start, length) for start, length in ranges)
        return self._windowed(get, list(ranges), in_flight)

    def _windowed(
        self, get: Callable[[int, int], bytes], ranges: list[tuple[int, int]], in_flight: int
    ) -> Iterator[bytes]:
        pool = self._executor()
        pending: deque[Future[_Result]] = deque()
        following = iter(ranges)
        try:
            for start, length in following:
                pending.append(pool.submit(_counting_retries, get, start, length))
                if len(pending) >= in_flight:
                    break
            while pending:
                retries, body, error = pending[0].result()
                pending.popleft()
                store_retries.credit(retries)
                if error is not None:
                    raise error
                nxt = next(following, None)
                if nxt is not None:
                    pending.append(pool.submit(_counting_retries, get, *nxt))
                assert body is not None
                yield body
        finally:
            _settle(pending)

    def _executor(self) -> ThreadPoolExecutor:
        with self._lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(max_workers=POOL_THREADS, thread_name_prefix=f"h5ngff-get-{self._name}")
            return self._pool


def _settle(pending: deque[Future[_Result]]) -> None:
    """After a failure or an abandoned read: cancel what has not started, wait for what has (its
    body is dropped), and credit the retries they made."""
    for future in pending:
        future.cancel()
    for future in pending:
        if not future.cancelled():
            store_retries.credit(future.result()[0])
    pending.clear()


def _counting_retries(get: Callable[[int, int], bytes], start: int, length: int) -> _Result:
    """One GET in a pool thread: (the retries it made, its body or None, its error or None)."""
    before = store_retries.mine()
    try:
        body = get(start, length)
    except BaseException as exc:  # noqa: BLE001 - handed to the reading thread
        return store_retries.mine() - before, None, exc
    return store_retries.mine() - before, body, None
