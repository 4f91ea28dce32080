"""A plain dataset, and several datasets of one file stacked along new leading axes.

Stacked datasets are named in ``source.dataset`` by
- ranges: ``/ch{0..2}`` (one new axis), ``/t{0..1}/channel{0..2}`` (two: t, then c);
- a list: ``/red,/green,/blue``;
- a glob: ``/ch*`` (matched against every dataset path, in natural order: ch2 before ch10).

``source.stack`` names the new axes (default ``c`` for one, ``tc`` for two). Every dataset must
have the same shape and dtype; the first dataset's attributes give the trailing axes' names and
voxel sizes.
"""

from __future__ import annotations

import fnmatch
import re
from dataclasses import replace
from itertools import product

import h5py

from ...errors import DatasetNotFoundError, SpecError, UnsupportedDatasetError
from ...spec import ConversionSpec, parse_axes
from .access import Access
from .hdf5 import inspect_dataset, list_datasets
from .base import Opened, SlabSource, check_dtype, composite_info
from .conventions import Physical, physical_attrs, raise_conflicts

_RANGE = re.compile(r"\{(\d+)\.\.(\d+)\}")
_DEFAULT_INNER = {2: "yx", 3: "zyx", 4: "czyx"}


def is_selection(dataset: str) -> bool:
    """Whether ``dataset`` names several datasets (a range, list or glob) rather than one."""
    return bool(_RANGE.search(dataset)) or "," in dataset or any(ch in dataset for ch in "*?[")


def overridden(spec: ConversionSpec) -> set[str]:
    return {f"image.{k}" for k in ("axes", "scale", "units") if getattr(spec.image, k)}


def _notices(physical: Physical, spec: ConversionSpec) -> tuple[str, ...]:
    """The attributes' notices, unless the user's flags decided what they are about."""
    return () if spec.image.scale else tuple(physical.notices)


def open_plain(spec: ConversionSpec, access: Access) -> Opened:
    path, dataset = spec.source.path, spec.source.dataset
    with access.open_h5(path, what="HDF5 file") as f:
        info, ds = inspect_dataset(f, path, dataset)
        physical = physical_attrs(ds, dataset, spec.image.axes)
        remote = access.layout(path, [dataset], [ds])
    ident = access.identity(path, dataset)
    raise_conflicts(physical, overridden(spec))
    info = replace(
        info,
        attr_axes=physical.axes,
        attr_scale=physical.scale,
        attr_units=physical.units,
        notices=_notices(physical, spec),
    )
    reader = SlabSource(path, (dataset,), (), info.shape, info.dtype, None, 0, remote=remote)
    return Opened(info, ident, reader, "plain")


def expand(f: h5py.File, selection: str) -> tuple[list[str], tuple[int, ...]]:
    """The dataset paths a selection names, in C order over the new axes, and those axes' sizes."""
    ranges = _RANGE.findall(selection)
    if ranges:
        bounds = [(int(a), int(b)) for a, b in ranges]
        bad = [f"{{{a}..{b}}}" for a, b in bounds if b < a]
        if bad:
            raise SpecError(
                "source.dataset",
                f"Expected ranges {{first..last}} with first <= last. Got {bad[0]} in {selection!r} instead.",
            )
        parts = _RANGE.split(selection)[::3]
        names = []
        for values in product(*(range(a, b + 1) for a, b in bounds)):
            name = parts[0] + "".join(str(v) + p for v, p in zip(values, parts[1:]))
            names.append(name if name.startswith("/") else "/" + name)
        return names, tuple(b - a + 1 for a, b in bounds)
    if "," in selection:
        names = ["/" + n.strip().lstrip("/") for n in selection.split(",") if n.strip()]
        return names, (len(names),)
    pattern = selection if selection.startswith("/") else "/" + selection
    names = sorted((n for n in list_datasets(f) if fnmatch.fnmatchcase(n, pattern)), key=_natural)
    if not names:
        listed = ", ".join(list_datasets(f)[:8])
        raise DatasetNotFoundError(
            f"source.dataset: the glob {selection!r} matches no dataset in {f.filename!r}. Datasets in it: {listed}."
        )
    return names, (len(names),)


def _natural(name: str) -> list[int | str]:
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", name)]


def open_stacked(spec: ConversionSpec, access: Access) -> Opened:
    path, selection = spec.source.path, spec.source.dataset
    with access.open_h5(path) as f:
        names, lead_shape = expand(f, selection)
        datasets = [_dataset(f, n, selection) for n in names]
        _check_agree(names, datasets)
        first = datasets[0]
        check_dtype(first.dtype, repr(names[0]))
        stack = spec.source.stack or ("c" if len(lead_shape) == 1 else "tc"[: len(lead_shape)])
        if len(stack) != len(lead_shape):
            raise SpecError(
                "source.stack",
                f"Expected one axis per range in {selection!r} ({len(lead_shape)}). Got {stack!r} instead.",
            )
        inner_axes = (
            spec.image.axes[len(stack) :]
            if spec.image.axes and len(spec.image.axes) == len(stack) + first.ndim
            else None
        )
        physical = physical_attrs(first, names[0], inner_axes)
        raise_conflicts(physical, overridden(spec))
        axes, scale, units = _stacked_axes(stack, first.ndim, physical, spec)
        info = composite_info(
            lead_shape,
            tuple(first.shape),
            first.dtype,
            datasets,
            attr_axes=axes,
            attr_scale=scale,
            attr_units=units,
            notices=_notices(physical, spec),
        )
        remote = access.layout(path, names, datasets)
    described = f"{','.join(names)} stacked along {stack}"
    reader = SlabSource(path, tuple(names), lead_shape, tuple(first.shape), info.dtype, None, 0, remote=remote)
    return Opened(info, access.identity(path, described), reader, "stacked")


def _dataset(f: h5py.File, name: str, selection: str) -> h5py.Dataset:
    obj = f.get(name)
    if not isinstance(obj, h5py.Dataset):
        what = "is a group" if obj is not None else "does not exist"
        listed = ", ".join(list_datasets(f)[:8])
        raise DatasetNotFoundError(
            f"source.dataset: {name!r} (from {selection!r}) {what} in {f.filename!r}. Datasets in it: {listed}."
        )
    return obj


def _check_agree(names: list[str], datasets: list[h5py.Dataset]) -> None:
    first = datasets[0]
    for name, ds in zip(names[1:], datasets[1:]):
        if ds.shape != first.shape:
            raise UnsupportedDatasetError(
                f"source.dataset: stacked datasets must have one shape, but {name!r} has shape {ds.shape} and {names[0]!r} has {first.shape}. "
                f"Select datasets of equal shape."
            )
        if ds.dtype != first.dtype:
            raise UnsupportedDatasetError(
                f"source.dataset: stacked datasets must have one dtype, but {name!r} is {ds.dtype} and {names[0]!r} is {first.dtype}. "
                f"Select datasets of equal dtype, or convert one."
            )


def _stacked_axes(
    stack: str, inner_ndim: int, physical: Physical, spec: ConversionSpec
) -> tuple[str | None, tuple[float, ...] | None, tuple[str, ...] | None]:
    inner = physical.axes or _DEFAULT_INNER.get(inner_ndim)
    if inner is None or inner_ndim + len(stack) > 5:
        raise UnsupportedDatasetError(
            f"source.dataset: stacking {inner_ndim}-dimensional datasets along {stack!r} gives {inner_ndim + len(stack)} dimensions; NGFF images have 2 to 5."
        )
    try:
        axes = parse_axes(stack + inner)
    except ValueError:
        if spec.image.axes:
            return None, None, None
        raise SpecError(
            "source.stack",
            f"Stacking along {stack!r} datasets whose axes are {inner!r} gives {stack + inner!r}, which is not an NGFF axis order "
            f"(t, c, then 2-3 spatial axes). Stack along another axis (--stack-axis t or c), or set --axes.",
        ) from None
    scale = (1.0,) * len(stack) + physical.scale if physical.scale else None
    units = ("",) * len(stack) + physical.units if physical.units else None
    return axes, scale, units
