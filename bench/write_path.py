"""Why h5ngff encodes and stores chunks itself: one slab written three ways, one thread each.

    .venv/bin/python -m bench.write_path [--slab 64,704,2008] [--repeat 3]

1. zarr-python 3: ``array[region] = slab`` (its codec pipeline and LocalStore);
2. h5ngff's writer (``engine.write.chunkio.write_block``: numcodecs encode + atomic file per chunk);
3. the bare minimum: encode each chunk with numcodecs and ``open().write()`` it.

Each is run ``--repeat`` times interleaved and the best time is kept, so background load hurts all
three alike. The output chunks are the benchmark's: (64,64,64), blosc zstd 5 bitshuffle.
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time

import numcodecs
import numpy as np
import zarr
from zarr.codecs import BloscCodec

from h5ngff.engine.write.chunkio import ArrayLayout, write_block
from h5ngff.sample import _plane
from h5ngff.spec import CompressorSpec

CHUNK = (64, 64, 64)


def make_slab(shape: tuple[int, int, int]) -> np.ndarray:
    rng = np.random.default_rng(0)
    return np.stack([_plane(z, shape[1:], rng, np.dtype("float32")) for z in range(shape[0])])


def with_zarr(slab: np.ndarray, path: str) -> None:
    zarr.config.set({"async.concurrency": 1, "threading.max_workers": 1})
    arr = zarr.create_array(
        path,
        shape=slab.shape,
        chunks=CHUNK,
        dtype=slab.dtype,
        fill_value=0,
        compressors=[BloscCodec(cname="zstd", clevel=5, shuffle="bitshuffle")],
        overwrite=True,
    )
    arr[...] = slab


def with_h5ngff(slab: np.ndarray, path: str) -> None:
    layout = ArrayLayout(
        path,
        slab.shape,
        CHUNK,
        None,
        "<f4",
        3,
        CompressorSpec(codec="blosc", cname="zstd", clevel=5, shuffle="bitshuffle"),
        0,
    )
    write_block(layout, slab, (0, 0, 0))


def bare(slab: np.ndarray, path: str) -> None:
    codec = numcodecs.Blosc("zstd", 5, numcodecs.Blosc.BITSHUFFLE)
    for index in np.ndindex(*(-(-n // c) for n, c in zip(slab.shape, CHUNK))):
        block = slab[tuple(slice(i * c, (i + 1) * c) for i, c in zip(index, CHUNK))]
        chunk = np.zeros(CHUNK, slab.dtype)
        chunk[tuple(slice(0, n) for n in block.shape)] = block
        directory = os.path.join(path, "c", *map(str, index[:-1]))
        os.makedirs(directory, exist_ok=True)
        with open(os.path.join(directory, str(index[-1])), "wb") as f:
            f.write(codec.encode(chunk))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--slab", default="64,704,2008")
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args(argv)
    numcodecs.blosc.set_nthreads(1)
    slab = make_slab(tuple(int(v) for v in args.slab.split(",")))
    best = {name: float("inf") for name in ("zarr-python", "h5ngff", "bare")}
    for _ in range(args.repeat):
        for name, fn in (("zarr-python", with_zarr), ("h5ngff", with_h5ngff), ("bare", bare)):
            path = tempfile.mkdtemp(prefix="write-path-")
            start = time.perf_counter()
            fn(slab, path)
            best[name] = min(best[name], time.perf_counter() - start)
            shutil.rmtree(path)
    chunks = np.prod([-(-n // c) for n, c in zip(slab.shape, CHUNK)])
    print(
        f"slab {slab.shape} float32 ({slab.nbytes / 2**20:.0f} MiB, {chunks} chunks of 64^3), best of {args.repeat}, one thread:"
    )
    for name, seconds in best.items():
        print(
            f"  {name:12s} {seconds:6.2f} s   {seconds / best['bare']:.2f} x bare   {seconds / chunks * 1e3:.2f} ms/chunk"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
