"""ngff-zarr with its default threaded Dask scheduler: ``to_ngff_image`` on the HDF5 dataset,
``to_multiscales`` with the output chunks, ``to_ngff_zarr`` with the benchmark's codec.
``--method`` names a ``ngff_zarr.Methods`` member (empty: ngff-zarr's default, a gaussian)."""

from __future__ import annotations

import dask.array as da
import h5py
import ngff_zarr as nz

from .common import peer_main, zarr_blosc


def convert(args) -> dict:
    method = nz.Methods[args.method] if args.method else None
    with h5py.File(args.source, "r") as f:
        image = nz.to_ngff_image(da.from_array(f[args.dataset]), dims=list(args.axes))
        factors = [2**k for k in range(1, args.levels)]
        chunks = dict(zip(args.axes, args.chunks))
        multiscales = nz.to_multiscales(image, scale_factors=factors, method=method, chunks=chunks)
        nz.to_ngff_zarr(args.out, multiscales, version="0.5", compressors=[zarr_blosc()])
    return {"method": method.name if method else "default", "scale_factors": factors}


if __name__ == "__main__":
    raise SystemExit(peer_main(convert))
