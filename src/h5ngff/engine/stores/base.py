"""The Store protocol and the retry policy every networked store shares.

A Store is where an output's bytes go: every writer and reader of an output (the engine, its
manifest and lock, ``verify``) goes through one, and none of them asks which kind it is. What
differs between stores is said by the store itself, in the capability members below, never by a
test of its type: a third store is a class with these members, passing tests/test_stores.py.

Objects (every store; tests/test_stores.py runs one contract suite against each):

- ``put(key, data)`` makes the object whole or not at all: no reader ever sees part of it;
  ``writer(key)`` does the same for bytes streamed into a file object (a shard, chunk by chunk),
  committed when the block exits cleanly and dropped when it raises; ``sync=True`` makes the
  bytes durable before they become visible (a directory fsyncs before its rename; a bucket's PUT
  is durable once acknowledged), kept for the few objects a crash must not lose (metadata);
- ``get`` of a missing key raises ``KeyError``; ``size`` returns None for it;
- ``get_suffix(key, n)`` gives the last ``n`` bytes (all of a shorter object) and the object's
  size; ``get_ranges(key, [(start, length), ...])`` yields those byte ranges in order: a shard is
  read through its index, one inner chunk at a time, never whole;
- ``list(prefix)`` gives every object under ``prefix`` (a key prefix ending in ``/``, or "" for
  all) with its size, recursively: resume and ``--overwrite`` need it, so every store lists;
- ``delete(key)`` removes one object if it exists; ``delete_prefix(prefix, keep)`` removes every
  object under ``prefix`` but the keys in ``keep``, and nothing else (a directory also removes
  the subdirectories it empties, so an overwritten output holds no empty level of the old one);
- ``occupied(ignore)``: whether anything but the keys in ``ignore`` is at the root (a directory:
  any entry, an empty subdirectory included, or a file where the directory would be);
- ``sweep()`` removes what a killed writer left behind (a directory's temporary files; nothing
  on a bucket, where an upload is whole or aborted) and returns how many; ``leftovers()`` names
  those keys without removing them (``verify`` reports them);
- ``overlapped(depth)``: within the block, the calling thread's ``put`` and ``writer`` may
  return before the object is stored, with at most ``depth`` in flight; when the block exits
  cleanly every one is stored, and an error in any is raised (a bucket overlaps its round trips
  with encoding, engine.stores.uploads; a directory writes at once, as its writes do not wait).

Capabilities (what differs, asked of the store; the callers in parentheses):

- ``supports_append`` and ``append(key, data, sync)``: add bytes at the end of an object in one
  write, creating it if absent; ``sync=True`` makes them durable first. Not atomic: a writer
  killed mid-append may leave a torn tail, which a reader of an appended object must ignore. A
  directory appends; a bucket has no append and raises OSError (the manifest appends to one
  object where it can and writes one object per batch of records otherwise, engine.write.manifest);
- ``supports_conditional_writes`` and ``create(key, data)`` (If-None-Match: *),
  ``replace(key, data, etag)`` (If-Match), ``get_tagged(key)`` (bytes and ETag): what a one-writer
  lease object needs (engine.stores.s3lease). A bucket has them (a store that answers 501 raises
  ConditionalWritesUnsupported at the first request); a directory has not and raises
  ConditionalWritesUnsupported at once: it is locked by ``flock`` on ``local_path`` instead;
- ``local_path``: the directory on this machine that holds the objects, or None (a bucket). What
  needs a real file (the ``flock`` of engine.write.lock) uses it; nothing else does;
- ``as_zarr_store()``: zarr-python's read-only store over the same objects (a zarr LocalStore on
  the directory; zarr's ObjectStore over the bucket's own client), what ``verify`` opens the
  metadata with;
- ``check_creatable()``: raise OutputError if an output cannot be created at the root (a
  directory: its nearest existing ancestor must be a directory we may write into; a bucket: the
  listing that found the prefix empty already proved it readable, so nothing more);
- ``overwrites_foreign_zarr``: whether ``--overwrite`` may replace a Zarr store h5ngff did not
  write (a directory: yes, as it always did; a bucket prefix: no, only an output of ours, since
  other writers share the bucket and nothing there can be restored; docs/engine.md).
"""

from __future__ import annotations

import logging
import random
import threading
import time
from dataclasses import dataclass
from typing import Any, BinaryIO, Callable, Collection, ContextManager, Iterable, Iterator, Protocol, Sequence, TypeVar

from ...errors import StoreUnavailableError
from .options import ATTEMPTS, RETRY_DEADLINE_S

log = logging.getLogger(__name__)
T = TypeVar("T")


class Store(Protocol):
    #: Where the store is rooted, as the user wrote it (a directory or a URL).
    root: str
    #: ``append`` adds to an object in place (a directory); else it raises (a bucket).
    supports_append: bool
    #: ``create``, ``replace`` and ``get_tagged`` work (a bucket); else they raise
    #: ConditionalWritesUnsupported (a directory, locked by ``flock`` on ``local_path``).
    supports_conditional_writes: bool
    #: ``--overwrite`` may replace a Zarr that h5ngff did not write (a directory, not a bucket).
    overwrites_foreign_zarr: bool

    @property
    def local_path(self) -> str | None: ...
    def put(self, key: str, data: bytes | memoryview | Iterable[bytes], sync: bool = False) -> int: ...
    def writer(self, key: str, sync: bool = False) -> ContextManager[BinaryIO]: ...
    def append(self, key: str, data: bytes, sync: bool = False) -> None: ...
    def get(self, key: str) -> bytes: ...
    def get_suffix(self, key: str, length: int) -> tuple[bytes, int]: ...
    def get_ranges(self, key: str, ranges: Sequence[tuple[int, int]]) -> Iterator[bytes]: ...
    def size(self, key: str) -> int | None: ...
    def list(self, prefix: str = "") -> dict[str, int]: ...
    def occupied(self, ignore: Collection[str] = ()) -> bool: ...
    def delete(self, key: str) -> None: ...
    def delete_prefix(self, prefix: str, keep: Collection[str] = ()) -> int: ...
    def sweep(self) -> int: ...
    def leftovers(self) -> tuple[str, ...]: ...
    def overlapped(self, depth: int) -> ContextManager[None]: ...
    def create(self, key: str, data: bytes, policy: "RetryPolicy | None" = None) -> str | None: ...
    def replace(self, key: str, data: bytes, etag: str, policy: "RetryPolicy | None" = None) -> str | None: ...
    def get_tagged(self, key: str, policy: "RetryPolicy | None" = None) -> tuple[bytes, str] | None: ...
    def as_zarr_store(self) -> Any: ...
    def check_creatable(self) -> None: ...


class ConditionalWritesUnsupported(Exception):
    """The store answered a conditional write (If-None-Match / If-Match) with 501 NotImplemented,
    or without an ETag: it cannot hold a lease (engine.stores.s3lease says what to do)."""


class TransientStoreError(Exception):
    """A failure worth retrying: 5xx, throttling (503 SlowDown), a reset or timed-out connection."""


@dataclass(frozen=True)
class RetryPolicy:
    """Bounded exponential backoff with full jitter (AWS's recommendation for S3 503 SlowDown)."""

    #: Attempts per request, the first included. 8 attempts span about 13 s of backoff: longer
    #: than an S3 prefix's throttling burst, short enough that a dead endpoint fails the slab soon.
    attempts: int = ATTEMPTS
    #: Seconds before the first retry; doubles per retry, capped at ``max_delay``.
    base_delay: float = 0.1
    max_delay: float = 5.0
    #: No retry starts this many seconds after the first attempt was sent: with the request
    #: timeout this bounds a request that never answers (stores.options.worst_case_seconds).
    deadline: float = RETRY_DEADLINE_S

    def delay(self, retry: int) -> float:
        return random.uniform(0, min(self.max_delay, self.base_delay * 2**retry))


class StoreRetries:
    """Retries made by this process's stores (h5ngff_store_retries_total sums them over workers)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._thread = threading.local()
        self.count = 0

    def add(self) -> None:
        with self._lock:
            self.count += 1
        self._thread.count = self.mine() + 1

    def mine(self) -> int:
        """Retries made by the calling thread (a slab runs in one thread), and by the uploads it
        handed to a pool (``credit``)."""
        return getattr(self._thread, "count", 0)

    def credit(self, retries: int) -> None:
        """Count, as the calling thread's, retries another thread made for it (already in
        ``count``): an upload the slab's thread handed to the pool (engine.stores.uploads)."""
        self._thread.count = self.mine() + retries


store_retries = StoreRetries()


def retrying(
    call: Callable[[], T],
    what: str,
    policy: RetryPolicy = RetryPolicy(),
    classify: Callable[[BaseException], Exception] | None = None,
) -> T:
    """Run ``call``; retry a transient failure (as ``classify`` maps it) with backoff, up to the
    policy's attempts and deadline; raise a permanent one at once. ``classify`` returns a
    TransientStoreError to retry, or the exception to raise."""
    first = time.monotonic()
    attempt = 0
    while True:
        sent = time.monotonic()
        try:
            return call()
        except Exception as exc:  # noqa: BLE001 - every client error goes through classify
            mapped = classify(exc) if classify else exc
            if mapped is exc:
                raise
            if not isinstance(mapped, TransientStoreError):
                raise mapped from exc
            attempt += 1
            pause = policy.delay(attempt - 1)
            if attempt >= policy.attempts or time.monotonic() + pause - first > policy.deadline:
                raise _gave_up(what, policy, attempt, time.monotonic() - first, mapped) from exc
            store_retries.add()
            _notice(what, mapped, attempt, policy, pause, time.monotonic() - sent)
            time.sleep(pause)


def _gave_up(what: str, policy: RetryPolicy, attempts: int, elapsed: float, why: Exception) -> StoreUnavailableError:
    return StoreUnavailableError(
        f"{what}: still failing after {attempts} attempt{'s' if attempts != 1 else ''} in {elapsed:.0f} s ({why}). The object store is unavailable, "
        f"throttling or not answering. Run the command again once it answers: a conversion resumes where it stopped (its "
        f"finished slabs are kept); a verify checks the output afresh (reading it changed nothing)."
    )


def _notice(what: str, why: Exception, attempt: int, policy: RetryPolicy, pause: float, took: float) -> None:
    """A retry after a slow failure (a timeout: the store did not answer) is a warning on stderr,
    so a hung endpoint is never silent; one answered at once (503 SlowDown) is logged at info."""
    level = logging.WARNING if took >= 1.0 else logging.INFO
    log.log(
        level,
        "%s: %s after %.1f s; retry %d of %d in %.2f s (no retry after %.0f s).",
        what,
        why,
        took,
        attempt,
        policy.attempts - 1,
        pause,
        policy.deadline,
    )
