"""Batch conversions: many HDF5 files through one planned cluster (docs/batch.md).

``items``: the items of a batch from glob patterns and an output template, refused before
anything starts when two would collide. ``run``: one plan per item, one cluster sized for the
largest, the items streamed through it.
"""
