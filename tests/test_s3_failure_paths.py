"""Object-store failure paths, round two (a real S3 endpoint: moto's server on loopback).

- A run that dies at any point of its start sequence leaves a prefix h5ngff resumes (or replaces
  with --overwrite), and the result is the same bytes, object for object, as an uninterrupted run.
- Two runs started at once: the loser is told the prefix is busy (OutputBusy), never to delete
  the live run's objects.
- Two uninterrupted runs give identical objects, in a bucket and in a directory (no run figures in
  the image's metadata); so does a run killed after its first slab and resumed.
- A failed run reports the store retries it made.
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import pytest

from conftest import smooth, spec_for, write_h5
from h5ngff.backends.external import ExternalBackend
from h5ngff.engine.write import manifest as manifest_mod
from h5ngff.engine.write.lock import output_lock
from h5ngff.engine.write.output import check_output, prepare_output
from h5ngff.engine.stores.s3 import S3Store
from h5ngff.engine.verify.check import verify_output
from h5ngff.errors import OutputBusyError, OutputConflictError, OutputError
from h5ngff.runner import plan_job, run_job
from s3_server import FaultProxy

pytestmark = pytest.mark.integration

SHAPE = (32, 48, 40)


class Crash(Exception):
    """The driver dies here (as a kill would stop it: nothing after this point is written)."""


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    return write_h5(tmp_path_factory.mktemp("s3fail") / "in.h5", smooth(SHAPE, "uint16", seed=7))


@pytest.fixture(scope="module")
def backend(shared_cluster):
    return ExternalBackend(shared_cluster.scheduler_address)


def _spec(h5, url, options=None, **output):
    out = {"chunks": [8, 16, 16], **({"storageOptions": options} if options else {}), **output}
    return spec_for(h5, url, output=out, pyramid={"levels": 2})


def _run(spec, backend):
    """As the CLI does: check the output, then run."""
    job = plan_job(spec, backend)
    check_output(job.plan, job.spec, job.source)
    return run_job(job, backend)


def _objects(s3, bucket: str, prefix: str) -> dict[str, bytes]:
    return {k[len(prefix) :]: v for k, v in s3.keys(bucket, prefix).items()}


def _files(root: str) -> dict[str, bytes]:
    return {
        os.path.relpath(os.path.join(d, f), root): Path(d, f).read_bytes()
        for d, _, names in os.walk(root)
        for f in names
    }


def _crash_at_put(monkeypatch, n: int) -> list[str]:
    """The driver's ``n``-th PUT (manifest and metadata: workers are other processes) raises."""
    sent: list[str] = []
    real = S3Store._put_now

    def put(self, key, data):
        if len(sent) + 1 == n:
            raise Crash(f"killed before PUT {key}")
        sent.append(key)
        return real(self, key, data)

    monkeypatch.setattr(S3Store, "_put_now", put)
    return sent


# The start sequence's PUTs: the manifest header, 0/zarr.json, 1/zarr.json, zarr.json; the 5th is
# the first slab's record (a kill after the start, mid-run).
@pytest.mark.slow
@pytest.mark.parametrize("overwrite", [False, True], ids=["resume", "overwrite"])
@pytest.mark.parametrize("n", [1, 2, 3, 4, 5])
def test_a_kill_at_any_point_of_the_start_leaves_a_prefix_that_resumes(source, s3, backend, monkeypatch, n, overwrite):
    bucket = s3.new_bucket()
    _run(_spec(source, f"s3://{bucket}/clean.ome.zarr", s3.options()), backend)
    url = f"s3://{bucket}/killed.ome.zarr"
    with monkeypatch.context() as m:
        sent = _crash_at_put(m, n)
        with pytest.raises(Crash):
            _run(_spec(source, url, s3.options()), backend)
    assert len(sent) == n - 1
    summary = _run(_spec(source, url, s3.options(), overwrite=overwrite), backend)
    assert summary.status == "Succeeded"
    assert verify_output(url, (source, "/volume/data"), storage_options=s3.options()).ok
    # The same bytes, object for object, as the uninterrupted run (the root zarr.json included).
    assert _objects(s3, bucket, "killed.ome.zarr/") == _objects(s3, bucket, "clean.ome.zarr/")


def test_a_run_starting_beside_a_live_one_is_busy_not_a_conflict(source, s3, backend):
    """The live run holds the lease and has PUT an object before its claim is readable (the old
    window between the metadata and the manifest): a second run is OutputBusy, naming it."""
    bucket = s3.new_bucket()
    url = f"s3://{bucket}/out.ome.zarr"
    spec = _spec(source, url, s3.options())
    job = plan_job(spec, backend)
    with output_lock(url, s3.options()):
        S3Store(bucket, "out.ome.zarr", s3.options()).put(
            "zarr.json", b'{"zarr_format": 3, "node_type": "group"}', sync=True
        )
        with pytest.raises(OutputBusyError, match=f"pid {os.getpid()}"):
            check_output(job.plan, job.spec, job.source)


@pytest.mark.slow
@pytest.mark.parametrize("attempt", range(6))
def test_two_runs_started_at_once_the_loser_is_busy(source, s3, backend, attempt):
    bucket = s3.new_bucket()
    url = f"s3://{bucket}/out.ome.zarr"
    job = plan_job(_spec(source, url, s3.options()), backend)
    errors: list[BaseException] = []
    barrier = threading.Barrier(2)

    def start():
        try:
            barrier.wait()
            check_output(job.plan, job.spec, job.source)
            with output_lock(url, s3.options()):
                prepare_output(job.plan, job.spec, job.source)
                time.sleep(0.5)  # the winner is still starting when the loser looks
        except OutputConflictError as exc:
            errors.append(exc)

    threads = [threading.Thread(target=start) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert all(type(e) is OutputBusyError for e in errors), [str(e) for e in errors]


@pytest.mark.slow
def test_two_uninterrupted_runs_give_identical_objects_in_a_bucket(source, s3, backend):
    bucket = s3.new_bucket()
    for name in ("a", "b"):
        _run(_spec(source, f"s3://{bucket}/{name}.ome.zarr", s3.options()), backend)
    a, b = _objects(s3, bucket, "a.ome.zarr/"), _objects(s3, bucket, "b.ome.zarr/")
    assert "zarr.json" in a and b"summary" not in a["zarr.json"]
    assert a == b


@pytest.mark.slow
def test_two_runs_and_a_resumed_run_give_identical_files_in_a_directory(source, backend, tmp_path, monkeypatch):
    outs = [str(tmp_path / f"{name}.ome.zarr") for name in ("a", "b", "killed")]
    for out in outs[:2]:
        _run(_spec(source, out), backend)
    with monkeypatch.context() as m:

        def die(self, records):
            raise Crash("killed before the first slab's record")

        m.setattr(manifest_mod.Manifest, "append", die)
        with pytest.raises(Crash):
            _run(_spec(source, outs[2]), backend)
    assert _run(_spec(source, outs[2]), backend).resumed
    a, b, resumed = (_files(out) for out in outs)
    assert b"summary" not in a["zarr.json"]
    assert a == b == resumed


@pytest.mark.slow
def test_a_failed_run_reports_its_store_retries(source, s3, backend):
    bucket = s3.new_bucket()
    with FaultProxy(s3.url) as proxy:
        proxy.faults.add("503", 10_000, "PUT", "/c/")
        with pytest.raises(OutputError, match="still failing after 3 attempts") as err:
            _run(_spec(source, f"s3://{bucket}/x.ome.zarr", {**s3.options(proxy.url), "retries": "3"}), backend)
    totals = err.value.totals  # type: ignore[attr-defined]
    assert totals.store_retries >= 2 and totals.store_retries <= proxy.faults.injected("503")
