"""Command-line flags -> ConversionSpec fields, and ``h5ngff plan`` run for real as a subprocess."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import h5py
import numpy as np
import pytest

from h5ngff.cli import build_parser, spec_from_args
from h5ngff.cliargs import merge, parse_compressor, spec_overrides, split_source
from h5ngff.errors import SpecError
from h5ngff.spec import MIN_WORKER_MEMORY, parse_spec
from h5ngff.units import MiB

H5NGFF = str(Path(sys.executable).with_name("h5ngff"))

#: The flags issue 2 says scripts may rely on (plan and convert share them).
ISSUE_FLAGS = [
    "--chunks",
    "--shards",
    "--slab",
    "--workers",
    "--threads",
    "--memory-per-worker",
    "--memory-total",
    "--levels",
    "--downsample",
    "--compressor",
    "--ngff-version",
    "--axes",
    "--scale",
    "--json",
]


# --- split_source -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "text, path, dataset",
    [
        ("in.h5:/volume/data", "in.h5", "/volume/data"),
        ("in.h5:volume/data", "in.h5", "/volume/data"),
        ("/abs/dir/in.h5:/data", "/abs/dir/in.h5", "/data"),
        ("dir:with:colons/in.h5:/entry/data", "dir:with:colons/in.h5", "/entry/data"),
        ("s3-mount/scan.hdf5:/a/b/c", "s3-mount/scan.hdf5", "/a/b/c"),
    ],
)
def test_split_source(text, path, dataset):
    assert split_source(text) == (path, dataset)


@pytest.mark.parametrize("text", ["in.h5", ":/data", "", "in.h5:", "in.h5:/"])
def test_split_source_refuses(text):
    with pytest.raises(SpecError) as info:
        split_source(text)
    assert info.value.field == "source"
    assert f"Expected FILE.h5:/dataset, e.g. in.h5:/volume/data. Got {text!r} instead." in str(info.value)


def test_regression_source_without_dataset_meant_the_root_group():
    """``in.h5:`` was split into ('in.h5', '/'): the root group, which is never an image."""
    with pytest.raises(SpecError):
        split_source("in.h5:")


# --- parse_compressor -------------------------------------------------------------------------

COMPRESSORS = [
    (
        "zstd:5:bitshuffle",
        {"codec": "blosc", "cname": "zstd", "clevel": 5, "shuffle": "bitshuffle"},
        "blosc zstd level 5 bitshuffle",
    ),
    ("zstd", {"codec": "blosc", "cname": "zstd", "clevel": None}, "blosc zstd level 5 bitshuffle"),
    ("zstd:3", {"codec": "blosc", "cname": "zstd", "clevel": 3}, "blosc zstd level 3 bitshuffle"),
    (
        "zstd::noshuffle",
        {"codec": "blosc", "cname": "zstd", "clevel": None, "shuffle": "noshuffle"},
        "blosc zstd level 5 noshuffle",
    ),
    (
        "lz4:3:shuffle",
        {"codec": "blosc", "cname": "lz4", "clevel": 3, "shuffle": "shuffle"},
        "blosc lz4 level 3 shuffle",
    ),
    ("LZ4HC:9", {"codec": "blosc", "cname": "lz4hc", "clevel": 9}, "blosc lz4hc level 9 bitshuffle"),
    ("zlib:1", {"codec": "blosc", "cname": "zlib", "clevel": 1}, "blosc zlib level 1 bitshuffle"),
    ("blosclz:0", {"codec": "blosc", "cname": "blosclz", "clevel": 0}, "blosc blosclz level 0 bitshuffle"),
    ("blosc:lz4:5", {"codec": "blosc", "cname": "lz4", "clevel": 5}, "blosc lz4 level 5 bitshuffle"),
    (
        "blosc:zstd:7:shuffle",
        {"codec": "blosc", "cname": "zstd", "clevel": 7, "shuffle": "shuffle"},
        "blosc zstd level 7 shuffle",
    ),
    ("blosc:zstd", {"codec": "blosc", "cname": "zstd", "clevel": None}, "blosc zstd level 5 bitshuffle"),
    ("plain-zstd:19", {"codec": "zstd", "clevel": 19}, "zstd level 19"),
    ("plain-zstd", {"codec": "zstd", "clevel": None}, "zstd level 5"),
    ("gzip:6", {"codec": "gzip", "clevel": 6}, "gzip level 6"),
    ("gzip", {"codec": "gzip", "clevel": None}, "gzip level 5"),
    ("none", {"codec": "none"}, "none"),
    (
        " Zstd:5:BitShuffle ",
        {"codec": "blosc", "cname": "zstd", "clevel": 5, "shuffle": "bitshuffle"},
        "blosc zstd level 5 bitshuffle",
    ),
]


@pytest.mark.parametrize("text, expected, described", COMPRESSORS, ids=[c[0].strip() for c in COMPRESSORS])
def test_parse_compressor(text, expected, described):
    parsed = parse_compressor(text)
    assert parsed == expected
    # ...and it is a valid output.compressor that means what the flag says.
    fields = {k: v for k, v in parsed.items() if v is not None}
    spec = parse_spec({"source": {"path": "a.h5", "dataset": "/d"}, "output": {"path": "o", "compressor": fields}})
    assert spec.output.compressor.describe() == described


@pytest.mark.parametrize(
    "text, hint",
    [
        ("bogus", "Got 'bogus' instead."),
        ("blosc", "Got 'blosc' instead."),
        ("blosc:gzip:5", "Got 'blosc:gzip:5' instead."),
        ("blosc:none", "Got 'blosc:none' instead."),
        ("none:3", "Got 'none:3' instead."),
        ("gzip:1:shuffle", "Got 'gzip:1:shuffle' instead."),
        ("plain-zstd:3:shuffle", "Got 'plain-zstd:3:shuffle' instead."),
        ("zstd:5:bitshuffle:extra", "Got 'zstd:5:bitshuffle:extra' instead."),
        ("zstd:high", "(the level must be an integer)"),
        ("blosc:lz4:x", "(the level must be an integer)"),
        ("gzip:x", "(the level must be an integer)"),
    ],
)
def test_parse_compressor_refuses(text, hint):
    with pytest.raises(SpecError) as info:
        parse_compressor(text)
    assert info.value.field == "output.compressor"
    assert hint in str(info.value)
    assert "Expected CODEC[:LEVEL[:SHUFFLE]]" in str(info.value)


def test_compressor_values_the_spec_refuses_are_caught_there():
    """parse_compressor only splits; ranges and shuffle names are the spec's job (one place)."""
    for text, field in (
        ("zstd:12", "output.compressor.clevel"),
        ("zstd:5:byteshuffle", "output.compressor.shuffle"),
        ("gzip:0", "output.compressor.clevel"),
    ):
        fields = {k: v for k, v in parse_compressor(text).items() if v is not None}
        with pytest.raises(SpecError) as info:
            parse_spec({"source": {"path": "a.h5", "dataset": "/d"}, "output": {"path": "o", "compressor": fields}})
        assert info.value.field == field


def test_regression_blosc_prefix_form_was_refused():
    """``blosc:lz4:5`` parsed 'lz4' as the level and refused the flag; ``blosc:lz4:x`` silently
    dropped the bad level."""
    assert parse_compressor("blosc:lz4:5") == {"codec": "blosc", "cname": "lz4", "clevel": 5}
    with pytest.raises(SpecError):
        parse_compressor("blosc:lz4:x")


# --- flags -> spec ------------------------------------------------------------------------------


def _args(*argv: str, command: str = "plan"):
    extra = ["out.ome.zarr"] if command == "convert" else []
    return build_parser().parse_args([command, "in.h5:/volume/data", *extra, *argv])


def test_every_flag_lands_in_one_spec_field():
    args = _args(
        "--chunks",
        "64,64,64",
        "--shards",
        "128x128x128",
        "--compressor",
        "lz4:3:shuffle",
        "--ngff-version",
        "0.5",
        "--axes",
        "zyx",
        "--scale",
        "2.0,0.5,0.5",
        "--units",
        "micrometer",
        "--name",
        "scan",
        "--levels",
        "3",
        "--downsample",
        "max",
        "--downsample-axes",
        "yx",
        "--workers",
        "8",
        "--threads",
        "2",
        "--memory-per-worker",
        "1GiB",
        "--slab",
        "64,704,2008",
        "--allocator",
        "glibc",
    )
    assert spec_overrides(args) == {
        "output": {
            "chunks": [64, 64, 64],
            "shards": [128, 128, 128],
            "compressor": {"codec": "blosc", "cname": "lz4", "clevel": 3, "shuffle": "shuffle"},
            "ngffVersion": "0.5",
        },
        "image": {
            "axes": "zyx",
            "scale": [2.0, 0.5, 0.5],
            "units": ["micrometer", "micrometer", "micrometer"],
            "name": "scan",
        },
        "pyramid": {"levels": 3, "method": "max", "axes": "yx"},
        "resources": {
            "workers": 8,
            "threadsPerWorker": 2,
            "memoryPerWorker": "1GiB",
            "slab": [64, 704, 2008],
            "allocator": "glibc",
        },
    }
    spec = spec_from_args(args)
    assert spec.source.path == "in.h5" and spec.source.dataset == "/volume/data"
    assert spec.output.path == "in.ome.zarr"  # plan's default output, beside the input
    assert spec.output.shards == [128, 128, 128] and spec.pyramid.method == "max"
    assert spec.resources.memory_per_worker_bytes == 1 << 30


def test_unset_flags_leave_the_spec_alone():
    assert spec_overrides(_args()) == {}
    spec = spec_from_args(_args())
    assert spec == parse_spec(
        {"source": {"path": "in.h5", "dataset": "/volume/data"}, "output": {"path": "in.ome.zarr"}}
    )


@pytest.mark.parametrize(
    "argv, key, value",
    [
        (["--levels", "auto"], ("pyramid", "levels"), "auto"),
        (["--workers", "auto"], ("resources", "workers"), "auto"),
        (["--memory-total", "16GiB"], ("resources", "memoryTotal"), "16GiB"),
        (["--ngff-version", "0.4"], ("output", "ngffVersion"), "0.4"),
        (["--downsample", "nearest"], ("pyramid", "method"), "nearest"),
        (["--threads", "1"], ("resources", "threadsPerWorker"), 1),
        (["--compressor", "none"], ("output", "compressor"), {"codec": "none"}),
        (["--compressor", "gzip"], ("output", "compressor"), {"codec": "gzip"}),  # no level: the spec's default
        (
            ["--axes", "tczyx", "--units", "micrometer"],
            ("image", "units"),
            ["", "", "micrometer", "micrometer", "micrometer"],
        ),
        (
            ["--units", "second,,micrometer,micrometer,micrometer"],
            ("image", "units"),
            ["second", "", "micrometer", "micrometer", "micrometer"],
        ),
    ],
)
def test_flag_values(argv, key, value):
    overrides = spec_overrides(_args(*argv))
    assert overrides[key[0]][key[1]] == value


@pytest.mark.parametrize(
    "argv, field",
    [
        (["--chunks", "64,sixty,64"], "output.chunks"),
        (["--shards", "1.5"], "output.shards"),
        (["--slab", "a,b"], "resources.slab"),
        (["--scale", "1,wide,1"], "image.scale"),
        (["--levels", "many"], "pyramid.levels"),
        (["--workers", "lots"], "resources.workers"),
    ],
)
def test_bad_flag_values_name_the_spec_field(argv, field):
    with pytest.raises(SpecError) as info:
        spec_overrides(_args(*argv))
    assert info.value.field == field
    assert "Expected" in str(info.value) and "Got" in str(info.value)


@pytest.mark.parametrize(
    "argv, field",
    [
        (["--chunks", "64,0,64"], "output.chunks"),
        (["--levels", "0"], "pyramid.levels"),
        (["--memory-per-worker", "1GiB", "--memory-total", "4GiB"], "resources.memoryTotal"),
        (["--ngff-version", "0.4", "--shards", "128,128,128"], "output.shards"),
        (["--memory-per-worker", "lots"], "resources.memoryPerWorker"),
    ],
)
def test_flags_the_spec_refuses(argv, field):
    with pytest.raises(SpecError) as info:
        spec_from_args(_args(*argv))
    assert info.value.field == field


def test_argparse_refuses_values_outside_the_choices(capsys):
    for argv in (["--ngff-version", "0.6"], ["--downsample", "gaussian"], ["--threads", "two"]):
        with pytest.raises(SystemExit) as info:
            _args(*argv)
        assert info.value.code == 2
    assert "invalid choice" in capsys.readouterr().err


def test_merge_flags_win_over_a_file_and_keep_the_rest():
    base = {
        "source": {"path": "in.h5", "dataset": "/d"},
        "output": {"path": "o", "chunks": [32, 32, 32], "compressor": {"codec": "gzip", "clevel": 9}},
        "resources": {"workers": 2, "memoryPerWorker": "1Gi"},
    }
    merged = merge(base, {"output": {"chunks": [64, 64, 64], "compressor": {"clevel": 3}}, "pyramid": {"levels": 2}})
    assert merged["output"] == {"path": "o", "chunks": [64, 64, 64], "compressor": {"codec": "gzip", "clevel": 3}}
    assert merged["resources"] == base["resources"] and merged["pyramid"] == {"levels": 2}
    assert base["output"]["chunks"] == [32, 32, 32]  # the file's dict is not mutated
    # A list is replaced, not merged element-wise; a scalar can replace a mapping.
    assert merge({"a": {"b": [1, 2, 3]}}, {"a": {"b": [4]}}) == {"a": {"b": [4]}}
    assert merge({"a": {"b": 1}}, {"a": 5}) == {"a": 5}


def test_plan_and_convert_share_the_spec_flags():
    parser = build_parser()
    sub = next(a for a in parser._actions if a.dest == "command").choices
    plan_flags = {s for a in sub["plan"]._actions for s in a.option_strings}
    convert_flags = {s for a in sub["convert"]._actions for s in a.option_strings}
    assert set(ISSUE_FLAGS) <= plan_flags and set(ISSUE_FLAGS) <= convert_flags
    spec_flags = plan_flags - {"-h", "--help", "--kubernetes"}
    assert spec_flags <= convert_flags, spec_flags - convert_flags


# --- h5ngff plan, for real ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def metadata_only_h5(tmp_path_factory):
    """A dataset whose raw data lives in an external file that is then deleted: only a tool that
    reads metadata alone can plan it."""
    d = tmp_path_factory.mktemp("plan")
    shape = (48, 300, 200)
    path = d / "ext.h5"
    with h5py.File(path, "w") as f:
        ds = f.create_dataset(
            "/volume/data", shape=shape, dtype="<f4", external=[(str(d / "ext.raw"), 0, int(np.prod(shape)) * 4)]
        )
        ds[...] = 1.0
        ds.attrs["element_size_um"] = [2.0, 0.5, 0.5]
    os.remove(d / "ext.raw")
    with h5py.File(path, "r") as f, pytest.raises(OSError):  # negative control: the data is gone
        f["/volume/data"][0, 0, :4]
    return path


def _run(*argv, cwd=None, check=True):
    proc = subprocess.run([H5NGFF, *argv], capture_output=True, text=True, timeout=120, cwd=cwd)
    if check:
        assert proc.returncode == 0, proc.stderr
    return proc


@pytest.mark.slow
@pytest.mark.integration
def test_h5ngff_plan_json_reads_only_metadata(metadata_only_h5):
    proc = _run(
        "plan",
        f"{metadata_only_h5}:/volume/data",
        "--json",
        "--chunks",
        "16,64,64",
        "--shards",
        "16,128,128",
        "--slab",
        "30,100,200",
        "--workers",
        "2",
        "--threads",
        "2",
        "--memory-per-worker",
        "1GiB",
        "--levels",
        "2",
        "--downsample",
        "max",
        "--compressor",
        "zstd:5:bitshuffle",
        "--ngff-version",
        "0.5",
        "--axes",
        "zyx",
        "--scale",
        "2,0.5,0.5",
        "--calibration",
        "/dev/null",
        check=False,
    )
    # --calibration /dev/null is not a JSON object: a negative control for the flag's own check
    assert proc.returncode == 2 and json.loads(proc.stdout)["reason"] == "InvalidSpec"
    proc = _run(
        "plan",
        f"{metadata_only_h5}:/volume/data",
        "--json",
        "--chunks",
        "16,64,64",
        "--shards",
        "16,128,128",
        "--slab",
        "30,100,200",
        "--workers",
        "2",
        "--threads",
        "2",
        "--memory-per-worker",
        "1GiB",
        "--levels",
        "2",
        "--downsample",
        "max",
        "--compressor",
        "zstd:5:bitshuffle",
        "--ngff-version",
        "0.5",
        "--axes",
        "zyx",
        "--scale",
        "2,0.5,0.5",
    )
    out = json.loads(proc.stdout)
    plan, spec = out["plan"], out["spec"]
    assert plan["dataset"]["shape"] == [48, 300, 200] and plan["dtype"] == "<f4"
    assert plan["chunks"] == [16, 64, 64] and plan["shards"] == [16, 128, 128]
    assert plan["workers"] == 2 and plan["threads_per_worker"] == 2
    # z (2) is 4x y and x (0.5): the anisotropy rule halves y and x only at level 1.
    assert [lv["shape"] for lv in plan["levels"]] == [[48, 300, 200], [48, 150, 100]]
    assert plan["levels"][0]["scale"] == [2.0, 0.5, 0.5] and plan["levels"][1]["scale"] == [2.0, 1.0, 1.0]
    assert plan["n_tasks"] == sum(p["n_slabs"] for p in plan["passes"]) > 0
    slab = plan["passes"][0]["slab"]
    # Whole shards of both levels: the shard x 2 on each halved axis (y, x), the shard on z, or the whole axis.
    assert all(s % (f * u) == 0 or s == n for s, f, u, n in zip(slab, [1, 2, 2], [16, 128, 128], [48, 300, 200])), slab
    assert any("re-aligned" in n for n in out["notices"])
    memory = plan["memory"]
    names = [t["name"] for t in memory["terms"]]
    assert names[0] == "interpreter" and "slab buffers" in names and names[-1] == "allocator slack"
    assert sum(t["bytes"] for t in memory["terms"]) == memory["predicted_peak"]
    assert memory["predicted_peak"] < memory["memory_limit"] < memory["pod_limit"] <= 1 << 30
    assert spec["output"]["compressor"] == {"codec": "blosc", "cname": "zstd", "clevel": 5, "shuffle": "bitshuffle"}
    assert spec["pyramid"] == {"levels": 2, "method": "max"}
    assert spec["resources"]["memoryPerWorker"] == "1GiB"


@pytest.mark.slow
@pytest.mark.integration
def test_plan_reads_axes_and_voxel_sizes_from_hdf5_attributes(tmp_path):
    """DIMENSION_LABELS (h5py dimension scales) give the axes and element_size_um the voxel
    sizes when no flag sets them; the same file without the attributes is the negative control."""
    labelled, bare = tmp_path / "labelled.h5", tmp_path / "bare.h5"
    for path, with_attrs in ((labelled, True), (bare, False)):
        with h5py.File(path, "w") as f:
            ds = f.create_dataset("/volume/data", shape=(3, 8, 32, 32), dtype="<u2")
            if with_attrs:
                for dim, label in zip(ds.dims, ("t", "z", "y", "x")):
                    dim.label = label
                ds.attrs["element_size_um"] = [1.0, 2.5, 0.25, 0.25]
    plan = json.loads(_run("plan", f"{labelled}:/volume/data", "--json", "--levels", "1").stdout)["plan"]
    assert plan["axes"] == "tzyx"
    assert plan["levels"][0]["scale"] == [1.0, 2.5, 0.25, 0.25]
    assert plan["units"][1:] == ["micrometer"] * 3
    plain = json.loads(_run("plan", f"{bare}:/volume/data", "--json", "--levels", "1").stdout)["plan"]
    assert plain["axes"] == "czyx" and plain["levels"][0]["scale"] == [1.0, 1.0, 1.0, 1.0]


@pytest.mark.slow
@pytest.mark.integration
def test_h5ngff_plan_table_and_refusal(metadata_only_h5):
    proc = _run("plan", f"{metadata_only_h5}:/volume/data", "--workers", "2", "--levels", "1")
    for word in ("interpreter", "slab buffers", "allocator slack", "MiB"):
        assert word in proc.stdout, proc.stdout
    refused = _run(
        "plan",
        f"{metadata_only_h5}:/volume/data",
        "--json",
        "--memory-per-worker",
        f"{MIN_WORKER_MEMORY // MiB}Mi",
        check=False,
    )
    assert refused.returncode == 2
    err = json.loads(refused.stdout)
    assert err["reason"] == "BudgetTooSmall" and "Raise resources.memoryPerWorker to at least" in err["message"]


@pytest.mark.slow
@pytest.mark.integration
@pytest.mark.parametrize("command", ["plan", "convert"])
def test_help_mentions_every_issue_flag(command):
    proc = _run(command, "--help")
    for flag in ISSUE_FLAGS:
        assert flag in proc.stdout, f"{command} --help lacks {flag}"
    for choice in ("0.4", "0.5", "mean", "nearest", "max", "zstd:5:bitshuffle", "N|auto"):
        assert choice in proc.stdout
