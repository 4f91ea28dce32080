"""The planner's inputs and its frozen output, the Plan.

Numbers in, numbers out: nothing here touches a file, a cluster or a clock.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

from ..units import MiB

Shape = tuple[int, ...]


@dataclass(frozen=True)
class DatasetInfo:
    """What the planner needs to know about the HDF5 dataset (read from metadata only)."""

    shape: Shape
    dtype: str  #: numpy dtype string, e.g. "<f4"
    itemsize: int
    #: HDF5 chunk shape, or None for contiguous storage.
    hdf5_chunks: Shape | None = None
    #: HDF5 filter names in pipeline order, e.g. ("shuffle", "gzip").
    hdf5_filters: tuple[str, ...] = ()
    #: The workers read the HDF5 chunks themselves (``read_direct_chunk`` + libdeflate: deflate is
    #: the only filter, engine.sources.inflate.direct_read decides), so HDF5's chunk cache is never used:
    #: the plan prices one compressed and one decompressed chunk, and no cache.
    hdf5_direct_read: bool = False
    #: Axes, voxel sizes and units found in HDF5 attributes (None where absent).
    attr_axes: str | None = None
    attr_scale: tuple[float, ...] | None = None
    attr_units: tuple[str, ...] | None = None
    #: Channel names and colours (RRGGBB) a container records (Imaris, BigDataViewer), for omero.
    channel_names: tuple[str, ...] | None = None
    channel_colors: tuple[str, ...] | None = None
    #: What the source reader decided that the user should hear (e.g. a voxel size left out);
    #: they join the plan's notices.
    notices: tuple[str, ...] = ()
    #: Files the image is stacked from (engine.sources.files): each thread opens one at a time.
    source_files: int = 1
    #: A source in a bucket (engine.sources.ranged): the ranged GETs each reading thread keeps in
    #: flight, the largest body one GET brings (a coalesced request, or one stored HDF5 chunk
    #: larger than that), the largest stored chunk, and the gap one request may span between two
    #: ranges. 0: a local file, read by HDF5.
    remote_in_flight: int = 0
    remote_request_bytes: int = 0
    remote_stored_chunk_bytes: int = 0
    remote_gap_bytes: int = 0

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.itemsize


@dataclass(frozen=True)
class Capacity:
    """Where the job will run, for the choices that the spec leaves on ``auto``."""

    cores: int
    #: Memory the workers may use in total (local: RAM; Kubernetes: not limiting).
    memory_bytes: int
    #: The worker count for ``workers: auto`` where there is no core count to follow.
    default_workers: int | None = None


@dataclass(frozen=True)
class Level:
    """One resolution level of the pyramid."""

    index: int
    shape: Shape
    #: Downsampling factor relative to level 0, per axis.
    factors: Shape
    scale: tuple[float, ...]
    translation: tuple[float, ...]


@dataclass(frozen=True)
class MemoryTerm:
    name: str
    bytes: int
    why: str


@dataclass(frozen=True)
class Pass:
    """One streaming pass: read slabs of ``source_level`` and write ``levels``.

    Pass 0 reads the HDF5 dataset and writes level 0 and the levels the slab can hold. A later pass
    reads a written level and builds the levels above it.
    """

    index: int
    source_level: int  #: -1 for the HDF5 source
    levels: tuple[int, ...]
    slab: Shape  #: slab shape in the source's coordinates
    grid: Shape  #: number of slabs along each axis
    terms: tuple[MemoryTerm, ...]

    @property
    def n_slabs(self) -> int:
        return math.prod(self.grid)

    @property
    def predicted_peak(self) -> int:
        return sum(t.bytes for t in self.terms)


@dataclass(frozen=True)
class Thresholds:
    """Dask's memory fractions of ``memory_limit``; False disables one."""

    target: float | bool
    spill: float | bool
    pause: float | bool
    terminate: float
    #: The fraction of memory_limit the plan's predicted peak may fill (no pass peaks above it).
    #: No defaults here: both come from MemoryConstants (planned_fraction, monitor_interval),
    #: the figures the memory model was fitted with.
    planned: float
    #: Seconds between the nanny's RSS checks.
    monitor_interval: float


@dataclass(frozen=True)
class WorkerMemory:
    """The memory of one worker: what it will use, what Dask allows, what the pod allows."""

    #: The terms of the pass with the largest prediction (the one that sizes the worker).
    terms: tuple[MemoryTerm, ...]
    predicted_peak: int
    memory_limit: int
    pod_limit: int
    pod_terms: tuple[MemoryTerm, ...]
    thresholds: Thresholds
    #: Why memory_limit is what it is (planned fraction, or the floor of room below terminate).
    memory_limit_why: str = ""


@dataclass(frozen=True)
class Plan:
    """Everything a run needs, decided before it starts."""

    dataset: DatasetInfo
    axes: str
    units: tuple[str, ...]
    dtype: str
    chunks: Shape
    shards: Shape | None
    levels: tuple[Level, ...]
    passes: tuple[Pass, ...]
    workers: int
    threads_per_worker: int
    #: Tasks the client keeps submitted per worker; the rest wait on the client, not the scheduler.
    inflight_per_worker: int
    memory: WorkerMemory
    hdf5_cache_bytes: int
    allocator: str
    notices: tuple[str, ...] = field(default=())
    #: PUTs each worker thread keeps in flight while it encodes the next unit (an object-store
    #: output; 0 writes synchronously, as a directory does). Counted in ``memory``.
    upload_depth: int = 0

    @property
    def n_tasks(self) -> int:
        return sum(p.n_slabs for p in self.passes)

    @property
    def slab(self) -> Shape:
        return self.passes[0].slab

    @property
    def inflight_total(self) -> int:
        return self.workers * self.inflight_per_worker

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["n_tasks"] = self.n_tasks
        d["memory"]["predicted_peak_mib"] = round(self.memory.predicted_peak / MiB, 1)
        d["memory"]["memory_limit_mib"] = round(self.memory.memory_limit / MiB, 1)
        d["memory"]["pod_limit_mib"] = round(self.memory.pod_limit / MiB, 1)
        for p, pd in zip(self.passes, d["passes"]):
            pd["n_slabs"] = p.n_slabs
            pd["predicted_peak"] = p.predicted_peak
        return d
