"""Exact 2x downsampling along chosen axes: ``mean``, ``nearest`` and ``max``.

Edge policy: an axis of odd length n becomes ceil(n / 2); its last output voxel comes from the
single remaining input voxel (``mean`` divides by the voxels that exist, never by padding).

``mean`` is exact:

* floats are summed in float64 and divided by the voxel count (a power of two, so the division
  is exact); the one rounding is the cast back to the input dtype;
* integers are summed exactly in integer arithmetic (64-bit inputs in two 32-bit halves) and
  rounded half to even, which is what ``np.rint`` of the float64 mean gives wherever float64 can
  hold the sum exactly; bool is treated as 0/1 and ties go to False.

NaN propagates through ``mean`` and ``max`` as one canonical quiet NaN (positive, no payload):
which of two NaN operands an addition returns, and the sign of the NaN that inf - inf makes,
depend on numpy's loop for the arrays' layout and on the CPU, so the writer's slabs and
``verify``'s chunks once disagreed in a NaN's sign bit (found by tests/test_engine_properties.py).
``nearest`` keeps the first voxel of each block, NaN payload and all. Each level is computed from
the previous one, so a level built from a written level in a later pass is bit-identical to one
built inside the first pass.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from itertools import product

import numpy as np
import numpy.typing as npt

from ...planner.memory import STRIP_ELEMENTS as STRIP_ELEMENTS  # re-exported: levelcheck reads it here

# Output elements are computed STRIP_ELEMENTS at a time (defined in the planner, which prices it).
# Pairwise sums along the first downsampled axis hold 4 then 2 float64 values per output element,
# plus rounding temporaries for integers: about six 8-byte values (planner.memory.STRIP_TEMPORARIES),
# so a block costs ~3 MiB.


def output_shape(shape: tuple[int, ...], downsampled: tuple[bool, ...]) -> tuple[int, ...]:
    return tuple(-(-n // 2) if d else n for n, d in zip(shape, downsampled))


def _output_blocks(shape: tuple[int, ...], limit: int) -> Iterator[tuple[slice, ...]]:
    """Output regions of at most ``limit`` elements, split from the first axis on."""
    block = list(shape)
    for axis in range(len(shape)):
        if math.prod(block) <= limit:
            break
        block[axis] = max(1, limit // math.prod(block[axis + 1 :]))
    for index in product(*(range(0, n, b) for n, b in zip(shape, block))):
        yield tuple(slice(i, min(i + b, n)) for i, b, n in zip(index, block, shape))


def downsample(
    block: np.ndarray, downsampled: tuple[bool, ...], method: str, out: np.ndarray | None = None
) -> np.ndarray:
    """The next level of ``block``, written into ``out`` when given (it must have the output shape)."""
    if not any(downsampled):
        return block
    if out is None:
        out = np.empty(output_shape(block.shape, downsampled), dtype=block.dtype)
    if method == "nearest":
        out[...] = block[tuple(slice(None, None, 2) if d else slice(None) for d in downsampled)]
        return out
    if method not in ("mean", "max"):
        raise ValueError(f"unknown downsampling method {method!r}")
    for dst in _output_blocks(out.shape, STRIP_ELEMENTS):
        src = tuple(
            slice(2 * r.start, min(2 * r.stop, n)) if d else r for r, d, n in zip(dst, downsampled, block.shape)
        )
        out[dst] = _reduce(block[src], downsampled, method)  # the one cast back to the dtype
    if out.dtype.kind == "f":
        _canonical_nan(out)
    return out


def _canonical_nan(a: np.ndarray) -> None:
    """Every NaN in ``a`` becomes the one positive quiet NaN (see the module's docstring)."""
    nan = np.isnan(a)
    if nan.any():
        a[nan] = np.nan


def _pair(a: np.ndarray, axis: int, op: np.ufunc, dtype: npt.DTypeLike) -> np.ndarray:
    """Combine neighbours 2i and 2i+1 along ``axis`` (a lone last element passes through)."""
    n = a.shape[axis]
    full = n // 2

    def at(s: slice) -> tuple[slice, ...]:
        return (slice(None),) * axis + (s,)

    shape = list(a.shape)
    shape[axis] = -(-n // 2)
    out = np.empty(shape, dtype=dtype)
    op(a[at(slice(0, 2 * full, 2))], a[at(slice(1, 2 * full, 2))], out=out[at(slice(0, full))], dtype=dtype)
    if n % 2:
        out[at(slice(full, full + 1))] = a[at(slice(n - 1, n))]
    return out


def _pairwise(block: np.ndarray, downsampled: tuple[bool, ...], op: np.ufunc, dtype: npt.DTypeLike) -> np.ndarray:
    """Reduce 2-blocks one axis at a time, outermost first: the first step combines whole
    contiguous planes (fast, vectorised), and each step halves the data the next one reads."""
    a = block
    for axis, d in enumerate(downsampled):
        if d:
            a = _pair(a, axis, op, dtype)
    return a


def _views(block: np.ndarray, downsampled: tuple[bool, ...]) -> Iterator[tuple[np.ndarray, tuple[slice, ...]]]:
    """The 2**k strided views of a block, each with the region of the output it covers (the
    64-bit integer mean sums these one by one, so it never holds input-sized temporaries)."""
    axes = [i for i, d in enumerate(downsampled) if d]
    for offsets in product((0, 1), repeat=len(axes)):
        index: list[slice] = [slice(None)] * block.ndim
        for axis, o in zip(axes, offsets):
            index[axis] = slice(o, None, 2)
        view = block[tuple(index)]
        if view.size:
            yield view, tuple(slice(0, n) for n in view.shape)


def _counts_log2(shape: tuple[int, ...], downsampled: tuple[bool, ...]) -> np.ndarray:
    """log2 of how many input voxels fed each output voxel (broadcastable)."""
    total = np.zeros((1,) * len(shape), dtype=np.int64)
    for axis, (n, d) in enumerate(zip(shape, downsampled)):
        if not d:
            continue
        per_axis = np.ones(-(-n // 2), dtype=np.int64)
        if n % 2:
            per_axis[-1] = 0
        total = total + per_axis.reshape([-1 if i == axis else 1 for i in range(len(shape))])
    return total


def _reduce(block: np.ndarray, downsampled: tuple[bool, ...], method: str) -> np.ndarray:
    if method == "max":
        return _pairwise(block, downsampled, np.maximum, block.dtype)
    log2 = _counts_log2(block.shape, downsampled)
    kind = block.dtype.kind
    if kind == "f":
        # float16/32 sums of up to 8 values are exact in float64, so the order does not matter;
        # float64 sums round once per addition, as any float64 mean does.
        acc = _pairwise(block, downsampled, np.add, np.float64)
        if log2.min() == log2.max():  # no odd edge in this block: one exact scalar scale
            acc *= 2.0 ** -int(log2.flat[0])
        else:
            acc /= np.exp2(log2)
        return acc
    return _integer_mean(block, downsampled, output_shape(block.shape, downsampled), log2)


def _integer_mean(
    block: np.ndarray, downsampled: tuple[bool, ...], shape: tuple[int, ...], log2: np.ndarray
) -> np.ndarray:
    dtype = block.dtype
    data = block.view(np.uint8) if dtype.kind == "b" else block
    if data.dtype.itemsize < 8:
        total = _pairwise(data, downsampled, np.add, np.int64)
        floor = total >> log2
        remainder = total & ((1 << log2) - 1)
    else:
        floor, remainder = _wide_integer_sum(data, downsampled, shape, log2)
    half = (1 << log2) >> 1  # 0 when a single voxel fed the output: nothing to round
    round_up = (remainder > half) | ((remainder == half) & (half > 0) & ((floor & 1) == 1))
    result: np.ndarray = floor + round_up
    return result.astype(np.uint8).view(np.bool_) if dtype.kind == "b" else result.astype(dtype)


def _wide_integer_sum(
    data: np.ndarray, downsampled: tuple[bool, ...], shape: tuple[int, ...], log2: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """Floor and remainder of the sum divided by 2**log2 for 64-bit integers, without overflow:
    each value is split as hi * 2**32 + lo and the halves are summed separately."""
    signed = data.dtype.kind == "i"
    acc_type = np.int64 if signed else np.uint64
    hi_sum = np.zeros(shape, dtype=acc_type)
    lo_sum = np.zeros(shape, dtype=np.uint64)
    for view, region in _views(data, downsampled):
        hi_sum[region] += view >> 32  # arithmetic shift keeps the sign for int64
        lo_sum[region] += (view & 0xFFFFFFFF).astype(np.uint64)
    shift = log2.astype(np.uint64) if not signed else log2
    # (hi * 2**32 + lo) >> j == hi * 2**(32 - j) + lo >> j, because 2**j divides 2**32. The mean
    # itself fits the dtype; any wrap-around in the intermediate product cancels out.
    with np.errstate(over="ignore"):
        floor = (hi_sum << (32 - shift).astype(hi_sum.dtype)) + (lo_sum >> log2.astype(np.uint64)).astype(acc_type)
    remainder = (lo_sum & ((np.uint64(1) << log2.astype(np.uint64)) - np.uint64(1))).astype(np.int64)
    return floor, remainder
