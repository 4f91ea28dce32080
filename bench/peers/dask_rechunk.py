"""``da.from_array(h5).rechunk(chunks).to_zarr(...)`` on a LocalCluster with one worker process
per core: the one-liner most Dask users try first (Dask picks the source blocks)."""

from __future__ import annotations

import dask.array as da
import h5py
from dask.distributed import Client, LocalCluster

from .common import peer_main, workers, zarr_blosc


def convert(args) -> dict:
    n = workers(args)
    with (
        LocalCluster(n_workers=n, threads_per_worker=1, processes=True, dashboard_address=None) as cluster,
        Client(cluster),
    ):
        with h5py.File(args.source, "r") as f:
            data = da.from_array(f[args.dataset])
            blocks = data.chunksize
            data.rechunk(args.chunks).to_zarr(args.out, compressors=[zarr_blosc()], fill_value=0)
    return {"workers": n, "source_blocks": blocks}


if __name__ == "__main__":
    raise SystemExit(peer_main(convert))
