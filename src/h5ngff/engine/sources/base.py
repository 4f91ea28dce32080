"""The one interface every source container sits behind.

A source is an N-D image made of one or more HDF5 datasets ("pieces") in one file. The pieces
tile a grid over the leading axes (``lead_shape``: none for a plain dataset; ``c`` for stacked
channels; ``t, c`` for Imaris time points and channels) and each piece gives the trailing axes,
read from the region ``[0, inner_shape)`` of its dataset (Imaris pads its blocks beyond the
image; the padding is never read).

The client describes a source once (``Opened``: the planner's ``DatasetInfo``, the identity that
resume checks, and the picklable ``SlabSource`` the workers read with). Workers read slabs into
their thread's slab buffer: a slab may span several pieces.
"""

from __future__ import annotations

import math
import os
import threading
from dataclasses import dataclass, replace
from itertools import product
from typing import TYPE_CHECKING, Any

import h5py
import hdf5plugin  # noqa: F401  registers blosc, zstd, lz4, bitshuffle... with HDF5
import numpy as np

from ...errors import SourceError, UnsupportedDatasetError
from ...planner.model import DatasetInfo
from ..buffers import current_conversion, slab_buffer
from .inflate import direct_read, read_deflate
from .hdf5 import SUPPORTED_KINDS, SourceIdentity, dtype_kind, filter_names, output_dtype, unopenable

if TYPE_CHECKING:
    from .remote import RemoteLayout

#: rdcc_nslots should be a prime well above the number of cached chunks.
CACHE_SLOTS = 10007
#: Files are opened once per worker process and kept open: h5py objects cannot be pickled, and
#: reopening per task costs a metadata read each time.
_files: dict[str, h5py.File] = {}
#: A plain source's dataset stays open with the planned chunk cache between slabs: a chunk that
#: straddles two slabs is inflated once.
_datasets: dict[tuple[str, str, int], h5py.Dataset] = {}
#: The conversions (engine.buffers.current_conversion) that read each open file: a batch closes
#: a file once no conversion that reads it is left (``close_files_of``).
_readers: dict[str, set[str]] = {}
_readers_lock = threading.Lock()


@dataclass(frozen=True)
class SlabSource:
    """What a worker needs to read any slab of a source: a few hundred bytes, pickled per task."""

    path: str
    #: Dataset path of every piece, in C order over ``lead_shape``.
    pieces: tuple[str, ...]
    lead_shape: tuple[int, ...]
    #: The region of each piece that is image (the rest is padding), per trailing axis.
    inner_shape: tuple[int, ...]
    dtype: str
    #: Read the bytes as this dtype and reinterpret them as ``dtype`` (BigDataViewer stores uint16
    #: as int16); None reads ``dtype`` itself.
    storage_dtype: str | None
    #: The planned HDF5 chunk cache of one whole slab; a slab spanning k pieces gives each 1/k.
    cache_bytes: int
    #: The file of each piece where the pieces come from several files (one image stacked from
    #: many, engine.sources.files); empty: every piece is in ``path``. Such files are opened for
    #: one slab's read and closed after it, so a worker never holds hundreds open.
    piece_files: tuple[str, ...] = ()
    #: A source in a bucket: each piece's object, ETag and chunk index, read by byte ranges
    #: (engine.sources.remote); None: local files, read with h5py.
    remote: "RemoteLayout | None" = None

    @property
    def shape(self) -> tuple[int, ...]:
        return self.lead_shape + self.inner_shape

    @property
    def plain(self) -> bool:
        return not self.lead_shape and self.storage_dtype is None

    def for_region(self, region: tuple[slice, ...]) -> "SlabSource":
        """The reader a task of ``region`` needs: a bucket source's carries only the part of its
        chunk index the region touches (a few kB per task, not the whole index per task)."""
        return self if self.remote is None else replace(self, remote=self.remote.around(self.lead_shape, region))

    def absolute(self) -> "SlabSource":
        """Local paths made absolute (a worker's working directory is its own); URLs as they are."""
        if self.remote is not None:
            return self
        return replace(
            self, path=os.path.abspath(self.path), piece_files=tuple(os.path.abspath(p) for p in self.piece_files)
        )

    def read(self, region: tuple[slice, ...]) -> np.ndarray:
        """One slab, read straight into this thread's slab buffer; valid until its next slab."""
        if self.plain and self.remote is None:
            return read_plain(self.path, self.pieces[0], self.cache_bytes, region)
        n = len(self.lead_shape)
        lead, inner = region[:n], region[n:]
        out = slab_buffer(tuple(r.stop - r.start for r in region), np.dtype(self.dtype))
        target = out.view(np.dtype(self.storage_dtype)) if self.storage_dtype else out
        spanned = math.prod(r.stop - r.start for r in lead)
        indices = list(product(*(range(r.start, r.stop) for r in lead)))
        flat = [int(np.ravel_multi_index(index, self.lead_shape)) for index in indices] if n else [0]
        if self.remote is not None:
            for index, i in zip(indices, flat):
                self.remote.read_piece(i, inner, target[tuple(j - r.start for j, r in zip(index, lead))])
            return out
        if self.piece_files:
            _read_from_files(self, indices, flat, lead, inner, target, self.cache_bytes // spanned)
            return out
        _note_reader(self.path)
        f = _open_file(self.path)
        for index, i in zip(indices, flat):
            dest = target[tuple(j - r.start for j, r in zip(index, lead))]
            _read_piece(f, self.pieces[i], self.cache_bytes // spanned, inner, dest, self.path)
        return out

    def __getitem__(self, region: tuple[slice, ...]) -> np.ndarray:
        """A fresh copy of ``region`` (for verify, which compares outside the slab path)."""
        return self.read(region).copy()


def _read_from_files(
    source: SlabSource,
    indices: list[tuple[int, ...]],
    flat: list[int],
    lead: tuple[slice, ...],
    inner: tuple[slice, ...],
    target: np.ndarray,
    cache_bytes: int,
) -> None:
    """The pieces of one slab that lie in several files: each file opened once for the slab, its
    pieces read, and closed (one image stacked from many files, engine.sources.files)."""
    for path in dict.fromkeys(source.piece_files[i] for i in flat):
        try:
            f = h5py.File(path, "r", rdcc_nbytes=1 << 20, rdcc_nslots=CACHE_SLOTS)
        except OSError as exc:
            raise SourceError(unopenable(path, exc)) from None
        with f:
            for index, i in zip(indices, flat):
                if source.piece_files[i] == path:
                    dest = target[tuple(j - r.start for j, r in zip(index, lead))]
                    _read_piece(f, source.pieces[i], cache_bytes, inner, dest, path)


def _open_file(path: str) -> h5py.File:
    f = _files.get(path)
    if f is None or not f.id.valid:
        # The file's own default cache stays small: each piece is opened with its share below.
        f = _files[path] = h5py.File(path, "r", rdcc_nbytes=1 << 20, rdcc_nslots=CACHE_SLOTS)
    return f


def _note_reader(path: str) -> None:
    """Before every read: the conversion of this slab reads ``path`` (``close_files_of``)."""
    with _readers_lock:
        _readers.setdefault(path, set()).add(current_conversion())


def _open_dataset(f: h5py.File, name: str, cache_bytes: int) -> h5py.Dataset:
    """``name`` opened with its own chunk cache of ``cache_bytes`` (the file's stays small)."""
    dapl = h5py.h5p.create(h5py.h5p.DATASET_ACCESS)
    dapl.set_chunk_cache(CACHE_SLOTS, max(cache_bytes, 1 << 20), 0.75)
    return h5py.Dataset(h5py.h5d.open(f.id, name.encode(), dapl))


def read_plain(path: str, dataset: str, cache_bytes: int, region: tuple[slice, ...]) -> np.ndarray:
    """One slab of a single dataset, read straight into this thread's slab buffer (no copy); valid
    until the thread's next slab. The dataset stays open with the planned cache between slabs."""
    key = (path, dataset, cache_bytes)
    _note_reader(path)
    ds = _datasets.get(key)
    try:
        if ds is None or not ds.id.valid:
            ds = _datasets[key] = _open_dataset(_open_file(path), dataset, cache_bytes)
        out = slab_buffer(tuple(r.stop - r.start for r in region), output_dtype(ds.dtype))
        _read_into(ds, region, out)
    except (OSError, RuntimeError, KeyError, ValueError) as exc:
        raise SourceError(
            f"Reading {dataset!r}{_fmt(region)} from {path!r} failed: {exc}. The file may be truncated or corrupt."
        ) from None
    return out


def _read_into(ds: h5py.Dataset, region: tuple[slice, ...], dest: np.ndarray) -> None:
    if direct_read(ds, dest.dtype):
        read_deflate(ds, region, dest)  # libdeflate: half HDF5's inflate time (engine.sources.inflate)
    else:
        ds.read_direct(dest, source_sel=region)


def _read_piece(
    f: h5py.File, name: str, cache_bytes: int, region: tuple[slice, ...], dest: np.ndarray, path: str
) -> None:
    """Read one piece's part of a slab. The dataset is opened for this read only, with its share
    of the planned chunk cache, and closed after it: pieces a worker has left hold no cache."""
    try:
        ds = _open_dataset(f, name, cache_bytes)
        _read_into(ds, region, dest)
    except (OSError, RuntimeError, KeyError, ValueError) as exc:
        raise SourceError(
            f"Reading {name!r}{_fmt(region)} from {path!r} failed: {exc}. The file may be truncated or corrupt."
        ) from None
    finally:
        ds = None  # noqa: F841  closes the dataset and frees its chunk cache


def _fmt(region: tuple[slice, ...]) -> str:
    return "[" + ", ".join(f"{r.start}:{r.stop}" for r in region) + "]"


def close_files_of(conversion: str) -> None:
    """Close the cached HDF5 files (and their open datasets) that ``conversion`` read and no
    other conversion still reads, once none of its slabs runs (a batch's item has ended): a
    batch of hundreds of files must not keep them all open, each with its chunk cache."""
    # Under the lock: a slab notes itself a reader before it looks a file up, so a file is
    # either kept for it or closed before its lookup (which then opens it again).
    with _readers_lock:
        done = [p for p, readers in _readers.items() if readers <= {conversion}]
        for readers in _readers.values():
            readers.discard(conversion)
        for path in done:
            del _readers[path]
            _close(path)


def close_files() -> None:
    """Close every cached HDF5 file of this process (tests that rewrite a file they have read)."""
    with _readers_lock:
        _readers.clear()
        for path in list(_files):
            _close(path)
        _datasets.clear()


def _close(path: str) -> None:
    """Close one cached file and drop its open datasets."""
    for key in [k for k in _datasets if k[0] == path]:
        del _datasets[key]
    f = _files.pop(path, None)
    if f is not None:
        try:
            f.close()
        except Exception:
            pass


@dataclass(frozen=True)
class Opened:
    """A source as the client sees it: the planner's numbers, resume's identity, the workers' reader."""

    info: DatasetInfo
    identity: SourceIdentity
    reader: SlabSource
    #: What the source is, for messages and docs: plain, stacked, imaris, bdv.
    kind: str = "plain"
    #: (spec field, message): metadata the reader cannot map, which stops a conversion unless the
    #: user's flags decide that field (``sources.open_source``). verify, which compares data
    #: only, does not stop on them.
    conflicts: tuple[tuple[str, str], ...] = ()


def check_dtype(dtype: np.dtype, what: str) -> None:
    if dtype.kind not in SUPPORTED_KINDS or dtype.fields is not None or dtype.subdtype is not None:
        raise UnsupportedDatasetError(
            f"source.dataset: {what} has dtype {dtype} ({dtype_kind(dtype)}); NGFF images hold numbers. "
            f"Expected bool, int8-int64, uint8-uint64 or float16/32/64. Convert it, or choose another dataset."
        )


def piece_storage(datasets: list[h5py.Dataset]) -> tuple[tuple[int, ...] | None, tuple[str, ...]]:
    """The HDF5 chunk shape and filters the planner prices for a set of pieces: the largest
    chunk among them (every piece's cache share must hold its own chunks)."""
    chunked = [tuple(ds.chunks) for ds in datasets if ds.chunks]
    chunks = max(chunked, key=math.prod) if chunked else None
    filters: tuple[str, ...] = ()
    for ds in datasets:
        filters = filters or tuple(filter_names(ds))
    return chunks, filters


def composite_info(
    lead_shape: tuple[int, ...],
    inner_shape: tuple[int, ...],
    dtype: np.dtype,
    datasets: list[h5py.Dataset],
    read_dtype: np.dtype | None = None,
    **attrs: Any,
) -> DatasetInfo:
    """The planner's view of pieces stacked over ``lead_shape``: each piece is one HDF5 chunk deep
    along the leading axes, so a slab's chunk cache covers exactly the pieces it spans.
    ``read_dtype`` is the dtype of the buffer the pieces are read into (SlabSource: the storage
    dtype where bytes are reinterpreted, else the output dtype): with it, ``_read_piece``'s own
    decision (engine.sources.inflate.direct_read) says whether every piece skips HDF5's chunk cache."""
    chunks, filters = piece_storage(datasets)
    into = read_dtype if read_dtype is not None else output_dtype(dtype)
    return DatasetInfo(
        shape=tuple(lead_shape) + tuple(inner_shape),
        dtype=output_dtype(dtype).str,
        itemsize=dtype.itemsize,
        hdf5_chunks=(1,) * len(lead_shape) + chunks if chunks else None,
        hdf5_filters=filters,
        hdf5_direct_read=bool(datasets) and all(direct_read(ds, into) for ds in datasets),
        **attrs,
    )
