"""One plain HDF5 dataset's metadata: inspect it for the planner and check it is convertible.

The containers (stacked datasets, Imaris, BigDataViewer), the attribute conventions (axes, voxel
sizes) and the workers' reads (``sources.base``, with the one per-process file cache) build on it.
"""

from __future__ import annotations

import errno
import os
from dataclasses import dataclass
from typing import Protocol

import h5py
import hdf5plugin  # noqa: F401  registers blosc, zstd, lz4, bitshuffle... with HDF5
import numpy as np

from ...errors import DatasetNotFoundError, SourceError, SourceNotFoundError, UnsupportedDatasetError
from ...planner.model import DatasetInfo
from .inflate import direct_read

#: numpy kinds an NGFF image may hold: bool, signed and unsigned integers, floats.
SUPPORTED_KINDS = {"b": "bool", "i": "signed integer", "u": "unsigned integer", "f": "float"}


@dataclass(frozen=True)
class SourceIdentity:
    """What must not change between a run and its resume."""

    path: str
    dataset: str
    size: int
    mtime_ns: int
    #: (path, size, mtime_ns) of every file of an image stacked from several (engine.sources.files),
    #: (URL, size, ETag) for objects; empty for one file, whose identity is the fields above.
    files: tuple[tuple[str, int, int | str], ...] = ()
    #: An object's ETag (a source in a bucket, whose mtime_ns is 0); "" for a local file.
    etag: str = ""


def output_dtype(dtype: np.dtype) -> np.dtype:
    """Zarr stores little-endian; HDF5 converts big-endian data while reading."""
    return dtype.newbyteorder("<") if dtype.byteorder == ">" else dtype


def broken_link(f: h5py.File, name: str) -> str | None:
    """What ``name`` is where it is a link whose target does not resolve (the file says "not in"
    otherwise, which a user who made the link cannot square with what they see in it)."""
    try:
        link = f.get(name, getlink=True)
    except (KeyError, ValueError, OSError):
        return None
    if isinstance(link, h5py.SoftLink):
        return f"a soft link to {link.path!r}, which is not in the file"
    if isinstance(link, h5py.ExternalLink):
        return f"an external link to {link.path!r} in {link.filename!r}, which cannot be opened or does not hold it"
    return None


def missing(path: str, what: str, field: str = "source.path") -> str:
    """Why ``path`` is not there: a dangling symbolic link names its target (a glob in a batch
    matches the link, so the user sees the link's name and not why it reads nothing)."""
    if os.path.islink(path):
        return (
            f"{field}: {what} {path!r} is a symbolic link to {os.readlink(path)!r}, which does not exist. "
            f"Fix or remove the link."
        )
    return f"{field}: {what} {path!r} does not exist. Check the path (workers must see the same path)."


def unopenable(path: str, exc: OSError, field: str = "source.path") -> str:
    """Why an existing ``path`` would not open as HDF5, with the hint that fits: h5py's own message
    buries a directory's or a permission's errno in its text, and the corrupt-file hint misled."""
    if os.path.isdir(path):
        return f"{field}: {path!r} is a directory, not an HDF5 file. Name the file itself."
    if not os.access(path, os.R_OK):
        return f"{field}: {path!r} cannot be read (permission denied). Check its permissions: every worker must read it too."
    if exc.errno == errno.EAGAIN or "unable to lock file" in str(exc):
        return (
            f"{field}: {path!r} is locked by another process that has it open for writing (HDF5 file locking, {exc}). "
            f"Wait until the writer closes it; if the writer uses SWMR, or the file sits on a filesystem whose locks "
            f"are stale, set HDF5_USE_FILE_LOCKING=FALSE to read it anyway (only while nothing writes it)."
        )
    return f"{field}: {path!r} cannot be opened as HDF5 ({exc}). Is it a complete, uncorrupted HDF5 file?"


class FileAccess(Protocol):
    """How a source's files are reached (engine.sources.access.Access, which builds on this module)."""

    def open_h5(self, path: str, field: str = ..., what: str = ...) -> h5py.File: ...
    def identity(self, path: str, selection: str) -> SourceIdentity: ...


def inspect_source(path: str, dataset: str, access: FileAccess | None = None) -> tuple[DatasetInfo, SourceIdentity]:
    """Read the dataset's metadata (never its data) and check it is convertible: a local file,
    or through ``access`` (a bucket's, engine.sources.access)."""
    if access is not None:
        with access.open_h5(path, what="HDF5 file") as f:
            info, _ = inspect_dataset(f, path, dataset)
        return info, access.identity(path, dataset)
    if not os.path.exists(path):
        raise SourceNotFoundError(missing(path, "HDF5 file"))
    try:
        f = h5py.File(path, "r")
    except OSError as exc:
        raise SourceError(unopenable(path, exc)) from None
    with f:
        info, _ = inspect_dataset(f, path, dataset)
    stat = os.stat(path)
    return info, SourceIdentity(os.path.abspath(path), dataset, stat.st_size, stat.st_mtime_ns)


def inspect_dataset(f: h5py.File, path: str, dataset: str) -> tuple[DatasetInfo, h5py.Dataset]:
    """The planner's numbers of ``dataset`` in the open file ``f``, and the dataset; refused
    with what the file holds where it is not there, not a dataset, or not convertible."""
    try:
        obj = f[dataset]
    except KeyError:
        if (broken := broken_link(f, dataset)) is not None:
            raise DatasetNotFoundError(f"source.dataset: {dataset!r} in {path!r} is {broken}.") from None
        found = list_datasets(f)
        hint = (
            f" Datasets in the file: {', '.join(found[:8])}{' ...' if len(found) > 8 else ''}."
            if found
            else " The file holds no datasets."
        )
        if "\\" in dataset:  # a Windows habit: HDF5 paths use '/', and repr would double each '\\'
            slashed = "/" + "/".join(p for p in dataset.replace("\\", "/").split("/") if p)
            raise DatasetNotFoundError(
                f"source.dataset: '{dataset}' is not in {path!r}: HDF5 paths are separated by '/', not '\\'. "
                f"Did you mean '{slashed}'?{hint}"
            ) from None
        raise DatasetNotFoundError(f"source.dataset: {dataset!r} is not in {path!r}.{hint}") from None
    except Exception as exc:  # corrupt object headers surface as assorted h5py errors
        if isinstance(exc, SourceError):  # a bucket's read failed under h5py (engine.sources.objects)
            raise
        if isinstance(exc.__context__, SourceError):
            raise exc.__context__ from None
        raise SourceError(
            f"source.dataset: cannot read {dataset!r} in {path!r} ({exc}). The file may be truncated or corrupt."
        ) from None
    if not isinstance(obj, h5py.Dataset):
        inside = list_datasets(obj)
        hint = (
            f"Datasets in it: {', '.join(inside[:8])}{' ...' if len(inside) > 8 else ''}."
            if inside
            else "The group holds no datasets."
        )
        raise DatasetNotFoundError(f"source.dataset: {dataset!r} in {path!r} is a group, not a dataset. {hint}")
    return _describe(obj, path, dataset), obj


def _describe(ds: h5py.Dataset, path: str, name: str) -> DatasetInfo:
    dtype = ds.dtype
    if dtype.kind not in SUPPORTED_KINDS or dtype.fields is not None or dtype.subdtype is not None:
        raise UnsupportedDatasetError(
            f"source.dataset: {name!r} has dtype {dtype} ({dtype_kind(dtype)}); NGFF images hold numbers. "
            f"Expected bool, int8-int64, uint8-uint64 or float16/32/64. Convert it, or choose another dataset."
        )
    if ds.ndim < 2 or ds.ndim > 5:
        raise UnsupportedDatasetError(
            f"source.dataset: {name!r} has {ds.ndim} dimension(s) (shape {ds.shape}); NGFF images have 2 to 5 (yx to tczyx)."
        )
    filters = tuple(filter_names(ds))
    return DatasetInfo(
        shape=tuple(int(n) for n in ds.shape),
        dtype=output_dtype(dtype).str,
        itemsize=dtype.itemsize,
        hdf5_chunks=tuple(ds.chunks) if ds.chunks else None,
        hdf5_filters=filters,
        hdf5_direct_read=direct_read(ds, output_dtype(dtype)),
    )


def dtype_kind(dtype: np.dtype) -> str:
    if dtype.fields is not None:
        return "compound"
    return {
        "S": "bytes string",
        "U": "unicode string",
        "O": "variable-length string or object",
        "c": "complex",
        "V": "opaque",
    }.get(dtype.kind, dtype.kind)


def filter_names(ds: h5py.Dataset) -> list[str]:
    names = []
    try:
        plist = ds.id.get_create_plist()
        for i in range(plist.get_nfilters()):
            names.append(plist.get_filter(i)[3].decode(errors="replace") or str(plist.get_filter(i)[0]))
    except Exception:  # informational only
        pass
    return names


def list_datasets(group: h5py.Group) -> list[str]:
    found: list[str] = []
    # visititems names are relative to the group; users need paths from the file's root.
    prefix = group.name.rstrip("/")
    group.visititems(lambda n, o: found.append(f"{prefix}/{n}") if isinstance(o, h5py.Dataset) else None)
    return found
