"""The physical limit: one core doing only the work every converter must do, timed per stage.

    python -m bench.limit --source in.h5 --dataset /volume/data --out limit.zarr --chunks 64,64,64 --result r.json
    python -m bench.limit ... --levels 3 [--part 0/2]     # the floor of a 3-level mean pyramid

1. read: h5py reads slabs one chunk deep along every axis but the last two, and as many rows as
   hold whole HDF5 chunks (one chunk row for contiguous data), in storage order into one reused
   buffer, so each HDF5 byte (and each compressed HDF5 chunk) is read exactly once while the slab
   stays small enough to be cache-friendly. Deflate-only chunks are inflated with libdeflate
   (``h5ngff.engine.sources.inflate``), as h5ngff reads them: the limit must not read slower than we do;
2. extract: each (64,64,64) chunk is copied out contiguous into one reused buffer (edge chunks
   zero-padded to the full chunk, as Zarr stores them);
3. encode: numcodecs Blosc zstd 5 + bitshuffle, one blosc thread;
4. write: one file per chunk at Zarr v3's default key (``c/z/y/x``).

With ``--levels N`` (N > 1) it is the floor of an N-level mean pyramid instead, the work every
pyramid converter must add: each slab is also halved into level 1 (held whole in memory, so no
level is ever read back), then level k is halved from level k-1, and every level's chunks are
extracted, encoded and written as above. The halving is h5ngff's own exact mean
(``h5ngff.engine.write.downsample``: the verifier demands it bit for bit), timed apart as
``downsample`` so a slow mean cannot hide in the floor. The output is an OME-style group of
arrays ``0`` .. ``N-1``.

The output is a real Zarr v3 array (its ``zarr.json`` is written before the clock starts), so the
benchmark verifies it like any tool's output: the limit cannot be fast by being wrong. The suite
divides the total by the cores in use: no converter on N cores can beat total / N.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import resource
import time
from itertools import product

import h5py
import numcodecs
import numpy as np
import zarr
from numcodecs import blosc
from zarr.codecs import BloscCodec

from h5ngff.engine.write.downsample import downsample, output_shape
from h5ngff.engine.sources.inflate import direct_deflate, read_deflate

from .config import CODEC


def _ints(text: str) -> tuple[int, ...]:
    return tuple(int(v) for v in text.split(","))


def _create_array(out: str, shape, chunks, dtype) -> None:
    try:
        zarr.create_array(
            out, shape=shape, chunks=chunks, dtype=dtype, compressors=BloscCodec(**CODEC), fill_value=0, zarr_format=3
        )
    except zarr.errors.ContainsArrayError:
        pass  # another part of a parallel measurement made it (same metadata)


def _create_pyramid(out: str, shapes: list[tuple[int, ...]], chunks, dtype) -> None:
    """A group whose multiscales name the levels ``0`` .. ``N-1`` (what bench.verify opens)."""
    group = zarr.open_group(out, mode="a", zarr_format=3)  # parts of a parallel measurement share it
    group.attrs["ome"] = {"multiscales": [{"datasets": [{"path": str(k)} for k in range(len(shapes))]}]}
    for k, shape in enumerate(shapes):
        _create_array(os.path.join(out, str(k)), shape, chunks, dtype)


def _chunk(slab: np.ndarray, index: tuple[slice, ...], out: np.ndarray) -> np.ndarray:
    """Copy one chunk into ``out`` (reused: a fresh array per chunk would add allocator work and
    page faults that no converter has to pay)."""
    part = slab[index]
    if part.shape != out.shape:
        out.fill(0)
    out[tuple(slice(0, n) for n in part.shape)] = part
    return out


def _slab_shape(ds, chunks: tuple[int, ...]) -> tuple[int, ...]:
    """A slab holds whole output chunks and whole HDF5 chunks (least common multiple per axis),
    and the whole last axis: each stored byte is read and decompressed once, in storage order."""
    stored = ds.chunks or (1,) * ds.ndim
    lead = tuple(min(math.lcm(c, h), n) for c, h, n in zip(chunks[:-1], stored[:-1], ds.shape[:-1]))
    return lead + (ds.shape[-1],)


class _ChunkWriter:
    """Extract, encode and write every chunk of a region, each stage timed on its own."""

    def __init__(self, out: str, chunks: tuple[int, ...], dtype, stages: dict[str, float]):
        self.out, self.chunks, self.stages = out, chunks, stages
        self.codec = numcodecs.Blosc(cname=CODEC["cname"], clevel=CODEC["clevel"], shuffle=numcodecs.Blosc.BITSHUFFLE)
        self.block = np.empty(chunks, dtype=dtype)
        self.made_dirs: set[str] = set()
        self.n_chunks = self.bytes_out = 0

    def write(self, region: np.ndarray, origin: tuple[int, ...]) -> None:
        clock, chunks, block = time.perf_counter, self.chunks, self.block
        for local in product(*(range(0, n, c) for n, c in zip(region.shape, chunks))):
            t0 = clock()
            _chunk(region, tuple(slice(o, o + c) for o, c in zip(local, chunks)), block)
            t1 = clock()
            encoded = self.codec.encode(block)
            t2 = clock()
            keys = [str((o + i) // c) for o, i, c in zip(origin, local, chunks)]
            folder = os.path.join(self.out, "c", *keys[:-1])
            if folder not in self.made_dirs:
                os.makedirs(folder, exist_ok=True)
                self.made_dirs.add(folder)
            with open(os.path.join(folder, keys[-1]), "wb") as fh:
                fh.write(encoded)
            t3 = clock()
            self.stages["extract"] += t1 - t0
            self.stages["encode"] += t2 - t1
            self.stages["write"] += t3 - t2
            self.n_chunks += 1
            self.bytes_out += len(encoded)


def _band(shape: tuple[int, ...], chunks: tuple[int, ...], levels: int, part: tuple[int, int]) -> tuple[int, int]:
    """Part i of n of a pyramid: a band of rows (the second-last axis) that starts and ends on a
    chunk of the deepest level, so each part builds its levels alone and no chunk has two writers."""
    unit = chunks[-2] * 2 ** (levels - 1)
    units = -(-shape[-2] // unit)
    i, n = part
    return min(units * i // n * unit, shape[-2]), min(units * (i + 1) // n * unit, shape[-2])


def measure_limit(
    source: str, dataset: str, out: str, chunks: tuple[int, ...], part: tuple[int, int] = (0, 1), levels: int = 1
) -> dict:
    """``part`` (i, n): n processes in parallel measure what n cores really do together (shared
    caches and memory bandwidth included); part i takes every n-th slab from the i-th, or for a
    pyramid (``levels`` > 1, see the module's docstring) the i-th band of rows."""
    blosc.set_nthreads(1)
    blosc.use_threads = False
    stages = dict.fromkeys(("read", "extract", "encode", "write") + (("downsample",) if levels > 1 else ()), 0.0)
    clock = time.perf_counter
    with h5py.File(source, "r") as f:
        ds = f[dataset]
        shape = ds.shape
        # The spatial axes (the last three) are halved; channels and time are not.
        halved = tuple(i >= ds.ndim - 3 for i in range(ds.ndim))
        rows = _band(shape, chunks, levels, part) if levels > 1 else (0, shape[-2])
        band_origin = (0,) * (ds.ndim - 2) + (rows[0], 0)
        band_shapes = [tuple(shape[:-2]) + (rows[1] - rows[0], shape[-1])]
        shapes = [tuple(shape)]
        for _ in range(levels - 1):
            shapes.append(output_shape(shapes[-1], halved))
            band_shapes.append(output_shape(band_shapes[-1], halved))
        if levels > 1:
            _create_pyramid(out, shapes, chunks, ds.dtype)
            writers = [_ChunkWriter(os.path.join(out, str(k)), chunks, ds.dtype, stages) for k in range(levels)]
            level1 = np.empty(band_shapes[1], dtype=ds.dtype)  # the whole level: nothing is read back
        else:
            _create_array(out, shape, chunks, ds.dtype)
            writers = [_ChunkWriter(out, chunks, ds.dtype, stages)]
        slab_shape = _slab_shape(ds, chunks)
        buffer = np.empty(slab_shape, dtype=ds.dtype)
        direct = direct_deflate(ds)
        cpu0, start = time.process_time(), clock()
        slab_starts = product(
            *(range(0, n, s) for n, s in zip(shape[:-2], slab_shape[:-2])),
            range(rows[0], rows[1], slab_shape[-2]),
            (0,),
        )
        for number, origin in enumerate(slab_starts):
            if levels == 1 and number % part[1] != part[0]:
                continue
            t = clock()
            sel = tuple(
                slice(o, min(o + s, n)) for o, s, n in zip(origin, slab_shape, shape[:-2] + (rows[1], shape[-1]))
            )
            dest = tuple(slice(0, r.stop - r.start) for r in sel)
            if direct:  # the same inflater h5ngff uses, so the limit stays a lower bound
                read_deflate(ds, sel, buffer[dest])
            else:
                ds.read_direct(buffer, source_sel=sel, dest_sel=dest)
            slab = buffer[dest]
            stages["read"] += clock() - t
            writers[0].write(slab, origin)
            if levels > 1:
                # Slabs start on even indices (multiples of a 64-chunk), so halving each slab is
                # halving the volume.
                t = clock()
                half = tuple((o - b) // 2 if h else o - b for o, b, h in zip(origin, band_origin, halved))
                target = level1[tuple(slice(o, o + n) for o, n in zip(half, output_shape(slab.shape, halved)))]
                downsample(slab, halved, "mean", out=target)
                stages["downsample"] += clock() - t
        level = level1 if levels > 1 else None
        for k in range(1, levels if rows[1] > rows[0] else 1):  # a part may get no band at all
            if k > 1:
                t = clock()
                level = downsample(level, halved, "mean")
                stages["downsample"] += clock() - t
            writers[k].write(level, tuple(b // 2**k if h else b for b, h in zip(band_origin, halved)))
        total = clock() - start
        cpu = time.process_time() - cpu0
        bytes_in = int(np.prod(shape)) * ds.dtype.itemsize
    return {
        "stages": stages,
        "total": total,
        "cpu_seconds": cpu,
        "chunks": sum(w.n_chunks for w in writers),
        "bytes_in": bytes_in,
        "bytes_out": sum(w.bytes_out for w in writers),
        "levels": levels,
        "max_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m bench.limit", description="Measure the one-core physical limit of a conversion."
    )
    p.add_argument("--source", required=True)
    p.add_argument("--dataset", default="/volume/data")
    p.add_argument("--out", required=True)
    p.add_argument("--chunks", required=True, type=_ints)
    p.add_argument("--result", required=True)
    p.add_argument(
        "--part", default="0/1", help="I/N: only every N-th slab from the I-th (for a parallel measurement)."
    )
    p.add_argument(
        "--levels",
        type=int,
        default=1,
        help="N > 1: the floor of an N-level mean pyramid (with --part, a band of rows each).",
    )
    args = p.parse_args(argv)
    index, count = (int(v) for v in args.part.split("/"))
    result = measure_limit(args.source, args.dataset, args.out, args.chunks, (index, count), args.levels)
    with open(args.result, "w") as f:
        json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
