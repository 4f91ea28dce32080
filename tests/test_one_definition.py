"""One definition per fact (issue 17, "the house"): each fact that two modules used to spell out
on their own now lives in one place. Each test fails if a second copy comes back or if the places
that use the fact stop agreeing with it. (Phase names: tests/test_phases.py.)"""

from __future__ import annotations

import ast
import dataclasses
import functools
from pathlib import Path
from typing import get_args

import pytest
import yaml

from h5ngff import codecs_table, job, jobspec
from h5ngff.backends import kubernetes
from h5ngff.backends.base import dask_memory_config
from h5ngff.engine import codecs as engine_codecs
from h5ngff.engine.write import downsample
from h5ngff.jobspec import parse_job_spec
from h5ngff.metrics.exporter import JOB_NAME_ENV, JOB_NAMESPACE_ENV
from h5ngff.operator.controller import manifests
from h5ngff.planner import DEFAULT_CONSTANTS, Capacity, DatasetInfo, MemoryConstants, Thresholds, make_plan
from h5ngff.planner import memory, plan
from h5ngff.spec import CompressorSpec, parse_spec

PACKAGE = Path(__file__).resolve().parents[1] / "src" / "h5ngff"


@functools.cache
def _trees(package: Path) -> dict[str, ast.Module]:
    return {str(path.relative_to(package)): ast.parse(path.read_text()) for path in sorted(package.rglob("*.py"))}


def _assignments(name: str) -> list[str]:
    """Modules of the package that assign ``name`` at module level (its definitions)."""
    found = []
    for where, tree in _trees(PACKAGE).items():
        for node in tree.body:
            targets = (
                node.targets
                if isinstance(node, ast.Assign)
                else [node.target]
                if isinstance(node, ast.AnnAssign)
                else []
            )
            if any(isinstance(t, ast.Name) and t.id == name for t in targets):
                found.append(where)
    return found


def _literals(value: str) -> list[str]:
    """Modules of the package holding the string literal ``value`` (docstrings aside)."""
    found = []
    for where, tree in _trees(PACKAGE).items():
        docs = {
            id(n.body[0].value)
            for n in ast.walk(tree)
            if isinstance(n, (ast.Module, ast.ClassDef, ast.FunctionDef))
            and n.body
            and isinstance(n.body[0], ast.Expr)
            and isinstance(n.body[0].value, ast.Constant)
        }
        if any(isinstance(n, ast.Constant) and n.value == value and id(n) not in docs for n in ast.walk(tree)):
            found.append(where)
    return found


# --- the downsampler's strip size ------------------------------------------------------------------


@pytest.mark.slow
def test_the_strip_size_is_defined_once_in_the_planner_and_used_by_the_engine():
    assert _assignments("STRIP_ELEMENTS") == ["planner/memory.py"]
    assert _assignments("MEAN_STRIP_ELEMENTS") == []
    assert downsample.STRIP_ELEMENTS == plan.STRIP_ELEMENTS == memory.STRIP_ELEMENTS


def test_negative_control_the_scan_sees_a_second_definition(tmp_path, monkeypatch):
    copy = tmp_path / "h5ngff"
    (copy / "engine" / "write").mkdir(parents=True)
    (copy / "engine" / "write" / "downsample.py").write_text("STRIP_ELEMENTS = 1 << 16\n")
    (copy / "units.py").write_text('GROUP = "h5ngff.dev"\n')
    monkeypatch.setitem(globals(), "PACKAGE", copy)
    assert _assignments("STRIP_ELEMENTS") == ["engine/write/downsample.py"]
    assert _literals("h5ngff.dev") == ["units.py"]


# --- the Dask thresholds: one source, MemoryConstants ------------------------------------------------


def test_thresholds_have_no_defaults_of_their_own():
    """Thresholds said monitor_interval=0.1 while every plan used MemoryConstants' 0.02."""
    assert all(
        f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
        for f in dataclasses.fields(Thresholds)
    )


def _plan(constants: MemoryConstants):
    spec = parse_spec(
        {"source": {"path": "in.h5", "dataset": "/d"}, "output": {"path": "out.ome.zarr"}, "resources": {"workers": 2}}
    )
    return make_plan(DatasetInfo((64, 256, 256), "<u2", 2), spec, Capacity(cores=2, memory_bytes=8 << 30), constants)


def test_the_plan_and_the_dask_config_carry_the_constants():
    for constants in (
        DEFAULT_CONSTANTS,
        dataclasses.replace(DEFAULT_CONSTANTS, monitor_interval=0.05, planned_fraction=0.8),
    ):
        t = _plan(constants).memory.thresholds
        assert (t.planned, t.monitor_interval, t.terminate) == (
            constants.planned_fraction,
            constants.monitor_interval,
            constants.terminate_fraction,
        )
        config = dask_memory_config(_plan(constants))
        assert config["distributed.worker.memory.monitor-interval"] == f"{round(constants.monitor_interval * 1000)}ms"
        assert config["distributed.worker.memory.terminate"] == constants.terminate_fraction


# --- the ConversionJob's identity: one owner class, one group/version/kind ----------------------------


@pytest.mark.slow
def test_one_owner_class():
    assert manifests.Owner is jobspec.Owner
    assert getattr(kubernetes, "ClusterOwner", jobspec.Owner) is jobspec.Owner  # a kept name, if any, is the same class
    owners = [
        (where, n.name)
        for where, tree in _trees(PACKAGE).items()
        for n in ast.walk(tree)
        if isinstance(n, ast.ClassDef) and n.name.endswith("Owner")
    ]
    assert owners == [("jobspec.py", "Owner")]
    assert _assignments("KIND") == ["jobspec.py"] and _assignments("API_VERSION") == ["jobspec.py"]
    assert _assignments("GROUP") == ["jobspec.py"] and _literals("h5ngff.dev") == ["jobspec.py"]
    assert _literals("ConversionJob") == ["jobspec.py"]


@pytest.mark.slow
def test_every_child_names_the_same_owner_as_the_crd():
    crd = yaml.safe_load((PACKAGE / "operator" / "schema" / "crd.yaml").read_text())["spec"]
    assert (crd["group"], crd["names"]["kind"], crd["versions"][0]["name"]) == (
        jobspec.GROUP,
        jobspec.KIND,
        jobspec.VERSION,
    )
    assert (job.API_VERSION, job.KIND) == (jobspec.API_VERSION, jobspec.KIND)
    owner = jobspec.Owner("science", "scan-42", "uid-42")
    spec = parse_job_spec(
        {
            "source": {"path": "/d/in.h5", "dataset": "/volume/data"},
            "output": {"path": "/d/out.ome.zarr"},
            "resources": {"workers": 2},
        }
    )
    runner = manifests.build_runner_job(owner, spec, 1, "img")
    cluster = kubernetes.build_dask_cluster(_plan(DEFAULT_CONSTANTS), owner, "img", spec.pod)
    # The runner's exporter labels its series with the names the runner Job sets.
    env = {e["name"]: e.get("value") for e in runner["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert (env[JOB_NAME_ENV], env[JOB_NAMESPACE_ENV]) == ("scan-42", "science")
    assert _literals(JOB_NAME_ENV) == _literals(JOB_NAMESPACE_ENV) == ["k8s.py"]
    for child in (runner, cluster, manifests.build_runner_role(owner)):
        (ref,) = child["metadata"]["ownerReferences"]
        assert (ref["apiVersion"], ref["kind"], ref["name"], ref["uid"]) == (
            f"{crd['group']}/{crd['versions'][0]['name']}",
            crd["names"]["kind"],
            "scan-42",
            "uid-42",
        )


# --- the codecs: one entry each (h5ngff/codecs_table.py, engine/codecs.py) ---------------------------


@pytest.mark.slow
def test_each_codec_fact_is_defined_once_in_the_codec_table():
    """The codec names, blosc's cnames and the level ranges used to be spelled out in spec.py
    (twice: a tuple beside a Literal), cliargs.py, the CRD's CEL rule and the planner."""
    for name in ("BLOSC_CNAMES", "LEVEL_RANGES", "DEFAULT_LEVEL", "BLOSC_SHUFFLES"):
        assert _assignments(name) == ["codecs_table.py"], name
    for literal in ("blosclz", "lz4hc", "plain-zstd", "noshuffle"):
        assert _literals(literal) == ["codecs_table.py"], literal


def test_the_literals_name_the_tables_and_the_spec_uses_them():
    assert get_args(CompressorSpec.model_fields["codec"].annotation) == tuple(codecs_table.CODECS)
    assert get_args(CompressorSpec.model_fields["cname"].annotation)[0] == codecs_table.BloscCname
    assert get_args(codecs_table.BloscCname) == tuple(codecs_table.BLOSC_CNAMES)
    assert CompressorSpec().codec == codecs_table.DEFAULT_CODEC and CompressorSpec().level == codecs_table.DEFAULT_LEVEL


def test_negative_control_a_literal_that_parts_from_its_table_is_refused():
    with pytest.raises(AssertionError, match="the Literal says"):
        codecs_table.same_names(codecs_table.CodecName, [*codecs_table.CODECS, "lzma"], "codec names")
    with pytest.raises(AssertionError, match="the Literal says"):
        codecs_table.same_names(codecs_table.BloscCname, reversed(codecs_table.BLOSC_CNAMES), "blosc cnames")


def test_the_engine_has_one_entry_per_codec_of_the_table():
    assert list(engine_codecs.CODECS) == list(codecs_table.CODECS)
    assert all(entry.facts is codecs_table.CODECS[name] for name, entry in engine_codecs.CODECS.items())


@pytest.mark.parametrize("fmt", [2, 3])
def test_every_codec_reads_back_from_its_own_metadata(fmt):
    """The metadata the engine writes names the codec as the table does: engine/existing.py reads
    it back into the same spec. Only the crc32c codec (Zarr v3) is set aside."""
    specs = [
        CompressorSpec(codec=name, clevel=None if f.levels is None else f.levels[1])
        for name, f in codecs_table.CODECS.items()
    ]
    specs += [
        CompressorSpec(codec="blosc", cname=c, shuffle=s, clevel=1)
        for c in codecs_table.BLOSC_CNAMES
        for s in codecs_table.BLOSC_SHUFFLES
    ]
    for spec in specs:
        written = engine_codecs.zarr_compressors(spec, fmt, checksums=True)
        if fmt == 2:
            meta = None if written is None else written.get_config()
        else:
            meta = next((c.to_dict() for c in written if c.to_dict()["name"] != "crc32c"), None)
        back = engine_codecs.spec_from_metadata(meta)
        assert (back.codec, back.level, back.blosc_cname, back.blosc_shuffle) == (
            spec.codec,
            spec.level,
            spec.blosc_cname,
            spec.blosc_shuffle,
        )


def test_the_memory_term_follows_the_codec_table():
    """zstd (plain, or inside blosc) keeps a zstd context per thread; the planner prices it."""
    assert plan._uses_zstd(parse_spec({"source": {"path": "a.h5", "dataset": "d"}, "output": {"path": "o"}}))
    for compressor, zstd in [
        ({"codec": "zstd"}, True),
        ({"codec": "blosc", "cname": "lz4"}, False),
        ({"codec": "gzip"}, False),
        ({"codec": "none"}, False),
    ]:
        spec = parse_spec(
            {"source": {"path": "a.h5", "dataset": "d"}, "output": {"path": "o", "compressor": compressor}}
        )
        assert plan._uses_zstd(spec) is zstd, compressor
