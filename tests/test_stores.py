"""The Store contract (engine/stores): one suite that the local directory store and the S3 store
(a real moto server on loopback) both pass, plus the S3 store's own failure modes through a real
fault-injecting HTTP proxy: retries with a counter, permanent errors at once, multipart uploads
that are completed or aborted."""

from __future__ import annotations

import os

import pytest

from h5ngff.engine.stores import LocalStore, store_retries
from h5ngff.errors import OutputError
from s3_server import FaultProxy


@pytest.fixture(params=["local", "s3"])
def store(request, tmp_path):
    if request.param == "local":
        return LocalStore(str(tmp_path / "out.ome.zarr"))
    from h5ngff.engine.stores.s3 import S3Store

    s3 = request.getfixturevalue("s3")
    return S3Store(s3.new_bucket(), "pre/out.ome.zarr", s3.options())


def test_put_get_size_list_and_overwrite(store):
    assert store.put("0/c/0/0/0", b"abc") == 3
    store.put("zarr.json", b"{}")
    assert store.get("0/c/0/0/0") == b"abc" and store.size("0/c/0/0/0") == 3
    assert store.size("0/c/9") is None
    with pytest.raises(KeyError):
        store.get("0/c/9")
    store.put("0/c/0/0/0", [b"x" * 5, b"y"])  # pieces; replaces the old object whole
    assert store.get("0/c/0/0/0") == b"xxxxxy"
    assert store.list("") == {"0/c/0/0/0": 6, "zarr.json": 2}
    assert store.list("0/") == {"0/c/0/0/0": 6}


def test_delete_prefix_removes_that_prefix_and_nothing_else(store, request):
    for key in ("0/c/0", "0/c/1", "1/c/0", ".h5ngff/manifest/0", "zarr.json"):
        store.put(key, b"1")
    assert store.delete_prefix(".h5ngff/") == 1
    assert store.delete_prefix("0/") == 2
    assert store.list("") == {"1/c/0": 1, "zarr.json": 1}
    store.put(".h5ngff.lock", b"held")  # --overwrite empties the prefix but keeps the run's own lock
    assert store.delete_prefix("", keep=(".h5ngff.lock",)) == 2
    assert store.list("") == {".h5ngff.lock": 4}


def test_a_sibling_prefix_with_the_same_start_is_not_ours(s3):
    """``out.ome.zarr`` must not list or delete ``out.ome.zarr.bak``: the prefix is a path."""
    from h5ngff.engine.stores.s3 import S3Store

    bucket = s3.new_bucket()
    ours, theirs = S3Store(bucket, "out.ome.zarr", s3.options()), S3Store(bucket, "out.ome.zarr.bak", s3.options())
    ours.put("zarr.json", b"1")
    theirs.put("zarr.json", b"precious")
    assert ours.delete_prefix("") == 1
    assert theirs.get("zarr.json") == b"precious"


def test_transient_errors_are_retried_counted_and_bounded(s3):
    from h5ngff.engine.stores.s3 import S3Store

    bucket = s3.new_bucket()
    with FaultProxy(s3.url) as proxy:
        store = S3Store(bucket, "out", {**s3.options(proxy.url), "retries": "4"})
        proxy.faults.add("503", 2, "PUT")
        proxy.faults.add("reset", 1, "PUT")
        before = store_retries.count
        store.put("a", b"data")
        assert store_retries.count - before == 3 and proxy.faults.injected("503") == 2 and proxy.faults.injected("reset") == 1
        assert s3.keys(bucket)["out/a"] == b"data"
        # Bounded: more failures than attempts fail the request with what to do, not forever.
        proxy.faults.add("503", 10, "PUT")
        with pytest.raises(OutputError, match="still failing after 4 attempts.*re-run the same command"):
            store.put("b", b"data")


def test_a_403_fails_at_once_with_what_to_change(s3):
    from h5ngff.engine.stores.s3 import S3Store

    with FaultProxy(s3.url) as proxy:
        store = S3Store(s3.new_bucket(), "out", s3.options(proxy.url))
        proxy.faults.add("403", 100)
        before = store_retries.count
        with pytest.raises(OutputError) as err:
            store.put("a", b"data")
        assert err.value.reason == "OutputUnwritable" and "AccessDenied" in str(err.value) and "s3:PutObject" in str(err.value)
        assert store_retries.count == before and proxy.faults.injected("403") == 1  # not retried
    # Control: the same store behind no faults writes.
    S3Store(store.bucket, "out", s3.options()).put("a", b"data")


def test_a_missing_bucket_fails_at_once_and_says_so(s3):
    from h5ngff.engine.stores.s3 import S3Store

    with pytest.raises(OutputError, match="NoSuchBucket.*create the bucket"):
        S3Store("no-such-bucket-h5ngff", "out", s3.options()).list("")


def test_multipart_uploads_are_completed_or_aborted_never_left_half(s3):
    from h5ngff.engine.stores.s3 import S3Store

    bucket = s3.new_bucket()
    data = os.urandom(11 * 2**20)
    options = {**s3.options(), "multipart_threshold": str(6 * 2**20), "part_size": str(5 * 2**20)}
    S3Store(bucket, "out", options).put("big", data)
    assert s3.keys(bucket)["out/big"] == data
    with FaultProxy(s3.url) as proxy:
        store = S3Store(bucket, "out", {**options, "endpoint": proxy.url, "retries": "1"})
        proxy.faults.add("503", 100, "PUT", "partNumber=2")  # the second part never goes up
        with pytest.raises(OutputError):
            store.put("half", data)
        assert proxy.faults.injected("503") >= 1
    uploads = s3.client().list_multipart_uploads(Bucket=bucket).get("Uploads", [])
    assert uploads == [], f"a failed multipart upload was left open: {uploads}"
    assert "out/half" not in s3.keys(bucket)
    # Control: an upload that nobody aborts is listed, so the empty list above means something.
    s3.client().create_multipart_upload(Bucket=bucket, Key="out/left-open")
    assert [u["Key"] for u in s3.client().list_multipart_uploads(Bucket=bucket)["Uploads"]] == ["out/left-open"]
