"""One writer per bucket prefix: a lease object ``PREFIX/.h5ngff.lock`` held with S3 conditional
writes, the object-store counterpart of engine.write.lock's flock (docs/engine.md, "One writer").

- **Acquire**: PUT with ``If-None-Match: *``. Exactly one of two racing runs creates it.
- **Renew**: every ttl/3 a background thread PUTs a new body (its renewal count changes the ETag,
  which is the body's MD5 on S3) with ``If-Match`` on the ETag it last wrote. A 412 means another
  run took the lease: the lease is lost.
- **Stale**: wall clocks of two machines are never compared (they drift and skew). A run that
  finds a lease watches its ETag on its own monotonic clock: renewed while watched -> live ->
  OutputBusy; unchanged for the holder's full ttl -> stale. On the holder's own host (same boot
  and pid namespace) a dead pid is stale at once, a live one busy at once.
- **Take over** a stale lease with ``If-Match`` on the stale ETag: of two racing takers one wins,
  the other gets 412 and sees a live lease.
- **Lost**: a 412 on renewal, or no renewal succeeding within 2/3 ttl of sending the last good
  one (so we stop before anyone watching could call us stale, a full ttl after that request).
  The driver then cancels its slabs, records nothing more and never writes the completion marker.
- **Release** after the completion marker: PUT a "released" body with ``If-Match`` (so we never
  release a lease we lost), then DELETE it. obstore 0.12 has no conditional DELETE; the window
  left is this process stalling for a whole ttl between those two requests.

Slabs already running on workers when a lease is lost finish their PUTs (workers hold no lease):
at most the plan's in-flight slabs, with the bytes of the same conversion.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import sys
import threading
import time
import uuid
from dataclasses import dataclass
from typing import Any, Callable, Mapping

import psutil

from ... import __version__
from ...errors import OutputBusyError, OutputError
from .base import ConditionalWritesUnsupported, RetryPolicy, Store
from .options import boolean, canonical, lock_ttl

log = logging.getLogger(__name__)
LOCK_KEY = ".h5ngff.lock"
ENV_TTL = "H5NGFF_LOCK_TTL"


@dataclass(frozen=True)
class LeaseSettings:
    #: Seconds a lease stays valid without a renewal. 60 s: a renewal every 20 s is a negligible
    #: request rate, and a crashed run's prefix is free to resume a minute later.
    ttl: float = 60.0
    #: ``lock=false`` (a storage option): no lease at all, for stores without conditional writes.
    enabled: bool = True

    @property
    def renew_every(self) -> float:
        return self.ttl / 3

    @property
    def lost_after(self) -> float:
        """No successful renewal sent within this many seconds: we stop (before 1 ttl)."""
        return self.ttl * 2 / 3

    def policy(self) -> RetryPolicy:
        """Retries of one lease request: brief, so a renewal never outlives its own deadline."""
        return RetryPolicy(attempts=2, base_delay=min(0.2, self.ttl / 30), max_delay=max(0.05, self.ttl / 10))

    @property
    def request_timeout(self) -> str:
        """The lease's own client gives up on a request after this (obstore's duration syntax):
        a hung renewal must not outlive the lease. At least 2 s, for a loaded loopback server."""
        return f"{max(2.0, self.ttl / 3):.0f}s"


def lease_settings(options: Mapping[str, Any] | None) -> LeaseSettings:
    """From storage options ``lock`` (true/false) and ``lock_ttl`` (seconds), or ``H5NGFF_LOCK_TTL``;
    a value they cannot take is a SpecError (exit 2)."""
    found = {canonical(k): v for k, v in (options or {}).items()}
    enabled = boolean("lock", found.get("lock", "true"))
    return LeaseSettings(lock_ttl(found.get("lock_ttl", os.environ.get(ENV_TTL, LeaseSettings.ttl))), enabled)


# -- who we are, and whether a holder is alive ------------------------------------------------


def pid_space() -> str:
    """Where a pid means the same process: this boot of this kernel and this pid namespace
    (two containers may share a hostname but never both of these)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
        return f"{boot}:{os.stat('/proc/self/ns/pid').st_ino}"
    except OSError:
        return ""


def my_identity(ttl: float) -> dict[str, Any]:
    me = psutil.Process()
    return {
        "h5ngff": __version__,
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "pid_space": pid_space(),
        "pid_started": me.create_time(),
        "started": time.time(),
        "token": uuid.uuid4().hex,
        "ttl": ttl,
        "renewals": 0,
        "state": "held",
        "command": " ".join(sys.argv)[:500],
    }


def local_holder_alive(holder: Mapping[str, Any]) -> bool | None:
    """True/False if the holder runs in our pid space (alive, or gone), None if we cannot tell."""
    here = pid_space()
    if not here or holder.get("pid_space") != here or not isinstance(holder.get("pid"), int):
        return None
    try:
        started = float(psutil.Process(holder["pid"]).create_time())
    except psutil.Error:  # no such process (or a zombie we cannot read): gone
        return False
    return abs(started - float(holder.get("pid_started", 0))) < 1.0  # a reused pid is another process


def judge(holder: Mapping[str, Any], unchanged_for: float, default_ttl: float, alive: bool | None) -> str:
    """ "live", "stale" or "wait": the decision on a lease someone else holds (pure).

    ``unchanged_for`` is how long we have seen its ETag unchanged, on our monotonic clock; the
    holder's wall-clock times are never used."""
    if alive is False:
        return "stale"
    if alive and holder.get("state") != "released":
        return "live"
    # Elsewhere, or released and about to be deleted by its holder: stale only if it stays as it
    # is for a whole ttl (taking a released lease at once would race the releaser's DELETE).
    return "stale" if unchanged_for >= holder_ttl(holder, default_ttl) else "wait"


def holder_ttl(holder: Mapping[str, Any], default: float) -> float:
    """The ttl the holder renews against (its own), or ours for a lease we cannot read."""
    ttl = holder.get("ttl")
    return float(ttl) if isinstance(ttl, (int, float)) and ttl > 0 else default


def describe(holder: Mapping[str, Any]) -> str:
    if not holder.get("pid"):
        return "an unreadable lease (not written by h5ngff?)"
    started = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(float(holder.get("started", 0))))
    return f"pid {holder['pid']} on host {holder.get('host', '?')}, started {started}: {holder.get('command', '?')!r}"


def busy_message(output: str, holder: Mapping[str, Any], why: str) -> str:
    ttl = holder.get("ttl", "?")
    return (
        f"output.path: {output!r} is being written by another h5ngff run ({describe(holder)}); {why}. Only one run may write "
        f"an output: wait for it to finish, or stop it (kill {holder.get('pid', '?')} on {holder.get('host', '?')}) and re-run "
        f"this command to resume its output (a re-run waits out its {ttl} s lease, at once on that host); or choose another "
        f"prefix. --overwrite never deletes an output another run holds."
    )


def unsupported_message(output: str, detail: str) -> str:
    return (
        f"output.path: {output!r}: the object store does not support conditional writes ({detail}), so h5ngff cannot hold "
        f"the lease that keeps a second run off this prefix. Use a store that does (AWS S3, MinIO, Ceph RGW 18+), or, if "
        f"you make sure yourself that only one run writes this prefix, set the storage option lock=false "
        f"(--storage-option lock=false)."
    )


# -- acquire -----------------------------------------------------------------------------------


def _parse(data: bytes) -> dict[str, Any]:
    try:
        doc = json.loads(data)
    except ValueError:
        return {}
    return doc if isinstance(doc, dict) else {}


def acquire(store: Store, settings: LeaseSettings, sleep: Callable[[float], None] = time.sleep) -> "Lease":
    """Create the lease, or take over a stale one; raise OutputBusyError if another run holds it."""
    me, policy = my_identity(settings.ttl), settings.policy()
    seen: tuple[str, float] | None = None  # (the holder's ETag, when we first saw it: monotonic)
    announced = False
    for _ in range(10_000):  # each turn sleeps or changes something; the bound only stops a livelock
        body = json.dumps(me).encode()
        try:
            etag = store.create(LOCK_KEY, body, policy)
            if etag is not None:
                _check_exclusive(store, body, policy)
                return Lease(store, settings, me, etag)
            asked = time.monotonic()  # the server read this GET's answer after this instant
            current = store.get_tagged(LOCK_KEY, policy)
        except ConditionalWritesUnsupported as exc:
            raise OutputError(unsupported_message(store.root, str(exc))) from None
        if current is None:
            continue  # released between our PUT and our GET: create it again
        holder, etag = _parse(current[0]), current[1]
        if holder.get("token") == me["token"]:  # our own create, answered late (a retried PUT)
            return Lease(store, settings, me, etag)
        if seen is not None and seen[0] != etag:
            if holder.get("state") != "released":
                raise OutputBusyError(
                    busy_message(store.root, holder, "its lease was renewed while this run watched it")
                )
            seen = None  # its run just finished: wait for the DELETE that follows
        # Unchanged from the first answer we had (its read happened before we got it) to this
        # one's sending: a lower bound on how long the holder has not renewed, however slow the GETs.
        seen = seen or (etag, time.monotonic())
        verdict = judge(holder, asked - seen[1], settings.ttl, local_holder_alive(holder))
        if verdict == "live":
            raise OutputBusyError(busy_message(store.root, holder, "it is alive on this host"))
        if verdict == "stale":
            taken = store.replace(LOCK_KEY, body, etag, policy)
            if taken is not None:
                log.warning(
                    "%s: took over the stale lease of %s (not renewed for %.1f s).",
                    store.root,
                    describe(holder),
                    asked - seen[1],
                )
                return Lease(store, settings, me, taken)
            continue  # another run took it first: the next turn sees its new ETag -> busy
        wait = holder_ttl(holder, settings.ttl)
        if not announced:
            log.warning(
                "%s is leased by %s. Waiting up to %.0f s to see whether it is still renewed (a crashed run's lease "
                "expires %.0f s after its last renewal; no clocks compared).",
                store.root,
                describe(holder),
                wait,
                wait,
            )
            announced = True
        sleep(min(settings.ttl / 10, max(0.05, wait - (asked - seen[1]))))
    raise OutputBusyError(
        f"output.path: {store.root!r}: its lease kept changing hands; other runs keep starting there. Retry."
    )


def _check_exclusive(store: Store, body: bytes, policy: RetryPolicy) -> None:
    """A store that ignores If-None-Match would let every run 'create' the lease: a second
    create of the object we just wrote must be refused."""
    if store.create(LOCK_KEY, body, policy) is not None:
        store.delete(LOCK_KEY)
        raise OutputError(
            unsupported_message(store.root, "it accepted a second If-None-Match: * PUT of an existing object")
        )


# -- hold, renew, release ----------------------------------------------------------------------


class Lease:
    """A held lease, renewed by a daemon thread until ``release``. ``check()`` raises once it is lost."""

    def __init__(self, store: Store, settings: LeaseSettings, me: dict[str, Any], etag: str):
        self.store, self.settings, self.me, self.etag = store, settings, dict(me), etag
        self.error: OutputError | None = None
        self._callbacks: list[Callable[[], None]] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._last_ok_sent = time.monotonic()
        self._thread = threading.Thread(target=self._renew_loop, name="h5ngff-s3-lease", daemon=True)
        self._thread.start()

    def check(self) -> None:
        """Raise once the lease is lost; also when the renewal thread is stuck in a request past
        the deadline (it would notice only when the request returns)."""
        if self.error is None and time.monotonic() - self._last_ok_sent > self.settings.lost_after:
            self._lose(
                f"no lease renewal succeeded for {time.monotonic() - self._last_ok_sent:.1f} s (ttl {self.settings.ttl:g} s)"
            )
        if self.error is not None:
            raise self.error

    def on_lost(self, callback: Callable[[], None]) -> Callable[[], None]:
        """Call ``callback`` (from the renewal thread) when the lease is lost; returns an undo."""
        with self._lock:
            self._callbacks.append(callback)
            lost = self.error is not None
        if lost:
            callback()
        return lambda: self._callbacks.remove(callback) if callback in self._callbacks else None

    def _renew_loop(self) -> None:
        interval = self.settings.renew_every
        while not self._stop.wait(interval):
            sent = time.monotonic()
            try:
                self._renew()
            except Exception as exc:  # noqa: BLE001 - any failure: try again soon, until the deadline
                log.warning(
                    "%s: lease renewal failed (%s); retrying.",
                    self.store.root,
                    str(exc).splitlines()[0][:200] if str(exc) else type(exc).__name__,
                )
                interval = self.settings.ttl / 10
            else:
                interval = self.settings.renew_every
                if self.error is None:
                    self._last_ok_sent = sent
            if self.error is None and time.monotonic() - self._last_ok_sent > self.settings.lost_after:
                self._lose(
                    f"no lease renewal succeeded for {time.monotonic() - self._last_ok_sent:.1f} s (ttl {self.settings.ttl:g} s)"
                )
            if self.error is not None:
                return

    def _renew(self) -> None:
        self.me["renewals"] += 1
        etag = self.store.replace(LOCK_KEY, json.dumps(self.me).encode(), self.etag, self.settings.policy())
        if etag is not None:
            self.etag = etag
            return
        current = self.store.get_tagged(LOCK_KEY, self.settings.policy())
        holder = _parse(current[0]) if current else {}
        if current and holder.get("token") == self.me["token"]:
            self.etag = current[1]  # an earlier renewal of ours landed though its answer was lost
            return
        self._lose(f"its lease was taken by {describe(holder)}" if current else "its lease object was deleted")

    def _lose(self, why: str) -> None:
        with self._lock:
            if self.error is not None:  # the renewal thread and check() may both get here
                return
            self.error = self._lost_error(why)
            callbacks = list(self._callbacks)
        log.error("%s", self.error)
        for callback in callbacks:
            try:
                callback()
            except Exception:  # noqa: BLE001 - a failing canceller must not hide the loss
                log.warning("Cancelling the run after the lease was lost failed.", exc_info=True)

    def _lost_error(self, why: str) -> OutputBusyError:
        return OutputBusyError(
            f"output.path: {self.store.root!r}: this run lost its one-writer lease ({why}), so it stopped writing: no more "
            f"slabs are recorded and the output is not marked complete. Make sure no other run writes this prefix, then "
            f"re-run this command to resume."
        )

    def release(self) -> None:
        """Stop renewing; if we still hold it, mark it released (If-Match) and delete it."""
        self._stop.set()
        self._thread.join(self.settings.ttl)
        if self.error is not None:
            return
        self.me["state"] = "released"
        try:
            if (
                self.store.replace(LOCK_KEY, json.dumps(self.me).encode(), self.etag, self.settings.policy())
                is not None
            ):
                self.store.delete(LOCK_KEY)
        except Exception:  # noqa: BLE001 - an undeleted lease expires by itself after ttl
            log.warning(
                "%s: could not delete the lease object; it expires %.0f s after its last renewal.",
                self.store.root,
                self.settings.ttl,
                exc_info=True,
            )
