"""Generate sample HDF5 volumes that compress like microscopy, not like random noise.

Smooth structure (blobs and gradients) plus quantised sensor noise: blosc/zstd reach ratios of a
few to one, as on real images, so compression costs what it costs on real data.
"""

from __future__ import annotations

import math
import os

import h5py
import numpy as np

DEFAULT_SHAPE = (96, 768, 512)


def _plane(z: int, shape: tuple[int, int], rng: np.random.Generator, dtype: np.dtype) -> np.ndarray:
    ny, nx = shape
    y = np.linspace(0, 6 * math.pi, ny, dtype=np.float32)[:, None]
    x = np.linspace(0, 4 * math.pi, nx, dtype=np.float32)[None, :]
    phase = z * 0.07
    signal = 0.5 + 0.25 * np.sin(y + phase) * np.cos(x - phase) + 0.2 * np.sin(0.31 * x + 0.17 * y + phase) ** 8
    noise = rng.standard_normal((ny, nx), dtype=np.float32) * 0.02
    data = np.clip(signal + noise, 0, 1)
    if dtype.kind in "iu":
        top = min(np.iinfo(dtype).max, 4095)  # 12-bit camera range
        return np.round(data * top).astype(dtype)
    if dtype.kind == "b":
        return data > 0.6
    # Quantise to 1/1024 as a real detector would; keeps float data compressible.
    return (np.round(data * 1024) / 1024).astype(dtype)


def write_sample(path: str, dataset: str = "/volume/data", shape: tuple[int, ...] = DEFAULT_SHAPE, dtype: str = "float32",
                 chunks: tuple[int, ...] | None = None, compression: str | None = None, seed: int = 0,
                 element_size_um: tuple[float, ...] | None = None, progress=None) -> str:
    """Write a sample volume; extra leading axes (t, c) repeat the 3-D volume with an offset."""
    dt = np.dtype(dtype)
    rng = np.random.default_rng(seed)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with h5py.File(path, "w") as f:
        ds = f.create_dataset(dataset, shape=shape, dtype=dt, chunks=chunks, compression=compression)
        if element_size_um is not None:
            ds.attrs["element_size_um"] = element_size_um
        if len(shape) == 2:
            ds[...] = _plane(0, shape, rng, dt)
            return path
        # Whole chunk-deep blocks of planes, so a chunked (compressed) dataset is written once
        # per chunk instead of being re-read and re-compressed plane by plane.
        depth = chunks[-3] if chunks else 16
        outer = list(np.ndindex(*shape[:-3]))
        steps = [(index, z0) for index in outer for z0 in range(0, shape[-3], depth)]
        for n, (index, z0) in enumerate(steps):
            z1 = min(z0 + depth, shape[-3])
            offset = sum(index) * 5
            ds[index + (slice(z0, z1),)] = np.stack([_plane(offset + z, (shape[-2], shape[-1]), rng, dt) for z in range(z0, z1)])
            if progress:
                progress(n + 1, len(steps))
    return path
