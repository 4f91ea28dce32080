"""ConversionSpec: every bad value names its field, what it got and what is allowed.

The table holds one bad spec per row: the patch applied to a good spec, the exact field path the
error must name, and a distinctive part of the message. Planner-time errors (facts that need the
dataset's shape) are tested through ``make_plan`` at the end.
"""

from __future__ import annotations

import copy
import json
import re

import pydantic
import pytest
import yaml

from h5ngff.errors import BudgetTooSmallError, PlanError, SpecError
from h5ngff.planner import Capacity, DatasetInfo, make_plan
from h5ngff.spec import MIN_WORKER_MEMORY, ConversionSpec, parse_spec
from h5ngff.units import MiB

GOOD = {
    "source": {"path": "/data/in.h5", "dataset": "/volume/data"},
    "output": {"path": "/data/out.ome.zarr", "chunks": [64, 64, 64]},
}

ISSUE_EXAMPLE = """\
source: {path: /data/in.h5, dataset: /volume/data}
output: {path: /data/out.ome.zarr, ngffVersion: "0.5", chunks: [64, 64, 64],
         compressor: {codec: blosc, cname: zstd, clevel: 5, shuffle: bitshuffle}}
pyramid: {levels: 3, method: mean}
resources: {workers: 8, memoryPerWorker: 1Gi}
"""


def patched(patch: dict) -> dict:
    """GOOD with ``patch`` merged in one level deep (a value of None deletes the key)."""
    data = copy.deepcopy(GOOD)
    for section, value in patch.items():
        if isinstance(value, dict) and isinstance(data.get(section), dict):
            for key, v in value.items():
                if v is None:
                    data[section].pop(key, None)
                else:
                    data[section][key] = v
        elif value is None:
            data.pop(section, None)
        else:
            data[section] = value
    return data


# (id, patch, field, distinctive message part)
BAD_SPECS = [
    # source
    ("source-missing", {"source": None}, "source", "this field is required"),
    ("source-dataset-missing", {"source": {"dataset": None}}, "source.dataset", "this field is required"),
    ("source-path-empty", {"source": {"path": ""}}, "source.path", "Expected a non-empty string. Got ''"),
    ("source-path-not-string", {"source": {"path": 5}}, "source.path", "Expected a valid string. Got 5"),
    ("source-not-mapping", {"source": "in.h5:/data"}, "source", "Expected a valid dictionary"),
    # output
    ("output-missing", {"output": None}, "output", "this field is required"),
    (
        "ngff-version-unknown",
        {"output": {"ngffVersion": "0.6"}},
        "output.ngffVersion",
        "Expected one of '0.4' or '0.5'. Got '0.6'",
    ),
    ("ngff-version-float", {"output": {"ngffVersion": 0.3}}, "output.ngffVersion", "Got the number 0.3 instead"),
    (
        "chunks-zero",
        {"output": {"chunks": [64, 0, 64]}},
        "output.chunks",
        "Expected positive integers for every axis. Got [64, 0, 64] instead (0 is not allowed)",
    ),
    ("chunks-negative", {"output": {"chunks": [-1, 64, 64]}}, "output.chunks", "(-1 is not allowed)"),
    ("chunks-empty", {"output": {"chunks": []}}, "output.chunks", "Expected at least one positive integer. Got []"),
    ("chunks-not-list", {"output": {"chunks": 64}}, "output.chunks", "Expected a valid list. Got 64"),
    ("chunks-fraction", {"output": {"chunks": [64, 1.5, 64]}}, "output.chunks[1]", "Expected a valid integer. Got 1.5"),
    ("chunks-text", {"output": {"chunks": [64, "big", 64]}}, "output.chunks[1]", "Expected a valid integer. Got 'big'"),
    (
        "shards-with-v04",
        {"output": {"ngffVersion": "0.4", "shards": [128, 128, 128]}},
        "output.shards",
        "Expected shards only with ngffVersion '0.5' (Zarr v3). Got shards with ngffVersion '0.4'",
    ),
    (
        "shards-not-multiple",
        {"output": {"shards": [128, 96, 128]}},
        "output.shards",
        "Expected every shard entry to be a multiple of the chunk entry. Got shards [128, 96, 128] for chunks [64, 64, 64] instead (axis 1)",
    ),
    (
        "shards-length",
        {"output": {"shards": [128, 128]}},
        "output.shards",
        "Expected shards with as many entries as chunks (3). Got [128, 128]",
    ),
    ("shards-zero", {"output": {"shards": [0, 128, 128]}}, "output.shards", "(0 is not allowed)"),
    (
        "codec-unknown",
        {"output": {"compressor": {"codec": "lzma"}}},
        "output.compressor.codec",
        "Expected one of 'blosc', 'zstd', 'gzip' or 'none'. Got 'lzma'",
    ),
    (
        "cname-unknown",
        {"output": {"compressor": {"codec": "blosc", "cname": "snappy"}}},
        "output.compressor.cname",
        "Expected one of 'zstd', 'lz4', 'lz4hc', 'zlib' or 'blosclz'. Got 'snappy'",
    ),
    (
        "shuffle-unknown",
        {"output": {"compressor": {"shuffle": "byteshuffle"}}},
        "output.compressor.shuffle",
        "Expected one of 'noshuffle', 'shuffle' or 'bitshuffle'. Got 'byteshuffle'",
    ),
    (
        "blosc-clevel-high",
        {"output": {"compressor": {"codec": "blosc", "clevel": 10}}},
        "output.compressor.clevel",
        "Expected clevel between 0 and 9 for codec 'blosc'. Got 10",
    ),
    (
        "zstd-clevel-zero",
        {"output": {"compressor": {"codec": "zstd", "clevel": 0}}},
        "output.compressor.clevel",
        "Expected clevel between 1 and 22 for codec 'zstd'. Got 0",
    ),
    (
        "gzip-clevel-high",
        {"output": {"compressor": {"codec": "gzip", "clevel": 12}}},
        "output.compressor.clevel",
        "Expected clevel between 1 and 9 for codec 'gzip'. Got 12",
    ),
    (
        "none-with-clevel",
        {"output": {"compressor": {"codec": "none", "clevel": 3}}},
        "output.compressor.clevel",
        "Expected no clevel with codec 'none'. Got clevel=3",
    ),
    (
        "cname-with-gzip",
        {"output": {"compressor": {"codec": "gzip", "cname": "zstd"}}},
        "output.compressor.cname",
        "Expected cname only with codec 'blosc'. Got cname='zstd' with codec 'gzip'",
    ),
    (
        "shuffle-with-zstd",
        {"output": {"compressor": {"codec": "zstd", "shuffle": "shuffle"}}},
        "output.compressor.shuffle",
        "Expected shuffle only with codec 'blosc'. Got shuffle='shuffle' with codec 'zstd'",
    ),
    (
        "clevel-boolean",
        {"output": {"compressor": {"clevel": True}}},
        "output.compressor.clevel",
        "Expected a number, not a boolean. Got True",
    ),
    (
        "output-url-scheme-unsupported",
        {"output": {"path": "gs://bucket/x.ome.zarr"}},
        "output.path",
        "Got 'gs://bucket/x.ome.zarr' instead (gs:// is not supported; nothing was written)",
    ),
    (
        "output-url-scheme-file",
        {"output": {"path": "file:///data/x.ome.zarr"}},
        "output.path",
        "(file:// is not supported",
    ),
    (
        "overwrite-not-bool",
        {"output": {"overwrite": "maybe"}},
        "output.overwrite",
        "Expected a valid boolean. Got 'maybe'",
    ),
    # image
    (
        "axes-unknown-letter",
        {"image": {"axes": "zyq"}},
        "image.axes",
        "Expected distinct axis names from 't', 'c', 'z', 'y', 'x', e.g. 'tczyx'. Got 'zyq'",
    ),
    ("axes-duplicate", {"image": {"axes": "zyy"}}, "image.axes", "Expected distinct axis names"),
    (
        "axes-order",
        {"image": {"axes": "zyxc"}},
        "image.axes",
        "Expected 2 or 3 spatial axes after optional 't' then 'c' (NGFF order), e.g. 'tczyx', 'czyx', 'yx'. Got 'zyxc'",
    ),
    ("axes-one-spatial", {"image": {"axes": "tx"}}, "image.axes", "Expected 2 or 3 spatial axes"),
    ("axes-not-string", {"image": {"axes": 5}}, "image.axes", "Expected a valid string. Got 5"),
    (
        "scale-zero",
        {"image": {"scale": [1.0, 0.0, 0.5]}},
        "image.scale",
        "Expected a positive, finite voxel size for every axis. Got [1.0, 0.0, 0.5]",
    ),
    ("scale-negative", {"image": {"scale": [-2.0, 0.5, 0.5]}}, "image.scale", "Got [-2.0, 0.5, 0.5]"),
    ("scale-text", {"image": {"scale": [1.0, "wide", 0.5]}}, "image.scale[1]", "Expected a valid number. Got 'wide'"),
    (
        "units-unknown",
        {"image": {"units": ["micrometer", "microns", "micrometer"]}},
        "image.units",
        "Expected NGFF unit names such as 'micrometer', 'nanometer', 'millimeter', 'second' or '' for none. Got 'microns'",
    ),
    ("units-abbreviation", {"image": {"units": ["um", "um", "um"]}}, "image.units", "Got 'um' instead"),
    # pyramid
    ("levels-zero", {"pyramid": {"levels": 0}}, "pyramid.levels", "Expected 'auto' or an integer from 1 to 16. Got 0"),
    (
        "levels-too-many",
        {"pyramid": {"levels": 17}},
        "pyramid.levels",
        "Expected 'auto' or an integer from 1 to 16. Got 17",
    ),
    (
        "levels-word",
        {"pyramid": {"levels": "many"}},
        "pyramid.levels",
        "Expected a valid integer or 'auto'. Got 'many'",
    ),
    (
        "levels-boolean",
        {"pyramid": {"levels": True}},
        "pyramid.levels",
        "Expected 'auto' or an integer from 1 to 16. Got True",
    ),
    ("levels-fraction", {"pyramid": {"levels": 2.5}}, "pyramid.levels", "Expected a valid integer or 'auto'. Got 2.5"),
    (
        "method-unknown",
        {"pyramid": {"method": "gaussian"}},
        "pyramid.method",
        "Expected one of 'mean', 'nearest' or 'max'. Got 'gaussian'",
    ),
    (
        "pyramid-axes-time",
        {"pyramid": {"axes": "tyx"}},
        "pyramid.axes",
        "Expected distinct spatial axes from 'zyx', e.g. 'yx'. Got 'tyx'",
    ),
    ("pyramid-axes-empty", {"pyramid": {"axes": ""}}, "pyramid.axes", "Got ''"),
    ("pyramid-axes-duplicate", {"pyramid": {"axes": "yy"}}, "pyramid.axes", "Got 'yy'"),
    # resources
    (
        "workers-zero",
        {"resources": {"workers": 0}},
        "resources.workers",
        "Expected 'auto' or an integer from 1 to 4096. Got 0",
    ),
    ("workers-huge", {"resources": {"workers": 5000}}, "resources.workers", "Got 5000"),
    (
        "workers-word",
        {"resources": {"workers": "many"}},
        "resources.workers",
        "Expected a valid integer or 'auto'. Got 'many'",
    ),
    (
        "workers-yaml-yes",
        {"resources": {"workers": True}},
        "resources.workers",
        "Expected 'auto' or an integer from 1 to 4096. Got True",
    ),
    (
        "threads-zero",
        {"resources": {"threadsPerWorker": 0}},
        "resources.threadsPerWorker",
        "Expected a number greater than or equal to 1. Got 0",
    ),
    (
        "threads-many",
        {"resources": {"threadsPerWorker": 65}},
        "resources.threadsPerWorker",
        "Expected a number less than or equal to 64. Got 65",
    ),
    (
        "threads-boolean",
        {"resources": {"threadsPerWorker": True}},
        "resources.threadsPerWorker",
        "Expected a number, not a boolean. Got True",
    ),
    (
        "memory-unit-unknown",
        {"resources": {"memoryPerWorker": "1Gx"}},
        "resources.memoryPerWorker",
        "e.g. '1Gi' or '512MiB'. Got '1Gx'",
    ),
    (
        "memory-too-small",
        {"resources": {"memoryPerWorker": "32Mi"}},
        "resources.memoryPerWorker",
        f"Expected at least {MIN_WORKER_MEMORY // MiB}Mi, the smallest worker any plan fits in",
    ),
    (
        "memory-negative",
        {"resources": {"memoryTotal": -5}},
        "resources.memoryTotal",
        "Expected a non-negative byte count. Got -5",
    ),
    (
        "memory-list",
        {"resources": {"memoryTotal": [1]}},
        "resources.memoryTotal",
        "Expected a valid integer or a valid string. Got [1]",
    ),
    (
        "memory-boolean",
        {"resources": {"memoryPerWorker": True}},
        "resources.memoryPerWorker",
        "Expected a byte quantity such as 1Gi. Got True",
    ),
    (
        "both-budgets",
        {"resources": {"memoryPerWorker": "1Gi", "memoryTotal": "8Gi"}},
        "resources.memoryTotal",
        "Expected memoryPerWorker or memoryTotal, not both. Got both (memoryPerWorker '1Gi', memoryTotal '8Gi')",
    ),
    (
        "slab-zero",
        {"resources": {"slab": [64, 0, 2008]}},
        "resources.slab",
        "Expected positive integers for every axis. Got [64, 0, 2008]",
    ),
    (
        "allocator-unknown",
        {"resources": {"allocator": "tcmalloc"}},
        "resources.allocator",
        "Expected one of 'auto', 'jemalloc' or 'glibc'. Got 'tcmalloc'",
    ),
    # unknown fields (typos) are quoted as written
    (
        "typo-top-level",
        {"resource": {"workers": 2}},
        "resource",
        "Expected no such field (check its spelling and case; fields are camelCase). Got {'workers': 2}",
    ),
    (
        "typo-snake-case-dash",
        {"resources": {"memory-per-worker": "1Gi"}},
        "resources.memory-per-worker",
        "Expected no such field",
    ),
    ("typo-capitalised", {"resources": {"Workers": 4}}, "resources.Workers", "Expected no such field"),
    ("typo-in-output", {"output": {"chunk": [64, 64, 64]}}, "output.chunk", "Got [64, 64, 64]"),
    ("typo-nested", {"output": {"compressor": {"level": 5}}}, "output.compressor.level", "Expected no such field"),
    (
        "typo-like-union-tag",
        {"pyramid": {"interpolation": "linear"}},
        "pyramid.interpolation",
        "Expected no such field",
    ),
    ("typo-like-str-tag", {"image": {"strides": [1, 1, 1]}}, "image.strides", "Expected no such field"),
    # wrong types
    (
        "image-not-mapping",
        {"image": ["zyx"]},
        "image",
        "Expected a valid dictionary or instance of ImageSpec. Got ['zyx']",
    ),
    (
        "resources-not-mapping",
        {"resources": 8},
        "resources",
        "Expected a valid dictionary or instance of ResourcesSpec. Got 8",
    ),
]


def test_the_table_is_large_and_has_no_duplicate_rows():
    assert len(BAD_SPECS) >= 30
    assert len({row[0] for row in BAD_SPECS}) == len(BAD_SPECS)


@pytest.mark.parametrize("patch, field, message", [row[1:] for row in BAD_SPECS], ids=[row[0] for row in BAD_SPECS])
def test_bad_spec_names_field_got_and_allowed(patch, field, message):
    with pytest.raises(SpecError) as info:
        parse_spec(patched(patch))
    err = info.value
    assert err.field == field, str(err)
    assert message in str(err), str(err)
    text = str(err)
    assert text.startswith(f"{field}: "), text
    # The house format: what is allowed, then what came, in that order.
    assert re.search(r"Expected .+ Got .+ instead", text), text
    assert err.reason == "InvalidSpec" and err.exit_code == 2
    assert isinstance(err, ValueError)


def test_the_table_rows_are_bad_only_because_of_their_patch():
    """Negative control: GOOD itself parses, so each row's error comes from its own patch."""
    assert parse_spec(copy.deepcopy(GOOD)).output.chunks == [64, 64, 64]


def test_non_mapping_spec_is_refused():
    with pytest.raises(SpecError, match=r"spec: Expected a mapping with source and output. Got list instead."):
        parse_spec(["source"])


def test_second_problem_is_counted():
    with pytest.raises(SpecError) as info:
        parse_spec(patched({"output": {"chunks": [0, 64, 64]}, "resources": {"workers": 0}}))
    assert "(1 more problem(s) after fixing this one)" in str(info.value)


def test_union_members_are_not_counted_as_more_problems():
    with pytest.raises(SpecError) as info:
        parse_spec(patched({"resources": {"workers": "many"}}))
    assert "more problem" not in str(info.value)


# --- regressions ------------------------------------------------------------------------------


def test_regression_typo_field_starting_with_int_or_str_lost_its_name():
    """``interval``/``strides`` began like pydantic's union tags 'int'/'str' and were dropped,
    so the error named only the section."""
    for key in ("interval", "strategy", "integer", "string"):
        with pytest.raises(SpecError) as info:
            parse_spec(patched({"resources": {key: 1}}))
        assert info.value.field == f"resources.{key}"


def test_regression_typo_field_was_camel_cased_into_a_valid_name():
    """``Workers`` was reported as ``resources.workers``: a valid field, a baffling error."""
    with pytest.raises(SpecError) as info:
        parse_spec(patched({"resources": {"Workers": 4}}))
    assert info.value.field == "resources.Workers"


def test_regression_yaml_yes_meant_one_worker():
    """pydantic's lax mode read True as 1: ``workers: yes`` planned a single worker."""
    data = yaml.safe_load("source: {path: a.h5, dataset: /d}\noutput: {path: o}\nresources: {workers: yes}\n")
    with pytest.raises(SpecError, match="resources.workers"):
        parse_spec(data)


def test_regression_infinite_scale_accepted():
    with pytest.raises(SpecError, match="image.scale"):
        parse_spec(patched({"image": {"scale": [1.0, float("inf"), 1.0]}}))
    with pytest.raises(SpecError, match="image.scale"):
        parse_spec(patched({"image": {"scale": [1.0, float("nan"), 1.0]}}))


def test_regression_model_level_errors_named_only_the_section():
    """Shards/compressor/budget checks run on the whole model and used to report ``output`` or
    ``resources``; they now name the field to change."""
    cases = [
        ({"output": {"ngffVersion": "0.4", "shards": [128, 128, 128]}}, "output.shards"),
        ({"output": {"compressor": {"codec": "gzip", "shuffle": "shuffle"}}}, "output.compressor.shuffle"),
        ({"resources": {"memoryPerWorker": "1Gi", "memoryTotal": "2Gi"}}, "resources.memoryTotal"),
    ]
    for patch, field in cases:
        with pytest.raises(SpecError) as info:
            parse_spec(patched(patch))
        assert info.value.field == field


# --- good specs -------------------------------------------------------------------------------

GOOD_SPECS = [
    GOOD,
    yaml.safe_load(ISSUE_EXAMPLE),
    patched({"output": {"ngffVersion": "0.4", "compressor": {"codec": "gzip", "clevel": 9}}}),
    patched({"output": {"shards": [128, 128, 192], "compressor": {"codec": "zstd", "clevel": 22}}}),
    patched({"output": {"compressor": {"codec": "none"}, "overwrite": True}}),
    patched({"output": {"compressor": {"codec": "blosc", "cname": "lz4hc", "clevel": 0, "shuffle": "noshuffle"}}}),
    patched(
        {
            "output": {"chunks": [1, 1, 64, 64, 64]},
            "image": {
                "axes": "tczyx",
                "scale": [1.0, 1.0, 2.0, 0.5, 0.5],
                "units": ["second", "", "micrometer", "micrometer", "micrometer"],
                "name": "scan",
            },
        }
    ),
    patched({"pyramid": {"levels": "auto", "method": "max", "axes": "yx"}}),
    patched(
        {
            "resources": {
                "workers": "auto",
                "threadsPerWorker": 4,
                "memoryTotal": "16GiB",
                "slab": [64, 704, 2008],
                "allocator": "glibc",
            }
        }
    ),
    patched({"resources": {"workers": 4096, "memoryPerWorker": 2_000_000_000}}),
]


@pytest.mark.parametrize("data", GOOD_SPECS, ids=range(len(GOOD_SPECS)))
def test_good_spec_round_trips_through_the_wire(data):
    spec = parse_spec(data)
    wire = spec.to_wire()
    assert parse_spec(wire) == spec
    # The wire form is camelCase and YAML-safe, as a ConversionJob's .spec holds it.
    assert parse_spec(yaml.safe_load(yaml.safe_dump(wire))) == spec
    assert all("_" not in key for section in wire.values() if isinstance(section, dict) for key in section)


def test_regression_yaml_float_ngff_version_was_accepted_though_the_crd_refuses_it():
    """An unquoted ``ngffVersion: 0.5`` is a YAML float: it passed locally and the API server
    refused the manifest. Now refused here too, saying how to quote it; the quoted form passes."""
    for text in ("0.4", "0.5"):
        data = yaml.safe_load(f"source: {{path: a.h5, dataset: /d}}\noutput: {{path: o, ngffVersion: {text}}}\n")
        with pytest.raises(SpecError, match=f'quote it, e.g. ngffVersion: "{text}"') as info:
            parse_spec(data)
        assert info.value.field == "output.ngffVersion"
    for text, version in (('"0.4"', "0.4"), ("'0.5'", "0.5")):
        data = yaml.safe_load(f"source: {{path: a.h5, dataset: /d}}\noutput: {{path: o, ngffVersion: {text}}}\n")
        assert parse_spec(data).output.ngff_version == version


def test_issue_example_parses_with_the_public_names():
    spec = parse_spec(yaml.safe_load(ISSUE_EXAMPLE))
    assert spec.source.path == "/data/in.h5" and spec.source.dataset == "/volume/data"
    assert spec.output.path == "/data/out.ome.zarr" and spec.output.chunks == [64, 64, 64]
    assert spec.output.ngff_version == "0.5"
    assert spec.output.compressor.describe() == "blosc zstd level 5 bitshuffle"
    assert spec.pyramid.levels == 3 and spec.pyramid.method == "mean"
    assert spec.resources.workers == 8 and spec.resources.memory_per_worker_bytes == 1 << 30


def test_dataset_path_is_made_absolute_and_defaults_are_filled():
    spec = parse_spec({"source": {"path": "a.h5", "dataset": "volume/data"}, "output": {"path": "o"}})
    assert spec.source.dataset == "/volume/data"
    assert spec.output.ngff_version == "0.5" and spec.output.compressor.codec == "blosc"
    assert spec.pyramid.levels == "auto" and spec.resources.workers == "auto" and spec.resources.threads_per_worker == 1


def test_snake_case_names_are_accepted_from_python():
    spec = parse_spec(
        {
            "source": {"path": "a.h5", "dataset": "/d"},
            "output": {"path": "o", "ngff_version": "0.4"},
            "resources": {"memory_per_worker": "1Gi"},
        }
    )
    assert spec.output.ngff_version == "0.4" and spec.resources.memory_per_worker_bytes == 1 << 30


def test_spec_is_frozen():
    spec = parse_spec(GOOD)
    with pytest.raises(pydantic.ValidationError):
        spec.output.path = "elsewhere"  # type: ignore[misc]


def test_json_schema_keeps_int_or_string_fields():
    """The CRD schema comes from the model: int-or-string fields must stay marked as such."""
    schema = ConversionSpec.model_json_schema(by_alias=True)
    resources = schema["$defs"]["ResourcesSpec"]["properties"]
    for prop in (
        resources["workers"],
        resources["memoryPerWorker"],
        resources["memoryTotal"],
        schema["$defs"]["PyramidSpec"]["properties"]["levels"],
    ):
        assert '"x-kubernetes-int-or-string": true' in json.dumps(prop), prop
    assert '"x-kubernetes-int-or-string"' not in json.dumps(resources["threadsPerWorker"])


# --- planner-time spec errors: facts that need the dataset's shape -----------------------------

CAP = Capacity(cores=2, memory_bytes=8 << 30)
DS3 = DatasetInfo((100, 200, 300), "<u2", 2)

PLAN_ERRORS = [
    (
        "chunks-length",
        DS3,
        {"output": {"chunks": [64, 64]}},
        "output.chunks",
        "Expected 3 entries, one per axis 'zyx'. Got [64, 64] instead.",
    ),
    (
        "shards-length",
        DS3,
        {"output": {"chunks": None, "shards": [128, 128]}},
        "output.shards",
        "Expected 3 entries, one per axis 'zyx'. Got [128, 128] instead.",
    ),
    (
        "shards-vs-default-chunks",
        DS3,
        {"output": {"chunks": None, "shards": [64, 96, 64]}},
        "output.shards",
        "Expected multiples of the chunk shape [64, 64, 64] on every axis. Got [64, 96, 64] instead (axis 'y').",
    ),
    (
        "axes-length",
        DS3,
        {"output": {"chunks": None}, "image": {"axes": "czyx"}},
        "image.axes",
        "Expected 3 axes for a dataset of shape (100, 200, 300). Got 'czyx' (4 axes) instead.",
    ),
    (
        "scale-length",
        DS3,
        {"image": {"scale": [1.0, 1.0]}},
        "image.scale",
        "Expected 3 voxel sizes, one per axis 'zyx'. Got [1.0, 1.0] instead.",
    ),
    (
        "units-length",
        DS3,
        {"image": {"units": ["micrometer", "micrometer"]}},
        "image.units",
        "Expected 3 units, one per axis 'zyx'. Got ['micrometer', 'micrometer'] instead.",
    ),
    (
        "units-time-on-space",
        DS3,
        {"image": {"units": ["second", "micrometer", "micrometer"]}},
        "image.units",
        "Expected a space unit for axis 'z' (or '' for none). Got 'second' instead.",
    ),
    # axes from the HDF5 attributes: with image.axes given, the spec alone is refused (below)
    (
        "units-space-on-time",
        DatasetInfo((5, 10, 10), "<u2", 2, attr_axes="tyx"),
        {"image": {"units": ["micrometer", "micrometer", "micrometer"]}},
        "image.units",
        "Expected a time unit for axis 't' (or '' for none). Got 'micrometer' instead.",
    ),
    (
        "units-on-channel",
        DatasetInfo((2, 10, 10, 10), "<u2", 2),
        {"output": {"chunks": [1, 8, 8, 8]}, "image": {"units": ["micrometer"] * 4}},
        "image.units",
        "Expected a channel unit for axis 'c' (or '' for none). Got 'micrometer' instead.",
    ),
    (
        "levels-too-many",
        DS3,
        {"pyramid": {"levels": 11}},
        "pyramid.levels",
        "Expected at most 10 levels for shape (100, 200, 300): level 9 is already one voxel along every downsampled axis. Got 11 instead.",
    ),
    (
        "levels-without-axes",
        DatasetInfo((2, 100, 100), "<u2", 2, attr_axes="cyx"),
        {"output": {"chunks": [1, 64, 64]}, "pyramid": {"levels": 2, "axes": "z"}},
        "pyramid.axes",
        "Expected axes present in the image axes 'cyx'. Got 'z' instead ('z' is not an image axis).",
    ),
    (
        "one-dimension",
        DatasetInfo((100,), "<u2", 2),
        {"output": {"chunks": None}},
        "source.dataset",
        "Expected a dataset with 2 to 5 dimensions (NGFF images are yx to tczyx). Got 1 dimension(s), shape (100,), instead.",
    ),
    (
        "slab-length",
        DS3,
        {"resources": {"slab": [64, 64]}},
        "resources.slab",
        "Expected 3 entries, one per axis. Got [64, 64] instead.",
    ),
]


@pytest.mark.parametrize(
    "ds, patch, field, message", [row[1:] for row in PLAN_ERRORS], ids=[row[0] for row in PLAN_ERRORS]
)
def test_planner_time_spec_errors_name_the_field(ds, patch, field, message):
    spec = parse_spec(patched(patch))  # valid on its own: only the dataset makes it wrong
    with pytest.raises((SpecError, PlanError)) as info:
        make_plan(ds, spec, CAP)
    assert getattr(info.value, "field", field) == field
    assert str(info.value) == f"{field}: {message}"
    assert not isinstance(info.value, BudgetTooSmallError)


SPEC_TIME_AXIS_ERRORS = [
    (
        "chunks-vs-axes",
        {"image": {"axes": "czyx"}},
        "output.chunks",
        "Expected 4 entries, one per axis 'czyx'. Got [64, 64, 64] instead.",
    ),
    (
        "units-space-on-time",
        {"output": {"chunks": None}, "image": {"axes": "tyx", "units": ["micrometer"] * 3}},
        "image.units",
        "Expected a time unit for axis 't' (or '' for none). Got 'micrometer' instead.",
    ),
    (
        "pyramid-axes",
        {"output": {"chunks": [1, 64, 64]}, "image": {"axes": "cyx"}, "pyramid": {"axes": "z"}},
        "pyramid.axes",
        "Expected axes present in the image axes 'cyx'. Got 'z' instead ('z' is not an image axis).",
    ),
    (
        "slab-vs-axes",
        {"image": {"axes": "zyx"}, "resources": {"slab": [64, 64]}},
        "resources.slab",
        "Expected 3 entries, one per axis 'zyx'. Got [64, 64] instead.",
    ),
]


@pytest.mark.parametrize(
    "patch, field, message", [row[1:] for row in SPEC_TIME_AXIS_ERRORS], ids=[row[0] for row in SPEC_TIME_AXIS_ERRORS]
)
def test_per_axis_lists_that_contradict_image_axes_are_refused_by_the_spec(patch, field, message):
    """With image.axes given, the planner's per-axis rules need no dataset: the model refuses
    them, and so does the CRD at admission (tests/test_admission.py), with the planner's words."""
    with pytest.raises(SpecError) as info:
        parse_spec(patched(patch))
    assert str(info.value) == f"{field}: {message}"


def test_planner_time_errors_negative_control():
    """The same specs plan fine on a dataset they fit."""
    make_plan(
        DatasetInfo((100, 200, 300), "<u2", 2),
        parse_spec(patched({"image": {"units": ["nanometer"] * 3}, "pyramid": {"levels": 9}})),
        CAP,
    )
    make_plan(
        DatasetInfo((100, 200), "<u2", 2),
        parse_spec(patched({"output": {"chunks": [64, 64]}, "resources": {"slab": [64, 64]}})),
        CAP,
    )
