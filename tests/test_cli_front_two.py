"""Failure paths, round two (items 13, 15 and 16): each rough edge pinned by a test that failed
before its fix. Real subprocesses on tiny generated files; no mocks."""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import socket
import subprocess
import sys
import time
import warnings
from pathlib import Path

import h5py
import numpy as np
import pytest

import h5ngff as package
from conftest import smooth, write_h5
from h5ngff.engine.write.manifest import MANIFEST_DIR, MANIFEST_FILE

pytestmark = pytest.mark.integration

#: The commands run the h5ngff this test imports (its src/), wherever the test file lies.
SRC = Path(package.__file__).resolve().parents[1]
H5NGFF = [sys.executable, "-m", "h5ngff.cli"]
# No COLUMNS (conftest drops it for the session): the commands' stdout is a pipe, as in
# `h5ngff plan ... > plan.txt`.
ENV = dict(os.environ)
ENV["PYTHONPATH"] = str(SRC) + os.pathsep + os.environ.get("PYTHONPATH", "")


def h5ngff(*argv, cwd=None, timeout=180) -> subprocess.CompletedProcess:
    return subprocess.run([*H5NGFF, *map(str, argv)], capture_output=True, text=True, timeout=timeout, cwd=cwd, env=ENV)


def no_traceback(proc: subprocess.CompletedProcess) -> None:
    for stream in (proc.stdout, proc.stderr):
        assert "Traceback" not in stream, stream[-3000:]


@pytest.fixture(scope="module")
def small(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("front2")
    write_h5(d / "small.h5", smooth((40, 64, 64)))
    return d


# --- 13 and 16 (exit 2's promise): a run that fails mid-way on a corrupt source chunk -----------


@pytest.fixture(scope="module")
def corrupt_run(tmp_path_factory):
    """64 planes in 8 HDF5 chunks of 8, the last one corrupt; 8 slabs of 8 planes, one worker:
    the first slabs are written and recorded before the last one fails."""
    d = tmp_path_factory.mktemp("corrupt")
    h5 = write_h5(d / "in.h5", smooth((64, 64, 64)), chunks=(8, 64, 64), compression="gzip", fletcher32=True)
    with h5py.File(h5, "r") as f:
        offset = f["/volume/data"].id.get_chunk_info(7).byte_offset
    with open(h5, "r+b") as f:
        f.seek(offset + 20)
        f.write(b"\xde\xad\xbe\xef" * 8)
    out = d / "out.ome.zarr"
    proc = h5ngff(
        "convert",
        f"{h5}:/volume/data",
        out,
        "--json",
        "--workers",
        "1",
        "--chunks",
        "8,64,64",
        "--slab",
        "8,64,64",
        "--levels",
        "1",
    )
    return out, proc


def _manifest_slabs(out: Path) -> int:
    with open(out / MANIFEST_DIR / MANIFEST_FILE) as f:
        return sum(1 for line in f if line.strip() and json.loads(line).get("kind") == "slab")


@pytest.mark.slow
def test_a_failed_runs_json_counts_the_slabs_it_wrote(corrupt_run):
    """Item 13: slabs_written was 0 on every failed run, whatever the manifest held."""
    out, proc = corrupt_run
    no_traceback(proc)
    summary = json.loads(proc.stdout)
    assert summary["status"] == "Failed" and summary["reason"] == "SourceUnreadable", summary
    recorded = _manifest_slabs(out)
    assert recorded >= 1, "the corrupt chunk is the last one: earlier slabs are written first"
    assert summary["slabs_written"] == recorded and summary["slabs_skipped"] == 0, (summary["slabs_written"], recorded)
    assert summary["bytes_read"] > 0 and summary["bytes_written"] > 0


@pytest.mark.slow
def test_exit_2_only_where_nothing_was_written(corrupt_run, small, tmp_path):
    """Item 16: exit 2 promises 'nothing was written'; a source that fails after slabs were
    written is a failed run (exit 1), its partial output resumable."""
    from h5ngff.errors import ExitCode

    out, proc = corrupt_run
    assert any(out.rglob("*")), "the run wrote files"
    assert proc.returncode == ExitCode.FAILED, (proc.returncode, proc.stderr[-2000:])
    assert "nothing was written" in ExitCode.BAD_INPUT.meaning
    # control: bad input found before anything is written keeps exit 2 and writes nothing
    missing = h5ngff("convert", f"{small / 'small.h5'}:/missing", tmp_path / "o.ome.zarr")
    assert missing.returncode == ExitCode.BAD_INPUT and not (tmp_path / "o.ome.zarr").exists()


# --- 15. sample and demo check their inputs as convert does ---------------------------------------


BAD_SAMPLE = [
    (["--shape", "10"], "--shape"),
    (["--shape", "0,10,10"], "--shape"),
    (["--shape", "2,2,2,2,2,2"], "--shape"),
    (["--shape", "4,x,8"], "--shape"),
    (["--dtype", "uint17"], "--dtype"),
    (["--dtype", "complex64"], "--dtype"),
    (["--shape", "4,8,8", "--hdf5-chunks", "2,4"], "--hdf5-chunks"),
]


@pytest.mark.slow
@pytest.mark.parametrize("flags,field", BAD_SAMPLE, ids=[" ".join(f) for f, _ in BAD_SAMPLE])
def test_sample_refuses_bad_inputs_with_exit_2_and_leaves_no_file(tmp_path, flags, field):
    proc = h5ngff("sample", tmp_path / "s.h5", *flags)
    no_traceback(proc)
    assert proc.returncode == 2, (proc.returncode, proc.stderr)
    assert field in proc.stderr and "Expected" in proc.stderr and "Got " in proc.stderr and "instead" in proc.stderr, (
        proc.stderr
    )
    assert os.listdir(tmp_path) == [], os.listdir(tmp_path)


@pytest.mark.slow
def test_sample_refuses_to_replace_an_existing_file_without_force(tmp_path):
    """It replaced a file holding anything (twelve datasets once) with its one sample, silently."""
    path = tmp_path / "precious.h5"
    with h5py.File(path, "w") as f:
        f["/mine"] = np.arange(10)
    before = path.read_bytes()
    proc = h5ngff("sample", path, "--shape", "4,8,8")
    no_traceback(proc)
    assert proc.returncode == 3 and "exists" in proc.stderr and "--force" in proc.stderr, proc.stderr
    assert path.read_bytes() == before
    forced = h5ngff("sample", path, "--shape", "4,8,8", "--force")  # the control: asked to, it replaces it
    assert forced.returncode == 0, forced.stderr
    with h5py.File(path, "r") as f:
        assert "/mine" not in f and f["/volume/data"].shape == (4, 8, 8)
    directory = tmp_path / "a-directory"
    directory.mkdir()
    for flags in ([], ["--force"]):  # a directory is never replaced
        refused = h5ngff("sample", directory, "--shape", "4,8,8", *flags)
        no_traceback(refused)
        assert refused.returncode == 3 and "is a directory" in refused.stderr, refused.stderr
    gzipped = h5ngff("sample", tmp_path / "g.h5", "--shape", "4,8,8", "--gzip")  # h5py chooses the chunks
    assert gzipped.returncode == 0, gzipped.stderr
    with h5py.File(tmp_path / "g.h5", "r") as f:
        assert f["/volume/data"].compression == "gzip" and f["/volume/data"].chunks is not None


@pytest.mark.slow
@pytest.mark.parametrize("shape", ["10", "0,10,10", "1,1,1,1,1,1"])
def test_demo_refuses_a_bad_shape_with_exit_2_and_writes_nothing(tmp_path, shape):
    proc = h5ngff("demo", tmp_path / "demo", "--shape", shape)
    no_traceback(proc)
    assert proc.returncode == 2 and "--shape" in proc.stderr and "Expected" in proc.stderr, proc.stderr
    assert not (tmp_path / "demo").exists()


def test_sample_never_leaves_a_partial_file(tmp_path):
    """A write that fails half-way (here: interrupted after its first block) leaves nothing, and
    an existing file at the path stays as it was."""
    from h5ngff.sample import write_sample

    def interrupt(done, total):
        raise KeyboardInterrupt

    path = tmp_path / "s.h5"
    with pytest.raises(KeyboardInterrupt):
        write_sample(str(path), shape=(32, 16, 16), dtype="uint16", progress=interrupt)
    assert os.listdir(tmp_path) == []
    write_sample(str(path), shape=(4, 16, 16), dtype="uint16")
    with pytest.raises(KeyboardInterrupt):
        write_sample(str(path), shape=(32, 16, 16), dtype="uint16", progress=interrupt)
    assert os.listdir(tmp_path) == ["s.h5"]
    with h5py.File(path, "r") as f:
        assert f["/volume/data"].shape == (4, 16, 16)


# --- 16. front-door details ---------------------------------------------------------------------


@pytest.mark.slow
def test_notices_go_to_stderr_and_the_tables_to_stdout(tmp_path):
    h5 = tmp_path / "z40.h5"
    with h5py.File(h5, "w") as f:
        f.create_dataset("/volume/data", shape=(40, 256, 256), dtype="u1")  # metadata only
    proc = h5ngff("plan", f"{h5}:/volume/data", "--chunks", "64,64,64")
    assert proc.returncode == 0, proc.stderr
    assert "Passes" in proc.stdout and "notice:" not in proc.stdout, proc.stdout
    assert "notice: output.chunks" in proc.stderr, proc.stderr


@pytest.mark.slow
def test_tables_in_a_pipe_fit_100_columns_and_keep_every_figure(small):
    """Issue 42: a pipe got 1000-column tables (200 wide in practice); 100 columns now, with the
    explanations wrapped in their column and no figure cut (rich's default 80 cut them)."""
    proc = h5ngff("plan", f"{small / 'small.h5'}:/volume/data")
    assert proc.returncode == 0, proc.stderr
    assert max(len(line) for line in proc.stdout.splitlines()) <= 100, proc.stdout
    pod = [line for line in proc.stdout.splitlines() if line.lstrip().startswith("pod limit")]
    assert len(pod) == 1 and "(Guaranteed" in pod[0], proc.stdout
    assert any(c.isdigit() for c in pod[0].split("│")[1]), pod[0]  # the MiB figure
    assert "QoS)" in proc.stdout  # the explanation's end, wrapped onto the next line, not cut


@pytest.mark.slow
def test_ngff_04_output_opens_in_zarr_and_ome_zarr_without_warnings(small, tmp_path):
    import zarr
    from ome_zarr.format import FormatV04
    from ome_zarr.io import parse_url
    from ome_zarr.reader import Reader

    from h5ngff.engine.verify.check import verify_output

    out = tmp_path / "v04.ome.zarr"
    proc = h5ngff(
        "convert",
        f"{small / 'small.h5'}:/volume/data",
        out,
        "--ngff-version",
        "0.4",
        "--levels",
        "2",
        "--workers",
        "1",
        "--no-progress",
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        group = zarr.open_group(str(out), mode="r")
        assert sorted(dict(group.members(max_depth=None))) == ["0", "1"]
        assert "1 (20, 32, 32)" in str(group.tree())
        nodes = list(Reader(parse_url(str(out), fmt=FormatV04()))())
        assert nodes[0].data[0].shape == (40, 64, 64)
    report = verify_output(str(out))
    assert report.ok and report.checksums == "sidecar", report.problems


@pytest.mark.slow
def test_an_output_with_the_old_sidecar_place_still_verifies(small, tmp_path):
    """Outputs written before the sidecar moved into 0/ keep it at OUT/.h5ngff-checksums/."""
    from h5ngff.engine.write.checksums import LEGACY_SIDECAR_DIR, SIDECAR_DIR
    from h5ngff.engine.verify.check import verify_output

    out = tmp_path / "old.ome.zarr"
    proc = h5ngff(
        "convert",
        f"{small / 'small.h5'}:/volume/data",
        out,
        "--ngff-version",
        "0.4",
        "--levels",
        "1",
        "--workers",
        "1",
        "--no-progress",
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    if (out / SIDECAR_DIR).exists():
        shutil.move(out / SIDECAR_DIR, out / LEGACY_SIDECAR_DIR)
    assert verify_output(str(out)).checksums == "sidecar" and verify_output(str(out)).ok
    chunk = next(
        p for p in (out / "0").rglob("*") if p.is_file() and not p.name.startswith(".") and ".h5ngff" not in str(p)
    )
    data = bytearray(chunk.read_bytes())
    data[-1] ^= 1
    chunk.write_bytes(bytes(data))
    assert not verify_output(str(out)).ok  # the old sidecar is really read


@pytest.mark.slow
def test_a_busy_output_is_refused_before_the_plan_is_printed(small, tmp_path):
    out = tmp_path / "busy.ome.zarr"
    out.mkdir()
    fd = os.open(out / ".h5ngff.lock", os.O_RDWR | os.O_CREAT)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        os.write(
            fd,
            json.dumps(
                {"pid": os.getpid(), "host": socket.gethostname(), "started": time.time(), "command": "the test"}
            ).encode(),
        )
        proc = h5ngff("convert", f"{small / 'small.h5'}:/volume/data", out, "--no-progress")
    finally:
        os.close(fd)
    no_traceback(proc)
    assert proc.returncode == 3 and "OutputBusy" in proc.stderr and str(os.getpid()) in proc.stderr, proc.stderr
    assert "Passes" not in proc.stdout and "pod limit" not in proc.stdout, proc.stdout
    assert os.listdir(out) == [".h5ngff.lock"]


@pytest.mark.slow
@pytest.mark.parametrize(
    "flag,field", [("--chunks", "output.chunks"), ("--shards", "output.shards"), ("--slab", "resources.slab")]
)
def test_a_negative_list_value_gets_the_specs_message_not_argparses(small, flag, field):
    proc = h5ngff("plan", f"{small / 'small.h5'}:/volume/data", flag, "-1,64,64")
    no_traceback(proc)
    assert proc.returncode == 2, proc.stderr
    assert "expected one argument" not in proc.stderr and field in proc.stderr and "-1" in proc.stderr, proc.stderr


@pytest.mark.slow
def test_a_mistyped_command_gets_the_closest_and_runner_stays_hidden():
    proc = h5ngff("conver", "in.h5:/data", "out.zarr")
    assert proc.returncode == 2 and "did you mean convert?" in proc.stderr, proc.stderr
    assert "runner" not in proc.stderr and "verify" in proc.stderr, proc.stderr
    helped = h5ngff("--help")
    assert "runner" not in helped.stdout
    assert h5ngff("runner", "--help").returncode == 0  # still there for the runner Job


@pytest.mark.slow
def test_a_memory_budget_beyond_this_machine_is_noticed(small):
    from h5ngff.backends.base import machine_capacity

    too_much = h5ngff("plan", f"{small / 'small.h5'}:/volume/data", "--memory-per-worker", "10TiB", "--workers", "2")
    assert too_much.returncode == 0, too_much.stderr
    assert "resources.memoryPerWorker" in too_much.stderr and "more than this machine's" in too_much.stderr, (
        too_much.stderr
    )
    as_json = json.loads(
        h5ngff("plan", f"{small / 'small.h5'}:/volume/data", "--memory-total", "10TiB", "--json").stdout
    )
    assert any("resources.memoryTotal" in n and "more than this machine's" in n for n in as_json["notices"]), as_json[
        "notices"
    ]
    fits = h5ngff(
        "plan",
        f"{small / 'small.h5'}:/volume/data",
        "--memory-per-worker",
        f"{machine_capacity().memory_bytes // 4 // 2**20}MiB",
        "--workers",
        "2",
    )
    assert fits.returncode == 0 and "more than this machine's" not in fits.stderr, fits.stderr  # control
