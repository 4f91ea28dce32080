"""One output path over the Store protocol (engine/output.py, engine/manifest.py): the manifest
takes the form the store allows (one appended object in a directory, one object per batch in a
bucket: a real moto server), and outputs written by earlier builds still load exactly as before.
The conversions themselves, their resume, refusal and --overwrite, are in test_engine_resume.py,
test_s3_output.py and test_s3_failure_paths.py."""

from __future__ import annotations

import json
import os
import random

import pytest

from h5ngff.engine.write import output as output_module
from h5ngff.engine.write.manifest import MANIFEST_KEY, MANIFEST_PREFIX, Manifest, SlabRecord, fingerprint
from h5ngff.engine.write.output import object_marker, remove_ours
from h5ngff.engine.stores import LocalStore

CONTENT = {"shape": [8, 8, 8], "dtype": "<u2", "chunks": [4, 4, 4], "levels": 1}


@pytest.fixture(params=["local", "s3"])
def store(request, tmp_path):
    if request.param == "local":
        return LocalStore(str(tmp_path / "out.ome.zarr"))
    from h5ngff.engine.stores.s3 import S3Store

    s3 = request.getfixturevalue("s3")
    return S3Store(s3.new_bucket(), "out.ome.zarr", s3.options())


def _record(i: int, empty: bool = False) -> SlabRecord:
    return SlabRecord(
        0,
        (i, 0, 0),
        [(0, f"c/{i}/0/0", 0 if empty else 100 + i)],
        [(0, float(i), float(i + 1))],
        [(0, f"c/{i}/0/0", f"{i:08x}")],
    )


def test_the_manifest_takes_the_form_its_store_allows_and_reads_back_the_same(store):
    m = Manifest(store)
    m.start(CONTENT)
    m.append([_record(0), _record(1)])
    m.append([])  # nothing recorded: nothing written
    m.append([_record(2)])
    keys = set(store.list(".h5ngff/"))
    if store.supports_append:
        assert keys == {MANIFEST_KEY}
        lines = store.get(MANIFEST_KEY).decode().splitlines()
        assert [json.loads(line)["kind"] for line in lines] == ["header", "slab", "slab", "slab"]
    else:  # the header, then one object per recorded batch, in order
        assert len(keys) == 3 and all(k.startswith(MANIFEST_PREFIX) for k in keys)
    loaded = Manifest.load(store)
    assert loaded is not None and loaded.content == CONTENT and loaded.fingerprint == m.fingerprint
    assert [r.slab for r in loaded.records] == [(0, 0, 0), (1, 0, 0), (2, 0, 0)]
    assert loaded.units == m.units and loaded.checksums == m.checksums
    # A resumed run goes on from the loaded manifest: its next batch comes after the others.
    loaded.append([_record(3)])
    assert [r.slab[0] for r in Manifest.load(store).records] == [0, 1, 2, 3]


def test_recorded_units_are_vouched_for_by_one_listing_per_level(store):
    """A unit is vouched for when its object has the recorded size; a unit recorded empty (the
    fill value everywhere, never stored) while nothing is at its key. Controls: a changed size,
    a missing object, and an object at an empty unit's key are not."""
    m = Manifest(store)
    m.start(CONTENT)
    m.append([_record(0), _record(1), _record(2), _record(3, empty=True), _record(4, empty=True)])
    store.put("0/c/0/0/0", b"x" * 100)  # as recorded
    store.put("0/c/1/0/0", b"x" * 7)  # another size
    # c/2: recorded, missing; c/3: recorded empty, absent; c/4: recorded empty, but an object is there
    store.put("0/c/4/0/0", b"x" * 3)
    assert Manifest.load(store).verified_units({0: "0"}) == {0: {"c/0/0/0", "c/3/0/0"}}
    assert Manifest.load(store).verified_units({}) == {}


def test_a_manifest_written_by_the_previous_build_still_loads(tmp_path):
    """The previous build wrote a directory's manifest with open/append/fsync; this one writes it
    through the store, in the same form. A hand-written file of that form loads as before and is
    appended to in place; a torn last line is ignored, as before."""
    out = tmp_path / "old.ome.zarr"
    (out / ".h5ngff").mkdir(parents=True)
    header = {"kind": "header", "format": 1, "fingerprint": "f" * 32, "content": CONTENT, "created": 1.0}
    slab = {"kind": "slab", "pass": 0, "slab": [0, 0, 0], "units": [[0, "c/0/0/0", 100]], "stats": [[0, 1.0, 2.0]]}
    old = (json.dumps(header) + "\n" + json.dumps(slab) + "\n").encode()
    (out / ".h5ngff" / "manifest.jsonl").write_bytes(old)
    m = Manifest.load(str(out))
    assert m is not None and m.fingerprint == "f" * 32 and [r.slab for r in m.records] == [(0, 0, 0)]
    assert m.units == {0: {"c/0/0/0": 100}} and m.checksums == {}
    m.append([_record(1)])  # a resumed run appends to the same file
    assert (out / ".h5ngff" / "manifest.jsonl").read_bytes().startswith(old)
    assert [r.slab for r in Manifest.load(str(out)).records] == [(0, 0, 0), (1, 0, 0)]
    (out / ".h5ngff" / "manifest.jsonl").write_bytes(
        old + b'{"kind": "slab", "pa'
    )  # torn, as a killed client leaves it
    assert [r.slab for r in Manifest.load(str(out)).records] == [(0, 0, 0)]
    # Control: a bad line that is not the last is not a torn write: it is an error.
    with open(out / ".h5ngff" / "manifest.jsonl", "a") as f:
        f.write("\n" + json.dumps(slab) + "\n")
    with pytest.raises(ValueError):
        Manifest.load(str(out))


def test_no_manifest_is_none(store):
    assert Manifest.load(store) is None
    store.put("zarr.json", b"{}")
    assert Manifest.load(store) is None
    if store.local_path is not None:  # a file where the output directory would be
        path = store.local_path + ".file"
        with open(path, "w") as f:
            f.write("x")
        assert Manifest.load(path) is None and os.path.isfile(path)


class _Killed(Exception):
    """The process died here: nothing after this mutation of the store happened."""


class _KilledAfter:
    """``store``, but the ``after``-th mutation (a put or the deletion of one object) never
    happens: the run is killed there. ``delete_prefix`` deletes one object at a time, in a seeded
    shuffled order (a kill lands after any subset of the data is gone) or, with no seed, in the
    store's listing order (a directory's root files come first)."""

    def __init__(self, store, after: int | None, seed: int | None = 0):
        self._store, self._after, self._seed, self.mutations = store, after, seed, 0

    def __getattr__(self, name):
        return getattr(self._store, name)

    def _mutate(self) -> None:
        self.mutations += 1
        if self.mutations == self._after:
            raise _Killed(f"killed at mutation {self.mutations}")

    def put(self, key, data, sync=False):
        self._mutate()
        return self._store.put(key, data, sync=sync)

    def delete(self, key):
        self._mutate()
        return self._store.delete(key)

    def delete_prefix(self, prefix, keep=()):
        keys = [k for k in self._store.list(prefix) if k not in keep]
        if self._seed is not None:  # else in the store's own listing order, as its deletes go
            random.Random(self._seed).shuffle(keys)
        for key in keys:
            self.delete(key)
        return len(keys)


def _finished_output(store) -> None:
    """What a finished h5ngff output holds: chunks, level metadata, and the root document with
    the completion marker (its manifest removed)."""
    marker = {"complete": True, "fingerprint": fingerprint(CONTENT), "content": CONTENT}
    store.put("zarr.json", json.dumps({"zarr_format": 3, "attributes": {"h5ngff": marker}}).encode())
    store.put("0/zarr.json", b'{"zarr_format": 3, "node_type": "array"}')
    for i in range(6):
        store.put(f"0/c/{i}/0/0", b"x" * (100 + i))


def _unfinished_output(store) -> None:
    """An output a run was killed in: the manifest's header, two batches of records, metadata
    without the marker, and the chunks."""
    m = Manifest(store)
    m.start(CONTENT)
    m.append([_record(0), _record(1)])
    m.append([_record(2)])
    store.put("zarr.json", b'{"zarr_format": 3, "attributes": {}}')
    for i in range(3):
        store.put(f"0/c/{i}/0/0", b"x" * (100 + i))


def _finished_with_headerless_records(store) -> None:
    """A finished output whose manifest's deletion was killed part-way: records are left, their
    header gone (a bucket deletes the sorted keys in batches, the header's first)."""
    _finished_output(store)
    line = Manifest._line(_record(0)) + "\n"
    key = MANIFEST_KEY if store.supports_append else f"{MANIFEST_PREFIX}0000000001-abcdef12.jsonl"
    store.put(key, line.encode())


def _foreign_zarr_v3(store) -> None:
    """A Zarr store h5ngff did not write (--overwrite replaces one where the store allows it)."""
    store.put("zarr.json", b'{"zarr_format": 3, "node_type": "group", "attributes": {}}')
    store.put("0/zarr.json", b'{"zarr_format": 3, "node_type": "array"}')
    for i in range(6):
        store.put(f"0/c/{i}/0/0", b"x" * (100 + i))


def _foreign_zarr_v2(store) -> None:
    store.put(".zgroup", b'{"zarr_format": 2}')
    store.put(".zattrs", b"{}")
    store.put("0/.zarray", b'{"zarr_format": 2}')
    for i in range(6):
        store.put(f"0/{i}.0.0", b"x" * (100 + i))


FOREIGN = (_foreign_zarr_v3, _foreign_zarr_v2)


@pytest.mark.slow
@pytest.mark.parametrize("order", ["listed", "shuffled"])
@pytest.mark.parametrize(
    "output",
    [_finished_output, _unfinished_output, _finished_with_headerless_records, *FOREIGN],
    ids=["finished", "unfinished", "headerless-records", "foreign-v3", "foreign-v2"],
)
def test_an_overwrite_killed_at_any_deletion_leaves_an_output_that_is_whole_or_records_nothing_done(
    store, output, order
):
    """--overwrite deletes the record of progress before the data and its claim last. Killed after
    any number of deletions, the output is still ours (the same content, so a re-run with other
    options is refused), a completion marker is only ever over all of its data, and every slab
    still recorded has its chunks: a re-run without --overwrite redoes what is gone instead of
    reporting missing chunks as finished (test_engine_resume.py runs that re-run)."""
    output(store)
    data = set(store.list("0/"))
    counting = _KilledAfter(store, None)
    remove_ours(counting)
    assert list(store.list("")) == []
    total = counting.mutations
    assert total > len(data)
    for after in range(1, total + 1):
        output(store)
        with pytest.raises(_Killed):
            remove_ours(_KilledAfter(store, after, seed=after if order == "shuffled" else None))
        where = f"killed at mutation {after} of {total}"
        if output in FOREIGN:  # still a Zarr store, so --overwrite may replace it again
            assert any(store.size(m) is not None for m in ("zarr.json", ".zgroup")), f"{where}: no longer Zarr"
            remove_ours(store)
            assert list(store.list("")) == []
            continue
        left, marker = Manifest.load(store), object_marker(store)
        assert marker is None or set(store.list("0/")) == data, f"{where}: a completion marker over missing data"
        claim = left.content if left is not None else (marker or {}).get("content")
        assert claim == CONTENT, f"{where}: no longer recognisably ours"
        if left is not None:
            recorded = {key for r in left.records for _, key, _ in r.units}
            assert recorded <= left.verified_units({0: "0"}).get(0, set()), f"{where}: a recorded chunk is gone"
        remove_ours(store)  # --overwrite again finishes the job
        assert list(store.list("")) == []


def test_negative_control_deleting_the_claims_last_alone_leaves_a_finished_marker(store, monkeypatch):
    """The order before the fix (data, root documents, then the manifest's header): a kill in the
    middle of the data left the completion marker over missing chunks."""
    monkeypatch.setattr(output_module, "_record_nothing_done", lambda s: ("zarr.json",))
    _finished_output(store)
    with pytest.raises(_Killed):
        remove_ours(_KilledAfter(store, 3))
    assert object_marker(store) is not None
    assert len(list(store.list("0/c/"))) < 6
