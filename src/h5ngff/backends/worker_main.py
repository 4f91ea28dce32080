"""The main module of the Dask worker processes a LocalCluster spawns (see
``local.workers_skip_main_module``): it only makes them ignore SIGINT.

multiprocessing's *spawn* runs the parent's main module in every child as ``__mp_main__``, before
the child unpickles its work. A terminal's Ctrl-C goes to the whole foreground process group, so
without this each worker died with its own ``KeyboardInterrupt`` and ``CommClosedError``
tracebacks (about 60 lines) while the parent, which stops the workers itself when it closes the
cluster, printed the one line that matters: "interrupted: re-run the same command to resume".
"""

import signal

if __name__ == "__mp_main__":
    signal.signal(signal.SIGINT, signal.SIG_IGN)
