"""Independent references, written differently from the code under test on purpose.

* The pyramid: pad to even lengths, reshape into 2-blocks and reduce, with exact integer
  arithmetic on Python ints.
* The memory formula: the buffer terms of one pass, straight from the table in
  docs/memory-model.md, from the pass's geometry alone (no planner helper).
"""

from __future__ import annotations

import numpy as np


def _blocks(data: np.ndarray, downsampled, pad_value):
    """Pad odd downsampled axes with ``pad_value`` and reshape into (n/2, 2) pairs per axis."""
    pad = [(0, n % 2 if d else 0) for n, d in zip(data.shape, downsampled)]
    # Not np.pad: for object arrays it pads with numpy scalars, whose arithmetic overflows.
    padded = np.empty(tuple(n + p for n, (_, p) in zip(data.shape, pad)), dtype=data.dtype)
    padded[...] = pad_value
    padded[tuple(slice(0, n) for n in data.shape)] = data
    valid = np.pad(np.ones(data.shape, dtype=np.int64), pad, constant_values=0)
    shape, pair_axes = [], []
    for n, d in zip(padded.shape, downsampled):
        if d:
            shape += [n // 2, 2]
            pair_axes.append(len(shape) - 1)
        else:
            shape += [n]
    return padded.reshape(shape), valid.reshape(shape), tuple(pair_axes)


def reference_level(data: np.ndarray, downsampled, method: str) -> np.ndarray:
    if method == "nearest":
        return data[tuple(slice(None, None, 2) if d else slice(None) for d in downsampled)]
    if method == "max":
        low = -np.inf if data.dtype.kind == "f" else (False if data.dtype.kind == "b" else np.iinfo(data.dtype).min)
        blocks, _, axes = _blocks(data, downsampled, low)
        return blocks.max(axis=axes).astype(data.dtype)
    if data.dtype.kind == "f":
        blocks, valid, axes = _blocks(data.astype(np.float64), downsampled, 0.0)
        return (blocks.sum(axis=axes) / valid.sum(axis=axes)).astype(data.dtype)
    # Integers and bool: exact sums on Python ints, then round half to even.
    as_int = data.astype(np.uint8) if data.dtype.kind == "b" else data
    exact = np.array([int(v) for v in as_int.ravel()], dtype=object).reshape(as_int.shape)
    blocks, valid, axes = _blocks(exact, downsampled, 0)
    sums, counts = blocks, valid
    for axis in sorted(axes, reverse=True):  # one axis at a time: object sums stay Python ints
        sums = np.add.reduce(sums, axis=axis, dtype=object)
        counts = counts.sum(axis=axis)
    out = np.empty(sums.shape, dtype=object)
    for index in np.ndindex(sums.shape):
        q, r = divmod(int(sums[index]), int(counts[index]))
        if 2 * r > counts[index] or (2 * r == counts[index] and q % 2 == 1):
            q += 1
        out[index] = q
    if data.dtype.kind == "b":
        return out.astype(np.uint8).astype(bool)
    return out.astype(data.dtype)


def reference_pyramid(data: np.ndarray, downsampled, method: str, levels: int) -> list[np.ndarray]:
    """Each level from the previous one, as the NGFF pyramid is defined. ``downsampled`` is one
    tuple of axes for every step, or a list of one tuple per step (the anisotropy rule)."""
    out = [data]
    for k in range(levels - 1):
        out.append(reference_level(out[-1], step_axes(downsampled, k), method))
    return out


def halving_steps(axes: str, scale, n_steps: int) -> list[tuple[bool, ...]]:
    """The anisotropy rule by brute force, written without the planner: per step, the physical
    voxel size of every spatial axis (level-0 size x 2**halvings so far); halve those more than
    1e-6 (relative) finer than the coarsest, or all of them when none is. t and c never halve."""
    halvings = {a: 0 for a in axes if a in "zyx"}
    steps = []
    for _ in range(n_steps):
        size = {a: scale[axes.index(a)] * 2 ** halvings[a] for a in halvings}
        coarsest = max(size.values(), default=0.0)
        halve = {a for a in halvings if size[a] * (1 + 1e-6) < coarsest} or set(halvings)
        steps.append(tuple(a in halve for a in axes))
        for a in halve:
            halvings[a] += 1
    return steps


def step_axes(downsampled, k: int):
    """Step ``k``'s axes (from level k to k+1) of a uniform tuple or a per-step list."""
    if len(downsampled) and isinstance(downsampled[0], (tuple, list)):
        return tuple(downsampled[k])
    return tuple(downsampled)


def expected_buffer_terms(
    p, chunks, shards, itemsize: int, threads: int, downsampled, zstd: bool, constants
) -> dict[str, int]:
    """The buffer terms of pass ``p`` by the documented formula (bytes). With T threads, a slab of
    S bytes and chunks of C bytes: slab T*S; chunk and encode T*(2C + 16 + codec context); shard
    assembly T*2*(16 * inner chunks + 4) (the index only: chunks are streamed); level read buffers
    T*(2C + 16) in later passes; pyramid buffers T*(S/R1 + S/(R1 R2) + ... + 48 * strip), R_k the
    reduction of the k-th step the pass builds (8 for zyx, 4 for yx only: the anisotropy rule); window
    histogram T*(22 * (elements/127 + 1) + 1 MiB + C) in the first pass."""
    slab_elements = 1
    for s in p.slab:
        slab_elements *= s
    chunk = itemsize
    for c in chunks:
        chunk *= c
    context = constants.codec_context_zstd if zstd else constants.codec_context_other
    terms = {
        "slab buffers": threads * slab_elements * itemsize,
        "chunk and encode buffers": threads * (2 * chunk + 16 + context),
    }
    if shards:
        inner = 1
        for s, c in zip(shards, chunks):
            inner *= s // c
        terms["shard assembly"] = threads * 2 * (16 * inner + 4)
    built = len(p.levels) - (1 if p.source_level == -1 else 0)
    if built:
        base = max(p.source_level, 0)
        reductions = [2 ** sum(bool(d) for d in step_axes(downsampled, base + k)) for k in range(built)]
        levels, divisor = 0, 1
        for r in reductions:
            divisor *= r
            levels += (slab_elements // divisor) * itemsize
        strip = min(slab_elements // reductions[0], 1 << 16)
        terms["pyramid buffers"] = threads * (levels + strip * 8 * 6)
    if p.source_level != -1:
        terms["level read buffers"] = threads * (2 * chunk + 16)
    else:  # the omero window's sample: 1 in 127 elements x 22 B, two dense 65536-bin arrays, an edge chunk copy
        terms["window histogram"] = threads * ((slab_elements // 127 + 1) * 22 + 2 * 65536 * 8 + chunk)
    return terms
