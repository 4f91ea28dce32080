"""The omero window: start/end are quantiles of a sampled histogram, min/max the exact range.

Issue 16: one hot pixel at 65535 over a background of 200 made the window 200..65535, which a
viewer shows as a black image."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

from conftest import spec_for, write_h5
from formats_fixtures import read_by_independent_clients
from h5ngff.engine.write.window import BINS, STRIDE, SampledHistogram, bin_range, key_mode, quantile_window, sample_keys


def _window(out: str, channel: int = 0) -> dict:
    with open(os.path.join(out, "zarr.json")) as f:
        return json.load(f)["attributes"]["ome"]["omero"]["channels"][channel]["window"]


@pytest.mark.slow
@pytest.mark.integration
def test_hot_pixel_does_not_set_the_window(tmp_path, convert):
    rng = np.random.default_rng(3)
    data = (200 + rng.integers(0, 3, size=(40, 96, 96))).astype("uint16")  # background 200..202
    data[0, 0, 0] = 65535  # the first element of a chunk: always in the sample
    h5 = write_h5(tmp_path / "in.h5", data)
    out = str(tmp_path / "out.ome.zarr")
    convert(spec_for(h5, out, output={"chunks": [16, 32, 32]}, pyramid={"levels": 2}))
    window = _window(out)
    assert (window["min"], window["max"]) == (200, 65535)  # the viewer's range: exact min and max
    assert 200 <= window["start"] <= window["end"] <= 202, window
    # Negative control: the old window (start/end = min/max) is what made the image black.
    assert (window["min"], window["max"]) != (window["start"], window["end"])
    read_by_independent_clients(out, data)  # ome-zarr-models validates the metadata; both readers read it


@pytest.mark.parametrize("dtype", ["uint8", "uint16", "int16", "float32", "float64", "int32", "uint64"])
def test_quantile_window_matches_numpy_within_one_bin(dtype):
    """Against np.quantile of the same sample: exact for <=16-bit integers, within one bin
    (2^-7 relative) for the rest; start rounded down, end rounded up."""
    rng = np.random.default_rng(0)
    values = rng.normal(1000, 300, size=(33, 64, 61))
    if np.dtype(dtype).kind == "u":
        values = np.abs(values)
    block = values.astype(dtype)
    hist = SampledHistogram(dtype)
    hist.add(0, block)
    [(keys, counts)] = hist.sparse().values()
    dense = np.zeros(BINS, dtype=np.int64)
    dense[keys] = counts
    low, high = float(block.min()), float(block.max())
    start, end = quantile_window(dense, key_mode(dtype), low, high)
    sample = block.reshape(-1)[::STRIDE].astype(np.float64)
    want_start, want_end = np.quantile(sample, [0.001, 0.999], method="inverted_cdf")
    if key_mode(dtype) in "us":
        assert (start, end) == (want_start, want_end)
    else:
        assert want_start * (1 - 2**-7) - 1e-9 <= start <= want_start
        assert want_end <= end <= want_end * (1 + 2**-7) + 1e-9


@pytest.mark.slow
def test_float_keys_preserve_order_and_skip_non_finite():
    values = np.array([-np.inf, -3e38, -1.5, -1e-30, -0.0, 0.0, 1e-30, 2.5, 3e38, np.inf], dtype=np.float32)
    keys = sample_keys(np.repeat(values, STRIDE), "f").astype(np.int64)
    assert list(keys) == sorted(keys)
    for key, value in zip(keys[1:-1], values[1:-1]):
        lo, hi = bin_range(int(key), "f")
        assert lo <= value <= hi
    dense = np.zeros(BINS, dtype=np.int64)
    np.add.at(dense, keys, 1)
    dense[sample_keys(np.full(STRIDE, np.nan, dtype=np.float32), "f")[0]] += 100  # NaN left out
    start, end = quantile_window(dense, "f", -3e38, 3e38, q=0.0)
    assert start == pytest.approx(-3e38, rel=1e-2) and end == pytest.approx(3e38, rel=1e-2)
