"""One writer per output path on a workstation (engine/write/lock.py): real concurrent ``h5ngff convert``
processes on one path, a real ``--overwrite`` against a held output, a real SIGKILL. Each refusal
has a negative control: the same second writer with the lock made a no-op does the damage."""

from __future__ import annotations

import fcntl
import json
import os
import signal
import subprocess
import sys
import time

from pathlib import Path

import psutil
import pytest

from conftest import smooth, write_h5
from h5ngff.engine.write.lock import LOCK_NAME
from h5ngff.engine.verify.check import verify_output
from h5ngff.errors import ExitCode
from test_engine_resume import chunk_files, manifest_lines

pytestmark = [pytest.mark.integration, pytest.mark.slow]

CLI = [sys.executable, "-m", "h5ngff.cli"]
FLAGS = ["--chunks", "8,32,32", "--levels", "2", "--slab", "16,64,256", "--workers", "1", "--no-progress"]
#: The second writer, with the lock replaced by a no-op: the negative control of every refusal.
UNLOCKED = [
    sys.executable,
    "-c",
    "import sys, contextlib, h5ngff.runner as r; from h5ngff.engine.write.lock import Held; "
    "r.output_lock = lambda *args: contextlib.nullcontext(Held()); r.refuse_if_held = lambda *args: None; "
    "from h5ngff.cli import main; sys.exit(main(sys.argv[1:]))",
]


JOB = """apiVersion: h5ngff.dev/v1alpha1
kind: ConversionJob
metadata: {{name: same-output}}
spec:
  source: {{path: {h5}, dataset: /volume/data}}
  output: {{path: {out}, chunks: [8, 32, 32]}}
  pyramid: {{levels: 2}}
  resources: {{workers: 1}}
"""


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    base = tmp_path_factory.mktemp("lock")
    h5 = write_h5(base / "in.h5", smooth((48, 256, 512), "uint16", seed=4))  # 24 slabs
    return h5, f"{h5}:/volume/data"


def _start_slow(src: str, out: str, sleep: float = 0.4, gate: Path | None = None) -> subprocess.Popen:
    """A first writer that takes a while (each slab sleeps), returned once it has written slabs.
    With ``gate``, its later slabs wait until the caller deletes that file (created here)."""
    faults = f"slab_sleep={sleep}" + (f",slab_gate={gate}" if gate else "")
    env = {**os.environ, "H5NGFF_FAULTS": faults}
    proc = subprocess.Popen(
        CLI + ["convert", src, out] + FLAGS,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        start_new_session=True,
    )
    deadline = time.monotonic() + 180
    while manifest_lines(out) < 2:
        assert proc.poll() is None, proc.stderr.read().decode()
        assert time.monotonic() < deadline, "the first writer never started writing"
        time.sleep(0.05)
    if gate is not None:
        gate.touch()
    return proc


def _header(out: str) -> dict:
    with open(os.path.join(out, ".h5ngff", "manifest.jsonl")) as f:
        return json.loads(f.readline())


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def _holders(pid: int, lock_file: str) -> list[int]:
    """The driver and every descendant (Dask nanny, workers) that has the lock file open."""
    procs = [psutil.Process(pid)] + psutil.Process(pid).children(recursive=True)
    return [p.pid for p in procs if any(f.path == lock_file for f in p.open_files())]


def test_a_second_convert_and_an_overwrite_are_refused_while_the_first_runs(source, tmp_path):
    h5, src = source
    out = str(tmp_path / "out.ome.zarr")
    job = tmp_path / "job.yaml"
    job.write_text(JOB.format(h5=h5, out=out))
    gate = tmp_path / "gate"
    first = _start_slow(src, out, sleep=0.1, gate=gate)  # held mid-run until the gate is deleted
    try:
        lock_file = os.path.join(out, LOCK_NAME)
        assert _holders(first.pid, lock_file) == [first.pid]  # the driver only, never a worker
        header, written = _header(out), set(chunk_files(out))
        second = subprocess.run(CLI + ["convert", src, out] + FLAGS, capture_output=True, text=True)
        assert second.returncode == ExitCode.OUTPUT_REFUSED, second.stdout + second.stderr
        assert "OutputBusy" in second.stderr and f"pid {first.pid}" in second.stderr.replace(
            "\n", " "
        )  # errors go to stderr
        overwrite = subprocess.run(
            CLI + ["convert", src, out, "--overwrite", "--json"] + FLAGS, capture_output=True, text=True
        )
        assert (
            overwrite.returncode == ExitCode.OUTPUT_REFUSED and json.loads(overwrite.stdout)["reason"] == "OutputBusy"
        )
        # Nothing was deleted: the first run's manifest and every file it had written are still there.
        assert _header(out) == header and written <= set(chunk_files(out))
        assert first.poll() is None  # checked while the first was still writing
        run = subprocess.run(CLI + ["run", str(job), "--json", "--no-progress"], capture_output=True, text=True)
        assert (
            run.returncode == ExitCode.OUTPUT_REFUSED and json.loads(run.stdout)["status"]["reason"] == "OutputBusy"
        ), run.stdout + run.stderr
        assert first.poll() is None  # all three were refused while the first was still writing
        gate.unlink()
        assert first.wait(timeout=300) == 0, first.stderr.read().decode()
    finally:
        _stop(first)
    assert not os.path.exists(lock_file)  # released and removed: a plain OME-Zarr
    assert verify_output(out, (h5, "/volume/data")).ok
    # Once the first run has finished the path is free again (it is complete: nothing to do).
    assert subprocess.run(CLI + ["convert", src, out] + FLAGS, capture_output=True).returncode == 0


def test_negative_control_without_the_lock_overwrite_deletes_the_running_output(source, tmp_path):
    """The same --overwrite with the lock made a no-op is not refused and deletes the output the
    first run is writing: its manifest (and with it the record of its finished slabs) is replaced."""
    _, src = source
    out = str(tmp_path / "out.ome.zarr")
    first = _start_slow(src, out)
    try:
        header = _header(out)
        second = subprocess.Popen(
            UNLOCKED + ["convert", src, out, "--overwrite"] + FLAGS,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
        try:
            deadline = time.monotonic() + 180
            while True:
                try:
                    if _header(out) != header:
                        break
                except (OSError, ValueError):
                    pass  # mid-delete
                assert time.monotonic() < deadline, "the unlocked second writer never replaced the output"
                time.sleep(0.05)
            assert first.poll() is None  # deleted while the first run was still writing
        finally:
            _stop(second)
    finally:
        _stop(first)


def _slabs_written_twice(out: str) -> int:
    """Slabs the manifest records more than once: each record is a writer that wrote its chunks."""
    try:
        with open(os.path.join(out, ".h5ngff", "manifest.jsonl")) as f:
            keys = [tuple(json.loads(line)["slab"]) + (json.loads(line)["pass"],) for line in f if '"slab"' in line]
    except (OSError, ValueError):
        return 0
    return len(keys) - len(set(keys))


def test_negative_control_without_the_lock_a_second_convert_runs_beside_the_first(source, tmp_path):
    """With the lock a no-op the second convert is not refused: it resumes the output the first is
    still writing. Then either both write the same slabs (the manifest records them twice), or one
    breaks the other (the resume sweeps the first's in-flight temporary chunk files, so its rename
    fails): two writers on one output, which the lock exists to prevent."""
    _, src = source
    out = str(tmp_path / "out.ome.zarr")
    first = _start_slow(src, out, sleep=2.5)  # ~60 s: the second has time to start beside it
    env = {**os.environ, "H5NGFF_FAULTS": "slab_sleep=0.2"}
    second = subprocess.Popen(
        UNLOCKED + ["convert", src, out] + FLAGS,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 240
        harm = None
        while harm is None:
            if _slabs_written_twice(out):
                harm = "the same slab written by both"
            elif first.poll() not in (None, 0):
                harm = "the first run failed"
            elif second.poll() not in (None, 0):
                output = second.stdout.read()
                assert "OutputBusy" not in output
                harm = "the second run failed: " + output[-300:]
            assert not (first.poll() == 0 and second.poll() == 0) or harm, "both finished without meeting"
            assert time.monotonic() < deadline, "the unlocked second writer never met the first"
            time.sleep(0.1)
    finally:
        _stop(second)
        _stop(first)


def test_a_stale_lock_from_a_sigkilled_run_does_not_block_the_resume(source, tmp_path):
    h5, src = source
    out = str(tmp_path / "out.ome.zarr")
    first = _start_slow(src, out, sleep=0.2)
    _stop(first)  # SIGKILL to the whole process group: no cleanup ran
    lock_file = os.path.join(out, LOCK_NAME)
    with open(lock_file) as f:
        assert json.load(f)["pid"] == first.pid  # the stale lock file is there, naming the dead run
    # Positive control: the same file held by a live process does block.
    with open(lock_file, "r+") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        blocked = subprocess.run(CLI + ["convert", src, out] + FLAGS, capture_output=True, text=True)
        assert blocked.returncode == ExitCode.OUTPUT_REFUSED and "OutputBusy" in blocked.stderr
    resumed = subprocess.run(CLI + ["convert", src, out, "--json"] + FLAGS, capture_output=True, text=True)
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    summary = json.loads(resumed.stdout)
    assert summary["resumed"] and summary["slabs_skipped"] >= 2
    assert not os.path.exists(lock_file)
    assert verify_output(out, (h5, "/volume/data")).ok
