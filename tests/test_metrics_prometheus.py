"""A real Prometheus server scrapes the exporter of a real conversion; every PromQL expression of
the shipped dashboard and rule file must then return series with our labels and plausible values.

The conversion runs in pod emulation (each worker in its own memory cgroup limited to the planned
pod limit) where memory cgroups are writable, so the cgroup panels have data; elsewhere it runs on
a plain LocalCluster and only the cgroup expressions may be empty.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass, field

import numpy as np
import pytest
import yaml

from conftest import smooth, spec_for, write_h5
from h5ngff.backends.cgroups import cgroups_available
from h5ngff.backends.local import LocalBackend, LocalPodsBackend
from h5ngff.metrics.assets import (
    RULES,
    Query,
    asset_path,
    dashboard_queries,
    load_dashboard,
    load_rules,
    referenced_metrics,
    rule_queries,
    substitute,
)
from h5ngff.metrics.exporter import JOB_NAME_ENV, JOB_NAMESPACE_ENV, MetricsExporter
from h5ngff.metrics.families import CATALOGUE
from h5ngff.metrics.operator import OPERATOR_METRICS, OperatorMetrics
from h5ngff.runner import plan_job, run_job

PROMETHEUS = "/usr/bin/prometheus"
PROMTOOL = shutil.which("promtool") or "/usr/bin/promtool"
pytestmark = [
    pytest.mark.skipif(
        not os.path.exists(PROMETHEUS),
        reason=f"{PROMETHEUS} is absent (Debian package prometheus; scripts/setup installs it)",
    ),
    pytest.mark.integration,
    pytest.mark.slow,
]

JOB, NAMESPACE, SCRAPE_JOB = "scrape-test", "h5ngff-tests", "h5ngff"
OPERATOR_SCRAPE_JOB = "h5ngff-operator"
POD_MONITOR_LABELS = {"namespace": NAMESPACE, "pod": f"{JOB}-runner-1-abcde", "container": "runner"}
BATCH_METRICS = {m.name for m in CATALOGUE if m.name.startswith("h5ngff_batch_")}
CGROUP_METRICS = {
    "h5ngff_worker_cgroup_usage_bytes",
    "h5ngff_worker_cgroup_working_set_bytes",
    "h5ngff_worker_cgroup_limit_bytes",
    "h5ngff_worker_pod_nonreclaimable_bytes",
    "h5ngff_worker_pod_nonreclaimable_peak_bytes",
}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class PrometheusServer:
    """/usr/bin/prometheus on a loopback port, scraping ``target`` every 0.5 s, with our rules."""

    def __init__(self, directory, target: str, operator_target: str):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        config = {
            "global": {"scrape_interval": "500ms", "scrape_timeout": "400ms", "evaluation_interval": "500ms"},
            "rule_files": [asset_path(RULES)],
            # The target labels a PodMonitor adds (namespace, pod, container): exported labels of
            # the same names would be renamed exported_*, and the dashboard would filter on nothing.
            "scrape_configs": [
                {"job_name": SCRAPE_JOB, "static_configs": [{"targets": [target], "labels": POD_MONITOR_LABELS}]},
                {
                    "job_name": OPERATOR_SCRAPE_JOB,
                    "static_configs": [{"targets": [operator_target], "labels": {"namespace": "h5ngff-system"}}],
                },
            ],
        }
        path = os.path.join(directory, "prometheus.yml")
        with open(path, "w") as f:
            yaml.safe_dump(config, f)
        self.log = open(os.path.join(directory, "prometheus.log"), "wb")
        self.process = subprocess.Popen(
            [
                PROMETHEUS,
                f"--config.file={path}",
                f"--storage.tsdb.path={os.path.join(directory, 'tsdb')}",
                f"--web.listen-address=127.0.0.1:{self.port}",
                "--log.level=warn",
            ],
            stdout=self.log,
            stderr=subprocess.STDOUT,
        )

    def api(self, path: str, **params) -> dict:
        url = f"{self.url}/api/v1/{path}?{urllib.parse.urlencode(params)}"
        try:
            with urllib.request.urlopen(url, timeout=10) as r:
                body = json.load(r)
        except urllib.error.HTTPError as exc:  # a PromQL error: say which query and why
            if exc.code == 503:  # the server answers before its TSDB is open: wait() tries again
                raise ConnectionError(f"Prometheus is not ready yet (503) for {params}") from None
            raise AssertionError(f"Prometheus rejected {params}: {exc.read().decode()}") from None
        assert body["status"] == "success", body
        return body["data"]

    def wait(self, expr: str, timeout: float = 30) -> list:
        deadline = time.time() + timeout
        while time.time() < deadline:
            assert self.process.poll() is None, f"prometheus exited: {open(self.log.name).read()[-2000:]}"
            try:
                result = self.api("query", query=expr)["result"]
                if result:
                    return result
            except OSError:
                pass
            time.sleep(0.2)
        raise AssertionError(f"Prometheus never returned {expr!r} within {timeout} s")

    def rounds(self, n: int, timeout: float = 30) -> None:
        """Wait until every target has been scraped, and every rule group evaluated, ``n`` more
        times: counted in the server's own /targets and /rules answers (each new lastScrape or
        lastEvaluation is one), not guessed from the intervals with a sleep."""

        def stamps() -> dict[str, str]:
            targets = {f"scrape {t['scrapeUrl']}": t["lastScrape"] for t in self.api("targets")["activeTargets"]}
            return targets | {f"rules {g['name']}": g["lastEvaluation"] for g in self.api("rules")["groups"]}

        seen = {key: {stamp} for key, stamp in stamps().items()}
        deadline = time.time() + timeout
        while any(len(s) <= n for s in seen.values()):
            assert time.time() < deadline, (
                f"Prometheus did not scrape and evaluate {n} more times within {timeout} s: {seen}"
            )
            time.sleep(0.1)
            for key, stamp in stamps().items():
                seen.setdefault(key, set()).add(stamp)

    def range(self, expr: str, start: float, end: float) -> list:
        return self.api("query_range", query=expr, start=f"{start:.3f}", end=f"{end:.3f}", step="0.5")["result"]

    def stop(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(timeout=15)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        self.log.close()


@dataclass
class Scraped:
    prom: PrometheusServer
    start: float
    end: float
    summary: object
    pod_limit: int
    workers: set[str]
    pods: bool
    exposition: str
    writing_seen: list = field(default_factory=list)


@pytest.fixture(scope="module")
def scraped(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("prometheus")
    exporter = MetricsExporter(0, JOB, NAMESPACE, addr="127.0.0.1")  # the runner polls every 0.5 s
    # The operator's own metrics, for the dashboard's Operator row: two jobs seen, passes, an error.
    operator = OperatorMetrics()
    operator.observe(NAMESPACE, JOB, "Running")
    operator.observe(NAMESPACE, "older", "Succeeded")
    operator.reconciled(NAMESPACE, JOB)
    operator.reconcile_error("transient")
    operator_server, _ = operator.serve(0, addr="127.0.0.1")
    # Started first: Prometheus's service discovery hands out targets only after ~5 s.
    prom = PrometheusServer(str(tmp), f"127.0.0.1:{exporter.port}", f"127.0.0.1:{operator_server.server_port}")
    try:
        # 128 slab tasks of 32x64x64: seconds of writing, so 0.5 s scrapes see it part-way through.
        shape = (64, 512, 512)
        data = (np.arange(np.prod(shape), dtype=np.uint32) * 7919 % 65521).astype(np.uint16).reshape(shape)
        h5 = write_h5(tmp / "in.h5", data)
        spec = spec_for(
            h5,
            str(tmp / "out.ome.zarr"),
            output={"chunks": [16, 32, 32]},
            resources={"workers": 2, "slab": [32, 64, 64]},
            pyramid={"levels": 2},
        )
        pods = cgroups_available() is None
        backend = LocalPodsBackend() if pods else LocalBackend()
        job = plan_job(spec, backend)
        prom.wait(f'up{{job="{SCRAPE_JOB}"}} == 1')
        start = time.time()
        summary = run_job(job, backend, metrics=exporter)
        prom.wait('h5ngff_job_phase{phase="Succeeded"} == 1', timeout=10)
        with urllib.request.urlopen(f"http://127.0.0.1:{exporter.port}/metrics") as r:
            exposition = r.read().decode()
        prom.rounds(2)  # two more scrapes and rule evaluations of the final state
        end = time.time()
        workers = {w.name for w in summary.workers}
        yield Scraped(prom, start, end, summary, job.plan.memory.pod_limit, workers, pods, exposition)
    finally:
        prom.stop()
        exporter.close()
        operator_server.shutdown()
        operator_server.server_close()


def relax(expr: str) -> str:
    """An alert expression with its thresholds (``> N``) replaced by ``>= 0``: on a healthy run the
    real expression is (rightly) empty, so the relaxed one shows its selectors, joins and labels
    match real series. The real thresholds are proven by the promtool unit tests."""
    return re.sub(r"(?<![<>=!])>=?\s*[0-9][0-9.eE+]*", ">= 0", expr)


def substituted(query: Query, workers: set[str], job: str = JOB) -> str:
    # The job names and NAMESPACE hold no regex metacharacters, so they stand for themselves in =~ matchers.
    expr = substitute(
        query.expr, {"job": job, "namespace": NAMESPACE, "worker": "|".join(sorted(workers)), "__rate_interval": "2s"}
    )
    return f"count by ({query.label}) ({expr})" if query.label else expr


def check_series(result: list, query: Query, workers: set[str], job: str = JOB) -> list[str]:
    """Problems with one expression's result: empty, wrong labels, implausible values."""
    if not result:
        return [f"{query.where}: no series for {query.expr!r}"]
    problems = []
    for series in result:
        labels, values = (
            series["metric"],
            [float(v) for _, v in series.get("values", [series.get("value", [0, "nan"])])],
        )
        if query.label:
            if labels.get(query.label) in (None, ""):
                problems.append(f"{query.where}: no {query.label!r} label in {labels}")
            continue
        if referenced_metrics(query.expr) <= set(OPERATOR_METRICS) and "conversion_job=~" not in query.expr:
            # The operator's series carry no job labels; they come from its own scrape job.
            if labels.get("job", OPERATOR_SCRAPE_JOB) != OPERATOR_SCRAPE_JOB or any(
                k.startswith("exported_") for k in labels
            ):
                problems.append(
                    f"{query.where}: operator series from the wrong target or with clashing labels: {labels}"
                )
            if not all(math.isfinite(v) and v >= 0 for v in values):
                problems.append(f"{query.where}: values not finite and >= 0: {values[:5]}")
            continue
        if labels.get("conversion_job") != job or labels.get("conversion_job_namespace") != NAMESPACE:
            problems.append(
                f"{query.where}: labels {labels} lack conversion_job={job!r} conversion_job_namespace={NAMESPACE!r}"
            )
        if labels.get("job", SCRAPE_JOB) != SCRAPE_JOB or any(k.startswith("exported_") for k in labels):
            problems.append(f"{query.where}: our labels clash with Prometheus's target labels: {labels}")
        if "worker" in labels and labels["worker"] not in workers:
            problems.append(f"{query.where}: worker {labels['worker']!r} is not one of {sorted(workers)}")
        if not all(math.isfinite(v) and v >= 0 for v in values):
            problems.append(f"{query.where}: values not finite and >= 0: {values[:5]}")
    return problems


def all_queries() -> list[Query]:
    rules = [Query(q.where, relax(q.expr)) for q in rule_queries(load_rules())]
    return dashboard_queries(load_dashboard()) + rules


def test_every_dashboard_and_rule_expression_returns_labelled_plausible_series(scraped):
    problems = []
    for query in all_queries():
        if not scraped.pods and referenced_metrics(query.expr) <= CGROUP_METRICS:
            continue  # plain LocalCluster: the workers share the test's cgroup, nothing to show
        if referenced_metrics(query.expr) <= BATCH_METRICS:
            continue  # one conversion, not a batch: the batch's scrape below checks these
        expr = substituted(query, scraped.workers)
        problems += check_series(scraped.prom.range(expr, scraped.start, scraped.end), query, scraped.workers)
    assert not problems, "\n".join(problems)


def test_the_check_fails_for_a_metric_the_exporter_does_not_export(scraped):
    """Negative control: the same check, on a panel with a made-up metric, reports it."""
    fake = Query(
        "panel 'made up' A",
        'h5ngff_worker_made_up_bytes{conversion_job=~"$job",conversion_job_namespace=~"$namespace"}',
    )
    problems = check_series(
        scraped.prom.range(substituted(fake, scraped.workers), scraped.start, scraped.end), fake, scraped.workers
    )
    assert problems and "no series" in problems[0]
    other = check_series(
        scraped.prom.range(
            'label_replace(h5ngff_worker_rss_bytes, "conversion_job", "other", "", "")', scraped.start, scraped.end
        ),
        fake,
        scraped.workers,
    )
    assert other and "lack conversion_job" in other[0]


def _instant(scraped, expr: str) -> dict[str, float]:
    result = scraped.prom.api("query", query=expr, time=f"{scraped.end:.3f}")["result"]
    return {s["metric"].get("worker", s["metric"].get("phase", "")): float(s["value"][1]) for s in result}


def test_worker_memory_is_positive_and_within_the_pod_limit(scraped):
    sel = f'{{conversion_job="{JOB}",conversion_job_namespace="{NAMESPACE}"}}'
    rss = scraped.prom.range(f"h5ngff_worker_rss_bytes{sel}", scraped.start, scraped.end)
    assert {s["metric"]["worker"] for s in rss} == scraped.workers
    for series in rss:
        values = [float(v) for _, v in series["values"]]
        assert 0 < min(values) and max(values) <= scraped.pod_limit, (series["metric"], max(values), scraped.pod_limit)
    plan = scraped.summary.job.plan
    assert set(_instant(scraped, f"h5ngff_worker_memory_limit_bytes{sel}").values()) == {plan.memory.memory_limit}
    assert set(_instant(scraped, f"h5ngff_worker_pod_limit_bytes{sel}").values()) == {scraped.pod_limit}
    process = _instant(scraped, 'sum by (worker) (h5ngff_worker_memory_bytes{type!="spilled"})')
    assert all(0 < v <= scraped.pod_limit for v in process.values()), process
    if scraped.pods:  # the kernel's limit on each pod's cgroup is the planned one, and it held
        assert set(_instant(scraped, f"h5ngff_worker_cgroup_limit_bytes{sel}").values()) == {scraped.pod_limit}
        peak_ws = scraped.prom.api(
            "query", query=f"max_over_time(h5ngff_worker_cgroup_working_set_bytes{sel}[5m])", time=f"{scraped.end:.3f}"
        )["result"]
        assert all(0 < float(s["value"][1]) <= scraped.pod_limit for s in peak_ws)


def test_progress_reaches_the_total_and_matches_the_run(scraped):
    sel = f'{{conversion_job="{JOB}",conversion_job_namespace="{NAMESPACE}"}}'
    totals = scraped.summary.totals
    planned = scraped.summary.job.plan.n_tasks
    assert _instant(scraped, f"h5ngff_job_planned_slabs{sel}") == {"": planned}
    assert _instant(scraped, f"h5ngff_job_slabs_done_total{sel}") == {"": planned}
    assert _instant(scraped, f"h5ngff_job_read_bytes_total{sel}") == {"": totals.bytes_read}
    assert _instant(scraped, f"h5ngff_job_written_bytes_total{sel}") == {"": totals.bytes_written}
    assert _instant(scraped, f"h5ngff_job_phase{sel} == 1") == {"Succeeded": 1.0}
    # Prometheus saw the job while it was writing, part-way through, not only the final state.
    done = scraped.prom.range(f"h5ngff_job_slabs_done_total{sel}", scraped.start, scraped.end)[0]["values"]
    assert any(0 < float(v) < planned for _, v in done), "no scrape caught the job mid-run"
    writing = scraped.prom.range('h5ngff_job_phase{phase="Writing"} == 1', scraped.start, scraped.end)
    assert writing and len(writing[0]["values"]) >= 2


def test_alerts_stay_silent_on_a_healthy_run_and_every_rule_evaluates(scraped):
    groups = scraped.prom.api("rules")["groups"]
    rules = [r for g in groups for r in g["rules"]]
    assert {r["name"] for r in rules} == {q.where.split(" ", 1)[1] for q in rule_queries(load_rules())}
    assert all(r["health"] == "ok" and not r.get("lastError") for r in rules), rules
    assert not scraped.prom.range('ALERTS{alertname=~"H5ngff.*"}', scraped.start, scraped.end)
    for query in rule_queries(load_rules()):  # the real thresholds: empty throughout the run
        assert not scraped.prom.range(query.expr, scraped.start, scraped.end), query.where
    ratio = rule_queries(load_rules())[0]
    values = [
        float(v) for s in scraped.prom.range(relax(ratio.expr), scraped.start, scraped.end) for _, v in s["values"]
    ]
    assert values and 0 < max(values) <= 0.9


def test_promtool_check_metrics_passes_on_the_real_scrape(scraped):
    assert "h5ngff_worker_rss_bytes{" in scraped.exposition
    result = subprocess.run([PROMTOOL, "check", "metrics"], input=scraped.exposition, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
    # Negative control: the same scrape with a counter re-typed as a gauge (a gauge named *_total).
    bad = scraped.exposition.replace(
        "# TYPE h5ngff_job_slabs_done_total counter", "# TYPE h5ngff_job_slabs_done_total gauge"
    )
    result = subprocess.run([PROMTOOL, "check", "metrics"], input=bad, capture_output=True, text=True)
    assert result.returncode != 0 and "_total" in result.stdout + result.stderr


def test_no_label_is_renamed_under_pod_monitor_target_labels(scraped):
    """Issue 17: with a PodMonitor's target labels (namespace, pod, container) on the scrape, the
    exporter's own labels keep their names: nothing becomes exported_*. Before the rename its
    ``namespace`` label became ``exported_namespace`` here."""
    renamed = scraped.prom.range(
        '{__name__=~"h5ngff_.+", exported_namespace!=""} or {__name__=~"h5ngff_.+", exported_job!=""}',
        scraped.start,
        scraped.end,
    )
    assert renamed == []
    (series,) = scraped.prom.range(f'h5ngff_job_planned_slabs{{conversion_job="{JOB}"}}', scraped.start, scraped.end)
    assert series["metric"]["conversion_job_namespace"] == series["metric"]["namespace"] == NAMESPACE


# --- a batch: h5ngff convert with a glob and --metrics-port, scraped -----------------------------

BATCH_JOB = "batch-test"


@dataclass
class BatchScraped:
    prom: PrometheusServer
    start: float
    end: float
    result: dict
    workers: set[str]


def _scraped_once(prom: PrometheusServer, port: int) -> bool:
    """Prometheus has tried the target on ``port`` at least once (up or not)."""
    try:
        targets = prom.api("targets")["activeTargets"]
    except OSError:  # not listening, or its TSDB not open, yet
        return False
    return any(f":{port}/" in t["scrapeUrl"] and not t["lastScrape"].startswith("0001-") for t in targets)


@pytest.fixture(scope="module")
def batch_scraped(tmp_path_factory, shared_cluster):
    """Three files and one that is not HDF5 through ``h5ngff convert 'runs/*.h5:/volume/data'
    'out/{stem}.ome.zarr' --metrics-port`` on the shared cluster, scraped every 0.5 s from before
    the process starts until it has lingered past the end."""
    tmp = tmp_path_factory.mktemp("prometheus-batch")
    runs = tmp / "runs"
    runs.mkdir()
    for i in range(3):  # 128 slabs each: a second or so per item, so 0.5 s scrapes see each run
        write_h5(runs / f"cell_{i}.h5", smooth((128, 256, 256), "uint16", seed=i))
    (runs / "cell_3.h5").write_bytes(b"not an HDF5 file")
    port = free_port()
    prom = PrometheusServer(
        str(tmp), f"127.0.0.1:{port}", f"127.0.0.1:{free_port()}"
    )  # no operator here: its target stays down
    try:
        deadline = time.time() + 30
        while not _scraped_once(prom, port):  # the target is known and scraped before the batch starts
            assert time.time() < deadline, "Prometheus never tried the batch's target"
            time.sleep(0.2)
        env = {**os.environ, JOB_NAME_ENV: BATCH_JOB, JOB_NAMESPACE_ENV: NAMESPACE}
        cmd = [
            sys.executable,
            "-m",
            "h5ngff.cli",
            "convert",
            f"{runs}/*.h5:/volume/data",
            str(tmp / "out" / "{stem}.ome.zarr"),
            "--scheduler",
            shared_cluster.scheduler_address,
            "--chunks",
            "16,64,64",
            "--slab",
            "16,64,64",
            "--levels",
            "2",
            "--items-in-flight",  # one at a time, so the 0.5 s scrapes see each item end apart
            "1",  # (two in flight: tests/test_metrics_batch.py)
            "--json",
            "--metrics-port",
            str(port),
            "--metrics-linger",
            "3",
        ]
        start = time.time()
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240)
        end = time.time()
        assert proc.returncode == 1, proc.stderr  # the bad file is refused: not every item converted
        yield BatchScraped(prom, start, end, json.loads(proc.stdout), {str(name) for name in shared_cluster.workers})
    finally:
        prom.stop()


def _batch_series(scraped: BatchScraped, expr: str) -> dict[str, list[float]]:
    return {
        s["metric"].get("state", ""): [float(v) for _, v in s["values"]]
        for s in scraped.prom.range(expr, scraped.start, scraped.end)
    }


def test_a_scraped_cli_batch_shows_its_items_by_state_and_its_progress(batch_scraped):
    assert [r["status"] for r in batch_scraped.result["results"]] == ["Done", "Done", "Done", "Refused"]
    sel = f'conversion_job="{BATCH_JOB}",conversion_job_namespace="{NAMESPACE}"'
    items = _batch_series(batch_scraped, f"h5ngff_batch_items{{{sel}}}")
    assert set(items) == {"Pending", "Running", "Done", "Complete", "Refused", "Failed", "NotRun"}
    totals = [sum(values) for values in zip(*items.values())]
    assert totals and set(totals) == {4}  # every scrape: the four items, in one state each
    assert items["Done"][0] == 0  # the first scrape came before any item ended
    assert items["Done"][-1] == 3 and items["Refused"][-1] == 1 and items["Pending"][-1] == items["Running"][-1] == 0
    assert any(0 < done < 3 for done in items["Done"]), "no scrape caught the batch part-way"
    assert max(items["Running"]) == 1, "no scrape caught an item running"
    assert max(items["Failed"] + items["Complete"] + items["NotRun"]) == 0
    (planned,) = _batch_series(batch_scraped, f"h5ngff_batch_planned_slabs{{{sel}}}").values()
    (done,) = _batch_series(batch_scraped, f"h5ngff_batch_slabs_done_total{{{sel}}}").values()
    assert planned[-1] == done[-1] > 0 and done == sorted(done)  # the counter reaches the plan and never goes down


def test_every_dashboard_and_rule_expression_works_on_a_batch(batch_scraped):
    """The whole dashboard on the batch's scrape: its Batch row, and the Job and Worker rows fed by
    each item's run on the batch's one cluster (the workers' names are the cluster's)."""
    problems = []
    for query in all_queries():
        metrics = referenced_metrics(query.expr)
        if metrics <= CGROUP_METRICS or metrics <= set(OPERATOR_METRICS):
            continue  # a plain cluster, and no operator here: the run's scrape above checks these
        expr = substituted(query, batch_scraped.workers, BATCH_JOB)
        problems += check_series(
            batch_scraped.prom.range(expr, batch_scraped.start, batch_scraped.end),
            query,
            batch_scraped.workers,
            BATCH_JOB,
        )
    assert not problems, "\n".join(problems)
    rule = next(q for q in rule_queries(load_rules()) if q.where == "rule H5ngffBatchNoProgress")
    assert not batch_scraped.prom.range(rule.expr, batch_scraped.start, batch_scraped.end)  # the real threshold: silent
    assert not batch_scraped.prom.range('ALERTS{alertname=~"H5ngff.*"}', batch_scraped.start, batch_scraped.end)
