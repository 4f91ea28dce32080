"""One image from many files: each file's image stacked along a new leading axis.

Microscopes write one file per time point, channel or plane. ``source.paths`` (in the order
given) or a glob in ``source.path`` (natural order: t2 before t10) names the files, and
``source.stack`` the new axis: ``t``, ``c`` or ``z`` (2-D planes into a volume). Each file is read
by the reader its container needs (a plain dataset, an Imaris file, a BigDataViewer setup), so
every file must hold the same image: the same shape, dtype, axes and voxel size. The first file
that differs is named with how it differs, before anything is written.

The new axis goes first: the files' own axes follow it (``t`` + ``czyx``), which must be an NGFF
order (t, c, then the spatial axes). Channel names and colours: stacked along ``c``, each file's
own (where its container records them); otherwise the first file's.

The workers read each file only for the slabs that span it, opened for that slab and closed after
it (``base.SlabSource.piece_files``): a worker never holds hundreds of files open, and the plan
prices one open file per thread. A conversion's identity covers every file (path, size, mtime):
a file changed, added or removed since is refused on resume.
"""

from __future__ import annotations

import math
import os
import re
from dataclasses import replace
from typing import Callable

from ...errors import SourceNotFoundError, SpecError, UnsupportedDatasetError
from ...planner.model import DatasetInfo
from ...spec import ConversionSpec, parse_axes
from .access import Access
from .base import Opened, SlabSource
from .hdf5 import SourceIdentity, missing
from .remote import RemoteLayout

#: The axes a source of that many dimensions gets when its container names none (the planner's).
_DEFAULT_AXES = {2: "yx", 3: "zyx", 4: "czyx"}


def file_list(spec: ConversionSpec, access: Access) -> list[str]:
    """The files of a stack in order: ``source.paths`` as given, or the glob in ``source.path`` in
    natural order (a bucket is listed under the pattern's prefix). A glob matching nothing, and a
    listed file that is missing, are refused."""
    source = spec.source
    if source.paths:
        for path in source.paths:
            if not access.exists(path):
                raise SourceNotFoundError(missing(path, "file", "source.paths"))
        return list(source.paths)
    found = sorted(access.glob(source.path), key=_natural)
    if not found:
        where = "" if access.remote(source.path) else f" (from {os.getcwd()!r})"
        raise SourceNotFoundError(
            f"source.path: the glob {source.path!r} matches no file{where}. Check the directory and "
            f"the quoting (quote the pattern so the shell does not expand it)."
        )
    return found


def _natural(text: str) -> list[object]:
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", text)]


def open_file_stack(spec: ConversionSpec, open_one: Callable[[ConversionSpec], Opened], access: Access) -> Opened:
    """Describe the stack: each file opened by ``open_one`` (metadata only), checked against the
    first, and joined into one source."""
    files = file_list(spec, access)
    axis = spec.source.stack or ""
    single = spec.source.model_copy(update={"paths": None, "stack": None})
    opened = [open_one(spec.model_copy(update={"source": single.model_copy(update={"path": f})})) for f in files]
    first = opened[0]
    for path, other in zip(files[1:], opened[1:]):
        _check_same(files[0], first, path, other)
    axes = _axes(axis, first.info, spec)
    info = _joined_info(axis, axes, opened)
    reader = first.reader
    pieces = tuple(p for o in opened for p in o.reader.pieces)
    piece_files = tuple(o.reader.path for o in opened for _ in o.reader.pieces)
    joined = SlabSource(
        files[0],
        pieces,
        (len(files), *reader.lead_shape),
        reader.inner_shape,
        reader.dtype,
        reader.storage_dtype,
        0,
        piece_files=piece_files,
        remote=_joined_remote([o.reader.remote for o in opened]),
    )
    described = f"{spec.source.dataset} of {len(files)} file(s) stacked along {axis}"
    identities = [o.identity for o in opened]
    return Opened(info, _identity(identities, described), joined, f"{first.kind} files", first.conflicts)


def _joined_remote(layouts: list[RemoteLayout | None]) -> RemoteLayout | None:
    """Objects in a bucket: every file's pieces, each with its own object, ETag and index."""
    if not layouts or any(layout is None for layout in layouts):
        return None
    present = [layout for layout in layouts if layout is not None]
    return replace(
        present[0],
        urls=tuple(u for layout in present for u in layout.urls),
        etags=tuple(e for layout in present for e in layout.etags),
        indexes=tuple(i for layout in present for i in layout.indexes),
    )


def _check_same(first_path: str, first: Opened, path: str, other: Opened) -> None:
    """Refuse a file whose image differs from the first's, saying how."""
    a, b = first.info, other.info
    checks = [
        ("shape", a.shape, b.shape),
        ("dtype", a.dtype, b.dtype),
        ("axes", a.attr_axes, b.attr_axes),
        ("voxel size", a.attr_scale, b.attr_scale),
        ("units", a.attr_units, b.attr_units),
        ("layout", (first.reader.inner_shape, first.reader.storage_dtype), (other.reader.inner_shape, other.reader.storage_dtype)),
    ]  # fmt: skip
    for what, mine, theirs in checks:
        if not _same(mine, theirs):
            raise UnsupportedDatasetError(
                f"source: the files must hold one image each of the same {what}, but {path!r} has {what} {theirs} "
                f"where {first_path!r}, the first, has {mine}. Stack files of one acquisition, or convert "
                f"{path!r} on its own."
            )


def _same(a: object, b: object) -> bool:
    if isinstance(a, tuple) and isinstance(b, tuple) and len(a) == len(b):
        return all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, float) and isinstance(b, float):
        return math.isclose(a, b, rel_tol=1e-6)
    return a == b


def _axes(axis: str, info: DatasetInfo, spec: ConversionSpec) -> str | None:
    """The stack's axes: the new one, then the files'. None where --axes decides them."""
    inner = info.attr_axes or _DEFAULT_AXES.get(info.ndim)
    if inner is None or info.ndim + 1 > 5:
        raise UnsupportedDatasetError(
            f"source.stack: stacking files of {info.ndim}-dimensional images along {axis!r} gives {info.ndim + 1} "
            f"dimensions; NGFF images have 2 to 5."
        )
    try:
        return parse_axes(axis + inner)
    except ValueError:
        if spec.image.axes:
            return None
        raise SpecError(
            "source.stack",
            f"Stacking files whose images are {inner!r} along {axis!r} gives {axis + inner!r}, which is not an NGFF "
            f"axis order (t, c, then 2-3 spatial axes). Stack along another axis (t, c, or z for 2-D images), or set --axes.",
        ) from None


def _joined_info(axis: str, axes: str | None, opened: list[Opened]) -> DatasetInfo:
    first = opened[0].info
    names, colors = first.channel_names, first.channel_colors
    if axis == "c":  # each file is a channel: its own name and colour, where its container has them
        per_file = [o.info.channel_names for o in opened]
        names = tuple(n for ns in per_file for n in ns) if all(per_file) else None  # type: ignore[union-attr]
        per_colors = [o.info.channel_colors for o in opened]
        colors = tuple(c for cs in per_colors for c in cs) if all(per_colors) else None  # type: ignore[union-attr]
    return replace(
        first,
        shape=(len(opened), *first.shape),
        hdf5_chunks=(1, *first.hdf5_chunks) if first.hdf5_chunks else None,
        hdf5_direct_read=all(o.info.hdf5_direct_read for o in opened),
        attr_axes=axes,
        attr_scale=(1.0, *first.attr_scale) if first.attr_scale else None,
        attr_units=("", *first.attr_units) if first.attr_units else None,
        channel_names=names,
        channel_colors=colors,
        source_files=len(opened),
    )


def _identity(identities: list[SourceIdentity], described: str) -> SourceIdentity:
    """What must not change before a resume: every file's path, size and mtime (an object's
    URL, size and ETag), as each file's own description saw it."""
    return SourceIdentity(
        identities[0].path,
        described,
        sum(i.size for i in identities),
        max(i.mtime_ns for i in identities),
        files=tuple((i.path, i.size, i.etag or i.mtime_ns) for i in identities),
    )
