"""The Helm chart (helm/h5ngff), rendered by real Helm in-process (helm-python-sdk).

* ``helm lint`` is clean, and the chart renders with the default values and three custom sets;
* every rendered object validates against the Kubernetes schemas (kubernetes-validate, strict);
  the Prometheus Operator and kopf kinds have no schema there and are checked against what they
  must match instead (the Service they select, the pods h5ngff builds, the rule file);
* values.schema.json rejects bad values (Helm refuses to render);
* the chart's copies of the CRD, dashboard, alert rules and RBAC rules equal their sources;
* the operator's and runner's RBAC is exactly src/h5ngff/operator/schema/rbac.py's rules for the mode,
  in both directions, with a negative control;
* the operator container's arguments parse with h5ngff's real command-line parser.
"""

from __future__ import annotations

import json
import re
import shutil
import sys
from pathlib import Path

import helm_python
import kubernetes_validate
import pytest
import yaml

from h5ngff.cli import build_parser
from h5ngff.operator.schema.rbac import OPERATOR_RULES, RUNNER_RULES, calls

ROOT = Path(__file__).resolve().parents[1]
CHART = ROOT / "helm" / "h5ngff"
sys.path.insert(0, str(ROOT / "scripts"))
import render_manifests as rm  # noqa: E402

#: A recent minor version that kubernetes-validate ships schemas for.
KUBE_VERSION = "1.33"
RELEASE, NAMESPACE = "conv", "imaging-system"

VALUE_SETS = {
    "defaults": {},
    "cluster-wide": {"watch": {"clusterWide": True}, "runner": {"namespaces": ["imaging", "tomo"]}},
    "monitoring": {
        "metrics": {
            "serviceMonitor": {"enabled": True, "labels": {"release": "kps"}},
            "podMonitor": {"enabled": True},
            "prometheusRule": {"enabled": True},
        }
    },
    "custom": {
        "image": {
            "repository": "registry.example.org/lab/h5ngff",
            "digest": "sha256:" + "ab" * 32,
            "pullPolicy": "Always",
        },
        "jobDefaults": {"image": "registry.example.org/lab/h5ngff:nightly"},
        "imagePullSecrets": [{"name": "lab-registry"}],
        "watch": {"namespaces": ["imaging", "tomo"]},
        "operator": {
            "replicas": 2,
            "peering": {"enabled": True, "name": "h5ngff-lab"},
            "interval": 2.5,
            "extraArgs": ["--priority", "100"],
            "extraEnv": [{"name": "TZ", "value": "UTC"}],
            "resources": {"requests": {"cpu": "100m", "memory": "300Mi"}, "limits": {"cpu": 1, "memory": "1Gi"}},
            "nodeSelector": {"node-role/infra": "true"},
            "tolerations": [{"key": "infra", "operator": "Exists"}],
        },
        "metrics": {"enabled": False, "grafanaDashboard": {"namespace": "grafana"}},
        "policy": {
            "allowedImages": ["registry.example.org/lab/*"],
            "allowedServiceAccounts": ["lab-runner"],
            "allowedVolumeTypes": ["persistentVolumeClaim", "csi"],
            "allowedTolerationKeys": ["dedicated", "nvidia.com/*"],
        },
    },
}

#: Kinds kubernetes-validate has no schema for, and where each is checked instead.
CUSTOM_KINDS = {
    ("monitoring.coreos.com/v1", "ServiceMonitor"): "test_service_monitor_selects_the_metrics_service",
    ("monitoring.coreos.com/v1", "PodMonitor"): "test_pod_monitor_selects_the_pods_h5ngff_builds",
    ("monitoring.coreos.com/v1", "PrometheusRule"): "test_prometheus_rule_is_the_rule_file",
    ("kopf.dev/v1", "KopfPeering"): "test_peering_objects_follow_the_mode",
    ("kopf.dev/v1", "ClusterKopfPeering"): "test_peering_objects_follow_the_mode",
}


def render(values: dict | None = None, chart: Path = CHART) -> list[dict]:
    return rm.render_objects(values, chart_dir=chart, name=RELEASE, namespace=NAMESPACE)


@pytest.fixture(scope="module")
def rendered() -> dict[str, list[dict]]:
    return {name: render(values) for name, values in VALUE_SETS.items()}


def find(objs: list[dict], kind: str, name: str | None = None) -> list[dict]:
    return [o for o in objs if o["kind"] == kind and (name is None or o["metadata"]["name"] == name)]


def operator_container(objs: list[dict]) -> dict:
    (deployment,) = find(objs, "Deployment")
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    return container


# --- lint, render, Kubernetes schemas -----------------------------------------------------------


@pytest.mark.parametrize("values", VALUE_SETS, ids=str)
def test_lint_is_clean(values):
    report = helm_python.lint(
        str(CHART), VALUE_SETS[values], strict=True, namespace=NAMESPACE, kube_version=f"v{KUBE_VERSION}.0"
    )
    assert report["errors"] == []
    # Severity 1 is "info": the only one is "icon is recommended" (the project has no icon).
    assert [m for m in report["messages"] if m["severity"] >= 2] == []
    assert {m["error"] for m in report["messages"]} <= {"icon is recommended"}


@pytest.mark.slow
@pytest.mark.parametrize("values", VALUE_SETS, ids=str)
def test_every_rendered_object_is_valid_kubernetes(rendered, values):
    objs = rendered[values]
    assert find(objs, "Deployment") and find(objs, "ServiceAccount")
    checked = 0
    for obj in objs:
        key = (obj["apiVersion"], obj["kind"])
        if key in CUSTOM_KINDS:
            with pytest.raises(kubernetes_validate.SchemaNotFoundError):  # honest: no schema to check
                kubernetes_validate.validate(obj, KUBE_VERSION, strict=True)
            continue
        kubernetes_validate.validate(obj, KUBE_VERSION, strict=True)
        checked += 1
    assert checked >= 9
    names = [(o["kind"], o["metadata"].get("namespace"), o["metadata"]["name"]) for o in objs]
    assert len(names) == len(set(names)), "two objects with the same kind, namespace and name"


def test_kubernetes_validation_is_not_vacuous(rendered):
    """Negative control: a misspelt field and a wrong type in the Deployment are rejected."""
    (deployment,) = find(rendered["defaults"], "Deployment")
    typo = json.loads(json.dumps(deployment))
    typo["spec"]["template"]["spec"]["containers"][0]["readinesProbe"] = {}
    wrong = json.loads(json.dumps(deployment))
    wrong["spec"]["replicas"] = "one"
    for bad in (typo, wrong):
        with pytest.raises(kubernetes_validate.ValidationError):
            kubernetes_validate.validate(bad, KUBE_VERSION, strict=True)


def test_the_chart_ships_the_crd_from_the_models():
    sources = [(ROOT / f"src/h5ngff/operator/schema/{name}").read_text() for name in ("crd-batch.yaml", "crd.yaml")]
    with helm_python.Chart.load(str(CHART)) as chart:
        crds = chart.crds
        notes = chart.render(values={}, name=RELEASE, namespace=NAMESPACE)
    assert sorted(c["data"] for c in crds) == sorted(sources)
    for crd in crds:
        kubernetes_validate.validate(yaml.safe_load(crd["data"]), KUBE_VERSION, strict=True)
    assert not any("CustomResourceDefinition" in text for text in notes.values()), "the CRD belongs in crds/ only"


@pytest.mark.parametrize("path", sorted(rm.chart_copies()), ids=lambda p: str(p.relative_to(CHART)))
def test_chart_copies_equal_their_sources(path):
    assert path.read_text() == rm.chart_copies()[path], (
        f"{path.relative_to(ROOT)} drifted; run scripts/render-manifests"
    )


def test_app_version_is_the_package_version():
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    version = re.search(r'^version = "(.+)"', (ROOT / "pyproject.toml").read_text(), re.M).group(1)
    assert chart["appVersion"] == version


# --- values.schema.json -------------------------------------------------------------------------


@pytest.mark.parametrize(
    "bad, where",
    [
        ({"operator": {"replicas": -1}}, "/operator/replicas"),
        ({"operator": {"replicaz": 2}}, "replicaz"),
        ({"image": {"pullPolicy": "Sometimes"}}, "/image/pullPolicy"),
        ({"image": {"digest": "sha256:123"}}, "/image/digest"),
        ({"watch": {"namespaces": ["Imaging_Data"]}}, "/watch/namespaces/0"),
        ({"watch": {"clusterWide": "yes"}}, "/watch/clusterWide"),
        ({"operator": {"healthPort": 70000}}, "/operator/healthPort"),
        ({"operator": {"interval": 0}}, "/operator/interval"),
        ({"metrics": {"serviceMonitor": {"interval": "30 seconds"}}}, "/metrics/serviceMonitor/interval"),
        ({"operator": {"resources": {"limits": {"memory": "lots"}}}}, "/operator/resources/limits/memory"),
        ({"runner": {"serviceAccount": {"name": "Runner SA"}}}, "/runner/serviceAccount/name"),
        ({"policy": {"allowedVolumeTypes": ["hostpath"]}}, "/policy/allowedVolumeTypes/0"),
        ({"policy": {"allowedVolumeTypes": []}}, "/policy/allowedVolumeTypes"),
        ({"policy": {"allowedServiceAccounts": ["Lab Runner"]}}, "/policy/allowedServiceAccounts/0"),
        ({"policy": {"allowedTolerationKeys": ["two words"]}}, "/policy/allowedTolerationKeys/0"),
    ],
    ids=lambda v: json.dumps(v) if isinstance(v, dict) else None,
)
def test_the_values_schema_rejects_bad_values(bad, where):
    with pytest.raises(helm_python.HelmValuesError) as err:
        render(bad)
    assert where in str(err.value)


def test_more_replicas_without_peering_is_refused():
    with pytest.raises(helm_python.HelmRenderError, match="peering"):
        render({"operator": {"replicas": 2}})


def _values_keys() -> list[tuple[tuple[str, ...], str]]:
    """(key path, the comment line just above it) for every key in values.yaml."""
    out, stack = [], []
    lines = (CHART / "values.yaml").read_text().splitlines()
    for i, line in enumerate(lines):
        m = re.match(r"^( *)([A-Za-z_][\w-]*):", line)
        if not m:
            continue
        depth = len(m.group(1)) // 2
        stack = stack[:depth] + [m.group(2)]
        above = lines[i - 1].strip() if i else ""
        out.append((tuple(stack), above))
    return out


def _schema_node(schema: dict, path: tuple[str, ...]) -> dict | None:
    """The schema of the object holding ``path``'s last key; {} inside free-form data."""
    node = schema
    for key in path[:-1]:
        if node.get("additionalProperties") is not False:
            return {}  # free-form Kubernetes data (resources, securityContext, labels)
        node = node.get("properties", {}).get(key)
        if node is None:
            return None
    return node


def test_every_value_is_commented_and_in_the_schema():
    schema = json.loads((CHART / "values.schema.json").read_text())
    documented = 0
    for path, above in _values_keys():
        parent = _schema_node(schema, path)
        assert parent is not None, f"{'.'.join(path)} is not in values.schema.json"
        if parent.get("additionalProperties") is False:  # an option of the chart, not free-form data
            assert path[-1] in parent["properties"], f"{'.'.join(path)} is not in values.schema.json"
            assert above.startswith("#"), f"{'.'.join(path)} has no comment above it in values.yaml"
            documented += 1
    assert documented >= 50
    # and every option in the schema has a default in values.yaml
    keys = {p for p, _ in _values_keys()}

    def options(node, prefix=()):
        for key, sub in node.get("properties", {}).items():
            yield prefix + (key,)
            if sub.get("additionalProperties") is False:
                yield from options(sub, prefix + (key,))

    missing = [".".join(p) for p in options(schema) if p not in keys and p != ("global",)]
    assert missing == []


# --- the operator Deployment --------------------------------------------------------------------


@pytest.mark.parametrize("values", VALUE_SETS, ids=str)
def test_operator_args_are_real_flags_of_h5ngff_operator(rendered, values):
    container = operator_container(rendered[values])
    assert "command" not in container, "args only: the image's entrypoint (tini) must stay PID 1"
    assert container["args"][:2] == ["h5ngff", "operator"]
    args = build_parser().parse_args(container["args"][1:])  # exits (SystemExit) on an unknown flag
    merged = {**VALUE_SETS["defaults"], **VALUE_SETS[values]}
    served = (
        [] if merged.get("watch", {}).get("clusterWide") else merged.get("watch", {}).get("namespaces", [NAMESPACE])
    )
    assert args.namespace == served
    expected_image = merged.get("jobDefaults", {}).get("image") or container["image"]
    assert args.image == expected_image
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert args.liveness == f"http://0.0.0.0:{ports['http-health']}/healthz"
    assert container["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "http-health"}
    assert container["readinessProbe"]["httpGet"] == {"path": "/healthz", "port": "http-health"}
    if merged.get("metrics", {}).get("enabled", True):
        assert args.metrics_port == ports["metrics"]
    else:
        assert args.metrics_port is None and "metrics" not in ports
    peering = merged.get("operator", {}).get("peering", {}).get("enabled", False)
    assert args.standalone is not peering
    if peering:
        assert args.peering == merged["operator"]["peering"]["name"]


@pytest.mark.parametrize("values", ["defaults", "custom"])
def test_the_tenant_policy_reaches_the_operator(rendered, values):
    """policy.* values become the operator's TenantPolicy through its real flags."""
    from h5ngff.clijob import policy_from_args
    from h5ngff.operator.schema.policy import DEFAULT_VOLUME_TYPES, TenantPolicy

    args = build_parser().parse_args(operator_container(rendered[values])["args"][1:])
    expected = (
        TenantPolicy()
        if values == "defaults"
        else TenantPolicy(
            ("registry.example.org/lab/*",),
            ("lab-runner",),
            ("persistentVolumeClaim", "csi"),
            ("dedicated", "nvidia.com/*"),
        )
    )
    assert policy_from_args(args) == expected
    chart_policy = yaml.safe_load((CHART / "values.yaml").read_text())["policy"]
    assert TenantPolicy().allowed_volume_types == DEFAULT_VOLUME_TYPES == tuple(chart_policy["allowedVolumeTypes"])
    assert TenantPolicy().allowed_toleration_keys == tuple(chart_policy["allowedTolerationKeys"]) == ()


def test_unknown_operator_flags_fail_the_parser():
    """Negative control for the check above: the parser rejects a flag h5ngff operator lacks."""
    with pytest.raises(SystemExit):
        build_parser().parse_args(["operator", "--service-account", "h5ngff-runner"])


def test_the_operator_runs_non_root_on_a_read_only_root(rendered):
    objs = rendered["defaults"]
    (deployment,) = find(objs, "Deployment")
    pod = deployment["spec"]["template"]["spec"]
    container = operator_container(objs)
    assert pod["securityContext"]["runAsNonRoot"] is True and pod["securityContext"]["runAsUser"] != 0
    sc = container["securityContext"]
    assert (
        sc["readOnlyRootFilesystem"] is True
        and sc["allowPrivilegeEscalation"] is False
        and sc["capabilities"]["drop"] == ["ALL"]
    )
    mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert "emptyDir" in volumes[mounts["/tmp"]]
    assert {"name": "HOME", "value": "/tmp"} in container["env"]
    assert container["resources"]["requests"]["memory"] and container["resources"]["limits"]["memory"]
    assert pod["serviceAccountName"] == find(objs, "ClusterRoleBinding")[0]["subjects"][0]["name"]


def test_custom_image_digest_and_job_default_image(rendered):
    container = operator_container(rendered["custom"])
    assert container["image"] == "registry.example.org/lab/h5ngff@sha256:" + "ab" * 32
    assert container["args"][container["args"].index("--image") + 1] == "registry.example.org/lab/h5ngff:nightly"
    defaults = operator_container(rendered["defaults"])
    assert (
        defaults["image"] == f"ghcr.io/h5ngff/h5ngff:{yaml.safe_load((CHART / 'Chart.yaml').read_text())['appVersion']}"
    )
    (deployment,) = find(rendered["custom"], "Deployment")
    assert deployment["spec"]["replicas"] == 2 and "strategy" not in deployment["spec"]


# --- RBAC: exactly rbac.py ----------------------------------------------------------------------


def granted(objs: list[dict], sa: str, sa_namespace: str) -> dict[str | None, set[tuple[str, str, str, str]]]:
    """What a service account may do: {namespace or None (cluster-wide): {(verb, group, resource, sub)}}."""
    roles = {
        (o["kind"], o["metadata"].get("namespace"), o["metadata"]["name"]): o
        for o in objs
        if o["kind"] in ("Role", "ClusterRole")
    }
    out: dict[str | None, set] = {}
    for binding in objs:
        if binding["kind"] not in ("RoleBinding", "ClusterRoleBinding"):
            continue
        if {"kind": "ServiceAccount", "name": sa, "namespace": sa_namespace} not in binding["subjects"]:
            continue
        scope = binding["metadata"].get("namespace")
        ref = binding["roleRef"]
        role = roles[(ref["kind"], scope if ref["kind"] == "Role" else None, ref["name"])]
        for rule in role["rules"]:
            for group in rule["apiGroups"]:
                for resource in rule["resources"]:
                    name, _, sub = resource.partition("/")
                    out.setdefault(scope, set()).update((verb, group, name, sub) for verb in rule["verbs"])
    return out


CLUSTER_SCOPED = {"customresourcedefinitions", "namespaces", "clusterkopfpeerings"}


def expected_operator(cluster_wide: bool, peering: bool) -> set[tuple[str, str, str, str]]:
    """rbac.py's OPERATOR_RULES less those the mode never calls: kopf lists namespaces only when
    serving named namespaces; it peers through ClusterKopfPeerings cluster-wide, KopfPeerings
    per namespace, and neither when standalone."""
    unused = {"kopfpeerings"} if cluster_wide else {"clusterkopfpeerings"}
    if cluster_wide:
        unused.add("namespaces")
    if not peering:
        unused |= {"kopfpeerings", "clusterkopfpeerings"}
    return {c for c in calls(OPERATOR_RULES, exercised_only=False) if c[2] not in unused}


@pytest.mark.parametrize("cluster_wide", [False, True], ids=["namespaced", "cluster-wide"])
@pytest.mark.parametrize("peering", [False, True], ids=["standalone", "peering"])
def test_operator_rbac_is_exactly_rbac_py(cluster_wide, peering):
    values = {
        "watch": {"clusterWide": cluster_wide, "namespaces": [] if cluster_wide else ["imaging", "tomo"]},
        "operator": {"peering": {"enabled": peering}},
    }
    objs = render(values)
    sa = find(objs, "Deployment")[0]["spec"]["template"]["spec"]["serviceAccountName"]
    grants = granted(objs, sa, NAMESPACE)
    expected = expected_operator(cluster_wide, peering)
    if cluster_wide:
        assert set(grants) == {None}
        assert grants[None] == expected
    else:
        assert set(grants) == {None, "imaging", "tomo", NAMESPACE}
        assert grants[None] == {c for c in expected if c[2] in CLUSTER_SCOPED}
        for ns in ("imaging", "tomo"):
            assert grants[ns] == {c for c in expected if c[2] not in CLUSTER_SCOPED}
        # The output Leases live in the operator's own namespace, served or not (operator/controller/lease.py).
        assert grants[NAMESPACE] == {c for c in expected if c[2] == "leases"}


def test_every_rbac_py_operator_rule_is_granted_in_some_mode():
    union = set()
    for cluster_wide in (False, True):
        union |= expected_operator(cluster_wide, peering=True)
    assert union == calls(OPERATOR_RULES, exercised_only=False)
    # and the rules the KMock tests saw the operator call are granted in its default test mode
    assert calls(OPERATOR_RULES) <= expected_operator(cluster_wide=True, peering=True)


@pytest.mark.parametrize("values", ["defaults", "cluster-wide", "custom"])
def test_runner_rbac_is_exactly_rbac_py(rendered, values):
    objs = rendered[values]
    name = yaml.safe_load((CHART / "values.yaml").read_text())["runner"]["serviceAccount"]["name"]
    namespaces = {"defaults": [NAMESPACE], "cluster-wide": ["imaging", "tomo"], "custom": ["imaging", "tomo"]}[values]
    accounts = {(o["metadata"]["namespace"], o["metadata"]["name"]) for o in find(objs, "ServiceAccount")}
    for ns in namespaces:
        assert (ns, name) in accounts
        assert granted(objs, name, ns) == {ns: calls(RUNNER_RULES, exercised_only=False)}


def test_extra_verbs_are_detected(tmp_path):
    """Negative control: a chart granting one verb more than rbac.py fails the comparison, and
    the drift check names the edited file."""
    chart = tmp_path / "h5ngff"
    shutil.copytree(CHART, chart)
    rules = chart / "files/rbac.yaml"
    doc = yaml.safe_load(rules.read_text())
    doc["operator"][0]["verbs"].append("delete")  # conversionjobs: list, watch, patch + delete
    doc["runner"][0]["verbs"].append("update")  # daskclusters: get, list, create, delete + update
    rules.write_text(yaml.safe_dump(doc))
    objs = render({"watch": {"clusterWide": True}}, chart=chart)
    grants = granted(objs, f"{RELEASE}-h5ngff-operator", NAMESPACE)[None]
    assert grants != expected_operator(True, False)
    assert grants - expected_operator(True, False) == {("delete", "h5ngff.dev", "conversionjobs", "")}
    runner = granted(objs, "h5ngff-runner", NAMESPACE)[NAMESPACE]
    assert runner - calls(RUNNER_RULES, exercised_only=False) == {("update", "kubernetes.dask.org", "daskclusters", "")}
    assert rules.read_text() != rm.rbac_yaml()


# --- monitoring and dashboards ------------------------------------------------------------------


def test_service_monitor_selects_the_metrics_service(rendered):
    objs = rendered["monitoring"]
    (monitor,) = find(objs, "ServiceMonitor")
    (service,) = find(objs, "Service")
    labels = service["metadata"]["labels"]
    assert monitor["spec"]["selector"]["matchLabels"].items() <= labels.items()
    assert monitor["spec"]["namespaceSelector"]["matchNames"] == [service["metadata"]["namespace"]]
    assert monitor["metadata"]["labels"]["release"] == "kps"
    (endpoint,) = monitor["spec"]["endpoints"]
    assert endpoint["port"] in {p["name"] for p in service["spec"]["ports"]}
    # the Service reaches the operator's metrics port
    container = operator_container(objs)
    (deployment,) = find(objs, "Deployment")
    assert service["spec"]["selector"].items() <= deployment["spec"]["template"]["metadata"]["labels"].items()
    assert service["spec"]["ports"][0]["targetPort"] in {p["name"] for p in container["ports"]}


def test_pod_monitor_selects_the_pods_h5ngff_builds(rendered):
    """The PodMonitor's selector matches the labels h5ngff puts on runner and Dask pods, and its
    ports are the ports those pods declare (the worker pods' Dask dashboard today)."""
    from h5ngff.backends.kubernetes import WORKER_DASHBOARD_PORT, build_scheduler_pod_spec, build_worker_container
    from h5ngff.k8s import labels
    from h5ngff.jobspec import PodSettings

    (monitor,) = find(rendered["monitoring"], "PodMonitor")
    selector = monitor["spec"]["selector"]
    (expression,) = selector["matchExpressions"]

    def selected(pod_labels: dict) -> bool:
        return (
            selector["matchLabels"].items() <= pod_labels.items()
            and pod_labels.get(expression["key"]) in expression["values"]
        )

    assert selected(labels("job", "runner", 1)) and selected(labels("job", "dask-cluster", 1))
    assert not selected(find(rendered["monitoring"], "Deployment")[0]["spec"]["template"]["metadata"]["labels"])
    assert monitor["spec"]["namespaceSelector"] == {"matchNames": [NAMESPACE]}
    ports = {e["port"] for e in monitor["spec"]["podMetricsEndpoints"]}
    scheduler = build_scheduler_pod_spec(_plan(), "img", PodSettings())["containers"][0]
    worker = build_worker_container(_plan(), "img", PodSettings())
    assert "http-dashboard" in ports
    assert {"name": "http-dashboard", "containerPort": WORKER_DASHBOARD_PORT, "protocol": "TCP"} in worker["ports"]
    assert "http-dashboard" in {p["name"] for p in scheduler["ports"]}
    cluster_wide = find(render({**VALUE_SETS["monitoring"], "watch": {"clusterWide": True}}), "PodMonitor")[0]
    assert cluster_wide["spec"]["namespaceSelector"] == {"any": True}


def _plan():
    from h5ngff.planner import make_plan
    from h5ngff.planner.model import Capacity, DatasetInfo
    from h5ngff.spec import parse_spec

    spec = parse_spec(
        {"source": {"path": "in.h5", "dataset": "/d"}, "output": {"path": "out.ome.zarr"}, "resources": {"workers": 2}}
    )
    return make_plan(
        DatasetInfo(shape=(64, 128, 128), dtype="<u2", itemsize=2),
        spec,
        Capacity(cores=2, memory_bytes=8 << 30, default_workers=2),
    )


def test_prometheus_rule_is_the_rule_file(rendered):
    (rule,) = find(rendered["monitoring"], "PrometheusRule")
    source = yaml.safe_load((ROOT / "src/h5ngff/metrics/rules/h5ngff-alerts.yaml").read_text())
    assert rule["spec"] == source
    assert {r["alert"] for g in rule["spec"]["groups"] for r in g["rules"]} == {
        "H5ngffWorkerNearPodLimit",
        "H5ngffJobNoProgress",
        "H5ngffBatchNoProgress",
        "H5ngffWorkerOOMKilled",
    }


def test_grafana_dashboard_configmap_is_the_dashboard(rendered):
    source = json.loads((ROOT / "src/h5ngff/metrics/dashboards/h5ngff.json").read_text())
    (cm,) = find(rendered["defaults"], "ConfigMap")
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert json.loads(cm["data"]["h5ngff.json"]) == source
    (custom,) = find(rendered["custom"], "ConfigMap")
    assert custom["metadata"]["namespace"] == "grafana"


def test_edited_copies_show_in_the_rendering(tmp_path):
    """Negative control for the copy checks: an edited chart copy renders differently."""
    chart = tmp_path / "h5ngff"
    shutil.copytree(CHART, chart)
    alerts = chart / "files/h5ngff-alerts.yaml"
    alerts.write_text(alerts.read_text().replace("> 0.9", "> 0.95"))
    dashboard = chart / "files/h5ngff.json"
    dashboard.write_text(dashboard.read_text().replace('"h5ngff conversions"', '"renamed"'))
    objs = render(VALUE_SETS["monitoring"], chart=chart)
    source_rules = yaml.safe_load((ROOT / "src/h5ngff/metrics/rules/h5ngff-alerts.yaml").read_text())
    assert find(objs, "PrometheusRule")[0]["spec"] != source_rules
    assert json.loads(find(objs, "ConfigMap")[0]["data"]["h5ngff.json"])["title"] == "renamed"


def test_peering_objects_follow_the_mode(rendered):
    assert find(rendered["defaults"], "KopfPeering") == [] and find(rendered["defaults"], "ClusterKopfPeering") == []
    peerings = find(rendered["custom"], "KopfPeering")
    assert {(p["metadata"]["namespace"], p["metadata"]["name"]) for p in peerings} == {
        ("imaging", "h5ngff-lab"),
        ("tomo", "h5ngff-lab"),
    }
    clusterwide = find(
        render({"watch": {"clusterWide": True}, "operator": {"peering": {"enabled": True}}}), "ClusterKopfPeering"
    )
    assert [p["metadata"]["name"] for p in clusterwide] == ["h5ngff"] and "namespace" not in clusterwide[0]["metadata"]


def test_notes_and_operator_agree_on_the_runner_service_account():
    with helm_python.Chart.load(str(CHART)) as chart:
        out = chart.render(values={"watch": {"namespaces": ["imaging"]}}, name=RELEASE, namespace=NAMESPACE)
    notes = out["h5ngff/templates/NOTES.txt"]
    assert "service account h5ngff-runner" in notes and "imaging" in notes and "dask-kubernetes-operator" in notes
    args = next(o for o in render({}) if o["kind"] == "Deployment")["spec"]["template"]["spec"]["containers"][0]["args"]
    assert args[args.index("--runner-service-account") + 1] == "h5ngff-runner"


@pytest.mark.slow
def test_every_custom_kind_has_its_check():
    seen = {(o["apiVersion"], o["kind"]) for objs in (render(v) for v in VALUE_SETS.values()) for o in objs}
    seen |= {
        (o["apiVersion"], o["kind"])
        for o in render({"watch": {"clusterWide": True}, "operator": {"peering": {"enabled": True}}})
    }
    for key in seen:
        if key in CUSTOM_KINDS:
            assert CUSTOM_KINDS[key] in globals()
        else:  # a kind kubernetes-validate has a schema for (a stub fails it, but not for want of one)
            try:
                kubernetes_validate.validate(
                    {"apiVersion": key[0], "kind": key[1], "metadata": {"name": "x"}}, KUBE_VERSION
                )
            except kubernetes_validate.ValidationError:
                pass
