"""A source in a bucket as the workers read it: each piece's object, ETag and chunk index.

The client builds a ``RemoteLayout`` once, while it describes the source (engine.sources.access:
h5py reads the metadata over byte ranges and ``chunkindex.read_index`` walks each dataset's chunk
B-tree). It travels inside the ``SlabSource``: each slab task carries only its part
(``around``), and a worker reads its slab's chunks as byte ranges (engine.sources.ranged),
never opening the file with HDF5.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from itertools import product

import numpy as np

from .chunkindex import ChunkIndex
from .objects import Bucket
from .ranged import GAP_BYTES, IN_FLIGHT, REQUEST_BYTES, read_chunked, read_contiguous


@dataclass(frozen=True, eq=False)
class RemoteLayout:
    bucket: Bucket
    #: Per piece (the SlabSource's pieces, in order): the object's URL and the ETag the client
    #: saw (every GET is pinned to it), and the dataset's index; None for a piece a task's slab
    #: does not span (``around``).
    urls: tuple[str, ...]
    etags: tuple[str, ...]
    indexes: tuple[ChunkIndex | None, ...]
    #: GETs each reading thread keeps in flight, the largest request body, and the gap between
    #: two ranges that one request spans (engine.sources.ranged; the plan counts them).
    in_flight: int = IN_FLIGHT
    request_bytes: int = REQUEST_BYTES
    gap_bytes: int = GAP_BYTES

    @property
    def largest_stored(self) -> int:
        """The largest stored chunk of any piece (0 for unchunked storage)."""
        return max((i.largest_stored for i in self.indexes if i is not None), default=0)

    @property
    def largest_request(self) -> int:
        """The largest body one GET brings: a request, or one stored chunk larger than that."""
        return max(self.request_bytes, self.largest_stored)

    def around(self, lead_shape: tuple[int, ...], region: tuple[slice, ...]) -> "RemoteLayout":
        """What a read of ``region`` (the SlabSource's coordinates) needs: the spanned pieces'
        indexes cut to the region's chunks, the others dropped."""
        n = len(lead_shape)
        lead, inner = region[:n], region[n:]
        spanned = {
            int(np.ravel_multi_index(i, lead_shape)) if n else 0
            for i in product(*(range(r.start, r.stop) for r in lead))
        }
        indexes = tuple(
            index.around(inner) if index is not None and k in spanned else None for k, index in enumerate(self.indexes)
        )
        return replace(self, indexes=indexes)

    def read_piece(self, piece: int, region: tuple[slice, ...], dest: np.ndarray) -> int:
        """Read ``region`` of piece ``piece`` into ``dest``; returns the GETs made."""
        index = self.indexes[piece]
        assert index is not None, "a slab task carries the index of every piece its slab spans"
        url, etag = self.urls[piece], self.etags[piece]

        def fetch(ranges: list[tuple[int, int]]):  # type: ignore[no-untyped-def]
            return self.bucket.fetch(url, ranges, self.in_flight, etag or None)

        if index.chunks is None:
            return read_contiguous(index, region, dest, fetch, self.gap_bytes, self.request_bytes)
        return read_chunked(index, region, dest, fetch, self.gap_bytes, self.request_bytes)
