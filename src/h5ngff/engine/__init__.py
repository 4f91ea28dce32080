"""The streaming engine: HDF5 source, OME-Zarr chunk writer, downsampling, manifest/resume, driver.

A regular package (not a namespace one) so import-linter sees its modules; see tests/test_architecture.py.
"""
