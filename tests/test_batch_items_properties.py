"""Property tests of how sources name outputs (issue 40): hypothesis draws a tree of files (names
with dots, spaces, digits and dashes; dangling links; directories that match), glob patterns and
explicit lists, and an output template; ``batch_items`` must hold:

- every path the patterns name (an independent walk of the tree, not ``glob``) is exactly one
  item, with the pattern's dataset, in natural order within each pattern;
- or the batch is refused with one SpecError, and only where two items would write one output,
  one output lies inside another, or an output is its own source (checked independently).

Pure and fast: real files in a temporary directory, no Dask.
"""

from __future__ import annotations

import fnmatch
import os
import re
import tempfile

import pytest
from hypothesis import HealthCheck, given, note, settings
from hypothesis import strategies as st

from h5ngff.batch.items import batch_items, render_output
from h5ngff.errors import SpecError
from properties import examples

pytestmark = pytest.mark.property

NAMES = st.text(alphabet="ab1 2.-_", min_size=1, max_size=6).filter(
    lambda n: n.strip(" .") == n and n not in (".", "..")
)


@st.composite
def trees(draw) -> list[tuple[str, str]]:
    """(relative path, kind) with kind 'file', 'link' (dangling) or 'dir' (named like a file)."""
    entries: dict[str, str] = {}
    for _ in range(draw(st.integers(1, 8))):
        parent = draw(st.sampled_from(["runs", "runs/day1", "runs/day 2", "runs/day1/deep"]))
        name = draw(NAMES) + draw(st.sampled_from([".h5", ".h5", ".H5", ".ims", ""]))
        entries.setdefault(f"{parent}/{name}", draw(st.sampled_from(["file", "file", "file", "link", "dir"])))
    # A directory entry is never also a parent of another entry (the tree stays well formed).
    return sorted((p, k) for p, k in entries.items() if not any(o.startswith(p + "/") for o in entries))


def _natural(text: str) -> list[object]:
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", text)]


def expected_matches(root: str, pattern: str) -> list[str]:
    """The paths ``pattern`` names, by a walk and fnmatch per component (hidden names excluded,
    as the shell does), in natural order; ``**`` matches any number of directories."""
    parts = pattern.split("/")
    found = []
    for directory, subdirs, files in os.walk(root):
        for name in [*subdirs, *files]:
            rel = os.path.relpath(os.path.join(directory, name), root).replace(os.sep, "/").split("/")
            if _matches(rel, parts) and not any(p.startswith(".") for p in rel):
                found.append("/".join(rel))
    return sorted(set(found), key=_natural)


def _matches(path: list[str], pattern: list[str]) -> bool:
    if not pattern:
        return not path
    if pattern[0] == "**":
        return any(_matches(path[i:], pattern[1:]) for i in range(len(path) + 1))
    return bool(path) and fnmatch.fnmatchcase(path[0], pattern[0]) and _matches(path[1:], pattern[1:])


def _outputs_clash(items) -> bool:
    keys = [os.path.normpath(os.path.abspath(i.output)) for i in items]
    if len(set(keys)) < len(keys):
        return True
    for a in keys:
        for b in keys:
            if a != b and b.startswith(a + os.sep):
                return True
    return any(os.path.normpath(os.path.abspath(i.path)) == os.path.normpath(os.path.abspath(i.output)) for i in items)


@pytest.mark.slow
@settings(
    max_examples=examples(ci=150, long=3000),
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
@given(
    tree=trees(),
    patterns=st.lists(
        st.sampled_from(["runs/*.h5", "runs/*/*.h5", "runs/**/*.h5", "runs/day1/*", "runs/**/*", "runs/day 2/*.h5"]),
        min_size=1,
        max_size=3,
    ),
    template=st.sampled_from(
        ["out/{stem}.ome.zarr", "out/{parent}/{stem}.ome.zarr", "out/{name}.zarr", "out/{parent}-{name}", "out/{stem}"]
    ),
    dataset=st.sampled_from([":/data", ""]),
)
def test_every_named_path_is_one_item_or_the_batch_is_refused_for_a_real_clash(tree, patterns, template, dataset):
    with tempfile.TemporaryDirectory(prefix="h5ngff-items-") as root:
        for path, kind in tree:
            full = os.path.join(root, path)
            os.makedirs(os.path.dirname(full), exist_ok=True)
            if kind == "file":
                open(full, "wb").close()
            elif kind == "link":
                os.symlink(full + ".missing", full)
            else:
                os.makedirs(full, exist_ok=True)
        cwd = os.getcwd()
        os.chdir(root)
        try:
            expected: list[str] = []
            for pattern in patterns:
                expected += [m for m in expected_matches(root, pattern) if m not in expected]
            note(f"tree {tree}; patterns {patterns}; expected {expected}")
            wanted = [(f"{m}{dataset}", m, render_output(template, m)) for m in expected]
            try:
                items = batch_items([p + dataset for p in patterns], template)
            except SpecError as exc:
                note(str(exc))
                matched_nothing = any(not expected_matches(root, p) for p in patterns)
                assert matched_nothing or _outputs_clash([_Item(*w) for w in wanted]), str(exc)
                return
            assert [(i.source, i.path, i.output) for i in items] == wanted
            assert not _outputs_clash(items)
        finally:
            os.chdir(cwd)


class _Item:
    def __init__(self, source: str, path: str, output: str):
        self.source, self.path, self.output = source, path, output
