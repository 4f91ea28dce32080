"""Pure builders of OME-NGFF metadata (0.4 and 0.5) from a Plan and the data's min/max."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from ... import __version__
from ...planner.layout import level_steps
from ...planner.model import Plan
from ...spec import AXIS_TYPES, ConversionSpec

_COLORS = ("FFFFFF", "00FF00", "FF00FF", "00FFFF", "FF0000", "0000FF", "FFFF00")


def axes_metadata(plan: Plan) -> list[dict[str, Any]]:
    axes = []
    for name, unit in zip(plan.axes, plan.units):
        entry: dict[str, Any] = {"name": name, "type": AXIS_TYPES[name]}
        if unit:
            entry["unit"] = unit
        axes.append(entry)
    return axes


def datasets_metadata(plan: Plan) -> list[dict[str, Any]]:
    datasets = []
    for level in plan.levels:
        transforms: list[dict[str, Any]] = [{"type": "scale", "scale": list(level.scale)}]
        if any(level.translation):
            transforms.append({"type": "translation", "translation": list(level.translation)})
        datasets.append({"path": str(level.index), "coordinateTransformations": transforms})
    return datasets


def description(plan: Plan, spec: ConversionSpec) -> str:
    """'2x mean downsampling along zyx', or per level where the steps differ (anisotropy rule):
    '2x mean downsampling along yx, yx, zyx' (level 1, 2, 3)."""
    steps = ["".join(a for a, d in zip(plan.axes, step) if d) or "no axis" for step in level_steps(plan.levels)]
    if len(set(steps)) > 1:
        return f"2x {spec.pyramid.method} downsampling along {', '.join(steps)} (levels 1 to {len(steps)})"
    return f"2x {spec.pyramid.method} downsampling along {steps[0] if steps else 'no axis'}"


def multiscale(plan: Plan, spec: ConversionSpec) -> dict[str, Any]:
    return {
        "name": spec.image.name or spec.source.dataset.strip("/").replace("/", "_") or "image",
        "axes": axes_metadata(plan),
        "datasets": datasets_metadata(plan),
        "type": spec.pyramid.method,
        "metadata": {
            "description": description(plan, spec),
            "method": "h5ngff.engine.write.downsample",
            "version": __version__,
        },
    }


def omero(plan: Plan, windows: list[tuple[float, ...]]) -> dict[str, Any]:
    """Channel rendering hints. ``windows`` holds (min, max, start, end) per channel: min/max is
    the data's exact range (the viewer's slider range), start/end the rendering window, the 0.1 %
    and 99.9 % quantiles (engine.write.window). A (min, max) pair is its own window."""
    kind = plan.dataset.dtype[1] if len(plan.dataset.dtype) > 1 else "f"
    channels = []
    # A container's own channel names and colours, where it records one per channel.
    names = plan.dataset.channel_names if len(plan.dataset.channel_names or ()) == len(windows) else None
    colors = plan.dataset.channel_colors if len(plan.dataset.channel_colors or ()) == len(windows) else None
    for i, window in enumerate(windows):
        low, high, start, end = window if len(window) == 4 else (*window, *window)
        low, high = _json_number(low, kind), _json_number(high, kind)
        start, end = _json_number(start, kind, math.floor), _json_number(end, kind, math.ceil)
        channels.append(
            {
                "label": names[i] if names and names[i] else f"Channel {i}",
                "color": colors[i] if colors else _COLORS[i % len(_COLORS)] if len(windows) > 1 else "FFFFFF",
                "active": True,
                "coefficient": 1.0,
                "family": "linear",
                "inverted": False,
                "window": {"min": low, "max": high, "start": start, "end": end},
            }
        )
    z = plan.axes.find("z")
    rdefs: dict[str, Any] = {"model": "color" if len(windows) > 1 else "greyscale", "defaultT": 0}
    if z >= 0:
        rdefs["defaultZ"] = plan.levels[0].shape[z] // 2
    return {"channels": channels, "rdefs": rdefs}


def _json_number(value: float, kind: str, to_int: Callable[[float], float] = int) -> float | int:
    # JSON has no NaN or Infinity; windows are taken over finite values, 0 where none exist.
    if not math.isfinite(value):
        return 0.0
    return int(to_int(value)) if kind in "iub" else float(value)


def root_attributes(
    plan: Plan, spec: ConversionSpec, windows: list[tuple[float, ...]], zarr_format: int
) -> dict[str, Any]:
    ms = multiscale(plan, spec)
    om = omero(plan, windows)
    # The whole source spec (stack axes, BDV tile...): verify --source rebuilds the same composite.
    # Never its storage options: they may hold credentials, and the output is read by others.
    source = {k: v for k, v in spec.source.to_wire().items() if k != "storageOptions"}
    provenance = {"version": __version__, "source": source}
    if zarr_format == 2:
        ms = {"version": "0.4", **ms}
        om = {"version": "0.4", **om}
        return {"multiscales": [ms], "omero": om, "h5ngff": provenance}
    return {"ome": {"version": "0.5", "multiscales": [ms], "omero": om}, "h5ngff": provenance}
