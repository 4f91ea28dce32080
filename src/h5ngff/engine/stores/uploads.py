"""Overlap a slab's uploads with its encoding: a bounded window of PUTs in flight per thread.

A PUT to a bucket is a round trip (tens of milliseconds to AWS, a few to a loopback endpoint)
that a worker spent waiting, one chunk after another, with its core idle: 5,664 synchronous PUTs
made the full-size seed case 2.5x slower to a bucket than to disk (docs/benchmarks.md). Inside
``UploadWindow.open(depth)``, a thread's PUTs are handed to a small pool and return at once; the
thread goes on encoding the next unit. At most ``depth`` of its PUTs are in flight: the next one
waits for the oldest, so the bytes held are bounded, and the planner counts them
(planner/memory.py ``object_store_terms``, ``upload_depth``).

What stays as it was:
- a slab's units are all stored, or its task fails, before the slab returns its record: the
  window is drained when the block exits, so the manifest never names an object still in flight;
- a failed PUT (after its own retries) fails the slab with its error; the other PUTs of the slab
  are waited for first, so a retried slab never races its own earlier uploads;
- retries made by the pool's threads are credited to the slab's thread (``store_retries.mine()``),
  where the slab task counts them for the metrics.
"""

from __future__ import annotations

import threading
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from typing import Callable, Iterator

from .base import store_retries

#: Pool threads: enough for every worker thread's window at the largest depth the planner picks
#: (planner/memory.py MAX_UPLOAD_DEPTH) on the largest worker we plan; idle ones cost nothing.
POOL_THREADS = 64


class UploadWindow:
    """One per store (and so per process and output): the pool, and each thread's window."""

    def __init__(self, name: str):
        self._name = name
        self._pool: ThreadPoolExecutor | None = None
        self._pool_lock = threading.Lock()
        self._local = threading.local()

    @property
    def depth(self) -> int:
        """PUTs the calling thread may have in flight (0: PUTs run in the caller, synchronously)."""
        return getattr(self._local, "depth", 0)

    @contextmanager
    def open(self, depth: int) -> Iterator[None]:
        """Within the block, the calling thread's ``submit``-ed PUTs overlap its work, at most
        ``depth`` at a time. On a clean exit every one has succeeded; on an error, every one has
        finished (their own errors are dropped behind the first)."""
        if depth < 1 or self.depth:
            yield  # synchronous, or already inside a window: the outer one drains
            return
        self._local.depth, self._local.pending = depth, deque()
        try:
            yield
            self._drain(raise_first=True)
        except BaseException:
            self._drain(raise_first=False)
            raise
        finally:
            self._local.depth = 0

    def submit(self, put: Callable[[], object]) -> None:
        """Run ``put`` in the pool; first wait for the oldest PUT if the window is full (its
        error, if any, is raised here, in the slab's thread). Outside a window, run it now."""
        if not self.depth:
            put()
            return
        pending: deque[Future[tuple[int, BaseException | None]]] = self._local.pending
        while len(pending) >= self._local.depth:
            self._settle_oldest(pending)
        pending.append(self._executor().submit(_counting_retries, put))

    def _drain(self, raise_first: bool) -> None:
        pending: deque[Future[tuple[int, BaseException | None]]] = self._local.pending
        first: BaseException | None = None
        while pending:
            try:
                self._settle_oldest(pending)
            except BaseException as exc:  # noqa: BLE001 - kept, raised once the window is empty
                first = first or exc
        if first is not None and raise_first:
            raise first

    @staticmethod
    def _settle_oldest(pending: deque[Future[tuple[int, BaseException | None]]]) -> None:
        """Wait for the oldest PUT and raise its error. It leaves the window only once it has
        finished: if the wait itself is interrupted, it is still pending, and the window's exit
        waits for it again."""
        oldest = pending[0]
        try:
            retries, error = oldest.result()
        finally:
            if oldest.done():
                pending.popleft()
        store_retries.credit(retries)
        if error is not None:
            raise error

    def _executor(self) -> ThreadPoolExecutor:
        with self._pool_lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(
                    max_workers=POOL_THREADS, thread_name_prefix=f"h5ngff-upload-{self._name}"
                )
            return self._pool


def _counting_retries(put: Callable[[], object]) -> tuple[int, BaseException | None]:
    """Run one PUT in a pool thread: (the retries it made, its error or None)."""
    before = store_retries.mine()
    try:
        put()
    except BaseException as exc:  # noqa: BLE001 - handed to the slab's thread
        return store_retries.mine() - before, exc
    return store_retries.mine() - before, None
