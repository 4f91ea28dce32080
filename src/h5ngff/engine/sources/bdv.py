"""BigDataViewer / BigStitcher: an XML file describing views, and the HDF5 file holding them.

What is read from where:
- the XML (``dataset.xml``; given directly, or found beside ``dataset.h5`` with the same name):
  ``ImageLoader`` (format ``bdv.hdf5``) names the HDF5 file; each ``ViewSetup`` gives its ``size``
  (x y z), ``voxelSize`` (unit, x y z) and ``attributes`` (illumination, channel, tile, angle);
  ``Attributes name="channel"`` gives channel names; ``Timepoints`` (range, list or pattern) the time point ids;
  ``MissingViews`` the views that are absent.
- the data: ``t{TTTTT}/s{SS}/0/cells`` (z, y, x), resolution level 0 of each view. BDV's own
  lower levels are not used: h5ngff builds its exact 2x pyramid.
- the dtype: BDV stores uint16 as int16 (its HDF5 convention); a setup group's ``dataType``
  attribute names other types (uint8, float32). The int16 bytes are reinterpreted, not converted.

One OME-Zarr image is one tile, angle and illumination: its channels (setups that differ only in
channel) become c and its time points t. A file with several tiles, angles or illuminations is
refused with what it holds and the flag that selects one (``--tile``, ``--angle``,
``--illumination``): a stitched or fused image needs the registrations, which h5ngff does not
apply. Registration transforms (``ViewRegistrations``) are not read.
"""

from __future__ import annotations

import os
import xml.etree.ElementTree as ET
from dataclasses import dataclass

import h5py
import numpy as np

from ...errors import SourceError, SourceNotFoundError, SpecError, UnsupportedDatasetError
from ...spec import ConversionSpec
from .access import Access
from .base import Opened, SlabSource, check_dtype, composite_info
from .hdf5 import missing
from .objects import join_url
from .imaris import UNITS, unknown_unit

_SELECTORS = ("illumination", "tile", "angle")
_NO_UNIT = {"px", "pixel", "pixels", ""}


@dataclass(frozen=True)
class Setup:
    id: int
    size: tuple[int, int, int]  # z, y, x
    voxel: tuple[float, float, float]  # z, y, x
    unit: str
    attributes: dict[str, int]


def xml_pair(path: str, access: Access) -> tuple[str, str, ET.Element]:
    """(xml, h5, the XML's root) of a BDV dataset named by either file. In a bucket the HDF5
    object is named relative to the XML's key, as a relative path is to the XML's directory."""
    if path.lower().endswith(".xml"):
        xml = path
    else:
        xml = os.path.splitext(path)[0] + ".xml"
        if not access.exists(xml):
            raise SourceNotFoundError(
                f"source.path: {path!r} looks like BigDataViewer HDF5 (t00000/s00) but {xml!r} is missing; the XML holds the setups and voxel sizes. Give the .xml."
            )
    if not access.exists(xml):
        raise SourceNotFoundError(missing(xml, "BigDataViewer XML"))
    try:
        root = ET.fromstring(access.read_bytes(xml))
    except ET.ParseError as exc:
        raise SourceError(f"source.path: {xml!r} is not valid XML ({exc}).") from None
    loader = root.find("SequenceDescription/ImageLoader")
    fmt = loader.get("format") if loader is not None else None
    h5 = loader.find("hdf5") if loader is not None else None
    if fmt != "bdv.hdf5" or h5 is None:
        raise UnsupportedDatasetError(
            f"source.path: {xml!r} uses the image loader {fmt!r}; h5ngff reads 'bdv.hdf5' (BigDataViewer HDF5). Re-save it as HDF5 in Fiji (BigDataViewer > Export Current Image as XML/HDF5)."
        )
    name = (h5.text or "").strip()
    if h5.get("type", "relative") == "relative":
        base = root.find("BasePath")
        relative = (
            (base.text or ".").strip() if base is not None and base.get("type", "relative") == "relative" else "."
        )
        if access.remote(xml):
            return xml, join_url(xml, f"{relative}/{name}"), root
        basedir = os.path.join(os.path.dirname(os.path.abspath(xml)), relative)
        name = os.path.normpath(os.path.join(basedir, name))
    elif access.remote(xml):
        raise UnsupportedDatasetError(
            f"source.path: {xml!r} names its HDF5 file by the absolute path {name!r}, which is not in the bucket. "
            f"Save the XML with a relative path to the HDF5 file (BigDataViewer's default)."
        )
    return xml, name, root


def _ints(text: str | None) -> list[int]:
    return [int(float(v)) for v in (text or "").split()]


def _text(element: ET.Element, tag: str | None = None) -> str:
    """The text of ``element`` (or of its child ``tag``) where the BDV format requires one."""
    text = element.text if tag is None else element.findtext(tag)
    if text is None:
        raise SourceError(
            f"source.path: the BigDataViewer XML has a <{element.tag}> without {'text' if tag is None else f'<{tag}>'}."
        )
    return text


def _attribute(element: ET.Element, name: str) -> str:
    value = element.get(name)
    if value is None:
        raise SourceError(f"source.path: the BigDataViewer XML has a <{element.tag}> without its {name!r} attribute.")
    return value


def _setups(root: ET.Element) -> list[Setup]:
    setups = []
    for vs in root.findall("SequenceDescription/ViewSetups/ViewSetup"):
        x, y, z = _ints(vs.findtext("size"))
        vox = vs.find("voxelSize")
        vx, vy, vz = (float(v) for v in _text(vox, "size").split()) if vox is not None else (1.0, 1.0, 1.0)
        unit = (vox.findtext("unit") or "").strip() if vox is not None else ""
        found = vs.find("attributes")
        attrs = {a.tag: int(_text(a)) for a in (list(found) if found is not None else [])}
        setups.append(Setup(int(_text(vs, "id")), (z, y, x), (vz, vy, vx), unit, attrs))
    return setups


def _timepoints(root: ET.Element, xml: str = "") -> list[int]:
    """The time point ids, ascending: t index i of the image is the HDF5 group ``t{ids[i]:05d}``.

    BigDataViewer's XML (spim_data ``XmlIoTimePoints``) writes ``type="range"`` as ``<first>`` and
    ``<last>``; ``type="list"`` as ``<Timepoint><id/><name/></Timepoint>`` children (whenever the ids
    are not a contiguous range, e.g. 0 and 2); ``type="pattern"`` as ``<integerpattern>``
    ("0-10:2, 15")."""
    tp = root.find("SequenceDescription/Timepoints")
    if tp is None:
        return [0]
    kind = tp.get("type")
    try:
        if kind == "range":
            first, last = int(_required(tp, "first")), int(_required(tp, "last"))
            ids = list(range(first, last + 1))
        elif kind == "list":
            ids = [int(_required(t, "id")) for t in tp.findall("Timepoint")]
        elif kind == "pattern":
            ids = _integer_pattern(_required(tp, "integerpattern"))
        else:
            raise UnsupportedDatasetError(
                f"source.path: {xml!r}: BigDataViewer time points of type {kind!r} are not read; expected 'range', 'list' or 'pattern'."
            )
    except ValueError as exc:
        raise SourceError(f"source.path: {xml!r}: the Timepoints (type {kind!r}) cannot be read: {exc}.") from None
    if not ids:
        raise SourceError(f"source.path: {xml!r}: the Timepoints (type {kind!r}) list no time point.")
    if len(set(ids)) != len(ids):
        raise SourceError(f"source.path: {xml!r}: the Timepoints (type {kind!r}) list a time point twice: {ids}.")
    return sorted(ids)


def _required(element: ET.Element, tag: str) -> str:
    value = element.findtext(tag)
    if value is None or not value.strip():
        raise ValueError(f"<{tag}> is missing or empty")
    return value.strip()


def _integer_pattern(pattern: str) -> list[int]:
    """spim_data's IntegerPattern: comma-separated ids and ranges ``a-b`` or ``a-b:step``."""
    ids: list[int] = []
    for part in (p.strip() for p in pattern.split(",")):
        if not part:
            continue
        span, _, step = part.partition(":")
        first, dash, last = span.strip().partition("-")
        if not dash:
            ids.append(int(first))
            continue
        by = int(step) if step else 1
        if by < 1 or int(last) < int(first):
            raise ValueError(f"{part!r} is not a range first-last[:step]")
        ids.extend(range(int(first), int(last) + 1, by))
    return ids


def _select(setups: list[Setup], spec: ConversionSpec, xml: str) -> list[Setup]:
    """The setups of one tile, angle and illumination, one per channel, in channel order."""
    chosen = [
        s
        for s in setups
        if all(getattr(spec.source, k) is None or s.attributes.get(k, 0) == getattr(spec.source, k) for k in _SELECTORS)
    ]
    if not chosen:
        asked = ", ".join(f"{k} {getattr(spec.source, k)}" for k in _SELECTORS if getattr(spec.source, k) is not None)
        raise SpecError("source", f"{xml!r} holds no setup with {asked}. {_holds(setups)}")
    several = {k: sorted({s.attributes.get(k, 0) for s in chosen}) for k in _SELECTORS}
    several = {k: v for k, v in several.items() if len(v) > 1}
    if several:
        flags = " ".join(f"--{k} {v[0]}" for k, v in several.items())
        raise SpecError(
            "source",
            f"{xml!r} holds several views per channel and time point. {_holds(setups)} One OME-Zarr image holds one tile, angle and "
            f"illumination (h5ngff does not stitch or fuse). Convert one at a time, e.g. {flags} (spec: source.{'/'.join(several)}).",
        )
    chosen.sort(key=lambda s: s.attributes.get("channel", 0))
    ids = [s.attributes.get("channel", 0) for s in chosen]
    if len(set(ids)) != len(ids):
        raise UnsupportedDatasetError(
            f"source.path: {xml!r} has several setups for one channel ({ids}) after selection; select one with --tile/--angle/--illumination."
        )
    return chosen


def _holds(setups: list[Setup]) -> str:
    counts = []
    for k in ("channel",) + _SELECTORS:
        values = sorted({s.attributes.get(k, 0) for s in setups})
        counts.append(f"{len(values)} {k}(s) {values}")
    return f"It holds {len(setups)} setup(s): {', '.join(counts)}."


def open_bdv(spec: ConversionSpec, access: Access) -> Opened:
    xml, h5, root = xml_pair(spec.source.path, access)
    setups = _select(_setups(root), spec, xml)
    times = _timepoints(root, xml)
    missing = {
        (int(_attribute(m, "timepoint")), int(_attribute(m, "setup")))
        for m in root.findall("SequenceDescription/MissingViews/MissingView")
    }
    gaps = [(t, s.id) for t in times for s in setups if (t, s.id) in missing]
    if gaps:
        raise UnsupportedDatasetError(
            f"source.path: {xml!r} marks views as missing (time point, setup): {gaps[:5]}; an OME-Zarr image needs every channel at every time point."
        )
    _agree(setups, xml)
    size, first = setups[0].size, setups[0]
    pieces = tuple(f"/t{t:05d}/s{s.id:02d}/0/cells" for t in times for s in setups)
    with access.open_h5(h5) as f:
        datasets = [_cells(f, p, size, h5) for p in pieces]
        dtype, storage = _dtype(f, setups[0].id, datasets[0])
        check_dtype(dtype, "the BigDataViewer data")
        names = _channel_names(root, setups)
        lead_shape = tuple(n for n in (len(times), len(setups)) if n > 1)
        lead_axes = ("t" if len(times) > 1 else "") + ("c" if len(setups) > 1 else "")
        unit = first.unit.lower()
        conflicts = (
            ()
            if unit in UNITS or unit in _NO_UNIT
            else (("image.units", unknown_unit("BigDataViewer voxel", first.unit)),)
        )
        info = composite_info(
            lead_shape,
            size,
            dtype,
            datasets,
            read_dtype=storage,
            attr_axes=lead_axes + "zyx",
            attr_scale=(1.0,) * len(lead_axes) + first.voxel,
            attr_units=("",) * len(lead_axes) + ((UNITS[unit],) * 3 if unit in UNITS else ("",) * 3),
            channel_names=names,
        )
        remote = access.layout(h5, pieces, datasets)
    reader = SlabSource(
        h5, pieces, lead_shape, size, info.dtype, storage.str if storage is not None else None, 0, remote=remote
    )
    contiguous = times == list(range(times[0], times[-1] + 1))
    described = f"bdv {os.path.basename(xml)}: setups {[s.id for s in setups]}, time points {f'{times[0]}..{times[-1]}' if contiguous else times}"
    return Opened(info, access.identity(h5, described), reader, "bdv", conflicts)


def _agree(setups: list[Setup], xml: str) -> None:
    first = setups[0]
    for s in setups[1:]:
        if s.size != first.size:
            raise UnsupportedDatasetError(
                f"source.path: {xml!r}: setup {s.id} is {s.size} (z, y, x), setup {first.id} is {first.size}; channels of one image need one size."
            )
        if s.voxel != first.voxel or s.unit != first.unit:
            raise UnsupportedDatasetError(
                f"source.path: {xml!r}: setup {s.id} has voxel size {s.voxel} {s.unit}, setup {first.id} has {first.voxel} {first.unit}; channels of one image need one voxel size."
            )


def _cells(f: h5py.File, name: str, size: tuple[int, ...], h5: str) -> h5py.Dataset:
    ds = f.get(name)
    if not isinstance(ds, h5py.Dataset):
        raise SourceError(f"source.path: {h5!r} lacks {name}, which the XML lists. Is the XML for this HDF5 file?")
    if tuple(ds.shape) != size:
        raise SourceError(
            f"source.path: {h5!r}:{name} has shape {ds.shape}, the XML says {size} (z, y, x). Is the XML for this HDF5 file?"
        )
    return ds


def _dtype(f: h5py.File, setup: int, ds: h5py.Dataset) -> tuple[np.dtype, np.dtype | None]:
    """The image dtype, and the stored dtype where the bytes are reinterpreted."""
    group = f.get(f"s{setup:02d}")
    declared = group.attrs.get("dataType") if group is not None else None
    if declared is not None:
        name = declared.decode() if isinstance(declared, bytes) else str(declared)
        dtype = np.dtype(name)
        if dtype != ds.dtype and dtype.itemsize != ds.dtype.itemsize:
            raise UnsupportedDatasetError(f"source.path: setup {setup} declares dataType {name} but stores {ds.dtype}.")
        return dtype, (ds.dtype if dtype != ds.dtype else None)
    if ds.dtype == np.dtype("int16"):
        return np.dtype("uint16"), ds.dtype  # BDV's convention: uint16 stored as int16
    return ds.dtype, None


def _channel_names(root: ET.Element, setups: list[Setup]) -> tuple[str, ...] | None:
    names = {
        int(_text(c, "id")): (c.findtext("name") or "").strip()
        for c in root.findall("SequenceDescription/ViewSetups/Attributes[@name='channel']/Channel")
    }
    if not names:
        return None
    return tuple(names.get(s.attributes.get("channel", 0), "") for s in setups)
