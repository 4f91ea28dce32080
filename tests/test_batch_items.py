"""A batch's items (h5ngff.batch): glob patterns and an output template become items, and a batch
whose items would collide is refused before anything starts."""

from __future__ import annotations

import os

import pytest

from h5ngff.batch.items import (
    BatchItem,
    batch_items,
    expand_sources,
    is_template,
    output_key,
    refuse_collisions,
    render_output,
    split_pattern,
)
from h5ngff.errors import SpecError


@pytest.fixture
def runs(tmp_path, monkeypatch):
    """runs/day1/cell_{1,2,10}.h5, runs/day2/cell_1.h5 and a non-HDF5 neighbour (empty files: no
    HDF5 is opened while items are built)."""
    for day, cells in (("day1", (1, 2, 10)), ("day2", (1,))):
        (tmp_path / "runs" / day).mkdir(parents=True)
        for c in cells:
            (tmp_path / "runs" / day / f"cell_{c}.h5").write_bytes(b"")
    (tmp_path / "runs" / "day1" / "notes.txt").write_text("x")
    monkeypatch.chdir(tmp_path)
    return tmp_path


def test_split_pattern_takes_the_dataset_after_the_last_colon():
    assert split_pattern("runs/*/*.h5:/volume/data") == ("runs/*/*.h5", "/volume/data")
    assert split_pattern("runs/*.ims") == ("runs/*.ims", None)
    assert split_pattern("a:b/*.h5:/data") == ("a:b/*.h5", "/data")


def test_sources_expand_in_natural_order_each_file_once(runs):
    got = expand_sources(["runs/day1/*.h5:/data", "runs/*/cell_1.h5:/data"])
    assert got == [
        ("runs/day1/cell_1.h5:/data", "runs/day1/cell_1.h5"),
        ("runs/day1/cell_2.h5:/data", "runs/day1/cell_2.h5"),
        ("runs/day1/cell_10.h5:/data", "runs/day1/cell_10.h5"),
        ("runs/day2/cell_1.h5:/data", "runs/day2/cell_1.h5"),
    ]


def test_recursive_globs_and_whole_containers(runs):
    got = expand_sources(["runs/**/*.h5"])
    assert [source for source, _ in got] == [
        "runs/day1/cell_1.h5",
        "runs/day1/cell_2.h5",
        "runs/day1/cell_10.h5",
        "runs/day2/cell_1.h5",
    ]


def test_a_pattern_that_matches_nothing_is_named(runs):
    with pytest.raises(SpecError, match=r"'runs/day3/\*.h5' to match HDF5 files. It matches none"):
        expand_sources(["runs/day1/*.h5:/data", "runs/day3/*.h5:/data"])


def test_the_template_fields(runs):
    path = os.path.join("runs", "day1", "cell_10.h5")
    assert render_output("out/{parent}/{stem}.ome.zarr", path) == "out/day1/cell_10.ome.zarr"
    assert render_output("out/{name}.zarr", path) == "out/cell_10.h5.zarr"
    assert is_template("out/{stem}.ome.zarr") and not is_template("out/one.ome.zarr")
    with pytest.raises(SpecError, match=r"Expected template fields from \{stem\}, \{name\}, \{parent\}. Got \{date\}"):
        render_output("out/{date}.zarr", path)
    with pytest.raises(SpecError, match="not one"):
        is_template("out/{stem.zarr")


def test_two_sources_to_one_output_are_refused_naming_both(runs):
    # {stem} alone maps day1/cell_1 and day2/cell_1 to one output.
    with pytest.raises(
        SpecError,
        match=r"'runs/day1/cell_1.h5:/data' and 'runs/day2/cell_1.h5:/data' both written to 'out/cell_1.ome.zarr'",
    ):
        batch_items(["runs/*/*.h5:/data"], "out/{stem}.ome.zarr")
    # Negative control: a template that tells them apart passes, one item per file.
    items = batch_items(["runs/*/*.h5:/data"], "out/{parent}_{stem}.ome.zarr")
    assert [i.output for i in items] == [
        "out/day1_cell_1.ome.zarr",
        "out/day1_cell_2.ome.zarr",
        "out/day1_cell_10.ome.zarr",
        "out/day2_cell_1.ome.zarr",
    ]


def test_one_spelling_per_output():
    assert output_key("out/./a.zarr/") == output_key(os.path.abspath("out/a.zarr"))
    assert output_key("s3://bucket//a/b/") == output_key("S3://bucket/a/b") == "s3://bucket/a/b"
    with pytest.raises(SpecError, match="both written to"):
        refuse_collisions([BatchItem("a.h5:/d", "a.h5", "s3://b/x/"), BatchItem("c.h5:/d", "c.h5", "s3://b//x")])


@pytest.mark.parametrize("outer, inner", [("out/a.zarr", "out/a.zarr/b.zarr"), ("s3://b/x", "s3://b/x/y/z")])
def test_an_output_inside_another_is_refused(outer, inner):
    items = [BatchItem("a.h5:/d", "a.h5", outer), BatchItem("c.h5:/d", "c.h5", inner)]
    with pytest.raises(SpecError, match=f"Got '{inner}' inside '{outer}'"):
        refuse_collisions(items)
    # Negative control: a sibling whose name only starts the same is apart.
    refuse_collisions([BatchItem("a.h5:/d", "a.h5", outer), BatchItem("c.h5:/d", "c.h5", outer + "-2")])


def test_an_output_over_its_own_source_is_refused(runs):
    with pytest.raises(SpecError, match="for the source file itself"):
        batch_items(["runs/day2/*.h5:/data"], "runs/{parent}/{name}")
