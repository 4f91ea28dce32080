"""Chunks that are the fill value everywhere are not stored (zarr's ``write_empty_chunks=False``):
readers return the fill value for them, resume and verify know they are absent on purpose
(issue 16)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import zarr

from conftest import spec_for, write_h5
from formats_fixtures import read_by_independent_clients
from h5ngff.engine.write.checksums import SIDECAR_DIR
from h5ngff.engine.write.chunkio import is_fill_chunk
from h5ngff.engine.write.manifest import Manifest
from h5ngff.engine.verify.check import verify_output

pytestmark = pytest.mark.integration

CLI = [sys.executable, "-m", "h5ngff.cli"]
SHAPE, CHUNKS, SHARDS = (40, 96, 96), (8, 32, 32), (16, 64, 64)


def sparse_volume(dtype="uint16") -> np.ndarray:
    """Mostly zero: data in two corners, so most chunks at every level are empty."""
    rng = np.random.default_rng(5)
    data = np.zeros(SHAPE, dtype=dtype)
    data[:8, :32, :40] = rng.integers(1, 4000, size=(8, 32, 40))  # one chunk and a sliver of the next
    data[30:, 70:, 70:] = rng.integers(1, 4000, size=(10, 26, 26))  # edge chunks
    return data


def stored_files(level_dir: str) -> set[str]:
    """The chunk files of a level: not its metadata, nor the NGFF 0.4 checksum sidecar that lives
    inside level 0's directory (docs/engine.md, Checksums)."""
    return {
        os.path.relpath(os.path.join(d, n), level_dir)
        for d, _, names in os.walk(level_dir)
        for n in names
        if n not in ("zarr.json", ".zarray", ".zattrs")
        and os.path.basename(SIDECAR_DIR) not in os.path.relpath(d, level_dir).split(os.sep)
    }


@pytest.mark.slow
@pytest.mark.parametrize("version,shards", [("0.5", None), ("0.5", SHARDS), ("0.4", None)])
def test_empty_chunks_are_not_stored_and_read_as_fill(tmp_path, convert, version, shards):
    data = sparse_volume()
    h5 = write_h5(tmp_path / "in.h5", data)
    out = str(tmp_path / "out.ome.zarr")
    output = {"chunks": list(CHUNKS), "ngffVersion": version, **({"shards": list(shards)} if shards else {})}
    convert(spec_for(h5, out, output=output, pyramid={"levels": 2}))
    unit = shards or CHUNKS
    grid = [-(-n // u) for n, u in zip(SHAPE, unit)]
    non_empty = {tuple(i // u for i, u in zip(idx, unit)) for idx in zip(*np.nonzero(data))}
    files = stored_files(os.path.join(out, "0"))
    assert len(files) == len(non_empty) < 0.4 * np.prod(grid)  # >= 60 % of the units left out
    for level in (0, 1):  # zarr returns the fill value for every absent chunk
        want = data if level == 0 else zarr.open_array(out + "/1", mode="r")[...]
        np.testing.assert_array_equal(zarr.open_array(f"{out}/{level}", mode="r")[...], want)
    if version == "0.5":
        read_by_independent_clients(out, data)
    marker = zarr.open_group(out, mode="r").attrs["h5ngff"]
    assert int(marker["emptyUnits"]["0"]) == np.prod(grid) - len(non_empty)
    assert verify_output(out, (h5, "/volume/data")).ok and verify_output(out).ok
    # Negative control: a non-empty unit deleted is still caught, with the source and without it.
    victim = sorted(files)[0]
    os.unlink(os.path.join(out, "0", victim))
    assert not verify_output(out).ok
    report = verify_output(out, (h5, "/volume/data"))
    assert not report.ok and any("missing" in p for p in report.problems)


def test_a_shard_leaves_out_its_empty_inner_chunks(tmp_path, convert):
    data = sparse_volume()
    h5 = write_h5(tmp_path / "in.h5", data)
    out = str(tmp_path / "out.ome.zarr")
    convert(spec_for(h5, out, output={"chunks": list(CHUNKS), "shards": list(SHARDS)}, pyramid={"levels": 1}))
    with open(os.path.join(out, "0", "c", "0", "0", "0"), "rb") as f:
        raw = f.read()
    inner = int(np.prod([s // c for s, c in zip(SHARDS, CHUNKS)]))
    index = np.frombuffer(raw[-(16 * inner + 4) : -4], dtype="<u8").reshape(inner, 2)
    stored = [i for i in range(inner) if index[i, 0] != 2**64 - 1]
    assert len(stored) == 2  # the chunk with data and its neighbour in x holding the sliver
    assert all(tuple(index[i]) == (2**64 - 1, 2**64 - 1) for i in range(inner) if i not in stored)
    assert len(raw) == sum(int(index[i, 1]) for i in stored) + 16 * inner + 4  # nothing else written


def test_only_all_zero_bits_count_as_empty():
    """-0.0 and NaN are data (the fill value 0 is compared bit for bit), so those chunks are stored."""
    chunk = np.zeros((8, 8), dtype=np.float32)
    assert is_fill_chunk(chunk, 0)
    for value in (-0.0, np.nan, 1e-45):
        c = chunk.copy()
        c[7, 7] = value  # not on the probe's stride: the full scan must find it
        assert not is_fill_chunk(c, 0), value
    assert not is_fill_chunk(chunk, 5)  # a non-zero fill value: never left out
    # The first element is looked at on its own first: a non-zero there is data at once, and a
    # -0.0 there (false as a number) must still reach the byte comparison.
    for value in (-0.0, np.nan, 1.0):
        c = chunk.copy()
        c[0, 0] = value
        assert not is_fill_chunk(c, 0), value
    for dtype in (np.uint16, np.int8, np.complex64, np.bool_, np.float16):
        z = np.zeros((4, 4), dtype=dtype)
        assert is_fill_chunk(z, 0), dtype
        z.reshape(-1)[0] = 1
        assert not is_fill_chunk(z, 0), dtype


FLAGS = [
    "--chunks",
    "8,32,32",
    "--levels",
    "2",
    "--slab",
    "16,96,96",
    "--compressor",
    "gzip:3",
    "--workers",
    "1",
    "--no-progress",
]


@pytest.mark.slow
def test_resume_trusts_recorded_empty_units_and_removes_a_stale_file(tmp_path, convert):
    """A run killed mid-way resumes without rewriting slabs whose units were left out as empty,
    and ends identical to an uninterrupted run (the window too). A file found at an empty unit's
    name (another run's leftover) is not trusted: that slab is rewritten and the file removed."""
    data = sparse_volume()
    h5 = write_h5(tmp_path / "in.h5", data)
    clean, out = str(tmp_path / "clean.ome.zarr"), str(tmp_path / "killed.ome.zarr")

    def spec(path):
        return spec_for(
            h5,
            path,
            output={"chunks": [8, 32, 32], "compressor": {"codec": "gzip", "clevel": 3}},
            pyramid={"levels": 2},
            resources={"slab": [16, 96, 96], "workers": 1},
        )

    convert(spec(clean))
    env = {**os.environ, "H5NGFF_FAULTS": "slab_sleep=1.0"}
    proc = subprocess.Popen(
        CLI + ["convert", f"{h5}:/volume/data", out] + FLAGS,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    deadline = time.time() + 120
    while (Manifest.load(out) is None or not Manifest.load(out).records) and time.time() < deadline:
        time.sleep(0.02)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    manifest = Manifest.load(out)
    empty = [(lv, key) for lv, units in manifest.units.items() for key, n in units.items() if n == 0]
    assert empty and 0 < len(manifest.records) < 3, "the kill must land mid-run, after a slab with empty units"
    verified = manifest.verified_units({lv: os.path.join(out, str(lv)) for lv in (0, 1)})
    assert all(key in verified[lv] for lv, key in empty)
    # A stale file at an empty unit's name: not trusted (negative control of the check above).
    lv, key = empty[0]
    os.makedirs(os.path.dirname(os.path.join(out, str(lv), key)), exist_ok=True)
    shutil.copy(os.path.join(clean, "0", "c", "0", "0", "0"), os.path.join(out, str(lv), key))
    assert key not in Manifest.load(out).verified_units({lv: os.path.join(out, str(lv))})[lv]
    summary = convert(spec(out))
    assert (
        summary.resumed and summary.totals.slabs_skipped == len(manifest.records) - 1
    )  # all but the stale file's slab
    assert not os.path.exists(os.path.join(out, str(lv), key))
    for level in ("0", "1"):
        assert stored_files(os.path.join(out, level)) == stored_files(os.path.join(clean, level))
        for name in stored_files(os.path.join(clean, level)):
            assert Path(out, level, name).read_bytes() == Path(clean, level, name).read_bytes()
    ome = [json.loads(Path(p, "zarr.json").read_text())["attributes"]["ome"] for p in (out, clean)]
    assert ome[0] == ome[1]
