"""Imaris ``.ims`` (the Imaris 5.5 file format, HDF5 inside).

What is read from where:
- data: ``/DataSet/ResolutionLevel 0/TimePoint t/Channel c/Data``, (z, y, x), one dataset per time
  point and channel. Datasets are padded to whole blocks beyond the image; only
  ``[0:Z, 0:Y, 0:X]`` is read. The lower ``ResolutionLevel``s are not used: h5ngff builds its own
  exact pyramid (Imaris's are not NGFF's 2x mean).
- size: ``/DataSetInfo/Image`` attributes ``X``, ``Y``, ``Z``; each channel's own
  ``ImageSizeX/Y/Z`` must agree with it.
- voxel size: ``(ExtMax_i - ExtMin_i) / size`` for i = 0, 1, 2 (x, y, z), in ``Unit`` (default um).
- channel names and colours: ``/DataSetInfo/Channel c`` attributes ``Name`` and ``Color``
  ("r g b", 0 to 1), written to ``omero``.

Imaris stores every attribute as an array of one-byte strings (``[b'5', b'1', b'2']``).
Axes: t (when more than one time point), c (when more than one channel), z, y, x.
"""

from __future__ import annotations

import re

import h5py
import numpy as np

from ...errors import SourceError, UnsupportedDatasetError
from ...spec import ConversionSpec
from .access import Access
from .base import Opened, SlabSource, check_dtype, composite_info
from .conventions import shortest_float32

#: Units as Imaris and BigDataViewer write them (lower case) -> NGFF. Micro is written with the
#: micro sign (U+00B5) or the Greek mu (U+03BC): both are accepted.
UNITS = {
    "um": "micrometer",
    "\u00b5m": "micrometer",
    "\u03bcm": "micrometer",
    "micron": "micrometer",
    "micrometer": "micrometer",
    "nm": "nanometer",
    "nanometer": "nanometer",
    "mm": "millimeter",
    "millimeter": "millimeter",
    "m": "meter",
}


def text(attrs: h5py.AttributeManager, name: str) -> str | None:
    """An Imaris attribute as text: an array of one-byte strings, or (other writers) bytes or str."""
    if name not in attrs:
        return None
    value = attrs[name]
    if isinstance(value, np.ndarray):
        return _decode(b"".join(v if isinstance(v, bytes) else str(v).encode() for v in value.ravel())).strip()
    return (_decode(value) if isinstance(value, bytes) else str(value)).strip()


def _decode(raw: bytes) -> str:
    """UTF-8 (a Greek mu, U+03BC, is two one-byte strings), else Latin-1: Windows writers store
    the micro sign as the single byte 0xB5."""
    try:
        return raw.decode()
    except UnicodeDecodeError:
        return raw.decode("latin-1")


def number(attrs: h5py.AttributeManager, name: str, where: str) -> float:
    value = text(attrs, name)
    try:
        return float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        raise SourceError(
            f"source.path: the Imaris attribute {where} {name} is {value!r}, not a number. The file is not a complete Imaris 5.5 file."
        ) from None


def _indices(group: h5py.Group, prefix: str) -> list[int]:
    found = sorted(int(m.group(1)) for k in group if (m := re.fullmatch(prefix + r" (\d+)", k)))
    return found


def data_path(t: int, c: int, level: int = 0) -> str:
    return f"/DataSet/ResolutionLevel {level}/TimePoint {t}/Channel {c}/Data"


def open_imaris(spec: ConversionSpec, access: Access) -> Opened:
    path = spec.source.path
    with access.open_h5(path) as f:
        image = f["DataSetInfo/Image"].attrs if "DataSetInfo/Image" in f else None
        if image is None or "ResolutionLevel 0" not in f["DataSet"]:
            raise SourceError(
                f"source.path: {path!r} has /DataSet but no /DataSetInfo/Image or ResolutionLevel 0: not a complete Imaris file."
            )
        size = tuple(int(number(image, a, "DataSetInfo/Image")) for a in ("Z", "Y", "X"))
        level0 = f["DataSet/ResolutionLevel 0"]
        times = _indices(level0, "TimePoint")
        channels = _indices(level0[f"TimePoint {times[0]}"], "Channel") if times else []
        if not channels or times != list(range(len(times))) or channels != list(range(len(channels))):
            raise SourceError(
                f"source.path: {path!r} holds time points {times} and channels {channels} at ResolutionLevel 0; expected 0..T-1 and 0..C-1."
            )
        datasets = [_channel_data(f, t, c, size, path) for t in times for c in channels]
        dtype = datasets[0].dtype
        check_dtype(dtype, "the Imaris data")
        for (t, c), ds in zip(((t, c) for t in times for c in channels), datasets):
            if ds.dtype != dtype:
                raise UnsupportedDatasetError(
                    f"source.path: Imaris time point {t} channel {c} is {ds.dtype}, time point 0 channel 0 is {dtype}; one image needs one dtype."
                )
        scale, units, conflicts = _voxel(image, size)
        names, colors = _channels(f, channels)
        lead_shape = tuple(n for n in (len(times), len(channels)) if n > 1)
        lead_axes = ("t" if len(times) > 1 else "") + ("c" if len(channels) > 1 else "")
        info = composite_info(
            lead_shape,
            size,
            dtype,
            datasets,
            attr_axes=lead_axes + "zyx",
            attr_scale=(1.0,) * len(lead_axes) + scale,
            attr_units=("",) * len(lead_axes) + units,
            channel_names=names,
            channel_colors=colors,
        )
        pieces = tuple(data_path(t, c) for t in times for c in channels)
        remote = access.layout(path, pieces, datasets)
    reader = SlabSource(path, pieces, lead_shape, size, info.dtype, None, 0, remote=remote)
    return Opened(
        info,
        access.identity(path, f"imaris ResolutionLevel 0: {len(times)} time point(s), {len(channels)} channel(s)"),
        reader,
        "imaris",
        conflicts,
    )


def _channel_data(f: h5py.File, t: int, c: int, size: tuple[int, ...], path: str) -> h5py.Dataset:
    name = data_path(t, c)
    ds = f.get(name)
    if not isinstance(ds, h5py.Dataset):
        raise SourceError(f"source.path: {path!r} lacks {name}: every time point needs every channel.")
    own = f[name].parent.attrs
    if all(k in own for k in ("ImageSizeX", "ImageSizeY", "ImageSizeZ")):
        csize = tuple(int(number(own, f"ImageSize{a}", name)) for a in "ZYX")
        if csize != size:
            raise UnsupportedDatasetError(
                f"source.path: Imaris time point {t} channel {c} is {csize} (z, y, x) but the image is {size}: one OME-Zarr image needs "
                f"equal sizes. Convert that channel alone: {path}:'{name}' (its blocks include padding), or resample it in Imaris."
            )
    if ds.ndim != 3 or any(d < s for d, s in zip(ds.shape, size)):
        raise SourceError(
            f"source.path: {name} has shape {ds.shape}, smaller than the image size {size} (z, y, x): the file is damaged."
        )
    return ds


def _voxel(
    image: h5py.AttributeManager, size: tuple[int, ...]
) -> tuple[tuple[float, ...], tuple[str, ...], tuple[tuple[str, str], ...]]:
    """Voxel sizes (z, y, x), their units, and an unknown unit as a conflict the flags decide."""
    scale = []
    for axis, n in zip((2, 1, 0), size):  # ExtMin0 is x, ExtMin2 is z
        # Imaris keeps the extents as float32 (ImarisWriter writes ExtMax0="60.900001526"), and
        # so the voxel size: each is read at its shortest float32 decimal (60.9 / 609 = 0.1).
        low, high = (shortest_float32(number(image, f"{k}{axis}", "DataSetInfo/Image")) for k in ("ExtMin", "ExtMax"))
        extent = high - low
        scale.append(shortest_float32(abs(extent) / n) if extent else 1.0)
    unit = (text(image, "Unit") or "um").lower()
    if unit not in UNITS:
        return tuple(scale), ("",) * 3, (("image.units", unknown_unit("Imaris", unit)),)
    return tuple(scale), (UNITS[unit],) * 3, ()


def unknown_unit(what: str, unit: str) -> str:
    return (
        f"source.path: the {what} unit {unit!r} is not one h5ngff maps to NGFF; expected one of {sorted(UNITS)}. "
        f"Set --units (image.units), and --scale (image.scale) to give the sizes in that unit."
    )


def _channels(f: h5py.File, channels: list[int]) -> tuple[tuple[str, ...], tuple[str, ...] | None]:
    names, colors = [], []
    for c in channels:
        group = f.get(f"DataSetInfo/Channel {c}")
        attrs = group.attrs if group is not None else {}
        names.append(text(attrs, "Name") or "")
        colors.append(_hex(text(attrs, "Color")))
    return tuple(names), tuple(c for c in colors if c) if all(colors) else None


def _hex(rgb: str | None) -> str | None:
    """Imaris's "r g b" in 0..1 as NGFF's RRGGBB."""
    try:
        values = [float(v) for v in (rgb or "").split()]
    except ValueError:
        return None
    if len(values) != 3:
        return None
    return "".join(f"{round(min(max(v, 0.0), 1.0) * 255):02X}" for v in values)
