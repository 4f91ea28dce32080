"""The main module of the Dask worker processes a LocalCluster spawns (see
``local.workers_skip_main_module``): it makes them ignore SIGINT and exit without interpreter
teardown.

multiprocessing's *spawn* runs the parent's main module in every child as ``__mp_main__``, before
the child unpickles its work. A terminal's Ctrl-C goes to the whole foreground process group, so
without this each worker died with its own ``KeyboardInterrupt`` and ``CommClosedError``
tracebacks (about 60 lines) while the parent, which stops the workers itself when it closes the
cluster, printed the one line that matters: "interrupted: re-run the same command to resume".

Exit: when the worker has closed (its tasks done, its files closed and renamed, its comms shut),
multiprocessing's bootstrap has run its exit functions, joined the process's threads and flushed
stdout and stderr. What a normal exit does after that is tear the interpreter down (atexit
handlers, module and object finalisation), which took 0.35-0.4 s of every conversion (the nanny
waits for it) and writes nothing. So the process leaves with ``os._exit`` and the bootstrap's own
exit code (measured with ``python -m bench.cluster_cost``: see docs/benchmarks.md).
"""

import signal

if __name__ == "__mp_main__":
    import os
    from multiprocessing.process import BaseProcess

    signal.signal(signal.SIGINT, signal.SIG_IGN)

    # A worker forked from the fork server (backends/forkserver.py) has jemalloc already loaded,
    # but jemalloc stops its background threads in a forked child; they return freed pages to
    # the kernel after dirty_decay_ms, which the plan counts on. Start them again. (A spawned
    # worker has them from MALLOC_CONF; asking again changes nothing. glibc has no mallctl.)
    if "background_thread:true" in os.environ.get("MALLOC_CONF", ""):
        import ctypes

        _mallctl = getattr(ctypes.CDLL(None), "mallctl", None)
        if _mallctl is not None:
            _on = ctypes.c_bool(True)
            _mallctl(b"background_thread", None, None, ctypes.byref(_on), ctypes.c_size_t(ctypes.sizeof(_on)))

    _bootstrap = BaseProcess._bootstrap  # type: ignore[attr-defined]  # private, stable since Python 3.4

    def _bootstrap_then_exit(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        os._exit(_bootstrap(self, *args, **kwargs))

    BaseProcess._bootstrap = _bootstrap_then_exit  # type: ignore[attr-defined]
