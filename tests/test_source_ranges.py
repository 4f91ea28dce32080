"""The pure parts of the bucket read path (engine.sources.ranged), against brute force: coalesced
requests cover every span once within the limits, and a contiguous region's runs are exactly the
region's elements in its own C order. Negative controls: a request list that drops or splits a
span, and runs of the wrong axis, are caught by the same checks."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from h5ngff.engine.sources.ranged import Request, coalesce, contiguous_runs


def problems(spans: list[tuple[int, int]], requests: list[Request], gap: int, limit: int) -> list[str]:
    """What is wrong with ``requests`` for ``spans`` (empty: nothing)."""
    out = []
    placed = [i for r in requests for i, _ in r.members]
    if sorted(placed) != list(range(len(spans))):
        out.append(f"spans placed {sorted(placed)}, expected each of {len(spans)} once")
    for r in requests:
        for i, inside in r.members:
            s, n = spans[i]
            if inside != s - r.start or s < r.start or s + n > r.start + r.length:
                out.append(f"span {i} {spans[i]} not inside request {r.start}+{r.length} at {inside}")
        if r.length > limit and len(r.members) > 1:
            out.append(f"request of {r.length} bytes and several spans exceeds {limit}")
        covered = sorted(spans[i] for i, _ in r.members)
        end = covered[0][0]
        for s, n in covered:
            if s - end > gap:
                out.append(f"a gap of {s - end} bytes inside one request")
            end = max(end, s + n)
    starts = [r.start for r in requests]
    if starts != sorted(starts):
        out.append("requests out of order")
    return out


spans_strategy = st.lists(st.tuples(st.integers(0, 10_000), st.integers(1, 600)), min_size=0, max_size=40)


@settings(max_examples=200, deadline=None)
@given(spans=spans_strategy, gap=st.integers(0, 500), limit=st.integers(1, 3000))
def test_coalesced_requests_cover_every_span_within_the_gap_and_limit(spans, gap, limit):
    requests = coalesce(spans, gap, limit)
    assert problems(spans, requests, gap, limit) == []
    if spans and gap >= 10_600 and limit >= 10_600:  # everything fits one request
        assert len(requests) == 1


def test_negative_controls_a_dropped_or_misplaced_span_is_named():
    spans = [(0, 10), (15, 10), (1000, 5)]
    good = coalesce(spans, gap=8, limit=100)
    assert problems(spans, good, 8, 100) == [] and len(good) == 2
    dropped = [Request(good[0].start, good[0].length, good[0].members[:1]), good[1]]
    assert problems(spans, dropped, 8, 100)
    shifted = [Request(good[0].start + 1, good[0].length, good[0].members), good[1]]
    assert problems(spans, shifted, 8, 100)
    assert problems(spans, [Request(0, 1005, tuple((i, s) for i, (s, _) in enumerate(spans)))], 8, 2000)


@settings(max_examples=200, deadline=None)
@given(data=st.data())
def test_contiguous_runs_are_the_regions_elements_in_c_order(data):
    ndim = data.draw(st.integers(1, 4))
    shape = tuple(data.draw(st.lists(st.integers(1, 6), min_size=ndim, max_size=ndim)))
    region = []
    for n in shape:
        a = data.draw(st.integers(0, n - 1))
        b = data.draw(st.integers(a + 1, n))
        region.append(slice(a, b))
    region = tuple(region)
    flat = np.arange(int(np.prod(shape))).reshape(shape)
    np.testing.assert_array_equal(_elements(shape, region), flat[region].ravel())


def _elements(shape, region):
    count, run, starts = contiguous_runs(shape, region)
    return np.concatenate([np.arange(s, s + run) for s in starts]) if count else np.array([], dtype=int)


def test_negative_control_runs_of_another_region_are_not_this_regions():
    flat = np.arange(3 * 4 * 5).reshape(3, 4, 5)
    region = (slice(1, 3), slice(0, 4), slice(1, 4))
    np.testing.assert_array_equal(_elements(flat.shape, region), flat[region].ravel())
    whole_rows = (slice(1, 3), slice(0, 4), slice(0, 5))  # the last axis taken whole by mistake
    assert not np.array_equal(_elements(flat.shape, whole_rows), flat[region].ravel())
    assert contiguous_runs(flat.shape, whole_rows)[0] == 1  # a slab of whole rows is one run
