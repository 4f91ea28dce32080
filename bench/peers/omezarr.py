"""ome-zarr-py ``write_image`` on a Dask array chunked like the output (ome-zarr-py requires the
Dask chunks to match the Zarr chunks), computed by Dask's default threaded scheduler, as
``write_image`` does when no Client is running. (On a distributed LocalCluster it cannot run
from an HDF5 file at all: the graph embeds the h5py dataset, and h5py objects cannot be pickled.)
Pyramids downsample z, y and x with ``--method`` (an ``ome_zarr.scale.Methods`` member)."""

from __future__ import annotations

import dask.array as da
import h5py
import zarr
from ome_zarr.scale import Methods
from ome_zarr.writer import write_image

from .common import peer_main, spatial_factors, zarr_blosc


def convert(args) -> dict:
    # An empty list means one level; None would mean ome-zarr-py's default of five.
    factors = [spatial_factors(args.axes, 2**k) for k in range(1, args.levels)]
    method = Methods[args.method] if args.method else Methods.RESIZE
    with h5py.File(args.source, "r") as f:
        data = da.from_array(f[args.dataset], chunks=args.chunks)
        root = zarr.open_group(args.out, mode="w")
        write_image(
            data,
            root,
            scale_factors=factors,
            method=method,
            axes=list(args.axes),
            storage_options={"chunks": args.chunks, "compressors": [zarr_blosc()]},
        )
    return {"scheduler": "threads", "method": method.name, "scale_factors": factors}


if __name__ == "__main__":
    raise SystemExit(peer_main(convert))
