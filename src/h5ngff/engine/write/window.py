"""The omero window: quantiles of a sampled histogram gathered while level 0 is written.

A single hot pixel decides the min and max of an image, so a window from min/max can show a
viewer a black image. The window's ``start``/``end`` are the 0.1 % and 99.9 % quantiles of the
level-0 values (per channel); ``min``/``max`` stay the exact data range, the viewer's slider range.

**The documented approximation.** Counting every voxel costs as much as encoding it (np.bincount
measured 1 ms per 64^3 uint16 chunk, more than blosc's encode), so each chunk contributes a
regular sample: every ``STRIDE``-th element of the chunk in C order, starting at its first. The
sample is a deterministic function of the chunk's data, so a resumed run ends with the same window
as an uninterrupted one. Values are binned into 65536 bins:

- unsigned integers and bools up to 16 bits: one bin per value (exact on the sample);
- signed integers up to 16 bits: one bin per value, offset by 32768;
- everything else (floats, 32/64-bit integers): the value as float32, binned by its top 16 bits
  mapped to an order-preserving key (sign, exponent and 7 mantissa bits): a bin spans 2^-7 of
  its value, so ``start`` is rounded down and ``end`` up by at most 0.8 % (then clamped to the
  exact min/max). NaN and +-Inf (and values beyond float32's range) are left out.

Each slab task writes its sparse per-channel counts to ``.h5ngff/hist/`` beside the manifest; the
driver merges the counts of every slab the manifest records when it writes the metadata.
"""

from __future__ import annotations

import io
import math
import sys
from typing import Any, Iterable

import numpy as np
import numpy.typing as npt

from ...planner.memory import WINDOW_SAMPLE_STRIDE
from . import faults
from ..stores import Store

#: One element in this many of each chunk is counted (prime, so a sample walks diagonally
#: through a chunk instead of down one column); 127 keeps the cost near 1 % of the run. The
#: planner's "window histogram" term holds the memory this costs.
STRIDE = WINDOW_SAMPLE_STRIDE
#: The window's start and end: these quantiles of the sampled values.
QUANTILE = 0.001
BINS = 1 << 16
#: Float keys at or below / at or above these hold NaN or +-Inf (exponent all ones).
_FLOAT_LOW_NONFINITE = 0x007F
_FLOAT_HIGH_NONFINITE = 0xFF80
_HIGH_HALF = 1 if sys.byteorder == "little" else 0


def key_mode(dtype: npt.DTypeLike) -> str:
    """'u' (one bin per value), 's' (one bin per value, offset) or 'f' (float32 top-16-bit keys)."""
    dt = np.dtype(dtype)
    if dt.kind in "bu" and dt.itemsize <= 2:
        return "u"
    if dt.kind == "i" and dt.itemsize <= 2:
        return "s"
    return "f"


def sample_keys(block: np.ndarray, mode: str) -> np.ndarray:
    """The bin keys (uint16) of every STRIDE-th element of ``block`` in C order."""
    # ravel, not reshape: an edge block one element wide along its last axis (a (k, 1) slice of
    # a chunk) reshapes to a strided view, which the uint16 view below cannot reinterpret; ravel
    # copies exactly when the elements are not contiguous, and is a view for the usual chunk copy.
    flat = np.ravel(block)
    if mode == "u":
        return flat[::STRIDE].astype(np.uint16)
    if mode == "s":
        return flat[::STRIDE].astype(np.int16).view(np.uint16) ^ np.uint16(0x8000)
    if flat.dtype == np.float32 and flat.dtype.isnative:
        high = flat.view(np.uint16)[_HIGH_HALF :: 2 * STRIDE]
    else:
        with np.errstate(over="ignore", invalid="ignore"):
            high = flat[::STRIDE].astype(np.float32).view(np.uint16)[_HIGH_HALF::2]
    # Order-preserving: positive floats get the sign bit set, negative ones are inverted.
    sign = (high.view(np.int16) >> 15).view(np.uint16)
    return high ^ (sign | np.uint16(0x8000))


def _float_of(bits: int) -> float:
    return float(np.array([bits], dtype=np.uint32).view(np.float32)[0])


def bin_range(key: int, mode: str) -> tuple[float, float]:
    """The smallest and largest value a bin holds."""
    if mode == "u":
        return float(key), float(key)
    if mode == "s":
        return float(key - 32768), float(key - 32768)
    high = key ^ 0x8000 if key & 0x8000 else key ^ 0xFFFF
    a, b = _float_of(high << 16), _float_of((high << 16) | 0xFFFF)
    return min(a, b), max(a, b)


def quantile_window(counts: np.ndarray, mode: str, low: float, high: float, q: float = QUANTILE) -> tuple[float, float]:
    """(start, end): the ``q`` and ``1 - q`` quantiles of the counted values, widened to whole bins
    and clamped to the exact [low, high]. (low, high) when nothing was counted."""
    counts = counts.astype(np.int64, copy=True)
    if mode == "f":
        counts[: _FLOAT_LOW_NONFINITE + 1] = 0
        counts[_FLOAT_HIGH_NONFINITE:] = 0
    cumulative = np.cumsum(counts)
    total = int(cumulative[-1])
    if not total:
        return low, high
    first = int(np.searchsorted(cumulative, q * total, side="right"))
    last = int(np.searchsorted(cumulative, (1 - q) * total, side="left"))
    start, end = bin_range(first, mode)[0], bin_range(last, mode)[1]
    start, end = min(max(start, low), high), max(min(end, high), low)
    return (start, end) if start <= end else (low, high)


class SampledHistogram:
    """Bin keys sampled per channel while a slab's chunks are written; counted once per slab
    (one np.bincount over the slab's samples costs a fraction of one per chunk)."""

    def __init__(self, dtype: npt.DTypeLike) -> None:
        self.mode = key_mode(dtype)
        self.samples: dict[int, list[np.ndarray]] = {}

    def add(self, channel: int, block: np.ndarray) -> None:
        self.samples.setdefault(channel, []).append(sample_keys(block, self.mode))

    def sparse(self) -> dict[int, tuple[np.ndarray, np.ndarray]]:
        """channel -> (keys, counts) of the non-empty bins; the samples are released."""
        out = {}
        for channel in sorted(self.samples):
            counts = np.bincount(np.concatenate(self.samples.pop(channel)), minlength=BINS)
            keys = np.flatnonzero(counts).astype(np.uint16)
            out[channel] = (keys, counts[keys].astype(np.uint32))
        return out


def histogram_key(stats_dir: str, pass_index: int, slab: tuple[int, ...]) -> str:
    """The key of one slab's histogram in the output's store, under ``stats_dir``."""
    return f"{stats_dir}/p{pass_index}-" + ".".join(str(i) for i in slab) + ".npz"


def write_histogram(store: Store, key: str, mode: str, sparse: dict[int, tuple[np.ndarray, np.ndarray]]) -> None:
    """One slab's sparse counts, stored whole (a killed task leaves no half file)."""
    arrays: dict[str, Any] = {"mode": np.array(mode)}
    for channel, (keys, counts) in sparse.items():
        arrays[f"keys{channel}"], arrays[f"counts{channel}"] = keys, counts
    buf = io.BytesIO()
    np.savez(buf, **arrays)
    with store.writer(key) as f:
        f.write(buf.getbuffer())
        faults.before_rename()


def merged_counts(paths: Iterable[Any], channels: int) -> tuple[str | None, list[np.ndarray]]:
    """The dense counts per channel summed over the given per-slab files."""
    mode, dense = None, [np.zeros(BINS, dtype=np.int64) for _ in range(channels)]
    for path in paths:
        with np.load(path) as f:
            mode = str(f["mode"])
            for channel in range(channels):
                if f"keys{channel}" in f:
                    dense[channel][f[f"keys{channel}"].astype(np.intp)] += f[
                        f"counts{channel}"
                    ]  # keys are unique per file
    return mode, dense


def windows(
    ranges: list[tuple[float, float]], paths: Iterable[Any], q: float = QUANTILE
) -> list[tuple[float, float, float, float]]:
    """(min, max, start, end) per channel: the exact range and the quantile window inside it."""
    mode, dense = merged_counts(paths, len(ranges))
    out = []
    for (low, high), counts in zip(ranges, dense):
        start, end = quantile_window(counts, mode, low, high, q) if mode and math.isfinite(low) else (low, high)
        out.append((low, high, start, end))
    return out
