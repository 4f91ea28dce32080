"""One writer per output path: an advisory ``flock`` on ``OUT/.h5ngff.lock``, held by the run's
driver from before anything in the output is read, replaced or deleted until the completion marker
is written.

Why ``flock`` and not a pid file or ``O_CREAT|O_EXCL``: the kernel drops the lock when its holder
dies, however it dies (SIGKILL, OOM kill, power of the process gone), so a crashed run never blocks
its own resume and nobody has to guess whether a pid is stale. The pid, host and start time
written into the file are only for the error message, never for the decision.

Why inside the output and not a sibling ``OUT.h5ngff-lock``: when the output is a mount point (a
Kubernetes volume or subPath, a network share mounted at the output path), its parent is each
machine's or pod's own filesystem, so a sibling lock would exclude nobody; the parent may not be
writable either. The price is paid in ``output``: ``--overwrite`` empties the directory but keeps
the lock file, and zarr must not recreate the root with ``overwrite=True`` (it removes the whole
store directory, which would unlink the held lock file and let a second writer lock a new one).

Only the driver holds the lock. Dask workers are separate interpreters (spawned, or on other
machines), and the descriptor is close-on-exec (Python's default), so no worker inherits it: a
worker left over from a killed driver cannot keep the output locked.

Release unlinks the file while still holding the lock, then closes it. A process that opened the
old file just before the unlink and locks it afterwards sees that its inode is no longer the
path's and starts over, so there are never two holders; a finished output is a plain OME-Zarr.

Scope: one machine, or a shared filesystem whose ``flock`` is honoured across clients (Linux NFS
v4 maps it to a byte-range lock; after a client machine crashes, the server frees it only when
the client's lease expires, ~90 s). Kubernetes jobs also take a Lease per output path (operator).
A store with no local directory (``Store.local_path`` None: a bucket) has no flock: it holds a
lease object under the same name instead (engine.stores.s3lease), where the store has conditional writes.

``output_lock`` yields a guard: ``check()`` raises once the lock is lost (only a lease can be)
and ``on_lost(callback)`` lets the driver cancel its slabs at that moment.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import socket
import sys
import time
from contextlib import contextmanager
from typing import Any, Callable, Iterator, Mapping

from ...errors import OutputBusyError, OutputError
from ..stores.s3lease import LOCK_KEY, acquire, lease_settings, unsupported_message
from ..stores import Store, open_store

log = logging.getLogger(__name__)

#: The lock's name under the output's root: a directory's flock file, a bucket's lease object
#: (one name, so neither is content, and ``--overwrite`` keeps it).
LOCK_NAME = LOCK_KEY
#: A lock file can be unlinked by its releasing holder between our open and our flock: start over
#: this many times (each race needs another run to finish in that window, so 2 would do).
_ATTEMPTS = 20


class Held:
    """The guard of a lock that cannot be lost (a flock, or none)."""

    def check(self) -> None:
        pass

    def on_lost(self, callback: Callable[[], None]) -> Callable[[], None]:
        return lambda: None


@contextmanager
def output_lock(path: str, storage_options: Mapping[str, Any] | None = None) -> Iterator[Any]:
    """Hold the output's lock for the block, or raise OutputBusyError naming the holder; yields
    the guard (``check``, ``on_lost``).

    An output that exists but is not a directory is not locked: nothing will be written there
    (``prepare_output`` refuses it). A store with no local directory holds a lease object
    (engine.stores.s3lease)."""
    store = open_store(path, storage_options)
    if store.local_path is None:
        with _object_lease(store, path, storage_options) as guard:
            yield guard
        return
    # (``path`` as the caller wrote it, which the messages name; it is the store's directory)
    if os.path.exists(path) and not os.path.isdir(path):
        yield Held()
        return
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as exc:
        raise OutputError(
            f"output.path: cannot create {path!r}: {exc.strerror or exc}. Choose a writable location."
        ) from None
    fd = _acquire(os.path.join(path, LOCK_NAME), path)
    try:
        yield Held()
    finally:
        _release(os.path.join(path, LOCK_NAME), fd)


@contextmanager
def inspection_lock(path: str, storage_options: Mapping[str, Any] | None = None) -> Iterator[Any]:
    """What ``check_output`` holds while it inspects an output, writing nothing: a lease (a
    prefix another run is starting on holds its objects before its claim is readable, and that
    run is busy, not a conflict); nothing for a directory, whose flock would create it (the CLI
    probes its lock file first, ``refuse_if_held``)."""
    if open_store(path, storage_options).local_path is not None:
        yield Held()
        return
    with output_lock(path, storage_options) as guard:
        yield guard


@contextmanager
def _object_lease(store: Store, path: str, options: Mapping[str, Any] | None) -> Iterator[Any]:
    settings = lease_settings(options)
    if not settings.enabled:
        log.warning(
            "%s: storage option lock=false: no one-writer lease is taken; nothing stops a second run from writing this prefix.",
            path,
        )
        yield Held()
        return
    if not store.supports_conditional_writes:
        raise OutputError(unsupported_message(store.root, "it has no conditional writes"))
    # The lease has a client of its own with a short request timeout (the data's is stores.options.TIMEOUT_S).
    lease = acquire(open_store(path, {**(options or {}), "timeout": settings.request_timeout}), settings)
    try:
        yield lease
    finally:
        lease.release()


def _acquire(lock_file: str, output: str) -> int:
    for _ in range(_ATTEMPTS):
        try:
            fd = os.open(lock_file, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        except OSError as exc:  # a read-only output (or filesystem): no run may write it
            raise OutputError(
                f"output.path: cannot create its lock file {lock_file!r}: {exc.strerror or exc}. "
                f"Make {output!r} writable, or choose another path."
            ) from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _holder(fd)
            os.close(fd)
            raise OutputBusyError(_busy_message(output, holder)) from None
        except OSError as exc:
            os.close(fd)
            raise OutputError(
                f"output.path: cannot lock {lock_file!r}: {exc.strerror or exc}. The filesystem must support flock."
            ) from None
        if _same_file(fd, lock_file):
            _describe_self(fd)
            return fd
        os.close(fd)  # the previous holder unlinked it as we locked it: lock the new file instead
    raise OutputBusyError(
        f"output.path: {output!r}: its lock file kept changing over {_ATTEMPTS} attempts; other runs keep starting and finishing there. Retry."
    )


def _same_file(fd: int, path: str) -> bool:
    try:
        on_disk = os.stat(path)
    except FileNotFoundError:
        return False
    held = os.fstat(fd)
    return (held.st_dev, held.st_ino) == (on_disk.st_dev, on_disk.st_ino)


def _describe_self(fd: int) -> None:
    info = {
        "pid": os.getpid(),
        "host": socket.gethostname(),
        "started": time.time(),
        "command": " ".join(sys.argv)[:500],
    }
    os.ftruncate(fd, 0)
    os.pwrite(fd, json.dumps(info).encode(), 0)


def _holder(fd: int) -> dict[str, Any]:
    try:
        holder = json.loads(os.pread(fd, 4096, 0) or b"{}")
    except ValueError:  # the holder has not written its details yet
        return {}
    return holder if isinstance(holder, dict) else {}


def _busy_message(output: str, holder: dict[str, Any]) -> str:
    if holder.get("pid"):
        started = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(holder.get("started", 0)))
        who = (
            f"pid {holder['pid']} on host {holder.get('host', '?')}, started {started}: {holder.get('command', '?')!r}"
        )
        stop = f"stop it (kill {holder['pid']} on {holder.get('host', '?')})"
    else:
        who, stop = "a run that is just starting", "stop it"
    return (
        f"output.path: {output!r} is being written by another h5ngff run ({who}). Only one run may write an output: "
        f"wait for it to finish, or {stop} and re-run this command to resume its output; or choose another path. "
        f"--overwrite never deletes an output another run holds."
    )


def refuse_if_held(path: str) -> None:
    """Raise OutputBusyError if another run holds a local output's lock, without creating
    anything: the run takes the lock itself later (``output_lock``) and would refuse only then,
    after the plan had been printed. A probe, not a claim: it holds a shared lock for an instant,
    so a run starting at that instant is refused as if this one held it. A URL names no local
    lock file (the open fails as for a missing one): an object store's lease is checked by the run."""
    try:
        fd = os.open(os.path.join(path, LOCK_NAME), os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return  # no lock file (or no output): nobody holds it
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            raise OutputBusyError(_busy_message(path, _holder(fd))) from None
        except OSError:
            return  # a filesystem without flock: the run's own attempt says so
        fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)


def _release(lock_file: str, fd: int) -> None:
    try:
        if _same_file(fd, lock_file):
            os.unlink(lock_file)
    except OSError:
        pass  # the output was removed under us: nothing left to clean
    finally:
        os.close(fd)
