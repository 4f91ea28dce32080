"""The exporter on real clusters: an existing cluster (``--scheduler``), pod-emulated workers that
are killed by a signal and by the kernel's OOM killer, and the ``h5ngff convert --metrics-port``
command line."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from contextlib import contextmanager

import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

from distributed import Client, LocalCluster

from conftest import requires_cgroups, spec_for, write_h5
from h5ngff.backends.base import Session
from h5ngff.backends.diagnostics import ClusterEvents, process_memory, register_plugins
from h5ngff.backends.external import ExternalBackend
from h5ngff.backends.local import LocalBackend, LocalPodsBackend
from h5ngff.engine.progress import Progress
from h5ngff.errors import SpecError
from h5ngff.metrics.exporter import MetricsExporter
from h5ngff.metrics.families import BY_NAME
from h5ngff.metrics.probes import ClusterPoller
from h5ngff.planner import DEFAULT_CONSTANTS
from h5ngff.runner import plan_job, run_job

pytestmark = pytest.mark.integration

PROMTOOL = shutil.which("promtool") or "/usr/bin/promtool"
CGROUP_METRICS = {
    "h5ngff_worker_cgroup_usage_bytes",
    "h5ngff_worker_cgroup_working_set_bytes",
    "h5ngff_worker_cgroup_limit_bytes",
    "h5ngff_worker_pod_nonreclaimable_bytes",
    "h5ngff_worker_pod_nonreclaimable_peak_bytes",
}


def volume(shape=(32, 256, 256)) -> np.ndarray:
    return (np.arange(np.prod(shape), dtype=np.uint32) * 7919 % 65521).astype(np.uint16).reshape(shape)


def scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        return r.read().decode()


def samples(text: str) -> dict[tuple[str, tuple], float]:
    """{(sample name, sorted labels): value} of an exposition."""
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def by_worker(text: str, name: str) -> dict[str, float]:
    return {dict(labels)["worker"]: v for (n, labels), v in samples(text).items() if n == name}


@pytest.mark.slow
def test_exporter_on_an_existing_cluster(shared_cluster, tmp_path):
    """--scheduler: worker memory from the scheduler and the workers, limits, job progress; no
    cgroup series, because these workers share the test's own cgroup (not a pod of their own)."""
    h5 = write_h5(tmp_path / "in.h5", volume())
    spec = spec_for(h5, str(tmp_path / "out.ome.zarr"), output={"chunks": [16, 64, 64]})
    backend = ExternalBackend(shared_cluster.scheduler_address)
    job = plan_job(spec, backend)
    exporter = MetricsExporter(0, "existing", "tests", addr="127.0.0.1")
    try:
        summary = run_job(job, backend, metrics=exporter)
        text = scrape(exporter.port)  # after the run: the final values are still served
    finally:
        exporter.close()
    workers = {str(name) for name in shared_cluster.workers}
    rss = by_worker(text, "h5ngff_worker_rss_bytes")
    assert set(rss) == workers and all(v > 50 << 20 for v in rss.values()), rss
    assert set(by_worker(text, "h5ngff_worker_memory_limit_bytes").values()) == {2 << 30}  # the cluster's own
    assert set(by_worker(text, "h5ngff_worker_pod_limit_bytes").values()) == {job.plan.memory.pod_limit}
    assert set(by_worker(text, "h5ngff_worker_oom_kills_total").values()) == {0}
    # Earlier tests may have killed workers of this shared cluster: only this run's exits count.
    assert set(by_worker(text, "h5ngff_worker_nanny_restarts_total").values()) == {0}
    values = samples(text)
    labels = (("conversion_job", "existing"), ("conversion_job_namespace", "tests"))
    assert (
        values[("h5ngff_job_slabs_done_total", labels)]
        == job.plan.n_tasks
        == values[("h5ngff_job_planned_slabs", labels)]
    )
    assert values[("h5ngff_job_read_bytes_total", labels)] == summary.totals.bytes_read
    assert values[("h5ngff_job_phase", labels + (("phase", "Succeeded"),))] == 1
    assert values[("h5ngff_exporter_poll_errors_total", labels)] == 0
    names = {
        family.name + ("_total" if family.type == "counter" else "") for family in text_string_to_metric_families(text)
    }
    batch = {name for name in BY_NAME if name.startswith("h5ngff_batch_")}  # one conversion, not a batch
    assert names <= set(BY_NAME) and set(BY_NAME) - names == CGROUP_METRICS | batch
    if os.path.exists(PROMTOOL):
        result = subprocess.run([PROMTOOL, "check", "metrics"], input=text, capture_output=True, text=True)
        assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.slow
def test_listener_only_exports_the_job_phase_without_a_cluster():
    exporter = MetricsExporter(0, "nocluster", "tests", addr="127.0.0.1")
    try:
        assert "h5ngff_job_phase" not in scrape(exporter.port)
        exporter(Progress(phase="Failed", slabs_total=8, slabs_done=3, message="boom"))
        values = samples(scrape(exporter.port))
    finally:
        exporter.close()
    labels = (("conversion_job", "nocluster"), ("conversion_job_namespace", "tests"))
    assert values[("h5ngff_job_phase", labels + (("phase", "Failed"),))] == 1
    assert values[("h5ngff_job_phase", labels + (("phase", "Writing"),))] == 0
    assert values[("h5ngff_job_slabs_done_total", labels)] == 3
    assert not any(name.startswith("h5ngff_worker_") for name, _ in values)


def _wait_for(
    exporter: MetricsExporter, name: str, worker: str, at_least: float, timeout: float = 60
) -> dict[str, float]:
    deadline = time.time() + timeout
    while time.time() < deadline:
        text = scrape(exporter.port)
        if by_worker(text, name).get(worker, 0) >= at_least:
            return {
                metric: by_worker(text, metric).get(worker, 0)
                for metric in BY_NAME
                if metric.startswith("h5ngff_worker_")
            }
        time.sleep(0.2)
    raise AssertionError(f"{name}{{worker={worker!r}}} never reached {at_least}: {scrape(exporter.port)[-3000:]}")


@pytest.mark.slow
@requires_cgroups
def test_a_killed_worker_is_a_restart_and_an_oom_killed_one_is_an_oom_kill(tmp_path):
    """Real exits of a pod-emulated worker: SIGKILL from outside counts as a nanny restart but
    not as an OOM kill (negative control); a task that outgrows the pod limit is OOM-killed by
    the kernel and counted as one, not as a Dask memory termination."""
    h5 = write_h5(tmp_path / "in.h5", volume((16, 64, 64)))
    spec = spec_for(h5, str(tmp_path / "out.ome.zarr"), resources={"workers": 1})
    # The nanny's terminate threshold off, so the kernel, not Dask, stops the allocation.
    constants = dataclasses.replace(DEFAULT_CONSTANTS, terminate_fraction=False)
    backend = LocalPodsBackend()
    plan = plan_job(spec, backend, constants).plan
    exporter = MetricsExporter(0, "kills", "tests", addr="127.0.0.1")
    try:
        with backend.session(plan) as session, _polled(exporter, session, plan):
            client = session.client
            assert (
                _wait_for(exporter, "h5ngff_worker_cgroup_limit_bytes", "pod-0", 1)["h5ngff_worker_cgroup_limit_bytes"]
                == plan.memory.pod_limit
            )
            (pid,) = client.run(os.getpid).values()
            os.kill(pid, signal.SIGKILL)
            killed = _wait_for(exporter, "h5ngff_worker_nanny_restarts_total", "pod-0", 1)
            assert killed["h5ngff_worker_oom_kills_total"] == 0
            client.wait_for_workers(1, timeout=60)

            def allocate(nbytes: int) -> int:  # local: shipped by value, the workers cannot import tests
                import numpy

                return int(numpy.ones(nbytes, dtype=numpy.uint8).sum())

            future = client.submit(allocate, 2 * plan.memory.pod_limit, pure=False)
            _wait_for(exporter, "h5ngff_worker_oom_kills_total", "pod-0", 1)
            future.cancel()
            # The kernel's count moves at the kill; the nanny logs its restart a moment later.
            oom = _wait_for(exporter, "h5ngff_worker_nanny_restarts_total", "pod-0", 2)
        assert oom["h5ngff_worker_nanny_restarts_total"] >= 2
        assert oom["h5ngff_worker_memory_terminations_total"] == 0
        # The pod's non-reclaimable peak: the killed task filled the pod (the kernel's kill record
        # and the 25 ms samples), and never more than the limit the kernel enforces.
        assert plan.memory.pod_limit // 2 < oom["h5ngff_worker_pod_nonreclaimable_peak_bytes"] <= plan.memory.pod_limit
    finally:
        exporter.close()


@contextmanager
def _polled(exporter: MetricsExporter, session, plan):
    """The exporter fed by the run's one sampler, polling every 0.2 s, as the runner does it."""
    poller = ClusterPoller(session, plan)
    with exporter.attached(poller, plan), poller.running(0.2):
        yield poller


def _hold(nbytes: int) -> int:
    """Runs in a worker (shipped by value): allocate and touch ``nbytes`` and keep them."""
    import builtins
    import os

    import numpy

    builtins._h5ngff_held = numpy.ones(nbytes, dtype=numpy.uint8)
    return os.getpid()


@pytest.mark.slow
def test_the_one_sampler_keeps_a_restarted_workers_peak_and_feeds_report_and_metrics(tmp_path):
    """One poller serves both readers. For the run's report (what MemorySampler did): a worker's
    peak is the highest of any of its processes, so a worker restarted after a spike keeps the
    spike as its peak, and the RSS timeline shows the spike; for the metrics (what ClusterPoller
    did): the exporter serves the same polls. The negative control is the restarted process's
    own high-water mark, which no longer holds the spike."""
    held = 256 << 20
    cluster = LocalCluster(
        n_workers=1,
        threads_per_worker=1,
        memory_limit="2GiB",
        processes=True,
        dashboard_address=None,
        silence_logs=logging.ERROR,
    )
    exporter = MetricsExporter(0, "sampler", "tests", addr="127.0.0.1")
    try:
        with Client(cluster, set_as_default=False) as client:
            register_plugins(client)
            session = Session(client, "local")
            plan = plan_job(
                spec_for(write_h5(tmp_path / "in.h5", volume((16, 64, 64))), str(tmp_path / "out.ome.zarr")),
                LocalBackend(),
            ).plan
            with _polled(exporter, session, plan) as poller:
                (name,) = [str(w["name"]) for w in client.scheduler_info(n_workers=-1)["workers"].values()]
                (pid,) = client.run(_hold, held).values()
                spike = _wait_for(exporter, "h5ngff_worker_rss_bytes", name, held)["h5ngff_worker_rss_bytes"]
                os.kill(pid, signal.SIGKILL)
                _wait_for(exporter, "h5ngff_worker_nanny_restarts_total", name, 1)
                client.wait_for_workers(1, timeout=60)
                deadline = time.time() + 30
                while time.time() < deadline and not (poller.timeline and poller.timeline[-1][2] < held):
                    time.sleep(0.2)  # until a poll has seen the restarted process
                (after,) = client.run(process_memory).values()
            reports = session.worker_reports(plan, poller.peaks, ClusterEvents.collect(client, poller.since))
    finally:
        exporter.close()
        cluster.close()
    assert spike >= held
    assert after["pid"] != pid and after["peak_rss"] < held, after  # the new process never held it
    assert poller.peaks[name] >= held  # ... but the worker's peak did
    (report,) = reports
    assert report.name == name and report.peak_rss >= held and report.nanny_restarts == 1, report
    rss = [r for _, n, r in poller.timeline if n == name]
    assert max(rss) >= held and rss[-1] < held, rss[-5:]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _scrape_until_succeeded(proc: subprocess.Popen, port: int, labels: tuple, timeout: float = 90) -> dict:
    """Scrape a running CLI's exporter until the job with ``labels`` reports phase Succeeded (the
    process must stay alive meanwhile); returns the last scrape's samples."""
    key = ("h5ngff_job_phase", labels + (("phase", "Succeeded"),))
    deadline, values = time.time() + timeout, {}
    while time.time() < deadline and values.get(key) != 1:
        assert proc.poll() is None, proc.communicate()
        try:
            values = samples(scrape(port))
        except OSError:
            pass
        time.sleep(0.2)
    assert values.get(key) == 1
    return values


@pytest.mark.slow
def test_cli_serves_metrics_during_the_run_and_lingers_after_it(shared_cluster, tmp_path):
    """``h5ngff convert --metrics-port --metrics-linger`` (on the shared cluster, to save a start)."""
    h5 = write_h5(tmp_path / "in.h5", volume())
    port = _free_port()
    env = {**os.environ, "H5NGFF_JOB_NAME": "cli-job", "H5NGFF_JOB_NAMESPACE": "cli-ns"}
    cmd = [
        sys.executable,
        "-m",
        "h5ngff.cli",
        "convert",
        f"{h5}:/volume/data",
        str(tmp_path / "out.ome.zarr"),
        "--scheduler",
        shared_cluster.scheduler_address,
        "--json",
        "--metrics-port",
        str(port),
        "--metrics-linger",
        "3",
    ]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        labels = (("conversion_job", "cli-job"), ("conversion_job_namespace", "cli-ns"))
        values = _scrape_until_succeeded(proc, port, labels)
        assert proc.poll() is None, "the process should still be lingering"
        assert any(name == "h5ngff_worker_rss_bytes" and value > 0 for (name, _), value in values.items())
        out, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, err


@pytest.mark.slow
def test_run_job_yaml_serves_metrics_labelled_by_the_manifest(shared_cluster, tmp_path):
    """``h5ngff run job.yaml --metrics-port``: the labels are the ConversionJob's name and namespace,
    as the operator's runner would have them, and progress reaches its total."""
    h5 = write_h5(tmp_path / "in.h5", volume())
    manifest = tmp_path / "job.yaml"
    manifest.write_text(
        "apiVersion: h5ngff.dev/v1alpha1\nkind: ConversionJob\nmetadata: {name: scan-7, namespace: imaging}\n"
        f"spec:\n  source: {{path: {h5}, dataset: /volume/data}}\n  output: {{path: {tmp_path / 'out.ome.zarr'}}}\n"
    )
    port = _free_port()
    cmd = [
        sys.executable,
        "-m",
        "h5ngff.cli",
        "run",
        str(manifest),
        "--scheduler",
        shared_cluster.scheduler_address,
        "--json",
        "--metrics-port",
        str(port),
        "--metrics-linger",
        "3",
    ]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    labels = (("conversion_job", "scan-7"), ("conversion_job_namespace", "imaging"))
    try:
        values = _scrape_until_succeeded(proc, port, labels)
        assert values[("h5ngff_job_slabs_done_total", labels)] == values[("h5ngff_job_planned_slabs", labels)] > 0
        out, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, err
    assert json.loads(out)["status"]["phase"] == "Succeeded"


def test_a_port_in_use_is_an_input_error():
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        with pytest.raises(SpecError, match="--metrics-port: Expected a free TCP port"):
            MetricsExporter(held.getsockname()[1], "busy", addr="127.0.0.1")


@pytest.mark.parametrize("port", [99999, 65536])
def test_a_port_no_machine_has_is_an_input_error(port):
    """bind() refuses these with an OverflowError, not an OSError: it was a traceback, exit 1."""
    with pytest.raises(SpecError, match=f"--metrics-port: Expected a free TCP port.*Got {port}.*0-65535"):
        MetricsExporter(port, "nonsense", addr="127.0.0.1")


@pytest.mark.parametrize("command", ["convert", "run"])
def test_the_exporter_answers_while_the_job_is_planned(shared_cluster, tmp_path, monkeypatch, command):
    """Issue 17: the exporter used to start after planning, so Prometheus's first scrapes of a
    runner were refused. Planning is intercepted here to scrape the port from inside it."""
    from h5ngff import runner
    from h5ngff.cli import main

    h5 = write_h5(tmp_path / "in.h5", volume((16, 64, 64)))
    port = _free_port()
    seen: list[str] = []
    real = runner.plan_job  # convert and run both plan in the one run sequence (runner.execute)

    def planning(*args, **kwargs):
        try:
            seen.append(scrape(port))
        except OSError as exc:
            seen.append(f"refused: {exc}")
        return real(*args, **kwargs)

    monkeypatch.setattr(runner, "plan_job", planning)
    out = tmp_path / "out.ome.zarr"
    if command == "convert":
        argv = ["convert", f"{h5}:/volume/data", str(out)]
    else:
        manifest = tmp_path / "job.yaml"
        manifest.write_text(
            "apiVersion: h5ngff.dev/v1alpha1\nkind: ConversionJob\nmetadata: {name: early}\n"
            f"spec:\n  source: {{path: {h5}, dataset: /volume/data}}\n  output: {{path: {out}}}\n"
        )
        argv = ["run", str(manifest)]
    assert main([*argv, "--scheduler", shared_cluster.scheduler_address, "--json", "--metrics-port", str(port)]) == 0
    (during,) = seen
    from h5ngff import __version__

    assert (
        f'h5ngff_build_info{{conversion_job="{"out" if command == "convert" else "early"}",conversion_job_namespace="local",version="{__version__}"}} 1.0'
        in during
    ), during
    assert "h5ngff_job_phase" not in during  # nothing planned yet: no progress series
