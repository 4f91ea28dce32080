"""The writer's ``ArrayLayout`` of a level of an existing output, read back from its metadata.

Tests and benches use it to write into (or damage) an output with the engine's own writer.
``verify does not: it reads through zarr-python (``h5ngff.engine.verify.stored``), independently of the writer.
"""

from __future__ import annotations

import json
import os
from typing import Any

import numpy as np

from h5ngff.spec import CompressorSpec
from h5ngff.engine.write.chunkio import ArrayLayout
from h5ngff.engine.codecs import spec_from_metadata


def _compressor_from_zarr(
    meta: dict[str, Any], fmt: int
) -> tuple[CompressorSpec, tuple[int, ...], tuple[int, ...] | None, bool]:
    """Our compressor spec, chunks, shards and whether chunks carry the crc32c codec."""
    if fmt == 2:
        return spec_from_metadata(meta.get("compressor")), tuple(meta["chunks"]), None, False
    codecs = meta["codecs"]
    chunks = tuple(meta["chunk_grid"]["configuration"]["chunk_shape"])
    shards = None
    if codecs[0]["name"] == "sharding_indexed":
        shards = chunks
        chunks = tuple(codecs[0]["configuration"]["chunk_shape"])
        codecs = codecs[0]["configuration"]["codecs"]
    crc = any(c["name"] == "crc32c" for c in codecs)
    inner = [c for c in codecs if c["name"] not in ("bytes", "crc32c")]
    return spec_from_metadata(inner[0] if inner else None), chunks, shards, crc


def level_layout(path: str, level_path: str, fmt: int, level: int, checksums: bool | None = None) -> ArrayLayout:
    """``checksums``: Zarr v2 keeps them in a sidecar, which the metadata does not show; in
    Zarr v3 the crc32c codec in the metadata decides (the argument is ignored)."""
    meta_file = os.path.join(path, level_path, "zarr.json" if fmt == 3 else ".zarray")
    with open(meta_file) as f:
        meta = json.load(f)
    compressor, chunks, shards, crc = _compressor_from_zarr(meta, fmt)
    dtype = (
        np.dtype(meta["dtype"]).str
        if fmt == 2
        else np.dtype(meta["data_type"] if meta["data_type"] != "bool" else "?").newbyteorder("<").str
    )
    return ArrayLayout(
        os.path.join(path, level_path),
        tuple(meta["shape"]),
        chunks,
        shards,
        dtype,
        fmt,
        compressor,
        level,
        meta.get("fill_value") or 0,
        checksums=crc if fmt == 3 else bool(checksums),
    )
