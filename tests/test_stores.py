"""The Store contract (engine/stores): one suite that the local directory store and the S3 store
(a real moto server on loopback) both pass, plus the S3 store's own failure modes through a real
fault-injecting HTTP proxy: retries with a counter, permanent errors at once, multipart uploads
that are completed or aborted."""

from __future__ import annotations

import os
import time

import pytest

from h5ngff.engine.stores import LocalStore, store_retries
from h5ngff.errors import OutputError
from s3_server import FaultProxy


@pytest.fixture(params=["local", pytest.param("s3", marks=pytest.mark.integration)])
def store(request, tmp_path):
    if request.param == "local":
        return LocalStore(str(tmp_path / "out.ome.zarr"))
    from h5ngff.engine.stores.s3 import S3Store

    s3 = request.getfixturevalue("s3")
    store = S3Store(s3.new_bucket(), "pre/out.ome.zarr", s3.options())
    store._test_options = tuple(sorted(s3.options().items()))  # what a level's layout carries
    return store


@pytest.mark.slow
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


def test_ranged_reads_give_exact_bytes_and_the_size(store):
    """A shard is read through its index: the tail with the object's size, then byte ranges."""
    data = bytes(range(256)) * 40  # 10240 bytes, every offset distinguishable
    store.put("0/c/0/0/0", data)
    tail, size = store.get_suffix("0/c/0/0/0", 100)
    assert (tail, size) == (data[-100:], len(data))
    assert store.get_suffix("0/c/0/0/0", 20000) == (data, len(data))  # longer than the object: all of it
    ranges = [(0, 1), (300, 17), (10000, 240), (5, 5)]
    assert list(store.get_ranges("0/c/0/0/0", ranges)) == [data[s : s + n] for s, n in ranges]
    with pytest.raises(KeyError):
        store.get_suffix("0/c/9", 4)
    with pytest.raises(KeyError):
        list(store.get_ranges("0/c/9", [(0, 4)]))


def test_a_writer_commits_on_a_clean_exit_and_drops_on_an_error(store):
    with store.writer("0/c/1") as f:
        f.write(b"ab")
        f.writelines([b"c", b"d"])
        assert f.tell() == 4
        assert store.size("0/c/1") is None  # nothing visible before the block exits
    assert store.get("0/c/1") == b"abcd"
    with pytest.raises(RuntimeError):
        with store.writer("0/c/1") as f:
            f.write(b"half")
            raise RuntimeError("killed mid-write")
    with pytest.raises(RuntimeError):
        with store.writer("0/c/2", sync=True) as f:
            f.write(b"half")
            raise RuntimeError("killed mid-write")
    assert store.get("0/c/1") == b"abcd" and store.size("0/c/2") is None
    assert store.list("") == {"0/c/1": 4}  # no temporary left behind
    assert store.put("zarr.json", b"{}", sync=True) == 2 and store.get("zarr.json") == b"{}"


def test_delete_removes_one_key_not_its_siblings(store):
    for key in ("0/c/1", "0/c/10", "0/c/1x"):
        store.put(key, b"1")
    store.delete("0/c/1")
    store.delete("0/c/404")  # missing: no error
    assert store.list("") == {"0/c/10": 1, "0/c/1x": 1}


def test_sweep_removes_only_what_a_killed_writer_left(tmp_path):
    """A writer killed between its write and its rename leaves a temporary file; sweep removes
    those and nothing else. Control: before the sweep, the file is there."""
    from h5ngff.engine.stores.local import TMP_MARK

    store = LocalStore(str(tmp_path / "out"))
    store.put("0/c/0", b"kept")
    left = tmp_path / "out" / "0" / "c" / f".1{TMP_MARK}0123456789ab"
    left.write_bytes(b"half")
    assert store.sweep() == 1 and not left.exists() and store.list("") == {"0/c/0": 4}
    assert store.sweep() == 0


@pytest.mark.integration
def test_a_sibling_prefix_with_the_same_start_is_not_ours(s3):
    """``out.ome.zarr`` must not list or delete ``out.ome.zarr.bak``: the prefix is a path."""
    from h5ngff.engine.stores.s3 import S3Store

    bucket = s3.new_bucket()
    ours, theirs = S3Store(bucket, "out.ome.zarr", s3.options()), S3Store(bucket, "out.ome.zarr.bak", s3.options())
    ours.put("zarr.json", b"1")
    theirs.put("zarr.json", b"precious")
    assert ours.delete_prefix("") == 1
    assert theirs.get("zarr.json") == b"precious"


@pytest.mark.slow
@pytest.mark.integration
def test_transient_errors_are_retried_counted_and_bounded(s3):
    from h5ngff.engine.stores.s3 import S3Store

    bucket = s3.new_bucket()
    with FaultProxy(s3.url) as proxy:
        store = S3Store(bucket, "out", {**s3.options(proxy.url), "retries": "4"})
        proxy.faults.add("503", 2, "PUT")
        proxy.faults.add("reset", 1, "PUT")
        before = store_retries.count
        store.put("a", b"data")
        assert (
            store_retries.count - before == 3
            and proxy.faults.injected("503") == 2
            and proxy.faults.injected("reset") == 1
        )
        assert s3.keys(bucket)["out/a"] == b"data"
        # Bounded: more failures than attempts fail the request with what to do, not forever.
        proxy.faults.add("503", 10, "PUT")
        with pytest.raises(OutputError, match="still failing after 4 attempts.*Run the command again once it answers"):
            store.put("b", b"data")


@pytest.mark.slow
@pytest.mark.integration
def test_a_403_fails_at_once_with_what_to_change(s3):
    from h5ngff.engine.stores.s3 import S3Store

    with FaultProxy(s3.url) as proxy:
        store = S3Store(s3.new_bucket(), "out", s3.options(proxy.url))
        proxy.faults.add("403", 100)
        before = store_retries.count
        with pytest.raises(OutputError) as err:
            store.put("a", b"data")
        assert (
            err.value.reason == "OutputUnwritable"
            and "AccessDenied" in str(err.value)
            and "s3:PutObject" in str(err.value)
        )
        assert store_retries.count == before and proxy.faults.injected("403") == 1  # not retried
    # Control: the same store behind no faults writes.
    S3Store(store.bucket, "out", s3.options()).put("a", b"data")


ROUND_TRIP = 0.5


@pytest.mark.slow
@pytest.mark.integration
def test_overlapped_puts_share_their_round_trips_and_are_all_stored_when_the_block_exits(s3):
    from h5ngff.engine.stores.s3 import S3Store

    bucket = s3.new_bucket()
    objects = {f"c/{i}": bytes([i]) * 1000 for i in range(6)}
    with FaultProxy(s3.url) as proxy:
        store = S3Store(bucket, "out", s3.options(proxy.url))
        store.put("warm", b"connection pool")  # so neither run pays for the connections
        # Control: six PUTs one after another each wait out the endpoint's round trip. It is long
        # (0.5 s) so that the check below, a listing made while the window's PUTs are held, ends
        # well inside it on a loaded machine (at 0.25 s a CI run once listed them stored).
        proxy.faults.add(f"delay:{ROUND_TRIP}", 6, "PUT", "/sync/")
        t0 = time.perf_counter()
        for key, data in objects.items():
            store.put(f"sync/{key}", data)
        synchronous = time.perf_counter() - t0
        proxy.faults.add(f"delay:{ROUND_TRIP}", 6, "PUT", "/window/")
        # Made before the clock: a new botocore client loads its service model, which on a
        # loaded CI machine outlasted the round trip (the PUTs were listed as stored).
        lister = s3.client()
        t0 = time.perf_counter()
        with store.overlapped(6):
            for key, data in objects.items():
                store.put(f"window/{key}", data)
            # The calls returned before the endpoint answered: nothing is stored yet.
            assert lister.list_objects_v2(Bucket=bucket, Prefix="out/window/").get("KeyCount") == 0
        overlapped = time.perf_counter() - t0
    stored = s3.keys(bucket, "out/window/")
    assert stored == {f"out/window/{k}": v for k, v in objects.items()}, "every PUT is stored once the block exits"
    assert synchronous >= 6 * ROUND_TRIP and overlapped < 0.5 * synchronous, (synchronous, overlapped)


@pytest.mark.slow
@pytest.mark.integration
def test_the_window_bounds_the_puts_in_flight(s3):
    from h5ngff.engine.stores.s3 import S3Store

    bucket = s3.new_bucket()
    with FaultProxy(s3.url) as proxy:
        store = S3Store(bucket, "out", s3.options(proxy.url))
        proxy.faults.add("delay:0.3", 4, "PUT")
        t0 = time.perf_counter()
        with store.overlapped(2):
            for i in range(4):
                store.put(f"k{i}", b"x")
        elapsed = time.perf_counter() - t0
    # Two at a time: the third PUT waits for the first, so four take two round trips, not one.
    assert 2 * 0.3 <= elapsed < 4 * 0.3, elapsed


@pytest.mark.slow
@pytest.mark.integration
def test_a_failed_put_in_the_window_fails_the_block_after_the_others_are_done(s3):
    from h5ngff.engine.stores.s3 import S3Store

    bucket = s3.new_bucket()
    with FaultProxy(s3.url) as proxy:
        store = S3Store(bucket, "out", {**s3.options(proxy.url), "retries": "3"})
        proxy.faults.add("403", 1, "PUT", "/out/bad")
        proxy.faults.add("503", 1, "PUT", "/out/flaky")
        proxy.faults.add("delay:0.4", 1, "PUT", "/out/slow")
        retries_before = store_retries.mine()
        with pytest.raises(OutputError, match="AccessDenied"):
            with store.overlapped(2):
                store.put("bad", b"refused")
                store.put("slow", b"late")
                store.put("flaky", b"retried once")  # the window is full: waits for "bad", which raises
        # The error comes out only once the PUT still in flight has finished: none is left to
        # race a retry of the same slab. "flaky" was never sent.
        assert set(s3.keys(bucket, "out/")) == {"out/slow"}
        # An error of the slab's own (an encoding failure) also waits for the PUTs in flight, and
        # is the one raised.
        proxy.faults.add("delay:0.4", 2, "PUT", "/out/late")
        with pytest.raises(RuntimeError, match="encoding failed"):
            with store.overlapped(6):
                store.put("late0", b"x")
                store.put("late1", b"x")
                raise RuntimeError("encoding failed")
        assert {"out/late0", "out/late1"} <= set(s3.keys(bucket, "out/"))
        # Retries made in the pool count as the calling thread's (the slab reports its own).
        with store.overlapped(6):
            store.put("flaky", b"retried once")
        assert store_retries.mine() - retries_before == 1 and proxy.faults.injected("503") == 1


@pytest.mark.integration
def test_a_missing_bucket_fails_at_once_and_says_so(s3):
    from h5ngff.engine.stores.s3 import S3Store

    with pytest.raises(OutputError, match="NoSuchBucket.*create the bucket"):
        S3Store("no-such-bucket-h5ngff", "out", s3.options()).list("")


@pytest.mark.slow
@pytest.mark.integration
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


@pytest.mark.slow
def test_the_engine_writes_and_reads_a_sharded_level_through_either_store(store):
    """chunkio's one path over both stores: shards streamed through ``writer``, read back through
    their index with ranged reads (any region, the fill value where nothing is stored), and an
    all-fill unit stored as nothing. Control: a shard whose index is damaged is refused."""
    import numpy as np

    from h5ngff.engine.write.chunkio import ArrayLayout, read_region, write_block
    from h5ngff.spec import CompressorSpec

    options = getattr(store, "_test_options", None)
    shape, chunks, shards = (24, 40, 48), (8, 8, 16), (16, 16, 32)
    layout = ArrayLayout(
        f"{store.root}/0",
        shape,
        chunks,
        shards,
        "<u2",
        3,
        CompressorSpec(codec="zstd", clevel=3),
        0,
        0,
        storage_options=options,
        checksums=True,
    )
    data = (np.arange(np.prod(shape)) % 5000).reshape(shape).astype("<u2")
    data[16:, :16, :32] = 0  # one shard all fill: not stored
    written = dict(write_block(layout, data[:, :32], (0, 0, 0)))
    assert written["c/1/0/0"] == 0 and store.size("0/c/1/0/0") is None and store.size("0/c/0/0/0") == written["c/0/0/0"]
    expected = data.copy()
    expected[:, 32:] = 0  # never written: reads as the fill value
    for region in [
        (slice(0, 24), slice(0, 40), slice(0, 48)),
        (slice(5, 19), slice(3, 37), slice(17, 47)),
        (slice(23, 24), slice(31, 33), slice(0, 1)),
    ]:
        np.testing.assert_array_equal(read_region(layout, region), expected[region])
    body = bytearray(store.get("0/c/0/0/0"))
    body[-6] ^= 0xFF  # inside the index
    store.put("0/c/0/0/0", bytes(body))
    with pytest.raises(ValueError, match="index checksum"):
        read_region(layout, (slice(0, 8), slice(0, 8), slice(0, 16)))


# -- the capability members (engine/stores/base.py): what differs is asked of the store ----------


def test_append_adds_in_place_where_the_store_can_and_refuses_where_it_cannot(store):
    """A directory appends (the manifest's one file); a bucket has no append and says so, so the
    manifest writes one object per batch there (tests/test_output_store.py)."""
    if not store.supports_append:
        with pytest.raises(OSError, match="no append"):
            store.append("log", b"a\n")
        assert store.size("log") is None
        return
    store.append(".h5ngff/log", b"a\n")  # creates the object (and its directory)
    store.append(".h5ngff/log", b"b\n", sync=True)
    assert store.get(".h5ngff/log") == b"a\nb\n" and store.list("") == {".h5ngff/log": 4}


def test_occupied_sees_anything_but_the_ignored_keys(store, tmp_path):
    assert not store.occupied()
    store.put(".h5ngff.lock", b"held")
    assert store.occupied() and not store.occupied(ignore=(".h5ngff.lock",))
    store.put("0/c/0", b"1")
    assert store.occupied(ignore=(".h5ngff.lock",))
    if store.local_path is not None:  # a directory: an empty subdirectory, or a file in its place
        from h5ngff.engine.stores import LocalStore

        (tmp_path / "d").mkdir()
        (tmp_path / "d" / "empty").mkdir()
        (tmp_path / "f").write_text("x")
        assert LocalStore(str(tmp_path / "d")).occupied() and LocalStore(str(tmp_path / "f")).occupied()
        assert not LocalStore(str(tmp_path / "absent")).occupied()


def test_delete_prefix_leaves_no_empty_directory_of_what_it_removed(store):
    """--overwrite of a directory must not leave the old output's empty level directories (a
    stale ``2/`` beside a new 2-level image). Control: a kept key keeps its directory."""
    for key in ("0/c/0/0", "2/c/1/1", ".h5ngff/hist/0", ".h5ngff.lock", "zarr.json"):
        store.put(key, b"1")
    assert store.delete_prefix("", keep=(".h5ngff.lock", "zarr.json")) == 3
    assert store.list("") == {".h5ngff.lock": 1, "zarr.json": 1}
    if store.local_path is not None:
        assert sorted(os.listdir(store.local_path)) == [".h5ngff.lock", "zarr.json"]
        store.put("1/c/0", b"1")
        store.put("1/c/1", b"1")
        store.delete_prefix("1/", keep=("1/c/0",))
        assert os.path.isdir(os.path.join(store.local_path, "1", "c"))


def test_leftovers_names_what_sweep_removes(store):
    store.put("0/c/0", b"kept")
    if store.local_path is None:  # a bucket's uploads are whole or aborted: none
        assert store.leftovers() == () and store.sweep() == 0
        return
    from h5ngff.engine.stores.local import TMP_MARK

    left = os.path.join(store.local_path, "0", "c", f".1{TMP_MARK}0123456789ab")
    with open(left, "wb") as f:
        f.write(b"half")
    assert store.leftovers() == (f"0/c/.1{TMP_MARK}0123456789ab",)
    assert store.sweep() == 1 and store.leftovers() == ()


@pytest.mark.slow
def test_the_zarr_view_reads_the_same_objects(store):
    """``as_zarr_store()``: zarr-python opens what the store holds, read-only."""
    import zarr

    store.put("zarr.json", b'{"zarr_format": 3, "node_type": "group", "attributes": {"a": 1}}')
    view = store.as_zarr_store()
    assert dict(zarr.open_group(view, mode="r").attrs) == {"a": 1}
    assert view.read_only


def test_conditional_writes_where_the_store_has_them(store):
    """A bucket holds a lease object with them (engine.stores.s3lease); a directory has none and says
    so at once (it is locked with flock on ``local_path``)."""
    from h5ngff.engine.stores.base import ConditionalWritesUnsupported

    if not store.supports_conditional_writes:
        assert store.local_path is not None
        with pytest.raises(ConditionalWritesUnsupported):
            store.create("lease", b"1")
        return
    etag = store.create("lease", b"1")
    assert etag and store.create("lease", b"2") is None  # exists: refused
    assert store.replace("lease", b"3", "wrong") is None
    assert store.replace("lease", b"3", etag) and store.get_tagged("lease")[0] == b"3"


def test_check_creatable_refuses_a_root_that_cannot_be_made(store, tmp_path):
    store.check_creatable()  # fresh: fine for both
    if store.local_path is not None:
        from h5ngff.engine.stores import LocalStore

        (tmp_path / "a-file").write_text("x")
        with pytest.raises(OutputError, match="is a file, not a directory"):
            LocalStore(str(tmp_path / "a-file" / "out")).check_creatable()


def test_no_caller_tests_the_type_of_its_store():
    """Outside engine/stores, nothing asks which kind of store it holds (isinstance of a store
    class, is_url): what differs is a capability member. Control: the pattern finds a planted line."""
    import re
    from pathlib import Path

    pattern = re.compile(r"isinstance\([^)]*\b(LocalStore|S3Store|ObjectStore)\b|\bis_url\(")
    assert pattern.search("    assert isinstance(store, S3Store)") and pattern.search("if is_url(path):")
    src = Path(__file__).resolve().parents[1] / "src" / "h5ngff"
    found = [
        f"{p.relative_to(src)}:{n}"
        for p in src.rglob("*.py")
        if "stores" not in p.parts
        for n, line in enumerate(p.read_text().splitlines(), 1)
        if pattern.search(line)
    ]
    assert found == []
