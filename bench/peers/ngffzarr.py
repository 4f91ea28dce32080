"""ngff-zarr with its default threaded Dask scheduler: ``to_ngff_image`` on the HDF5 dataset
(an Imaris or BDV container through an independent reader: ``common.source_array``),
``to_multiscales`` with the output chunks, ``to_ngff_zarr`` with the benchmark's codec.
``--method`` names a ``ngff_zarr.Methods`` member (empty: ngff-zarr's default, a gaussian)."""

from __future__ import annotations

import ngff_zarr as nz

from .common import peer_main, source_array, zarr_blosc


def convert(args) -> dict:
    method = nz.Methods[args.method] if args.method else None
    with source_array(args.source, args.dataset) as data:
        image = nz.to_ngff_image(data, dims=list(args.axes))
        factors = [2**k for k in range(1, args.levels)]
        chunks = dict(zip(args.axes, args.chunks))
        multiscales = nz.to_multiscales(image, scale_factors=factors, method=method, chunks=chunks)
        nz.to_ngff_zarr(args.out, multiscales, version="0.5", compressors=[zarr_blosc()])
    return {"method": method.name if method else "default", "scale_factors": factors}


if __name__ == "__main__":
    raise SystemExit(peer_main(convert))
