"""Metadata conventions of plain HDF5, applied to the axes they describe.

- ``DIMENSION_LABELS`` (h5py ``dims[i].label``, HDF5 dimension scales; written by h5py, MATLAB,
  netCDF-4): the axis names.
- ilastik's ``axistags`` attribute: JSON ``{"axes": [{"key": "z", ...}, ...]}`` in the dataset's
  axis order: the axis names.
- ``element_size_um`` (Fiji's HDF5 plugin, ilastik, many lab scripts): voxel sizes in micrometres.
  Fiji always writes three, z, y, x, even for data with time or channel axes: three values then
  apply to the spatial axes present (a dataset without z, e.g. t, y, x, takes the y and x values;
  the z value is left out and a notice says so). Otherwise one value per axis applies axis by axis.

Where two conventions disagree, or one cannot be applied, the source reports it as a conflict
(a message naming both readings and the flag that decides). The conflict only stops the run
when the user has not set that field: flags and the spec always win over attributes.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

import h5py
import numpy as np

from ...spec import parse_axes

AXIS_NAMES = {
    "t": "t",
    "time": "t",
    "c": "c",
    "ch": "c",
    "channel": "c",
    "channels": "c",
    "z": "z",
    "y": "y",
    "x": "x",
}
_DEFAULT_AXES = {2: "yx", 3: "zyx", 4: "czyx", 5: "tczyx"}


@dataclass
class Physical:
    """What a dataset's attributes say about its axes and voxel sizes."""

    axes: str | None = None
    scale: tuple[float, ...] | None = None
    units: tuple[str, ...] | None = None
    #: Spec field ("image.axes", "image.scale") -> why the attributes cannot decide it.
    conflicts: dict[str, str] = field(default_factory=dict)
    #: Which convention gave what, e.g. "axes 'tzyx' from ilastik axistags".
    found: list[str] = field(default_factory=list)
    #: What the user should hear about how an attribute was applied (the plan's notices).
    notices: list[str] = field(default_factory=list)


def shortest_float32(value: float) -> float:
    """A float32 as the shortest decimal that reads back as the same float32: 0.4, not
    0.4000000059604645. Fiji's ``element_size_um`` and Imaris's extents are float32; the short
    decimal is what was meant."""
    return float(str(np.float32(value)))


def physical_attrs(ds: h5py.Dataset, name: str, axes: str | None = None) -> Physical:
    """What ``ds``'s attributes say. ``axes``: the user's own (``--axes``), which decide which
    axes the voxel sizes belong to."""
    out = Physical()
    readings = [
        (what, axes) for what, axes in (("DIMENSION_LABELS", _labels(ds)), ("ilastik axistags", _axistags(ds))) if axes
    ]
    if len({axes for _, axes in readings}) > 1:
        said = " but ".join(f"{what} say {axes!r}" for what, axes in readings)
        out.conflicts["image.axes"] = f"{name!r}: {said}. Set the axes with --axes (image.axes)."
    elif readings:
        what, axes = readings[0]
        try:
            out.axes = parse_axes(axes)
            out.found.append(f"axes {axes!r} from {what}")
        except ValueError:
            out.conflicts["image.axes"] = (
                f"{name!r}: {what} give the axis order {axes!r}, but OME-Zarr needs t, c, then the spatial axes "
                f"(e.g. 'tczyx'); h5ngff does not transpose. Re-export in that order (ilastik: export with axis order "
                f"'tczyx' or 'czyx'), or set --axes to name the axes as stored."
            )
    _element_size(ds, name, out, axes)
    return out


def _labels(ds: h5py.Dataset) -> str | None:
    labels = [d.label for d in ds.dims] if ds.ndim else []
    if not labels or not all(label.lower() in AXIS_NAMES for label in labels):
        return None
    axes = "".join(AXIS_NAMES[label.lower()] for label in labels)
    return axes if len(set(axes)) == len(axes) else None


def _axistags(ds: h5py.Dataset) -> str | None:
    raw = ds.attrs.get("axistags")
    if raw is None:
        return None
    if isinstance(raw, bytes):
        raw = raw.decode(errors="replace")
    try:
        keys = [a["key"] for a in json.loads(str(raw))["axes"]]
    except (ValueError, KeyError, TypeError):
        return None
    if len(keys) != ds.ndim or not all(k in AXIS_NAMES for k in keys):
        return None
    return "".join(AXIS_NAMES[k] for k in keys)


def _element_size(ds: h5py.Dataset, name: str, out: Physical, user_axes: str | None = None) -> None:
    size = ds.attrs.get("element_size_um")
    if size is None:
        return
    try:
        # Fiji writes float32: its shortest decimal (0.4, not 0.4000000059604645) is what was meant.
        raw = np.atleast_1d(size)
        values = tuple(shortest_float32(v) if raw.dtype == np.float32 else float(str(v)) for v in raw)
    except (TypeError, ValueError):
        out.conflicts["image.scale"] = f"{name!r}: element_size_um is {size!r}, not numbers. Set --scale (image.scale)."
        return
    axes = user_axes if user_axes and len(user_axes) == ds.ndim else out.axes or _DEFAULT_AXES.get(ds.ndim, "")
    spatial = [i for i, a in enumerate(axes) if a in "zyx"]
    if not all(v > 0 and np.isfinite(v) for v in values):
        out.conflicts["image.scale"] = (
            f"{name!r}: element_size_um {list(values)} holds a size that is not positive. Set --scale (image.scale)."
        )
        return
    scale = [1.0] * ds.ndim
    if len(values) == 3 and len(spatial) in (2, 3) and (len(spatial) < ds.ndim or ds.ndim < 3):
        # Fiji's three z, y, x sizes (it writes three whatever the rank): the last ones belong to
        # the spatial axes present, and the time and channel axes get none of them.
        for i, v in zip(spatial, values[-len(spatial) :]):
            scale[i] = v
        if "z" not in axes and len(spatial) < ds.ndim:
            out.notices.append(
                f"{name!r}: element_size_um {list(values)} is z, y, x (Fiji's convention); the dataset's axes are {axes!r}, "
                f"which have no z, so y and x take {list(values[1:])} and the z size {values[0]} is not used. "
                f"Set --scale (image.scale) if the sizes mean something else."
            )
    elif len(values) == ds.ndim:
        scale = list(values)
    else:
        out.conflicts["image.scale"] = (
            f"{name!r}: element_size_um has {len(values)} values {list(values)} for a {ds.ndim}-dimensional dataset "
            f"(axes {axes!r}); expected {ds.ndim}, or 3 (z, y, x). Set --scale (image.scale)."
        )
        return
    out.scale = tuple(scale)
    out.units = tuple("micrometer" if a in "zyx" else "" for a in axes) if len(axes) == ds.ndim else None
    if out.units is None:
        out.scale = None
        return
    out.found.append(f"voxel size {list(values)} um from element_size_um")


def raise_conflicts(physical: Physical, overridden: set[str]) -> None:
    """Stop on a conflict the user has not decided with a flag."""
    from ...errors import SpecError

    for field_name, message in physical.conflicts.items():
        if field_name not in overridden:
            raise SpecError(field_name, message)
