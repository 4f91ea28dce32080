"""Chunks and shards: encode them and write each whole through the output's store; read and
decode them back.

zarr-python creates every array's metadata, but the engine encodes and stores chunks itself:
zarr's per-chunk overhead on the write path (async codec pipeline, store abstraction) cost more
than the encoding itself in our benchmark (docs/benchmarks.md). Every unit goes through the
output's ``Store`` (engine.stores): a directory writes it to a temporary name and renames it, a
bucket PUTs it whole, so a reader or a resumed run never sees half a chunk. The bytes are exactly
zarr's: tests read every codec, format and sharding back with zarr.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from itertools import product
from typing import BinaryIO, Callable, Iterator

import google_crc32c
import numpy as np

from ...errors import UnalignedWriteError
from ...planner.grid import ceil_div
from ...spec import CompressorSpec
from . import faults
from ..buffers import slab_buffer
from ..codecs import chunk_codec
from ..stores import Store, open_store

# EMPTY_UNIT_BYTES: the recorded size of a unit not stored because it is the fill value
# everywhere. No stored unit has 0 bytes (an encoded chunk has a header; a shard has its index).
from .manifest import EMPTY_UNIT_BYTES

Shape = tuple[int, ...]
Fill = float | int | bool
#: ``on_chunk(data, unit_region)``: sees each unit's (or inner chunk's) data while it is in cache.
OnChunk = Callable[[np.ndarray, tuple[slice, ...]], None]
#: ``on_file(key, pieces)``: sees the bytes of each chunk file written.
OnFile = Callable[[str, list[bytes]], None]
_EMPTY = np.uint64(2**64 - 1)


@dataclass(frozen=True)
class ArrayLayout:
    """Where and how one pyramid level's chunk files are stored."""

    path: str
    shape: Shape
    chunks: Shape
    shards: Shape | None
    dtype: str
    zarr_format: int
    compressor: CompressorSpec
    level: int = 0
    fill_value: float | int | bool = 0
    #: Storage options of an object-store output (sorted items), None for a local directory.
    storage_options: tuple[tuple[str, str], ...] | None = None
    #: A CRC32C per chunk: in Zarr v3 the crc32c codec's 4 bytes end every chunk; in Zarr v2 the
    #: slab task reports each file's CRC32C for the sidecar (``engine.write.checksums``).
    checksums: bool = False

    @property
    def crc_codec(self) -> bool:
        """Chunks end in the Zarr v3 crc32c codec's 4 bytes."""
        return self.checksums and self.zarr_format == 3

    @property
    def unit(self) -> Shape:
        """The unit stored as one file: the shard where sharded, else the chunk."""
        return self.shards or self.chunks

    @property
    def unit_grid(self) -> Shape:
        return tuple(ceil_div(n, u) for n, u in zip(self.shape, self.unit))

    def key(self, index: tuple[int, ...]) -> str:
        parts = "/".join(str(i) for i in index)
        return f"c/{parts}" if self.zarr_format == 3 else parts

    def file(self, index: tuple[int, ...]) -> str:
        return os.path.join(self.path, self.key(index))

    @property
    def root(self) -> str:
        """The output's root (a directory or a URL): the level's array lives under it."""
        return os.path.dirname(self.path)

    def store_key(self, index: tuple[int, ...]) -> str:
        """The unit's key in the output's store: ``<level array>/<chunk key>``."""
        return f"{os.path.basename(self.path)}/{self.key(index)}"

    def store(self) -> Store:
        """The output's store (engine.stores; one per process and output, so a Dask worker
        builds a bucket's client once)."""
        return open_store(self.root, None if self.storage_options is None else dict(self.storage_options))

    def units_in(self, region: tuple[slice, ...]) -> Iterator[tuple[int, ...]]:
        """Indices of the write units a region touches."""
        ranges = [range(r.start // u, ceil_div(r.stop, u)) for r, u in zip(region, self.unit)]
        return product(*ranges)

    def unit_region(self, index: tuple[int, ...]) -> tuple[slice, ...]:
        return tuple(slice(i * u, min((i + 1) * u, n)) for i, u, n in zip(index, self.unit, self.shape))


def _padded(block: np.ndarray, shape: Shape, fill: Fill) -> np.ndarray:
    """A C-contiguous copy of ``block`` in a full chunk; edge chunks are padded with the fill value,
    as zarr stores them."""
    if block.shape == shape:
        return np.ascontiguousarray(block)
    out = np.full(shape, fill, dtype=block.dtype)
    out[tuple(slice(0, n) for n in block.shape)] = block
    return out


def encode_chunk(
    layout: ArrayLayout, block: np.ndarray, on_chunk: OnChunk | None = None, unit: tuple[slice, ...] = ()
) -> bytes:
    data = encode_stored_chunk(layout, block, on_chunk, unit, skip_empty=False)
    assert data is not None
    return data


def encode_stored_chunk(
    layout: ArrayLayout,
    block: np.ndarray,
    on_chunk: OnChunk | None = None,
    unit: tuple[slice, ...] = (),
    skip_empty: bool = True,
) -> bytes | None:
    """The chunk's encoded bytes, or None for a chunk that is the fill value everywhere: it is
    not stored, as zarr does with ``write_empty_chunks=False``, and reads back as the fill value."""
    chunk = _padded(block, layout.chunks, layout.fill_value)
    if on_chunk is not None:
        # Statistics on the contiguous copy while it is in cache; edge chunks only over real data.
        on_chunk(chunk if chunk.shape == block.shape else block, unit)
    if skip_empty and is_fill_chunk(chunk, layout.fill_value):
        return None
    codec = chunk_codec(layout.compressor)
    return chunk.tobytes() if codec is None else bytes(codec.encode(chunk))


def checksum_piece(data: bytes | np.ndarray) -> bytes:
    """The Zarr v3 crc32c codec's suffix: the CRC32C of ``data``, 4 bytes little-endian. Written as
    a separate piece after the chunk's bytes, so no copy of the encoded chunk is made."""
    crc: int = google_crc32c.value(data)
    return crc.to_bytes(4, "little")


def stored_pieces(layout: ArrayLayout, data: bytes) -> list[bytes]:
    """What one chunk's file (or slot in a shard) holds: its encoded bytes, then its checksum."""
    return [data, checksum_piece(data)] if layout.crc_codec else [data]


#: Elements of a chunk looked at before it is scanned whole: data almost always has a non-zero
#: among them, so a dense chunk costs ~5 us (a full scan of 1 MiB costs ~40 us).
_EMPTY_PROBE_STRIDE = 61


def is_fill_chunk(chunk: np.ndarray, fill: Fill) -> bool:
    """Whether a C-contiguous chunk equals a zero fill value bit for bit (-0.0 and NaN payloads are
    data, so the bytes are compared, not the values). A non-zero fill value is never skipped."""
    if fill:
        return False
    flat = chunk.reshape(-1)
    # The first element as a Python scalar costs ~0.5 us against ~7 us for the strided probe
    # (numpy's reduction set-up); a dense chunk almost always starts with a non-zero. -0.0 is
    # false here and falls through to the byte comparison, which keeps it.
    if flat.size and flat.item(0):
        return False
    if flat[::_EMPTY_PROBE_STRIDE].any():  # NaN and non-zero values are True: stops at once
        return False
    return not int(flat.view(np.uint8).max(initial=0))


def write_shard(
    f: BinaryIO, layout: ArrayLayout, block: np.ndarray, shard_start: Shape, on_chunk: OnChunk | None = None
) -> int:
    """Stream one shard into ``f``: inner chunks in C order, each written as soon as it is encoded,
    then the index (offset, nbytes per chunk, little-endian uint64) and its CRC32C: zarr's
    ``sharding_indexed`` codec with the index at the end.

    Only one encoded chunk and the index are held at a time. Holding every encoded chunk until
    the shard was written whole cost up to 1.7x the encoded shard (allocator size classes around
    each ~1 MiB piece) and broke the plan on incompressible data (docs/memory-model.md, issue 18).
    ``on_chunk`` sees each inner chunk, as in ``write_block``: per chunk, so its temporaries (e.g.
    the finite-value copy of a float chunk with NaN) stay chunk-sized, never shard-sized. An inner
    chunk that is the fill value everywhere is left out (its index entry stays empty, 2^64-1).
    Returns the number of inner chunks stored.
    """
    assert layout.shards is not None
    inner_grid = shard_grid(layout)
    index = np.full(inner_grid + (2,), _EMPTY, dtype="<u8")
    offset = stored = 0
    for inner in product(*(range(g) for g in inner_grid)):
        start = tuple(i * c for i, c in zip(inner, layout.chunks))
        if any(s0 + s >= n for s0, s, n in zip(shard_start, start, layout.shape)):
            continue  # wholly outside the array: stays empty, as zarr leaves it
        local = tuple(slice(s, min(s + c, b)) for s, c, b in zip(start, layout.chunks, block.shape))
        where = tuple(slice(s0 + r.start, s0 + r.stop) for s0, r in zip(shard_start, local))
        data = encode_stored_chunk(layout, block[local], on_chunk, where)
        if data is None:
            continue
        pieces = stored_pieces(layout, data)
        del data
        f.writelines(pieces)
        nbytes = sum(len(p) for p in pieces)
        index[inner] = (offset, nbytes)
        offset += nbytes
        stored += 1
        del pieces  # before the next chunk is encoded: one encoded chunk at a time
    raw_index = index.tobytes()
    f.write(raw_index)
    f.write(google_crc32c.value(raw_index).to_bytes(4, "little"))
    return stored


def shard_grid(layout: ArrayLayout) -> Shape:
    """Inner chunks per shard along each axis."""
    assert layout.shards is not None
    return tuple(s // c for s, c in zip(layout.shards, layout.chunks))


def shard_index_bytes(layout: ArrayLayout) -> int:
    """Bytes of a shard's index and its CRC32C at the end of the file."""
    return 16 * math.prod(shard_grid(layout)) + 4


def write_block(
    layout: ArrayLayout,
    block: np.ndarray,
    origin: Shape,
    on_chunk: OnChunk | None = None,
    on_file: OnFile | None = None,
) -> list[tuple[str, int]]:
    """Write every unit of ``block`` (placed at ``origin`` in the level). The block must cover whole
    units (or reach the array's edge): that is what makes each unit's writer unique.

    ``on_chunk(sub_block, unit_region)`` sees each unit's data while it is still in cache, which is
    where the engine takes its min/max for the omero window. ``on_file(key, pieces)`` sees the
    bytes of each chunk file written (unsharded levels), which is where Zarr v2 outputs take the
    CRC32C for their checksum sidecar.

    A unit that is the fill value everywhere is not stored (``EMPTY_UNIT_BYTES`` is its size in
    the result): any file a killed run left at its name is removed, so it reads as the fill value.
    """
    region = tuple(slice(o, o + n) for o, n in zip(origin, block.shape))
    check_alignment(layout, region)
    store = layout.store()
    written = []
    for index in layout.units_in(region):
        unit = layout.unit_region(index)
        local = tuple(slice(u.start - o, u.stop - o) for u, o in zip(unit, origin))
        sub = block[local]
        key = layout.store_key(index)
        if layout.shards is None:
            data = encode_stored_chunk(layout, sub, on_chunk, unit)
            if data is None:
                nbytes = EMPTY_UNIT_BYTES
            else:
                pieces = stored_pieces(layout, data)
                del data
                with store.writer(key) as f:
                    f.writelines(pieces)
                    faults.before_rename()
                nbytes = sum(len(p) for p in pieces)
                if on_file is not None:
                    on_file(layout.key(index), pieces)
                del pieces
        else:
            nbytes = _write_shard_unit(store, key, layout, sub, unit, on_chunk)
        if nbytes == EMPTY_UNIT_BYTES:
            store.delete(key)
        written.append((layout.key(index), nbytes))
    return written


class _NothingStored(Exception):
    """Every inner chunk of a shard is the fill value: the unit is dropped, nothing stored."""


def _write_shard_unit(
    store: Store, key: str, layout: ArrayLayout, sub: np.ndarray, unit: tuple[slice, ...], on_chunk: OnChunk | None
) -> int:
    try:
        with store.writer(key) as f:
            if not write_shard(f, layout, sub, tuple(u.start for u in unit), on_chunk):
                raise _NothingStored  # the writer drops what it holds, commits nothing
            faults.before_rename()
            return f.tell()
    except _NothingStored:
        return EMPTY_UNIT_BYTES


def check_alignment(layout: ArrayLayout, region: tuple[slice, ...]) -> None:
    """Refuse a block that covers part of a unit: every unit is written whole, by one writer,
    exactly once, so a partial block would leave fill values over another slab's data."""
    for axis, (r, u, n) in enumerate(zip(region, layout.unit, layout.shape)):
        if r.start % u or (r.stop % u and r.stop != n):
            raise UnalignedWriteError(
                f"block {[(s.start, s.stop) for s in region]} of level {layout.level} covers part of a {layout.unit} "
                f"unit along axis {axis}: the planner must align slabs to whole chunks/shards."
            )


def decode_chunk(layout: ArrayLayout, data: bytes) -> np.ndarray:
    payload = checked_payload(data) if layout.crc_codec else data
    codec = chunk_codec(layout.compressor)
    raw = payload if codec is None else codec.decode(payload)
    arr = np.frombuffer(raw, dtype=layout.dtype)
    if arr.size != math.prod(layout.chunks):
        raise ValueError(f"decoded {arr.size} elements, expected {math.prod(layout.chunks)}")
    return arr.reshape(layout.chunks)


def checked_payload(data: bytes) -> np.ndarray:
    """A chunk's bytes without the crc32c codec's suffix, after checking it (a view: no copy)."""
    view = np.frombuffer(data, dtype=np.uint8)  # google_crc32c takes arrays, not memoryviews
    if len(view) < 4:
        raise ValueError(f"chunk of {len(view)} bytes is shorter than its 4-byte CRC32C")
    payload = view[:-4]
    stored, computed = view[-4:].tobytes(), checksum_piece(payload)
    if stored != computed:
        raise ValueError(f"CRC32C mismatch: stored {stored.hex()}, computed {computed.hex()}")
    return payload


def parse_shard_index(layout: ArrayLayout, tail: bytes, data_bytes: int) -> np.ndarray:
    """The (offset, nbytes) of every inner chunk from a shard's last ``shard_index_bytes`` bytes,
    checked: CRC32C, and every chunk inside the ``data_bytes`` that precede the index."""
    inner_grid = shard_grid(layout)
    raw_index = tail[:-4]
    if google_crc32c.value(raw_index).to_bytes(4, "little") != tail[-4:]:
        raise ValueError("shard index checksum mismatch")
    index = np.frombuffer(raw_index, dtype="<u8").reshape(inner_grid + (2,))
    for inner in product(*(range(g) for g in inner_grid)):
        offset, nbytes = (int(v) for v in index[inner])
        if offset != int(_EMPTY) and offset + nbytes > data_bytes:
            raise ValueError(f"inner chunk {inner} runs past the shard's data")
    return index


def decode_unit(layout: ArrayLayout, data: bytes) -> np.ndarray:
    """Decode one chunk file, or one shard file into its full (padded) shard array."""
    if layout.shards is None:
        return decode_chunk(layout, data)
    tail = shard_index_bytes(layout)
    if len(data) < tail:
        raise ValueError(f"shard of {len(data)} bytes is shorter than its index ({tail} bytes)")
    index = parse_shard_index(layout, data[-tail:], len(data) - tail)
    out = np.full(layout.shards, layout.fill_value, dtype=layout.dtype)
    for inner in product(*(range(g) for g in shard_grid(layout))):
        offset, nbytes = (int(v) for v in index[inner])
        if offset == int(_EMPTY):
            continue
        place = tuple(slice(i * c, (i + 1) * c) for i, c in zip(inner, layout.chunks))
        out[place] = decode_chunk(layout, data[offset : offset + nbytes])
    return out


def read_unit(layout: ArrayLayout, index: tuple[int, ...]) -> np.ndarray | None:
    """One unit's decoded data, or None where nothing is stored (reads as the fill value)."""
    try:
        data = layout.store().get(layout.store_key(index))
    except KeyError:
        return None
    return decode_unit(layout, data)


def _shard_table(store: Store, key: str, layout: ArrayLayout) -> np.ndarray | None:
    """A shard's checked index (inner grid + (offset, nbytes)) from one read of its tail; None
    where the shard is not stored."""
    tail = shard_index_bytes(layout)
    try:
        raw, size = store.get_suffix(key, tail)
    except KeyError:
        return None
    if size < tail:
        raise ValueError(f"shard of {size} bytes is shorter than its index ({tail} bytes)")
    return parse_shard_index(layout, raw, size - tail)


def read_region(layout: ArrayLayout, region: tuple[slice, ...]) -> np.ndarray:
    """Read a region of a level, one unit at a time (what a later pass streams from), into this
    thread's slab buffer (valid until the thread's next slab)."""
    out = slab_buffer(tuple(r.stop - r.start for r in region), layout.dtype)
    store = layout.store()
    for index in layout.units_in(region):
        unit = layout.unit_region(index)
        inter = tuple(slice(max(u.start, r.start), min(u.stop, r.stop)) for u, r in zip(unit, region))
        dst = tuple(slice(i.start - r.start, i.stop - r.start) for i, r in zip(inter, region))
        if layout.shards is not None:
            _read_shard_into(store, layout, index, out[dst], inter)
            continue
        try:
            data = decode_chunk(layout, store.get(layout.store_key(index)))
        except KeyError:
            out[dst] = layout.fill_value
            continue
        out[dst] = data[tuple(slice(i.start - u.start, i.stop - u.start) for i, u in zip(inter, unit))]
        del data  # before the next unit is read: one decoded unit at a time
    return out


def _read_shard_into(
    store: Store, layout: ArrayLayout, index: tuple[int, ...], out: np.ndarray, region: tuple[slice, ...]
) -> None:
    """Decode the inner chunks of one shard that ``region`` (level coordinates) touches straight
    into ``out``: its index from the shard's tail, then each chunk's byte range. A directory holds
    one encoded and one decoded chunk at a time, never the whole shard nor its decoded array
    (which cost two decoded shards and the file per thread before, issue 18); a bucket fetches the
    ranges in one call (engine.stores.s3), at most the shard's bytes."""
    key = layout.store_key(index)
    table = _shard_table(store, key, layout)
    if table is None:
        out[...] = layout.fill_value
        return
    assert layout.shards is not None
    origin = tuple(i * s for i, s in zip(index, layout.shards))
    first = tuple((r.start - o) // c for r, o, c in zip(region, origin, layout.chunks))
    last = tuple(ceil_div(r.stop - o, c) for r, o, c in zip(region, origin, layout.chunks))
    stored: list[tuple[tuple[int, int], tuple[slice, ...], tuple[slice, ...]]] = []
    for inner in product(*(range(a, b) for a, b in zip(first, last))):
        start = tuple(o + i * c for o, i, c in zip(origin, inner, layout.chunks))
        inter = tuple(slice(max(s, r.start), min(s + c, r.stop)) for s, c, r in zip(start, layout.chunks, region))
        dst = tuple(slice(i.start - r.start, i.stop - r.start) for i, r in zip(inter, region))
        offset, nbytes = (int(v) for v in table[inner])
        if offset == int(_EMPTY):
            out[dst] = layout.fill_value
            continue
        stored.append(((offset, nbytes), dst, tuple(slice(i.start - s, i.stop - s) for i, s in zip(inter, start))))
    if not stored:
        return
    for data, (_, dst, src) in zip(store.get_ranges(key, [r for r, _, _ in stored]), stored):
        out[dst] = decode_chunk(layout, data)[src]
        del data
