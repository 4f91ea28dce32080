"""The benchmark's fixed facts: the reference cases (the reference case, docs/architecture.md), the output codec and chunks
every tool must write, and how ``--scale`` shrinks a case.

``--scale S`` is the fraction of the full-size volume's bytes: y and x shrink by sqrt(S) while z
(150) and every chunk and slab depth stay as they are, so edge chunks, slab alignment and the
per-chunk costs keep their full-size proportions. Scale 1 is the 4.54 GB case of the reference case, docs/architecture.md.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

import numpy as np

#: the reference case, docs/architecture.md: (z, y, x) of the reference volume at scale 1.
FULL_ZYX = (150, 3768, 2008)
#: The ad-hoc scripts' slab at scale 1 (11 chunk rows of 64, whole x).
USER_SLAB_ZY = (64, 704)
#: Output chunk edge on every spatial axis, for every tool.
CHUNK = 64
#: Output codec for every tool: blosc zstd level 5 with bitshuffle.
CODEC = {"cname": "zstd", "clevel": 5, "shuffle": "bitshuffle"}
CODEC_TEXT = "blosc zstd:5 bitshuffle"
#: Pyramid runs build this many levels (full resolution included), 2x per spatial axis per level.
PYRAMID_LEVELS = 3
#: (c, z, y, x) of the container cases (issue 15) at scale 1; y and x shrink with --scale as above.
CONTAINER_CZYX = (2, 64, 2048, 2048)
#: Bump when the generated data changes, so cached inputs are rebuilt.
GENERATOR_VERSION = 1

BENCH_DIR = os.path.dirname(os.path.abspath(__file__))
REPO_DIR = os.path.dirname(BENCH_DIR)


@dataclass(frozen=True)
class Case:
    """One input volume and the output layout every tool is asked for."""

    name: str
    title: str
    shape: tuple[int, ...]
    dtype: str
    axes: str
    hdf5_chunks: tuple[int, ...] | None
    compression: str | None
    dataset: str = "/volume/data"
    #: "h5" (one dataset), or a microscopy container read whole: "ims" (Imaris), "bdv" (XML + HDF5)
    container: str = "h5"
    #: Fraction of the y extent (from the end, whole output chunks) set to zero: that share of the
    #: output chunks is the fill value everywhere (issue 16's sparse case). 0: dense.
    sparse: float = 0.0

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * np.dtype(self.dtype).itemsize

    @property
    def chunks(self) -> tuple[int, ...]:
        lead = (1,) * (len(self.shape) - 3)
        return lead + (CHUNK, CHUNK, CHUNK)

    @property
    def user_slab(self) -> tuple[int, ...]:
        """(64, 704, whole x) at scale 1; y clipped to the volume when scaled down."""
        lead = (1,) * (len(self.shape) - 3)
        z, y, x = self.shape[-3:]
        return lead + (min(USER_SLAB_ZY[0], z), min(USER_SLAB_ZY[1], y), x)

    def describe(self) -> str:
        storage = (
            "contiguous"
            if self.hdf5_chunks is None
            else f"chunked {self.hdf5_chunks} {self.compression or 'uncompressed'}"
        )
        return f"{self.shape} {self.dtype} {self.axes}, {storage}, {self.nbytes / 1e9:.3f} GB"


def scaled_yx(scale: float) -> tuple[int, int]:
    if not scale > 0:  # above 1: the 16-core figures were taken at 3x the full size
        raise ValueError(f"Expected --scale > 0. Got {scale} instead.")
    factor = math.sqrt(scale)
    return tuple(max(CHUNK, round(n * factor)) for n in FULL_ZYX[1:])  # type: ignore[return-value]


def build_cases(scale: float) -> dict[str, Case]:
    """The reference float32 contiguous volume, its chunked-gzip uint16 4-D variant, and the same
    uint16 image in an Imaris file and a BigDataViewer pair (bench/containers.py)."""
    y, x = scaled_yx(scale)
    c, cz, cy, cx = CONTAINER_CZYX
    cy, cx = (max(CHUNK, round(n * math.sqrt(scale))) for n in (cy, cx))
    z = FULL_ZYX[0]
    # The 4-D variant holds 2 channels of uint16, so it has the same bytes as the float32 case;
    # its HDF5 chunks are a common acquisition layout (one channel, 32 planes, 256x256 tiles).
    h5_chunks = (1, 32, min(256, y), min(256, x))
    return {
        "f32": Case(
            "f32",
            "float32 3-D, contiguous (the reference case, docs/architecture.md)",
            (z, y, x),
            "float32",
            "zyx",
            None,
            None,
        ),
        # The same volume with 2/3 of its chunks zero (issue 16): empty chunks cost no encode or file.
        "f32-sparse": Case(
            "f32-sparse",
            "float32 3-D, contiguous, 2/3 of the chunks zero",
            (z, y, x),
            "float32",
            "zyx",
            None,
            None,
            sparse=2 / 3,
        ),
        "u16-4d": Case("u16-4d", "uint16 4-D (c=2), chunked gzip", (2, z, y, x), "uint16", "czyx", h5_chunks, "gzip"),
        "imaris": Case(
            "imaris",
            "Imaris .ims, uint16 c=2, gzip blocks padded beyond the image (issue 15)",
            (c, cz, cy, cx),
            "uint16",
            "czyx",
            (1, 16, 128, 160),
            "gzip",
            dataset="/",
            container="ims",
        ),
        "bdv": Case(
            "bdv",
            "BigDataViewer XML + HDF5 (npy2bdv), uint16 as int16, c=2 setups (issue 15)",
            (c, cz, cy, cx),
            "uint16",
            "czyx",
            (1, 4, 256, 256),
            None,
            dataset="/",
            container="bdv",
        ),
    }


def scale_tag(scale: float) -> str:
    return f"{scale:g}"


def default_timeout(scale: float) -> float:
    """Per run. At scale 1 the slowest peer measured (ngff-zarr gaussian) took 179 s."""
    return 120.0 + 1500.0 * scale


def available_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1
