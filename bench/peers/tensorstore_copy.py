"""A tensorstore slab copy: read (64, 704, X) slabs with h5py and write each into a zarr3
tensorstore array; one write stays in flight while the next slab is read."""

from __future__ import annotations

import h5py
import numpy as np
import tensorstore as ts

from ..config import CODEC
from .common import peer_main, slabs


def spec(out: str, shape, chunks, dtype: np.dtype) -> dict:
    codecs = [
        {"name": "bytes", "configuration": {"endian": "little"}},
        {"name": "blosc", "configuration": {**CODEC, "typesize": dtype.itemsize, "blocksize": 0}},
    ]
    metadata = {
        "shape": list(shape),
        "data_type": dtype.name,
        "fill_value": 0,
        "codecs": codecs,
        "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": list(chunks)}},
        "chunk_key_encoding": {"name": "default"},
    }
    return {"driver": "zarr3", "kvstore": {"driver": "file", "path": out}, "metadata": metadata, "create": True}


def convert(args) -> dict:
    with h5py.File(args.source, "r") as f:
        ds = f[args.dataset]
        target = ts.open(spec(args.out, ds.shape, args.chunks, ds.dtype)).result()
        pending = None
        for sel in slabs(ds.shape, args.slab):
            data = ds[sel]
            if pending is not None:
                pending.result()
            pending = target[sel].write(data)
        if pending is not None:
            pending.result()
    return {"slab": args.slab}


if __name__ == "__main__":
    raise SystemExit(peer_main(convert))
