"""Reference inputs, generated once per scale and cached under the data directory.

The volumes come from ``h5ngff.sample.write_sample``: smooth structure plus quantised sensor
noise, so blosc/zstd compresses them a few times over like real images (not 1x like random noise,
not 50x like zeros). The ratio is measured on a sample of chunks and kept with the file.
"""

from __future__ import annotations

import json
import logging
import os
import time

import numcodecs
import numpy as np

from h5ngff.sample import write_sample

from .config import CHUNK, CODEC, GENERATOR_VERSION, Case, scale_tag
from .containers import data_files, input_name, open_image, write_container

log = logging.getLogger(__name__)

#: A blosc ratio outside this range means the data no longer looks like real images.
REALISTIC_RATIO = (1.5, 6.0)


def case_dir(data_dir: str, scale: float) -> str:
    return os.path.join(data_dir, f"scale-{scale_tag(scale)}")


def _identity(case: Case) -> dict:
    identity = {
        "generator": GENERATOR_VERSION,
        "shape": list(case.shape),
        "dtype": case.dtype,
        "dataset": case.dataset,
        "hdf5_chunks": list(case.hdf5_chunks) if case.hdf5_chunks else None,
        "compression": case.compression,
        "seed": 0,
    }
    # Only the containers add the key, so the HDF5 inputs already cached stay valid.
    identity |= {"sparse": round(case.sparse, 4)} if case.sparse else {}
    return identity | ({"container": case.container} if case.container != "h5" else {})


def _zero_tail(path: str, case: Case) -> None:
    """Zero the last ``case.sparse`` of the y extent, in whole output chunks, one z-plane at a time."""
    import h5py

    y = case.shape[-2]
    first = min(y, -(-round((1 - case.sparse) * y) // CHUNK) * CHUNK)
    with h5py.File(path, "r+") as f:
        ds = f[case.dataset]
        zeros = np.zeros(ds.shape[-2:], dtype=ds.dtype)[first:]
        for z in range(case.shape[-3]):
            ds[..., z, first:, :] = zeros


def ensure_input(case: Case, scale: float, data_dir: str) -> tuple[str, dict]:
    """Path of the case's HDF5 file, .ims or BDV .xml (generated unless a matching one is cached)
    and its metadata."""
    folder = case_dir(data_dir, scale)
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, input_name(case))
    meta_path = path + ".json"
    identity = _identity(case)
    if os.path.exists(path) and os.path.exists(meta_path):
        with open(meta_path) as f:
            meta = json.load(f)
        if meta.get("identity") == identity:
            return path, meta
    log.warning("generating %s: %s", path, case.describe())
    start = time.perf_counter()
    if case.container != "h5":
        # The metadata file is written last: an interrupted generation is never reused.
        for name in data_files(path) + [meta_path]:
            if os.path.exists(name):
                os.remove(name)
        write_container(case, path)
    else:
        tmp = path + ".tmp"
        # Written under a temporary name and renamed: an interrupted generation is never reused.
        write_sample(
            tmp, case.dataset, case.shape, case.dtype, chunks=case.hdf5_chunks, compression=case.compression, seed=0
        )
        if case.sparse:
            _zero_tail(tmp, case)
        os.replace(tmp, path)
    meta = {
        "identity": identity,
        "seconds": round(time.perf_counter() - start, 1),
        "file_bytes": sum(os.path.getsize(p) for p in data_files(path)),
        "blosc_ratio": round(blosc_ratio(path, case), 2),
    }
    with open(meta_path, "w") as f:
        json.dump(meta, f, indent=1)
    low, high = REALISTIC_RATIO
    if not low <= meta["blosc_ratio"] <= high:
        log.warning(
            "%s compresses %.2fx with %s: outside the realistic %.1f-%.1fx", path, meta["blosc_ratio"], CODEC, low, high
        )
    return path, meta


def blosc_ratio(path: str, case: Case, max_chunks: int = 48) -> float:
    """Raw/encoded bytes over up to ``max_chunks`` whole output chunks spread over the volume."""
    codec = numcodecs.Blosc(cname=CODEC["cname"], clevel=CODEC["clevel"], shuffle=numcodecs.Blosc.BITSHUFFLE)
    lead = (0,) * (len(case.shape) - 3)
    z, y, x = case.shape[-3:]
    c = case.chunks[-1]
    grid = [
        (zi, yi, xi)
        for zi in range(0, max(1, z - c + 1), c)
        for yi in range(0, max(1, y - c + 1), c)
        for xi in range(0, max(1, x - c + 1), c)
    ]
    picks = grid[:: max(1, len(grid) // max_chunks)][:max_chunks]
    raw = enc = 0
    with open_image(path, case) as ds:
        for zi, yi, xi in picks:
            block = np.ascontiguousarray(ds[lead + (slice(zi, zi + c), slice(yi, yi + c), slice(xi, xi + c))])
            raw += block.nbytes
            enc += len(codec.encode(block))
    return raw / max(1, enc)


def warm_page_cache(path: str, block: int = 64 << 20) -> float:
    """Read the file (a BDV XML: and its HDF5) once so every tool starts from the same warm page
    cache. Returns seconds."""
    start = time.perf_counter()
    buf = bytearray(block)
    for name in data_files(path):
        with open(name, "rb", buffering=0) as f:
            while f.readinto(buf):
                pass
    return time.perf_counter() - start
