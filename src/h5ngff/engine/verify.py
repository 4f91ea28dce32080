"""``h5ngff verify``: check an output's metadata, its completion marker and every chunk, and
optionally compare every level with the pyramid computed from the HDF5 source (``levelcheck``),
streaming one chunk or write unit at a time so memory stays bounded whatever the image size."""

from __future__ import annotations

import dataclasses
import json
import math
import os
from dataclasses import dataclass, field
from itertools import product
from typing import Any, Callable

import numpy as np

from ..errors import VerificationError
from ..spec import CompressorSpec
from .chunkio import TMP_MARK, ArrayLayout, read_unit
from .levelcheck import SOURCE_CACHE_BYTES, LevelComparison, Mismatch, PyramidRule, chunk_count, pyramid_rule
from .output import completion_marker
from .sources import verify_source


@dataclass
class VerifyReport:
    path: str
    levels: int = 0
    units_checked: int = 0
    complete: bool = False
    problems: list[str] = field(default_factory=list)
    #: (level, key) of every chunk or shard file that is missing, truncated, undecodable or wrong.
    bad_units: list[tuple[int, str]] = field(default_factory=list)
    compared_with_source: bool = False
    #: Levels compared with the pyramid computed from the source (0 without --source).
    levels_compared: int = 0
    chunks_compared: int = 0
    mismatches: list[Mismatch] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems and not self.bad_units

    def to_dict(self) -> dict[str, Any]:
        return {
            "path": self.path, "ok": self.ok, "complete": self.complete, "levels": self.levels,
            "units_checked": self.units_checked, "compared_with_source": self.compared_with_source,
            "levels_compared": self.levels_compared, "chunks_compared": self.chunks_compared,
            "problems": self.problems, "bad_units": [{"level": lv, "key": k} for lv, k in self.bad_units],
            "mismatches": [m.to_dict() for m in self.mismatches],
        }


def _root_attributes(path: str) -> tuple[int, dict[str, Any]]:
    if os.path.exists(os.path.join(path, "zarr.json")):
        with open(os.path.join(path, "zarr.json")) as f:
            return 3, json.load(f).get("attributes", {})
    if os.path.exists(os.path.join(path, ".zattrs")):
        with open(os.path.join(path, ".zattrs")) as f:
            return 2, json.load(f)
    raise VerificationError(f"{path!r} is not a Zarr group (no zarr.json or .zattrs).")


def _multiscales(fmt: int, attrs: dict[str, Any]) -> dict[str, Any]:
    ms = attrs.get("ome", {}).get("multiscales") if fmt == 3 else attrs.get("multiscales")
    if not ms:
        raise VerificationError("no OME-NGFF multiscales metadata: the output is unfinished or not an OME-Zarr image.")
    return ms[0]


def _compressor_from_zarr(meta: dict[str, Any], fmt: int) -> tuple[CompressorSpec, tuple[int, ...], tuple[int, ...] | None]:
    """Our compressor spec, chunks and shards, read back from an array's own metadata."""
    if fmt == 2:
        comp = meta.get("compressor")
        chunks = tuple(meta["chunks"])
        if comp is None:
            return CompressorSpec(codec="none"), chunks, None
        if comp["id"] == "blosc":
            shuffle = {0: "noshuffle", 1: "shuffle", 2: "bitshuffle"}[comp["shuffle"]]
            return CompressorSpec(codec="blosc", cname=comp["cname"], clevel=comp["clevel"], shuffle=shuffle), chunks, None
        return CompressorSpec(codec=comp["id"], clevel=comp.get("level")), chunks, None
    codecs = meta["codecs"]
    chunks = tuple(meta["chunk_grid"]["configuration"]["chunk_shape"])
    shards = None
    if codecs[0]["name"] == "sharding_indexed":
        shards = chunks
        chunks = tuple(codecs[0]["configuration"]["chunk_shape"])
        codecs = codecs[0]["configuration"]["codecs"]
    inner = [c for c in codecs if c["name"] != "bytes"]
    if not inner:
        return CompressorSpec(codec="none"), chunks, shards
    c = inner[0]
    conf = c.get("configuration", {})
    if c["name"] == "blosc":
        return CompressorSpec(codec="blosc", cname=conf["cname"], clevel=conf["clevel"], shuffle=conf["shuffle"]), chunks, shards
    return CompressorSpec(codec=c["name"], clevel=conf.get("level")), chunks, shards


def level_layout(path: str, level_path: str, fmt: int, level: int) -> ArrayLayout:
    meta_file = os.path.join(path, level_path, "zarr.json" if fmt == 3 else ".zarray")
    with open(meta_file) as f:
        meta = json.load(f)
    compressor, chunks, shards = _compressor_from_zarr(meta, fmt)
    dtype = np.dtype(meta["dtype"]).str if fmt == 2 else np.dtype(meta["data_type"] if meta["data_type"] != "bool" else "?").newbyteorder("<").str
    return ArrayLayout(os.path.join(path, level_path), tuple(meta["shape"]), chunks, shards, dtype, fmt, compressor, level, meta.get("fill_value") or 0)


def verify_output(path: str, source: tuple[str, str] | None = None, on_unit: Callable[[], None] | None = None,
                  on_total: Callable[[int], None] | None = None) -> VerifyReport:
    """Check everything; problems are collected, not raised, so the report names them all.

    With ``source``, every level is compared with the pyramid computed from it
    (``levelcheck``); levels that cannot be compared are still decoded. ``on_total(n)`` is told
    how many ``on_unit()`` calls follow (files decoded plus chunks compared)."""
    report = VerifyReport(path)
    try:
        fmt, attrs = _root_attributes(path)
        ms = _multiscales(fmt, attrs)
    except VerificationError as exc:
        report.problems.append(str(exc))
        return report
    report.complete = completion_marker(path) is not None
    if not report.complete:
        report.problems.append("no completion marker (h5ngff.complete): the conversion did not finish; re-run it to resume.")
    datasets = ms.get("datasets", [])
    report.levels = len(datasets)
    layouts = []
    for index, ds in enumerate(datasets):
        try:
            layouts.append(level_layout(path, ds["path"], fmt, index))
        except (OSError, KeyError, ValueError) as exc:
            report.problems.append(f"level {ds.get('path')}: unreadable array metadata ({exc}).")
    source_ds, compared, rule = None, [], None
    if source is not None and layouts:
        recorded = attrs.get("h5ngff", {}).get("source") if isinstance(attrs.get("h5ngff"), dict) else None
        source_ds, compared, rule = _comparable(path, ms, layouts, len(datasets), source, report, recorded)
    decoded = [lay for lay in layouts if lay not in compared]
    if on_total:
        on_total(sum(chunk_count(lay) for lay in compared) + sum(math.prod(lay.unit_grid) for lay in decoded))
    if compared:
        _compare_levels(source_ds, compared, rule, report, on_unit)
    marker = completion_marker(path) or {}
    for layout in decoded:
        _check_units(layout, report, on_unit, int((marker.get("emptyUnits") or {}).get(str(layout.level), 0)))
    _stale_temporaries(path, report)
    return report


def _comparable(path, ms, layouts, n_levels, source, report, recorded=None):
    """The source (a plain dataset or a composite: stacked, Imaris, BDV), the levels that can be
    compared with it, and the pyramid rule."""
    source_ds = dataclasses.replace(verify_source(source[0], source[1], recorded), cache_bytes=SOURCE_CACHE_BYTES)
    report.compared_with_source = True
    if layouts[0].level != 0 or tuple(source_ds.shape) != layouts[0].shape:
        report.problems.append(f"level 0 has shape {layouts[0].shape}, the source {source[0]}:{source[1]} has {tuple(source_ds.shape)}.")
        return None, [], None
    if len(layouts) < n_levels:  # some level's metadata is unreadable: only level 0 is safe to compare
        return source_ds, layouts[:1], PyramidRule("mean", (False,) * len(layouts[0].shape))
    rule = pyramid_rule(path, ms, layouts)
    if isinstance(rule, str):
        report.problems.append(rule)
        return source_ds, layouts[:1], PyramidRule("mean", (False,) * len(layouts[0].shape))
    report.levels_compared = len(layouts)
    return source_ds, layouts, rule


def _compare_levels(source_ds, layouts, rule, report: VerifyReport, on_unit) -> None:
    named = set(report.bad_units)  # a set: a wholly wrong level can name many thousand chunks

    def bad(level: int, key: str, message: str) -> None:
        if (level, key) not in named:
            named.add((level, key))
            report.bad_units.append((level, key))
        report.problems.append(message)

    walk = LevelComparison(source_ds, layouts, rule, bad, on_unit)
    walk.run()
    report.levels_compared = max(report.levels_compared, len(layouts))
    report.chunks_compared += walk.compared
    report.units_checked += sum(math.prod(lay.unit_grid) for lay in layouts)
    report.mismatches.extend(walk.mismatches)


def _check_units(layout: ArrayLayout, report: VerifyReport, on_unit, recorded_empty: int = 0) -> None:
    """Decode every unit once (levels not compared with a source). Units the writer left out as
    the fill value everywhere are absent legitimately: the completion marker records how many
    per level (``emptyUnits``); absent units beyond that count are missing."""
    absent = []
    for index in product(*(range(g) for g in layout.unit_grid)):
        report.units_checked += 1
        key = layout.key(index)
        try:
            unit = read_unit(layout, index)
        except Exception as exc:  # any decode failure is a bad chunk, whatever the codec raises
            report.bad_units.append((layout.level, key))
            report.problems.append(f"level {layout.level} {key}: does not decode ({type(exc).__name__}: {exc}).")
        else:
            if unit is None:
                absent.append(key)
        if on_unit:
            on_unit()
    if len(absent) == recorded_empty:
        return
    for key in absent:  # which of them are the empty ones is unknown without the source
        report.bad_units.append((layout.level, key))
        report.problems.append(f"level {layout.level} {key}: missing ({len(absent)} absent, {recorded_empty} recorded as the fill value everywhere; verify --source tells which).")


def _stale_temporaries(path: str, report: VerifyReport) -> None:
    for directory, _, files in os.walk(path):
        for name in files:
            if TMP_MARK in name:
                report.problems.append(f"stale temporary file {os.path.relpath(os.path.join(directory, name), path)} (an interrupted write).")
