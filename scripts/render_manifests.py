"""Keep the Helm chart and the plain manifests in step with h5ngff's single sources.

Helm can read only files inside the chart, so the chart holds copies, written here:

* ``crds/conversionjobs.h5ngff.dev.yaml`` and ``crds/conversionbatches.h5ngff.dev.yaml``:
  ``src/h5ngff/operator/schema/crd.yaml`` and ``crd-batch.yaml`` (generated from the pydantic models);
* ``files/rbac.yaml``: ``src/h5ngff/operator/schema/rbac.py``'s rules, tagged with where each one applies;
* ``files/dask-policy.yaml``: ``src/h5ngff/operator/schema/admissionpolicy.py``'s rules of the
  DaskCluster ValidatingAdmissionPolicy (from daskpolicy.py's lists);
* ``files/h5ngff.json`` and ``files/h5ngff-alerts.yaml``: the Grafana dashboard and the alert rules
  from ``src/h5ngff/metrics/``.

Then the chart is rendered with real Helm (helm-python-sdk, in-process) and its default values
into ``manifests/h5ngff.yaml`` for ``kubectl apply -k manifests/`` users.

    .venv/bin/python scripts/render_manifests.py           # write (scripts/render-manifests)
    .venv/bin/python scripts/render_manifests.py --check   # exit 1 naming the files that drifted

This is a script, not part of the h5ngff package, so nothing under src/ depends on Helm.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[1]
CHART = ROOT / "helm" / "h5ngff"
MANIFESTS = ROOT / "manifests"
#: The plain manifests are the chart rendered as this release in this namespace.
RELEASE = "h5ngff"
NAMESPACE = "h5ngff"

SOURCES = {
    "crds/conversionjobs.h5ngff.dev.yaml": ROOT / "src/h5ngff/operator/schema/crd.yaml",
    "crds/conversionbatches.h5ngff.dev.yaml": ROOT / "src/h5ngff/operator/schema/crd-batch.yaml",
    "files/h5ngff.json": ROOT / "src/h5ngff/metrics/dashboards/h5ngff.json",
    "files/h5ngff-alerts.yaml": ROOT / "src/h5ngff/metrics/rules/h5ngff-alerts.yaml",
}
RBAC_FILE = "files/rbac.yaml"
DASK_POLICY_FILE = "files/dask-policy.yaml"

#: Resources that are not namespaced: a Role cannot grant them, only a ClusterRole.
CLUSTER_SCOPED = {"customresourcedefinitions", "namespaces", "clusterkopfpeerings"}
#: Operator rules needed in one serving mode only (the rest are needed in both):
#: * kopf lists and watches namespaces only when it serves named namespaces, not cluster-wide
#:   (kopf/_core/reactor/observation.py, namespace_observer);
#: * kopf peers through a ClusterKopfPeering cluster-wide and a KopfPeering in each served
#:   namespace otherwise, and through neither when standalone.
MODES = {
    "namespaces": ["namespaced"],
    "clusterkopfpeerings": ["clusterWide"],
    "kopfpeerings": ["namespaced"],
}
PEERING = {"clusterkopfpeerings", "kopfpeerings"}

#: Helm's install order for the kinds the chart renders; custom resources come last.
KIND_ORDER = [
    "Namespace",
    "ServiceAccount",
    "ConfigMap",
    "ClusterRole",
    "ClusterRoleBinding",
    "Role",
    "RoleBinding",
    "Service",
    "Deployment",
    "ValidatingAdmissionPolicy",
    "ValidatingAdmissionPolicyBinding",
]


def _rule(rule: Any, placed: bool) -> dict[str, Any]:
    resource = rule.resource.partition("/")[0]
    out: dict[str, Any] = {"apiGroups": [rule.api_group], "resources": [rule.resource], "verbs": list(rule.verbs)}
    if placed:
        out["clusterScoped"] = resource in CLUSTER_SCOPED
        out["modes"] = MODES.get(resource, ["clusterWide", "namespaced"])
        out["peering"] = resource in PEERING
    out["why"] = rule.why
    return out


def rbac_document() -> dict[str, list[dict[str, Any]]]:
    """rbac.py's rules as the chart's templates read them (``files/rbac.yaml``)."""
    sys.path.insert(0, str(ROOT / "src"))
    from h5ngff.operator.schema.rbac import OPERATOR_RULES, RUNNER_RULES

    return {"operator": [_rule(r, True) for r in OPERATOR_RULES], "runner": [_rule(r, False) for r in RUNNER_RULES]}


def rbac_yaml() -> str:
    header = (
        "# Generated from src/h5ngff/operator/schema/rbac.py by scripts/render-manifests; do not edit.\n"
        "# clusterScoped: only a ClusterRole can grant it. modes: the serving modes that need it\n"
        "# (watch.clusterWide true/false). peering: needed only with operator.peering.enabled.\n"
    )
    return header + yaml.safe_dump(rbac_document(), sort_keys=False, width=120)


def dask_policy_yaml() -> str:
    """schema/admissionpolicy.py's rules, as the chart's ValidatingAdmissionPolicy reads them."""
    sys.path.insert(0, str(ROOT / "src"))
    from h5ngff.operator.schema.admissionpolicy import policy_rules

    header = (
        "# Generated from src/h5ngff/operator/schema/admissionpolicy.py by scripts/render-manifests; do not edit.\n"
        "# templates/admission-policy.yaml fills the __PLACEHOLDERS__ from the chart's values.\n"
    )
    return header + yaml.safe_dump(policy_rules(), sort_keys=False, width=120)


def chart_copies() -> dict[Path, str]:
    """Every file of the chart that is a copy of (or generated from) a source elsewhere."""
    out = {CHART / rel: src.read_text() for rel, src in SOURCES.items()}
    out[CHART / RBAC_FILE] = rbac_yaml()
    out[CHART / DASK_POLICY_FILE] = dask_policy_yaml()
    return out


def split_documents(text: str) -> list[str]:
    """The non-empty YAML documents of a rendered template, as Helm wrote them."""
    docs, current = [], []
    for line in text.splitlines(keepends=True):
        if line.rstrip() == "---":
            docs.append("".join(current))
            current = []
        else:
            current.append(line)
    docs.append("".join(current))
    return [d.strip("\n") + "\n" for d in docs if yaml.safe_load(d) is not None]


def render(
    values: dict[str, Any] | None = None, chart_dir: Path = CHART, name: str = RELEASE, namespace: str = NAMESPACE
) -> list[tuple[str, str]]:
    """Render the chart with real Helm: ``(template path, document text)`` in install order.
    NOTES.txt is left out. Raises helm_python's errors (a bad value fails values.schema.json)."""
    import helm_python

    with helm_python.Chart.load(str(chart_dir)) as chart:
        rendered = chart.render(values=values or {}, name=name, namespace=namespace, is_install=True)
    docs = []
    for path in sorted(rendered):
        if path.endswith(".yaml"):
            docs += [(path, d) for d in split_documents(rendered[path])]

    def order(item: tuple[str, str]) -> tuple[int, str, str]:
        obj = yaml.safe_load(item[1])
        kind = obj["kind"]
        meta = obj["metadata"]
        rank = KIND_ORDER.index(kind) if kind in KIND_ORDER else len(KIND_ORDER)
        return rank, meta.get("namespace", ""), meta["name"]

    return sorted(docs, key=order)


def render_objects(values: dict[str, Any] | None = None, **kwargs: Any) -> list[dict[str, Any]]:
    return [yaml.safe_load(doc) for _, doc in render(values, **kwargs)]


def plain_manifests() -> dict[Path, str]:
    header = (
        f"# Generated by scripts/render-manifests: helm/h5ngff rendered with its default values as\n"
        f"# release {RELEASE!r} in namespace {NAMESPACE!r}. Do not edit; change the chart and re-run it.\n"
        f"# Install: kubectl apply -k manifests/ (the CRDs, the namespace and these objects).\n"
    )
    body = "---\n".join(f"# Source: {path}\n{doc}" for path, doc in render())
    namespace = {
        "apiVersion": "v1",
        "kind": "Namespace",
        "metadata": {"name": NAMESPACE, "labels": {"app.kubernetes.io/name": "h5ngff"}},
    }
    kustomization = {
        "apiVersion": "kustomize.config.k8s.io/v1beta1",
        "kind": "Kustomization",
        "resources": ["crd.yaml", "crd-batch.yaml", "namespace.yaml", "h5ngff.yaml"],
    }
    return {
        MANIFESTS / "h5ngff.yaml": header + "---\n" + body,
        MANIFESTS
        / "namespace.yaml": "# Generated by scripts/render-manifests; the namespace the plain manifests install into.\n"
        + yaml.safe_dump(namespace, sort_keys=False),
        MANIFESTS / "kustomization.yaml": "# Generated by scripts/render-manifests. kubectl apply -k manifests/\n"
        + yaml.safe_dump(kustomization, sort_keys=False),
    }


def drifted(files: dict[Path, str]) -> list[Path]:
    return [p for p, text in files.items() if not p.exists() or p.read_text() != text]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="Change nothing; exit 1 if any generated file differs.")
    args = parser.parse_args(argv)
    copies = chart_copies()
    if args.check:
        # Render from the chart as it is on disk: a stale copy shows up as drift of the copy.
        stale = drifted(copies) + drifted(plain_manifests())
        for path in stale:
            print(f"drifted: {path.relative_to(ROOT)}", file=sys.stderr)
        return 1 if stale else 0
    for path, text in copies.items():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    for path, text in plain_manifests().items():
        path.write_text(text)
        print(f"wrote {path.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
