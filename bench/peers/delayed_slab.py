"""The ad-hoc script users write (docs/architecture.md, "Why h5ngff exists"): read (64, 704, X) slabs from HDF5 in Dask
delayed tasks on a LocalCluster with one process per core, and write each slab into a
zarr-python 3 array with chunks (64, 64, 64). The slab is chunk-aligned, so no two tasks
write the same chunk."""

from __future__ import annotations

import dask
import h5py
import zarr
from dask.distributed import Client, LocalCluster

from .common import dtype_of, peer_main, slabs, workers, zarr_blosc


def copy_slab(source: str, dataset: str, out: str, sel: tuple[slice, ...]) -> None:
    with h5py.File(source, "r") as f:
        data = f[dataset][sel]
    target = zarr.open_array(out, mode="r+")
    target[sel] = data


def convert(args) -> dict:
    shape, dtype = dtype_of(args.source, args.dataset)
    zarr.create_array(args.out, shape=shape, chunks=args.chunks, dtype=dtype, compressors=zarr_blosc(), fill_value=0)
    n = workers(args)
    with (
        LocalCluster(n_workers=n, threads_per_worker=1, processes=True, dashboard_address=None) as cluster,
        Client(cluster),
    ):
        tasks = [dask.delayed(copy_slab)(args.source, args.dataset, args.out, sel) for sel in slabs(shape, args.slab)]
        dask.compute(*tasks)
    return {"workers": n, "slab": args.slab, "tasks": len(tasks)}


if __name__ == "__main__":
    raise SystemExit(peer_main(convert))
