"""Decoding HDF5 chunks fetched as bytes, with the decoders the local path uses.

- no filter: the bytes are the chunk;
- deflate alone: libdeflate, as the local path reads such chunks (engine.sources.inflate);
- shuffle then deflate (h5py's ``compression="gzip", shuffle=True``): libdeflate, then HDF5's
  byte shuffle undone (a transpose of the chunk's bytes by element size: it has one answer);
- anything else (blosc, zstd, lz4, bitshuffle, szip, scale-offset, n-bit, fletcher32, a chunk
  whose mask skipped a filter): HDF5's own filter pipeline, with the plugins hdf5plugin
  registers. The chunk is written as stored bytes (``write_direct_chunk``) into a one-chunk
  dataset of an in-memory file with the same filters, and read back through them: the same code
  that decodes the chunk when h5py reads a local file, so the two paths cannot differ.

Memory: one compressed chunk (inside its request's body) and one decoded chunk per thread; the
in-memory file of the HDF5 path holds one stored chunk more (planner/memory.py, "source range
buffers" and "hdf5 cache and decompression").
"""

from __future__ import annotations

import threading
from typing import Any

import h5py
import hdf5plugin  # noqa: F401  registers blosc, zstd, lz4, bitshuffle... with HDF5
import numpy as np

from .chunkindex import ChunkIndex, Filter
from .inflate import libdeflate

_DEFLATE, _SHUFFLE = 1, 2
#: Each thread keeps the in-memory decoding files it made, by filter pipeline (few per process).
_local = threading.local()


class ChunkDecoder:
    """Decodes the stored chunks of one dataset (its ``ChunkIndex``)."""

    def __init__(self, index: ChunkIndex):
        self.index = index
        self.dtype = np.dtype(index.dtype)
        self.chunk_bytes = index.chunk_bytes
        ids = tuple(f[0] for f in index.filters)
        self._inflate = libdeflate()
        inflate = self._inflate is not None
        self._path = "hdf5"
        if not ids:
            self._path = "raw"
        elif ids == (_DEFLATE,) and inflate:
            self._path = "deflate"
        elif ids == (_SHUFFLE, _DEFLATE) and inflate:
            self._path = "shuffle-deflate"

    def decode(self, stored: memoryview, mask: int) -> np.ndarray:
        """One chunk's elements, flat, in the stored dtype."""
        if mask == 0 and self._path == "raw":
            return np.frombuffer(stored, dtype=self.dtype)
        if mask == 0 and self._path in ("deflate", "shuffle-deflate"):
            try:
                raw = self._inflate.zlib_decompress(stored, self.chunk_bytes)
            except self._inflate.DeflateError as exc:
                raise OSError(f"a deflate stream of {len(stored)} bytes does not decode ({exc})") from None
            if self._path == "shuffle-deflate" and self.dtype.itemsize > 1:
                shuffled = np.frombuffer(raw, dtype=np.uint8).reshape(self.dtype.itemsize, -1)
                return np.ascontiguousarray(shuffled.T).view(self.dtype).reshape(-1)
            return np.frombuffer(raw, dtype=self.dtype)
        return _through_hdf5(self.index, stored, mask)


def _through_hdf5(index: ChunkIndex, stored: memoryview, mask: int) -> np.ndarray:
    """HDF5's filter pipeline on one stored chunk (see the module's docstring). A filter the
    chunk's mask says was skipped (an optional filter that did not shrink it, as LZF leaves
    random data) is left out of the decoding pipeline, which then sees a chunk every filter of
    which was applied (a chunk written by write_direct_chunk with its mask did not decode under
    HDF5 2.0: the mask is left to this function)."""
    dtype = np.dtype(index.dtype)
    applied = tuple(f for i, f in enumerate(index.filters) if not mask & (1 << i))
    if not applied:
        return np.frombuffer(stored, dtype=dtype)
    assert index.chunks is not None
    ds = _decoding_dataset(index.dtype, index.chunks, applied)
    ds.id.write_direct_chunk((0,) * len(index.chunks), bytes(stored))
    out = np.empty(index.chunks, dtype=dtype)
    ds.read_direct(out)
    return out.reshape(-1)


def _decoding_dataset(dtype: str, chunks: tuple[int, ...], filters: tuple[Filter, ...]) -> Any:
    """This thread's one-chunk-deep dataset in an in-memory file with ``filters``, made once."""
    key = (dtype, chunks, filters)
    made: dict[Any, Any] = getattr(_local, "datasets", None) or {}
    _local.datasets = made
    ds = made.get(key)
    if ds is None or not ds.id.valid:
        f = h5py.File(f"h5ngff-decode-{id(made)}-{len(made)}", "w", driver="core", backing_store=False)
        dcpl = h5py.h5p.create(h5py.h5p.DATASET_CREATE)
        dcpl.set_chunk(chunks)
        for fid, flags, values in filters:
            dcpl.set_filter(fid, flags, values)
        dapl = h5py.h5p.create(h5py.h5p.DATASET_ACCESS)
        dapl.set_chunk_cache(0, 0, 0.75)  # nothing cached: every read decodes the chunk just written
        space = h5py.h5s.create_simple(chunks)
        htype = h5py.h5t.py_create(np.dtype(dtype), logical=True)
        ds = h5py.Dataset(h5py.h5d.create(f.id, b"chunk", htype, space, dcpl=dcpl, dapl=dapl))
        made[key] = ds
        made[("file", key)] = f
    return ds
