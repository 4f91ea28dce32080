"""One image from many files against one file of the stacked size, and against EuBI-Bridge's
aggregative conversion, in the same run (issue 45, docs/benchmarks.md).

    .venv/bin/python -m bench.files_stack [--files 40] [--shape 32,256,256] [--repeat 3]
        [--eubi /path/to/venv/bin/eubi] [--result r.json]

The inputs: N HDF5 files, one time point each, (Z, Y, X) uint16 (``h5ngff.sample``: compresses like
microscopy), and one HDF5 file holding the same N time points as one (N, Z, Y, X) dataset; with
``--eubi``, the same time points as N TIFF files, which EuBI-Bridge reads (its HDF5 reading did
not work here: its reader took the files for Imaris and failed, so it is compared on its TIFF
path, as the peers measured in the issue were).

Measured per round, page cache warm, each tool timed end to end as a user runs it (interpreter
start, imports and cluster start included), rounds interleaved and each keeping its fastest:

1. ``h5ngff convert 'DIR/t*.h5:/data' OUT --stack-axis t``: the N files stacked;
2. ``h5ngff convert one.h5:/data OUT``: one file of the stacked size, the same chunks and pyramid;
3. ``eubi to_zarr DIR OUT --concatenation_axes t`` (with ``--eubi``).

Every h5ngff output is checked against numpy stacking of the sources (level 0 exact), and so is
EuBI-Bridge's level 0. Target: (1) <= 1.1 x (2). Exit 0 when it is met.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

import h5py
import numpy as np
import zarr

from h5ngff.sample import write_sample

from .config import REPO_DIR

TARGET = 1.1
CHUNKS = "1,32,64,64"


def make_inputs(directory: str, files: int, shape: tuple[int, ...], tiffs: bool) -> np.ndarray:
    """The N files, the one stacked file and (``tiffs``) the TIFF copies; returns the stack."""
    os.makedirs(os.path.join(directory, "h5"), exist_ok=True)
    planes = []
    for t in range(files):
        path = os.path.join(directory, "h5", f"t{t}.h5")
        write_sample(path, "/data", shape, "uint16", chunks=(min(16, shape[0]), *shape[1:]), seed=t)
        with h5py.File(path, "r") as f:
            planes.append(f["data"][...])
    stack = np.stack(planes)
    with h5py.File(os.path.join(directory, "one.h5"), "w") as f:
        f.create_dataset("data", data=stack, chunks=(1, min(16, shape[0]), *shape[1:]))
    if tiffs:
        import tifffile

        os.makedirs(os.path.join(directory, "tif"), exist_ok=True)
        for t, plane in enumerate(planes):
            tifffile.imwrite(os.path.join(directory, "tif", f"t{t:03d}.tif"), plane, metadata={"axes": "ZYX"})
    return stack


def warm(directory: str) -> None:
    for root, _, names in os.walk(directory):
        for name in names:
            with open(os.path.join(root, name), "rb") as f:
                while f.read(1 << 24):
                    pass


def timed(argv: list[str]) -> float:
    start = time.perf_counter()
    proc = subprocess.run(argv, capture_output=True, text=True)
    seconds = time.perf_counter() - start
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(argv[:4])} ... failed ({proc.returncode}): {proc.stderr[-2000:]}")
    return seconds


def h5ngff(*args: str) -> list[str]:
    return [os.path.join(REPO_DIR, ".venv", "bin", "h5ngff"), *args]


def level0(out: str) -> np.ndarray:
    group = zarr.open_group(out, mode="r")
    return group["0"][...]


def run(args: argparse.Namespace) -> dict:
    shape = tuple(int(v) for v in args.shape.split(","))
    work = tempfile.mkdtemp(prefix="h5ngff-files-stack-", dir=args.work_dir)
    try:
        stack = make_inputs(work, args.files, shape, bool(args.eubi))
        flags = ["--chunks", CHUNKS, "--levels", "auto", "--no-progress", "--json"]
        best: dict[str, float] = {}
        for _ in range(args.repeat):
            for name, argv in (
                ("stacked", h5ngff("convert", f"{work}/h5/t*.h5:/data", f"{work}/stacked.ome.zarr", "--stack-axis", "t", *flags)),
                ("one file", h5ngff("convert", f"{work}/one.h5:/data", f"{work}/one.ome.zarr", *flags)),
                *(
                    [("eubi-bridge-lite (TIFF)", [args.eubi, "to_zarr", f"{work}/tif", f"{work}/eubi.zarr", "--concatenation_axes", "t", "--time_tag", "t"])]
                    if args.eubi
                    else []
                ),
            ):  # fmt: skip
                out = argv[4] if name != "eubi-bridge-lite (TIFF)" else f"{work}/eubi.zarr"
                shutil.rmtree(out, ignore_errors=True)
                warm(work)
                best[name] = min(best.get(name, float("inf")), timed(argv))
        assert np.array_equal(level0(f"{work}/stacked.ome.zarr"), stack)
        assert np.array_equal(level0(f"{work}/one.ome.zarr")[:, :, :, :], stack)
        if args.eubi:
            best["eubi level 0 equal"] = float(_eubi_equal(f"{work}/eubi.zarr", stack))
        ratio = best["stacked"] / best["one file"]
        return {"files": args.files, "shape": shape, "seconds": best, "ratio": ratio, "target": TARGET}
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _eubi_equal(out: str, stack: np.ndarray) -> bool:
    """EuBI-Bridge writes OUT/<tag>_tset.zarr, whose level 0 is a 5-D tczyx array: the values in
    C order must be the stack's."""
    inner = [name for name in sorted(os.listdir(out)) if name.endswith(".zarr")]
    if not inner:
        return False
    data = np.asarray(zarr.open_group(os.path.join(out, inner[0]), mode="r")["0"][...])
    return data.size == stack.size and bool(np.array_equal(data.reshape(-1), stack.reshape(-1)))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--files", type=int, default=40)
    p.add_argument("--shape", default="32,256,256", help="Z,Y,X of each file (uint16)")
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--eubi", help="the eubi command of a venv with eubi-bridge-lite and tifffile")
    p.add_argument("--work-dir", default=None)
    p.add_argument("--result", help="write the figures here as JSON")
    args = p.parse_args(argv)
    result = run(args)
    print(json.dumps(result, indent=1))
    if args.result:
        with open(args.result, "w") as f:
            json.dump(result, f, indent=1)
    return 0 if result["ratio"] <= TARGET else 1


if __name__ == "__main__":
    sys.exit(main())
