"""The pyramid's arithmetic against an independent reference, for every dtype, odd edges included."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from h5ngff.engine.write import downsample as ds
from reference import reference_level

DTYPES = [
    "int8",
    "uint8",
    "int16",
    "uint16",
    "int32",
    "uint32",
    "int64",
    "uint64",
    "float16",
    "float32",
    "float64",
    "bool",
]


def random_data(shape, dtype, rng) -> np.ndarray:
    dt = np.dtype(dtype)
    if dt.kind == "b":
        return rng.integers(0, 2, size=shape).astype(bool)
    if dt.kind in "iu":
        info = np.iinfo(dt)
        data = rng.integers(info.min, info.max, size=shape, dtype=dt, endpoint=True)
        data.flat[:2] = [info.min, info.max]  # the extremes, where overflow would show
        return data
    return (rng.standard_normal(shape) * 1000).astype(dt)


def assert_same(got: np.ndarray, want: np.ndarray) -> None:
    assert got.dtype == want.dtype and got.shape == want.shape
    if got.dtype == np.float64:
        # float64 sums of 8 values round differently in another summation order (near-cancelling
        # sums most of all); the engine sums in float64 as documented, so allow rounding noise only.
        finite = np.isfinite(want)
        scale = max(1.0, float(np.abs(want[finite]).max())) if finite.any() else 1.0
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-13 * scale)
    else:
        np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("method", ["mean", "max", "nearest"])
def test_every_dtype_matches_reference_on_odd_shapes(dtype, method):
    rng = np.random.default_rng(1)
    data = random_data((5, 7, 9), dtype, rng)
    for downsampled in [(True, True, True), (False, True, True), (True, False, False)]:
        assert_same(ds.downsample(data, downsampled, method), reference_level(data, downsampled, method))


def test_integer_mean_rounds_half_to_even():
    data = np.array([[1, 2], [3, 4]], dtype=np.uint8)  # mean 2.5 -> 2
    assert ds.downsample(data, (True, True), "mean")[0, 0] == 2
    data = np.array([[3, 4], [5, 6]], dtype=np.uint8)  # mean 4.5 -> 4
    assert ds.downsample(data, (True, True), "mean")[0, 0] == 4
    data = np.array([[3, 4], [5, 7]], dtype=np.int16)  # 4.75 -> 5
    assert ds.downsample(data, (True, True), "mean")[0, 0] == 5
    data = np.array([[-3, -4], [-5, -6]], dtype=np.int8)  # -4.5 -> -4
    assert ds.downsample(data, (True, True), "mean")[0, 0] == -4


def test_uint64_mean_is_exact_where_float64_is_not():
    top = np.iinfo(np.uint64).max
    # mean = top - 1.5; of its neighbours top - 2 (odd) and top - 1 (even), half-to-even picks top - 1
    data = np.array([[top, top - 1], [top - 2, top - 3]], dtype=np.uint64)
    got = ds.downsample(data, (True, True), "mean")[0, 0]
    assert int(got) == top - 1
    # float64 cannot even represent the inputs: its mean lands on 2**64, outside uint64.
    assert int(np.float64(data.astype(np.float64).mean())) != top - 1


def test_odd_edge_is_the_mean_of_the_voxels_that_exist():
    data = np.arange(3 * 3, dtype=np.float32).reshape(3, 3)
    out = ds.downsample(data, (True, True), "mean")
    assert out.shape == (2, 2)
    assert out[1, 1] == data[2, 2]  # a lone corner voxel is its own mean, not diluted by padding
    assert out[0, 1] == np.float32((data[0, 2] + data[1, 2]) / 2)


def test_nan_propagates_through_mean_and_max():
    data = np.ones((4, 4), dtype=np.float32)
    data[0, 0] = np.nan
    assert np.isnan(ds.downsample(data, (True, True), "mean")[0, 0])
    assert np.isnan(ds.downsample(data, (True, True), "max")[0, 0])
    assert ds.downsample(data, (True, True), "mean")[1, 1] == 1


def test_strips_give_the_same_result_as_one_pass(monkeypatch):
    rng = np.random.default_rng(2)
    data = random_data((9, 10, 11), "uint16", rng)
    whole = ds.downsample(data, (True, True, True), "mean")
    monkeypatch.setattr(ds, "STRIP_ELEMENTS", 7)  # many tiny strips
    assert_same(ds.downsample(data, (True, True, True), "mean"), whole)


@settings(max_examples=60, deadline=None)
@given(
    shape=st.lists(st.integers(1, 7), min_size=2, max_size=4).map(tuple),
    dtype=st.sampled_from(["uint8", "int16", "int64", "uint64", "float32", "bool"]),
    method=st.sampled_from(["mean", "max", "nearest"]),
    seed=st.integers(0, 1000),
    mask=st.integers(1, 15),
)
def test_property_matches_reference(shape, dtype, method, seed, mask):
    downsampled = tuple(bool(mask >> i & 1) for i in range(len(shape)))
    if not any(downsampled):
        downsampled = (True,) + downsampled[1:]
    data = random_data(shape, dtype, np.random.default_rng(seed))
    assert_same(ds.downsample(data, downsampled, method), reference_level(data, downsampled, method))


def test_reference_catches_a_wrong_mean():
    """Negative control: the reference is not a copy of the engine; an off-by-one edge rule differs."""
    data = np.arange(15, dtype=np.float32).reshape(3, 5)
    padded_mean = np.pad(data, ((0, 1), (0, 1))).reshape(2, 2, 3, 2).mean(axis=(1, 3)).astype(np.float32)
    assert not np.array_equal(padded_mean, reference_level(data, (True, True), "mean"))
