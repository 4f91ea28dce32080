"""``h5ngff verify --source`` compares EVERY level with the pyramid computed from the source.

Real conversions (real HDF5, real Dask, real Zarr stores), then real damage: a level-1 chunk
replaced by another valid level-1 chunk decodes fine, so only the source comparison can see it.
The pyramid verify computes is checked against tests/reference.py (pad, reshape, exact Python-int
arithmetic), written independently of the engine's downsampler that verify shares with the writer.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tracemalloc
from itertools import product

import numpy as np
import pytest

from conftest import smooth, spec_for, write_h5
from h5ngff.engine.write.chunkio import ArrayLayout, read_region, write_block
from h5ngff.engine.verify.levelcheck import LevelComparison, PyramidRule, memory_bound, SOURCE_CACHE_BYTES
from existing_layout import level_layout
from h5ngff.engine.verify.check import verify_output
from h5ngff.spec import CompressorSpec
from reference import reference_pyramid

CLI = [sys.executable, "-m", "h5ngff.cli"]
SHAPE = (21, 45, 38)  # odd, and not a multiple of the chunks on any axis

CASES = {
    # name: (ngffVersion, chunks, shards, method, dtype, compressor)
    "v2-mean-u16": ("0.4", [4, 8, 8], None, "mean", "uint16", {"codec": "none"}),
    "v3-mean-f32": ("0.5", [4, 8, 8], None, "mean", "float32", {"codec": "zstd"}),
    "v3-sharded-mean-i16": ("0.5", [2, 4, 4], [4, 8, 8], "mean", "int16", {"codec": "blosc"}),
    "v3-max-u8": ("0.5", [4, 8, 8], None, "max", "uint8", {"codec": "gzip"}),
    "v2-nearest-f64": ("0.4", [4, 8, 8], None, "nearest", "float64", {"codec": "blosc"}),
    "v3-sharded-nearest-u16": ("0.5", [2, 4, 4], [4, 8, 8], "nearest", "uint16", {"codec": "none"}),
}


def _convert(convert, tmp_path, case: str) -> tuple[str, str, np.ndarray]:
    version, chunks, shards, method, dtype, compressor = CASES[case]
    data = smooth(SHAPE, dtype, seed=5)
    h5 = write_h5(tmp_path / "in.h5", data)
    out = str(tmp_path / "out.ome.zarr")
    output = {"chunks": chunks, "ngffVersion": version, "compressor": compressor}
    if shards:
        output["shards"] = shards
    convert(spec_for(h5, out, output=output, pyramid={"levels": 3, "method": method}))
    return h5, out, data


def _layout(out: str, level: int) -> ArrayLayout:
    fmt = 3 if os.path.exists(os.path.join(out, "zarr.json")) else 2
    return level_layout(out, str(level), fmt, level)


def _two_units_of_one_shape(layout: ArrayLayout) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Two interior units (same region shape) of a level, far apart so their data differ."""
    full = [
        idx
        for idx in product(*(range(g) for g in layout.unit_grid))
        if all(r.stop - r.start == u for r, u in zip(layout.unit_region(idx), layout.unit))
    ]
    return full[0], full[-1]


def _reencode(layout: ArrayLayout, source_unit, target_unit) -> None:
    """Write the data of one unit into another's file with the engine's own encoder: the result is
    a perfectly valid chunk (or shard) of the right level, in the wrong place."""
    data = read_region(layout, layout.unit_region(source_unit)).copy()
    write_block(layout, data, tuple(r.start for r in layout.unit_region(target_unit)))


@pytest.mark.slow
@pytest.mark.integration
@pytest.mark.parametrize("case", sorted(CASES))
def test_a_level1_chunk_replaced_by_another_valid_level1_chunk_is_reported(convert, tmp_path, case):
    h5, out, data = _convert(convert, tmp_path, case)
    source = (h5, "/volume/data")
    # Negative control: the untouched output passes, every level compared.
    clean = verify_output(out, source)
    assert clean.ok, clean.problems
    assert clean.levels_compared == 3 and clean.chunks_compared > 0

    layout = _layout(out, 1)
    donor, victim = _two_units_of_one_shape(layout)
    _reencode(layout, donor, victim)
    key = layout.key(victim)
    # The replaced unit decodes, and in Zarr v3 carries a valid crc32c (the engine's own encoder
    # wrote it): without the source nothing is wrong there. The 0.4 sidecar recorded the CRC32C of
    # the file first written, so it names the unit even without the source.
    plain = verify_output(out)
    if CASES[case][0] == "0.5":
        assert plain.ok, plain.problems
    else:
        assert plain.bad_units == [(1, key)] and [m["key"] for m in plain.checksum_mismatches] == [key]
    report = verify_output(out, source)
    assert not report.ok
    assert report.bad_units == [(1, key)], report.problems  # level 1 only: nothing blamed on levels 0 or 2
    region = layout.unit_region(victim)
    assert report.mismatches and all(m.level == 1 and m.key == key for m in report.mismatches)
    for m in report.mismatches:  # each named chunk lies inside the replaced unit
        assert all(r.start <= lo < hi <= r.stop for (lo, hi), r in zip(m.region, region))
    covered = sum(int(np.prod([hi - lo for lo, hi in m.region])) for m in report.mismatches)
    assert covered == int(np.prod([r.stop - r.start for r in region]))  # every chunk of the unit is named
    cli = subprocess.run(
        CLI + ["verify", out, "--source", f"{h5}:/volume/data", "--json"], capture_output=True, text=True
    )
    assert cli.returncode == 1
    assert f'"key": "{key}"' in cli.stdout and '"level": 1' in cli.stdout


@pytest.mark.slow
@pytest.mark.integration
def test_swapped_level1_chunk_files_are_both_reported(convert, tmp_path):
    """The literal swap: two uncompressed level-1 chunk files of the same size trade places."""
    h5, out, _ = _convert(convert, tmp_path, "v2-mean-u16")
    layout = _layout(out, 1)
    a, b = _two_units_of_one_shape(layout)
    fa, fb = layout.file(a), layout.file(b)
    assert os.path.getsize(fa) == os.path.getsize(fb)
    os.rename(fa, fa + ".x")
    os.rename(fb, fa)
    os.rename(fa + ".x", fb)
    plain = verify_output(out)  # both decode; the 0.4 checksum sidecar names both without the source
    assert sorted(plain.bad_units) == sorted([(1, layout.key(a)), (1, layout.key(b))]), plain.problems
    report = verify_output(out, (h5, "/volume/data"))
    assert sorted(report.bad_units) == sorted([(1, layout.key(a)), (1, layout.key(b))])
    ranges = {m.key: m.region for m in report.mismatches}
    assert ranges[layout.key(a)] == tuple((r.start, r.stop) for r in layout.unit_region(a))
    cli = subprocess.run(CLI + ["verify", out, "--source", f"{h5}:/volume/data"], capture_output=True, text=True)
    assert cli.returncode == 1 and "level 1" in cli.stdout and "differs from the source" in cli.stdout


@pytest.mark.integration
def test_a_wrong_level0_chunk_is_not_blamed_on_the_levels_above(convert, tmp_path):
    """verify builds each level from the source's values, not from the stored level below."""
    h5, out, _ = _convert(convert, tmp_path, "v3-mean-f32")
    layout = _layout(out, 0)
    donor, victim = _two_units_of_one_shape(layout)
    _reencode(layout, donor, victim)
    report = verify_output(out, (h5, "/volume/data"))
    assert report.bad_units == [(0, layout.key(victim))]


@pytest.mark.integration
def test_a_top_level_chunk_and_an_edge_chunk_are_checked_too(convert, tmp_path):
    """The odd edge (a partial chunk of the last level) is compared, not skipped."""
    h5, out, _ = _convert(convert, tmp_path, "v2-nearest-f64")
    top = _layout(out, 2)
    edge = tuple(g - 1 for g in top.unit_grid)
    stored = read_region(top, top.unit_region(edge)).copy()
    stored.flat[-1] += 1.0  # one voxel, the array's last
    write_block(top, stored, tuple(r.start for r in top.unit_region(edge)))
    report = verify_output(out, (h5, "/volume/data"))
    assert report.bad_units == [(2, top.key(edge))]
    assert report.mismatches[0].differing == 1


class _Collect(LevelComparison):
    """The walk's expected chunks assembled into whole levels (small volumes only)."""

    def __init__(self, source, layouts, rule):
        super().__init__(source, layouts, rule, bad=lambda *a: None)
        self.levels = [np.zeros(lay.shape, dtype=lay.dtype) for lay in layouts]
        self.seen = [np.zeros(lay.shape, dtype=np.int32) for lay in layouts]

    def _compare(self, layout, chunk, region, expected):
        self.levels[layout.level][region] = expected
        self.seen[layout.level][region] += 1


@pytest.mark.parametrize("method", ["mean", "max", "nearest"])
@pytest.mark.parametrize("dtype", ["uint8", "int16", "uint64", "float32", "bool"])
@pytest.mark.parametrize(
    "shape,downsampled,chunks",
    [
        ((13, 37, 29), (True, True, True), (4, 8, 8)),
        ((3, 17, 31, 11), (False, False, True, True), (1, 5, 8, 3)),
        ((1, 9, 2), (True, True, True), (1, 2, 2)),
    ],
)
def test_verify_pyramid_equals_the_independent_reference(tmp_path, method, dtype, shape, downsampled, chunks):
    """Every voxel of every level, computed exactly once, equals the plain-NumPy reference."""
    data = smooth(shape, dtype, seed=3)
    levels = 4
    ref = reference_pyramid(data, downsampled, method, levels)
    layouts = [
        ArrayLayout(str(tmp_path / str(k)), r.shape, chunks, None, data.dtype.str, 3, CompressorSpec(), k)
        for k, r in enumerate(ref)
    ]
    walk = _Collect(data, layouts, PyramidRule(method, downsampled))
    walk.run()
    for k, r in enumerate(ref):
        assert (walk.seen[k] == 1).all(), f"level {k}: some voxel computed {walk.seen[k].max()} times or never"
        assert walk.levels[k].tobytes() == r.tobytes(), f"level {k} differs from the reference"


_PEAK = """
import sys, tracemalloc
from h5ngff.engine.verify.check import verify_output
out, h5 = sys.argv[1:3]
verify_output(out, (h5, "/volume/data"))  # first call: one-time imports and caches
tracemalloc.start()
report = verify_output(out, (h5, "/volume/data"))
print(int(report.ok), report.levels_compared, tracemalloc.get_traced_memory()[1])
"""


def _traced_peak(out: str, h5: str) -> tuple[bool, int, int]:
    """verify's peak in a fresh interpreter: in this one, the Dask client's threads allocate too
    and tracemalloc would count them."""
    ok, levels, peak = subprocess.run(
        [sys.executable, "-c", _PEAK, out, h5], capture_output=True, text=True, check=True
    ).stdout.split()
    return ok == "1", int(levels), int(peak)


def _whole_level_peak(layout: ArrayLayout) -> tuple[int, int]:
    tracemalloc.start()
    try:
        whole = read_region(layout, tuple(slice(0, n) for n in layout.shape)).copy()
        return whole.nbytes, tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


@pytest.mark.slow
@pytest.mark.integration
def test_verify_memory_stays_within_its_bound_and_does_not_grow_with_the_image(convert, tmp_path):
    """tracemalloc sees NumPy's allocations. The peak of a full verify stays under the documented
    bound (less the HDF5 cache, which lives in C) and is the same for a 4x larger image; the bound
    is far below one level 0, and loading level 0 whole (the positive control) exceeds it."""
    peaks, bound = {}, None
    for name, shape in (("small", (64, 256, 256)), ("large", (64, 512, 512))):
        data = smooth(shape, "uint16", seed=9)
        h5 = write_h5(tmp_path / f"{name}.h5", data)
        out = str(tmp_path / f"{name}.ome.zarr")
        convert(
            spec_for(h5, out, output={"chunks": [8, 32, 32], "compressor": {"codec": "zstd"}}, pyramid={"levels": 4})
        )
        ok, levels, peaks[name] = _traced_peak(out, h5)
        assert ok and levels == 4
        layouts = [_layout(out, k) for k in range(4)]
        bound = memory_bound(layouts, PyramidRule("mean", (True, True, True))) - SOURCE_CACHE_BYTES
        assert peaks[name] < bound, f"{name}: verify held {peaks[name]} bytes, bound {bound}"
    assert peaks["large"] < 1.1 * peaks["small"] + 65536, peaks
    assert bound < data.nbytes / 4
    nbytes, peak_whole = _whole_level_peak(layouts[0])
    assert nbytes == data.nbytes and peak_whole > bound


@pytest.mark.slow
@pytest.mark.integration
def test_verify_without_a_known_pyramid_rule_says_so(convert, tmp_path):
    """An output whose levels cannot be recomputed (a foreign method) is not passed silently."""
    h5, out, _ = _convert(convert, tmp_path, "v3-max-u8")
    copy = str(tmp_path / "foreign.ome.zarr")
    shutil.copytree(out, copy)
    import json

    with open(os.path.join(copy, "zarr.json")) as f:
        doc = json.load(f)
    doc["attributes"]["h5ngff"]["content"]["method"] = "gaussian"
    doc["attributes"]["ome"]["multiscales"][0]["type"] = "gaussian"
    with open(os.path.join(copy, "zarr.json"), "w") as f:
        json.dump(doc, f)
    report = verify_output(copy, (h5, "/volume/data"))
    assert not report.ok and any("unknown downsampling method 'gaussian'" in p for p in report.problems)
    assert report.units_checked > 0  # the levels above 0 are still decoded
