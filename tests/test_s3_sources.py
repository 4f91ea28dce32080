"""HDF5 sources in a bucket (issue 44), against the real S3 server on loopback (moto) and a real
Dask cluster: every container converts exactly at every level (tests/reference.py, and the same
conversion from the local file), through every decoder path; the workers read only byte ranges;
each failure has its one message; verify --source and batch globs read the bucket; a changed
object is refused on resume. The operator's rendering, the resume after SIGKILL and the CLI's
flags are in tests/test_s3_sources_cli.py."""

from __future__ import annotations

import io
import pickle

import h5py
import hdf5plugin
import numpy as np
import pytest

from conftest import smooth, spec_for
from formats_fixtures import write_ims
from h5ngff.engine.sources import open_source
from h5ngff.engine.stores import open_object_reader
from h5ngff.errors import DatasetNotFoundError, SourceError, SourceNotFoundError, SourceUnavailableError
from reference import reference_pyramid
from s3_server import FaultProxy

pytestmark = pytest.mark.integration

SHAPE = (24, 64, 48)
ALL3 = (True, True, True)
#: Each storage and decoder path of engine.sources.decode / ranged: libdeflate alone, libdeflate
#: and the byte shuffle, HDF5's own pipeline (blosc via hdf5plugin; LZF, whose random chunks are
#: stored with the filter skipped), contiguous runs, and chunks never written (the fill value).
LAYOUTS = {
    "gzip": dict(chunks=(8, 16, 16), compression="gzip"),
    "shuffle-gzip": dict(chunks=(8, 16, 16), compression="gzip", shuffle=True),
    "blosc": dict(chunks=(8, 16, 16), **hdf5plugin.Blosc(cname="zstd", clevel=3, shuffle=hdf5plugin.Blosc.BITSHUFFLE)),
    "lzf-random": dict(chunks=(5, 20, 12), compression="lzf"),
    "contiguous": dict(),
    "partly-written": dict(chunks=(8, 16, 16), compression="gzip", fillvalue=7),
}


def _put(s3, bucket: str, key: str, body: bytes) -> str:
    s3.client().put_object(Bucket=bucket, Key=key, Body=body)
    return f"s3://{bucket}/{key}"


def _h5_bytes(data: np.ndarray, dataset: str = "/volume/data", **kwargs) -> bytes:
    buf = io.BytesIO()
    with h5py.File(buf, "w") as f:
        if kwargs.get("fillvalue") is not None:  # only the first 8 planes written; the rest read as 7
            ds = f.create_dataset(dataset, shape=data.shape, dtype=data.dtype, **kwargs)
            ds[:8] = data[:8]
        else:
            f.create_dataset(dataset, data=data, **kwargs)
    return buf.getvalue()


def _layout_data(name: str) -> np.ndarray:
    if name == "lzf-random":  # incompressible: LZF leaves chunks uncompressed, their filter skipped
        return np.random.default_rng(5).integers(0, 2**16, size=SHAPE, dtype=np.uint16)
    data = smooth(SHAPE, "uint16", seed=7)
    if name == "partly-written":
        data[8:] = 7
    return data


def _levels(out: str) -> list[np.ndarray]:
    import zarr

    group = zarr.open_group(out, mode="r")
    return [group[str(k)][...] for k in range(len(group.attrs["ome"]["multiscales"][0]["datasets"]))]


@pytest.fixture(scope="module")
def bucket(s3):
    return s3.new_bucket()


@pytest.mark.slow
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_a_plain_dataset_in_a_bucket_converts_exactly_at_every_level(s3, bucket, convert, tmp_path, layout):
    data = _layout_data(layout)
    kwargs = dict(LAYOUTS[layout])
    url = _put(s3, bucket, f"plain/{layout}.h5", _h5_bytes(data, **kwargs))
    spec = spec_for(
        url,
        str(tmp_path / "out.ome.zarr"),
        source={"storageOptions": s3.options()},
        output={"chunks": [8, 16, 16]},
        pyramid={"levels": 3},
    )
    summary = convert(spec)
    assert summary.status == "Succeeded" and summary.totals.store_retries == 0
    for got, expected in zip(_levels(str(tmp_path / "out.ome.zarr")), reference_pyramid(data, ALL3, "mean", 3)):
        np.testing.assert_array_equal(got, expected)
    # The plan priced the ranged reads (the requests beyond the one being decoded: none where one
    # request holds a slab's reads), and no HDF5 chunk cache (a worker never opens the file).
    terms = {t.name: t.bytes for t in summary.job.plan.memory.terms}
    assert "source requests in flight" in terms and terms["source range buffers"] > 0
    assert summary.job.plan.hdf5_cache_bytes == 0


@pytest.mark.slow
def test_every_chunk_decodes_as_hdf5_reads_it_and_a_corrupt_one_does_not(s3, bucket):
    """The decoders of the bucket path against h5py's own read of the same file, chunk by chunk
    over whole slabs; negative control: one flipped byte in a stored chunk is caught."""
    from h5ngff.engine.sources.ranged import read_chunked

    for layout in ("gzip", "shuffle-gzip", "blosc", "lzf-random"):
        data = _layout_data(layout)
        body = _h5_bytes(data, **LAYOUTS[layout])
        url = _put(s3, bucket, f"decode/{layout}.h5", body)
        reader = open_source(
            spec_for(url, "unused", source={"storageOptions": s3.options()}), objects=open_object_reader
        ).reader
        region = (slice(3, 21), slice(5, 64), slice(0, 47))
        np.testing.assert_array_equal(reader.for_region(region).read(region), data[region])
        index = reader.remote.indexes[0]
        corrupt = bytearray(body)
        at = int(index.offsets[(0, 0, 0)]) + int(index.sizes[(0, 0, 0)]) // 2
        corrupt[at] ^= 0xFF
        out = np.empty((8, 16, 16), dtype=np.uint16)

        def fetch(ranges, stored=bytes(corrupt)):
            return iter([stored[s : s + n] for s, n in ranges])

        try:
            read_chunked(index, (slice(0, 8), slice(0, 16), slice(0, 16)), out, fetch)
        except OSError:
            continue  # the codec refused the corrupt stream
        assert not np.array_equal(out, data[:8, :16, :16]), f"{layout}: a corrupt chunk decoded to the original"


@pytest.mark.slow
def test_workers_read_only_byte_ranges_and_each_task_carries_only_its_part_of_the_index(s3, bucket):
    data = smooth((64, 64, 48), "uint16", seed=2)
    body = _h5_bytes(data, chunks=(8, 16, 16), compression="gzip")
    url = _put(s3, bucket, "ranges/scan.h5", body)
    with FaultProxy(s3.url) as proxy:
        opened = open_source(
            spec_for(url, "unused", source={"storageOptions": s3.options(proxy.url)}), objects=open_object_reader
        )
        client_requests = list(proxy.faults.requests)
        region = (slice(16, 32), slice(0, 64), slice(0, 48))
        task = opened.reader.for_region(region)
        np.testing.assert_array_equal(task.read(region), data[region])
        worker_requests = proxy.faults.requests[len(client_requests) :]
    gets = [r for r in client_requests + worker_requests if r[0] == "GET"]
    assert gets and all(r[2] and r[2].startswith("bytes=") for r in gets), "every GET is a ranged GET"
    fetched = sum(int(b) - int(a) + 1 for _, _, rng in worker_requests for a, b in [rng[6:].split("-")])
    index = opened.reader.remote.indexes[0]
    needed = int(index.sizes[2:4].sum())  # the 2 chunk planes of the slab
    assert needed <= fetched < needed + 2 * 256 * 1024 and fetched < len(body) / 2, (needed, fetched, len(body))
    assert len(worker_requests) <= 2, worker_requests  # the slab's chunks coalesced into one or two GETs
    # The whole index would travel with every task; each carries only its slab's chunks.
    whole, part = len(pickle.dumps(opened.reader)), len(pickle.dumps(task))
    assert part < whole and task.remote.indexes[0].offsets.shape == (2, 4, 3), (part, whole)


@pytest.mark.slow
def test_stacked_datasets_imaris_and_bigdataviewer_in_a_bucket_convert_as_their_local_files(
    s3, bucket, convert, tmp_path
):
    """Each container read from the bucket gives the same image, at every level, as the same
    file read from disk (independent of the bucket path), and the data the file was written with."""
    import npy2bdv  # noqa: F401  the BDV pair's independent writer (tests/test_formats_bdv.py)
    from test_formats_bdv import write_npy2bdv

    channels = np.stack([smooth((16, 32, 32), "uint16", seed=s) for s in (1, 2, 3)])
    stacked_body = io.BytesIO()
    with h5py.File(stacked_body, "w") as f:
        for c in range(3):
            f.create_dataset(f"ch{c}", data=channels[c], chunks=(8, 16, 16), compression="gzip")
    ims_local = write_ims(tmp_path / "cells.ims", channels[None, :2])
    (tmp_path / "bdv").mkdir()
    bdv_xml = write_npy2bdv(tmp_path / "bdv" / "dataset.h5", channels[None, None, :2])
    cases = {
        "stacked": (_put(s3, bucket, "c/stack.h5", stacked_body.getvalue()), "/ch{0..2}", channels),
        "imaris": (_put(s3, bucket, "c/cells.ims", open(ims_local, "rb").read()), "/", channels[:2]),
        "bdv": (
            _put(s3, bucket, "c/bdv/dataset.xml", open(bdv_xml, "rb").read()),
            "/",
            channels[:2],
        ),
    }
    _put(s3, bucket, "c/bdv/dataset.h5", (tmp_path / "bdv" / "dataset.h5").read_bytes())
    local_of = {"imaris": ims_local, "bdv": bdv_xml}
    for name, (url, dataset, expected) in cases.items():
        out = str(tmp_path / f"{name}.ome.zarr")
        spec = spec_for(url, out, dataset, source={"storageOptions": s3.options()}, pyramid={"levels": 2})
        assert convert(spec).status == "Succeeded", name
        got = _levels(out)
        np.testing.assert_array_equal(got[0], expected, err_msg=name)
        if name in local_of:
            local = str(tmp_path / f"{name}-local.ome.zarr")
            assert convert(spec_for(local_of[name], local, dataset, pyramid={"levels": 2})).status == "Succeeded"
            for a, b in zip(got, _levels(local)):
                np.testing.assert_array_equal(a, b, err_msg=name)


@pytest.mark.slow
def test_files_stacked_from_a_glob_over_a_prefix(s3, bucket, convert, tmp_path):
    planes = [smooth((8, 32, 32), "uint16", seed=s) for s in range(12)]
    for i, plane in enumerate(planes):  # natural order: t2 before t10
        _put(s3, bucket, f"series/t{i}.h5", _h5_bytes(plane, "/data", chunks=(8, 16, 16), compression="gzip"))
    _put(s3, bucket, "series/notes.txt", b"not matched")
    out = str(tmp_path / "series.ome.zarr")
    spec = spec_for(
        f"s3://{bucket}/series/t*.h5",
        out,
        "/data",
        source={"stack": "t", "storageOptions": s3.options()},
        pyramid={"levels": 1},
    )
    summary = convert(spec)
    assert summary.status == "Succeeded"
    np.testing.assert_array_equal(_levels(out)[0], np.stack(planes))
    files = summary.job.source.files
    assert [f[0].rsplit("/", 1)[1] for f in files] == [f"t{i}.h5" for i in range(12)]
    assert all(isinstance(f[2], str) and f[2] for f in files), "each file's identity names its ETag"


@pytest.mark.slow
def test_each_failure_has_its_own_message(s3, bucket, tmp_path):
    data = smooth(SHAPE, "uint16", seed=1)
    body = _h5_bytes(data, chunks=(8, 16, 16), compression="gzip")
    url = _put(s3, bucket, "fail/scan.h5", body)

    def opened(path, dataset="/volume/data", options=None):
        spec = spec_for(path, "unused", dataset, source={"storageOptions": options or s3.options()})
        return open_source(spec, objects=open_object_reader)

    assert opened(url).info.shape == SHAPE  # the control: the same request, nothing wrong
    with pytest.raises(SourceNotFoundError, match=r"fail/nothing\.h5 does not exist \(no such object"):
        opened(f"s3://{bucket}/fail/nothing.h5")
    with pytest.raises(SourceNotFoundError, match=r"no-such-bucket-h5ngff/scan\.h5 does not exist"):  # HEAD: a bare 404
        opened("s3://no-such-bucket-h5ngff/scan.h5")
    with pytest.raises(DatasetNotFoundError, match=r"'/volume/dat' is not in .*Datasets in the file: /volume/data"):
        opened(url, "/volume/dat")
    truncated = _put(s3, bucket, "fail/truncated.h5", body[: len(body) // 2])
    with pytest.raises(SourceError, match="truncated"):
        opened(truncated)
    with FaultProxy(s3.url) as proxy:
        proxy.faults.add("403", 100, path_contains="fail/scan.h5")
        with pytest.raises(SourceError, match=r"cannot be read: the store refused these credentials \(AccessDenied"):
            opened(url, options=s3.options(proxy.url))
    with FaultProxy(s3.url) as proxy:
        reader = opened(url, options={**s3.options(proxy.url), "retries": "3"}).reader
        proxy.faults.add("503", 1000, "GET", "fail/scan.h5")
        region = (slice(0, 8), slice(0, 64), slice(0, 48))
        with pytest.raises(
            SourceUnavailableError, match=r"still failing after 3 attempts .*503.*resumes where it stopped"
        ):
            reader.for_region(region).read(region)
        assert proxy.faults.injected("503") >= 3


@pytest.mark.slow
def test_a_throttling_burst_is_retried_and_counted(s3, bucket, shared_cluster, tmp_path):
    from h5ngff.backends.external import ExternalBackend
    from h5ngff.runner import plan_job, run_job

    data = smooth(SHAPE, "uint16", seed=9)
    url = _put(s3, bucket, "burst/scan.h5", _h5_bytes(data, chunks=(8, 16, 16), compression="gzip"))
    with FaultProxy(s3.url) as proxy:
        spec = spec_for(
            url, str(tmp_path / "out.ome.zarr"), source={"storageOptions": s3.options(proxy.url)}, pyramid={"levels": 1}
        )
        # After the client's description (its requests are not faulted), 4 of the workers' GETs answer 503.
        backend = ExternalBackend(shared_cluster.scheduler_address)
        job = plan_job(spec, backend)
        proxy.faults.add("503", 4, "GET", "burst/scan.h5")
        summary = run_job(job, backend)
    assert summary.status == "Succeeded" and proxy.faults.injected("503") == 4
    assert summary.totals.store_retries == 4, "every retried GET is counted"
    np.testing.assert_array_equal(_levels(str(tmp_path / "out.ome.zarr"))[0], data)


def test_an_object_replaced_after_its_description_is_refused_not_mixed(s3, bucket):
    data = smooth(SHAPE, "uint16", seed=4)
    url = _put(s3, bucket, "replaced/scan.h5", _h5_bytes(data, chunks=(8, 16, 16), compression="gzip"))
    reader = open_source(
        spec_for(url, "unused", source={"storageOptions": s3.options()}), objects=open_object_reader
    ).reader
    region = (slice(0, 8), slice(0, 64), slice(0, 48))
    np.testing.assert_array_equal(reader.for_region(region).read(region), data[region])  # control
    _put(s3, bucket, "replaced/scan.h5", _h5_bytes(data + 1, chunks=(8, 16, 16), compression="gzip"))
    with pytest.raises(SourceError, match="was replaced while it was converted"):
        reader.for_region(region).read(region)


@pytest.mark.slow
def test_verify_compares_with_a_source_in_a_bucket(s3, bucket, convert, tmp_path):
    from h5ngff.engine.verify.check import verify_output

    data = smooth(SHAPE, "uint16", seed=11)
    url = _put(s3, bucket, "verify/scan.h5", _h5_bytes(data, chunks=(8, 16, 16), compression="gzip"))
    out = str(tmp_path / "v.ome.zarr")
    assert (
        convert(spec_for(url, out, source={"storageOptions": s3.options()}, pyramid={"levels": 2})).status
        == "Succeeded"
    )
    report = verify_output(out, (url, "/volume/data"), source_options=s3.options())
    assert report.ok and report.levels_compared == 2, report.problems
    # The provenance never records the storage options (they may hold credentials).
    import zarr

    assert "storageOptions" not in zarr.open_group(out, mode="r").attrs["h5ngff"]["source"]
    # Negative control: another object of the same shape is found different.
    other = _put(s3, bucket, "verify/other.h5", _h5_bytes(data + 1, chunks=(8, 16, 16), compression="gzip"))
    assert not verify_output(out, (other, "/volume/data"), source_options=s3.options()).ok


def test_a_batch_glob_over_a_prefix_lists_the_bucket(s3, bucket, tmp_path):
    from h5ngff.batch.items import batch_items
    from h5ngff.batch.listing import bucket_lister
    from h5ngff.errors import SpecError

    for name in ("cell_2", "cell_10", "cell_1"):
        _put(s3, bucket, f"batch/{name}.h5", _h5_bytes(smooth((8, 16, 16), seed=1)))
    _put(s3, bucket, "batch/deeper/cell_3.h5", b"x")  # '*' stays within one level, as a shell glob does
    items = batch_items(
        [f"s3://{bucket}/batch/*.h5:/volume/data"], str(tmp_path / "{stem}.ome.zarr"), bucket_lister(s3.options())
    )
    assert [i.source for i in items] == [
        f"s3://{bucket}/batch/{n}.h5:/volume/data" for n in ("cell_1", "cell_2", "cell_10")
    ]
    assert [i.output for i in items] == [str(tmp_path / f"{n}.ome.zarr") for n in ("cell_1", "cell_2", "cell_10")]
    with pytest.raises(SpecError, match="matches none in the bucket"):
        batch_items(
            [f"s3://{bucket}/batch/*.hdf5:/volume/data"], str(tmp_path / "{stem}.ome.zarr"), bucket_lister(s3.options())
        )
