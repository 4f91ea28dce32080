"""Where a dataset's bytes lie in its file, read once by the client: kerchunk's view of HDF5.

For a chunked dataset, the byte offset, stored size and filter mask of every chunk (HDF5's
``chunk_iter``, one walk of the chunk B-tree); for a contiguous one, the offset of its first
element; for a compact one (at most 64 KiB, kept in the object header), the bytes themselves.
With the dtype, fill value and filter pipeline, that is everything the workers need to read any
region as byte ranges, without HDF5 opening the file (engine.sources.ranged).

Each slab task carries only its own part of the index (``ChunkIndex.around``): a slab's chunks,
a few kB pickled, not the whole dataset's.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import h5py
import numpy as np

from ...errors import UnsupportedDatasetError

#: (filter id, flags, client values) in pipeline order, as HDF5 stores them.
Filter = tuple[int, int, tuple[int, ...]]


@dataclass(frozen=True, eq=False)
class ChunkIndex:
    """One dataset's storage: a few fields, and for a chunked dataset three arrays over (a part
    of) its chunk grid. ``eq=False``: two indexes are the same only as the same object."""

    shape: tuple[int, ...]
    #: The stored dtype, byte order included (``>f4``): the bytes are read as that.
    dtype: str
    #: The element HDF5 reads where nothing was written (one element of ``dtype``).
    fill: bytes
    filters: tuple[Filter, ...] = ()
    #: HDF5 chunk shape; None for contiguous or compact storage.
    chunks: tuple[int, ...] | None = None
    #: The chunk-grid coordinates of ``offsets[0, 0, ...]`` (a task's part of the grid).
    origin: tuple[int, ...] = ()
    #: Per chunk: byte offset in the file (-1: never written, reads as ``fill``), stored size,
    #: and filter mask (bit i set: filter i was skipped for that chunk).
    offsets: np.ndarray | None = None
    sizes: np.ndarray | None = None
    masks: np.ndarray | None = None
    #: Contiguous storage: the byte offset of the first element; -1 if never written.
    contiguous_offset: int = -1
    #: Compact storage: the data itself (C order, ``dtype``).
    inline: bytes | None = None

    @property
    def itemsize(self) -> int:
        return np.dtype(self.dtype).itemsize

    @property
    def chunk_bytes(self) -> int:
        """Bytes of one decoded chunk (0 for unchunked storage)."""
        return math.prod(self.chunks) * self.itemsize if self.chunks else 0

    @property
    def largest_stored(self) -> int:
        """The largest stored chunk (a request must hold one whole)."""
        return int(self.sizes.max()) if self.sizes is not None and self.sizes.size else 0

    def around(self, region: tuple[slice, ...]) -> "ChunkIndex":
        """The part of the index a read of ``region`` needs (a slab task carries only that)."""
        if self.chunks is None or self.offsets is None or self.sizes is None or self.masks is None:
            return self
        first = [r.start // c for r, c in zip(region, self.chunks)]
        last = [max(-(-r.stop // c), f + 1) for r, c, f in zip(region, self.chunks, first)]
        local = tuple(slice(f - o, e - o) for f, e, o in zip(first, last, self.origin))
        return replace(
            self,
            origin=tuple(first),
            offsets=self.offsets[local].copy(),
            sizes=self.sizes[local].copy(),
            masks=self.masks[local].copy(),
        )


def read_index(ds: h5py.Dataset, where: str) -> ChunkIndex:
    """The index of ``ds`` (metadata only: the chunk B-tree, never the chunks)."""
    dcpl = ds.id.get_create_plist()
    if ds.is_virtual:
        raise UnsupportedDatasetError(
            f"source.dataset: {where} is a virtual dataset (its data lie in other files it names), which h5ngff does "
            f"not read from a bucket. Convert the files it maps, or a copy of it made with h5repack."
        )
    if dcpl.get_external_count():
        raise UnsupportedDatasetError(
            f"source.dataset: {where} keeps its data in external files, which h5ngff does not read from a bucket. "
            f"Convert a copy made with h5repack (which brings the data into the file)."
        )
    dtype = ds.dtype
    fill = np.array(ds.fillvalue, dtype=dtype).tobytes()
    filters = tuple(
        (int(fid), int(flags), tuple(int(v) for v in values))
        for fid, flags, values, _ in (dcpl.get_filter(i) for i in range(dcpl.get_nfilters()))
    )
    common = dict(shape=tuple(int(n) for n in ds.shape), dtype=dtype.str, fill=fill, filters=filters)
    layout = dcpl.get_layout()
    if layout == h5py.h5d.COMPACT:
        return ChunkIndex(**common, inline=np.ascontiguousarray(ds[()]).tobytes())
    if layout == h5py.h5d.CONTIGUOUS:
        offset = ds.id.get_offset()
        return ChunkIndex(**common, contiguous_offset=-1 if offset is None else int(offset))
    chunks = tuple(int(c) for c in ds.chunks)
    grid = tuple(-(-n // c) for n, c in zip(ds.shape, chunks))
    offsets = np.full(grid, -1, dtype=np.int64)
    sizes = np.zeros(grid, dtype=np.int64)
    masks = np.zeros(grid, dtype=np.uint32)

    def visit(info) -> None:  # type: ignore[no-untyped-def]
        at = tuple(o // c for o, c in zip(info.chunk_offset, chunks))
        offsets[at], sizes[at], masks[at] = info.byte_offset, info.size, info.filter_mask

    if math.prod(grid):
        ds.id.chunk_iter(visit)
    return ChunkIndex(**common, chunks=chunks, origin=(0,) * len(grid), offsets=offsets, sizes=sizes, masks=masks)
