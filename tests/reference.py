"""Independent NumPy references for the pyramid, written differently from the engine on purpose:
pad to even lengths, reshape into 2-blocks and reduce, with exact integer arithmetic on Python ints."""

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
    """Each level from the previous one, as the NGFF pyramid is defined."""
    out = [data]
    for _ in range(levels - 1):
        out.append(reference_level(out[-1], downsampled, method))
    return out
