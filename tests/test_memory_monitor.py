"""The nanny's cheaper memory check (backends/memory_monitor.py): the figure it reads is psutil's
RSS, it hands over to Dask's check exactly when the worker is above the threshold, and a real
nanny still terminates a worker that outgrows its limit through it."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import time

import psutil
import pytest
from distributed import Client, LocalCluster

from h5ngff.backends import memory_monitor
from h5ngff.backends.diagnostics import MEMORY_RESTART_TOPIC, register_plugins
from h5ngff.backends.memory_monitor import StatmProbe, cheaper_check


def _sleeper(mib: int = 0) -> subprocess.Popen:
    code = f"import time; b = bytearray({mib} << 20); print('ready', flush=True); time.sleep(60)"
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
    return proc


def test_the_probe_reads_psutils_rss_and_follows_a_new_process():
    probe = StatmProbe()
    first, second = _sleeper(64), _sleeper(8)
    try:
        assert probe.rss(first.pid) == psutil.Process(first.pid).memory_info().rss
        assert probe.rss(first.pid) > 64 << 20  # the bytearray is resident
        first.kill()
        first.wait()
        assert probe.rss(first.pid) is None  # its descriptor reads nothing once the process is gone
        assert probe.pid is None
        assert probe.rss(second.pid) == psutil.Process(second.pid).memory_info().rss
        assert probe.rss(second.pid) < 64 << 20
        assert probe.rss(None) is None and probe.pid is None
    finally:
        for proc in (first, second):
            proc.kill()
            proc.wait()
        probe.close()


def test_dasks_check_runs_only_above_the_threshold_or_when_rss_is_unreadable():
    calls: list[int] = []
    proc = _sleeper(32)
    probe = StatmProbe()
    try:
        rss = psutil.Process(proc.pid).memory_info().rss
        below = cheaper_check(lambda: calls.append(1), lambda: proc.pid, rss + (16 << 20), probe)
        above = cheaper_check(lambda: calls.append(2), lambda: proc.pid, rss - (16 << 20), probe)
        unknown = cheaper_check(lambda: calls.append(3), lambda: None, 1e18, probe)
        for check in (below, above, unknown):
            check()
        assert calls == [2, 3]
    finally:
        proc.kill()
        proc.wait()
        probe.close()


def _grow(mib: int) -> int:
    held = bytearray(mib << 20)  # resident at once: bytearray zero-fills
    time.sleep(8)
    return len(held)


@pytest.fixture(autouse=True)
def _environment_back():
    """A plain LocalCluster's nanny writes Dask's pre-spawn variables (MALLOC_TRIM_THRESHOLD_...)
    into os.environ for good: put it back for the tests after these."""
    saved = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(saved)


def _run_a_task_beyond_the_limit() -> tuple[list, int | None, bool]:
    """(memory-restart events, the task's result or None, whether the cheaper check was installed)."""
    with LocalCluster(
        n_workers=1, threads_per_worker=1, memory_limit="400MiB", processes=True, dashboard_address=":0"
    ) as cluster:
        with Client(cluster) as client:
            register_plugins(client)
            (nanny,) = cluster.workers.values()
            installed = "cheaper_check" in getattr(
                nanny.periodic_callbacks["memory_monitor"].callback, "__qualname__", ""
            )
            future = client.submit(_grow, 600, retries=0, pure=False)
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline and not client.get_events(MEMORY_RESTART_TOPIC) and not future.done():
                time.sleep(0.1)
            events = list(client.get_events(MEMORY_RESTART_TOPIC))
            result = future.result(timeout=5) if future.done() and future.status == "finished" else None
            return events, result, installed


@pytest.mark.slow
def test_a_worker_above_its_limit_is_still_terminated_by_the_nanny(monkeypatch):
    logging.getLogger("distributed.nanny").setLevel(logging.CRITICAL)
    events, result, installed = _run_a_task_beyond_the_limit()
    assert installed
    assert events and result is None, "the nanny did not terminate a worker at 600 MiB against a 400 MiB limit"
    (_, event), *_ = events
    assert event["rss"] > 0.95 * (400 << 20)
    # Negative control: a probe that always reads 0 never hands over to Dask's check, and the
    # same task runs to its end: the cheaper check is what decides.
    monkeypatch.setattr(memory_monitor.StatmProbe, "rss", lambda self, pid: 0)
    events, result, installed = _run_a_task_beyond_the_limit()
    assert installed and not events and result == 600 << 20


def test_teardown_puts_dasks_check_back_and_closes_the_descriptor():
    """A nanny tears its plugins down before it stops its periodic callbacks: a check still
    installed then would open the descriptor again, and nothing would close it."""

    class Periodic:
        def __init__(self, callback):
            self.callback = callback

    class Nanny:
        def __init__(self, pid):
            self.process = type("P", (), {"process": type("Q", (), {"pid": pid})()})()
            self.periodic_callbacks = {"memory_monitor": Periodic(lambda: calls.append("dask"))}
            self.memory_manager = type("M", (), {"memory_limit": 1 << 40, "memory_terminate_fraction": 0.95})()

    calls: list[str] = []
    proc = _sleeper()
    try:
        nanny = Nanny(proc.pid)
        original = nanny.periodic_callbacks["memory_monitor"].callback
        plugin = memory_monitor.CheaperMemoryCheck()
        plugin.setup(nanny)
        check = nanny.periodic_callbacks["memory_monitor"].callback
        check()  # below the threshold: Dask's check is not called, the descriptor is open
        probe = nanny._h5ngff_memory_check[2]
        assert calls == [] and probe.pid == proc.pid
        plugin.teardown(nanny)
        assert nanny.periodic_callbacks["memory_monitor"].callback is original and probe.pid is None
        nanny.periodic_callbacks["memory_monitor"].callback()  # a tick after the teardown: Dask's
        assert calls == ["dask"] and probe.pid is None  # and no descriptor opened again
        # Negative control: the wrapped check itself, ticking after the teardown, opens it again.
        check()
        assert probe.pid == proc.pid
        probe.close()
    finally:
        proc.kill()
        proc.wait()
