"""One writer per bucket prefix (engine/stores/s3lease.py): real ``h5ngff convert`` processes against a
real S3 endpoint (moto's server on loopback), a real SIGKILL, and a second "machine" that is a
process in its own pid namespace (``unshare --pid``): the lease cannot see whether a pid there is
alive, exactly as for a run on another workstation, so it must watch the lease's ETag.

Negative controls: with the lease switched off (lock=false) the refused writer is not refused;
a run that stops renewing (SIGKILL) is taken over after its ttl, which a live one never is; the
server refuses a taker holding a wrong ETag; a store without conditional writes is refused."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time

import psutil
import pytest

from conftest import smooth, spec_for, write_h5
from h5ngff.engine.stores.s3lease import LOCK_KEY, LeaseSettings, acquire, judge, local_holder_alive, my_identity
from h5ngff.engine.stores import open_store
from h5ngff.errors import ExitCode, OutputBusyError, OutputError
from s3_server import FaultProxy
from test_s3_output import _chunk_objects, _env, _flags

pytestmark = pytest.mark.integration

CLI = [sys.executable, "-m", "h5ngff.cli"]
#: Seconds: a renewal every 3.3 s, given up after 6.7 s without one; a dead remote holder is
#: taken over after 10 s. Shorter ttls lost leases on this 2-core machine while a benchmark ran
#: at nice -10 and these processes at nice 19 (a starved holder rightly gives its lease up).
TTL = 10.0
FLAGS = ["--chunks", "8,32,32", "--levels", "2", "--slab", "16,96,80", "--workers", "1", "--no-progress"]


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    return write_h5(tmp_path_factory.mktemp("s3lock") / "in.h5", smooth((64, 96, 80), "uint16", seed=5))  # 4 slabs


@pytest.fixture(scope="module")
def elsewhere():
    """The command prefix that runs a process as if on another machine: its own pid namespace."""
    if shutil.which("unshare") is None:
        pytest.skip("unshare (util-linux) is not installed: no second pid namespace to play another machine")
    prefix = ["unshare", "--pid", "--fork", "--mount-proc"]
    if os.geteuid() != 0:
        prefix[1:1] = ["--user", "--map-root-user"]
    probe = subprocess.run(
        prefix + [sys.executable, "-c", "import os; print(os.stat('/proc/self/ns/pid').st_ino)"],
        capture_output=True,
        text=True,
    )
    if probe.returncode != 0:
        pytest.skip(f"this kernel refuses a new pid namespace ({probe.stderr.strip()[:200]})")
    assert probe.stdout.strip() != str(os.stat("/proc/self/ns/pid").st_ino)
    return prefix


def _run(s3, src, url, *extra, prefix=(), options=None, timeout=300, **env):
    args = (
        list(prefix) + CLI + ["convert", f"{src}:/volume/data", url, *FLAGS, *extra, *_flags(options or s3.options())]
    )
    return subprocess.run(
        args, env=_env(s3, H5NGFF_LOCK_TTL=str(TTL), **env), capture_output=True, text=True, timeout=timeout
    )


def _start_slow(s3, src, url, bucket, key_prefix, sleep, manifest_objects=2):
    """A first writer whose slabs each sleep, returned once it holds the lease and has written
    ``manifest_objects`` manifest objects (the header, then one per recorded slab)."""
    args = CLI + ["convert", f"{src}:/volume/data", url, *FLAGS, *_flags(s3.options())]
    proc = subprocess.Popen(
        args,
        env=_env(s3, H5NGFF_LOCK_TTL=str(TTL), H5NGFF_FAULTS=f"slab_sleep={sleep}"),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    client, deadline = s3.client(), time.monotonic() + 180
    while True:
        keys = [o["Key"] for o in client.list_objects_v2(Bucket=bucket, Prefix=key_prefix).get("Contents", [])]
        if key_prefix + LOCK_KEY in keys and sum("/.h5ngff/manifest/" in k for k in keys) >= manifest_objects:
            return proc
        assert proc.poll() is None, proc.stderr.read()
        assert time.monotonic() < deadline, "the first writer never started writing"
        time.sleep(0.2)  # moto answers in this process: a tight poll would starve it


def _lease(s3, bucket, key):
    obj = s3.client().get_object(Bucket=bucket, Key=key)
    return json.loads(obj["Body"].read()), obj["ETag"]


def _stop(proc):
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


@pytest.mark.slow
def test_a_held_prefix_refuses_a_second_writer_and_an_overwrite_and_a_taken_lease_stops_its_run(source, s3, elsewhere):
    bucket = s3.new_bucket()
    url, key_prefix = f"s3://{bucket}/held.ome.zarr", "held.ome.zarr/"
    # Its slabs sleep a minute: every check below happens while it holds the prefix, however
    # slowly a loaded machine starts the other processes. Release is checked by the other tests.
    first = _start_slow(s3, source, url, bucket, key_prefix, sleep=60.0, manifest_objects=1)
    try:
        held_since = time.monotonic()
        holder, etag = _lease(s3, bucket, key_prefix + LOCK_KEY)
        assert holder["pid"] == first.pid and holder["ttl"] == TTL
        before = s3.keys(bucket, key_prefix)
        # The same host: refused at once (the holder's pid is alive), naming it. (A plain second
        # convert on this host is refused the same way in the lock=false control below.)
        overwrite = _run(s3, source, url, "--overwrite", "--json")
        assert overwrite.returncode == ExitCode.OUTPUT_REFUSED, overwrite.stderr[-2000:]
        report = json.loads(overwrite.stdout)
        assert (
            report["reason"] == "OutputBusy"
            and f"pid {first.pid}" in report["message"]
            and "alive on this host" in report["message"]
        )
        after = s3.keys(bucket, key_prefix)
        assert {k: v for k, v in before.items() if k != key_prefix + LOCK_KEY}.items() <= after.items(), (
            "--overwrite deleted or changed objects"
        )
        # Renewal: past one ttl, a writer on another "machine" (it cannot see the pid) watches the
        # lease, sees it renewed, and is refused. Its control is the SIGKILL test: unrenewed, taken.
        time.sleep(max(0.0, TTL + 0.5 - (time.monotonic() - held_since)))
        remote = _run(s3, source, url, prefix=elsewhere)
        assert remote.returncode == ExitCode.OUTPUT_REFUSED, remote.stderr[-2000:]
        assert "renewed while this run watched" in remote.stderr and f"Waiting up to {TTL:.0f} s" in remote.stderr
        renewed, new_etag = _lease(s3, bucket, key_prefix + LOCK_KEY)
        assert renewed["token"] == holder["token"] and renewed["renewals"] >= 3 and new_etag != etag
        assert first.poll() is None, "every refusal above must have happened while the first run was writing"
        # Lost: another workstation overwrites the lease. The first run's next renewal gets 412; it
        # cancels its slabs (each sleeping a minute, so only the cancel can end it this soon) and
        # fails without marking the output complete or touching the taker's lease.
        intruder = {
            **my_identity(TTL),
            "host": "another-workstation",
            "pid": 4242,
            "pid_space": "elsewhere",
            "command": "intruder",
        }
        s3.client().put_object(Bucket=bucket, Key=key_prefix + LOCK_KEY, Body=json.dumps(intruder).encode())
        # It had written (its manifest, the array metadata): a failed run, exit 1. Exit 3 promises
        # that nothing was changed (README, exit statuses); the reason still names OutputBusy.
        assert first.wait(timeout=50) == ExitCode.FAILED
        err = first.stderr.read()
        assert "(OutputBusy)" in err, err[-2000:]
        assert "lost its one-writer lease" in err and "another-workstation" in err, err[-2000:]
    finally:
        _stop(first)
    root = json.loads(s3.client().get_object(Bucket=bucket, Key=key_prefix + "zarr.json")["Body"].read())
    assert "ome" not in root["attributes"] and "h5ngff" not in root["attributes"], (
        "a run without its lease marked the output"
    )
    assert _lease(s3, bucket, key_prefix + LOCK_KEY)[0]["host"] == "another-workstation"


@pytest.mark.slow
def test_negative_control_with_the_lease_off_the_second_writer_is_not_refused(source, s3, convert):
    """A live lease held by this test process: the CLI is refused, naming it; the same conversion
    with lock=false is not refused and writes the prefix under the holder's feet."""
    bucket = s3.new_bucket()
    url = f"s3://{bucket}/off.ome.zarr"
    lease = acquire(open_store(url, s3.options()), LeaseSettings(ttl=TTL))
    try:
        refused = _run(s3, source, url)
        assert refused.returncode == ExitCode.OUTPUT_REFUSED and f"pid {os.getpid()}" in refused.stderr, refused.stderr[
            -2000:
        ]
        unlocked = spec_for(
            source,
            url,
            output={"chunks": [8, 32, 32], "storageOptions": {**s3.options(), "lock": "false"}},
            pyramid={"levels": 2},
        )
        assert convert(unlocked).status == "Succeeded"
        lease.check()  # our lease was never touched: the unlocked run simply ignored it
    finally:
        lease.release()
    assert "off.ome.zarr/" + LOCK_KEY not in s3.keys(bucket, "off.ome.zarr/")


@pytest.mark.slow
def test_a_sigkilled_holder_is_waited_out_for_one_ttl_then_resumed_byte_identical(source, s3, convert, elsewhere):
    bucket = s3.new_bucket()
    clean = f"s3://{bucket}/clean.ome.zarr"
    convert(
        spec_for(source, clean, output={"chunks": [8, 32, 32], "storageOptions": s3.options()}, pyramid={"levels": 2})
    )
    url, key_prefix = f"s3://{bucket}/killed.ome.zarr", "killed.ome.zarr/"
    first = _start_slow(s3, source, url, bucket, key_prefix, sleep=1.0)
    _stop(first)  # SIGKILL: no release; the lease names a dead pid
    dead, _ = _lease(s3, bucket, key_prefix + LOCK_KEY)
    assert dead["pid"] == first.pid
    t = time.monotonic()
    resumed = _run(s3, source, url, "--json", prefix=elsewhere)
    elapsed = time.monotonic() - t
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert f"Waiting up to {TTL:.0f} s" in resumed.stderr and "took over the stale lease" in resumed.stderr
    assert elapsed >= TTL, f"the lease was taken after {elapsed:.1f} s, before its ttl ({TTL} s) could pass"
    summary = json.loads(resumed.stdout)
    assert summary["resumed"] and summary["slabs_skipped"] >= 1
    keys = s3.keys(bucket)
    assert _chunk_objects(keys, key_prefix) == _chunk_objects(keys, "clean.ome.zarr/")
    assert key_prefix + LOCK_KEY not in keys


def test_on_the_same_host_a_dead_holder_is_taken_at_once_and_a_live_one_refused_at_once(s3):
    bucket = s3.new_bucket()
    store = open_store(f"s3://{bucket}/same", s3.options())
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    started = psutil.Process(gone.pid).create_time() if psutil.pid_exists(gone.pid) else time.time()
    gone.wait()
    dead = {**my_identity(60.0), "pid": gone.pid, "pid_started": started, "token": "dead"}
    assert local_holder_alive(dead) is False and local_holder_alive(my_identity(60.0)) is True
    assert local_holder_alive({**my_identity(60.0), "pid_started": 12.0}) is False  # a reused pid is another process
    assert local_holder_alive({**my_identity(60.0), "pid_space": "another-machine"}) is None
    s3.client().put_object(Bucket=bucket, Key=f"same/{LOCK_KEY}", Body=json.dumps(dead).encode())
    t = time.monotonic()
    lease = acquire(store, LeaseSettings(ttl=60.0))  # a 60 s ttl: only the dead pid can make this quick
    try:
        assert time.monotonic() - t < 10
        with pytest.raises(OutputBusyError, match=f"pid {os.getpid()}.*alive on this host"):
            acquire(store, LeaseSettings(ttl=60.0))
    finally:
        lease.release()


def test_judge_never_calls_a_remote_lease_stale_before_its_own_ttl():
    remote = {"ttl": 3.0, "pid": 1, "host": "x"}
    assert [judge(remote, t, 60.0, None) for t in (0.0, 2.9, 3.0)] == ["wait", "wait", "stale"]
    assert judge({}, 59.0, 60.0, None) == "wait"  # an unreadable lease gets our own ttl
    assert judge({**remote, "state": "released"}, 0.0, 60.0, True) == "wait"  # its holder deletes it next
    assert judge(remote, 0.0, 60.0, True) == "live" and judge(remote, 0.0, 60.0, False) == "stale"


@pytest.mark.slow
def test_the_server_refuses_a_taker_with_a_wrong_etag_and_one_of_two_racing_takers(s3):
    bucket = s3.new_bucket()
    store = open_store(f"s3://{bucket}/race", s3.options())
    first = store.create(LOCK_KEY, b'{"token": "a"}')
    assert first and store.create(LOCK_KEY, b'{"token": "b"}') is None  # If-None-Match: exactly one creator
    assert store.replace(LOCK_KEY, b'{"token": "c"}', '"0123456789abcdef0123456789abcdef"') is None
    assert store.get_tagged(LOCK_KEY) == (b'{"token": "a"}', first)
    results: dict[str, str | None] = {}
    barrier = threading.Barrier(2)

    def take(name):
        barrier.wait()
        results[name] = store.replace(LOCK_KEY, json.dumps({"token": name}).encode(), first)

    threads = [threading.Thread(target=take, args=(n,)) for n in ("x", "y")]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    winners = [n for n, etag in results.items() if etag]
    assert len(winners) == 1, results
    assert json.loads(store.get_tagged(LOCK_KEY)[0])["token"] == winners[0]


@pytest.mark.slow
def test_a_store_without_conditional_writes_is_refused_with_what_to_do(source, s3, convert):
    bucket = s3.new_bucket()
    with FaultProxy(s3.url) as proxy:
        proxy.faults.add("501", 1000, "PUT", LOCK_KEY)
        options = s3.options(proxy.url)
        spec = {"output": {"chunks": [8, 32, 32], "storageOptions": options}, "pyramid": {"levels": 2}}
        with pytest.raises(OutputError, match="does not support conditional writes.*lock=false"):
            convert(spec_for(source, f"s3://{bucket}/no-cas.ome.zarr", **spec))
        assert s3.keys(bucket) == {}  # refused before anything was written
        spec["output"]["storageOptions"] = {**options, "lock": "false"}  # the user's knowing choice
        assert convert(spec_for(source, f"s3://{bucket}/no-cas.ome.zarr", **spec)).status == "Succeeded"


@pytest.mark.slow
def test_a_lease_that_cannot_be_renewed_is_lost_within_two_thirds_of_its_ttl(s3):
    """Every renewal fails (the proxy resets the connection): the holder gives up 2/3 ttl after
    its last good renewal, before any watcher could call it stale, and calls back the driver's
    canceller. Control: the same lease through the healthy proxy stays held past a renewal."""
    bucket = s3.new_bucket()
    with FaultProxy(s3.url) as proxy:
        store = open_store(f"s3://{bucket}/cut", {**s3.options(proxy.url), "timeout": "2s"})
        lease = acquire(store, LeaseSettings(ttl=TTL))
        cancelled = threading.Event()
        lease.on_lost(cancelled.set)
        first, deadline = lease.etag, time.monotonic() + TTL
        while lease.etag == first:  # its first renewal, counted by the lease's new ETag
            assert time.monotonic() < deadline, "the lease was not renewed within one ttl"
            time.sleep(0.05)
        lease.check()  # control: renewed through the healthy proxy (the held test spans a whole ttl)
        t = time.monotonic()
        proxy.faults.add("reset", 10_000, "PUT", LOCK_KEY)
        assert cancelled.wait(TTL * 3), "the lease was never given up"
        assert time.monotonic() - t <= TTL * 2 / 3 + 2 + 1.0  # deadline + one timed-out request + slack
        with pytest.raises(OutputBusyError, match="lost its one-writer lease.*no lease renewal succeeded"):
            lease.check()
        lease.release()  # a lost lease is left alone
    assert f"cut/{LOCK_KEY}" in s3.keys(bucket)
