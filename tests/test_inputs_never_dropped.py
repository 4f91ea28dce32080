"""No input is ever dropped silently (issue 40, item 3).

On cb6367c, ``h5ngff convert a.h5:/ch0 a.h5:/ch1 out.ome.zarr`` converted only ``/ch0`` and exited
0 ("batch: 1 items"), and a glob skipped a dangling link it matched without naming it. Now every
source a command is given is either refused before anything is written (exit 2, one line naming
what the user may have meant) or appears in the summary with an outcome.

Real ``h5ngff convert`` processes on the session's shared Dask cluster (``--scheduler``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import h5py
import pytest

from conftest import smooth, write_h5
from h5ngff.batch.items import expand_sources
from h5ngff.errors import ExitCode

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[1]
CLI = [sys.executable, "-m", "h5ngff.cli"]
ENV = {**os.environ, "PYTHONPATH": str(ROOT / "src") + os.pathsep + os.environ.get("PYTHONPATH", "")}


def h5ngff(*argv, cwd) -> subprocess.CompletedProcess:
    return subprocess.run([*CLI, *map(str, argv)], capture_output=True, text=True, timeout=180, env=ENV, cwd=cwd)


@pytest.fixture
def two_channels(tmp_path):
    with h5py.File(tmp_path / "a.h5", "w") as f:
        f["/ch0"] = smooth((8, 16, 16), "uint16", seed=1)
        f["/ch1"] = smooth((8, 16, 16), "uint16", seed=2)
    return tmp_path


@pytest.mark.slow
def test_two_datasets_of_one_file_and_one_output_are_refused_naming_both_ways(two_channels):
    proc = h5ngff("convert", "a.h5:/ch0", "a.h5:/ch1", "out.ome.zarr", cwd=two_channels)
    assert proc.returncode == ExitCode.BAD_INPUT, proc.stderr
    line = proc.stderr.strip()
    assert len(line.splitlines()) == 1, line
    assert "2 sources ('a.h5:/ch0', 'a.h5:/ch1')" in line
    assert "{stem}.ome.zarr" in line  # one output per file
    assert "'a.h5:/ch0,/ch1'" in line  # one image stacking both
    assert not (two_channels / "out.ome.zarr").exists()


@pytest.mark.slow
def test_two_files_and_one_output_are_refused_with_a_template(tmp_path):
    for name in ("a", "b"):
        write_h5(tmp_path / f"{name}.h5", smooth((4, 8, 8)))
    proc = h5ngff("convert", "a.h5:/volume/data", "b.h5:/volume/data", "out/x.ome.zarr", cwd=tmp_path)
    assert proc.returncode == ExitCode.BAD_INPUT, proc.stderr
    assert "'out/{stem}.ome.zarr'" in proc.stderr
    assert not (tmp_path / "out").exists()


def test_two_datasets_of_one_file_are_two_sources_not_one():
    """The root cause on cb6367c: sources were deduplicated by file, so /ch1 vanished."""
    assert expand_sources(["a.h5:/ch0", "a.h5:/ch1", "a.h5:/ch0"]) == [("a.h5:/ch0", "a.h5"), ("a.h5:/ch1", "a.h5")]


@pytest.mark.slow
def test_every_path_a_glob_matches_is_an_item_with_an_outcome(tmp_path, shared_cluster):
    """A dangling link and a directory the glob matches are Refused items that say why."""
    runs = tmp_path / "r"
    runs.mkdir()
    write_h5(runs / "a.h5", smooth((8, 16, 16)))
    (runs / "b.h5").symlink_to("missing.h5")
    (runs / "c.h5").mkdir()
    proc = h5ngff(
        "convert", "r/*.h5:/volume/data", "out/{stem}.ome.zarr", "--json", "--scheduler", shared_cluster.scheduler_address,
        cwd=tmp_path,
    )  # fmt: skip
    assert proc.returncode == ExitCode.FAILED, proc.stderr
    summary = json.loads(proc.stdout)
    by_source = {r["source"]: r for r in summary["results"]}
    assert set(by_source) == {"r/a.h5:/volume/data", "r/b.h5:/volume/data", "r/c.h5:/volume/data"}
    assert (summary["items"], summary["done"], summary["refused"]) == (3, 1, 2), (
        by_source["r/a.h5:/volume/data"],
        proc.stderr,
    )
    assert "symbolic link to 'missing.h5', which does not exist" in by_source["r/b.h5:/volume/data"]["message"]
    assert "is a directory" in by_source["r/c.h5:/volume/data"]["message"]
    assert (tmp_path / "out" / "a.ome.zarr" / "zarr.json").exists()


@pytest.mark.slow
def test_the_table_names_every_source_too(tmp_path, shared_cluster):
    runs = tmp_path / "r"
    runs.mkdir()
    write_h5(runs / "a.h5", smooth((8, 16, 16)))
    (runs / "b.h5").symlink_to("missing.h5")
    proc = h5ngff(
        "convert", "r/*.h5:/volume/data", "out/{stem}.ome.zarr", "--no-progress",
        "--scheduler", shared_cluster.scheduler_address, cwd=tmp_path,
    )  # fmt: skip
    assert proc.returncode == ExitCode.FAILED, proc.stderr
    text = proc.stdout + proc.stderr
    assert "r/b.h5:/volume/data" in text and "Refused" in text and "missing.h5" in text
