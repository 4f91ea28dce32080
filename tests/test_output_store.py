"""One output path over the Store protocol (engine/output.py, engine/manifest.py): the manifest
takes the form the store allows (one appended object in a directory, one object per batch in a
bucket: a real moto server), and outputs written by earlier builds still load exactly as before.
The conversions themselves, their resume, refusal and --overwrite, are in test_engine_resume.py,
test_s3_output.py and test_s3_failure_paths.py."""

from __future__ import annotations

import json
import os

import pytest

from h5ngff.engine.write.manifest import MANIFEST_KEY, MANIFEST_PREFIX, Manifest, SlabRecord
from h5ngff.engine.stores import LocalStore

CONTENT = {"shape": [8, 8, 8], "dtype": "<u2", "chunks": [4, 4, 4]}


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
