"""Chunk and shard files: encode and write them whole, atomically; read and decode them back.

zarr-python creates every array's metadata, but the engine encodes and stores chunks itself:
zarr's per-chunk overhead on the write path (async codec pipeline, store abstraction) cost more
than the encoding itself in our benchmark (docs/benchmarks.md), and a file written here is first
written to a temporary name and renamed, so a reader or a resumed run never sees half a chunk.
The bytes are exactly zarr's: tests read every codec, format and sharding back with zarr.
"""

from __future__ import annotations

import errno
import io
import math
import os
import uuid
from contextlib import contextmanager
from dataclasses import dataclass
from itertools import product
from typing import BinaryIO, Iterator

import google_crc32c
import numpy as np

from ..errors import DiskFullError, OutputError, UnalignedWriteError
from ..planner.grid import ceil_div
from ..spec import CompressorSpec
from . import faults
from .buffers import slab_buffer
from .codecs import chunk_codec
from .stores import is_url, register, store_for
#: The recorded size of a unit not stored because it is the fill value everywhere. No stored unit
#: has 0 bytes (an encoded chunk has a header; a shard has its index).
from .manifest import EMPTY_UNIT_BYTES

Shape = tuple[int, ...]
#: Temporary files carry this marker; a resumed run deletes the ones a killed run left behind.
TMP_MARK = ".h5ngff-tmp-"
_EMPTY = np.uint64(2**64 - 1)
_made_dirs: set[str] = set()


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
    #: slab task reports each file's CRC32C for the sidecar (``engine.checksums``).
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

    def units_in(self, region: tuple[slice, ...]) -> Iterator[tuple[int, ...]]:
        """Indices of the write units a region touches."""
        ranges = [range(r.start // u, ceil_div(r.stop, u)) for r, u in zip(region, self.unit)]
        return product(*ranges)

    def unit_region(self, index: tuple[int, ...]) -> tuple[slice, ...]:
        return tuple(slice(i * u, min((i + 1) * u, n)) for i, u, n in zip(index, self.unit, self.shape))


def _padded(block: np.ndarray, shape: Shape, fill) -> np.ndarray:
    """A C-contiguous copy of ``block`` in a full chunk; edge chunks are padded with the fill value,
    as zarr stores them."""
    if block.shape == shape:
        return np.ascontiguousarray(block)
    out = np.full(shape, fill, dtype=block.dtype)
    out[tuple(slice(0, n) for n in block.shape)] = block
    return out


def encode_chunk(layout: ArrayLayout, block: np.ndarray, on_chunk=None, unit=None) -> bytes:
    data = encode_stored_chunk(layout, block, on_chunk, unit, skip_empty=False)
    assert data is not None
    return data


def encode_stored_chunk(layout: ArrayLayout, block: np.ndarray, on_chunk=None, unit=None, skip_empty: bool = True) -> bytes | None:
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


def checksum_piece(data) -> bytes:
    """The Zarr v3 crc32c codec's suffix: the CRC32C of ``data``, 4 bytes little-endian. Written as
    a separate piece after the chunk's bytes, so no copy of the encoded chunk is made."""
    return google_crc32c.value(data).to_bytes(4, "little")


def stored_pieces(layout: ArrayLayout, data: bytes) -> list[bytes]:
    """What one chunk's file (or slot in a shard) holds: its encoded bytes, then its checksum."""
    return [data, checksum_piece(data)] if layout.crc_codec else [data]


#: Elements of a chunk looked at before it is scanned whole: data almost always has a non-zero
#: among them, so a dense chunk costs ~5 us (a full scan of 1 MiB costs ~40 us).
_EMPTY_PROBE_STRIDE = 61


def is_fill_chunk(chunk: np.ndarray, fill) -> bool:
    """Whether a C-contiguous chunk equals a zero fill value bit for bit (-0.0 and NaN payloads are
    data, so the bytes are compared, not the values). A non-zero fill value is never skipped."""
    if fill:
        return False
    flat = chunk.reshape(-1)
    if flat[::_EMPTY_PROBE_STRIDE].any():  # NaN and non-zero values are True: stops at once
        return False
    return not int(flat.view(np.uint8).max(initial=0))


def write_shard(f: BinaryIO, layout: ArrayLayout, block: np.ndarray, shard_start: Shape, on_chunk=None) -> int:
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


@contextmanager
def atomic_file(path: str) -> Iterator[BinaryIO]:
    """A file written through a temporary name and renamed onto ``path`` once the block exits
    cleanly: a reader or a resumed run never sees half a chunk or shard."""
    if is_url(path):  # an object store: one whole PUT, no temporary name (engine.stores)
        with _object_file(path) as f:
            yield f
        return
    directory, name = os.path.split(path)
    if directory not in _made_dirs:
        os.makedirs(directory, exist_ok=True)
        _made_dirs.add(directory)
    tmp = os.path.join(directory, f".{name}{TMP_MARK}{uuid.uuid4().hex[:12]}")
    try:
        with open(tmp, "wb") as f:
            yield f
            faults.before_rename()
        os.replace(tmp, path)
    except OSError as exc:
        _remove_quietly(tmp)
        if exc.errno in (errno.ENOSPC, errno.EDQUOT):
            raise DiskFullError(f"No space left on the output device while writing {path}. Free space and re-run the same command; finished slabs are kept.") from exc
        raise OutputError(f"Cannot write {path}: {exc.strerror or exc}. Check that the output location is writable.") from exc
    except BaseException:
        _remove_quietly(tmp)
        raise


@contextmanager
def _object_file(url: str) -> Iterator[BinaryIO]:
    """Buffer a unit in memory and PUT it whole once the block exits cleanly (the upload buffer
    of the memory plan): a PUT is atomic, so a reader sees the old object or the new one."""
    buffer = io.BytesIO()
    yield buffer
    faults.before_rename()
    store, key = store_for(url)
    store.put(key, buffer.getbuffer())


def object_bytes(url: str) -> bytes | None:
    store, key = store_for(url)
    try:
        return store.get(key)
    except KeyError:
        return None


def atomic_write(path: str, pieces: list[bytes]) -> int:
    """Write ``pieces`` to ``path`` through a temporary file and a rename. Returns the size."""
    with atomic_file(path) as f:
        f.writelines(pieces)
    return sum(len(p) for p in pieces)


def _remove_quietly(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


def write_block(layout: ArrayLayout, block: np.ndarray, origin: Shape, on_chunk=None, on_file=None) -> list[tuple[str, int]]:
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
    written = []
    for index in layout.units_in(region):
        unit = layout.unit_region(index)
        local = tuple(slice(u.start - o, u.stop - o) for u, o in zip(unit, origin))
        sub = block[local]
        if layout.shards is None:
            data = encode_stored_chunk(layout, sub, on_chunk, unit)
            if data is None:
                nbytes = EMPTY_UNIT_BYTES
            else:
                pieces = stored_pieces(layout, data)
                del data
                nbytes = atomic_write(layout.file(index), pieces)
                if on_file is not None:
                    on_file(layout.key(index), pieces)
                del pieces
        else:
            nbytes = _write_shard_file(layout, index, sub, unit, on_chunk)
        if nbytes == EMPTY_UNIT_BYTES:
            _remove_quietly(layout.file(index))
        written.append((layout.key(index), nbytes))
    return written


class _NothingStored(Exception):
    """Every inner chunk of a shard is the fill value: its temporary file is dropped."""


def _write_shard_file(layout: ArrayLayout, index: tuple[int, ...], sub: np.ndarray, unit: tuple[slice, ...], on_chunk) -> int:
    try:
        with atomic_file(layout.file(index)) as f:
            if not write_shard(f, layout, sub, tuple(u.start for u in unit), on_chunk):
                raise _NothingStored  # atomic_file removes the temporary file, renames nothing
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
    if layout.crc_codec:
        data = checked_payload(data)
    codec = chunk_codec(layout.compressor)
    raw = data if codec is None else codec.decode(data)
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
    """One unit's decoded data, or None where no file exists (reads as the fill value)."""
    if is_url(layout.path):
        data = object_bytes(layout.file(index))
        return None if data is None else decode_unit(layout, data)
    try:
        with open(layout.file(index), "rb") as f:
            data = f.read()
    except FileNotFoundError:
        return None
    return decode_unit(layout, data)


def read_chunk(layout: ArrayLayout, chunk: tuple[int, ...]) -> np.ndarray | None:
    """One chunk's decoded (padded) data, or None where it reads as the fill value: no file, or an
    empty slot in its shard. A shard's index is checked, then only this chunk's bytes are read, so
    ``verify`` holds one chunk, never a whole shard."""
    if layout.shards is None:
        return read_unit(layout, chunk)
    if is_url(layout.path):
        return _object_chunk(layout, chunk)
    per_shard = tuple(s // c for s, c in zip(layout.shards, layout.chunks))
    shard = tuple(i // p for i, p in zip(chunk, per_shard))
    inner = tuple(i % p for i, p in zip(chunk, per_shard))
    tail = 16 * math.prod(per_shard) + 4
    try:
        f = open(layout.file(shard), "rb")
    except FileNotFoundError:
        return None
    with f:
        size = f.seek(0, os.SEEK_END)
        if size < tail:
            raise ValueError(f"shard of {size} bytes is shorter than its index ({tail} bytes)")
        f.seek(size - tail)
        raw = f.read(tail)
        if google_crc32c.value(raw[:-4]).to_bytes(4, "little") != raw[-4:]:
            raise ValueError("shard index checksum mismatch")
        offset, nbytes = (int(v) for v in np.frombuffer(raw[:-4], dtype="<u8").reshape(per_shard + (2,))[inner])
        if offset == int(_EMPTY):
            return None
        if offset + nbytes > size - tail:
            raise ValueError(f"inner chunk {inner} runs past the shard's data")
        f.seek(offset)
        return decode_chunk(layout, f.read(nbytes))


def read_region(layout: ArrayLayout, region: tuple[slice, ...]) -> np.ndarray:
    """Read a region of a level, one file at a time (what a later pass streams from), into this
    thread's slab buffer (valid until the thread's next slab)."""
    out = slab_buffer(tuple(r.stop - r.start for r in region), layout.dtype)
    for index in layout.units_in(region):
        unit = layout.unit_region(index)
        inter = tuple(slice(max(u.start, r.start), min(u.stop, r.stop)) for u, r in zip(unit, region))
        dst = tuple(slice(i.start - r.start, i.stop - r.start) for i, r in zip(inter, region))
        if layout.shards is not None:
            _read_shard_into(layout, index, out[dst], inter)
            continue
        data = read_unit(layout, index)
        if data is None:
            out[dst] = layout.fill_value
        else:
            out[dst] = data[tuple(slice(i.start - u.start, i.stop - u.start) for i, u in zip(inter, unit))]
        del data  # before the next file is read: one decoded unit at a time
    return out


def _read_shard_into(layout: ArrayLayout, index: tuple[int, ...], out: np.ndarray, region: tuple[slice, ...]) -> None:
    """Decode the inner chunks of one shard that ``region`` (level coordinates) touches straight
    into ``out``, reading each chunk's bytes on its own. Holds the index, one encoded and one
    decoded chunk: never the whole shard file nor its decoded array (which cost two decoded shards
    and the file per thread before, issue 18)."""
    if is_url(layout.path):
        _object_shard_into(layout, index, out, region)
        return
    try:
        f = open(layout.file(index), "rb")
    except FileNotFoundError:
        out[...] = layout.fill_value
        return
    with f:
        size = os.fstat(f.fileno()).st_size
        tail = shard_index_bytes(layout)
        if size < tail:
            raise ValueError(f"shard of {size} bytes is shorter than its index ({tail} bytes)")
        table = parse_shard_index(layout, os.pread(f.fileno(), tail, size - tail), size - tail)
        origin = tuple(i * s for i, s in zip(index, layout.shards))
        first = tuple((r.start - o) // c for r, o, c in zip(region, origin, layout.chunks))
        last = tuple(ceil_div(r.stop - o, c) for r, o, c in zip(region, origin, layout.chunks))
        for inner in product(*(range(a, b) for a, b in zip(first, last))):
            start = tuple(o + i * c for o, i, c in zip(origin, inner, layout.chunks))
            inter = tuple(slice(max(s, r.start), min(s + c, r.stop)) for s, c, r in zip(start, layout.chunks, region))
            dst = tuple(slice(i.start - r.start, i.stop - r.start) for i, r in zip(inter, region))
            offset, nbytes = (int(v) for v in table[inner])
            if offset == int(_EMPTY):
                out[dst] = layout.fill_value
                continue
            chunk = decode_chunk(layout, os.pread(f.fileno(), nbytes, offset))
            out[dst] = chunk[tuple(slice(i.start - s, i.stop - s) for i, s in zip(inter, start))]


def _object_chunk(layout: ArrayLayout, chunk: tuple[int, ...]) -> np.ndarray | None:
    """One chunk of a sharded level in an object store: the shard object is fetched whole (one
    GET; a ranged read per chunk would cost a request per chunk) and decoded."""
    per_shard = shard_grid(layout)
    shard = tuple(i // p for i, p in zip(chunk, per_shard))
    decoded = read_unit(layout, shard)
    if decoded is None:
        return None
    place = tuple(slice((i % p) * c, (i % p + 1) * c) for i, p, c in zip(chunk, per_shard, layout.chunks))
    return decoded[place]


def _object_shard_into(layout: ArrayLayout, index: tuple[int, ...], out: np.ndarray, region: tuple[slice, ...]) -> None:
    decoded = read_unit(layout, index)
    if decoded is None:
        out[...] = layout.fill_value
        return
    origin = tuple(i * s for i, s in zip(index, layout.shards))
    out[...] = decoded[tuple(slice(r.start - o, r.stop - o) for r, o in zip(region, origin))]


def attach_stores(layouts) -> None:
    """Tell this process's stores where the object-store levels among ``layouts`` live and with
    which options (a Dask worker learns it from its first task; cheap to repeat)."""
    for layout in layouts:
        if isinstance(layout, ArrayLayout) and layout.storage_options is not None:
            register(os.path.dirname(layout.path), dict(layout.storage_options))
