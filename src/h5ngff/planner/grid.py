"""Slab geometry: steps, grids, regions and the greedy slab choice.

A *step* is the smallest slab extent per axis that keeps every write unit (chunk or shard) of
every level the slab builds owned by exactly one slab. Slabs are whole multiples of the step,
start on multiples of it and are only cut short at the array's far edge.
"""

from __future__ import annotations

import math
from itertools import product
from typing import Callable, Iterator

from .model import Shape


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def slab_step(unit: Shape, steps: tuple[tuple[bool, ...], ...], storage: Shape | None = None) -> Shape:
    """Per-axis step: the write unit, times 2 for every pyramid step the pass builds that halves
    the axis (``steps``: one tuple of halved axes per level built), times the storage chunk
    where given (least common multiple, so HDF5 chunks are read whole)."""
    step = tuple(u * 2 ** sum(s[axis] for s in steps) for axis, u in enumerate(unit))
    if storage is not None:
        step = tuple(math.lcm(s, h) for s, h in zip(step, storage))
    return step


def grid_shape(shape: Shape, slab: Shape) -> Shape:
    return tuple(ceil_div(n, s) for n, s in zip(shape, slab))


def clip(slab: Shape, shape: Shape) -> Shape:
    return tuple(min(s, n) for s, n in zip(slab, shape))


def region(shape: Shape, slab: Shape, index: tuple[int, ...]) -> tuple[slice, ...]:
    """The slab at grid ``index`` as slices, cut short at the array's edge."""
    return tuple(slice(i * s, min((i + 1) * s, n)) for i, s, n in zip(index, slab, shape))


def grid_indices(grid: Shape) -> Iterator[tuple[int, ...]]:
    """Slab indices in C order: the order of the HDF5 file for contiguous data."""
    return product(*(range(g) for g in grid))


def align_up(slab: Shape, step: Shape, shape: Shape) -> Shape:
    """Round a requested slab up to whole steps (never beyond the array)."""
    return clip(tuple(ceil_div(s, t) * t for s, t in zip(slab, step)), shape)


def greedy_slab(shape: Shape, step: Shape, fits: Callable[[Shape], bool], max_elements: int) -> Shape:
    """The largest whole-step slab that ``fits`` and stays under ``max_elements``.

    Grows the last axis first, then the one before it, and so on: that follows the storage order
    (whole rows of contiguous data), so each read is a few long sequential runs. An axis grows
    only once the axes after it span the whole array, because a slab that is partial along a
    later axis is not contiguous anyway.
    """
    slab = list(clip(step, shape))
    for axis in reversed(range(len(shape))):
        units = ceil_div(shape[axis], step[axis])
        low, high = 1, units  # binary search the number of steps along this axis
        while low < high:
            mid = (low + high + 1) // 2
            trial = list(slab)
            trial[axis] = min(mid * step[axis], shape[axis])
            if math.prod(trial) <= max_elements and fits(tuple(trial)):
                low = mid
            else:
                high = mid - 1
        slab[axis] = min(low * step[axis], shape[axis])
        if slab[axis] < shape[axis]:
            break
    return tuple(slab)
