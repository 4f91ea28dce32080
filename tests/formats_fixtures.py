"""Writers of source containers for the format tests.

BigDataViewer files are written by npy2bdv and pybdv (independent writers). No Imaris writer
installs on Linux (PyPI's imaris-convert ships only Windows DLLs), so ``write_ims`` follows the
published Imaris 5.5 file format, and every test cross-checks what it wrote by reading it back
with imaris-ims-file-reader, an independent reader.
"""

from __future__ import annotations

import math

import h5py
import numpy as np

#: What Imaris writes into the padding beyond the image is unspecified; a value far from the data
#: makes any padding that leaks into the output show.
PADDING_VALUE = 4093


def _s1(value) -> np.ndarray:
    """An Imaris attribute: the text as an array of one-byte strings."""
    return np.array([c.encode() for c in str(value)], dtype="S1")


def write_ims(
    path, data: np.ndarray, voxel=(2.0, 0.5, 0.25), block=(4, 16, 16), names=None, colors=None, levels: int = 2
) -> str:
    """An Imaris 5.5 file holding ``data`` (t, c, z, y, x) at voxel size ``voxel`` (z, y, x, um)."""
    T, C, Z, Y, X = data.shape
    with h5py.File(path, "w") as f:
        for key, value in (
            ("ImarisDataSet", "ImarisDataSet"),
            ("ImarisVersion", "5.5.0"),
            ("DataSetDirectoryName", "DataSet"),
            ("DataSetInfoDirectoryName", "DataSetInfo"),
            ("ThumbnailDirectoryName", "Thumbnail"),
        ):
            f.attrs[key] = _s1(value)
        f.attrs["NumberOfDataSets"] = np.array([1], dtype=np.uint32)
        for r in range(levels):
            shape = tuple(math.ceil(n / 2**r) for n in (Z, Y, X))
            for t in range(T):
                for c in range(C):
                    g = f.create_group(f"DataSet/ResolutionLevel {r}/TimePoint {t}/Channel {c}")
                    image = data[t, c][:: 2**r, :: 2**r, :: 2**r]
                    padded_shape = tuple(math.ceil(n / b) * b for n, b in zip(shape, block))
                    pad = min(PADDING_VALUE, np.iinfo(data.dtype).max) if data.dtype.kind in "iu" else PADDING_VALUE
                    padded = np.full(padded_shape, pad, dtype=data.dtype)
                    padded[: shape[0], : shape[1], : shape[2]] = image
                    g.create_dataset("Data", data=padded, chunks=block, compression="gzip", compression_opts=2)
                    hist, _ = np.histogram(image, bins=256)
                    g.create_dataset("Histogram", data=hist.astype(np.uint64))
                    for axis, n, b in zip("ZYX", shape, block):
                        g.attrs[f"ImageSize{axis}"] = _s1(n)
                        g.attrs[f"ImageBlockSize{axis}"] = _s1(b)
                    g.attrs["HistogramMin"] = _s1(f"{image.min():.3f}")
                    g.attrs["HistogramMax"] = _s1(f"{image.max():.3f}")
        info = f.create_group("DataSetInfo/Image")
        for axis, n in zip("ZYX", (Z, Y, X)):
            info.attrs[axis] = _s1(n)
        # ExtMin/ExtMax 0, 1, 2 are x, y, z; an origin away from 0 checks that only the extent counts.
        for i, (n, v) in enumerate(zip((X, Y, Z), voxel[::-1])):
            info.attrs[f"ExtMin{i}"] = _s1(f"{-3.5:.3f}")
            info.attrs[f"ExtMax{i}"] = _s1(f"{-3.5 + n * v:.3f}")
        info.attrs["Unit"] = _s1("um")
        info.attrs["Noc"] = _s1(C)
        info.attrs["Name"] = _s1("fixture")
        for c in range(C):
            g = f.create_group(f"DataSetInfo/Channel {c}")
            g.attrs["Name"] = _s1(names[c] if names else f"Channel {c}")
            g.attrs["Color"] = _s1(" ".join(f"{v:.3f}" for v in (colors[c] if colors else (1.0, 1.0, 1.0))))
            g.attrs["ColorMode"] = _s1("BaseColor")
            g.attrs["ColorOpacity"] = _s1("1.000")
        times = f.create_group("DataSetInfo/TimeInfo")
        times.attrs["DatasetTimePoints"] = _s1(T)
        times.attrs["FileTimePoints"] = _s1(T)
        for t in range(T):
            times.attrs[f"TimePoint{t + 1}"] = _s1(f"2026-01-01 00:00:{t:02d}.000")
    return str(path)


def read_ims_independently(path):
    """(data t, c, z, y, x; resolution z, y, x) as imaris-ims-file-reader reads them."""
    from imaris_ims_file_reader.ims import ims

    reader = ims(str(path), squeeze_output=False)
    try:
        data = np.asarray(reader[0, :, :, :, :, :])
        return data.reshape(reader.shape), tuple(reader.resolution)
    finally:
        reader.close()


def read_by_independent_clients(out: str, data: np.ndarray, storage_options: dict | None = None):
    """Validate ``out`` with ome-zarr-models, check that ome-zarr-py and ngff-zarr read level 0 as
    ``data``, and return ngff-zarr's multiscales for the caller's metadata checks. An ``s3://``
    URL is read through fsspec/s3fs with ``storage_options`` (the caller points the AWS
    environment at the endpoint too, for ome-zarr-py, which takes no options)."""
    import warnings

    import ngff_zarr
    import zarr
    from ome_zarr.io import parse_url
    from ome_zarr.reader import Reader
    from ome_zarr_models.v05 import Image

    store = out
    if storage_options is not None:
        from zarr.storage import FsspecStore

        store = FsspecStore.from_url(out, storage_options=storage_options, read_only=True)
    Image.from_zarr(zarr.open_group(store, mode="r"))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        node = list(Reader(parse_url(out))())[0]
    np.testing.assert_array_equal(np.asarray(node.data[0]), data)
    multiscales = (
        ngff_zarr.from_ngff_zarr(out, storage_options=storage_options)
        if storage_options is not None
        else ngff_zarr.from_ngff_zarr(out)
    )
    np.testing.assert_array_equal(np.asarray(multiscales.images[0].data), data)
    return multiscales
