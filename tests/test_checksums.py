"""Checksums, and a ``verify`` that does not share the writer's code.

NGFF 0.5 chunks carry the Zarr v3 crc32c codec (read and checked by zarr-python and
tensorstore); NGFF 0.4 chunk files get a CRC32C sidecar. A same-size bit flip in a chunk, which
decodes fine, is named by ``verify`` without ``--source``; with ``--no-checksums`` (the negative
control) the same flip passes. ``verify`` decodes through zarr-python, so a bug shared by the
writer's encoder and decoder (injected here) is caught where the writer's own decoder passes it.
Real conversions, real stores, real zarr-python, tensorstore, ome-zarr-py and ngff-zarr.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import google_crc32c
import numpy as np
import pytest
import zarr

from conftest import smooth, spec_for, write_h5
from formats_fixtures import read_by_independent_clients
from h5ngff.engine.write import chunkio
from h5ngff.engine.write.checksums import SIDECAR_DIR
from existing_layout import level_layout
from h5ngff.engine.verify.check import verify_output
from test_engine_resume import FLAGS, chunk_files, manifest_lines

pytestmark = pytest.mark.integration

CLI = [sys.executable, "-m", "h5ngff.cli"]
SHAPE = (16, 40, 36)
OUTPUTS = {
    # name: output section (compressor none: a flipped bit still decodes, so only a checksum sees it)
    "0.5": {"chunks": [4, 8, 8], "ngffVersion": "0.5", "compressor": {"codec": "none"}},
    "0.5-shards": {"chunks": [2, 4, 4], "shards": [4, 8, 8], "ngffVersion": "0.5", "compressor": {"codec": "none"}},
    "0.4": {"chunks": [4, 8, 8], "ngffVersion": "0.4", "compressor": {"codec": "none"}},
}


def _convert(convert, tmp_path, name: str, checksums: bool = True, data=None):
    data = smooth(SHAPE, "uint16", seed=7) if data is None else data
    h5 = write_h5(tmp_path / f"{name}-{checksums}.h5", data)  # one file each: workers keep sources open
    out = str(tmp_path / f"{name}-{checksums}.ome.zarr")
    convert(spec_for(h5, out, output={**OUTPUTS[name], "checksums": checksums}, pyramid={"levels": 2}))
    return h5, out, data


def _flip_bit(path: str, offset: int) -> None:
    """One bit of one byte, in place: the file keeps its size."""
    size = os.path.getsize(path)
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)[0]
        f.seek(offset)
        f.write(bytes([byte ^ 0x10]))
    assert os.path.getsize(path) == size


@pytest.mark.slow
def test_v3_chunks_carry_crc32c_that_zarr_and_tensorstore_check(convert, tmp_path):
    """Our bytes are the codec's: zarr-python and tensorstore read them back, ome-zarr-py and
    ngff-zarr too; and both libraries refuse a chunk whose bit was flipped, so the CRC is real."""
    ts = pytest.importorskip("tensorstore")
    for name in ("0.5", "0.5-shards"):
        _, out, data = _convert(convert, tmp_path, name)
        meta = json.load(open(os.path.join(out, "0", "zarr.json")))
        codecs = meta["codecs"][0]["configuration"]["codecs"] if name == "0.5-shards" else meta["codecs"]
        assert codecs[-1] == {"name": "crc32c"}
        if name == "0.5-shards":
            assert meta["codecs"][0]["configuration"]["index_codecs"][-1] == {"name": "crc32c"}
        np.testing.assert_array_equal(zarr.open_array(os.path.join(out, "0"), mode="r")[...], data)
        store = ts.open({"driver": "zarr3", "kvstore": {"driver": "file", "path": os.path.join(out, "0")}}).result()
        np.testing.assert_array_equal(store.read().result(), data)
        read_by_independent_clients(out, data)
        _flip_bit(os.path.join(out, "0", "c", "1", "1", "1"), 20)  # inside the first (inner) chunk's data
        with pytest.raises(ValueError, match="checksum"):
            zarr.open_array(os.path.join(out, "0"), mode="r")[...]
        with pytest.raises(Exception, match="(?i)checksum|crc"):
            ts.open(
                {"driver": "zarr3", "kvstore": {"driver": "file", "path": os.path.join(out, "0")}}
            ).result().read().result()


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(OUTPUTS))
@pytest.mark.parametrize("checksums", [True, False], ids=["checksums", "negative-control-no-checksums"])
def test_a_same_size_bit_flip_is_named_by_verify_without_the_source(convert, tmp_path, name, checksums):
    h5, out, _ = _convert(convert, tmp_path, name, checksums)
    clean = verify_output(out)
    assert clean.ok, clean.problems
    assert clean.checksums == ("none" if not checksums else "sidecar" if name == "0.4" else "crc32c codec")
    prefix = "" if name == "0.4" else "c/"
    victims = [(0, f"{prefix}1/2/1"), (1, f"{prefix}0/1/1")]  # one chunk (or shard) in each level
    for level, key in victims:
        _flip_bit(os.path.join(out, str(level), key), 12)
    report = verify_output(out)
    if not checksums:  # the flip decodes to other values: nothing without checksums can see it
        assert report.ok, report.problems
        assert not verify_output(out, (h5, "/volume/data")).ok  # (the flip is real: the source sees it)
        return
    assert sorted(report.bad_units) == sorted(victims), report.problems  # both named: verify kept going
    named = {(m["level"], m["key"]) for m in report.checksum_mismatches}
    assert named == set(victims)
    assert all(m["expected"] != m["actual"] and len(m["actual"]) == 8 for m in report.checksum_mismatches)
    if name == "0.5-shards":  # an inner chunk, named with its index in the shard
        assert all(m["chunk"] is not None for m in report.checksum_mismatches)
        assert any("inner chunk (0, 0, 0)" in p for p in report.problems)
    if name == "0.5-shards":  # the CLI once: its exit status and message
        cli = subprocess.run(CLI + ["verify", out], capture_output=True, text=True)
        assert cli.returncode == 1, cli.stdout
        assert "checksum mismatch" in cli.stdout and victims[0][1] in cli.stdout
    with_source = verify_output(out, (h5, "/volume/data"))  # the comparison path names them too
    assert sorted(with_source.bad_units) == sorted(victims) and len(with_source.checksum_mismatches) == 2


def test_verify_decodes_independently_of_the_writer(convert, tmp_path, monkeypatch):
    """A symmetric bug in the writer's chunk code (each chunk stored byte-swapped, and swapped
    back by its decoder; the CRC is then taken over the wrong bytes, so it is valid) passes any
    check that decodes with the writer's own ``chunkio``, the old verify's path. zarr-python
    reads the bytes as the metadata says, little-endian, and verify --source names every chunk."""
    h5, out, data = _convert(convert, tmp_path, "0.5")
    layout = level_layout(out, "0", 3, 0)
    assert layout.checksums
    encode, decode = chunkio.encode_stored_chunk, chunkio.decode_chunk
    monkeypatch.setattr(
        chunkio, "encode_stored_chunk", lambda lay, block, *a, **k: encode(lay, block.byteswap(), *a, **k)
    )
    monkeypatch.setattr(chunkio, "decode_chunk", lambda lay, raw: decode(lay, raw).byteswap())
    chunkio.write_block(layout, data, (0, 0, 0))  # level 0 rewritten with the bug
    # The old path: every unit decodes with chunkio, and equals the source.
    whole = tuple(slice(0, n) for n in data.shape)
    for unit in layout.units_in(whole):
        assert chunkio.read_unit(layout, unit) is not None
    np.testing.assert_array_equal(chunkio.read_region(layout, whole), data)
    # The new path: zarr-python's decoding, independent of chunkio.
    report = verify_output(out, (h5, "/volume/data"))
    assert not report.ok
    level0 = {key for level, key in report.bad_units if level == 0}
    assert level0 == {layout.key(u) for u in layout.units_in(whole)}, report.problems[:3]
    assert not report.checksum_mismatches  # the CRCs are valid: only decoding independently sees it


@pytest.mark.slow
def test_an_absent_chunk_of_a_finished_output_reads_as_fill_unless_recorded(convert, tmp_path):
    """The writer skips chunks that are all fill value: such an absent chunk is accepted (and
    --source says whether it should be fill). A chunk that held data and is deleted is found
    without the source too: by the marker's count of skipped units (0.5) or the sidecar (0.4)."""
    data = smooth(SHAPE, "uint16", seed=3)
    data[:4] = 0  # the first z-row of level-0 chunks is all fill value
    for name in ("0.5", "0.4"):
        h5, out, _ = _convert(convert, tmp_path, name, data=data)
        sep = "/" if name == "0.4" else "/c/"
        empty, full = f"{out}/0{sep}0/0/0", f"{out}/0{sep}2/2/2"
        assert not os.path.exists(empty) and os.path.exists(full)  # the writer left the all-fill chunk out
        report = verify_output(out, (h5, "/volume/data"))
        assert report.ok and verify_output(out).ok, report.problems  # absent and all fill: legitimate
        os.unlink(full)  # negative control: a chunk that held data
        plain = verify_output(out)
        compared = verify_output(out, (h5, "/volume/data"))
        key = "2/2/2" if name == "0.4" else "c/2/2/2"
        assert (0, key) in compared.bad_units  # absent, but the source says it held data
        assert not plain.ok and (0, key) in plain.bad_units, plain.problems  # one absent unit more than recorded


def _sidecars(out: str) -> dict[str, bytes]:
    base = os.path.join(out, SIDECAR_DIR)
    return {name: open(os.path.join(base, name), "rb").read() for name in sorted(os.listdir(base))}


@pytest.mark.slow
def test_v2_killed_run_resumes_to_the_same_chunks_and_sidecar(convert, tmp_path):
    """One kill mid-run, then a resume: the chunks and the checksum sidecar are byte-identical to
    an uninterrupted run's, and the sidecar's CRCs are those of the files (computed here). The
    killed run is a real CLI process group; the other two use the shared cluster."""
    data = smooth((48, 256, 512), "uint16", seed=11)  # 24 slabs of FLAGS' 16x64x256
    h5 = write_h5(tmp_path / "in.h5", data)
    clean, out = str(tmp_path / "clean.ome.zarr"), str(tmp_path / "killed.ome.zarr")
    output = {"chunks": [8, 32, 32], "compressor": {"codec": "gzip", "clevel": 3}, "ngffVersion": "0.4"}
    same = dict(output=output, pyramid={"levels": 2}, resources={"slab": [16, 64, 256]})  # = FLAGS
    convert(spec_for(h5, clean, **same))
    proc = subprocess.Popen(
        CLI + ["convert", f"{h5}:/volume/data", out, "--ngff-version", "0.4"] + FLAGS,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    deadline = time.time() + 120
    while manifest_lines(out) < 8 and proc.poll() is None and time.time() < deadline:
        time.sleep(0.01)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    assert 0 < manifest_lines(out) < 24 and not os.path.exists(os.path.join(out, SIDECAR_DIR))
    summary = convert(spec_for(h5, out, **same))
    assert summary.resumed and summary.totals.slabs_skipped >= 8
    assert chunk_files(out) == chunk_files(clean)
    assert _sidecars(out) == _sidecars(clean)
    for level in (0, 1):
        recorded = json.loads(_sidecars(out)[f"{level}.json"])["chunks"]
        files = {k.split("/", 1)[1]: v for k, v in chunk_files(out).items() if k.startswith(f"{level}/")}
        assert set(recorded) == set(files) and len(files) > 10
        assert all(recorded[k] == f"{google_crc32c.value(v):08x}" for k, v in files.items())
    assert verify_output(out).ok
