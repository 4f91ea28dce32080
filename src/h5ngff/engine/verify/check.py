"""``h5ngff verify``: check an output's metadata, its completion marker, its checksums and every
chunk, and optionally compare every level with the pyramid computed from the HDF5 source
(``levelcheck``), streaming one chunk or write unit at a time so memory stays bounded whatever
the image size.

Everything is decoded by zarr-python (``engine.verify.stored``): the root attributes and each level's
array metadata, read through the store's zarr view (``Store.as_zarr_store()``), and every chunk,
its bytes read through the output's Store and decoded by zarr's codecs and checked by its crc32c
codec. None of the writer's own chunk code (``chunkio``) is used, so a bug shared by the
writer's encoder and decoder cannot pass (tests/test_checksums.py injects one). A directory and a
bucket go the same way.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from itertools import product
from typing import Any, Callable

import zarr

from ...errors import VerificationError
from ...spec import source_options_from_output
from ..write.checksums import SIDECAR_DIR, load_sidecar, sidecar_key
from .levelcheck import SOURCE_CACHE_BYTES, LevelComparison, Mismatch, PyramidRule, chunk_count, pyramid_rule
from ..write.manifest import Manifest
from ..sources import verify_source
from .stored import ChecksumMismatch, StoredLevel, open_levels
from ..stores import Store, open_object_reader, open_store


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
    #: How chunk bytes are checked: "crc32c codec" (Zarr v3), "sidecar" (Zarr v2) or "none".
    checksums: str = "none"
    #: Every chunk whose bytes fail their CRC32C: level, key, chunk, expected and actual CRC.
    checksum_mismatches: list[dict[str, Any]] = field(default_factory=list)
    #: The library that validated the OME-NGFF metadata (None: not installed, not validated).
    metadata_validator: str | None = None

    @property
    def ok(self) -> bool:
        return not self.problems and not self.bad_units

    def to_dict(self) -> dict[str, Any]:
        return {
            "path": self.path,
            "ok": self.ok,
            "complete": self.complete,
            "levels": self.levels,
            "units_checked": self.units_checked,
            "compared_with_source": self.compared_with_source,
            "levels_compared": self.levels_compared,
            "chunks_compared": self.chunks_compared,
            "checksums": self.checksums,
            "metadata_validator": self.metadata_validator,
            "problems": self.problems,
            "bad_units": [{"level": lv, "key": k} for lv, k in self.bad_units],
            "mismatches": [m.to_dict() for m in self.mismatches],
            "checksum_mismatches": self.checksum_mismatches,
        }

    def bad(self, level: int, key: str, message: str) -> None:
        if (level, key) not in self._named:
            self._named.add((level, key))
            self.bad_units.append((level, key))
        self.problems.append(message)

    def checksum(self, level: int, key: str, chunk: tuple[int, ...] | None, mismatch: ChecksumMismatch) -> None:
        self.checksum_mismatches.append(
            {
                "level": level,
                "key": key,
                "chunk": None if chunk is None else list(chunk),
                "expected": mismatch.expected,
                "actual": mismatch.actual,
            }
        )

    def __post_init__(self) -> None:
        # A set beside the list: a wholly wrong level can name many thousand chunks.
        self._named: set[tuple[int, str]] = set()


def _root(root: Any, path: str) -> tuple[int, dict[str, Any]]:
    """The root group's Zarr format and attributes, as zarr-python reads them."""
    try:
        group = zarr.open_group(root, mode="r")
    except Exception:  # zarr raises several types for "no group here"
        raise VerificationError(f"{path!r} is not a Zarr group (no zarr.json or .zattrs).") from None
    return group.metadata.zarr_format, dict(group.attrs)


def _multiscales(fmt: int, attrs: dict[str, Any]) -> dict[str, Any]:
    ms = attrs.get("ome", {}).get("multiscales") if fmt == 3 else attrs.get("multiscales")
    if not ms:
        raise VerificationError("no OME-NGFF multiscales metadata: the output is unfinished or not an OME-Zarr image.")
    first: dict[str, Any] = ms[0]
    return first


def _validate_metadata(root: Any, fmt: int, report: VerifyReport) -> None:
    """Validate the NGFF metadata with ome-zarr-models where it is installed (a test and dev
    dependency, ~1 s to import); without it, verify checks only what it reads."""
    try:
        import ome_zarr_models
        from ome_zarr_models import v04, v05
    except ImportError:
        return
    report.metadata_validator = f"ome-zarr-models {getattr(ome_zarr_models, '__version__', '')}".strip()
    try:
        (v05 if fmt == 3 else v04).Image.from_zarr(zarr.open_group(root, mode="r"))
    except Exception as exc:
        report.problems.append(
            f"the OME-NGFF metadata does not validate with {report.metadata_validator}: {str(exc)[:500]}"
        )


def _content(store: Store, marker: dict[str, Any] | None) -> dict[str, Any]:
    """What the writer recorded about the conversion: from the completion marker, else the manifest."""
    recorded = marker.get("content") if marker else None
    if isinstance(recorded, dict):
        return recorded
    manifest = Manifest.load(store)
    return manifest.content if manifest is not None else {}


def _sidecars(
    store: Store, fmt: int, content: dict[str, Any], n_levels: int, report: VerifyReport
) -> dict[int, dict[str, str] | None] | None:
    """Zarr v2: every level's recorded CRC32Cs, where the conversion kept them. They are written
    at completion, so an unfinished output (already reported) is not checked against them."""
    if fmt != 2 or content.get("checksums") != "crc32c" or not report.complete:
        return None
    report.checksums = "sidecar"
    sidecars: dict[int, dict[str, str] | None] = {}
    for level in range(n_levels):
        name = sidecar_key(level)
        try:
            sidecars[level] = load_sidecar(store, level)
        except ValueError as exc:
            sidecars[level] = None
            report.problems.append(f"{exc}: level {level}'s chunk files cannot be checked against their checksums.")
            continue
        if sidecars[level] is None:
            report.problems.append(
                f"no checksum sidecar {name}: the conversion recorded one, so level {level}'s chunk files cannot be checked. "
                f"Restore {SIDECAR_DIR}/ from the original output, or re-convert."
            )
    return sidecars


def zarr_root(path: str, storage_options: dict[str, str] | None = None) -> Any:
    """What zarr-python opens: the output store's read-only zarr view (``Store.as_zarr_store``:
    the directory, or zarr's ObjectStore over the same client the writer used, with the same
    options, endpoint and credentials)."""
    return open_store(path, storage_options or {}).as_zarr_store()


def verify_output(
    path: str,
    source: tuple[str, str] | None = None,
    on_unit: Callable[[], None] | None = None,
    on_total: Callable[[int], None] | None = None,
    storage_options: dict[str, str] | None = None,
    source_options: dict[str, str] | None = None,
) -> VerifyReport:
    """Check everything; problems are collected, not raised, so the report names them all.

    With ``source``, every level is compared with the pyramid computed from it
    (``levelcheck``); levels that cannot be compared are still decoded. ``on_total(n)`` is told
    how many ``on_unit()`` calls follow (files decoded plus chunks compared). A source in a bucket
    is read with ``source_options`` (default: an s3:// output's ``storage_options``)."""
    report = VerifyReport(path)
    store = open_store(path, storage_options or {})
    root = store.as_zarr_store()
    try:
        fmt, attrs = _root(root, path)
        ms = _multiscales(fmt, attrs)
    except VerificationError as exc:
        report.problems.append(str(exc))
        return report
    marker = attrs.get("h5ngff") if isinstance(attrs.get("h5ngff"), dict) else None
    report.complete = bool(marker and marker.get("complete"))
    if not report.complete:
        report.problems.append(
            "no completion marker (h5ngff.complete): the conversion did not finish; re-run it to resume."
        )
    _validate_metadata(root, fmt, report)
    content = _content(store, marker)
    datasets = ms.get("datasets", [])
    report.levels = len(datasets)
    sidecars = _sidecars(store, fmt, content, len(datasets), report)
    levels, problems = open_levels(root, store, ms, report.complete, sidecars)
    report.problems.extend(problems)
    if fmt == 3 and levels and all(lv.crc_codec for lv in levels):
        report.checksums = "crc32c codec"
    source_ds: Any = None
    compared: list[StoredLevel] = []
    rule: PyramidRule | None = None
    if source is not None and levels:
        recorded = marker.get("source") if marker else None
        if source_options is None:
            source_options = source_options_from_output(path, storage_options)
        source_ds, compared, rule = _comparable(
            ms, levels, len(datasets), source, report, content, recorded, source_options
        )
    decoded = [lv for lv in levels if lv not in compared]
    if on_total:
        on_total(sum(chunk_count(lv) for lv in compared) + sum(math.prod(lv.unit_grid) for lv in decoded))
    if compared and rule is not None:  # (a rule comes with every compared level)
        _compare_levels(source_ds, compared, rule, report, on_unit)
    empty_units = marker.get("emptyUnits") if marker else None
    for level in decoded:
        recorded_empty = None if not isinstance(empty_units, dict) else int(empty_units.get(str(level.level), 0))
        _check_units(level, report, on_unit, recorded_empty)
    _stale_temporaries(store, report)
    return report


def _comparable(
    ms: dict[str, Any],
    levels: list[StoredLevel],
    n_levels: int,
    source: tuple[str, str],
    report: VerifyReport,
    content: dict[str, Any],
    recorded: dict[str, Any] | None = None,
    source_options: dict[str, str] | None = None,
) -> tuple[Any, list[StoredLevel], PyramidRule | None]:
    """The source (a plain dataset or a composite: stacked, Imaris, BDV), the levels that can be
    compared with it, and the pyramid rule."""
    opened = verify_source(source[0], source[1], recorded, open_object_reader, source_options)
    source_ds = dataclasses.replace(opened, cache_bytes=SOURCE_CACHE_BYTES)
    report.compared_with_source = True
    if levels[0].level != 0 or tuple(source_ds.shape) != levels[0].shape:
        report.problems.append(
            f"level 0 has shape {levels[0].shape}, the source {source[0]}:{source[1]} has {tuple(source_ds.shape)}."
        )
        return None, [], None
    if len(levels) < n_levels:  # some level's metadata is unreadable: only level 0 is safe to compare
        return source_ds, levels[:1], PyramidRule("mean", (False,) * len(levels[0].shape))
    rule = pyramid_rule(content, ms, levels)
    if isinstance(rule, str):
        report.problems.append(rule)
        return source_ds, levels[:1], PyramidRule("mean", (False,) * len(levels[0].shape))
    report.levels_compared = len(levels)
    return source_ds, levels, rule


def _compare_levels(
    source_ds: Any,
    levels: list[StoredLevel],
    rule: PyramidRule,
    report: VerifyReport,
    on_unit: Callable[[], None] | None,
) -> None:
    walk = LevelComparison(source_ds, levels, rule, report.bad, on_unit, on_checksum=report.checksum)
    walk.run()
    report.levels_compared = max(report.levels_compared, len(levels))
    report.chunks_compared += walk.compared
    report.units_checked += sum(math.prod(lv.unit_grid) for lv in levels)
    report.mismatches.extend(walk.mismatches)


def _check_units(
    level: StoredLevel, report: VerifyReport, on_unit: Callable[[], None] | None, recorded_empty: int | None = None
) -> None:
    """Decode every chunk of every unit once (levels not compared with a source), one chunk at a
    time: every bad inner chunk of a shard is named, not just the first.

    Units the writer left out as the fill value everywhere are absent legitimately: the completion
    marker records how many per level (``emptyUnits``); absent units beyond that count are
    missing. (None: a marker from before the count, whose absent units are all accepted.)"""
    absent = []
    for unit in product(*(range(g) for g in level.unit_grid)):
        report.units_checked += 1
        key = level.key(unit)
        if level.missing(unit):
            report.bad(level.level, key, f"level {level.level} {key}: missing.")
        elif recorded_empty is not None and not level.exists(unit):
            absent.append(key)
        elif (index := level.index_problem(unit)) is not None:
            report.bad(level.level, key, f"level {level.level} {key}: {index}")
        else:
            for chunk in level.inner_chunks(unit):
                try:
                    level.read_chunk(chunk)
                except Exception as exc:  # any decode failure is a bad chunk, whatever the codec raises
                    _chunk_failed(level, key, chunk, exc, report)
        if on_unit:
            on_unit()
    if recorded_empty is None or len(absent) == recorded_empty:
        return
    for key in absent:  # which of them are the empty ones is unknown without the source
        report.bad(
            level.level,
            key,
            f"level {level.level} {key}: missing ({len(absent)} absent, {recorded_empty} recorded as the fill value everywhere; verify --source tells which).",
        )


def _chunk_failed(level: StoredLevel, key: str, chunk: tuple[int, ...], exc: Exception, report: VerifyReport) -> None:
    where = key
    if level.shards is not None:
        where = f"{key}, inner chunk {tuple(c % (s // k) for c, s, k in zip(chunk, level.shards, level.chunks))} (chunk {chunk})"
    if isinstance(exc, ChecksumMismatch):
        report.checksum(level.level, key, chunk, exc)
        report.bad(level.level, key, f"level {level.level} {where}: {exc}")
    else:
        report.bad(level.level, key, f"level {level.level} {where}: does not decode ({type(exc).__name__}: {exc}).")


def _stale_temporaries(store: Store, report: VerifyReport) -> None:
    """What killed writers left (a directory's temporary files; a bucket's objects are written
    whole, so it has none)."""
    for key in store.leftovers():
        report.problems.append(f"stale temporary file {key} (an interrupted write).")
