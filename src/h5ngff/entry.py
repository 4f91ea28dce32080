"""The ``h5ngff`` command's entry point: starts the workers' fork server before the CLI's imports.

A local conversion's workers are forked from a fork server that imports Dask once
(``backends/forkserver.py``); the first worker would start it, after the CLI has imported its
modules (about 0.6 s) and planned. Started here instead, the server imports Dask on another core
while this process imports the CLI, and the cluster is up sooner. Only for the commands that start
a local cluster on their own (``convert`` and ``demo`` without ``--backend``, ``--scheduler`` or
``--enforce-pod-limits``), and with the environment the plan's workers will have: the default
allocator's variables, or those of ``--allocator``. Where the plan's environment turns out to
differ, the cluster starts a new server and this one is only wasted (one process, about half a
CPU-second); ``H5NGFF_WORKER_START=spawn`` starts none.

This module imports only the standard library, ``backends.interrupts`` (with ``errors``),
``backends.allocator`` and ``backends.forkserver`` (the standard library too) before it hands over.
"""

from __future__ import annotations

import sys

from .backends.interrupts import interrupted_exit, terminate_like_ctrl_c

#: Commands that start a LocalCluster when none of ``_OTHER_CLUSTER`` is given.
_LOCAL_COMMANDS = ("convert", "demo")
_OTHER_CLUSTER = ("--backend", "--scheduler", "--enforce-pod-limits", "--help")
#: The CLI's options before the command (``h5ngff -v convert ...``).
_GLOBAL_FLAGS = ("-v", "-vv", "-vvv", "--verbose")


def _names(arg: str, flag: str) -> bool:
    """Whether ``arg`` may be ``flag`` as argparse reads it: whole, with ``=value``, or abbreviated
    to any prefix (``--b`` is ``--backend`` where no other option starts so; where one does,
    argparse refuses it and the head start is only wasted)."""
    name = arg.split("=", 1)[0]
    return name.startswith("--") and len(name) > 2 and flag.startswith(name)


def _command(argv: list[str]) -> tuple[str | None, list[str]]:
    rest = list(argv)
    while rest and rest[0] in _GLOBAL_FLAGS:
        rest.pop(0)
    return (rest[0], rest[1:]) if rest else (None, [])


def _allocator(argv: list[str]) -> str:
    """The value of the last ``--allocator`` (argparse keeps the last), or "auto"."""
    value = "auto"
    for i, arg in enumerate(argv):
        if _names(arg, "--allocator"):
            if "=" in arg:
                value = arg.split("=", 1)[1]
            elif i + 1 < len(argv):
                value = argv[i + 1]
    return value


def starts_a_local_cluster(argv: list[str]) -> bool:
    """Whether these arguments run a command that starts a LocalCluster of its own."""
    command, rest = _command(argv)
    if command not in _LOCAL_COMMANDS:
        return False
    return not any(arg == "-h" or any(_names(arg, flag) for flag in _OTHER_CLUSTER) for arg in rest)


def start_fork_server_early(argv: list[str]) -> bool:
    """Start the fork server with the environment this command's workers will have; True if
    started."""
    from .backends import forkserver
    from .backends.allocator import allocator_env, resolve_allocator

    if not starts_a_local_cluster(argv):
        return False
    allocator = _allocator(argv)
    if allocator not in ("auto", "jemalloc", "glibc"):
        return False  # the CLI will refuse it
    return forkserver.start_early(allocator_env(resolve_allocator(allocator)))


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    try:
        terminate_like_ctrl_c()  # before the CLI's half second of imports, which cli.main cannot guard
        try:
            start_fork_server_early(args)
        except Exception:  # a head start only: the cluster starts its server itself if this fails
            pass
        from .cli import main as cli_main
    except KeyboardInterrupt as exc:  # nothing has started: the CLI's own line, without its imports
        what, code = interrupted_exit(exc)
        print(f"{what}: re-run the same command to resume.", file=sys.stderr)
        return int(code)
    return cli_main(argv)
