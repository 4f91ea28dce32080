"""The front door (issue 17, items 1-15): every rough edge a new user hit, each pinned by a test
that failed before its fix. Real subprocesses on tiny generated files; no mocks."""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import h5py
import jsonschema
import psutil
import pytest
import yaml

from conftest import smooth, write_h5
from h5ngff import errors
from h5ngff.errors import ExitCode

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[1]
H5NGFF = [sys.executable, "-m", "h5ngff.cli"]
ENV = {**os.environ, "PYTHONPATH": str(ROOT / "src") + os.pathsep + os.environ.get("PYTHONPATH", "")}


def h5ngff(*argv, cwd=None, timeout=120, env=None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [*H5NGFF, *map(str, argv)], capture_output=True, text=True, timeout=timeout, cwd=cwd, env=env or ENV
    )


def no_traceback(proc: subprocess.CompletedProcess) -> None:
    for stream in (proc.stdout, proc.stderr):
        assert "Traceback" not in stream, stream[-3000:]


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    """small.h5:/volume/data (40, 64, 64) uint16, an empty group /empty, and a text file."""
    d = tmp_path_factory.mktemp("front")
    h5 = write_h5(d / "small.h5", smooth((40, 64, 64)))
    with h5py.File(h5, "a") as f:
        f.create_group("/empty")
    (d / "notes.txt").write_text("not an HDF5 file\n")
    return d


@pytest.fixture(scope="module")
def converted(small):
    """One real conversion of small.h5 through the CLI (its stdout is item 15's subject too)."""
    out = small / "small.ome.zarr"
    proc = h5ngff("convert", f"{small / 'small.h5'}:/volume/data", out, "--no-progress", "--levels", "2")
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out, proc


# --- 1. scripts/setup waits for the dpkg lock ------------------------------------------------


def _setup_copy(tmp_path: Path) -> Path:
    """scripts/setup in a tree whose venv already exists, so only its apt part does work."""
    (tmp_path / "scripts").mkdir()
    shutil.copy(ROOT / "scripts/setup", tmp_path / "scripts/setup")
    (tmp_path / ".venv/bin").mkdir(parents=True)
    os.symlink(sys.executable, tmp_path / ".venv/bin/python")
    (tmp_path / ".venv/.h5ngff-installed").touch()
    (tmp_path / "src").mkdir()
    return tmp_path / "scripts/setup"


DPKG_LOCK = "/var/lib/dpkg/lock-frontend"
needs_apt = pytest.mark.skipif(
    shutil.which("apt-get") is None or os.geteuid() != 0 or not os.path.exists(DPKG_LOCK),
    reason="needs apt-get, root and a dpkg lock file",
)


class DpkgLock:
    """Hold the dpkg frontend lock as apt and dpkg do: an fcntl (POSIX) lock, not flock(2),
    which apt would not see. Released on exit (and by the kernel if the test dies)."""

    def __init__(self):
        self.fd = os.open(DPKG_LOCK, os.O_RDWR)

    def __enter__(self):
        try:
            fcntl.lockf(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(self.fd)
            pytest.skip("another process holds the dpkg lock right now")
        return self

    def release(self):
        if self.fd >= 0:
            fcntl.lockf(self.fd, fcntl.LOCK_UN)
            os.close(self.fd)
            self.fd = -1

    def __exit__(self, *exc):
        self.release()


def _run_setup(script: Path, timeout_s: int) -> tuple[subprocess.CompletedProcess, float]:
    env = {**os.environ, "H5NGFF_APT_UPDATE": "1", "H5NGFF_APT_LOCK_TIMEOUT": str(timeout_s)}
    start = time.monotonic()
    proc = subprocess.run(["bash", str(script)], capture_output=True, text=True, timeout=180, env=env)
    if "setup: apt-get update failed" in proc.stderr:  # apt-get update takes no dpkg lock: the network failed
        pytest.skip(f"apt-get update cannot reach a package index here: {proc.stderr[-500:]}")
    return proc, time.monotonic() - start


@pytest.mark.slow
@needs_apt
def test_setup_gives_up_on_a_held_dpkg_lock_after_its_timeout_with_a_message(tmp_path):
    script = _setup_copy(tmp_path)
    with DpkgLock():
        proc, took = _run_setup(script, 3)
    assert proc.returncode != 0
    assert took >= 3, f"setup gave up after {took:.1f} s, without waiting for the lock"
    assert f"pid {os.getpid()}" in proc.stderr and "H5NGFF_APT_LOCK_TIMEOUT" in proc.stderr, proc.stderr


@pytest.mark.slow
@needs_apt
def test_setup_waits_for_a_dpkg_lock_that_is_released(tmp_path):
    script = _setup_copy(tmp_path)
    with DpkgLock() as lock:
        threading.Timer(2.0, lock.release).start()
        proc, took = _run_setup(script, 60)
    assert proc.returncode == 0, proc.stderr
    assert took >= 2 and "waiting" in proc.stderr, proc.stderr


# --- 2 and 15. verify's inputs ----------------------------------------------------------------


@pytest.mark.slow
def test_verify_source_that_is_not_hdf5_or_lacks_the_dataset(small, converted):
    out, _ = converted
    for source, words in (
        (f"{small / 'notes.txt'}:/x", "cannot be opened as HDF5"),
        (f"{small / 'small.h5'}:/nope", "Datasets in the file: /volume/data"),
    ):
        for json_flag in ([], ["--json"]):
            proc = h5ngff("verify", out, "--source", source, *json_flag)
            no_traceback(proc)
            assert proc.returncode == ExitCode.BAD_INPUT, proc.stderr
            assert words in (proc.stdout if json_flag else proc.stderr)
    good = h5ngff("verify", out, "--source", f"{small / 'small.h5'}:/volume/data")  # the positive control
    assert good.returncode == 0 and "equal to the pyramid computed from the source" in " ".join(good.stdout.split()), (
        good.stdout + good.stderr
    )


@pytest.mark.slow
def test_verify_a_missing_output_says_it_does_not_exist(small):
    proc = h5ngff("verify", small / "nothere.ome.zarr")
    assert proc.returncode == ExitCode.BAD_INPUT
    assert "does not exist" in proc.stderr and "not a Zarr group" not in proc.stderr + proc.stdout


# --- 3. a binary file given as a manifest -----------------------------------------------------


@pytest.mark.slow
def test_run_with_an_hdf5_file_instead_of_a_manifest(small):
    proc = h5ngff("run", small / "small.h5")
    no_traceback(proc)
    assert proc.returncode == ExitCode.BAD_INPUT
    assert "not a YAML" in proc.stderr and "h5ngff convert" in proc.stderr, proc.stderr
    folder = h5ngff("run", small)
    no_traceback(folder)
    assert folder.returncode == ExitCode.BAD_INPUT and "is a directory" in folder.stderr, folder.stderr


# --- 4. a real Ctrl-C ------------------------------------------------------------------------


SLOW_FLAGS = ["--chunks", "8,64,64", "--slab", "8,64,64", "--levels", "1", "--workers", "2", "--no-progress"]


def _start_slowed(argv: list[str]) -> subprocess.Popen:
    """``argv`` in a process group of its own, each slab sleeping a second."""
    return subprocess.Popen(
        argv,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**ENV, "H5NGFF_FAULTS": "slab_sleep=1"},
        start_new_session=True,
    )


def _ctrl_c_once_writing(argv: list[str], out: Path) -> tuple[int, str]:
    """Run ``argv`` (slabs slowed down) and, once a chunk file exists under ``out`` (the workers
    are running slab tasks), send SIGINT to its whole process group, as a terminal's Ctrl-C
    does. Its exit status and stderr."""
    proc = _start_slowed(argv)
    try:
        deadline = time.monotonic() + 60
        while not any(out.rglob("c/*")) and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.1)
        os.killpg(proc.pid, signal.SIGINT)
        _, stderr = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    return proc.returncode, stderr


@pytest.mark.slow
def test_ctrl_c_to_the_process_group_prints_one_line_not_tracebacks(small, tmp_path):
    out = tmp_path / "interrupted.ome.zarr"
    code, stderr = _ctrl_c_once_writing(
        [*H5NGFF, "convert", f"{small / 'small.h5'}:/volume/data", str(out), *SLOW_FLAGS], out / "0"
    )
    assert code == ExitCode.INTERRUPTED, stderr[-3000:]
    assert "interrupted: re-run the same command to resume" in stderr
    assert "Traceback" not in stderr and "CommClosedError" not in stderr and "KeyboardInterrupt" not in stderr, stderr[
        -3000:
    ]
    assert len(stderr.strip().splitlines()) <= 3, stderr


@pytest.mark.slow
def test_ctrl_c_to_a_batch_prints_one_line_not_tracebacks(small, tmp_path):
    """The items in flight end while the cluster closes under them: each one's release on the
    workers fails, and that was logged as a warning with two tracebacks per item."""
    inputs = tmp_path / "in"
    inputs.mkdir()
    for name in ("a", "b", "c"):
        shutil.copy(small / "small.h5", inputs / f"{name}.h5")
    out = tmp_path / "out"
    code, stderr = _ctrl_c_once_writing(
        [*H5NGFF, "convert", f"{inputs}/*.h5:/volume/data", f"{out}/{{stem}}.ome.zarr", *SLOW_FLAGS], out
    )
    assert code == ExitCode.INTERRUPTED, stderr[-3000:]
    assert "interrupted: re-run the same command to resume" in stderr
    assert "Traceback" not in stderr and "Could not release" not in stderr, stderr[-3000:]
    assert len(stderr.strip().splitlines()) <= 3, stderr


def _live_processes_of_group(pgid: int, wait_s: float) -> list[str]:
    """The processes of group ``pgid`` still running (exited ones not yet reaped by init do not
    count) once they have had ``wait_s`` to go: the fork server and the resource tracker exit
    when they see the command gone."""
    deadline = time.monotonic() + wait_s
    while True:
        live = [
            f"{p.pid} {' '.join(p.info['cmdline'] or [])[:120]}"
            for p in psutil.process_iter(["cmdline", "status"])
            if p.info["status"] != psutil.STATUS_ZOMBIE and _pgid(p.pid) == pgid
        ]
        if not live or time.monotonic() > deadline:
            return live
        time.sleep(0.2)


def _pgid(pid: int) -> int | None:
    try:
        return os.getpgid(pid)
    except ProcessLookupError:
        return None


@pytest.mark.slow
def test_sigterm_to_the_command_closes_the_run_like_ctrl_c_and_a_rerun_resumes(small, tmp_path):
    """kill, a deleted pod and scancel send SIGTERM to the command (not its group): one line, exit
    143, the cluster closed (no process of the run left), and the same command resumes. Before,
    SIGTERM's default ended the client at once: no message, the workers left to die on their own."""
    out = tmp_path / "terminated.ome.zarr"
    argv = [*H5NGFF, "convert", f"{small / 'small.h5'}:/volume/data", str(out), *SLOW_FLAGS]
    proc = _start_slowed(argv)
    manifest = out / ".h5ngff" / "manifest.jsonl"
    try:
        deadline = time.monotonic() + 60
        # Once a slab is recorded: the re-run then has something to skip.
        while time.monotonic() < deadline and proc.poll() is None:
            if manifest.exists() and '"slab"' in manifest.read_text():
                break
            time.sleep(0.1)
        proc.send_signal(signal.SIGTERM)
        stdout, stderr = proc.communicate(timeout=60)
        left = _live_processes_of_group(proc.pid, wait_s=10)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == ExitCode.TERMINATED, stderr[-3000:]
    assert "terminated (SIGTERM): re-run the same command to resume" in stderr
    assert "Traceback" not in stderr and "KeyboardInterrupt" not in stderr, stderr[-3000:]
    assert left == [], f"processes of the run still there: {left}"
    again = subprocess.run(argv + ["--json"], capture_output=True, text=True, env=ENV, timeout=120)
    assert again.returncode == 0, again.stderr[-3000:]
    summary = json.loads(again.stdout)
    assert summary["resumed"] is True and summary["slabs_skipped"] >= 1


# --- 5. errors go to stderr ------------------------------------------------------------------


@pytest.mark.slow
def test_errors_go_to_stderr_and_json_to_stdout(small, tmp_path):
    proc = h5ngff("convert", f"{small / 'small.h5'}:/missing", tmp_path / "o.ome.zarr")
    assert proc.returncode == ExitCode.BAD_INPUT
    assert "SourceUnreadable" in proc.stderr and "SourceUnreadable" not in proc.stdout and "error" not in proc.stdout
    as_json = h5ngff("convert", f"{small / 'small.h5'}:/missing", tmp_path / "o.ome.zarr", "--json")
    assert json.loads(as_json.stdout)["reason"] == "SourceUnreadable"


# --- 6 and 10. the output is checked first; one exit-code table ----------------------------------


@pytest.mark.slow
def test_output_conflicts_are_refused_before_the_plan_and_the_cluster(small, tmp_path):
    taken = tmp_path / "taken"
    taken.mkdir()
    (taken / "thesis.tex").write_text("precious")
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    for out, reason in ((taken, "OutputConflict"), (blocker / "out.ome.zarr", "OutputUnwritable")):
        # Refused before the plan table is printed (and so before any cluster starts).
        proc = h5ngff("convert", f"{small / 'small.h5'}:/volume/data", out, "--no-progress")
        assert proc.returncode == ExitCode.OUTPUT_REFUSED, (reason, proc.returncode, proc.stderr)
        assert reason in proc.stderr and "predicted peak RSS" not in proc.stdout, proc.stdout
    assert (taken / "thesis.tex").read_text() == "precious"
    # h5ngff run refuses it before its plan too, with the status the operator would write.
    job = {
        "apiVersion": "h5ngff.dev/v1alpha1",
        "kind": "ConversionJob",
        "metadata": {"name": "taken"},
        "spec": {
            "source": {"path": str(small / "small.h5"), "dataset": "/volume/data"},
            "output": {"path": str(taken)},
        },
    }
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(job))
    run = h5ngff("run", tmp_path / "job.yaml", "--no-progress")
    assert (
        run.returncode == ExitCode.OUTPUT_REFUSED
        and "OutputConflict" in run.stdout
        and "predicted peak RSS" not in run.stdout
    )


@pytest.mark.slow
def test_an_unsupported_url_scheme_is_refused_not_written_as_a_local_directory(small, tmp_path):
    # Before the fix `convert in.h5:/d gs://bucket/x` exited 0 after writing ./gs:/bucket/x.
    proc = h5ngff(
        "convert", f"{small / 'small.h5'}:/volume/data", "gs://bucket/x.ome.zarr", "--no-progress", cwd=tmp_path
    )
    assert proc.returncode == ExitCode.BAD_INPUT, proc.stderr
    assert "output.path" in proc.stderr and "gs:// is not supported" in proc.stderr, proc.stderr
    assert list(tmp_path.iterdir()) == []
    no_traceback(proc)
    # Control: a local name with a colon is still a local directory once it does not start like a
    # URL (a bare out:1.ome.zarr now does: tests/test_operator_admission_limits.py).
    plan = h5ngff("plan", f"{small / 'small.h5'}:/volume/data", "./out:1.ome.zarr", "--json", cwd=tmp_path)
    assert plan.returncode == 0 and json.loads(plan.stdout)["spec"]["output"]["path"] == "./out:1.ome.zarr", plan.stderr


@pytest.mark.slow
def test_one_exit_code_table_in_code_help_and_readme():
    codes = {int(c) for c in ExitCode}
    assert {0, 1, 2, 130} <= codes
    for cls in _all_subclasses(errors.H5ngffError):
        assert cls.exit_code in codes, cls
    assert errors.OutputError.exit_code == errors.OutputConflictError.exit_code == ExitCode.OUTPUT_REFUSED
    assert errors.SourceError.exit_code == errors.SpecError.exit_code == ExitCode.BAD_INPUT
    assert errors.DiskFullError.exit_code == errors.WorkerFailedError.exit_code == ExitCode.FAILED
    help_text = h5ngff("--help").stdout
    readme = (ROOT / "README.md").read_text()
    for code in ExitCode:
        line = f"{int(code):>3}  {code.meaning}"
        assert line in help_text, (line, help_text)
        assert f"| {int(code)} | {code.meaning} |" in readme, code


def _all_subclasses(cls):
    for sub in cls.__subclasses__():
        yield sub
        yield from _all_subclasses(sub)


# --- 7. a group instead of a dataset ---------------------------------------------------------


@pytest.mark.slow
def test_a_group_suggests_full_dataset_paths(small):
    proc = h5ngff("plan", f"{small / 'small.h5'}:/volume")
    assert proc.returncode == ExitCode.BAD_INPUT
    assert "Datasets in it: /volume/data." in " ".join(proc.stderr.split()), proc.stderr
    empty = h5ngff("plan", f"{small / 'small.h5'}:/empty")
    assert "Datasets in it: ." not in " ".join(empty.stderr.split()) and "holds no datasets" in empty.stderr, (
        empty.stderr
    )


# --- 8. a full disk --------------------------------------------------------------------------


@pytest.mark.slow
def test_full_disk_gives_the_message_without_dask_logs(tmp_path):
    mount = tmp_path / "disk"
    mount.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=512k", "tmpfs", str(mount)], capture_output=True).returncode:
        pytest.skip("cannot mount a tmpfs here (needs root)")
    try:
        h5 = write_h5(tmp_path / "big.h5", smooth((32, 128, 128)))  # 1 MiB uncompressed
        proc = h5ngff(
            "convert",
            f"{h5}:/volume/data",
            mount / "out.ome.zarr",
            "--compressor",
            "none",
            "--levels",
            "1",
            "--chunks",
            "8,128,128",
            "--workers",
            "1",
            "--no-progress",
        )
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)
    assert proc.returncode == ExitCode.FAILED, proc.stderr[-3000:]
    assert "No space left on the output device" in proc.stderr
    assert "Compute Failed" not in proc.stderr and "Traceback" not in proc.stderr, proc.stderr[-3000:]


# --- 9. local validation is the CRD's --------------------------------------------------------


def _crd_spec_schema() -> dict:
    crd = yaml.safe_load((ROOT / "src/h5ngff/operator/schema/crd.yaml").read_text())
    return crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]


@pytest.mark.parametrize("version", [0.5, 0.4, "0.5", "0.4", "0.6", 5, True])
def test_ngff_version_the_model_accepts_exactly_what_the_crd_accepts(version):
    from h5ngff.jobspec import parse_job_spec

    spec = {"source": {"path": "in.h5", "dataset": "/d"}, "output": {"path": "o", "ngffVersion": version}}
    try:
        # The CRD schema is OpenAPI v3.0 (boolean exclusiveMinimum): JSON Schema draft 4 semantics.
        jsonschema.Draft4Validator(_crd_spec_schema()).validate(spec)
        crd_ok = True
    except jsonschema.ValidationError:
        crd_ok = False
    try:
        parse_job_spec(spec)
        model_ok = True
    except errors.SpecError:
        model_ok = False
    assert model_ok == crd_ok, (version, model_ok, crd_ok)


@pytest.mark.slow
def test_run_refuses_an_unquoted_ngff_version_and_says_to_quote_it(small, tmp_path):
    (tmp_path / "job.yaml").write_text(
        "apiVersion: h5ngff.dev/v1alpha1\nkind: ConversionJob\nmetadata: {name: unquoted}\n"
        f"spec:\n  source: {{path: {small / 'small.h5'}, dataset: /volume/data}}\n"
        f"  output: {{path: {tmp_path / 'o.ome.zarr'}, ngffVersion: 0.5}}\n"
    )
    proc = h5ngff("run", tmp_path / "job.yaml", "--no-progress")
    assert proc.returncode == ExitCode.BAD_INPUT, proc.stdout + proc.stderr
    assert "spec.output.ngffVersion" in proc.stderr and 'ngffVersion: "0.5"' in proc.stderr, proc.stderr
    assert not (tmp_path / "o.ome.zarr").exists()


# --- 11. a typo'd flag -----------------------------------------------------------------------


@pytest.mark.slow
def test_a_typod_flag_gets_the_subcommand_usage_and_the_closest_flag(small):
    proc = h5ngff("plan", f"{small / 'small.h5'}:/volume/data", "--memroy-per-worker", "1G")
    assert proc.returncode == ExitCode.BAD_INPUT
    assert proc.stderr.startswith("usage: h5ngff plan"), proc.stderr
    assert "--memroy-per-worker" in proc.stderr and "did you mean --memory-per-worker?" in proc.stderr, proc.stderr
    far = h5ngff("convert", "a.h5:/d", "o", "--qqqqqqqqqq")
    assert far.stderr.startswith("usage: h5ngff convert") and "did you mean" not in far.stderr


# --- 12. a closed pipe -----------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("form", [["--json"], []], ids=["json", "tables"])
def test_a_closed_stdout_pipe_ends_quietly(small, form):
    """141 for the tables too: rich's own broken-pipe handler exited 1, a failed run's status."""
    proc = subprocess.Popen(
        [*H5NGFF, "plan", f"{small / 'small.h5'}:/volume/data", *form],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=ENV,
    )
    proc.stdout.close()  # as `| head` does once it has its lines: every write gets EPIPE
    stderr = proc.stderr.read()
    proc.wait(timeout=60)
    assert "Traceback" not in stderr and "BrokenPipeError" not in stderr, stderr
    assert proc.returncode == ExitCode.BROKEN_PIPE


# --- 13. clamped chunks and shards are noticed -------------------------------------------------


@pytest.mark.slow
def test_chunks_and_shards_clipped_to_the_array_are_noticed(tmp_path):
    h5 = tmp_path / "z60.h5"
    with h5py.File(h5, "w") as f:
        f.create_dataset("/volume/data", shape=(40, 256, 256), dtype="u1")  # no data written: metadata only
        f.create_dataset("/deep/data", shape=(60, 256, 256), dtype="u1")
    chunks = json.loads(h5ngff("plan", f"{h5}:/volume/data", "--json", "--chunks", "64,64,64").stdout)
    assert chunks["plan"]["chunks"] == [40, 64, 64]
    assert any("output.chunks" in n and "(40, 64, 64)" in n for n in chunks["notices"]), chunks["notices"]
    shards = json.loads(h5ngff("plan", f"{h5}:/deep/data", "--json", "--shards", "128,256,256").stdout)
    assert shards["plan"]["shards"] == [60, 256, 256]
    assert any("output.shards" in n and "(60, 256, 256)" in n for n in shards["notices"]), shards["notices"]
    fits = json.loads(h5ngff("plan", f"{h5}:/deep/data", "--json", "--chunks", "32,64,64").stdout)  # negative control
    assert not any("output.chunks" in n for n in fits["notices"]), fits["notices"]


# --- 14. the memory report's figure ----------------------------------------------------------


@pytest.mark.slow
def test_memory_report_figure(small):
    from h5ngff.backends.local import LocalBackend
    from h5ngff.engine.write.driver import RunTotals
    from h5ngff.metrics.timeline import _figure
    from h5ngff.runner import RunSummary, plan_job
    from h5ngff.spec import parse_spec

    spec = parse_spec(
        {
            "source": {"path": str(small / "small.h5"), "dataset": "/volume/data"},
            "output": {"path": "o"},
            "resources": {"workers": 4},
        }
    )
    job = plan_job(spec, LocalBackend())
    t0 = 1_000_000.0
    timeline = [(t0 + i * 0.25, str(w), (100 + i) << 20) for i in range(13) for w in range(4)]  # samples stop at 3 s
    summary = RunSummary("Succeeded", job, seconds=6.2, totals=RunTotals(bytes_read=327680), timeline=timeline)
    fig = _figure(summary)
    ax = fig.axes[0]
    assert ax.get_xlim()[1] >= 6.2
    workers = [line for line in ax.get_lines() if line.get_label().startswith("worker")]
    limits = [
        line
        for line in ax.get_lines()
        if not line.get_label().startswith("worker") and not line.get_label().startswith("_")
    ]
    colours = [line.get_color() for line in workers + limits]
    assert len(workers) == 4 and len(limits) == 4 and len(set(colours)) == len(colours), colours
    legend = [t.get_text() for t in ax.get_legend().get_texts()]
    assert not any("(cgroup)" in t for t in legend) and any("not enforced" in t for t in legend), legend
    assert ax.get_title().startswith("h5ngff memory per worker: small.h5:/volume/data"), ax.get_title()
    assert str(small) not in ax.get_title()


# --- 15. small things ------------------------------------------------------------------------


@pytest.mark.slow
def test_small_runs_show_a_readable_rate(converted):
    _, proc = converted
    assert "0.00 GB/s" not in proc.stdout
    assert re.search(r"\(\d[\d,.]* [MGk]B/s of source data\)", proc.stdout), proc.stdout


@pytest.mark.slow
def test_help_texts():
    sample = h5ngff("sample", "--help").stdout
    assert re.search(r"--dataset DATASET\s+\S", sample), sample
    plan = h5ngff("plan", "--help").stdout
    assert "examples:" in plan and "h5ngff plan " in plan.split("examples:")[1]
