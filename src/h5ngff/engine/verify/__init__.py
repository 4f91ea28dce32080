"""Verify: reads an output back through zarr-python, independently of the writer, and checks it."""
