"""The argument protocol and timing every peer script shares."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import time
from collections.abc import Callable, Iterator
from itertools import product

import numpy as np

from ..config import CODEC


def _ints(text: str) -> tuple[int, ...]:
    return tuple(int(v) for v in text.split(","))


def peer_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="Convert one HDF5 dataset to Zarr the way this tool's users do.")
    p.add_argument("--source", required=True, help="HDF5 file")
    p.add_argument("--dataset", default="/volume/data")
    p.add_argument("--out", required=True, help="output directory (must not exist)")
    p.add_argument("--result", required=True, help="JSON file to write the timing into")
    p.add_argument("--axes", default="zyx")
    p.add_argument("--chunks", type=_ints, required=True)
    p.add_argument("--levels", type=int, default=1)
    p.add_argument("--method", default="", help="pyramid method, in the tool's own words")
    p.add_argument("--slab", type=_ints, help="read slab (scripts that read by slab)")
    p.add_argument("--workers", type=int, help="worker processes (default: one per core)")
    p.add_argument("--no-checksums", action="store_true", help="h5ngff only: no crc32c per chunk")
    return p.parse_args(argv)


def peer_main(convert: Callable[[argparse.Namespace], dict | None], argv: list[str] | None = None) -> int:
    """Time ``convert(args)`` (everything after the imports) and write the result file."""
    args = peer_args(argv)
    start = time.perf_counter()
    extra = convert(args) or {}
    seconds = time.perf_counter() - start
    with open(args.result, "w") as f:
        json.dump({"seconds": seconds, "extra": extra}, f, indent=1, default=str)
    return 0


def workers(args: argparse.Namespace) -> int:
    return args.workers or len(os.sched_getaffinity(0))


def zarr_blosc():
    """The benchmark's codec as a zarr-python v3 codec object."""
    from zarr.codecs import BloscCodec

    return BloscCodec(**CODEC)


def slabs(shape: tuple[int, ...], slab: tuple[int, ...]) -> Iterator[tuple[slice, ...]]:
    """Slab selections in storage order."""
    for origin in product(*(range(0, n, s) for n, s in zip(shape, slab))):
        yield tuple(slice(o, min(o + s, n)) for o, s, n in zip(origin, slab, shape))


def spatial_factors(axes: str, factor: int) -> dict[str, int]:
    return {a: (factor if a in "zyx" else 1) for a in axes}


def dtype_of(source: str, dataset: str) -> tuple[tuple[int, ...], np.dtype]:
    import h5py

    with h5py.File(source, "r") as f:
        return f[dataset].shape, f[dataset].dtype


@contextlib.contextmanager
def source_array(source: str, dataset: str):
    """The source as a Dask array, read the way a user of each container would without h5ngff:
    an HDF5 dataset with h5py; an Imaris file with imaris-ims-file-reader (its (t, c, z, y, x)
    array, cropped to the image, t dropped); a BigDataViewer pair with h5py on each setup's
    ``t00000/sSS/0/cells`` stacked as channels, its int16 bytes viewed as uint16 (BDV's convention)."""
    import dask.array as da
    import h5py

    if source.endswith(".ims"):
        from imaris_ims_file_reader.ims import ims

        reader = ims(source, squeeze_output=False)
        try:
            # Its reads always return 5-D blocks (an integer index does not drop the axis), so
            # time point 0 is taken from each block rather than by indexing the reader.
            yield da.from_array(reader).map_blocks(lambda block: block[0], drop_axis=0, dtype=reader.dtype)
        finally:
            reader.close()
    elif source.endswith(".xml"):
        with h5py.File(source[:-4] + ".h5", "r") as f:
            setups = sorted(k for k in f if k.startswith("s"))
            yield da.stack([da.from_array(f[f"t00000/{s}/0/cells"]) for s in setups]).view("uint16")
    else:
        with h5py.File(source, "r") as f:
            yield da.from_array(f[dataset])
