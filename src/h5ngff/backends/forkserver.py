"""How the embedded cluster's nannies start their worker processes: forked from a fork server
that has imported Dask once, instead of a fresh interpreter per worker.

multiprocessing's *spawn* (Dask's default) starts each worker as a new interpreter that imports
Dask and its dependencies again: about 0.45 CPU-s per worker (``python -c "import distributed"``
on this project's machines), paid by every worker of every conversion, 16 times on a 16-core
workstation. multiprocessing's *forkserver* starts one server process that imports them once;
each worker is then a fork of it, its imported modules shared copy-on-write. Dask supports it
(``distributed.worker.multiprocessing-method``) and preloads its own modules into the server.

The server is one per process and keeps the environment it was started with, while a worker
must start with this cluster's: its allocator (``LD_PRELOAD``, ``MALLOC_CONF``: the plan counts on
them) and whatever else the caller has set since (a test's fault injection, a user's variables).
The local backend puts the plan's worker environment into ``os.environ`` while its cluster lives
(``local.worker_environment``), the first worker starts the server, and every worker forked from
it has that environment. A later cluster in the same process whose environment differs in any
variable lets that server go (it exits once the processes forked from it have) and its first
worker starts a new one. A server this module did not start, or one multiprocessing has lost
track of, is left alone and the workers are spawned instead.

What a fork does not carry over is put back in each worker (``backends/worker_main``):
jemalloc's background threads, which return freed pages to the kernel.
"""

from __future__ import annotations

import importlib.util
import logging
import multiprocessing
import multiprocessing.forkserver as mp_forkserver
import multiprocessing.resource_tracker as mp_resource_tracker
import multiprocessing.util as mp_util
import os
import signal
import sys
import threading
from contextlib import contextmanager
from typing import Any, Iterable, Iterator, Mapping

log = logging.getLogger(__name__)

#: Set to "spawn" to start every worker as a fresh interpreter, as Dask does by default.
METHOD_VARIABLE = "H5NGFF_WORKER_START"

_started_with: dict[str, str] | None = None


#: Variables that are no difference between two environments: the nanny sets PYTHONHASHSEED when
#: it is unset, and pytest rewrites its marker for every phase of every test (no worker reads it;
#: compared, every test's cluster would start a server of its own).
_NOT_COMPARED = ("PYTHONHASHSEED", "PYTEST_CURRENT_TEST")


def _spawn_asked() -> bool:
    return os.environ.get(METHOD_VARIABLE, "forkserver") == "spawn"


def _environment() -> dict[str, str]:
    env = dict(os.environ)
    for name in _NOT_COMPARED:
        env.pop(name, None)
    return env


@contextmanager
def environment(variables: Mapping[str, str]) -> Iterator[None]:
    """``variables`` in ``os.environ`` inside the block, the earlier values back after it."""
    before = {key: os.environ.get(key) for key in variables}
    os.environ.update(variables)
    try:
        yield
    finally:
        for key, value in before.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


#: What the server imports before it forks any worker: what a spawned worker imports anyway, at
#: its start (Dask's required packages, numpy, lz4) or with its first slab task (the engine:
#: h5py, hdf5plugin, zarr, numcodecs; about 0.2 CPU-s a worker, paid once here instead). Not
#: Dask's own list, which adds pandas where it is installed (``distributed.utils.get_mp_context``,
#: importing it in this process to check): a forked worker's RSS starts with every page of the
#: server's, and pandas added 25 MiB to each worker, past a plan whose interpreter term was
#: fitted on spawned workers (141 MiB measured against 138.3 planned, pandas 3.1 installed). No
#: worker needs pandas. Importing the engine starts no thread (a fork keeps only the forking one).
WORKER_PRELOAD = (
    "distributed",
    "dask",
    "msgpack",
    "cloudpickle",
    "tornado",
    "toolz",
    "numpy",
    "lz4",
    "h5ngff.engine.write.tasks",
)


def _set_preload(preload: Iterable[str]) -> None:
    """The server's preload: those of ``preload`` that are installed (found, not imported), and
    Dask told that it is set, so that its nannies do not set their own."""
    modules = [name for name in preload if importlib.util.find_spec(name) is not None]
    multiprocessing.get_context("forkserver").set_forkserver_preload(modules)
    dask_utils = sys.modules.get("distributed.utils")
    if dask_utils is not None and hasattr(dask_utils, "_forkserver_preload_set"):
        dask_utils._forkserver_preload_set = True  # type: ignore[attr-defined]  # private: no setter exists


#: multiprocessing's resource tracker warns, when it exits, of every semaphore a worker could not
#: unlink because it was killed ("There appear to be N leaked semaphore objects to clean up at
#: shutdown"), and then unlinks it: nothing is left behind, the run's report already counts the
#: worker's restart, and the two lines came after the report of a run that had succeeded. The
#: filter is by module: the tracker's other warning (an unlink that failed) goes too, as both
#: begin "resource_tracker: " and a -W filter cannot tell them apart by message.
QUIET_TRACKER = "ignore::UserWarning:multiprocessing.resource_tracker"


def start_resource_tracker() -> None:
    """Start this process's resource tracker (shared by its fork server and spawned workers)
    without that warning, unless one already runs. multiprocessing starts it with this
    interpreter's ``-W`` options: the filter goes last among them, so it wins over a ``-W default``
    of the caller's, and holds under ``-E``/``-I`` (which drop PYTHONWARNINGS)."""
    sys.warnoptions.append(QUIET_TRACKER)
    try:
        mp_resource_tracker.ensure_running()
    finally:
        sys.warnoptions.remove(QUIET_TRACKER)


def start_early(
    worker_env: Mapping[str, str], preload: Iterable[str] = WORKER_PRELOAD, shield_ctrl_c: bool = True
) -> bool:
    """Start the server now, with this process's environment and ``worker_env`` on top, preloading
    those of ``preload`` that are installed (``entry.py``: while the CLI imports its modules). A
    cluster whose environment is the same then uses it; True if it was started (not where
    ``H5NGFF_WORKER_START=spawn`` or a server already runs).

    A terminal's Ctrl-C reaches the whole process group, and multiprocessing's server ignores
    SIGINT only once its preload is done (half a second): a Ctrl-C then killed it with a
    traceback beside the CLI's own clean message. So it starts with SIGINT blocked, as a server
    the cluster starts does (``local.ctrl_c_after_start``); processes forked from it inherit the
    mask until ``worker_main`` ignores SIGINT. ``shield_ctrl_c=False`` is the tests' negative
    control."""
    global _started_with
    server = getattr(mp_forkserver, "_forkserver", None)
    if _spawn_asked() or server is None or getattr(server, "_forkserver_pid", None) is not None:
        return False
    # Dask's nanny gives its workers PYTHONHASHSEED=6640 where it is unset; a server started by
    # the nanny gets it that way, this one here.
    worker_env = {"PYTHONHASHSEED": "6640", **worker_env} if "PYTHONHASHSEED" not in os.environ else dict(worker_env)
    with environment(worker_env):
        _set_preload(preload)
        # The resource tracker first: starting it unblocks SIGINT in this thread again.
        start_resource_tracker()
        mask = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT} if shield_ctrl_c else set())
        try:
            server.ensure_running()
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, mask)  # a Ctrl-C held meanwhile is raised here
        _started_with = _environment()
    log.debug("fork server started early")
    return True


def worker_start_method() -> str:
    """The multiprocessing start method for this cluster's workers, once this process's
    environment is what they must start with: "forkserver", after making sure that a running
    server has that environment, or "spawn" (``H5NGFF_WORKER_START=spawn``, or a server this
    module did not start or cannot use)."""
    global _started_with
    start_resource_tracker()  # spawned workers and the fork server alike register with it
    if _spawn_asked():
        return "spawn"
    server = getattr(mp_forkserver, "_forkserver", None)
    pid = getattr(server, "_forkserver_pid", None)
    if pid is not None and (_started_with is None or not _usable(server, pid)):
        # Not one this module started (its environment is unknown: a user's process pool, say),
        # or its state no longer matches a live child of ours (something else reaped it, or an
        # interrupt landed inside multiprocessing's own stop): Dask's spawn needs none of it.
        log.debug("the fork server cannot be used: workers are spawned")
        return "spawn"
    env = _environment()
    if pid is not None and env != _started_with:
        log.debug("a new fork server: the environment changed")
        try:
            _let_go(server, pid)
        except Exception:
            log.debug("the fork server could not be let go: workers are spawned", exc_info=True)
            return "spawn"
    _started_with = env
    _set_preload(WORKER_PRELOAD)  # before the nannies ask Dask for its context (a server it starts)
    return "forkserver"


def _let_go(server: Any, pid: int) -> None:
    """Forget the running server so that the next worker starts a new one, and let the old one
    exit on its own. multiprocessing's own ``_stop`` waits for it to exit, which it does only once
    every process forked from it has (each holds its "alive" descriptor): a worker that outlived
    its cluster would block this one for good (a CI run hung on it). Its exit is waited for on a
    thread, so it leaves no zombie."""
    with server._lock:
        alive, address = server._forkserver_alive_fd, server._forkserver_address
        server._forkserver_alive_fd = server._forkserver_pid = server._forkserver_address = None
    os.close(alive)  # the server's signal to stop
    if address and not mp_util.is_abstract_socket_namespace(address):
        try:
            os.unlink(address)  # a socket file, where the platform has no abstract namespace
        except OSError:
            pass
    threading.Thread(target=_reap, args=(pid,), name="h5ngff-fork-server-reaper", daemon=True).start()


def _reap(pid: int) -> None:
    try:
        os.waitpid(pid, 0)
    except ChildProcessError:
        pass


def _usable(server: object, pid: int) -> bool:
    """Whether multiprocessing's record of its running server ``pid`` is whole: this module can
    let it go, and multiprocessing can reuse it."""
    if any(not hasattr(server, name) for name in ("_lock", "_forkserver_address")):
        return False  # another Python's multiprocessing: not what this module knows how to handle
    if getattr(server, "_forkserver_alive_fd", None) is None:
        return False
    try:
        os.kill(pid, 0)  # an exited server not yet waited for still counts: multiprocessing waits for it
    except ProcessLookupError:
        return False  # waited for by someone else: multiprocessing's waitpid would fail
    except PermissionError:
        return False  # the number is another user's process now
    return True
