"""Reading deflate-compressed HDF5 chunks with libdeflate instead of HDF5's zlib filter.

HDF5 inflates each chunk with zlib on the reading thread. libdeflate (PyPI ``deflate``) inflates
the same zlib streams in about half the CPU time: on the u16-4d bench chunks (1, 32, 256, 256)
gzip 4, 0.45 s against h5py's 0.94 s of process CPU for 134 MB (docs/benchmarks.md). So a slab of
a dataset whose only filter is deflate is read chunk by chunk: ``read_direct_chunk`` (the stored
bytes, no filter) and libdeflate into a chunk-sized buffer, then the chunk's part of the region is
copied into the slab. The decoded bytes are those zlib gives (inflate has one answer; the tests
compare with h5py's own read), and anything else (shuffle, other filters, a chunk stored with its
filter skipped is handled, an unallocated chunk reads as the fill value) falls back to h5py.

Memory: one compressed and one decompressed HDF5 chunk at a time, which the plan holds ("hdf5
cache and decompression": + 2 x hdf5 chunk); HDF5's chunk cache is not used by this path, so the
plan prices none for it. The planner is pure: the client describes the source with
:func:`direct_read` (``DatasetInfo.hdf5_direct_read``) and the workers read with the same
function, so the plan prices the path the workers take. ``H5NGFF_NO_LIBDEFLATE`` must therefore
be set alike for the client and the workers (it is inherited by local, SLURM and emulated pods).
"""

from __future__ import annotations

import math
import os
from itertools import product
from typing import Any

import h5py
import numpy as np

try:  # optional: without it every read goes through h5py
    import deflate as _libdeflate
except ImportError:  # pragma: no cover - the lock pins it
    _libdeflate = None  # type: ignore[assignment]

_DEFLATE = 1  # H5Z_FILTER_DEFLATE
#: Set (to anything) to read through h5py's own filter: the baseline bench.cpu_work compares with.
DISABLE_ENV = "H5NGFF_NO_LIBDEFLATE"


def libdeflate() -> Any:
    """libdeflate's module where it is installed and not switched off (``DISABLE_ENV``), else None:
    the bucket path (engine.sources.decode) decides as the local path does."""
    return None if _libdeflate is None or DISABLE_ENV in os.environ else _libdeflate


def direct_deflate(ds: h5py.Dataset) -> bool:
    """Whether ``ds`` can be read by :func:`read_deflate`: chunked, deflate its only filter, a
    plain numeric dtype, and libdeflate installed."""
    if (
        _libdeflate is None
        or DISABLE_ENV in os.environ
        or ds.chunks is None
        or ds.dtype.kind not in "biuf"
        or ds.dtype.fields
    ):
        return False
    plist = ds.id.get_create_plist()
    return bool(plist.get_nfilters() == 1 and plist.get_filter(0)[0] == _DEFLATE)


def direct_read(ds: h5py.Dataset, into: np.dtype | str | None = None) -> bool:
    """The one decision of the read path: whether a read of ``ds`` into a buffer of dtype ``into``
    (default: ``ds``'s own) goes through :func:`read_deflate` (HDF5's chunk cache unused) rather
    than h5py. The engine's readers take the path it names and the source description records it
    for the planner (``DatasetInfo.hdf5_direct_read``), so the plan prices the path taken. A
    buffer of another dtype (a big-endian dataset read as little-endian) goes through h5py."""
    return direct_deflate(ds) and (into is None or np.dtype(into) == ds.dtype)


def read_deflate(ds: h5py.Dataset, region: tuple[slice, ...], out: np.ndarray) -> None:
    """Read ``region`` of ``ds`` into ``out`` (same shape), inflating each chunk with libdeflate."""
    chunks = ds.chunks
    chunk_bytes = math.prod(chunks) * ds.dtype.itemsize
    first = [r.start // c for r, c in zip(region, chunks)]
    last = [-(-r.stop // c) for r, c in zip(region, chunks)]
    for index in product(*(range(a, b) for a, b in zip(first, last))):
        start = tuple(i * c for i, c in zip(index, chunks))
        inter = tuple(slice(max(s, r.start), min(s + c, r.stop)) for s, c, r in zip(start, chunks, region))
        dst = tuple(slice(i.start - r.start, i.stop - r.start) for i, r in zip(inter, region))
        chunk = _chunk(ds, start, chunk_bytes)
        if chunk is None:
            out[dst] = ds.fillvalue
            continue
        out[dst] = chunk.reshape(chunks)[tuple(slice(i.start - s, i.stop - s) for i, s in zip(inter, start))]


def _chunk(ds: h5py.Dataset, start: tuple[int, ...], chunk_bytes: int) -> np.ndarray | None:
    """One chunk's elements, or None where the chunk was never written (reads as the fill value)."""
    info = ds.id.get_chunk_info_by_coord(start)
    if info.byte_offset is None:
        return None
    mask, data = ds.id.read_direct_chunk(start)
    try:
        raw = data if mask & 1 else _libdeflate.zlib_decompress(data, chunk_bytes)  # bit 0: deflate skipped
    except _libdeflate.DeflateError as exc:
        raise OSError(
            f"the deflate stream of the chunk at {start} ({len(data)} bytes) does not decode ({exc})"
        ) from None
    return np.frombuffer(raw, dtype=ds.dtype)
