"""Axes, units, chunks and pyramid levels: the parts of a plan that follow from the spec and the
dataset's shape alone."""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..errors import SpecError
from ..spec import AXIS_TYPES, SPACE_UNITS, TIME_UNITS, ConversionSpec
from .grid import ceil_div
from .model import DatasetInfo, Level, Shape

DEFAULT_AXES = {2: "yx", 3: "zyx", 4: "czyx", 5: "tczyx"}
#: Default chunk edge per spatial axis: 64**3 float32 is 1 MiB, a good object size for both
#: local disks and object stores; 2-D images get 256**2 for the same reason.
DEFAULT_SPATIAL_CHUNK = {2: 256, 3: 64}
#: ``levels: auto`` never builds more than this many levels.
MAX_AUTO_LEVELS = 10


def resolve_axes(spec: ConversionSpec, ds: DatasetInfo) -> str:
    if not 2 <= ds.ndim <= 5:
        raise SpecError(
            "source.dataset",
            f"Expected a dataset with 2 to 5 dimensions (NGFF images are yx to tczyx). Got {ds.ndim} dimension(s), shape {ds.shape}, instead.",
        )
    axes = spec.image.axes or ds.attr_axes or DEFAULT_AXES[ds.ndim]
    if len(axes) != ds.ndim:
        field = "image.axes" if spec.image.axes else "source.dataset"
        raise SpecError(
            field,
            f"Expected {ds.ndim} axes for a dataset of shape {ds.shape}. Got {axes!r} ({len(axes)} axes) instead.",
        )
    return axes


def resolve_scale_units(spec: ConversionSpec, ds: DatasetInfo, axes: str) -> tuple[tuple[float, ...], tuple[str, ...]]:
    n = len(axes)
    scale = tuple(spec.image.scale) if spec.image.scale else ds.attr_scale or (1.0,) * n
    if len(scale) != n:
        raise SpecError("image.scale", f"Expected {n} voxel sizes, one per axis {axes!r}. Got {list(scale)} instead.")
    if spec.image.units and len(spec.image.units) == 1 and n > 1 and spec.image.units[0] in SPACE_UNITS:
        # One space unit names the unit of every spatial axis (``--units micrometer``); time and
        # channel axes get none.
        units = tuple(spec.image.units[0] if AXIS_TYPES[a] == "space" else "" for a in axes)
    elif spec.image.units:
        units = tuple(spec.image.units)
    elif ds.attr_units:
        units = ds.attr_units
    else:
        units = tuple("" for _ in axes)
    if len(units) != n:
        raise SpecError("image.units", f"Expected {n} units, one per axis {axes!r}. Got {list(units)} instead.")
    for axis, unit in zip(axes, units):
        allowed = SPACE_UNITS if AXIS_TYPES[axis] == "space" else TIME_UNITS if axis == "t" else ()
        if unit and unit not in allowed:
            raise SpecError(
                "image.units",
                f"Expected a {AXIS_TYPES[axis]} unit for axis {axis!r} (or '' for none). Got {unit!r} instead.",
            )
    return scale, units


def resolve_chunks(spec: ConversionSpec, ds: DatasetInfo, axes: str) -> tuple[Shape, Shape | None]:
    n = ds.ndim
    if spec.output.chunks is not None:
        chunks = tuple(spec.output.chunks)
        if len(chunks) != n:
            raise SpecError(
                "output.chunks", f"Expected {n} entries, one per axis {axes!r}. Got {list(chunks)} instead."
            )
    else:
        spatial = sum(AXIS_TYPES[a] == "space" for a in axes)
        edge = DEFAULT_SPATIAL_CHUNK[spatial]
        chunks = tuple(edge if AXIS_TYPES[a] == "space" else 1 for a in axes)
    shards = None
    if spec.output.shards is not None:
        shards = tuple(spec.output.shards)
        if len(shards) != n:
            raise SpecError(
                "output.shards", f"Expected {n} entries, one per axis {axes!r}. Got {list(shards)} instead."
            )
        # Check against the chunks as asked for, before they are clipped to the array below.
        bad = [i for i, (s, c) in enumerate(zip(shards, chunks)) if s % c]
        if bad:
            raise SpecError(
                "output.shards",
                f"Expected multiples of the chunk shape {list(chunks)} on every axis. Got {list(shards)} instead (axis {axes[bad[0]]!r}).",
            )
        # A chunk clipped to the array holds the whole axis, so its shard holds exactly that chunk.
        shards = tuple(s if c <= size else size for s, c, size in zip(shards, chunks, ds.shape))
    # A chunk larger than the array only pads the stored chunk with fill value.
    chunks = tuple(min(c, s) for c, s in zip(chunks, ds.shape))
    return chunks, shards


def clipped_notices(spec: ConversionSpec, ds: DatasetInfo, chunks: Shape, shards: Shape | None) -> list[str]:
    """Notices for chunks and shards the user asked for that ``resolve_chunks`` clipped to the
    array, as slab re-alignment is noticed: a silent change of a requested shape surprises."""
    notices = []
    for name, asked, got in (("chunks", spec.output.chunks, chunks), ("shards", spec.output.shards, shards)):
        if asked is not None and got is not None and tuple(asked) != tuple(got):
            notices.append(
                f"output.{name} {tuple(asked)} became {tuple(got)}: the array's shape is {tuple(ds.shape)}, and a "
                f"{name[:-1]} holds at most the whole axis (a larger one would only store fill values)."
            )
    return notices


def resolve_downsampled(spec: ConversionSpec, axes: str) -> tuple[bool, ...]:
    if spec.pyramid.axes is None:
        return tuple(AXIS_TYPES[a] == "space" for a in axes)
    missing = [a for a in spec.pyramid.axes if a not in axes]
    if missing:
        raise SpecError(
            "pyramid.axes",
            f"Expected axes present in the image axes {axes!r}. Got {spec.pyramid.axes!r} instead ({missing[0]!r} is not an image axis).",
        )
    return tuple(a in spec.pyramid.axes for a in axes)


#: Two voxel sizes whose relative difference is below this count as equal for the anisotropy
#: rule (scales read from a file are often 0.30000001 against 0.3).
SCALE_TOLERANCE = 1e-6

#: ``steps[k]``: per axis, whether going from level k to level k+1 halves it.
Steps = tuple[tuple[bool, ...], ...]


@dataclass(frozen=True)
class HalvingRule:
    """Which axes each pyramid step halves.

    ``candidates`` are the axes the pyramid may halve (the spatial ones, or ``pyramid.axes``). By
    default (``by_scale``) a step halves only the candidates whose current voxel size (the level's
    scale) is finer than the coarsest candidate's, within ``SCALE_TOLERANCE``; once they are all
    equal it halves them all. So z at 4x the size of y and x keeps its planes for two levels while
    y and x catch up, as bioformats2raw and ome-zarr-py do, and then all three halve together.
    Without voxel sizes (all 1) every candidate halves at every step, as before. A user's
    ``pyramid.axes`` turns the rule off: those axes halve at every step (``by_scale`` False).
    """

    candidates: tuple[bool, ...]
    scale: tuple[float, ...]
    by_scale: bool = True

    def steps(self, n_steps: int) -> Steps:
        current = list(self.scale)
        steps = []
        for _ in range(n_steps):
            step = halved_axes(self.candidates, current) if self.by_scale else self.candidates
            steps.append(step)
            current = [s * 2 if d else s for s, d in zip(current, step)]
        return tuple(steps)


def halved_axes(candidates: tuple[bool, ...], scale: list[float] | tuple[float, ...]) -> tuple[bool, ...]:
    """The anisotropy rule for one step (see ``HalvingRule``)."""
    sizes = [abs(s) for s, d in zip(scale, candidates) if d]
    if not sizes or not all(math.isfinite(s) and s > 0 for s in sizes):
        return candidates  # no usable voxel sizes: halve every candidate
    coarsest = max(sizes)
    finer = tuple(bool(d and abs(s) * (1 + SCALE_TOLERANCE) < coarsest) for s, d in zip(scale, candidates))
    return finer if any(finer) else candidates


def halving_rule(spec: ConversionSpec, axes: str, scale: tuple[float, ...]) -> HalvingRule:
    return HalvingRule(resolve_downsampled(spec, axes), tuple(scale), by_scale=spec.pyramid.axes is None)


def level_shapes(shape: Shape, steps: Steps) -> list[Shape]:
    """Each step halves its axes, rounding up: the last, partial block of an odd axis becomes
    one voxel of its own (see docs/memory-model.md, "edge policy"). ``len(steps) + 1`` levels."""
    shapes = [shape]
    for step in steps:
        shapes.append(tuple(ceil_div(s, 2) if d else s for s, d in zip(shapes[-1], step)))
    return shapes


def auto_levels(shape: Shape, chunks: Shape, rule: HalvingRule) -> int:
    """Halve until the smallest level fits in one chunk along every axis the pyramid halves (every
    candidate of ``rule``). An axis the anisotropy rule is not halving yet still counts: its turn
    comes once the finer axes have caught up with its voxel size, so levels go on until it fits
    too (and never beyond ``MAX_AUTO_LEVELS``). Axes no step halves (t, c) never count."""
    if not any(rule.candidates):
        return 1
    n = 1
    current = shape
    while n < MAX_AUTO_LEVELS and any(d and s > c for s, c, d in zip(current, chunks, rule.candidates)):
        step = rule.steps(n)[-1]
        current = tuple(ceil_div(s, 2) if d else s for s, d in zip(current, step))
        n += 1
    return n


def resolve_levels(spec: ConversionSpec, shape: Shape, chunks: Shape, rule: HalvingRule) -> int:
    levels = spec.pyramid.levels
    if levels == "auto":
        return auto_levels(shape, chunks, rule)
    if levels > 1 and not any(rule.candidates):
        raise SpecError(
            "pyramid.levels",
            f"Expected 1 when no axis is downsampled. Got {levels} instead; set pyramid.axes to spatial axes.",
        )
    shapes = level_shapes(shape, rule.steps(levels - 1))
    useful = next((k + 1 for k, s in enumerate(shapes) if all(n == 1 for n, d in zip(s, rule.candidates) if d)), levels)
    if levels > useful:
        raise SpecError(
            "pyramid.levels",
            f"Expected at most {useful} levels for shape {shape}: level {useful - 1} is already one voxel along every downsampled axis. Got {levels} instead.",
        )
    return levels


def _decimal(x: float) -> float:
    """``x`` to 12 significant digits: 0.5 * 3 * 0.1 is 0.15000000000000002 in binary, which the
    metadata would show as written; voxel sizes carry nowhere near 12 digits."""
    return float(f"{x:.12g}")


def build_levels(shape: Shape, scale: tuple[float, ...], steps: Steps, method: str) -> tuple[Level, ...]:
    """``len(steps) + 1`` levels. A level's factors are the product of the halvings of the steps
    below it, per axis, and its scale is level 0's times them. For ``mean`` and ``max`` a level-k
    voxel covers a block of that many level-0 voxels per axis, so its centre moves by
    (factor - 1) / 2 voxels of level 0; ``nearest`` keeps the first voxel of each block, so it
    does not move."""
    levels = []
    factors = tuple(1 for _ in shape)
    for k, lshape in enumerate(level_shapes(shape, steps)):
        if k:
            factors = tuple(f * 2 if d else f for f, d in zip(factors, steps[k - 1]))
        lscale = tuple(_decimal(s * f) for s, f in zip(scale, factors))
        shift = 0.0 if method == "nearest" else 0.5
        translation = tuple(_decimal(shift * (f - 1) * s) for s, f in zip(scale, factors))
        levels.append(Level(k, lshape, factors, lscale, translation))
    return tuple(levels)


def level_steps(levels: tuple[Level, ...] | list[Level]) -> Steps:
    """The steps a pyramid's levels were built with, read back from their factors."""
    return tuple(tuple(b > a for a, b in zip(lo.factors, hi.factors)) for lo, hi in zip(levels, levels[1:]))


def step_reduction(step: tuple[bool, ...]) -> int:
    """Element count reduction of one step: 4 when it halves y and x, 8 for z, y and x."""
    return 1 << sum(step)


def elements(shape: Shape) -> int:
    return math.prod(shape)
