"""h5ngff: HDF5 to OME-Zarr (NGFF) on Dask, with every worker's memory planned before the run."""

__version__ = "0.1.0"
