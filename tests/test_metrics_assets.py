"""The shipped dashboard and rule file, checked without a cluster: they reference only metrics the
exporter exports, the catalogue is exactly what the exporter emits and follows Prometheus naming,
``promtool check rules`` passes and ``promtool test rules`` fires each alert on synthetic series
(and fails when a rule is weakened)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess

import pytest
import yaml
from prometheus_client import CollectorRegistry, generate_latest

from h5ngff.engine.progress import Progress
from h5ngff.metrics.assets import (
    asset_path,
    dashboard_queries,
    iter_panels,
    load_dashboard,
    load_rules,
    referenced_metrics,
    rule_queries,
    unknown_metrics,
)
from h5ngff.metrics.batch import BatchFigures
from h5ngff.metrics.families import BY_NAME, CATALOGUE, ExportState, build_families
from h5ngff.metrics.operator import OPERATOR_METRICS, OperatorMetrics
from h5ngff.metrics.probes import CgroupFigures, ClusterSnapshot, WorkerFigures

PROMTOOL = shutil.which("promtool") or "/usr/bin/promtool"
needs_promtool = pytest.mark.skipif(
    not os.path.exists(PROMTOOL), reason=f"{PROMTOOL} is absent (Debian package prometheus; scripts/setup installs it)"
)
UNIT_TESTS = os.path.join(os.path.dirname(__file__), "promtool", "h5ngff-alerts.test.yaml")


def test_dashboard_has_the_variables_and_panels_the_issue_asks_for():
    dash = load_dashboard()
    variables = {v["name"]: v for v in dash["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    assert {"namespace", "job"} <= set(variables)
    panels = [p for p in iter_panels(dash["panels"]) if p["type"] != "row"]
    assert len({p["id"] for p in iter_panels(dash["panels"])}) == len(list(iter_panels(dash["panels"])))
    for panel in panels:  # every query goes to the chosen data source
        assert panel["datasource"]["uid"] == "${datasource}", panel["title"]
        assert all(t["datasource"]["uid"] == "${datasource}" for t in panel["targets"]), panel["title"]
    used = {
        title: set().union(*(referenced_metrics(t["expr"]) for t in p["targets"]))
        for p in panels
        for title in [p["title"]]
    }
    for panel in panels:  # job panels filter on the variables; the operator's metrics have no job labels
        operator = used[panel["title"]] <= set(OPERATOR_METRICS) and all(
            "conversion_job" not in t["expr"] or 'conversion_job=""' in t["expr"] for t in panel["targets"]
        )
        for target in panel["targets"]:
            assert operator or ('$job"' in target["expr"] and '$namespace"' in target["expr"]), (
                panel["title"],
                target["expr"],
            )

    def panel_with(*metrics: str) -> list[str]:
        return [title for title, names in used.items() if set(metrics) <= names]

    assert panel_with("h5ngff_worker_rss_bytes", "h5ngff_worker_memory_limit_bytes", "h5ngff_worker_pod_limit_bytes")
    assert panel_with("h5ngff_worker_memory_bytes")  # managed / unmanaged / spilled, stacked
    assert panel_with("h5ngff_worker_cgroup_working_set_bytes", "h5ngff_worker_pod_limit_bytes")
    assert panel_with("h5ngff_job_slabs_done_total", "h5ngff_job_planned_slabs")
    assert panel_with("h5ngff_job_read_bytes_total")
    assert panel_with("h5ngff_worker_nanny_restarts_total", "h5ngff_worker_oom_kills_total")
    # Issue 17: pass progress, the build info, and the operator's own metrics.
    assert panel_with("h5ngff_job_current_pass", "h5ngff_job_planned_passes")
    assert len(panel_with("h5ngff_build_info")) == 2  # the runner's (by job) and the operator's
    assert panel_with("h5ngff_operator_conversionjobs")
    assert panel_with("h5ngff_operator_reconcile_passes_total", "h5ngff_operator_reconcile_errors_total")
    stacked = [p for p in panels if "h5ngff_worker_memory_bytes" in used[p["title"]]]
    assert stacked[0]["fieldConfig"]["defaults"]["custom"]["stacking"]["mode"] == "normal"


def test_dashboard_and_rules_reference_only_exported_metrics():
    queries = dashboard_queries(load_dashboard()) + rule_queries(load_rules())
    assert len(queries) > 20 and all(referenced_metrics(q.expr) for q in queries)
    assert unknown_metrics(queries, set(BY_NAME) | set(OPERATOR_METRICS)) == {}


def test_the_operator_catalogue_is_what_the_operator_exposes():
    metrics = OperatorMetrics()
    metrics.observe("imaging", "scan", "Running")
    metrics.reconciled("imaging", "scan")
    metrics.reconcile_error("transient")
    text = generate_latest(metrics.registry).decode()
    samples = set(re.findall(r"^(h5ngff_\w+)[{ ]", text, re.M)) - {
        n for n in re.findall(r"^(h5ngff_\w+_created)[{ ]", text, re.M)
    }
    assert samples == set(OPERATOR_METRICS)
    assert re.search(r'^h5ngff_build_info\{version="[^"]+"\} 1\.0$', text, re.M), text


def test_a_panel_with_a_made_up_metric_is_reported():
    """Negative control for the test above: the check catches a name the exporter lacks."""
    dash = load_dashboard()
    panel = dict(dash["panels"][1])
    panel["targets"] = [
        {"refId": "A", "expr": 'h5ngff_worker_made_up_bytes{conversion_job=~"$job"} / h5ngff_worker_rss_bytes'}
    ]
    dash["panels"] = dash["panels"] + [panel]
    assert unknown_metrics(dashboard_queries(dash), set(BY_NAME) | set(OPERATOR_METRICS)) == {
        f"panel {panel['title']!r} A": {"h5ngff_worker_made_up_bytes"}
    }


def full_state() -> ExportState:
    """A state in which every metric has a value: progress, a paused worker with a cgroup, kills."""
    cgroup = CgroupFigures("host:1:2", usage=300, working_set=250, limit=1000, oom_kills=1, nonreclaimable=240)
    worker = WorkerFigures(
        "pod-0",
        "tcp://10.0.0.1:1",
        status="paused",
        memory_limit=800,
        process=400,
        managed=100,
        unmanaged_old=200,
        unmanaged_recent=100,
        spilled=50,
        rss=410,
        peak_rss=500,
        spill={("disk-write", "count"): 3, ("disk-write", "bytes"): 50},
        cgroup=cgroup,
    )
    snapshot = ClusterSnapshot(
        time=1e9,
        workers={"pod-0": worker},
        nanny_restarts={"pod-0": 1},
        oom_kills={"pod-0": 1},
        memory_terminations={"pod-0": 0},
        pod_limits={"pod-0": 1000},
        pod_nonreclaimable_peaks={"pod-0": 260},
    )
    progress = Progress(phase="Writing", slabs_done=5, slabs_total=10, bytes_read=100, bytes_written=50, passes=1)
    batch = BatchFigures(
        states=("Done", "Running", "Pending"),
        planned_slabs=(10, 10, 10),
        slabs_done=(10, 5, 0),
        last_progress=1e9,
        planned=True,
    )
    return ExportState(
        progress=progress,
        last_progress=1e9,
        throughput=10.0,
        eta=5.0,
        predicted_peak=600,
        passes=1,
        snapshot=snapshot,
        batch=batch,
    )


def exposition(state: ExportState) -> str:
    registry = CollectorRegistry(auto_describe=False)

    class Collector:
        def collect(self):
            return build_families("scan", "imaging", state)

    registry.register(Collector())
    return generate_latest(registry).decode()


def test_the_catalogue_is_exactly_what_the_exporter_emits_and_follows_prometheus_naming():
    text = exposition(full_state())
    emitted = set(re.findall(r"^# TYPE (\S+) (\S+)$", text, re.M))
    assert {(m.name, m.kind) for m in CATALOGUE} == emitted
    for metric in CATALOGUE:
        assert metric.name.startswith("h5ngff_")
        assert metric.name.endswith("_total") == (metric.kind == "counter"), metric.name
        if "bytes" in metric.name:
            assert re.search(r"_bytes(_total|_per_second)?$", metric.name), metric.name
        assert metric.help.endswith(".") and metric.source
        assert "job" not in metric.labels  # Prometheus's own target label; see families.py
    worker = [line for line in text.splitlines() if line.startswith("h5ngff_worker_rss_bytes{")]
    assert worker == [
        'h5ngff_worker_rss_bytes{conversion_job="scan",conversion_job_namespace="imaging",worker="pod-0"} 410.0'
    ]


@pytest.mark.integration
@needs_promtool
def test_promtool_check_metrics_accepts_every_metric():
    result = subprocess.run(
        [PROMTOOL, "check", "metrics"], input=exposition(full_state()), capture_output=True, text=True
    )
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.integration
@needs_promtool
def test_promtool_check_rules_passes():
    result = subprocess.run(
        [PROMTOOL, "check", "rules", asset_path("rules/h5ngff-alerts.yaml")], capture_output=True, text=True
    )
    assert result.returncode == 0 and "SUCCESS: 4 rules found" in result.stdout, result.stdout + result.stderr


def run_unit_tests(rule_file: str, tmp_path) -> subprocess.CompletedProcess:
    with open(UNIT_TESTS) as f:
        tests = yaml.safe_load(f)
    tests["rule_files"] = [rule_file]
    path = tmp_path / "alerts.test.yaml"
    path.write_text(yaml.safe_dump(tests, sort_keys=False))
    return subprocess.run([PROMTOOL, "test", "rules", str(path)], capture_output=True, text=True)


@pytest.mark.integration
@needs_promtool
def test_promtool_unit_tests_fire_each_alert_and_stay_silent_on_healthy_series(tmp_path):
    result = subprocess.run([PROMTOOL, "test", "rules", UNIT_TESTS], capture_output=True, text=True)
    assert result.returncode == 0 and "SUCCESS" in result.stdout, result.stdout + result.stderr
    alerts = {r["alert"] for g in load_rules()["groups"] for r in g["rules"] if "alert" in r}
    with open(UNIT_TESTS) as f:
        tested = {
            t["alertname"] for case in yaml.safe_load(f)["tests"] for t in case["alert_rule_test"] if t["exp_alerts"]
        }
    assert tested == alerts  # every alert has a case in which it fires
    assert run_unit_tests(asset_path("rules/h5ngff-alerts.yaml"), tmp_path).returncode == 0


@pytest.mark.integration
@pytest.mark.parametrize(
    "weaken",
    [
        ("> 0.9", "> 0.93"),  # misses a worker at 92% of its limit
        ("for: 2m", "for: 30s"),  # fires on a short spike, and too early
        (
            "h5ngff_job_last_progress_timestamp_seconds > 600",
            "h5ngff_job_last_progress_timestamp_seconds > 700",
        ),  # a stuck job alerts too late
        ('phase!~"Succeeded|Failed"', 'phase!~"Failed"'),  # alerts on finished jobs
        ("h5ngff_worker_oom_kills_total > 0", "h5ngff_worker_oom_kills_total > 1"),  # misses the first kill
        (
            "h5ngff_batch_last_progress_timestamp_seconds > 600",
            "h5ngff_batch_last_progress_timestamp_seconds > 700",
        ),  # a stuck batch alerts too late
        ('state=~"Pending|Running"', 'state=~"Pending"'),  # misses a batch whose last item is stuck
        ('state=~"Pending|Running"', 'state=~"Pending|Running|NotRun"'),  # alerts on a --fail-fast batch that has ended
    ],
)
@needs_promtool
def test_promtool_unit_tests_fail_when_a_rule_is_weakened(weaken, tmp_path):
    """Negative controls: each changed threshold or filter makes the unit tests fail."""
    text = open(asset_path("rules/h5ngff-alerts.yaml")).read()
    assert text.count(weaken[0]) == 1
    mutated = tmp_path / "weakened.yaml"
    mutated.write_text(text.replace(*weaken))
    result = run_unit_tests(str(mutated), tmp_path)
    out = result.stdout + result.stderr
    assert result.returncode != 0 and "exp:" in out and "got:" in out and "error" not in out, (
        out
    )  # an alert assertion failed, not a parse


def test_docs_describe_every_metric_alert_and_panel():
    with open(os.path.join(os.path.dirname(__file__), "..", "docs", "metrics.md")) as f:
        docs = f.read()
    rows = dict(re.findall(r"^\| `(h5ngff_\w+)` \| (gauge|counter) \|", docs, re.M))
    assert rows == {m.name: m.kind for m in CATALOGUE}
    alerts = {r["alert"] for g in load_rules()["groups"] for r in g["rules"] if "alert" in r}
    assert all(f"`{a}`" in docs for a in alerts)
    titles = {p["title"].split(":")[0] for p in iter_panels(load_dashboard()["panels"])}
    assert all(t in docs for t in titles), titles - {t for t in titles if t in docs}
