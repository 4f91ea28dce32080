"""``verify --source``: every level compared with a pyramid computed from the HDF5 source, in
bounded memory.

The expected pyramid is built chunk by chunk, depth first from each chunk of the top level: a
level-k chunk is the engine's own ``downsample`` of the level-(k-1) chunks under it (2**d of
them, d = the axes that step halved: the anisotropy rule may halve different axes per level), each computed the same way from the level below, down to level-0
chunks read from the source. Every chunk of every level is computed exactly once, from the
source's values, never from the stored level below: a wrong level-0 chunk is reported at level 0
and is not blamed on the correct level-1 chunk above it. Each chunk is compared with the stored
one as soon as it is computed.

Memory held at once: per level of the recursion one block of 2**d chunks plus one chunk, so at
most ``levels * (2**d + 1) + 2`` chunks (the +2: the stored chunk being compared and its encoded
bytes), plus the downsampler's strip temporaries (``downsample.STRIP_ELEMENTS``, ~3 MiB) and the
source's HDF5 chunk cache (``SOURCE_CACHE_BYTES``). No whole level is ever loaded; sharded levels
are read one inner chunk at a time, by zarr-python (``stored.StoredLevel.read_chunk``), never with
the writer's own ``chunkio``.

Why the result equals the writer's pyramid bit for bit: chunk starts are even in the level below
(2 * c * chunk), so no 2-block straddles two of our blocks, and the only odd edge is the array's
own last voxel, where the block ends too. ``downsample`` is elementwise per 2-block, so any
tiling into whole 2-blocks gives the same bytes as the writer's slabs. This shares
``downsample`` with the writer on purpose (one rounding and edge rule); the tests check it
against an independent NumPy reference (tests/reference.py) so a shared bug cannot pass unseen.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from itertools import product
from typing import Any, Callable, Sequence

import numpy as np

from ...planner.grid import ceil_div
from ...planner.memory import STRIP_ELEMENTS
from ..write.downsample import downsample, output_shape
from .stored import ChecksumMismatch, StoredLevel

#: HDF5 chunk cache for the source while verifying: holds the HDF5 chunks under a tile of output
#: chunks, so a chunked (e.g. gzip) source is not decompressed once per output chunk it overlaps.
SOURCE_CACHE_BYTES = 64 << 20
#: Fixed allowance in ``memory_bound`` for the Python objects a verify holds besides arrays.
PYTHON_OBJECTS_BYTES = 1 << 20
_METHODS = ("mean", "nearest", "max")


@dataclass(frozen=True)
class PyramidRule:
    """How each level was built from the one below: ``method`` and the axes halved, either one
    tuple for every step or one tuple per step (``downsampled[k]``: from level k to level k+1, as
    the anisotropy rule writes them, planner.layout.HalvingRule)."""

    method: str
    downsampled: tuple[bool, ...] | tuple[tuple[bool, ...], ...]

    def step(self, level: int) -> tuple[bool, ...]:
        """The axes halved to build ``level`` (>= 1) from ``level - 1``."""
        d = self.downsampled
        if d and isinstance(d[0], tuple):
            return tuple(d[level - 1])
        return d  # type: ignore[return-value]

    def fan_in(self, levels: int) -> int:
        """The most chunks of the level below that one chunk's block holds, over the steps."""
        return max((2 ** sum(self.step(k)) for k in range(1, levels)), default=1)


@dataclass(frozen=True)
class Mismatch:
    level: int
    key: str
    chunk: tuple[int, ...]
    region: tuple[tuple[int, int], ...]
    differing: int
    voxels: int

    def to_dict(self) -> dict[str, Any]:
        return {
            "level": self.level,
            "key": self.key,
            "chunk": list(self.chunk),
            "region": [list(r) for r in self.region],
            "differing_voxels": self.differing,
            "voxels": self.voxels,
        }


def pyramid_rule(
    content: dict[str, Any], multiscale: dict[str, Any], layouts: Sequence[StoredLevel]
) -> PyramidRule | str:
    """How the levels were built (from the output's own record, ``content``: the completion
    marker's or the manifest's), or why that cannot be told."""
    method = content.get("method") or multiscale.get("type")
    if len(layouts) == 1:
        return PyramidRule(method or "mean", (False,) * len(layouts[0].shape))
    if method not in _METHODS:
        return f"cannot compare levels above 0 with the source: unknown downsampling method {method!r} (h5ngff writes {', '.join(_METHODS)})."
    recorded = content.get("downsampled")
    steps: tuple[tuple[bool, ...], ...]
    if recorded is None:  # not written by h5ngff: per step, the axes whose length changed
        steps = tuple(tuple(a != b for a, b in zip(lo.shape, hi.shape)) for lo, hi in zip(layouts, layouts[1:]))
    elif recorded and isinstance(recorded[0], list):  # one list per step (the anisotropy rule)
        if len(recorded) != len(layouts) - 1:
            return f"cannot compare levels above 0 with the source: the output records {len(recorded)} downsampling steps for {len(layouts)} levels."
        steps = tuple(tuple(bool(d) for d in step) for step in recorded)
    else:  # one list for every step (outputs written before the anisotropy rule, or a uniform rule)
        steps = (tuple(bool(d) for d in recorded),) * (len(layouts) - 1)
    for below, above, step in zip(layouts, layouts[1:], steps):
        expected = output_shape(below.shape, step)
        if above.shape != expected:
            return f"cannot compare levels above 0 with the source: level {above.level} has shape {above.shape}, 2x {method} downsampling of level {below.level} gives {expected}."
    if all(s == steps[0] for s in steps):
        return PyramidRule(method, steps[0])
    return PyramidRule(method, steps)


def chunk_count(layout: StoredLevel) -> int:
    return math.prod(ceil_div(n, c) for n, c in zip(layout.shape, layout.chunks))


class LevelComparison:
    """Walks the expected pyramid and reports every stored chunk that differs from it.

    ``bad(level, key, message)`` is told about each bad chunk; ``on_chunk()`` after each chunk
    compared (the progress bar); ``on_checksum(level, key, chunk, mismatch)`` about each chunk
    whose bytes fail their CRC32C."""

    def __init__(
        self,
        source: Any,
        layouts: Sequence[StoredLevel],
        rule: PyramidRule,
        bad: Callable[[int, str, str], None],
        on_chunk: Callable[[], None] | None = None,
        on_checksum: Callable[[int, str, tuple[int, ...], ChecksumMismatch], None] | None = None,
    ) -> None:
        self.source = source
        self.on_checksum = on_checksum
        self.layouts = layouts
        self.rule = rule
        self.bad = bad
        self.on_chunk = on_chunk
        self.broken: set[tuple[int, str]] = set()
        self.mismatches: list[Mismatch] = []
        self.compared = 0

    def run(self) -> None:
        top = self.layouts[-1]
        for chunk in product(*(range(ceil_div(n, c)) for n, c in zip(top.shape, top.chunks))):
            self.expected(top.level, chunk)

    def expected(self, level: int, chunk: tuple[int, ...]) -> np.ndarray:
        """The source's pyramid over one chunk of ``level`` (clipped at the array's edge)."""
        layout = self.layouts[level]
        region = _chunk_region(layout, chunk)
        if level == 0:
            data = np.ascontiguousarray(self.source[region], dtype=layout.dtype)
        else:
            data = downsample(self._block_below(level, chunk, region), self.rule.step(level), self.rule.method)
        self._compare(layout, chunk, region, data)
        return data

    def _block_below(self, level: int, chunk: tuple[int, ...], region: tuple[slice, ...]) -> np.ndarray:
        below = self.layouts[level - 1]
        d = self.rule.step(level)
        parent = tuple(slice(2 * r.start, min(2 * r.stop, n)) if di else r for r, di, n in zip(region, d, below.shape))
        block = np.empty(tuple(p.stop - p.start for p in parent), dtype=below.dtype)
        grid = tuple(ceil_div(n, c) for n, c in zip(below.shape, below.chunks))
        children = [[2 * c, 2 * c + 1] if di else [c] for c, di in zip(chunk, d)]
        for child in product(*([i for i in ids if i < g] for ids, g in zip(children, grid))):
            cregion = _chunk_region(below, child)
            local = tuple(slice(r.start - p.start, r.stop - p.start) for r, p in zip(cregion, parent))
            block[local] = self.expected(level - 1, child)
        return block

    def _compare(
        self, layout: StoredLevel, chunk: tuple[int, ...], region: tuple[slice, ...], expected: np.ndarray
    ) -> None:
        self.compared += 1
        unit = _unit_of(layout, chunk)
        key = layout.key(unit)
        try:
            if (layout.level, key) in self.broken:
                return  # its file is missing or its shard index broken: said once, not per inner chunk
            if layout.missing(unit):
                return self._bad(layout.level, key, "missing.", broken=True)
            try:
                # An absent chunk of a finished output reads as the fill value (a skipped all-fill
                # chunk), and is compared as such.
                stored = layout.read_chunk(chunk)
            except Exception as exc:  # any decode failure is a bad chunk, whatever the codec raises
                self._unreadable(layout, unit, key, chunk, exc)
                if not (isinstance(exc, ChecksumMismatch) and layout.recorded is not None):
                    return
                # A Zarr v2 file that fails its sidecar CRC may still decode: say how it differs too.
                stored = layout.read_chunk(chunk, check=False)
            # Only a chunk that reads as the fill value everywhere can be absent, so the store is
            # asked (a stat, or a HEAD on a bucket) for those alone, not for every chunk compared.
            if (
                not _all_fill(expected, layout.fill_value)
                and _reads_as_fill(stored, layout.fill_value)
                and not layout.exists(unit)
            ):
                return self._bad(layout.level, key, "missing.", broken=True)
            self._differences(layout, key, chunk, region, stored, expected)
        finally:
            if self.on_chunk:
                self.on_chunk()

    def _unreadable(
        self, layout: StoredLevel, unit: tuple[int, ...], key: str, chunk: tuple[int, ...], exc: Exception
    ) -> None:
        index = layout.index_problem(unit)
        if index is not None:
            return self._bad(layout.level, key, index, broken=True)
        where = key if layout.shards is None else f"{key}, inner chunk {_inner(layout, chunk)} (chunk {chunk})"
        if isinstance(exc, ChecksumMismatch):
            if self.on_checksum:
                self.on_checksum(layout.level, key, chunk, exc)
            return self.bad(layout.level, key, f"level {layout.level} {where}: {exc}")
        # An unsharded chunk is its own file: said once. In a shard the other chunks are still read.
        self.bad(layout.level, key, f"level {layout.level} {where}: does not decode ({type(exc).__name__}: {exc}).")
        if layout.shards is None:
            self.broken.add((layout.level, key))

    def _differences(
        self,
        layout: StoredLevel,
        key: str,
        chunk: tuple[int, ...],
        region: tuple[slice, ...],
        stored: np.ndarray,
        expected: np.ndarray,
    ) -> None:
        view = tuple(slice(0, r.stop - r.start) for r in region)
        # Compared bitwise, so NaN equals the same NaN and -0.0 differs from 0.0.
        bits = np.dtype(f"u{expected.dtype.itemsize}")
        differ = np.ascontiguousarray(stored[view]).view(bits) != np.ascontiguousarray(expected).view(bits)
        count = int(np.count_nonzero(differ))
        if not count:
            return
        first = tuple(int(i) for i in np.argwhere(differ)[0])
        ranges = tuple((r.start, r.stop) for r in region)
        where = f"{key}" if layout.shards is None else f"{key}, inner chunk {_inner(layout, chunk)}"
        self.mismatches.append(Mismatch(layout.level, key, chunk, ranges, count, int(differ.size)))
        voxel = tuple(r.start + i for r, i in zip(region, first))
        self._bad(
            layout.level,
            key,
            f"differs from the source in chunk {chunk} ({where}), voxels {[list(r) for r in ranges]} of level "
            f"{layout.level} (compared with the pyramid computed from the source): {count} of {differ.size} voxels "
            f"differ; first at {voxel}: stored {stored[view][first].item()!r}, expected {expected[first].item()!r}.",
        )

    def _bad(self, level: int, key: str, message: str, broken: bool = False) -> None:
        if broken:
            self.broken.add((level, key))
        self.bad(level, key, f"level {level} {key}: {message}")


def _inner(layout: StoredLevel, chunk: tuple[int, ...]) -> tuple[int, ...]:
    """A chunk's index inside its shard."""
    assert layout.shards is not None  # only a sharded level has inner chunks
    return tuple(c % (s // k) for c, s, k in zip(chunk, layout.shards, layout.chunks))


def _all_fill(expected: np.ndarray, fill: Any) -> bool:
    """Whether the source says this chunk is the fill value everywhere, bit for bit: the writer
    leaves such a chunk out (only for a zero fill value), so its absence is legitimate. Written
    here, not imported from the writer, so that verify shares no code with what it checks."""
    return not fill and not np.ascontiguousarray(expected).view(np.uint8).any()


def _reads_as_fill(stored: np.ndarray, fill: Any) -> bool:
    """Whether a decoded chunk is the fill value everywhere (NaN fill included), as an absent
    chunk reads."""
    return np.array_equal(stored, np.full_like(stored, fill), equal_nan=np.issubdtype(stored.dtype, np.inexact))


def _chunk_region(layout: StoredLevel, chunk: tuple[int, ...]) -> tuple[slice, ...]:
    return tuple(slice(i * c, min((i + 1) * c, n)) for i, c, n in zip(chunk, layout.chunks, layout.shape))


def _unit_of(layout: StoredLevel, chunk: tuple[int, ...]) -> tuple[int, ...]:
    """The index of the file (chunk, or the shard holding it) that stores ``chunk``."""
    if layout.shards is None:
        return chunk
    return tuple(c // (s // k) for c, s, k in zip(chunk, layout.shards, layout.chunks))


def memory_bound(layouts: Sequence[StoredLevel], rule: PyramidRule) -> int:
    """Bytes ``LevelComparison`` holds at most (besides the interpreter), as the module says:
    per level one block of 2**d chunks plus its result, four chunk-sized buffers for the compare
    (source read and its cast, the encoded and decoded stored chunk), the downsampler's float64
    and integer-rounding temporaries (at most 10 eight-byte values per output element of a
    strip), the source's HDF5 chunk cache, and a fixed allowance for the walk's Python objects
    (array metadata, h5py handles; measured flat at ~0.35 MiB from 6 to 24 MiB volumes)."""
    chunk = layouts[0].chunks
    chunk_bytes = math.prod(chunk) * np.dtype(layouts[0].dtype).itemsize
    fan_in = rule.fan_in(len(layouts))
    blocks = len(layouts) * (fan_in + 1) + 4
    strip = 10 * 8 * min(STRIP_ELEMENTS, math.prod(chunk))
    return blocks * chunk_bytes + strip + SOURCE_CACHE_BYTES + PYTHON_OBJECTS_BYTES
