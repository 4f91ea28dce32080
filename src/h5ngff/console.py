"""Where the CLI writes: tables and ``--json`` documents to stdout, notices and errors to stderr.

Kept apart from ``report`` (which imports the runner, hence Dask) so that every command, ``--help``
included, can make a console without that import.
"""

from __future__ import annotations

import os
import sys

from rich.console import Console
from rich.markup import escape

#: The width of tables written to a pipe or a file: rich would cut them to 80 columns, dropping
#: the numbers of the wide ones (the pod-limit rows); a file has no width to fit.
PIPE_WIDTH = 1000


class _Console(Console):
    """rich's Console, but a reader that went away (``| head``) is a BrokenPipeError for the CLI
    to end with 141, as for --json's output: rich's own handler exits 1, which reads as a failed
    run (and for ``verify``, as problems found)."""

    def on_broken_pipe(self) -> None:
        self.quiet = True
        raise BrokenPipeError


def make_console(stderr: bool = False) -> Console:
    """A rich Console on stdout (or stderr): the terminal's width on a terminal, COLUMNS where
    set, else (a pipe or a file) wide enough that no table is cut."""
    stream = sys.stderr if stderr else sys.stdout
    try:
        tty = stream.isatty()
    except (AttributeError, ValueError):
        tty = False
    if tty or os.environ.get("COLUMNS"):
        return _Console(stderr=stderr)
    return _Console(stderr=stderr, width=PIPE_WIDTH)


def print_notices(notices: list[str]) -> None:
    """The plan's notices go to stderr, as the README says: stdout carries only the tables (or
    the --json document), so a pipe or a file gets the plan alone."""
    if notices:
        from .report import notices_renderable

        make_console(stderr=True).print(notices_renderable(notices))


def print_warning(message: str) -> None:
    """One warning line on stderr; ``message`` is shown as it is (never read as rich markup)."""
    make_console(stderr=True).print(f"[yellow]warning[/yellow]: {escape(message)}")
