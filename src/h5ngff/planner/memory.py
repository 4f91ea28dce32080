"""The memory model: every byte a worker needs, as named terms.

A worker's peak RSS is predicted as the sum of the terms of :func:`pass_terms`. The Dask
``memory_limit`` and the pod limit are derived from it by :func:`worker_memory`. The constants
are measured, not guessed: ``bench/calibrate`` runs real conversions under cgroup limits and
``docs/memory-model.md`` records the figures. Override them with a calibration file
(``h5ngff plan --calibration FILE``) where your machines differ.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any

from ..errors import SpecError
from ..units import MiB
from .model import MemoryTerm, Thresholds, WorkerMemory

BLOSC_MAX_OVERHEAD = 16
#: Output elements the downsampler (engine.write.downsample) computes at a time: one definition for
#: the engine that uses it and the memory model that prices it.
STRIP_ELEMENTS = 1 << 16
#: 8-byte temporaries per output element while a block is downsampled: the pairwise sums hold 4
#: then 2 float64 (or int64) values per output element, and the integer mean's rounding adds a few.
STRIP_TEMPORARIES = 6
#: Shard index per inner chunk: two little-endian uint64 (offset, nbytes), plus a CRC32C.
SHARD_INDEX_ENTRY = 16
#: The shard index is held as an array while chunks are written and serialised once at the end.
SHARD_INDEX_COPIES = 2
#: The omero window's histogram (engine.write.window) counts one element in this many of each chunk.
WINDOW_SAMPLE_STRIDE = 127
#: Bytes per sampled element a slab task holds at most: its uint16 key, the concatenated copy
#: counted at the end, the sparse (uint16 key, uint32 count) pairs and the .npz bytes (twice).
WINDOW_BYTES_PER_SAMPLE = 22
#: The dense counts of one channel (65536 int64 bins) and the indices of its non-empty bins.
WINDOW_DENSE_BYTES = 2 * 65536 * 8


@dataclass(frozen=True)
class MemoryConstants:
    """Measured constants of the memory model. Units are bytes unless the name says otherwise."""

    #: RSS of a Dask worker with numpy, h5py, hdf5plugin, zarr and numcodecs imported and the HDF5
    #: file open, fitted with the zstd context below on bench/calibrate's matrix (implied
    #: baselines 82-100 MiB under pod emulation, 98-101 MiB on tiny gzip runs; see
    #: docs/memory-model.md) for the locked library versions (requirements/lock.txt): it grows
    #: with them. Measured as the kernel's high-water mark (VmHWM) of the worker.
    interpreter_baseline: int = 102 * MiB
    #: jemalloc's own share of ``interpreter_baseline`` (its arenas' metadata and retained pages),
    #: which glibc workers do not have: the implied baselines of the glibc matrices measured 3-5
    #: MiB below the jemalloc ones case by case (docs/memory-model.md, "Calibration, round four").
    jemalloc_baseline_share: int = 4 * MiB
    #: Per thread: a zstd compression context (level 5, window ~1 MiB, hash tables), which blosc
    #: and numcodecs keep alive between chunks; other codecs need about 1 MiB.
    codec_context_zstd: int = 6 * MiB
    codec_context_other: int = 1 * MiB
    #: Memory the nanny adds to the pod beside its worker: the nanny's own private memory (USS
    #: 43 MiB) and its multiprocessing resource tracker (6 MiB), measured with psutil on a running
    #: ``dask worker`` pod; their anonymous memory in emulated pods measured 49.7-50.0 MiB
    #: (``nanny_anon_peak``, bench/pod_truth). Shared library pages are already in the worker's RSS.
    nanny: int = 52 * MiB
    #: HDF5's own buffers per open file: type conversion (1 MiB), sieve buffer, metadata cache.
    hdf5_internal: int = 4 * MiB
    #: Resident bytes per byte of chunk cache when the HDF5 chunks are filtered. HDF5's deflate
    #: filter grows its output buffer by doubling from the compressed size and the cache keeps that
    #: buffer, so a cached chunk holds 1-2x its bytes. Fitted on gzip chunks (50, 100, 100) that
    #: compress 1.35x (buffers 1.48x the chunk): a 60.1 MiB cache measured 72-80 MiB resident, 1.31x
    #: (docs/memory-model.md, issue 18). glibc keeps those odd-sized buffers in its heap and
    #: fragments it: the same reads measured 1.03x more per cached byte than the plan at 1.4.
    #: Raised in round four: the gzip 4-D case read through HDF5's filter (chunks (1, 24, 100,
    #: 100), a 60.4 MiB cache) measured 245-250 MiB with jemalloc against 247.9 planned at 1.4
    #: (four runs), and 255-256 MiB with glibc, 4.5 MiB under its plan at 1.6 once glibc's
    #: baseline lost jemalloc's share (``jemalloc_baseline_share``).
    hdf5_filtered_cache_factor: float = 1.6
    hdf5_filtered_cache_factor_glibc: float = 1.7
    #: Fraction of the dynamic terms that the allocator keeps but does not use (fragmentation,
    #: retained free pages). jemalloc with a short decay keeps less than glibc.
    allocator_slack_jemalloc: float = 0.04
    allocator_slack_glibc: float = 0.06
    #: Page cache of written chunk files is charged to the pod's cgroup; dirty pages cannot be
    #: reclaimed until written back. Under the pod's pressure the kernel writes them back and
    #: reclaims them instead of killing (at 0.8x a pod's measured non-reclaimable peak, its dirty
    #: pages fell from 53 to 9 MiB and nothing was killed, docs/memory-model.md), so this room
    #: buys speed, not safety, and is shared with the monitor overshoot: this fraction of the
    #: bytes one wave of slabs writes, and never less than the floor.
    page_cache_fraction: float = 0.1
    page_cache_floor: int = 32 * MiB
    #: The predicted peak as a fraction of Dask's memory_limit: the rest is room for the nanny
    #: to see a worker outgrow its plan before it terminates it at ``terminate_fraction``.
    #: Dask's *pause* is switched off: a slab task's memory is unmanaged, so a paused worker never
    #: frees anything and would stop the run for good (a 100 KiB-per-slab leak did exactly that);
    #: terminating and retrying the slab elsewhere is the action that helps.
    planned_fraction: float = 0.90
    terminate_fraction: float = 0.95
    #: The least room, in bytes, between the predicted peak and the nanny's terminate threshold.
    #: On a small plan 5 % of memory_limit is only a few MiB, less than the interpreter baseline
    #: varies between machines and installs (a fresh checkout compiling its bytecode in the
    #: workers measured 4-8 MiB above a warm one); a worker must not be terminated in a loop for
    #: that. Large plans already have more room than this, so it changes only small ones. (Kept at
    #: 24 MiB: 8 MiB brought small pods from 1.86x to only 1.83x their pinned peak, far from the
    #: 1.6x target, for a margin a fresh install measured 4-8 MiB of; docs/memory-model.md.)
    terminate_headroom_floor: int = 24 * MiB
    #: How often the nanny checks its worker's RSS (seconds), and the fastest a runaway task grows
    #: (bytes/s: about a slab read from page cache). Between two checks a worker can overshoot the
    #: terminate threshold by their product; the pod limit leaves that room so the nanny, not the
    #: kernel, stops a worker that outgrows its plan. Measured overshoot of a fault-injected task
    #: at 1-2 GiB/s: 3-22 MiB above the threshold, every time terminated by Dask, never killed.
    monitor_interval: float = 0.02
    growth_rate: int = 2 << 30
    #: An object-store output (s3://): obstore imported, its Rust runtime's threads and its HTTP
    #: connection pool, once per worker process. Measured 18.5-18.8 MiB of RSS for 1-4 writer
    #: threads putting 1 MiB objects (bench/store_clients.py --memory): the pool and the runtime
    #: do not grow with the writer threads. Where a profile or a shared AWS config file is in
    #: play, each worker also imports botocore to read it (engine/stores/awsconfig.py): 25.4-25.7
    #: MiB against 17.6-17.9 MiB in the same run (--memory --profile), so 8 MiB more. The pure
    #: planner cannot see the workers' files, so every s3 plan counts it.
    object_store_client: int = 28 * MiB
    #: A unit bound for an object store is held whole in memory until its PUT returns: the
    #: BytesIO it is streamed into (grown by doubling-ish steps) and the request body the client
    #: sends from it. Bytes held per encoded byte, per thread.
    object_store_buffer_factor: float = 2.0

    @classmethod
    def from_file(cls, path: str | Path) -> "MemoryConstants":
        """Load overrides from a JSON object of field names to numbers."""
        try:
            data = json.loads(Path(path).read_text())
        except (OSError, ValueError) as exc:
            raise SpecError(
                "calibration", f"Expected a readable JSON file of memory constants. Got {path!s}: {exc}"
            ) from None
        return cls().with_overrides(data)

    def with_overrides(self, data: dict[str, Any]) -> "MemoryConstants":
        known = {f.name for f in fields(self)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise SpecError("calibration", f"Expected constants from {sorted(known)}. Got unknown {unknown} instead.")
        return replace(self, **data)


DEFAULT_CONSTANTS = MemoryConstants()


@dataclass(frozen=True)
class PassShape:
    """The sizes one pass works with, in bytes and elements."""

    slab_elements: int
    itemsize: int
    threads: int
    chunk_bytes: int
    #: Bytes of one shard (None when unsharded).
    shard_bytes: int | None
    #: Element count reduction of each pyramid step the pass builds, one per level built above
    #: its source, in order (8 in 3-D for a step that halves z, y and x; 4 for one that halves
    #: only y and x, as the anisotropy rule does while z is coarser: planner.layout.HalvingRule).
    reductions: tuple[int, ...]
    #: Elements of one output strip that the mean accumulates in float64 at a time.
    strip_elements: int
    from_hdf5: bool
    hdf5_chunk_bytes: int | None
    hdf5_filtered: bool
    hdf5_cache_bytes: int
    #: The output codec is zstd (alone or inside blosc).
    zstd: bool = False
    #: The output is an object store: units are held whole for their PUT (object_store_terms).
    object_store: bool = False
    #: PUTs each thread keeps in flight while it builds the next unit (object-store outputs).
    upload_depth: int = 0
    #: The HDF5 chunks are read with read_direct_chunk and inflated by libdeflate
    #: (DatasetInfo.hdf5_direct_read): HDF5's chunk cache and its filter buffers are not used.
    hdf5_direct: bool = False
    #: HDF5 files a worker holds open at once: one, or, for an image stacked from several files
    #: (each opened for one slab's read and closed after it), one per thread.
    open_files: int = 1
    #: A source in a bucket (DatasetInfo.remote_in_flight, remote_request_bytes): each reading
    #: thread's ranged GETs in flight, the largest body of one, and the most bytes one slab's
    #: reads span (all its requests together); 0 for a local file.
    remote_in_flight: int = 0
    remote_request_bytes: int = 0
    remote_span_bytes: int = 0

    @property
    def levels_built(self) -> int:
        """Pyramid levels the pass builds above its source."""
        return len(self.reductions)

    def level_elements(self) -> list[int]:
        """Elements of each level the pass builds from one slab: the slab divided by the
        reductions of the steps up to that level (rounded down, as the buffers are priced)."""
        out, level = [], self.slab_elements
        for r in self.reductions:
            level //= r
            out.append(level)
        return out


def encoded_bound(nbytes: int) -> int:
    """The largest encoded size of ``nbytes`` (blosc can expand incompressible data by its header)."""
    return nbytes + BLOSC_MAX_OVERHEAD


#: The name of the term that counts each thread's slab buffer: a batch reads it from a plan to
#: know what a spare buffer may hold (batch.run.slab_share).
SLAB_BUFFERS_TERM = "slab buffers"


def pass_terms(shape: PassShape, allocator: str, c: MemoryConstants = DEFAULT_CONSTANTS) -> tuple[MemoryTerm, ...]:
    """The named terms of one worker's peak during a pass."""
    T = shape.threads
    slab_bytes = shape.slab_elements * shape.itemsize
    terms = [
        MemoryTerm(
            "interpreter",
            c.interpreter_baseline - (0 if allocator == "jemalloc" else c.jemalloc_baseline_share),
            "Python, Dask worker, numpy, h5py, zarr and codecs once imported",
        ),
        MemoryTerm(SLAB_BUFFERS_TERM, T * slab_bytes, f"{T} slab(s) in flight x {slab_bytes / MiB:.1f} MiB, read once"),
    ]
    encode = shape.chunk_bytes + encoded_bound(shape.chunk_bytes)
    context = c.codec_context_zstd if shape.zstd else c.codec_context_other
    why = "per thread: one padded chunk copy + its encoded bytes"
    if shape.shard_bytes:
        why += ", streamed into its shard file"
    terms.append(
        MemoryTerm(
            "chunk and encode buffers", T * (encode + context), why + f" + codec context ({context / MiB:.0f} MiB)"
        )
    )
    if shape.shard_bytes:
        terms.append(shard_term(shape))
    if shape.levels_built:
        # Each level the pass builds has its own buffer, kept per thread for the next slab (fresh
        # buffers cost page faults on every slab), plus one block of downsampling temporaries.
        # Each step divides by its own reduction: a step that halves only y and x (the anisotropy
        # rule) leaves its level twice as large as one that also halves z.
        levels = sum(n * shape.itemsize for n in shape.level_elements())
        strip = shape.strip_elements * 8 * STRIP_TEMPORARIES
        ratios = ", ".join(f"1/{math.prod(shape.reductions[: k + 1])}" for k in range(shape.levels_built))
        terms.append(
            MemoryTerm(
                "pyramid buffers",
                T * (levels + strip),
                f"per thread: {shape.levels_built} level buffer(s) ({levels / MiB:.1f} MiB, {ratios} of the slab) + one block of temporaries ({strip / MiB:.1f} MiB)",
            )
        )
    if shape.from_hdf5 and shape.remote_request_bytes:
        terms.append(window_term(shape))
        terms.extend(source_range_terms(shape, c))
    elif shape.from_hdf5:
        terms.append(window_term(shape))
        # HDF5's own buffers per open file; an image stacked from files has one open per thread.
        internal = shape.open_files * c.hdf5_internal
        files = f" of {shape.open_files} open files (one per thread)" if shape.open_files > 1 else ""
        hdf5 = shape.hdf5_cache_bytes + internal
        why = f"chunk cache (rdcc_nbytes) {shape.hdf5_cache_bytes / MiB:.1f} MiB + HDF5 internal buffers{files}"
        if shape.hdf5_direct:
            # engine.sources.inflate: each chunk's stored bytes (read_direct_chunk) and libdeflate's output,
            # one chunk at a time (h5py serialises the reads); HDF5's chunk cache stays empty.
            hdf5 = internal
            why = f"chunks read directly and inflated by libdeflate, HDF5's chunk cache unused: HDF5 internal buffers{files}"
        elif shape.hdf5_filtered and shape.hdf5_cache_bytes:
            factor = c.hdf5_filtered_cache_factor if allocator == "jemalloc" else c.hdf5_filtered_cache_factor_glibc
            hdf5 = math.ceil(factor * shape.hdf5_cache_bytes) + internal
            why = f"chunk cache (rdcc_nbytes) {shape.hdf5_cache_bytes / MiB:.1f} MiB x {factor} (filter buffers, {allocator}) + HDF5 internal buffers{files}"
        if shape.hdf5_direct and shape.hdf5_chunk_bytes:
            # libdeflate inflates outside h5py's lock, so every thread may hold its own chunk.
            hdf5 += T * 2 * shape.hdf5_chunk_bytes
            why += f" + per thread ({T}) one compressed and one decompressed HDF5 chunk"
        elif shape.hdf5_filtered and shape.hdf5_chunk_bytes:
            # h5py serialises HDF5 calls per process, so one chunk is decompressed at a time.
            hdf5 += 2 * shape.hdf5_chunk_bytes
            why += " + one compressed and one decompressed HDF5 chunk"
        terms.append(MemoryTerm("hdf5 cache and decompression", hdf5, why))
    else:
        # Chunk files of the previous level are read and decoded one at a time into the slab.
        # Shards too are read one inner chunk at a time, straight into the slab (engine.write.chunkio).
        terms.append(
            MemoryTerm(
                "level read buffers",
                T * (encoded_bound(shape.chunk_bytes) + shape.chunk_bytes),
                "per thread: one encoded chunk + one decoded chunk",
            )
        )
    if shape.object_store:
        terms.extend(object_store_terms(shape, c))
    elif shape.from_hdf5 and shape.remote_request_bytes:
        terms.append(client_term(c))
    dynamic = sum(t.bytes for t in terms[1:])
    slack = c.allocator_slack_jemalloc if allocator == "jemalloc" else c.allocator_slack_glibc
    terms.append(
        MemoryTerm("allocator slack", math.ceil(slack * dynamic), f"{slack:.0%} of the buffers above ({allocator})")
    )
    return tuple(terms)


#: Mirrors engine.stores.s3: objects above MULTIPART_THRESHOLD go up in PART_SIZE parts, at most
#: PART_CONCURRENCY of them in flight per upload.
MULTIPART_THRESHOLD = 64 * MiB
PART_SIZE = 16 * MiB
PART_CONCURRENCY = 2
#: Encoded bytes a thread may have in flight to an object store while it encodes the next unit
#: (engine.stores.uploads), and the most PUTs that makes. A PUT round trip is about a millisecond
#: to a loopback endpoint and 20-50 ms to AWS, against about 7 ms to encode a 1 MiB chunk: 6 in
#: flight keep a core encoding through either (bench/s3_write.py --latency-ms). Units above the
#: window (large shards) are PUT synchronously, as before: holding a second 64 MiB shard per
#: thread would cost more memory than the wait costs time (a multipart upload already sends
#: PART_CONCURRENCY parts at once).
UPLOAD_WINDOW_BYTES = 16 * MiB
MAX_UPLOAD_DEPTH = 6


def upload_depth(unit_bytes: int) -> int:
    """PUTs a worker thread keeps in flight for units of ``unit_bytes`` (counted at their encoded
    bound: the planner cannot know how well the data compresses); 0 writes synchronously."""
    return min(MAX_UPLOAD_DEPTH, UPLOAD_WINDOW_BYTES // encoded_bound(unit_bytes))


def source_range_terms(shape: PassShape, c: MemoryConstants) -> list[MemoryTerm]:
    """A source in a bucket (engine.sources.ranged): per thread, the bodies of the ranged GETs in
    flight (engine.stores.fetches keeps ``remote_in_flight`` running while the thread decodes the
    one before), the body being decoded, one decoded HDF5 chunk and its copy (libdeflate's output,
    or HDF5's filter pipeline's in-memory file, engine.sources.decode) and that file's HDF5
    buffers. No HDF5 chunk cache: a worker never opens the file with HDF5."""
    T = shape.threads
    request = shape.remote_request_bytes
    chunk = shape.hdf5_chunk_bytes or 0
    # A thread's bodies all belong to its one slab: together never more than that slab's reads span.
    in_flight = min(shape.remote_in_flight * request, max(shape.remote_span_bytes - request, 0))
    return [
        MemoryTerm(
            "source requests in flight",
            T * in_flight,
            f"per thread: {shape.remote_in_flight} ranged GETs of the source in flight, up to {request / MiB:.1f} MiB "
            f"each, at most what one slab's reads span beyond the body being decoded ({in_flight / MiB:.1f} MiB)",
        ),
        MemoryTerm(
            "source range buffers",
            T * (request + 2 * chunk) + c.hdf5_internal,
            f"per thread: the body being decoded ({request / MiB:.1f} MiB) + one decoded HDF5 chunk and its copy "
            f"({chunk / MiB:.1f} MiB each); HDF5's buffers of the decoding file",
        ),
    ]


def client_term(c: MemoryConstants) -> MemoryTerm:
    return MemoryTerm(
        "object store client",
        c.object_store_client,
        "obstore, its runtime threads and connection pool, botocore for the AWS config chain; once per worker",
    )


def object_store_terms(shape: PassShape, c: MemoryConstants) -> list[MemoryTerm]:
    """The network path's terms: the client once per worker, and per thread the unit being built
    plus the ``upload_depth`` units whose PUTs are in flight, each held whole (plus the multipart
    parts in flight per unit above the threshold). A later pass reads a shard through its index,
    with the ranges it needs in one call: at most the shard object and its decoded chunks."""
    T = shape.threads
    unit = encoded_bound(shape.shard_bytes or shape.chunk_bytes)
    depth = shape.upload_depth
    per_unit = math.ceil(c.object_store_buffer_factor * unit)
    if unit > MULTIPART_THRESHOLD:
        per_unit += PART_CONCURRENCY * PART_SIZE
    kind = "shard" if shape.shard_bytes else "chunk"
    why = (
        f"per thread: the encoded {kind} being built + {depth} whose PUT(s) are in flight, {unit / MiB:.1f} MiB each "
        f"x {c.object_store_buffer_factor} (its buffer and the request body)"
    )
    if unit > MULTIPART_THRESHOLD:
        why += f" + {PART_CONCURRENCY} multipart parts of {PART_SIZE / MiB:.0f} MiB in flight each"
    terms = [client_term(c), MemoryTerm("object store upload buffers", T * (depth + 1) * per_unit, why)]
    if shape.shard_bytes and not shape.from_hdf5:
        terms.append(
            MemoryTerm(
                "object store shard reads",
                T * (unit + shape.shard_bytes),
                "per thread: one shard object fetched whole + decoded whole (a later pass)",
            )
        )
    return terms


def window_term(shape: PassShape) -> MemoryTerm:
    """The first pass samples level 0 for the omero window's quantiles (engine.write.window)."""
    samples = shape.slab_elements // WINDOW_SAMPLE_STRIDE + 1
    held = samples * WINDOW_BYTES_PER_SAMPLE + WINDOW_DENSE_BYTES + shape.chunk_bytes
    return MemoryTerm(
        "window histogram",
        shape.threads * held,
        f"per thread: 1 in {WINDOW_SAMPLE_STRIDE} elements sampled ({samples} x {WINDOW_BYTES_PER_SAMPLE} B as keys, counts and file), "
        f"one channel's dense counts ({WINDOW_DENSE_BYTES / MiB:.0f} MiB) and the contiguous copy of an edge chunk",
    )


def shard_index_bytes(shard_bytes: int, chunk_bytes: int) -> int:
    """A shard's index as stored: (offset, nbytes) per inner chunk, then a CRC32C."""
    return SHARD_INDEX_ENTRY * (shard_bytes // chunk_bytes) + 4


def shard_term(shape: PassShape) -> MemoryTerm:
    """What assembling one shard holds beyond one chunk's encode buffers, per thread.

    The engine streams each encoded chunk into the shard's file as soon as it is encoded, so a
    shard holds only its index while it is written: the index array and its serialised copy at
    close. A later pass reads a shard's index once and each inner chunk on its own. Levels are
    written one after another, so one shard per thread is open at a time, whatever the number of
    levels the pass writes. (Holding every encoded chunk until the shard was written whole cost
    1.7x the encoded shard and broke the plan on incompressible data: docs/memory-model.md.)
    """
    index = shard_index_bytes(shape.shard_bytes or 0, shape.chunk_bytes)
    n = (shape.shard_bytes or 0) // shape.chunk_bytes
    held = SHARD_INDEX_COPIES * index
    return MemoryTerm(
        "shard assembly",
        shape.threads * held,
        f"per thread: the open shard's index, {held / 1024:.1f} KiB ({n} inner chunks x {SHARD_INDEX_ENTRY} B + 4 B CRC, "
        f"as an array and as bytes); its chunks are streamed into the file as they are encoded, never held as a shard",
    )


def slab_output_bytes(shape: PassShape) -> int:
    """Uncompressed bytes one slab writes (its level plus the levels it builds)."""
    return (shape.slab_elements + sum(shape.level_elements())) * shape.itemsize


def worker_memory(
    terms: tuple[MemoryTerm, ...], written_per_wave: int, c: MemoryConstants = DEFAULT_CONSTANTS
) -> WorkerMemory:
    """Derive Dask's memory_limit and the pod limit from the predicted peak.

    The pod holds the worker up to Dask's terminate threshold (above it the nanny terminates the
    worker), the nanny, and one room that serves two purposes: the dirty pages of chunk writes and
    the growth between two nanny checks. They share it because dirty pages give way: under the
    pod's memory pressure the kernel writes them back and reclaims them instead of killing
    (measured in docs/memory-model.md#pod-level-truth), so a worker overshooting its threshold
    takes the room the page cache had."""
    peak = sum(t.bytes for t in terms)
    memory_limit = _round_mib(
        max(peak / c.planned_fraction, (peak + c.terminate_headroom_floor) / (c.terminate_fraction or 1.0))
    )
    page_cache = max(c.page_cache_floor, math.ceil(c.page_cache_fraction * written_per_wave))
    overshoot = math.ceil(c.growth_rate * c.monitor_interval)
    threshold = math.ceil(memory_limit * c.terminate_fraction) if c.terminate_fraction else memory_limit
    room_why = f"max(dirty chunk pages {page_cache / MiB:.1f}, growth in one nanny check ({c.monitor_interval * 1000:.0f} ms) {overshoot / MiB:.1f}): dirty pages give way"
    pod_terms = (
        MemoryTerm(
            "dask terminate threshold",
            threshold,
            f"{c.terminate_fraction:.0%} of memory_limit: above it the nanny terminates the worker"
            if c.terminate_fraction
            else "no terminate threshold: memory_limit",
        ),
        MemoryTerm("nanny", c.nanny, "the nanny process (and its resource tracker) shares the pod's cgroup"),
        MemoryTerm("page cache and overshoot room", max(page_cache, overshoot), room_why),
    )
    pod_limit = _round_mib(sum(t.bytes for t in pod_terms))
    thresholds = Thresholds(
        target=False,
        spill=False,
        pause=False,
        terminate=c.terminate_fraction,
        planned=c.planned_fraction,
        monitor_interval=c.monitor_interval,
    )
    return WorkerMemory(
        terms, peak, memory_limit, pod_limit, pod_terms, thresholds, _memory_limit_why(peak, memory_limit, c)
    )


def minimum_pod_limit(c: MemoryConstants = DEFAULT_CONSTANTS) -> int:
    """The smallest pod limit any plan has: one thread converting one byte (no pyramid, no HDF5
    cache, a codec without zstd's context, jemalloc's smaller slack). Every term of a real pass
    is at least this one's, so no budget below it can ever plan; spec.MIN_WORKER_MEMORY (the
    spec's and the CRD's floor) is this figure for the default constants."""
    one_byte = PassShape(
        slab_elements=1,
        itemsize=1,
        threads=1,
        chunk_bytes=1,
        shard_bytes=None,
        reductions=(),
        strip_elements=0,
        from_hdf5=True,
        hdf5_chunk_bytes=None,
        hdf5_filtered=False,
        hdf5_cache_bytes=0,
    )
    return worker_memory(pass_terms(one_byte, "jemalloc", c), slab_output_bytes(one_byte), c).pod_limit


def _memory_limit_why(peak: int, memory_limit: int, c: MemoryConstants) -> str:
    if memory_limit == _round_mib(peak / c.planned_fraction):
        return f"predicted peak / planned fraction {c.planned_fraction}"
    threshold = f"the terminate threshold ({c.terminate_fraction:.0%})" if c.terminate_fraction else "it"
    return f"predicted peak + {c.terminate_headroom_floor / MiB:.0f} MiB of room below {threshold}"


def _round_mib(n: float) -> int:
    return math.ceil(n / MiB) * MiB
