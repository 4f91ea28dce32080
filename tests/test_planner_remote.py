"""The plan of a source in a bucket (issue 44, docs/memory-model.md): the ranged reads' terms, from
the numbers alone. Per thread, the GETs in flight hold at most ``in_flight`` requests and never more
than one slab's reads span beyond the body being decoded; no HDF5 chunk cache is planned. Control:
the same dataset read from a local file plans the HDF5 term and none of the bucket's."""

from __future__ import annotations

from h5ngff.planner import Capacity, DatasetInfo, make_plan
from h5ngff.spec import parse_spec
from h5ngff.units import MiB

MACHINE = Capacity(cores=2, memory_bytes=24 << 30)
REQUEST, GAP, IN_FLIGHT = 8 * MiB, 256 * 1024, 4


def _plan(info: DatasetInfo, slab: list[int]):
    spec = parse_spec(
        {
            "source": {"path": "s3://b/scan.h5", "dataset": "/d"},
            "output": {"path": "out.ome.zarr", "chunks": [64, 64, 64]},
            "pyramid": {"levels": 1},
            "resources": {"workers": 1, "threadsPerWorker": 2, "slab": slab},
        }
    )
    plan = make_plan(info, spec, MACHINE)
    return plan, {t.name: t.bytes for t in plan.passes[0].terms}


def _remote(**kwargs) -> DatasetInfo:
    return DatasetInfo(remote_in_flight=IN_FLIGHT, remote_request_bytes=REQUEST, remote_gap_bytes=GAP, **kwargs)


def test_a_contiguous_slab_holds_at_most_its_own_bytes_in_flight():
    info = _remote(shape=(128, 512, 512), dtype="<u2", itemsize=2)
    plan, terms = _plan(info, [64, 512, 512])
    span = 64 * 512 * 512 * 2 + GAP  # 32 MiB + the gap: four requests, one being decoded
    assert terms["source requests in flight"] == 2 * min(IN_FLIGHT * REQUEST, span - REQUEST)
    assert terms["source range buffers"] >= 2 * REQUEST
    assert plan.hdf5_cache_bytes == 0 and "hdf5 cache and decompression" not in terms
    assert terms["object store client"] > 0  # the output is local: the client is the source's


def test_a_large_chunked_slab_holds_in_flight_requests_and_a_small_one_its_chunks():
    stored = 600 * 1024  # compressed 64^3 u16 chunks of at most 600 KiB
    info = _remote(
        shape=(128, 1024, 1024), dtype="<u2", itemsize=2, hdf5_chunks=(64, 64, 64),
        hdf5_filters=("deflate",), remote_stored_chunk_bytes=stored,
    )  # fmt: skip
    _, big = _plan(info, [64, 1024, 1024])
    assert big["source requests in flight"] == 2 * IN_FLIGHT * REQUEST
    _, small = _plan(info, [64, 64, 128])  # two chunks: one request, nothing else in flight
    span = 2 * (stored + GAP)
    assert small["source requests in flight"] == 2 * max(0, span - min(REQUEST, span))
    assert small["source range buffers"] == 2 * (span + 2 * 64**3 * 2) + 4 * MiB


def test_control_a_local_file_plans_hdf5_and_no_ranged_reads():
    info = DatasetInfo(shape=(128, 512, 512), dtype="<u2", itemsize=2)
    _, terms = _plan(info, [64, 512, 512])
    assert "hdf5 cache and decompression" in terms
    assert not {"source requests in flight", "source range buffers", "object store client"} & set(terms)
