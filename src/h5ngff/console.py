"""Where the CLI writes: tables and ``--json`` documents to stdout, notices and errors to stderr.

Kept apart from ``report`` (which imports the runner, hence Dask) so that every command, ``--help``
included, can make a console without that import.
"""

from __future__ import annotations

import os
import re
import sys

from rich.console import Console
from rich.markup import escape

#: The width of tables written to a pipe or a file: 100 columns, which a terminal, a pager or a
#: log viewer shows whole (rich's 80 cut the numbers of the wide rows; 1000 made 200-column
#: tables). Long explanations wrap inside their column; no figure is cut.
PIPE_WIDTH = 100


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


#: A quoted value longer than this is shown with its middle left out: a 5 KB path echoed whole
#: buries the message around it.
QUOTED_LIMIT = 160
_QUOTED = re.compile(r"'[^'\n]{%d,}'" % (QUOTED_LIMIT + 1))


def shorten_quoted(message: str) -> str:
    """``message`` with every quoted value over QUOTED_LIMIT characters cut in the middle
    (its start and its end, where paths differ, are kept)."""
    keep = QUOTED_LIMIT // 2 - 2

    def cut(match: re.Match[str]) -> str:
        text = match.group(0)[1:-1]
        return f"'{text[:keep]}…({len(text) - 2 * keep} characters)…{text[-keep:]}'"

    return _QUOTED.sub(cut, message)


def print_notices(notices: list[str]) -> None:
    """The plan's notices go to stderr, as the README says: stdout carries only the tables (or
    the --json document), so a pipe or a file gets the plan alone."""
    if notices:
        from .report import notices_renderable

        make_console(stderr=True).print(notices_renderable(notices), soft_wrap=True)  # a notice, a line


def print_warning(message: str) -> None:
    """One warning line on stderr; ``message`` is shown as it is (never read as rich markup)."""
    make_console(stderr=True).print(f"[yellow]warning[/yellow]: {escape(message)}")
