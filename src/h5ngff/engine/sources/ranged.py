"""The workers' read of a source in a bucket: a slab's HDF5 chunks as byte ranges.

For each dataset (piece) a slab spans, the reader takes the chunks its region touches from the
index the client read (engine.sources.chunkindex), sorts their byte ranges, and coalesces ranges
whose gap is at most ``gap_bytes`` into requests of at most ``request_bytes`` (a chunk larger than
that is one request of its own). The requests go out ``in_flight`` at a time
(engine.stores.fetches, through the bucket's store), and each body is decoded chunk by chunk
into the slab as it arrives (engine.sources.decode). A chunk never written reads as the fill
value, as HDF5 reads it. A contiguous dataset is read as the runs of bytes the region covers
(one run for a slab of whole rows), cut into requests of at most ``request_bytes``.

Every GET is pinned to the ETag the client saw (If-Match): a replaced object is refused rather
than mixed into the output.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from itertools import product
from typing import Callable, Iterable, Iterator

import numpy as np

from .chunkindex import ChunkIndex
from .decode import ChunkDecoder

#: A request's largest body, unless one chunk is larger (then that chunk alone). Large enough
#: that a request's round trip is small beside its transfer (8 MiB is 80 ms at 100 MB/s against
#: 20-50 ms of latency to AWS), small enough that the bodies in flight stay a small share of a
#: worker (the plan counts in_flight + 1 of them per thread).
REQUEST_BYTES = 8 * 2**20
#: Ranges this close are fetched as one request, the bytes between them read and dropped: a
#: request costs about what 256 KiB of transfer does.
GAP_BYTES = 256 * 1024
#: Requests a reading thread keeps in flight.
IN_FLIGHT = 4

#: fetch(ranges) -> the bodies in order (the bucket's ``fetch``, bound to one object).
Fetch = Callable[[list[tuple[int, int]]], Iterator[bytes]]


@dataclass(frozen=True)
class Request:
    start: int
    length: int
    #: (position in the caller's list of spans, the span's offset inside this request's body).
    members: tuple[tuple[int, int], ...]


def coalesce(spans: list[tuple[int, int]], gap: int, limit: int) -> list[Request]:
    """Requests covering every ``(start, length)`` span: spans sorted by start, neighbours
    merged while the gap between them is at most ``gap`` and the request stays within ``limit``
    (a span longer than ``limit`` is a request of its own; spans may overlap)."""
    requests: list[Request] = []
    start = end = 0
    members: list[int] = []

    def close() -> None:
        requests.append(Request(start, end - start, tuple((j, spans[j][0] - start) for j in members)))

    for i in sorted(range(len(spans)), key=lambda i: spans[i][0]):
        s, n = spans[i]
        if members and s - end <= gap and max(end, s + n) - start <= limit:
            end = max(end, s + n)
        else:
            if members:
                close()
            start, end, members = s, s + n, []
        members.append(i)
    if members:
        close()
    return requests


def read_chunked(
    index: ChunkIndex,
    region: tuple[slice, ...],
    dest: np.ndarray,
    fetch: Fetch,
    gap: int = GAP_BYTES,
    limit: int = REQUEST_BYTES,
) -> int:
    """Read ``region`` of a chunked dataset into ``dest``; returns the requests made."""
    assert index.chunks is not None and index.offsets is not None
    assert index.sizes is not None and index.masks is not None
    chunks = index.chunks
    first = [r.start // c for r, c in zip(region, chunks)]
    last = [-(-r.stop // c) for r, c in zip(region, chunks)]
    fill = np.frombuffer(index.fill, dtype=np.dtype(index.dtype))[0]
    stored: list[tuple[int, ...]] = []
    spans: list[tuple[int, int]] = []
    for at in product(*(range(a, b) for a, b in zip(first, last))):
        local = tuple(a - o for a, o in zip(at, index.origin))
        offset = int(index.offsets[local])
        if offset < 0:
            dest[_overlap(at, chunks, region)[1]] = fill
            continue
        stored.append(at)
        spans.append((offset, int(index.sizes[local])))
    if not spans:
        return 0
    decoder = ChunkDecoder(index)
    requests = coalesce(spans, gap, max(limit, max(n for _, n in spans)))
    bodies = fetch([(r.start, r.length) for r in requests])
    for request, body in zip(requests, bodies):
        view = memoryview(body)
        for i, inside in request.members:
            at = stored[i]
            local = tuple(a - o for a, o in zip(at, index.origin))
            chunk = decoder.decode(view[inside : inside + spans[i][1]], int(index.masks[local]))
            src, dst = _overlap(at, chunks, region)
            dest[dst] = chunk.reshape(chunks)[src]
        del view, body
    return len(requests)


def _overlap(
    at: tuple[int, ...], chunks: tuple[int, ...], region: tuple[slice, ...]
) -> tuple[tuple[slice, ...], tuple[slice, ...]]:
    """(the part of chunk ``at`` inside ``region``, in the chunk; the same part, in ``dest``)."""
    start = [a * c for a, c in zip(at, chunks)]
    inter = [(max(s, r.start), min(s + c, r.stop)) for s, c, r in zip(start, chunks, region)]
    return (
        tuple(slice(a - s, b - s) for (a, b), s in zip(inter, start)),
        tuple(slice(a - r.start, b - r.start) for (a, b), r in zip(inter, region)),
    )


def contiguous_runs(shape: tuple[int, ...], region: tuple[slice, ...]) -> tuple[int, int, Iterable[int]]:
    """The region of a C-ordered array as runs of elements: (how many runs, elements per run,
    the first element of each run in the array), in the order the region's own C order lays
    them out (so run k fills elements [k * run, (k + 1) * run) of the region's buffer)."""
    n = len(shape)
    j = n - 1  # the last axis the region does not span whole; every axis after it is whole
    while j > 0 and region[j].start == 0 and region[j].stop == shape[j]:
        j -= 1
    inner = math.prod(shape[j + 1 :])
    run = (region[j].stop - region[j].start) * inner
    strides = [math.prod(shape[k + 1 :]) for k in range(n)]
    leads = [range(r.start, r.stop) for r in region[:j]]
    count = math.prod(len(r) for r in leads)
    starts = (sum(i * s for i, s in zip(idx, strides)) + region[j].start * strides[j] for idx in product(*leads))
    return count, run, starts


def read_contiguous(
    index: ChunkIndex,
    region: tuple[slice, ...],
    dest: np.ndarray,
    fetch: Fetch,
    gap: int = GAP_BYTES,
    limit: int = REQUEST_BYTES,
) -> int:
    """Read ``region`` of a contiguous (or compact) dataset into ``dest``; returns the requests made."""
    dtype = np.dtype(index.dtype)
    if not dest.flags.c_contiguous:  # slab buffers and their leading-axes views are; anything else via a copy
        whole = np.empty(dest.shape, dest.dtype)
        made = read_contiguous(index, region, whole, fetch, gap, limit)
        dest[...] = whole
        return made
    flat = dest.reshape(-1)
    if index.inline is not None:
        dest[...] = np.frombuffer(index.inline, dtype=dtype).reshape(index.shape)[region]
        return 0
    if index.contiguous_offset < 0:
        dest[...] = np.frombuffer(index.fill, dtype=dtype)[0]
        return 0
    _, run, starts = contiguous_runs(index.shape, region)
    piece = max(1, limit // dtype.itemsize)  # elements per piece: runs longer than a request are cut
    spans: list[tuple[int, int]] = []
    targets: list[int] = []
    for k, first in enumerate(starts):
        for at in range(0, run, piece):
            n = min(piece, run - at)
            spans.append((index.contiguous_offset + (first + at) * dtype.itemsize, n * dtype.itemsize))
            targets.append(k * run + at)
    requests = coalesce(spans, gap, max(limit, dtype.itemsize))
    bodies = fetch([(r.start, r.length) for r in requests])
    for request, body in zip(requests, bodies):
        view = memoryview(body)
        for i, inside in request.members:
            n = spans[i][1] // dtype.itemsize
            flat[targets[i] : targets[i] + n] = np.frombuffer(view[inside : inside + spans[i][1]], dtype=dtype)
        del view, body
    return len(requests)
