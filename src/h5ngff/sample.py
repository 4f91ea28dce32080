"""Generate sample HDF5 volumes that compress like microscopy, not like random noise.

Smooth structure (blobs and gradients) plus quantised sensor noise: blosc/zstd reach ratios of a
few to one, as on real images, so compression costs what it costs on real data.
"""

from __future__ import annotations

import math
import os
import shutil

import h5py
import numpy as np

from .errors import SpecError

DEFAULT_SHAPE = (96, 768, 512)
#: Dimensions a sample may have: a 2-D image up to a tczyx volume (what convert accepts).
MIN_DIMS, MAX_DIMS = 2, 5
#: numpy kinds a sample may hold: the pixel types convert accepts (no complex, no strings).
DTYPE_KINDS = "biuf"


def parse_shape(text: str, field: str = "--shape", dims: tuple[int, int] = (MIN_DIMS, MAX_DIMS)) -> tuple[int, ...]:
    """``96,768,512`` -> (96, 768, 512): 2 to 5 positive integers, refused with SpecError (exit 2)."""
    low, high = dims
    expected = f"Expected {low} to {high} comma-separated positive integers, e.g. 96,768,512"
    try:
        shape = tuple(int(v) for v in text.replace("x", ",").split(","))
    except ValueError:
        raise SpecError(field, f"{expected}. Got {text!r} instead.") from None
    if not low <= len(shape) <= high:
        raise SpecError(
            field, f"{expected}. Got {text!r} instead ({len(shape)} dimension{'s' if len(shape) != 1 else ''})."
        )
    if any(n < 1 for n in shape):
        raise SpecError(field, f"{expected}. Got {text!r} instead (every dimension needs at least one element).")
    return shape


def check_dtype(name: str, field: str = "--dtype") -> np.dtype:
    """A numpy dtype name a sample may hold (bool, integers, floats), else SpecError (exit 2)."""
    expected = "Expected a numpy integer, float or bool dtype name, e.g. uint8, uint16, int32, float32"
    try:
        dt = np.dtype(name)
    except TypeError:
        raise SpecError(field, f"{expected}. Got {name!r} instead.") from None
    if dt.kind not in DTYPE_KINDS:
        raise SpecError(field, f"{expected}. Got {name!r} instead ({dt.name} is not a pixel type convert accepts).")
    return dt


def check_chunks(chunks: tuple[int, ...] | None, shape: tuple[int, ...], field: str = "--hdf5-chunks") -> None:
    if chunks is None:
        return
    if len(chunks) != len(shape) or any(c < 1 for c in chunks):
        raise SpecError(
            field,
            f"Expected {len(shape)} comma-separated positive integers, one per axis of the shape {shape}. "
            f"Got {','.join(map(str, chunks))!r} instead.",
        )
    if any(c > n for c, n in zip(chunks, shape)):
        fitted = ",".join(str(min(c, n)) for c, n in zip(chunks, shape))
        raise SpecError(
            field,
            f"Expected chunks no larger than the shape {shape} (HDF5 refuses a chunk larger than a fixed-size "
            f"dataset). Got {','.join(map(str, chunks))!r} instead; {fitted!r} fits.",
        )


#: Bytes of working memory per element of one plane while it is generated (a few float32
#: temporaries: the signal, the noise, the clipped data and the cast).
_PLANE_WORK_BYTES = 20


def check_size(shape: tuple[int, ...], dt: np.dtype, directory: str, compressed: bool) -> None:
    """Refuse a sample this machine cannot write (SpecError, exit 2, nothing written): one plane is
    generated at a time, so a plane must fit in half the available memory, and the uncompressed
    file must fit on the disk."""
    import psutil

    from .units import format_bytes

    plane = math.prod(shape[-2:]) * _PLANE_WORK_BYTES
    available = psutil.virtual_memory().available
    if plane > available // 2:
        raise SpecError(
            "--shape",
            f"Expected planes (the last two axes) this machine can generate: one {shape[-2]} x {shape[-1]} plane takes "
            f"{format_bytes(plane)} to generate, more than half of the {format_bytes(available)} available. Choose "
            f"smaller y and x (more planes cost disk, not memory).",
        )
    size = math.prod(shape) * dt.itemsize
    free = shutil.disk_usage(directory).free
    if not compressed and size > free:
        raise SpecError(
            "--shape",
            f"Expected a sample that fits on the disk: {shape} {dt.name} is {format_bytes(size)}, and "
            f"{directory!r} has {format_bytes(free)} free. Choose a smaller shape, another directory, or --gzip.",
        )


def _existing_ancestor(directory: str) -> str:
    while not os.path.exists(directory):
        directory = os.path.dirname(directory)
    return directory


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


def write_sample(
    path: str,
    dataset: str = "/volume/data",
    shape: tuple[int, ...] = DEFAULT_SHAPE,
    dtype: str = "float32",
    chunks: tuple[int, ...] | None = None,
    compression: str | None = None,
    seed: int = 0,
    element_size_um: tuple[float, ...] | None = None,
    progress=None,
) -> str:
    """Write a sample volume; extra leading axes (t, c) repeat the 3-D volume with an offset.

    The inputs are checked first (SpecError, nothing written); the file is written under a
    temporary name beside ``path`` and renamed when whole, so a failed or interrupted write
    leaves no partial file (and an existing ``path`` stays as it was)."""
    dt = check_dtype(dtype)
    shape = tuple(int(n) for n in shape)
    if not MIN_DIMS <= len(shape) <= MAX_DIMS or any(n < 1 for n in shape):
        raise SpecError("--shape", f"Expected {MIN_DIMS} to {MAX_DIMS} positive dimensions. Got {shape} instead.")
    check_chunks(chunks, shape)
    check_size(shape, dt, _existing_ancestor(os.path.dirname(os.path.abspath(path))), compression is not None)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    partial = os.path.join(os.path.dirname(os.path.abspath(path)), f".{os.path.basename(path)}.partial-{os.getpid()}")
    try:
        _write(partial, dataset, shape, dt, chunks, compression, seed, element_size_um, progress)
        os.replace(partial, path)
    except BaseException:
        if os.path.exists(partial):
            os.unlink(partial)
        raise
    return path


def _write(
    path: str,
    dataset: str,
    shape: tuple[int, ...],
    dt: np.dtype,
    chunks: tuple[int, ...] | None,
    compression: str | None,
    seed: int,
    element_size_um: tuple[float, ...] | None,
    progress,
) -> None:
    rng = np.random.default_rng(seed)
    with h5py.File(path, "w") as f:
        ds = f.create_dataset(dataset, shape=shape, dtype=dt, chunks=chunks, compression=compression)
        if element_size_um is not None:
            ds.attrs["element_size_um"] = element_size_um
        if len(shape) == 2:
            ds[...] = _plane(0, shape, rng, dt)
            return
        # Whole chunk-deep blocks of planes, so a chunked (compressed) dataset is written once
        # per chunk instead of being re-read and re-compressed plane by plane.
        depth = chunks[-3] if chunks else 16
        outer = list(np.ndindex(*shape[:-3]))
        steps = [(index, z0) for index in outer for z0 in range(0, shape[-3], depth)]
        for n, (index, z0) in enumerate(steps):
            z1 = min(z0 + depth, shape[-3])
            offset = sum(index) * 5
            ds[index + (slice(z0, z1),)] = np.stack(
                [_plane(offset + z, (shape[-2], shape[-1]), rng, dt) for z in range(z0, z1)]
            )
            if progress:
                progress(n + 1, len(steps))
