"""Write the suite's f32 input on many cores, bit for bit what ``bench.data.ensure_input`` writes on
one (run.sh runs it before the suite, which then finds the input cached and generates nothing).

``h5ngff.sample.write_sample`` builds each z-plane with ``_plane`` from one seeded generator, one
``standard_normal`` draw per plane, in z order; on one core that takes about 0.7 s a plane at full
size (150 planes), all before anything is measured. Here the main process replays the same draws
to learn the generator's state before each plane (about 0.1 s a plane) and hands each state to a
pool that builds the plane with the same ``_plane`` and writes it into the contiguous dataset's
bytes. The file is created (same ``create_dataset`` call), named and described (the .json with its
identity, bytes and blosc ratio) by bench's own functions. ``--check`` also writes the file with
``write_sample`` on one core and compares every plane bit for bit (slow at scale 1).

    python pregen.py --scale 1 --data-dir /dev/shm/benchdata --workers 16 [--any-scale] [--check]

Run it from the folder that holds bench/ (the bundle's h5ngff/, or the repository root) with
h5ngff importable (PYTHONPATH=src in the repository). Cases that are not contiguous dense 3-D
volumes are left to the suite."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from multiprocessing import Pool

import h5py
import numpy as np

sys.path.insert(0, os.getcwd())  # the folder that holds bench/

_target: dict = {}


def _init(target: dict) -> None:
    _target.update(target)


def _states(nplanes: int, plane: tuple[int, int]):
    rng = np.random.default_rng(0)  # write_sample's seed, as bench.data.ensure_input passes it
    for z in range(nplanes):
        yield z, rng.bit_generator.state
        rng.standard_normal(plane, dtype=np.float32)  # exactly the draw _plane makes


def _write(job) -> int:
    from h5ngff.sample import _plane

    z, state = job
    t = _target
    rng = np.random.default_rng()
    rng.bit_generator.state = state
    data = _plane(z, t["plane"], rng, np.dtype(t["dtype"]))
    out = np.memmap(t["path"], dtype=t["dtype"], mode="r+", offset=t["offset"] + z * data.nbytes, shape=data.shape)
    out[...] = data
    out.flush()
    del out
    return z


def generate(case, scale: float, data_dir: str, workers: int, check: bool = False) -> bool:
    """Write ``case``'s input unless a matching one is cached; True when it is bit-identical
    (``check``) or was not checked."""
    from bench.containers import data_files, input_name
    from bench.data import REALISTIC_RATIO, _identity, blosc_ratio, case_dir

    from h5ngff.sample import write_sample

    folder = case_dir(data_dir, scale)
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, input_name(case))
    meta_path = path + ".json"
    identity = _identity(case)
    if os.path.exists(path) and os.path.exists(meta_path) and not check:
        with open(meta_path) as f:
            if json.load(f).get("identity") == identity:
                print(f"pregen: {path} already there")
                return True
    start = time.perf_counter()
    nz, ny, nx = case.shape
    dtype = np.dtype(case.dtype)
    tmp = path + ".tmp"
    # The file as write_sample makes it; a first write through h5py allocates the whole contiguous
    # block, then every plane lands at its offset (plane 0 is rewritten by the pool).
    with h5py.File(tmp, "w") as f:
        ds = f.create_dataset(case.dataset, shape=case.shape, dtype=dtype, chunks=None, compression=None)
        ds[0:1] = np.zeros((1, ny, nx), dtype)
        offset = ds.id.get_offset()
    target = {"path": tmp, "offset": offset, "plane": (ny, nx), "dtype": dtype.str}
    with Pool(max(1, workers), initializer=_init, initargs=(target,)) as pool:
        done = sum(1 for _ in pool.imap_unordered(_write, _states(nz, (ny, nx)), chunksize=1))
    os.replace(tmp, path)
    took = time.perf_counter() - start
    meta = {
        "identity": identity,
        "seconds": round(took, 1),
        "file_bytes": sum(os.path.getsize(q) for q in data_files(path)),
        "blosc_ratio": round(blosc_ratio(path, case), 2),
        "generated_by": f"bench/device/pregen.py on {workers} processes",
    }
    with open(meta_path, "w") as f:
        json.dump(meta, f, indent=1)
    low, high = REALISTIC_RATIO
    print(
        f"pregen: {path} {case.shape} {case.dtype}, {done} planes on {workers} processes in {took:.1f} s, "
        f"blosc ratio {meta['blosc_ratio']}{'' if low <= meta['blosc_ratio'] <= high else ' (outside the realistic range)'}"
    )
    if not check:
        return True
    ref = path + ".ref"
    write_sample(
        ref, case.dataset, case.shape, case.dtype, chunks=case.hdf5_chunks, compression=case.compression, seed=0
    )
    try:
        with h5py.File(path, "r") as a, h5py.File(ref, "r") as b:
            da, db = a[case.dataset], b[case.dataset]
            same = all(np.array_equal(da[z].view(np.uint32), db[z].view(np.uint32)) for z in range(nz))
            layout = (da.id.get_create_plist().get_layout(), da.chunks, da.compression, da.shape, da.dtype) == (
                db.id.get_create_plist().get_layout(),
                db.chunks,
                db.compression,
                db.shape,
                db.dtype,
            )
    finally:
        os.remove(ref)
    print(f"pregen check: every plane bit-identical to write_sample: {same}; same layout: {layout}")
    return same and layout


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--scale", type=float, required=True)
    p.add_argument("--data-dir", required=True)
    p.add_argument("--workers", type=int, default=len(os.sched_getaffinity(0)))
    p.add_argument("--cases", default="f32")
    p.add_argument(
        "--check", action="store_true", help="also write the file with write_sample and compare (slow: one core)"
    )
    args = p.parse_args(argv)
    from bench.config import build_cases

    ok = True
    cases = build_cases(args.scale)
    for name in args.cases.split(","):
        case = cases[name]
        if case.container != "h5" or case.hdf5_chunks or case.compression or case.sparse or len(case.shape) != 3:
            print(f"pregen: {name} left to the suite (only contiguous dense 3-D cases are written here)")
            continue
        ok = generate(case, args.scale, args.data_dir, args.workers, args.check) and ok
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
