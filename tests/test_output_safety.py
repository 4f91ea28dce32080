"""Nothing outside the output is deleted, and every crash point of creating an output is
recoverable (issue 40, items 2 and 4).

- ``--overwrite`` deletes only the objects of a Zarr hierarchy and h5ngff's own: an output that holds
  the run's source, a README, a folder of TIFFs or a link is refused (exit 3) before anything is
  deleted, for a directory and a bucket, single and batch. The negative control runs the same
  conversion with the check switched off and sees the source deleted, so the survival checks here
  can fail.
- A run SIGKILLed at each step of creating its output (``faults.CRASH_POINTS``: the lock, the
  manifest header, the metadata, the first slab) leaves an output that the same command resumes
  and ``--overwrite`` replaces, byte-identical to an uninterrupted run's. On cb6367c the
  ``manifest`` point was refused by both (exit 3).

Real ``h5ngff convert`` processes (a kill must be a real SIGKILL), real HDF5 files, a real S3
endpoint (moto on loopback) and the session's shared Dask cluster (``--scheduler``), so that no
run pays for a cluster start.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from pathlib import Path

import pytest
import zarr

from conftest import smooth, spec_for, write_h5
from h5ngff.engine.write import members, output as output_module
from h5ngff.engine.write.faults import CRASH_POINTS
from h5ngff.engine.verify.check import verify_output
from h5ngff.errors import ExitCode, OutputConflictError
from test_s3_output import _env, _flags

ROOT = Path(__file__).resolve().parents[1]
CLI = [sys.executable, "-m", "h5ngff.cli"]
ENV = {**os.environ, "PYTHONPATH": str(ROOT / "src") + os.pathsep + os.environ.get("PYTHONPATH", "")}
FLAGS = ["--chunks", "8,16,16", "--levels", "2", "--no-progress"]


def h5ngff(*argv, env=None, scheduler=None) -> subprocess.CompletedProcess:
    extra = ["--scheduler", scheduler] if scheduler else []
    return subprocess.run([*CLI, *map(str, argv), *extra], capture_output=True, text=True, timeout=180, env=env or ENV)


def tree(root: Path) -> dict[str, str]:
    """Every file under ``root`` (links as links) -> its content's hash; what a test compares."""
    out = {}
    for directory, _, files in os.walk(root):
        for name in files:
            path = Path(directory, name)
            key = str(path.relative_to(root))
            out[key] = f"link:{os.readlink(path)}" if path.is_symlink() else hashlib.sha1(path.read_bytes()).hexdigest()
    return out


def image_files(root: Path) -> dict[str, str]:
    """The image's files: what two runs of one conversion must agree on (not the lock)."""
    return {k: v for k, v in tree(root).items() if not k.startswith(".h5ngff")}


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    d = tmp_path_factory.mktemp("safety")
    return write_h5(d / "scan.h5", smooth((20, 40, 40), "uint16", seed=3))


def zarr_group(path: Path) -> None:
    zarr.create_group(str(path), zarr_format=3).create_array("0", shape=(4, 4), chunks=(2, 2), dtype="u1")[:] = 7


# -- the classification itself (pure) -------------------------------------------------------------


def test_members_of_both_zarr_formats_and_our_own_objects_are_not_foreign():
    docs = {
        "zarr.json": b'{"node_type": "group"}',
        "0/zarr.json": b'{"node_type": "array"}',
        "labels/zarr.json": b'{"node_type": "group"}',
        "labels/cells/zarr.json": b'{"node_type": "array"}',
        "v2/.zarray": b"{}",
    }
    keys = [
        *docs,
        "0/c/0/1/2",
        "0/c/3",
        "labels/cells/c.0.0",
        "v2/0.0.1",
        "v2/0/0/1",
        "v2/.zattrs",
        ".zattrs",
        ".zmetadata",
        ".h5ngff.lock",
        ".h5ngff/manifest.jsonl",
        ".h5ngff/hist/p0-0.npz",
        "0/.h5ngff-checksums/0.json",
        ".h5ngff-checksums/0.json",
        "0/c/0/.1.h5ngff-tmp-0123456789ab",
    ]
    assert members.foreign_objects(keys, docs.__getitem__) == []


@pytest.mark.parametrize(
    "foreign",
    [
        "raw/scan.h5",  # the case: a subdirectory that is no node
        "README.md",
        "tiffs/0001.tif",
        "0/README.md",  # inside an array, not a chunk key
        "0/c/notes.txt",
        "0/c/0/0.bak",
        "unlisted/zarr.json",  # a node document that does not parse is no node
        "unlisted/c/0",
    ],
)
def test_anything_else_under_the_output_is_foreign(foreign):
    docs = {
        "zarr.json": b'{"node_type": "group"}',
        "0/zarr.json": b'{"node_type": "array"}',
        "unlisted/zarr.json": b"{",
    }
    keys = [*docs, "0/c/0/0", foreign]
    assert members.foreign_objects(keys, docs.__getitem__) == sorted({foreign} | ({"unlisted/zarr.json"}))


def test_a_node_below_an_array_or_a_foreign_directory_is_not_part_of_the_hierarchy():
    docs = {
        "zarr.json": b'{"node_type": "group"}',
        "0/zarr.json": b'{"node_type": "array"}',
        "0/inner/zarr.json": b'{"node_type": "group"}',  # below an array: not reachable through groups
        "raw/sub/zarr.json": b'{"node_type": "array"}',  # below a directory that is no node
    }
    keys = [*docs, "raw/sub/c/0"]
    assert members.foreign_objects(keys, docs.__getitem__) == ["0/inner/zarr.json", "raw/sub/c/0", "raw/sub/zarr.json"]


# -- --overwrite on a directory -------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.integration
def test_overwrite_refuses_an_output_holding_its_own_source_and_deletes_nothing(tmp_path, shared_cluster):
    """The issue's repro: a Zarr v3 group at z/ with the HDF5 source in z/raw/."""
    out = tmp_path / "z"
    zarr_group(out)
    (out / "raw").mkdir()
    inside = write_h5(out / "raw" / "scan.h5", smooth((20, 40, 40), "uint16", seed=3))
    before = tree(out)
    proc = h5ngff(
        "convert", f"{inside}:/volume/data", out, *FLAGS, "--overwrite", scheduler=shared_cluster.scheduler_address
    )
    assert proc.returncode == ExitCode.OUTPUT_REFUSED, proc.stderr
    assert "holds the source of this conversion ('raw/scan.h5')" in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert tree(out) == before


@pytest.mark.slow
@pytest.mark.integration
@pytest.mark.parametrize(
    "plant",
    ["README.md", "tiffs/0001.tif", "0/README.md", "link"],
    ids=["readme", "tiff-folder", "inside-an-array", "symlink"],
)
def test_overwrite_refuses_an_output_holding_unrelated_files_ours_or_foreign(tmp_path, source, shared_cluster, plant):
    """Both kinds of output --overwrite replaces: a finished h5ngff output and a foreign Zarr."""
    ours, foreign = tmp_path / "ours.ome.zarr", tmp_path / "foreign.zarr"
    first = h5ngff("convert", f"{source}:/volume/data", ours, *FLAGS, scheduler=shared_cluster.scheduler_address)
    assert first.returncode == 0, first.stderr
    zarr_group(foreign)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "data.tif").write_text("the user's data\n")
    for out in (ours, foreign):
        target = out / plant
        target.parent.mkdir(parents=True, exist_ok=True)
        if plant == "link":
            target.symlink_to(elsewhere)  # a link to a directory: a walk does not even list it
        else:
            target.write_text("the user's own file\n")
        before = tree(out)
        proc = h5ngff(
            "convert", f"{source}:/volume/data", out, *FLAGS, "--overwrite", scheduler=shared_cluster.scheduler_address
        )
        assert proc.returncode == ExitCode.OUTPUT_REFUSED, (out, proc.stderr)
        assert "no part of its Zarr hierarchy" in proc.stderr and repr(plant) in proc.stderr
        assert tree(out) == before, out
    assert (elsewhere / "data.tif").read_text() == "the user's data\n"


@pytest.mark.slow
@pytest.mark.integration
def test_a_batch_overwrite_refuses_the_item_whose_output_holds_another_file_and_converts_the_rest(
    tmp_path, shared_cluster
):
    runs = tmp_path / "runs"
    runs.mkdir()
    for name in ("a", "b"):
        write_h5(runs / f"{name}.h5", smooth((8, 16, 16), "uint16", seed=len(name)))
    template = str(tmp_path / "out" / "{stem}.ome.zarr")
    first = h5ngff("convert", f"{runs}/*.h5:/volume/data", template, *FLAGS, scheduler=shared_cluster.scheduler_address)
    assert first.returncode == 0, first.stderr
    notes = tmp_path / "out" / "b.ome.zarr" / "notes.txt"
    notes.write_text("keep me\n")
    proc = h5ngff(
        "convert",
        f"{runs}/*.h5:/volume/data",
        template,
        *FLAGS,
        "--overwrite",
        scheduler=shared_cluster.scheduler_address,
    )
    assert proc.returncode == 1, proc.stderr
    assert notes.read_text() == "keep me\n"
    assert "no part of its Zarr hierarchy" in proc.stdout + proc.stderr and "'notes.txt'" in proc.stdout + proc.stderr


@pytest.mark.integration
def test_negative_control_without_the_check_overwrite_deletes_the_source(tmp_path, convert, monkeypatch):
    """The same repro with ``refuse_foreign`` switched off: the source is gone, so the survival
    checks above are able to fail (on cb6367c, which had no such check, this is what happened)."""
    out = tmp_path / "z"
    zarr_group(out)
    (out / "raw").mkdir()
    inside = write_h5(out / "raw" / "scan.h5", smooth((20, 40, 40), "uint16", seed=3))
    monkeypatch.setattr(output_module, "refuse_foreign", lambda *a, **k: None)
    with pytest.raises(Exception):  # noqa: B017 - whichever error a run without its source ends in
        convert(spec_for(inside, str(out), output={"overwrite": True, "chunks": [8, 16, 16]}))
    assert not os.path.exists(inside)


# -- --overwrite in a bucket ----------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.integration
def test_overwrite_in_a_bucket_refuses_a_prefix_of_ours_holding_a_foreign_object(source, s3, shared_cluster):
    bucket = s3.new_bucket()
    url = f"s3://{bucket}/out.ome.zarr"
    env = _env(s3)
    first = h5ngff("convert", f"{source}:/volume/data", url, *FLAGS, *_flags(s3.options()), env=env)
    assert first.returncode == 0, first.stderr
    s3.client().put_object(Bucket=bucket, Key="out.ome.zarr/README.md", Body=b"keep me")
    before = s3.keys(bucket)
    proc = h5ngff("convert", f"{source}:/volume/data", url, *FLAGS, *_flags(s3.options()), "--overwrite", env=env)
    assert proc.returncode == ExitCode.OUTPUT_REFUSED, proc.stderr
    assert "'README.md'" in proc.stderr
    assert s3.keys(bucket) == before


def test_remove_ours_checks_again_right_before_it_deletes(tmp_path):
    """Defence in depth: the deleting function itself refuses, whatever its caller checked."""
    out = tmp_path / "z"
    zarr_group(out)
    (out / "keep.txt").write_text("x")
    from h5ngff.engine.stores import open_store

    with pytest.raises(OutputConflictError, match="keep.txt"):
        output_module.remove_ours(open_store(str(out), {}))
    assert (out / "keep.txt").exists() and (out / "zarr.json").exists()


# -- every crash point of creating an output ------------------------------------------------------


def _reference(tmp_path_factory, source, scheduler) -> dict[str, str]:
    out = tmp_path_factory.mktemp("reference") / "ref.ome.zarr"
    proc = h5ngff("convert", f"{source}:/volume/data", out, *FLAGS, scheduler=scheduler)
    assert proc.returncode == 0, proc.stderr
    return image_files(out)


@pytest.fixture(scope="module")
def reference(tmp_path_factory, source, shared_cluster):
    return _reference(tmp_path_factory, source, shared_cluster.scheduler_address)


@pytest.mark.integration
@pytest.mark.slow
@pytest.mark.parametrize("point", CRASH_POINTS)
@pytest.mark.parametrize("then", ["resume", "overwrite"])
def test_a_kill_at_each_step_of_creating_a_directory_output_is_resumed_or_replaced(
    tmp_path, source, shared_cluster, reference, point, then
):
    out = tmp_path / "out.ome.zarr"
    address = shared_cluster.scheduler_address
    killed = h5ngff(
        "convert",
        f"{source}:/volume/data",
        out,
        *FLAGS,
        scheduler=address,
        env={**ENV, "H5NGFF_FAULTS": f"crash_at={point}"},
    )
    assert killed.returncode == -9, (point, killed.returncode, killed.stderr[-2000:])
    assert out.exists()
    again = h5ngff(
        "convert",
        f"{source}:/volume/data",
        out,
        *FLAGS,
        *(["--overwrite"] if then == "overwrite" else []),
        scheduler=address,
    )
    assert again.returncode == 0, (point, again.stderr)
    assert image_files(out) == reference
    report = verify_output(str(out), (source, "/volume/data"))  # in this process: a second start saved
    assert report.ok, report.problems[:3]


@pytest.mark.integration
@pytest.mark.slow
@pytest.mark.parametrize("point", CRASH_POINTS)
def test_a_kill_at_each_step_of_creating_a_bucket_output_is_resumed_then_replaced(source, s3, shared_cluster, point):
    """On its own machine a dead holder's lease is taken at once (tests/test_s3_lock.py)."""
    bucket = s3.new_bucket()
    url = f"s3://{bucket}/out.ome.zarr"
    flags = [*FLAGS, *_flags(s3.options()), "--scheduler", shared_cluster.scheduler_address]
    killed = h5ngff("convert", f"{source}:/volume/data", url, *flags, env=_env(s3, H5NGFF_FAULTS=f"crash_at={point}"))
    assert killed.returncode == -9, (point, killed.returncode, killed.stderr[-2000:])
    resumed = h5ngff("convert", f"{source}:/volume/data", url, *flags, env=_env(s3))
    assert resumed.returncode == 0, (point, resumed.stderr)
    first = {k: v for k, v in s3.keys(bucket).items() if "/.h5ngff" not in k}
    killed = h5ngff(
        "convert", f"{source}:/volume/data", url, *flags, "--overwrite", env=_env(s3, H5NGFF_FAULTS=f"crash_at={point}")
    )
    assert killed.returncode == -9
    replaced = h5ngff("convert", f"{source}:/volume/data", url, *flags, "--overwrite", env=_env(s3))
    assert replaced.returncode == 0, (point, replaced.stderr)
    assert {k: v for k, v in s3.keys(bucket).items() if "/.h5ngff" not in k} == first
    report = verify_output(url, (source, "/volume/data"), storage_options=s3.options())
    assert report.ok, report.problems[:3]


def test_every_crash_point_is_reached_by_a_run():
    """The injection names real steps: each is called where the docstring of faults says."""
    src = (ROOT / "src" / "h5ngff").rglob("*.py")
    called = {p for f in src for p in CRASH_POINTS if f'crash_point("{p}")' in f.read_text()}
    assert called == set(CRASH_POINTS)


@pytest.mark.slow
@pytest.mark.integration
def test_relative_paths_on_an_existing_cluster_are_the_clients_not_the_workers(tmp_path, source, shared_cluster):
    """Found while exploring: with --scheduler, the workers (started elsewhere, here in the test
    process's directory) opened the relative source in their own directory and wrote the relative
    output's chunks there, while the run reported success. The paths are the client's now."""
    workdir = tmp_path / "client"
    workdir.mkdir()
    os.symlink(source, workdir / "in.h5")
    name = f"rel-{os.getpid()}-{tmp_path.name}.ome.zarr"
    proc = subprocess.run(
        [*CLI, "convert", "in.h5:/volume/data", name, *FLAGS, "--scheduler", shared_cluster.scheduler_address],
        capture_output=True, text=True, timeout=180, env=ENV, cwd=workdir,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert not os.path.exists(name), "chunks were written under the workers' directory"
    check = h5ngff("verify", workdir / name, "--source", f"{source}:/volume/data")
    assert check.returncode == 0, check.stdout + check.stderr


@pytest.mark.slow
@pytest.mark.integration
@pytest.mark.parametrize("then", ["resume", "overwrite"])
def test_an_output_left_with_only_a_lock_and_a_temporary_header_is_resumed_or_replaced(
    tmp_path, source, shared_cluster, reference, then
):
    """The state the issue found after a kill while the output was created (a lock file and the
    manifest header's temporary file, nothing else), made directly: on cb6367c both the re-run and
    --overwrite refused it (exit 3, "not an h5ngff output" / "Remove it yourself")."""
    out = tmp_path / "out.ome.zarr"
    (out / ".h5ngff").mkdir(parents=True)
    (out / ".h5ngff.lock").write_text('{"pid": 1}')
    (out / ".h5ngff" / ".manifest.jsonl.h5ngff-tmp-0123456789ab").write_text('{"kind": "hea')
    again = h5ngff(
        "convert", f"{source}:/volume/data", out, *FLAGS, *(["--overwrite"] if then == "overwrite" else []),
        scheduler=shared_cluster.scheduler_address,
    )  # fmt: skip
    assert again.returncode == 0, again.stderr
    assert image_files(out) == reference


def _open_on_workers(client, paths: list[str]) -> int:
    """How many of ``paths`` a worker process still holds open (the readers' file cache)."""

    def count(names):
        from h5ngff.engine.sources import base

        return sum(1 for path in base._files if path in names)

    return sum(client.run(count, set(paths)).values())


@pytest.mark.slow
@pytest.mark.integration
def test_runs_on_an_existing_cluster_leave_nothing_open_on_its_workers(tmp_path, shared_cluster, monkeypatch):
    """Found by the suite: every run on a long-lived cluster (--scheduler) left its HDF5 files
    open on the workers (about 0.7 MiB each, 240 MiB of RSS after 200 runs), until the workers
    stood above a small plan's pod limit. A batch freed each item's; a single run now frees its
    own. Negative control: without the release the files stay open."""
    from distributed import Client

    import h5ngff.runner as runner_module
    from h5ngff.backends.external import ExternalBackend
    from h5ngff.engine.write.tasks import end_of_conversion
    from h5ngff.runner import plan_job, run_job

    backend = ExternalBackend(shared_cluster.scheduler_address)

    def runs(tag: str, n: int = 3) -> list[str]:
        paths = []
        for i in range(n):
            h5 = write_h5(tmp_path / f"{tag}{i}.h5", smooth((8, 16, 16), seed=i))
            spec = spec_for(h5, str(tmp_path / f"{tag}{i}.ome.zarr"), output={"chunks": [8, 16, 16]})
            run_job(plan_job(spec, backend), backend)
            paths.append(os.path.abspath(h5))
        return paths

    with Client(shared_cluster.scheduler_address) as client:
        released = runs("released")
        assert _open_on_workers(client, released) == 0
        monkeypatch.setattr(runner_module, "_release_on_workers", lambda session, output: None)
        kept = runs("kept")
        assert _open_on_workers(client, kept) == len(kept)  # the control: each run's file is still open
        for i in range(len(kept)):  # the control's leftovers are this test's to free, and only they
            client.run(end_of_conversion, str(tmp_path / f"kept{i}.ome.zarr"))
        assert _open_on_workers(client, kept) == 0
