"""Pyramids that respect anisotropy: each level halves only the spatial axes whose voxel size is
finer than the coarsest one (within 1e-6, relative), all of them once they are equal; a user's
``pyramid.axes`` keeps halving its axes at every level.

The rule is checked as a table of the planner's levels, against a brute-force oracle
(tests/reference.halving_steps, which the planner does not use) under hypothesis together with
the whole plan oracle (slab alignment per step, unit ownership, memory terms with per-step
reductions), and end to end: a converted anisotropic volume read back by ome-zarr-py, ngff-zarr and
plain zarr, each level compared with an independent NumPy mean of the level above, ``h5ngff
verify --source`` run on it, and its measured worker peak held under the plan's prediction.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
import warnings

import numpy as np
import pytest
import zarr
from hypothesis import HealthCheck, given, note, settings
from hypothesis import strategies as st

from conftest import cgroups_available, smooth, spec_for, write_h5
from h5ngff.engine.verify.levelcheck import pyramid_rule
from h5ngff.engine.write.output import downsampled_record
from h5ngff.planner import Capacity, DatasetInfo, make_plan
from h5ngff.spec import parse_spec
from h5ngff.units import MiB
from reference import halving_steps, reference_level
from test_planner_oracle import check_plan

CAP = Capacity(cores=4, memory_bytes=16 << 30)
CLI = [sys.executable, "-m", "h5ngff.cli"]
ZYX, YX, Z = (True, True, True), (False, True, True), (True, False, False)


def _spec(scale=None, levels=4, axes=None, image_axes=None, **sections):
    image = {k: v for k, v in (("scale", scale), ("axes", image_axes)) if v is not None}
    pyramid = {"levels": levels} | ({"axes": axes} if axes else {})
    data = {
        "source": {"path": "in.h5", "dataset": "/d"},
        "output": {"path": "o.zarr"},
        "image": image,
        "pyramid": pyramid,
        "resources": {"workers": 2},
    }
    for key, value in sections.items():
        data.setdefault(key, {}).update(value)
    return parse_spec(data)


def _steps(plan) -> list[tuple[bool, ...]]:
    """The axes halved per step, read from the planner's per-level cumulative factors."""
    return [tuple(b > a for a, b in zip(lo.factors, hi.factors)) for lo, hi in zip(plan.levels, plan.levels[1:])]


# --- the rule as a table ---------------------------------------------------------------------

TABLE = [
    # (name, shape, image axes, scale, levels, pyramid.axes, expected steps)
    ("z 4x: levels 1-2 yx, then zyx", (64, 1024, 1024), None, [4, 1, 1], 5, None, [YX, YX, ZYX, ZYX]),
    ("z 2x: level 1 yx, then zyx", (64, 1024, 1024), None, [2, 1, 1], 4, None, [YX, ZYX, ZYX]),
    ("equal scales: zyx every level", (64, 512, 512), None, [0.5, 0.5, 0.5], 4, None, [ZYX, ZYX, ZYX]),
    ("no scale (all 1): zyx every level, as before", (64, 512, 512), None, None, 4, None, [ZYX, ZYX, ZYX]),
    ("within 1e-6 counts as equal", (64, 512, 512), None, [1.0000001, 1, 1], 3, None, [ZYX, ZYX]),
    ("z finer than y and x: z first", (256, 128, 128), None, [0.25, 1, 1], 4, None, [Z, Z, ZYX]),
    ("z 3x: yx, yx, then z catches up", (256, 1024, 1024), None, [3, 1, 1], 5, None, [YX, YX, Z, YX]),
    ("2-D, y 2x: x first", (512, 1024), "yx", [2, 1], 3, None, [(False, True), (True, True)]),
    ("2-D, equal", (512, 1024), "yx", [0.3, 0.3], 3, None, [(True, True), (True, True)]),
    (
        "t and c untouched",
        (2, 3, 16, 256, 256),
        "tczyx",
        [1, 1, 4, 1, 1],
        4,
        None,
        [(False, False, False, True, True)] * 2 + [(False, False, True, True, True)],
    ),
    ("pyramid.axes zyx overrides the rule", (64, 1024, 1024), None, [4, 1, 1], 4, "zyx", [ZYX, ZYX, ZYX]),
    ("pyramid.axes yx overrides the rule", (64, 1024, 1024), None, [1, 4, 4], 3, "yx", [YX, YX]),
]


@pytest.mark.parametrize("name,shape,image_axes,scale,levels,axes,expected", TABLE, ids=[t[0] for t in TABLE])
def test_the_rule_as_a_planner_table(name, shape, image_axes, scale, levels, axes, expected):
    ds = DatasetInfo(shape, "<u2", 2)
    spec = _spec(scale, levels, axes, image_axes)
    plan = make_plan(ds, spec, CAP)
    check_plan(plan, ds, spec, CAP)  # shapes, factors, scale, translation, alignment, ownership, memory terms
    assert _steps(plan) == expected
    scale0 = tuple(scale or [1.0] * len(shape))
    factors = [1] * len(shape)
    for k, lv in enumerate(plan.levels):
        if k:
            factors = [f * 2 if d else f for f, d in zip(factors, expected[k - 1])]
        assert lv.factors == tuple(factors)
        assert lv.scale == pytest.approx([s * f for s, f in zip(scale0, factors)])
        assert lv.translation == pytest.approx([0.5 * (f - 1) * s for s, f in zip(scale0, factors)])
    # Every step of the plan is what the brute-force oracle gives.
    assert _steps(plan) == (halving_steps(plan.axes, scale0, levels - 1) if axes is None else expected)


def test_z_4x_reaches_isotropic_voxels_at_level_2():
    plan = make_plan(DatasetInfo((64, 1024, 1024), "<u2", 2), _spec([4, 1, 1], 4), CAP)
    assert [lv.scale for lv in plan.levels] == [(4, 1, 1), (4, 2, 2), (4, 4, 4), (8, 8, 8)]
    assert [lv.shape for lv in plan.levels] == [(64, 1024, 1024), (64, 512, 512), (64, 256, 256), (32, 128, 128)]


def test_auto_levels_go_on_until_every_halved_axis_fits_one_chunk():
    """yx, yx, zyx, zyx: z (256 planes, chunk 64) keeps the pyramid going after y and x fit."""
    plan = make_plan(
        DatasetInfo((256, 256, 256), "<u2", 2), _spec([4, 1, 1], "auto", output={"chunks": [64, 64, 64]}), CAP
    )
    assert [lv.shape for lv in plan.levels] == [
        (256, 256, 256),
        (256, 128, 128),
        (256, 64, 64),
        (128, 32, 32),
        (64, 16, 16),
    ]
    small = make_plan(
        DatasetInfo((16, 128, 128), "<u2", 2), _spec([4, 1, 1], "auto", output={"chunks": [16, 32, 32]}), CAP
    )
    assert [lv.shape for lv in small.levels] == [(16, 128, 128), (16, 64, 64), (16, 32, 32)]


def test_the_output_records_the_steps_and_verify_reads_both_forms():
    aniso = make_plan(DatasetInfo((16, 128, 128), "<u2", 2), _spec([4, 1, 1], 4), CAP)
    iso = make_plan(DatasetInfo((16, 128, 128), "<u2", 2), _spec(None, 3), CAP)
    assert downsampled_record(aniso) == [list(YX), list(YX), list(ZYX)]
    assert downsampled_record(iso) == list(ZYX)  # the single list outputs had before: they still resume

    class L:
        def __init__(self, level, shape):
            self.level, self.shape = level, shape

    layouts = [L(k, lv.shape) for k, lv in enumerate(aniso.levels)]
    rule = pyramid_rule({"method": "mean", "downsampled": downsampled_record(aniso)}, {}, layouts)
    assert [rule.step(k) for k in (1, 2, 3)] == [YX, YX, ZYX] and rule.fan_in(4) == 8
    foreign = pyramid_rule({"method": "mean"}, {}, layouts)  # no record: inferred per step from the shapes
    assert [foreign.step(k) for k in (1, 2, 3)] == [YX, YX, ZYX]
    old = pyramid_rule(
        {"method": "mean", "downsampled": [True, True, True]}, {}, [L(k, lv.shape) for k, lv in enumerate(iso.levels)]
    )
    assert [old.step(k) for k in (1, 2)] == [ZYX, ZYX]
    assert "level 1 has shape" in pyramid_rule({"method": "mean", "downsampled": [True, True, True]}, {}, layouts)


def test_pyramid_buffers_are_priced_with_the_reduction_of_each_step():
    """A step that halves only y and x keeps a level twice as large as a zyx step: the pass's
    pyramid term must grow (same shape, same slab, same levels built)."""
    ds = DatasetInfo((32, 512, 512), "<u2", 2)
    terms = {}
    for name, scale in (("aniso", [4, 1, 1]), ("iso", None)):
        plan = make_plan(
            ds, _spec(scale, 4, output={"chunks": [16, 64, 64]}, resources={"workers": 1, "slab": [32, 512, 512]}), CAP
        )
        assert [p.levels for p in plan.passes] == [(0, 1, 2, 3)]
        terms[name] = {t.name: t.bytes for t in plan.passes[0].terms}["pyramid buffers"]
    slab = 32 * 512 * 512 * 2
    strip = min(32 * 512 * 512 // 4, 1 << 16) * 8 * 6
    assert terms["aniso"] == slab // 4 + slab // 16 + slab // 128 + strip  # yx, yx, zyx: 1/4, 1/16, 1/128
    assert terms["iso"] == slab // 8 + slab // 64 + slab // 512 + min(32 * 512 * 512 // 8, 1 << 16) * 8 * 6
    assert terms["aniso"] > terms["iso"]


# --- the rule against a brute-force oracle, with the whole plan oracle -------------------------

NICE = st.sampled_from([0.25, 0.3, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 5.0, 0.3 + 1e-9])


@st.composite
def anisotropic_cases(draw):
    axes = draw(st.sampled_from(["yx", "zyx", "czyx", "tczyx"]))
    shape = tuple(draw(st.integers(1, 3)) if a in "tc" else draw(st.integers(1, 200)) for a in axes)
    scale = [1.0 if a in "tc" else draw(NICE) for a in axes]
    override = draw(st.sampled_from([None, None, None, "yx", "zyx"] if "z" in axes else [None, None, "yx"]))
    levels = draw(st.sampled_from(["auto", 1, 2, 3, 4, 5]))
    chunks = [1 if a in "tc" else draw(st.sampled_from([8, 16, 32])) for a in axes]
    return axes, shape, scale, override, levels, chunks


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
@given(anisotropic_cases())
def test_every_level_follows_the_brute_force_rule(case):
    axes, shape, scale, override, levels, chunks = case
    ds = DatasetInfo(shape, "<u2", 2)
    spec = _spec(scale, levels, override, axes, output={"chunks": chunks})
    try:
        plan = make_plan(ds, spec, CAP)
    except Exception as exc:  # too many levels for the shape: the spec's own refusal
        assert "pyramid.levels" in str(exc), exc
        return
    note(f"steps {_steps(plan)}")
    expected = (
        halving_steps(axes, scale, len(plan.levels) - 1)
        if override is None
        else [tuple(a in override for a in axes)] * (len(plan.levels) - 1)
    )
    assert _steps(plan) == expected
    check_plan(plan, ds, spec, CAP)


# --- end to end --------------------------------------------------------------------------------

SHAPE, SCALE, LEVELS = (16, 128, 128), [4.0, 1.0, 1.0], 4


@pytest.fixture(scope="module")
def anisotropic(tmp_path_factory, shared_cluster):
    from h5ngff.backends.external import ExternalBackend
    from h5ngff.runner import plan_job, run_job

    tmp = tmp_path_factory.mktemp("aniso")
    data = smooth(SHAPE, "uint16", seed=11)
    h5 = write_h5(str(tmp / "in.h5"), data)
    out = str(tmp / "out.ome.zarr")
    backend = ExternalBackend(shared_cluster.scheduler_address)
    spec = spec_for(
        h5,
        out,
        output={"chunks": [8, 32, 32]},
        image={"scale": SCALE, "units": ["micrometer"]},
        pyramid={"levels": LEVELS},
    )
    summary = run_job(plan_job(spec, backend), backend)
    assert summary.status == "Succeeded"
    return h5, out, data, summary


def _independent_mean(above: np.ndarray, axes: tuple[bool, ...]) -> np.ndarray:
    """2x mean over the given axes with plain NumPy reshapes (even sizes only), rounded half to
    even as the engine's integer mean is: written here, not shared with the engine or reference.py."""
    shape, reduce_axes = [], []
    for n, d in zip(above.shape, axes):
        if d:
            assert n % 2 == 0
            shape += [n // 2, 2]
            reduce_axes.append(len(shape) - 1)
        else:
            shape.append(n)
    return np.round(above.astype(np.float64).reshape(shape).mean(axis=tuple(reduce_axes))).astype(above.dtype)


@pytest.mark.slow
@pytest.mark.integration
def test_the_anisotropic_output_read_back_by_independent_readers(anisotropic):
    from ome_zarr.io import parse_url
    from ome_zarr.reader import Reader
    import ngff_zarr

    h5, out, data, _ = anisotropic
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        node = list(Reader(parse_url(out))())[0]
    levels = [np.asarray(a) for a in node.data]
    assert [lv.shape for lv in levels] == [(16, 128, 128), (16, 64, 64), (16, 32, 32), (8, 16, 16)]
    np.testing.assert_array_equal(levels[0], data)
    # Plain zarr: the multiscales metadata and each array.
    with open(f"{out}/zarr.json") as f:
        ms = json.load(f)["attributes"]["ome"]["multiscales"][0]
    transforms = [{t["type"]: t.get(t["type"]) for t in d["coordinateTransformations"]} for d in ms["datasets"]]
    ngff = ngff_zarr.from_ngff_zarr(out)
    for k, d in enumerate(ms["datasets"]):
        arr = zarr.open_array(f"{out}/{d['path']}", mode="r")[...]
        np.testing.assert_array_equal(arr, levels[k])
        np.testing.assert_array_equal(np.asarray(ngff.images[k].data), arr)
        # The scale recomputed from the shapes alone: level 0's voxel size x (shape0 / shape_k).
        factors = [a // b for a, b in zip(SHAPE, arr.shape)]
        assert transforms[k]["scale"] == pytest.approx([s * f for s, f in zip(SCALE, factors)])
        assert transforms[k].get("translation", [0.0] * 3) == pytest.approx(
            [0.5 * (f - 1) * s for s, f in zip(SCALE, factors)]
        )
        assert [ngff.images[k].scale[a] for a in "zyx"] == pytest.approx(transforms[k]["scale"])
        if k:
            step = tuple(a != b for a, b in zip(levels[k - 1].shape, arr.shape))
            assert step == (YX if k < 3 else ZYX), (k, step)
            np.testing.assert_array_equal(arr, _independent_mean(levels[k - 1], step))
            np.testing.assert_array_equal(arr, reference_level(levels[k - 1], step, "mean"))
    assert [t["scale"] for t in transforms] == [[4, 1, 1], [4, 2, 2], [4, 4, 4], [8, 8, 8]]
    assert ms["metadata"]["description"] == "2x mean downsampling along yx, yx, zyx (levels 1 to 3)"


@pytest.mark.slow
@pytest.mark.integration
def test_verify_source_passes_and_names_a_wrong_level(anisotropic, tmp_path):
    import shutil

    from h5ngff.engine.verify.check import verify_output

    h5, out, _, _ = anisotropic
    cli = subprocess.run(CLI + ["verify", out, "--source", f"{h5}:/volume/data"], capture_output=True, text=True)
    assert cli.returncode == 0, cli.stdout + cli.stderr
    # Negative control: a level-2 array whose values are wrong (written through zarr, so every
    # chunk still decodes) is named at level 2, and nothing below it.
    broken = str(tmp_path / "broken.ome.zarr")
    shutil.copytree(out, broken)
    arr = zarr.open_array(f"{broken}/2", mode="r+")
    arr[0, 0, 0] = arr[0, 0, 0] + 1
    report = verify_output(broken, (h5, "/volume/data"))
    assert not report.ok
    assert {level for level, _ in report.bad_units} == {2}, report.problems


@pytest.mark.slow
@pytest.mark.integration
@pytest.mark.skipif(cgroups_available() is not None, reason=f"memory cgroups unavailable: {cgroups_available()}")
@pytest.mark.cgroup
def test_the_plan_bounds_the_measured_worker_peak(tmp_path):
    """Under enforced pod limits: the one worker's peak stays under the predicted peak, whose
    pyramid term holds levels of 1/4 and 1/16 of the slab (y and x halved), not 1/8 and 1/64."""
    from h5ngff.backends.local import LocalPodsBackend
    from h5ngff.runner import plan_job, run_job

    data = smooth((32, 512, 512), "uint16", seed=12)
    h5 = write_h5(str(tmp_path / "in.h5"), data)
    out = str(tmp_path / "out.ome.zarr")
    spec = spec_for(
        h5,
        out,
        output={"chunks": [16, 64, 64]},
        image={"scale": [4, 1, 1]},
        pyramid={"levels": 4},
        resources={"workers": 1, "slab": [32, 512, 512]},
    )
    backend = LocalPodsBackend()
    job = plan_job(spec, backend)
    assert _steps(job.plan) == [YX, YX, ZYX]
    summary = run_job(job, backend)
    assert summary.status == "Succeeded"
    predicted = job.plan.memory.predicted_peak
    for w in summary.workers:
        assert w.oom_kills == 0 and w.memory_terminations == 0, w
        assert 0 < w.peak_rss <= predicted, f"measured {w.peak_rss / MiB:.1f} MiB > predicted {predicted / MiB:.1f} MiB"
    top = zarr.open_array(f"{out}/3", mode="r")
    assert top.shape == (16, 64, 64) and math.prod(top.shape) == 16 * 64 * 64
