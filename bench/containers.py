"""The microscopy-container cases (issue 15): an Imaris ``.ims`` file and a BigDataViewer XML +
HDF5 pair, each holding 2 channels of uint16.

The files are written by the same writers the format tests use: ``tests/formats_fixtures.write_ims``
(the published Imaris 5.5 format, gzip blocks padded beyond the image) and npy2bdv (what Fiji
reads; uint16 stored as int16). ``open_image`` gives the verifier the (c, z, y, x) image with
plain h5py, not through h5ngff's readers, so h5ngff cannot pass by agreeing with itself.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator

import h5py
import numpy as np

from h5ngff.sample import _plane

from .config import REPO_DIR, Case

#: Imaris blocks as Imaris writes them for large images; no axis of the case is a multiple of x's.
IMS_BLOCK = (16, 128, 160)
#: npy2bdv's HDF5 blocks (its default depth, 256-wide tiles).
BDV_BLOCK = (4, 256, 256)


def input_name(case: Case) -> str:
    return {"ims": f"{case.name}.ims", "bdv": f"{case.name}.xml"}.get(case.container, f"{case.name}.h5")


def volume(case: Case, seed: int = 0) -> np.ndarray:
    """(c, z, y, x): the sample planes of ``h5ngff.sample``, each channel offset in phase."""
    rng = np.random.default_rng(seed)
    dt = np.dtype(case.dtype)
    C, Z = case.shape[0], case.shape[1]
    return np.stack([np.stack([_plane(c * 5 + z, case.shape[-2:], rng, dt) for z in range(Z)]) for c in range(C)])


def write_container(case: Case, path: str) -> None:
    """Write the case's container at ``path`` (the .ims, or the .xml with its .h5 beside it)."""
    data = volume(case)
    if case.container == "ims":
        sys.path.insert(0, os.path.join(REPO_DIR, "tests"))
        from formats_fixtures import write_ims

        write_ims(path, data[None], voxel=(2.0, 0.5, 0.5), block=IMS_BLOCK, levels=1)
        return
    import npy2bdv

    writer = npy2bdv.BdvWriter(path[:-4] + ".h5", nchannels=case.shape[0], blockdim=(BDV_BLOCK,))
    for c, stack in enumerate(data):
        writer.append_view(stack, time=0, channel=c, voxel_size_xyz=(0.5, 0.5, 2.0), voxel_units="um")
    writer.write_xml()
    writer.close()


def data_files(path: str) -> list[str]:
    """The files a source consists of (a BDV XML names the HDF5 beside it)."""
    return [path, path[:-4] + ".h5"] if path.endswith(".xml") else [path]


class _Stacked:
    """Read-only (c, z, y, x) view of one 3-D dataset per channel, cropped to the image."""

    def __init__(self, datasets: list[h5py.Dataset], zyx: tuple[int, int, int], dtype: np.dtype):
        self.datasets, self.dtype = datasets, np.dtype(dtype)
        self.shape = (len(datasets),) + tuple(zyx)

    def __getitem__(self, sel: tuple) -> np.ndarray:
        """``sel``: a channel index or slice, then one slice per spatial axis (step 1)."""
        inner = tuple(slice(*s.indices(n)[:2]) for s, n in zip(sel[1:], self.shape[1:]))
        if isinstance(sel[0], (int, np.integer)):
            return self.datasets[sel[0]][inner].view(self.dtype)
        return np.stack([self.datasets[c][inner].view(self.dtype) for c in range(*sel[0].indices(self.shape[0]))])


@contextlib.contextmanager
def open_image(path: str, case: Case) -> Iterator:
    """The case's image as an array-like with ``shape``, ``dtype`` and slicing by slices."""
    files = data_files(path)
    with h5py.File(files[-1], "r") as f:
        if case.container == "ims":
            level = f["DataSet/ResolutionLevel 0/TimePoint 0"]
            yield _Stacked([level[f"Channel {c}/Data"] for c in range(case.shape[0])], case.shape[1:], case.dtype)
        elif case.container == "bdv":
            yield _Stacked([f[f"t00000/s{c:02d}/0/cells"] for c in range(case.shape[0])], case.shape[1:], case.dtype)
        else:
            yield f[case.dataset]
