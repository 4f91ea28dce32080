"""The runner keeps its metrics endpoint up after the attempt until Prometheus has scraped the
final values once ($H5NGFF_METRICS_LINGER seconds at most). The end-to-end case (the real runner
command, scraped over HTTP) is in tests/test_operator_e2e.py."""

from __future__ import annotations

import threading
import time
import urllib.request

import pytest

from h5ngff.engine.progress import Progress
from h5ngff.metrics.exporter import MetricsExporter
from h5ngff.errors import RunnerContractError
from h5ngff.operator.contract import DEFAULT_METRICS_LINGER, RunnerContract


@pytest.mark.slow
def test_lingering_ends_at_the_first_scrape_after_the_run():
    exporter = MetricsExporter(0, "scan", addr="127.0.0.1")
    try:
        urllib.request.urlopen(
            f"http://127.0.0.1:{exporter.port}/metrics", timeout=5
        ).read()  # during the run: does not count
        timer = threading.Timer(
            0.5, lambda: urllib.request.urlopen(f"http://127.0.0.1:{exporter.port}/metrics", timeout=5).read()
        )
        timer.start()
        t0 = time.monotonic()
        assert exporter.linger(30, until_scraped=True) is True
        assert 0.4 < time.monotonic() - t0 < 10
    finally:
        exporter.close()


@pytest.mark.slow
def test_a_scrape_of_the_final_values_before_lingering_counts():
    exporter = MetricsExporter(0, "scan", addr="127.0.0.1")
    try:
        exporter(Progress(phase="Succeeded", slabs_done=4, slabs_total=4))
        text = urllib.request.urlopen(f"http://127.0.0.1:{exporter.port}/metrics", timeout=5).read().decode()
        assert 'phase="Succeeded"} 1.0' in text
        t0 = time.monotonic()
        assert exporter.linger(30, until_scraped=True) is True and time.monotonic() - t0 < 1
    finally:
        exporter.close()


@pytest.mark.slow
def test_without_a_scrape_it_lingers_the_whole_time():
    """Negative control: nobody scrapes, so the process stays up for the full linger."""
    exporter = MetricsExporter(0, "scan", addr="127.0.0.1")
    try:
        t0 = time.monotonic()
        assert exporter.linger(1.0, until_scraped=True) is False
        assert time.monotonic() - t0 >= 1.0
    finally:
        exporter.close()


def test_the_linger_comes_from_the_runner_contract():
    env = {"H5NGFF_JOB_NAMESPACE": "ns", "H5NGFF_JOB_NAME": "scan", "H5NGFF_SPEC": "{}"}
    assert RunnerContract.from_env(env).metrics_linger == DEFAULT_METRICS_LINGER == 30.0
    assert RunnerContract.from_env({**env, "H5NGFF_METRICS_LINGER": "5"}).metrics_linger == 5.0
    with pytest.raises(RunnerContractError, match="H5NGFF_METRICS_LINGER"):
        RunnerContract.from_env({**env, "H5NGFF_METRICS_LINGER": "soon"})
