"""Exact 2x downsampling along chosen axes: ``mean``, ``nearest`` and ``max``.

Edge policy: an axis of odd length n becomes ceil(n / 2); its last output voxel comes from the
single remaining input voxel (``mean`` divides by the voxels that exist, never by padding).

``mean`` is exact:

* floats are summed in float64 and divided by the voxel count (a power of two, so the division
  is exact); the one rounding is the cast back to the input dtype;
* integers are summed exactly in integer arithmetic (64-bit inputs in two 32-bit halves) and
  rounded half to even, which is what ``np.rint`` of the float64 mean gives wherever float64 can
  hold the sum exactly; bool is treated as 0/1 and ties go to False.

NaN propagates through ``mean`` and ``max``; ``nearest`` keeps the first voxel of each block.
Each level is computed from the previous one, so a level built from a written level in a later
pass is bit-identical to one built inside the first pass.
"""

from __future__ import annotations

from itertools import product

import numpy as np

#: Output elements computed at a time. The integer mean holds about five 8-byte temporaries per
#: element (sum, floor, remainder, rounding, result), so a strip costs ~5 MiB; the planner's
#: memory model uses the same figures (planner.plan.MEAN_STRIP_ELEMENTS, memory.STRIP_TEMPORARIES).
STRIP_ELEMENTS = 1 << 17


def output_shape(shape: tuple[int, ...], downsampled: tuple[bool, ...]) -> tuple[int, ...]:
    return tuple(-(-n // 2) if d else n for n, d in zip(shape, downsampled))


def downsample(block: np.ndarray, downsampled: tuple[bool, ...], method: str) -> np.ndarray:
    if not any(downsampled):
        return block
    if method == "nearest":
        return np.ascontiguousarray(block[tuple(slice(None, None, 2) if d else slice(None) for d in downsampled)])
    out = np.empty(output_shape(block.shape, downsampled), dtype=block.dtype)
    axis = downsampled.index(True)
    rows_per_strip = max(1, STRIP_ELEMENTS // max(1, out[(slice(None),) * axis + (0,)].size))
    for r0 in range(0, out.shape[axis], rows_per_strip):
        r1 = min(r0 + rows_per_strip, out.shape[axis])
        src = block[(slice(None),) * axis + (slice(2 * r0, min(2 * r1, block.shape[axis])),)]
        dst = (slice(None),) * axis + (slice(r0, r1),)
        out[dst] = _reduce(src, downsampled, method)
    return out


def _views(block: np.ndarray, downsampled: tuple[bool, ...]):
    """The 2**k strided views of a block, each with the region of the output it covers."""
    axes = [i for i, d in enumerate(downsampled) if d]
    for offsets in product((0, 1), repeat=len(axes)):
        index = [slice(None)] * block.ndim
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
    shape = output_shape(block.shape, downsampled)
    if method == "max":
        out = None
        for view, region in _views(block, downsampled):
            if out is None:
                out = view.copy()
            else:
                np.maximum(out[region], view, out=out[region])
        return out
    if method != "mean":
        raise ValueError(f"unknown downsampling method {method!r}")
    log2 = _counts_log2(block.shape, downsampled)
    kind = block.dtype.kind
    if kind == "f":
        acc = np.zeros(shape, dtype=np.float64)
        for view, region in _views(block, downsampled):
            acc[region] += view
        acc /= np.exp2(log2)
        return acc.astype(block.dtype)
    return _integer_mean(block, downsampled, shape, log2)


def _integer_mean(block: np.ndarray, downsampled, shape, log2: np.ndarray) -> np.ndarray:
    dtype = block.dtype
    data = block.view(np.uint8) if dtype.kind == "b" else block
    if data.dtype.itemsize < 8:
        total = np.zeros(shape, dtype=np.int64)
        for view, region in _views(data, downsampled):
            total[region] += view
        floor = total >> log2
        remainder = total & ((1 << log2) - 1)
    else:
        floor, remainder = _wide_integer_sum(data, downsampled, shape, log2)
    half = (1 << log2) >> 1  # 0 when a single voxel fed the output: nothing to round
    round_up = (remainder > half) | ((remainder == half) & (half > 0) & ((floor & 1) == 1))
    result = floor + round_up
    return result.astype(np.uint8).view(np.bool_) if dtype.kind == "b" else result.astype(dtype)


def _wide_integer_sum(data: np.ndarray, downsampled, shape, log2: np.ndarray):
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
