"""Bad inputs give clear, specific errors and never leave an output that looks finished."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time

import h5py
import numpy as np
import pytest

from conftest import smooth, spec_for, write_h5
from h5ngff.engine.write.output import completion_marker
from h5ngff.errors import (
    DatasetNotFoundError,
    OutputError,
    SourceError,
    SourceNotFoundError,
    UnsupportedDatasetError,
)

pytestmark = pytest.mark.integration


def assert_not_finished(out: str) -> None:
    assert completion_marker(out) is None
    zarr_json = os.path.join(out, "zarr.json")
    if os.path.exists(zarr_json):
        with open(zarr_json) as f:
            assert "ome" not in json.load(f).get("attributes", {})


@pytest.mark.slow
def test_missing_file(tmp_path, convert):
    with pytest.raises(SourceNotFoundError, match=r"source.path: HDF5 file .*nope.h5.* does not exist"):
        convert(spec_for(str(tmp_path / "nope.h5"), str(tmp_path / "out.zarr")))
    assert not (tmp_path / "out.zarr").exists()


def test_missing_dataset_lists_the_ones_that_exist(tmp_path, convert):
    h5 = write_h5(tmp_path / "in.h5", smooth((4, 8, 8)), dataset="/entry/data")
    with pytest.raises(DatasetNotFoundError, match=r"'/volume/data' is not in .*Datasets in the file: /entry/data"):
        convert(spec_for(h5, str(tmp_path / "out.zarr")))


def test_group_instead_of_dataset(tmp_path, convert):
    h5 = write_h5(tmp_path / "in.h5", smooth((4, 8, 8)), dataset="/entry/data")
    with pytest.raises(DatasetNotFoundError, match="is a group, not a dataset"):
        convert(spec_for(h5, str(tmp_path / "out.zarr"), dataset="/entry"))


@pytest.mark.parametrize(
    "data,kind",
    [
        (np.zeros((4, 4), dtype=[("a", "i4"), ("b", "f8")]), "compound"),
        (np.array([[b"ab", b"cd"], [b"ef", b"gh"]]), "bytes string"),
        (np.zeros((4, 4), dtype=np.complex64), "complex"),
    ],
    ids=["compound", "string", "complex"],
)
def test_non_numeric_dataset(tmp_path, convert, data, kind):
    h5 = write_h5(tmp_path / "in.h5", data)
    with pytest.raises(UnsupportedDatasetError, match=f"dtype .*\\({kind}\\).*Expected bool, int8-int64"):
        convert(spec_for(h5, str(tmp_path / "out.zarr")))


def test_variable_length_strings(tmp_path, convert):
    path = tmp_path / "in.h5"
    with h5py.File(path, "w") as f:
        f.create_dataset(
            "/volume/data", data=np.array([["a", "bb"], ["c", "d"]], dtype=object), dtype=h5py.string_dtype()
        )
    with pytest.raises(UnsupportedDatasetError, match="NGFF images hold numbers"):
        convert(spec_for(str(path), str(tmp_path / "out.zarr")))


def test_one_dimensional_dataset(tmp_path, convert):
    h5 = write_h5(tmp_path / "in.h5", np.arange(100, dtype=np.uint8))
    with pytest.raises(
        UnsupportedDatasetError, match=r"has 1 dimension\(s\) \(shape \(100,\)\); NGFF images have 2 to 5"
    ):
        convert(spec_for(h5, str(tmp_path / "out.zarr")))


def test_zero_sized_dimension(tmp_path, convert):
    h5 = write_h5(tmp_path / "in.h5", np.zeros((0, 8, 8), dtype=np.uint8))
    with pytest.raises(UnsupportedDatasetError, match=r"at least one element. Got shape \(0, 8, 8\)"):
        convert(spec_for(h5, str(tmp_path / "out.zarr")))


def test_truncated_file(tmp_path, convert):
    h5 = write_h5(tmp_path / "in.h5", smooth((16, 64, 64)))
    size = os.path.getsize(h5)
    with open(h5, "r+b") as f:
        f.truncate(size // 3)
    with pytest.raises(SourceError, match="truncated|corrupt|cannot be opened"):
        convert(spec_for(h5, str(tmp_path / "out.zarr")))
    assert_not_finished(str(tmp_path / "out.zarr"))


@pytest.mark.slow
def test_corrupt_chunk_fails_the_run_without_a_finished_output(tmp_path, convert):
    data = smooth((16, 64, 64))
    h5 = write_h5(tmp_path / "in.h5", data, chunks=(8, 32, 32), compression="gzip", fletcher32=True)
    with h5py.File(h5, "r") as f:
        offset = f["/volume/data"].id.get_chunk_info(3).byte_offset
    with open(h5, "r+b") as f:
        f.seek(offset + 20)
        f.write(b"\xde\xad\xbe\xef" * 8)
    out = str(tmp_path / "out.zarr")
    with pytest.raises(SourceError, match="Reading '/volume/data'.*failed"):
        convert(spec_for(h5, out, output={"chunks": [8, 32, 32]}, pyramid={"levels": 1}))
    assert_not_finished(out)


def test_unwritable_output(tmp_path, convert):
    h5 = write_h5(tmp_path / "in.h5", smooth((4, 8, 8)))
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    with pytest.raises(OutputError, match="output.path: cannot create .*Choose a writable location"):
        convert(spec_for(h5, str(blocker / "out.zarr")))


@pytest.mark.slow
def test_cli_exit_codes_and_messages(tmp_path):
    """Through the real command line: exit 2 for bad input; the reason and the message on stderr
    (stdout only carries --json's document)."""
    h5 = write_h5(tmp_path / "in.h5", smooth((4, 8, 8)))
    cli = [sys.executable, "-m", "h5ngff.cli"]
    bad_dataset = subprocess.run(
        cli + ["convert", f"{h5}:/missing", str(tmp_path / "o.zarr")], capture_output=True, text=True
    )
    assert bad_dataset.returncode == 2
    assert "SourceUnreadable" in bad_dataset.stderr and "/volume/data" in bad_dataset.stderr and not bad_dataset.stdout
    bad_flag = subprocess.run(
        cli + ["plan", f"{h5}:/volume/data", "--chunks", "0,8,8", "--json"], capture_output=True, text=True
    )
    assert bad_flag.returncode == 2
    assert json.loads(bad_flag.stdout) == {
        "status": "Failed",
        "reason": "InvalidSpec",
        "message": json.loads(bad_flag.stdout)["message"],
    }
    assert "output.chunks" in bad_flag.stdout and "0 is not allowed" in bad_flag.stdout


def _as_an_unprivileged_user() -> list[str]:
    """A command prefix under which file modes bind: root's DAC override dropped (CI runs as root)."""
    if os.geteuid() != 0:
        return []
    caps = "-dac_override,-dac_read_search,-fowner"
    assert shutil.which("setpriv"), "setpriv (util-linux) drops root's DAC override for this test"
    return ["setpriv", f"--bounding-set={caps}", f"--inh-caps={caps}"]


@pytest.mark.slow
def test_a_read_only_output_is_refused_with_exit_3_before_the_plan(tmp_path):
    """A finished output the user may not write: exit 3 and a message saying what to change, with
    nothing on stdout (no plan printed), instead of a PermissionError traceback from the lock
    file. Control: the same command once the output is writable again finishes (exit 0)."""
    h5 = write_h5(tmp_path / "in.h5", smooth((4, 8, 8)))
    out = tmp_path / "out.ome.zarr"
    cli = [sys.executable, "-m", "h5ngff.cli", "convert", f"{h5}:/volume/data", str(out), "--workers", "1"]
    subprocess.run(cli, check=True, capture_output=True)
    modes = {p: p.stat().st_mode for p in [out, *out.rglob("*")] if p.is_dir()}
    for path in modes:
        path.chmod(0o555)
    try:
        refused = subprocess.run(_as_an_unprivileged_user() + cli, capture_output=True, text=True)
        locked = subprocess.run(
            _as_an_unprivileged_user()
            + [
                sys.executable,
                "-c",
                f"from h5ngff.engine.write.lock import output_lock\nwith output_lock({str(out)!r}): pass",
            ],
            capture_output=True,
            text=True,
        )
    finally:
        for path, mode in modes.items():
            path.chmod(mode)
    assert refused.returncode == 3, refused.stderr
    assert "is not writable" in refused.stderr and "h5ngff verify" in refused.stderr
    assert "Traceback" not in refused.stderr and not refused.stdout.strip()
    assert "OutputError: output.path: cannot create its lock file" in locked.stderr  # the lock's own refusal
    assert "PermissionError" not in locked.stderr
    again = subprocess.run(_as_an_unprivileged_user() + cli, capture_output=True, text=True)
    assert again.returncode == 0, again.stderr


@pytest.mark.parametrize(
    "address, why",
    [
        ("notanaddress", "missing port number"),
        ("tcp://localhost", "missing port number"),
        ("http://127.0.0.1:8786", "unknown address scheme 'http'"),
    ],
)
def test_a_scheduler_address_dask_cannot_parse_is_bad_input_at_once(tmp_path, address, why):
    """Dask's client fails on these inside its connection attempt: a traceback, exit 1, and then a
    60 s wait in its finaliser. Now exit 2 before anything is planned or started."""
    h5 = write_h5(tmp_path / "in.h5", smooth((4, 8, 8)))
    started = time.monotonic()
    result = subprocess.run(
        [sys.executable, "-m", "h5ngff.cli", "convert", f"{h5}:/volume/data", str(tmp_path / "o.zarr")]
        + ["--scheduler", address],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2, result.stderr
    assert f"--scheduler: {address!r} is not a Dask scheduler address ({why}" in result.stderr
    assert "Traceback" not in result.stderr and time.monotonic() - started < 30
    assert not (tmp_path / "o.zarr").exists()


def test_addresses_dask_accepts_are_accepted():
    from h5ngff.backends.external import check_address

    for address in (
        "tcp://10.0.0.5:8786",
        "127.0.0.1:8786",
        "scheduler.lab.example:8786",
        "tls://host:8786",
        "ws://host:8786",
        "tcp://[::1]:8786",
        "inproc://x/1/2",
        "ucx://host:13337",
    ):
        assert check_address(address) == address


@pytest.mark.slow
def test_a_memory_report_path_that_cannot_be_written_is_refused_before_the_run(tmp_path):
    """The report is written after the conversion: a bad path was a traceback and exit 1 after a
    finished conversion (.txt, a path under a file), or a report at another name (a directory
    gave DIR.png). Now exit 2 before anything is written."""
    h5 = write_h5(tmp_path / "in.h5", smooth((4, 8, 8)))
    a_file = tmp_path / "a-file"
    a_file.write_text("x")
    a_dir = tmp_path / "a-dir"
    a_dir.mkdir()
    cases = {
        "rep.txt": "Expected an .html page or an image file name",
        str(a_dir): "which is a directory",
        str(a_file / "x.png"): "is a file, not a directory",
    }
    for report, message in cases.items():
        out = tmp_path / "o.ome.zarr"
        result = subprocess.run(
            [sys.executable, "-m", "h5ngff.cli", "convert", f"{h5}:/volume/data", str(out), "--memory-report", report],
            capture_output=True,
            text=True,
        )
        assert result.returncode == 2, (report, result.stderr)
        assert "--memory-report" in result.stderr and message in result.stderr and "Traceback" not in result.stderr
        assert not out.exists()


@pytest.mark.parametrize("where", ["a file", "under a file"])
def test_demo_into_a_path_it_cannot_use_is_an_output_error(tmp_path, where):
    a_file = tmp_path / "a-file"
    a_file.write_text("x")
    directory = a_file if where == "a file" else a_file / "demo"
    result = subprocess.run(
        [sys.executable, "-m", "h5ngff.cli", "demo", str(directory), "--shape", "4,16,16"],
        capture_output=True,
        text=True,
    )
    assert result.returncode == 3, result.stderr
    assert "cannot use" in result.stderr and "Choose a writable directory" in result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.slow
def test_a_directory_or_an_unreadable_file_gets_its_own_hint_not_the_corrupt_file_one(tmp_path):
    """h5py's message buried the errno (21, 13) in its text, and the hint asked whether the file
    was corrupt. Control: a truncated file still gets that hint."""
    directory = tmp_path / "adir.h5"
    directory.mkdir()
    locked = write_h5(tmp_path / "locked.h5", smooth((4, 8, 8)))
    os.chmod(locked, 0)
    truncated = tmp_path / "truncated.h5"
    truncated.write_bytes(open(write_h5(tmp_path / "whole.h5", smooth((4, 8, 8))), "rb").read()[:300])
    cli = _as_an_unprivileged_user() + [sys.executable, "-m", "h5ngff.cli", "plan"]
    expected = {
        directory: "is a directory, not an HDF5 file",
        locked: "cannot be read (permission denied)",
        truncated: "Is it a complete, uncorrupted HDF5 file?",
    }
    try:
        for path, message in expected.items():
            result = subprocess.run(cli + [f"{path}:/volume/data"], capture_output=True, text=True)
            assert result.returncode == 2 and message in result.stderr, (path, result.stderr)
            assert ("uncorrupted" in result.stderr) == (path == truncated), result.stderr
    finally:
        os.chmod(locked, 0o644)


def test_a_dangling_soft_or_external_link_is_named_as_a_link(tmp_path):
    """It was "'/ext' is not in 'links.h5'", though the file lists it. Control: a name that is
    not in the file at all still says so, with the datasets that are."""
    from h5ngff.engine.sources.hdf5 import inspect_source
    from h5ngff.errors import DatasetNotFoundError

    path = str(tmp_path / "links.h5")
    with h5py.File(path, "w") as f:
        f["real"] = np.zeros((4, 8, 8), "u2")
        f["soft"] = h5py.SoftLink("/gone")
        f["ext"] = h5py.ExternalLink(str(tmp_path / "missing.h5"), "/data")
    with pytest.raises(DatasetNotFoundError, match="'/soft' in .* is a soft link to '/gone', which is not in the file"):
        inspect_source(path, "/soft")
    with pytest.raises(DatasetNotFoundError, match="'/ext' in .* is an external link to '/data' in .*missing.h5"):
        inspect_source(path, "/ext")
    with pytest.raises(DatasetNotFoundError, match="'/nothing' is not in .*Datasets in the file: /real"):
        inspect_source(path, "/nothing")
