"""OME-Zarr written to a real S3 endpoint (moto's server on loopback) with the guarantees a
directory has: every level exact read back through the endpoint by three independent readers,
metadata last, resume after SIGKILL byte-identical, retries counted, 403 refused at once,
--overwrite only for our own outputs, and ``h5ngff verify s3://``."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import zarr

from conftest import smooth, spec_for, write_h5
from formats_fixtures import read_by_independent_clients
from h5ngff.errors import ExitCode, OutputConflictError, OutputError
from h5ngff.metrics.families import ExportState, build_families
from reference import reference_pyramid
from s3_server import FaultProxy

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[1]
CLI = [sys.executable, "-m", "h5ngff.cli"]
SHAPE = (24, 96, 80)
ALL3 = (True, True, True)


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    data = smooth(SHAPE, "uint16", seed=3)
    return write_h5(tmp_path_factory.mktemp("s3") / "in.h5", data), data


def _spec(h5, url, options, **output):
    return spec_for(h5, url, output={"chunks": [8, 32, 32], "storageOptions": options, **output}, pyramid={"levels": 3})


def _zarr_group(url, s3):
    from zarr.storage import FsspecStore

    return zarr.open_group(
        FsspecStore.from_url(
            url,
            storage_options={"endpoint_url": s3.url, "key": "h5ngff-test", "secret": "h5ngff-test-secret"},
            read_only=True,
        ),
        mode="r",
    )


def _env(s3, **extra):
    return {
        **os.environ,
        **s3.env(),
        "PYTHONPATH": str(ROOT / "src") + os.pathsep + os.environ.get("PYTHONPATH", ""),
        **extra,
    }


def _flags(options):
    return [f for k, v in options.items() for f in ("--storage-option", f"{k}={v}")]


@pytest.mark.slow
@pytest.mark.parametrize("shards", [None, [16, 64, 64]], ids=["chunks", "shards"])
def test_every_level_exact_read_back_through_the_endpoint(source, s3, convert, monkeypatch, shards):
    h5, data = source
    bucket = s3.new_bucket()
    url = f"s3://{bucket}/prefix/out.ome.zarr"
    summary = convert(_spec(h5, url, s3.options(), **({"shards": shards} if shards else {})))
    assert summary.status == "Succeeded"
    group = _zarr_group(url, s3)
    for level, expected in enumerate(reference_pyramid(data, ALL3, "mean", 3)):
        np.testing.assert_array_equal(group[str(level)][...], expected)
    assert group.attrs["h5ngff"]["complete"] is True
    keys = s3.keys(bucket)
    assert not [k for k in keys if "/.h5ngff/" in k], "the manifest must be gone from a finished output"
    if shards is None:  # the three readers once: the shard path's bytes are zarr's, checked above
        for key, value in s3.env().items():
            monkeypatch.setenv(key, value)
        read_by_independent_clients(url, data, {"endpoint_url": s3.url})


@pytest.mark.slow
def test_verify_an_s3_output_with_and_without_source(source, s3, convert):
    from h5ngff.engine.verify.check import verify_output

    h5, data = source
    bucket = s3.new_bucket()
    url = f"s3://{bucket}/v.ome.zarr"
    convert(_spec(h5, url, s3.options()))
    plain = verify_output(url, storage_options=s3.options())
    assert plain.ok and plain.complete and plain.levels == 3 and plain.units_checked == 27 + 8 + 1, plain.problems
    # The CLI, with --source: every level compared with the pyramid computed from the HDF5 file.
    flags = _flags(s3.options())
    proc = subprocess.run(
        CLI + ["verify", url, "--json", "--source", f"{h5}:/volume/data", *flags],
        capture_output=True,
        text=True,
        env=_env(s3),
        timeout=120,
    )
    report = json.loads(proc.stdout)
    assert proc.returncode == 0 and report["ok"] and report["levels_compared"] == 3, proc.stderr[-2000:]
    # Negative controls: a changed chunk object is found by the comparison, a deleted one by both.
    client = s3.client()
    body = bytearray(client.get_object(Bucket=bucket, Key="v.ome.zarr/1/c/0/0/0")["Body"].read())
    body[len(body) // 2] ^= 0xFF
    client.put_object(Bucket=bucket, Key="v.ome.zarr/1/c/0/0/0", Body=bytes(body))
    client.delete_object(Bucket=bucket, Key="v.ome.zarr/0/c/2/2/2")
    compared = verify_output(url, (h5, "/volume/data"), storage_options=s3.options())
    assert {(1, "c/0/0/0"), (0, "c/2/2/2")} <= set(compared.bad_units), compared.problems
    decoded = verify_output(url, storage_options=s3.options())
    assert (0, "c/2/2/2") in decoded.bad_units and "missing" in " ".join(decoded.problems)
    missing = subprocess.run(
        CLI + ["verify", f"s3://{bucket}/nothing-here", *flags],
        capture_output=True,
        text=True,
        env=_env(s3),
        timeout=60,
    )
    assert missing.returncode == ExitCode.BAD_INPUT and "holds no objects" in missing.stderr


def _chunk_objects(keys: dict[str, bytes], prefix: str) -> dict[str, bytes]:
    return {
        k[len(prefix) :]: v
        for k, v in keys.items()
        if k.startswith(prefix) and "/.h5ngff/" not in k and not k.endswith(("zarr.json", ".zattrs"))
    }


@pytest.mark.slow
def test_killed_run_resumes_byte_identical_and_a_poller_never_sees_it_finished_early(s3, convert, tmp_path):
    # Two slabs (a 3-level pyramid of 8-deep chunks aligns slabs to 32 planes), run one after the
    # other: the kill lands after the first slab's record and before the second's. With one slab
    # (the module's 24-plane source) the run could finish between two polls.
    data = smooth((64, 96, 80), "uint16", seed=4)
    h5 = write_h5(tmp_path / "two-slabs.h5", data)
    bucket = s3.new_bucket()
    clean = f"s3://{bucket}/clean.ome.zarr"
    convert(_spec(h5, clean, s3.options()))
    url = f"s3://{bucket}/killed.ome.zarr"
    args = CLI + [
        "convert",
        f"{h5}:/volume/data",
        url,
        "--chunks",
        "8,32,32",
        "--levels",
        "3",
        "--slab",
        "32,96,80",
        "--workers",
        "1",
        "--threads",
        "1",
        "--no-progress",
        *_flags(s3.options()),
    ]
    proc = subprocess.Popen(
        args,
        env=_env(s3, H5NGFF_FAULTS="slab_sleep=0.5"),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        start_new_session=True,
    )
    client = s3.client()
    deadline = time.time() + 90
    while time.time() < deadline and proc.poll() is None:
        recorded = [
            o["Key"]
            for o in client.list_objects_v2(Bucket=bucket, Prefix="killed.ome.zarr/.h5ngff/manifest/").get(
                "Contents", []
            )
        ]
        if len(recorded) >= 2:  # the header and one slab: mid-run
            break
        time.sleep(0.05)
    assert proc.poll() is None, "the run ended before it could be killed mid-run: the test would prove nothing"
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    root = json.loads(client.get_object(Bucket=bucket, Key="killed.ome.zarr/zarr.json")["Body"].read())
    assert "ome" not in root["attributes"], "a killed run must not look finished"

    seen = _poll_while(
        lambda: subprocess.run(args, env=_env(s3), capture_output=True, text=True, timeout=120),
        s3,
        bucket,
        "killed.ome.zarr/",
    )
    assert seen["result"].returncode == 0, seen["result"].stderr[-2000:]
    assert seen["early"] == [], f"the metadata appeared before these chunks: {seen['early'][:5]}"
    assert seen["polls_unfinished"] > 0, "the poller must have seen the run in progress (else it proves nothing)"
    keys = s3.keys(bucket)
    assert _chunk_objects(keys, "killed.ome.zarr/") == _chunk_objects(keys, "clean.ome.zarr/")
    group = _zarr_group(url, s3)
    np.testing.assert_array_equal(group["0"][...], data)


def _poll_while(run, s3, bucket, prefix):
    """Run ``run()`` while another thread lists the prefix: whenever the root document carries
    the NGFF metadata, every chunk object of a finished output must already be there."""
    client = s3.client()
    expected = {"0": 3 * 3 * 3, "1": 2 * 2 * 2, "2": 1}  # (24,96,80) in (8,32,32) chunks, halved twice
    seen = {"early": [], "polls_unfinished": 0}
    done = threading.Event()

    def poll():
        while not done.is_set():
            keys = [
                o["Key"]
                for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix)
                for o in page.get("Contents", [])
            ]
            try:
                root = json.loads(client.get_object(Bucket=bucket, Key=prefix + "zarr.json")["Body"].read())
            except client.exceptions.NoSuchKey:
                continue
            if "ome" not in root["attributes"]:
                seen["polls_unfinished"] += 1
                continue
            for level, n in expected.items():
                have = [k for k in keys if k.startswith(f"{prefix}{level}/c/")]
                if len(have) < n:
                    seen["early"].append((level, len(have), n))

    thread = threading.Thread(target=poll, daemon=True)
    thread.start()
    try:
        seen["result"] = run()
    finally:
        done.set()
        thread.join(10)
    return seen


@pytest.mark.slow
def test_injected_503s_and_resets_are_retried_and_counted(source, s3, convert):
    h5, data = source
    bucket = s3.new_bucket()
    with FaultProxy(s3.url) as proxy:
        url = f"s3://{bucket}/faulty.ome.zarr"
        proxy.faults.add("503", 4, "PUT", "/c/")
        proxy.faults.add("reset", 2, "PUT", "/c/")
        progress = []
        summary = convert(_spec(h5, url, s3.options(proxy.url)), listeners=[progress.append])
        assert proxy.faults.injected("503") == 4 and proxy.faults.injected("reset") == 2
    assert summary.status == "Succeeded" and summary.totals.store_retries == 6
    families = {f.name: f for f in build_families("faulty", "local", ExportState(progress=progress[-1]))}
    assert (
        families["h5ngff_store_retries"].samples[0].value == 6
    )  # prometheus_client drops "_total" from a counter family's name
    np.testing.assert_array_equal(_zarr_group(url, s3)["0"][...], data)


@pytest.mark.slow
def test_a_403_fails_fast_before_the_cluster_with_what_to_change(source, s3):
    h5, _ = source
    bucket = s3.new_bucket()
    with FaultProxy(s3.url) as proxy:
        proxy.faults.add("403", 1000)
        t = time.monotonic()
        proc = subprocess.run(
            CLI
            + [
                "convert",
                f"{h5}:/volume/data",
                f"s3://{bucket}/x.ome.zarr",
                "--no-progress",
                *_flags(s3.options(proxy.url)),
            ],
            capture_output=True,
            text=True,
            env=_env(s3),
            timeout=120,
        )
        elapsed = time.monotonic() - t
    assert proc.returncode == ExitCode.OUTPUT_REFUSED, proc.stderr
    assert "OutputUnwritable" in proc.stderr and "AccessDenied" in proc.stderr and "s3:PutObject" in proc.stderr
    assert (
        "predicted peak RSS" not in proc.stdout and proxy.faults.injected("403") == 1
    )  # refused before the plan; not retried
    assert elapsed < 30


@pytest.mark.slow
def test_overwrite_replaces_only_our_own_output(source, s3, convert):
    h5, data = source
    bucket = s3.new_bucket()
    client = s3.client()
    client.put_object(Bucket=bucket, Key="theirs.ome.zarr/zarr.json", Body=b'{"zarr_format": 3, "node_type": "group"}')
    client.put_object(Bucket=bucket, Key="theirs.ome.zarr/0/c/0/0/0", Body=b"precious")
    with pytest.raises(OutputConflictError, match="did not write"):
        convert(_spec(h5, f"s3://{bucket}/theirs.ome.zarr", s3.options(), overwrite=True))
    assert s3.keys(bucket, "theirs.ome.zarr/")["theirs.ome.zarr/0/c/0/0/0"] == b"precious"
    # Ours (finished), then with a stray object no Zarr hierarchy holds: --overwrite refuses to
    # delete what it did not write (issue 40), and replaces ours once the stray is gone.
    ours = f"s3://{bucket}/ours.ome.zarr"
    convert(_spec(h5, ours, s3.options(), chunks=[8, 16, 16]))
    before = s3.keys(bucket, "ours.ome.zarr/")
    again = convert(_spec(h5, ours, s3.options(), chunks=[8, 16, 16]))  # finished: nothing rewritten
    assert again.resumed and s3.keys(bucket, "ours.ome.zarr/") == before
    client.put_object(Bucket=bucket, Key="ours.ome.zarr/stray", Body=b"x")
    with pytest.raises(OutputConflictError, match="different conversion"):
        convert(_spec(h5, ours, s3.options()))
    with pytest.raises(OutputConflictError, match="no part of its Zarr hierarchy.*'stray'"):
        convert(_spec(h5, ours, s3.options(), overwrite=True))
    assert s3.keys(bucket, "ours.ome.zarr/")["ours.ome.zarr/stray"] == b"x"
    client.delete_object(Bucket=bucket, Key="ours.ome.zarr/stray")
    convert(_spec(h5, ours, s3.options(), overwrite=True))
    keys = s3.keys(bucket, "ours.ome.zarr/")
    assert "ours.ome.zarr/0/c/0/0/4" not in keys  # the old 16-wide grid is gone
    np.testing.assert_array_equal(_zarr_group(ours, s3)["0"][...], data)


def test_an_unwritable_bucket_is_an_output_error_not_a_crash(source, s3, convert):
    h5, _ = source
    with pytest.raises(OutputError, match="NoSuchBucket"):
        convert(_spec(h5, "s3://no-such-bucket-h5ngff/x.ome.zarr", s3.options()))


@pytest.mark.slow
def test_a_sparse_bucket_output_skips_empty_chunks_and_keeps_the_quantile_window(source, s3, convert, tmp_path):
    """Empty chunks, checksums and the window, merged with the bucket path: a chunk that is zero
    everywhere is no object, verify counts it as recorded (``emptyUnits``) and not as missing,
    and the omero window comes from the per-slab histograms kept as objects in the bucket, equal
    to the same conversion's on disk. Control: deleting one stored chunk is still found."""
    from h5ngff.engine.verify.check import verify_output

    _, data = source
    sparse = data.copy()
    sparse[:, :, 40:] = 0  # every chunk at x >= 64 is all zero (chunks are 32 wide)
    sparse[0, 0, 0] = 65535  # a hot pixel: the window's end must stay near the background
    h5 = write_h5(tmp_path / "sparse.h5", sparse)
    bucket = s3.new_bucket()
    url = f"s3://{bucket}/sparse.ome.zarr"
    convert(_spec(h5, url, s3.options(), compressor={"codec": "zstd"}))
    local = str(tmp_path / "sparse.ome.zarr")
    convert(_spec(h5, local, None, compressor={"codec": "zstd"}))

    group = _zarr_group(url, s3)
    np.testing.assert_array_equal(group["0"][...], sparse)
    marker = group.attrs["h5ngff"]
    assert marker["emptyUnits"].get("0", 0) > 0, marker.get("emptyUnits")
    keys = s3.keys(bucket)
    assert "sparse.ome.zarr/0/c/0/0/2" not in keys and "sparse.ome.zarr/0/c/0/0/0" in keys
    local_root = zarr.open_group(local, mode="r")
    assert group.attrs["ome"]["omero"] == local_root.attrs["ome"]["omero"]
    window = group.attrs["ome"]["omero"]["channels"][0]["window"]
    assert window["max"] == 65535 and window["end"] < 65535, window
    assert sorted(
        k[len("sparse.ome.zarr/") :] for k in keys if "/c/" in k and k.startswith("sparse.ome.zarr/0/")
    ) == sorted(str(p.relative_to(local)) for p in Path(local, "0").rglob("*") if p.is_file() and "/c/" in str(p))
    report = verify_output(url, storage_options=s3.options())
    assert report.ok and report.checksums == "crc32c codec", report.problems

    s3.client().delete_object(Bucket=bucket, Key="sparse.ome.zarr/0/c/0/0/0")  # negative control
    broken = verify_output(url, storage_options=s3.options())
    assert not broken.ok and "missing" in " ".join(broken.problems), broken.problems


@pytest.mark.slow
def test_ngff_04_in_a_bucket_has_no_sidecar_checksums():
    from h5ngff.spec import OutputSpec

    assert OutputSpec(path="s3://b/x.ome.zarr", ngffVersion="0.4").checksums is False
    assert OutputSpec(path="s3://b/x.ome.zarr").checksums is True  # 0.5: the crc32c codec travels in the chunks
    assert OutputSpec(path="/data/x.ome.zarr", ngffVersion="0.4").checksums is True  # control: a local sidecar
    with pytest.raises(ValueError, match="checksums"):
        OutputSpec(path="s3://b/x.ome.zarr", ngffVersion="0.4", checksums=True)
