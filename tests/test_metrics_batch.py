"""A batch's metrics (docs/metrics.md, "Batches"): the items by state and the last-progress clock,
fed by the batch's hooks; then a real batch on a real cluster, its exporter scraped over HTTP after
each item (the per-item worker series keep coming from the batch's one cluster)."""

from __future__ import annotations

import dataclasses
import urllib.request
from types import SimpleNamespace

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from conftest import smooth, spec_for, write_h5
from h5ngff.backends.external import ExternalBackend
from h5ngff.batch import run as batch_run
from h5ngff.batch.items import batch_items
from h5ngff.batch.run import BatchHooks, run_batch
from h5ngff.engine.progress import Progress
from h5ngff.metrics import batch as batch_metrics
from h5ngff.metrics.batch import BatchMetrics
from h5ngff.phases import ITEM_STATES, ITEMS_TO_DO
from h5ngff.metrics.exporter import JOB_NAME_ENV, JOB_NAMESPACE_ENV, MetricsExporter, _shared_directory
from h5ngff.metrics.families import ExportState, build_families


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch) -> Clock:
    clock = Clock()
    monkeypatch.setattr(batch_metrics.time, "time", clock)
    return clock


def result(status="NotRun", n_tasks=10):
    return SimpleNamespace(
        status=status, job=SimpleNamespace(plan=SimpleNamespace(n_tasks=n_tasks)) if n_tasks else None
    )


def scraped(metrics: BatchMetrics) -> dict[tuple[str, str], float]:
    """One scrape's batch samples, by (metric, state)."""
    registry = CollectorRegistry(auto_describe=False)

    class Collector:
        def collect(self):
            return build_families("run-7", "imaging", ExportState(batch=metrics.figures()))

    registry.register(Collector())
    out = {}
    for family in text_string_to_metric_families(generate_latest(registry).decode()):
        for s in family.samples:
            if s.name.startswith("h5ngff_batch_"):
                assert (s.labels["conversion_job"], s.labels["conversion_job_namespace"]) == ("run-7", "imaging")
                out[(s.name, s.labels.get("state", ""))] = s.value
    return out


def states(metrics: BatchMetrics) -> dict[str, float]:
    return {state: v for (name, state), v in scraped(metrics).items() if name == "h5ngff_batch_items" and v}


def test_items_by_state_follow_the_hooks_and_always_sum_to_the_batch(clock):
    metrics = BatchMetrics(3, lambda figures: None)
    assert states(metrics) == {"Pending": 3}  # from the start, before any item is planned
    assert ("h5ngff_batch_planned_slabs", "") not in scraped(metrics)
    items = [result(), result(n_tasks=20), result("Refused", n_tasks=40)]  # refused: its plan did not fit the cluster
    metrics.on_planned(SimpleNamespace(results=items))
    assert states(metrics) == {"Pending": 2, "Refused": 1}
    assert scraped(metrics)[("h5ngff_batch_planned_slabs", "")] == 30
    listen = metrics.listener(items[0])
    listen(Progress(phase="Planned", slabs_total=10))
    assert states(metrics) == {"Pending": 1, "Running": 1, "Refused": 1}
    listen(Progress(phase="Writing", slabs_total=10, slabs_done=4))
    assert scraped(metrics)[("h5ngff_batch_slabs_done_total", "")] == 4
    items[0].status = "Done"
    listen(Progress(phase="Succeeded", slabs_total=10, slabs_done=10))
    metrics.on_item(items[0])
    assert states(metrics) == {"Done": 1, "Pending": 1, "Refused": 1}
    # A --fail-fast batch stops: the item it never ran is NotRun, not left to do.
    metrics.finished(SimpleNamespace(results=items))
    assert states(metrics) == {"Done": 1, "NotRun": 1, "Refused": 1}
    samples = scraped(metrics)
    assert {state for name, state in samples if name == "h5ngff_batch_items"} == set(
        ITEM_STATES
    )  # every state, zeros included
    assert samples[("h5ngff_batch_slabs_done_total", "")] == 10 and samples[("h5ngff_batch_planned_slabs", "")] == 30


def test_the_clock_moves_on_each_step_and_only_then(clock):
    metrics = BatchMetrics(2, lambda figures: None)
    stamp = lambda: scraped(metrics)[("h5ngff_batch_last_progress_timestamp_seconds", "")]  # noqa: E731
    assert stamp() == 1000.0
    clock.now = 1010.0
    spec = metrics.planning(lambda item: f"spec of {item}")
    assert spec("a") == "spec of a" and stamp() == 1010.0  # an item's planning starts
    items = [result(), result()]
    clock.now = 1020.0
    metrics.on_planned(SimpleNamespace(results=items))
    listen = metrics.listener(items[0])
    clock.now = 1030.0
    listen(Progress(phase="Writing", slabs_total=10, slabs_done=3))
    assert stamp() == 1030.0
    clock.now = 1040.0
    listen(Progress(phase="Writing", slabs_total=10, slabs_done=3, bytes_read=99))  # the same step again: no progress
    assert stamp() == 1030.0
    clock.now = 1050.0
    listen(Progress(phase="Writing", slabs_total=10, slabs_done=4))
    assert stamp() == 1050.0
    clock.now = 1060.0
    listen(Progress(phase="Finalizing", slabs_total=10, slabs_done=4))  # a phase change is progress
    assert stamp() == 1060.0


def test_around_feeds_the_metrics_and_the_callers_hooks():
    seen = []
    caller = BatchHooks(
        on_planned=lambda s: seen.append("planned"),
        listeners=lambda r: [lambda p: seen.append(p.phase)],
        on_item=lambda r: seen.append(r.status),
    )
    metrics = BatchMetrics(1, lambda figures: None)
    hooks = metrics.around(caller)
    assert isinstance(hooks, BatchHooks)
    item = result()
    hooks.on_planned(SimpleNamespace(results=[item]))
    listeners = hooks.listeners(item)
    assert len(listeners) == 2
    for listen in listeners:
        listen(Progress(phase="Writing", slabs_total=10, slabs_done=1))
    item.status = "Failed"
    hooks.on_item(item)
    assert seen == ["planned", "Writing", "Failed"]
    assert states(metrics) == {"Failed": 1}


def test_a_broken_update_is_logged_and_never_stops_the_batch(caplog):
    """Negative control of the guard: an item the metrics never saw planned is an error, logged."""
    metrics = BatchMetrics(1, lambda figures: None)
    metrics.on_item(result("Done"))  # no on_planned: unknown item
    assert "batch metrics: an update failed" in caplog.text
    assert states(metrics) == {"Pending": 1}


def test_the_exported_states_cover_every_outcome_of_a_batch():
    outcomes = {batch_run.DONE, batch_run.COMPLETE, batch_run.REFUSED, batch_run.FAILED, batch_run.NOT_RUN}
    assert outcomes <= set(ITEM_STATES) and batch_metrics.NOT_RUN == batch_run.NOT_RUN
    assert set(ITEM_STATES) - outcomes == set(ITEMS_TO_DO)


@pytest.mark.parametrize(
    "outputs, name",
    [
        (["out/a.ome.zarr", "out/b.ome.zarr"], "out"),
        (["/data/run-3/x/a.ome.zarr", "/data/run-3/y/b.ome.zarr"], "run-3"),
        (["s3://bucket/lab/a.ome.zarr", "s3://bucket/lab/b.ome.zarr"], "lab"),
        (["a.ome.zarr", "/abs/b.ome.zarr"], "batch"),
    ],
)
def test_a_batch_is_labelled_by_the_directory_its_outputs_share(outputs, name):
    assert _shared_directory(outputs) == name


@pytest.mark.slow  # the HTTP server takes 0.5 s to shut down
def test_for_batch_labels_from_the_outputs_unless_the_runner_names_the_batch(monkeypatch):
    monkeypatch.delenv(JOB_NAME_ENV, raising=False)
    monkeypatch.delenv(JOB_NAMESPACE_ENV, raising=False)
    exporter = MetricsExporter.for_batch(["out/a.ome.zarr", "out/b.ome.zarr"], 0, addr="127.0.0.1")
    try:
        assert (exporter.job, exporter.namespace) == ("out", "local")
        assert exporter.batch is not None and exporter.batch.figures().states == ("Pending", "Pending")
    finally:
        exporter.close()


def scrape(port: int) -> dict[tuple[str, tuple], float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        text = r.read().decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for f in text_string_to_metric_families(text)
        for s in f.samples
    }


@pytest.mark.integration
@pytest.mark.slow
@pytest.mark.parametrize("in_flight", [1, 2])
def test_a_batch_on_a_real_cluster_serves_its_items_and_each_items_workers(
    shared_cluster, tmp_path, monkeypatch, in_flight
):
    """Three good files and one that is not HDF5, on the shared cluster: after each item a scrape
    of the exporter's HTTP endpoint shows the items done so far, the refused one, and the batch's
    workers' memory series from that item's run. Two items in flight: the item still running is
    Running, and the worker series stay those of the cluster."""
    monkeypatch.setenv(JOB_NAME_ENV, "lab-run")
    monkeypatch.setenv(JOB_NAMESPACE_ENV, "imaging")
    day = tmp_path / "runs"
    day.mkdir()
    for i in range(3):
        write_h5(day / f"cell_{i}.h5", smooth((16, 96, 80), "uint16", seed=i))
    (day / "cell_3.h5").write_bytes(b"not an HDF5 file")
    items = batch_items([f"{day}/*.h5:/volume/data"], str(tmp_path / "out" / "{stem}.ome.zarr"))
    exporter = MetricsExporter.for_batch([item.output for item in items], 0, addr="127.0.0.1")
    labels = (("conversion_job", "lab-run"), ("conversion_job_namespace", "imaging"))

    def item_states(values):
        return {dict(k[1])["state"]: v for k, v in values.items() if k[0] == "h5ngff_batch_items" and v}

    scrapes, running_scrapes = [], []

    def after_item(r) -> None:
        scrapes.append(scrape(exporter.port))

    def scrape_while_running(result):
        """At an item's first progress event (after the exporter's own listener has seen it)."""
        first = []

        def listen(progress) -> None:
            if not first:
                first.append(progress)
                running_scrapes.append(item_states(scrape(exporter.port)))

        return [listen]

    try:
        assert item_states(scrape(exporter.port)) == {"Pending": 4}  # served before planning
        assert exporter.batch is not None
        hooks = exporter.batch.around(BatchHooks(on_item=after_item, listeners=scrape_while_running))
        backend = ExternalBackend(shared_cluster.scheduler_address)
        summary = run_batch(
            items,
            exporter.batch.planning(lambda item: spec_for(item.path, item.output, output={"chunks": [16, 48, 40]})),
            backend,
            hooks=hooks,
            metrics=exporter,
            items_in_flight=in_flight,
        )
        exporter.batch.finished(summary)
        final = scrape(exporter.port)
    finally:
        exporter.close()
    assert [r.status for r in summary.results] == ["Done", "Done", "Done", "Refused"]
    # While an item runs, the exporter counts at least one item Running (its first event is
    # in the figures before any listener after the exporter's own sees it).
    assert len(running_scrapes) == 3 and all(s.get("Running", 0) >= 1 for s in running_scrapes), running_scrapes
    if in_flight == 1:
        assert not any(r.beside for r in summary.results)  # the overlap check below can fail
        assert [item_states(s) for s in scrapes] == [
            {"Done": k, "Pending": 3 - k, "Refused": 1} if k < 3 else {"Done": 3, "Refused": 1} for k in (1, 2, 3)
        ]
    else:  # after the k-th item ends, the others are Running (at most one) or Pending
        # At least k Done: the item beside it may end while this one's hook scrapes (a loaded
        # machine showed Done 2 in the first item's scrape).
        for k, states in enumerate(map(item_states, scrapes), 1):
            assert states.get("Done", 0) >= k and states.get("Refused") == 1, states
            assert states.get("Running", 0) <= 1 and sum(states.values()) == 4, states
        assert item_states(scrapes[-1]).get("Done") == 3
        # Two were launched together: the batch's own record of the items beside each one (what
        # sizes their shared memory allowance). A scrape after an item's end need not catch
        # another Running: two small items can end within one scrape, which failed this once.
        assert any(r.beside for r in summary.results)
    workers = {str(name) for name in shared_cluster.workers}
    for values in scrapes:  # each item's run polled the batch's cluster
        rss = {
            dict(k[1])["worker"]: v
            for k, v in values.items()
            if k[0] == "h5ngff_worker_rss_bytes" and k[1][:2] == labels
        }
        assert set(rss) == workers and all(v > 0 for v in rss.values()), rss
        if in_flight == 1:
            assert values[("h5ngff_job_phase", labels + (("phase", "Succeeded"),))] == 1  # the item just ended
    planned = sum(r.job.plan.n_tasks for r in summary.results if r.job)
    assert final[("h5ngff_batch_planned_slabs", labels)] == planned == final[("h5ngff_batch_slabs_done_total", labels)]
    assert item_states(final) == {"Done": 3, "Refused": 1}
    assert (
        0
        < final[("h5ngff_batch_last_progress_timestamp_seconds", labels)]
        <= final[("h5ngff_exporter_last_poll_timestamp_seconds", labels)] + 60
    )


def test_figures_are_immutable_snapshots():
    """The exporter copies its state shallowly under its lock: the batch figures it holds must not
    change under a scrape."""
    metrics = BatchMetrics(1, lambda figures: None)
    figures = metrics.figures()
    assert figures is not None and dataclasses.is_dataclass(figures)
    with pytest.raises(dataclasses.FrozenInstanceError):
        figures.states = ()  # type: ignore[misc]
    assert isinstance(figures.states, tuple)


def test_a_batch_takes_metrics_port_but_still_refuses_memory_report(tmp_path):
    """--memory-report stays one conversion's (a batch's summary shows each item against its
    plan); the refusal comes before anything is expanded or started."""
    from argparse import Namespace

    from rich.console import Console

    from h5ngff.clibatch import convert_batch
    from h5ngff.errors import SpecError

    with pytest.raises(SpecError, match="--memory-report"):
        convert_batch(
            [f"{tmp_path}/*.h5:/data"],
            str(tmp_path / "{stem}.ome.zarr"),
            Namespace(memory_report="r.html", metrics_port=9464),
            Console(),
        )
    # --metrics-port passes the check: the batch goes on to expand its (here missing) sources.
    with pytest.raises(SpecError) as refused:
        convert_batch(
            [f"{tmp_path}/*.h5:/data"],
            str(tmp_path / "{stem}.ome.zarr"),
            Namespace(memory_report=None, metrics_port=9464),
            Console(),
        )
    assert "--memory-report" not in str(refused.value) and "--metrics-port" not in str(refused.value)
