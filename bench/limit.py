"""The physical limit: one core doing only the work every converter must do, timed per stage.

    python -m bench.limit --source in.h5 --dataset /volume/data --out limit.zarr --chunks 64,64,64 --result r.json

1. read: h5py reads slabs one chunk deep along every axis but the last two, and as many rows as
   hold whole HDF5 chunks (one chunk row for contiguous data), in storage order into one reused
   buffer, so each HDF5 byte (and each compressed HDF5 chunk) is read exactly once while the slab
   stays small enough to be cache-friendly. Deflate-only chunks are inflated with libdeflate
   (``h5ngff.engine.inflate``), as h5ngff reads them: the limit must not read slower than we do;
2. extract: each (64,64,64) chunk is copied out contiguous into one reused buffer (edge chunks
   zero-padded to the full chunk, as Zarr stores them);
3. encode: numcodecs Blosc zstd 5 + bitshuffle, one blosc thread;
4. write: one file per chunk at Zarr v3's default key (``c/z/y/x``).

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

from h5ngff.engine.inflate import direct_deflate, read_deflate

from .config import CODEC


def _ints(text: str) -> tuple[int, ...]:
    return tuple(int(v) for v in text.split(","))


def _create_array(out: str, shape, chunks, dtype) -> None:
    try:
        zarr.create_array(out, shape=shape, chunks=chunks, dtype=dtype, compressors=BloscCodec(**CODEC), fill_value=0, zarr_format=3)
    except zarr.errors.ContainsArrayError:
        pass  # another part of a parallel measurement made it (same metadata)


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


def measure_limit(source: str, dataset: str, out: str, chunks: tuple[int, ...], part: tuple[int, int] = (0, 1)) -> dict:
    """``part`` (i, n): only every n-th slab, from the i-th; n processes in parallel measure what
    n cores really do together (shared caches and memory bandwidth included)."""
    blosc.set_nthreads(1)
    blosc.use_threads = False
    codec = numcodecs.Blosc(cname=CODEC["cname"], clevel=CODEC["clevel"], shuffle=numcodecs.Blosc.BITSHUFFLE)
    stages = dict.fromkeys(("read", "extract", "encode", "write"), 0.0)
    n_chunks = bytes_out = 0
    clock = time.perf_counter
    with h5py.File(source, "r") as f:
        ds = f[dataset]
        shape = ds.shape
        _create_array(out, shape, chunks, ds.dtype)
        slab_shape = _slab_shape(ds, chunks)
        buffer = np.empty(slab_shape, dtype=ds.dtype)
        block = np.empty(chunks, dtype=ds.dtype)
        made_dirs: set[str] = set()
        direct = direct_deflate(ds)
        cpu0, start = time.process_time(), clock()
        slab_starts = product(*(range(0, n, s) for n, s in zip(shape, slab_shape)))
        for number, origin in enumerate(slab_starts):
            if number % part[1] != part[0]:
                continue
            t = clock()
            sel = tuple(slice(o, min(o + s, n)) for o, s, n in zip(origin, slab_shape, shape))
            dest = tuple(slice(0, r.stop - r.start) for r in sel)
            if direct:  # the same inflater h5ngff uses, so the limit stays a lower bound
                read_deflate(ds, sel, buffer[dest])
            else:
                ds.read_direct(buffer, source_sel=sel, dest_sel=dest)
            slab = buffer[dest]
            stages["read"] += clock() - t
            for local in product(*(range(0, n, c) for n, c in zip(slab.shape, chunks))):
                t0 = clock()
                _chunk(slab, tuple(slice(o, o + c) for o, c in zip(local, chunks)), block)
                t1 = clock()
                encoded = codec.encode(block)
                t2 = clock()
                keys = [str((o + i) // c) for o, i, c in zip(origin, local, chunks)]
                folder = os.path.join(out, "c", *keys[:-1])
                if folder not in made_dirs:
                    os.makedirs(folder, exist_ok=True)
                    made_dirs.add(folder)
                with open(os.path.join(folder, keys[-1]), "wb") as fh:
                    fh.write(encoded)
                t3 = clock()
                stages["extract"] += t1 - t0
                stages["encode"] += t2 - t1
                stages["write"] += t3 - t2
                n_chunks += 1
                bytes_out += len(encoded)
        total = clock() - start
        cpu = time.process_time() - cpu0
        bytes_in = int(np.prod(shape)) * ds.dtype.itemsize
    return {"stages": stages, "total": total, "cpu_seconds": cpu, "chunks": n_chunks, "bytes_in": bytes_in, "bytes_out": bytes_out,
            "max_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.limit", description="Measure the one-core physical limit of a conversion.")
    p.add_argument("--source", required=True)
    p.add_argument("--dataset", default="/volume/data")
    p.add_argument("--out", required=True)
    p.add_argument("--chunks", required=True, type=_ints)
    p.add_argument("--result", required=True)
    p.add_argument("--part", default="0/1", help="I/N: only every N-th slab from the I-th (for a parallel measurement).")
    args = p.parse_args(argv)
    index, count = (int(v) for v in args.part.split("/"))
    result = measure_limit(args.source, args.dataset, args.out, args.chunks, (index, count))
    with open(args.result, "w") as f:
        json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
