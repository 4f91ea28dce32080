"""Tenant policy (operator/schema/policy.py) and the runner's per-job RBAC.

* the pure ``policy_violations`` on a table of specs, with what each message names;
* ``reconcile`` turns a denial into Failed/PolicyDenied with no child ensured;
* the real kopf operator against KMock: a denied job gets no runner Job, no Role, no
  DaskCluster, and its status and Event say why; the same job under a policy that allows it
  runs (negative control);
* the runner may patch its own ConversionJob's status and no other's: the chart's namespace
  Role plus the per-job Role the operator creates, evaluated as RBAC evaluates them, with the
  namespace-wide grant of before as the negative control.
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import kmock
import pytest

from h5ngff.jobspec import parse_job_spec
from h5ngff.operator.controller.manifests import Owner, build_runner_role, build_runner_role_binding, runner_account
from h5ngff.operator.schema.policy import DEFAULT_VOLUME_TYPES, TenantPolicy, policy_violations, volume_type
from h5ngff.operator.schema.rbac import RUNNER_JOB_RULES, RUNNER_RULES, role_rules
from h5ngff.operator.controller.lease import LeaseState
from h5ngff.operator.controller.reconcile import Observed, reconcile
from operator_harness import (
    DASK_RES,
    JOB_RES,
    ROLE_RES,
    ROLEBINDING_RES,
    emulator,
    fast_config,
    manifest,
    operator_running,
    passes,
    wait_for,
)

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_IMAGE, DEFAULT_SA = "ghcr.io/h5ngff/h5ngff:0.1.0", "h5ngff-runner"
BASE = {"source": {"path": "/data/in.h5", "dataset": "/d"}, "output": {"path": "/data/out.ome.zarr"}}


def spec_with(**pod):
    return parse_job_spec({**BASE, "pod": pod})


PVC = {"name": "data", "persistentVolumeClaim": {"claimName": "scans"}}
HOST = {"name": "node", "hostPath": {"path": "/"}}
LAB = TenantPolicy(
    allowed_images=("registry.example.org/lab/*",),
    allowed_service_accounts=("lab-runner",),
    allowed_volume_types=(*DEFAULT_VOLUME_TYPES, "csi"),
    allowed_toleration_keys=("dedicated", "nvidia.com/*"),
)
GPU = {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}
CONTROL_PLANE = {"key": "node-role.kubernetes.io/control-plane", "operator": "Exists", "effect": "NoSchedule"}
EVERY_TAINT = {"operator": "Exists"}

CASES = [
    # (pod settings, policy, expected number of violations, a phrase every message must hold)
    ({}, TenantPolicy(), 0, None),
    ({"image": DEFAULT_IMAGE}, TenantPolicy(), 0, None),
    ({"image": "evil.example/miner:1"}, TenantPolicy(), 1, "policy.allowedImages"),
    ({"image": "registry.example.org/lab/h5ngff:2"}, LAB, 0, None),
    ({"image": "registry.example.org/other/h5ngff:2"}, LAB, 1, "registry.example.org/lab/*"),
    ({"serviceAccountName": DEFAULT_SA}, TenantPolicy(), 0, None),
    ({"serviceAccountName": "deployer"}, TenantPolicy(), 1, "policy.allowedServiceAccounts"),
    ({"serviceAccountName": "lab-runner"}, LAB, 0, None),
    (
        {
            "volumes": [
                PVC,
                {"name": "cm", "configMap": {"name": "x"}},
                {"name": "s", "secret": {"secretName": "x"}},
                {"name": "e"},
            ]
        },
        TenantPolicy(),
        0,
        None,
    ),
    ({"volumes": [PVC, HOST]}, TenantPolicy(), 1, "hostPath"),
    ({"volumes": [{"name": "n", "nfs": {"server": "s", "path": "/"}}]}, TenantPolicy(), 1, "policy.allowedVolumeTypes"),
    ({"volumes": [{"name": "c", "csi": {"driver": "x"}}]}, TenantPolicy(), 1, "csi"),
    ({"volumes": [{"name": "c", "csi": {"driver": "x"}}]}, LAB, 0, None),
    ({"image": "evil:1", "serviceAccountName": "admin", "volumes": [HOST]}, TenantPolicy(), 3, "is not allowed"),
    # Tolerations: taints keep nodes for others, so each key tolerated must be allowed.
    ({"tolerations": [GPU]}, TenantPolicy(), 1, "policy.allowedTolerationKeys"),
    ({"tolerations": [GPU, {"key": "dedicated", "operator": "Equal", "value": "lab"}]}, LAB, 0, None),
    ({"tolerations": [GPU, CONTROL_PLANE]}, LAB, 1, "node-role.kubernetes.io/control-plane"),
    ({"tolerations": [EVERY_TAINT]}, LAB, 1, "every taint"),
    ({"tolerations": [EVERY_TAINT, CONTROL_PLANE]}, TenantPolicy(allowed_toleration_keys=("*",)), 0, None),
    ({"nodeSelector": {"dedicated": "lab"}}, TenantPolicy(), 0, None),
]


@pytest.mark.parametrize("pod, policy, n, phrase", CASES, ids=[str(i) for i in range(len(CASES))])
def test_policy_violations(pod, policy, n, phrase):
    found = policy_violations(spec_with(**pod), policy, DEFAULT_IMAGE, DEFAULT_SA)
    assert len(found) == n, found
    for message in found:
        assert phrase in message and "allowed" in message and "Helm value policy." in message


def test_volume_type_is_the_source_field():
    assert volume_type(PVC) == "persistentVolumeClaim" and volume_type({"name": "x"}) == "emptyDir"


def test_reconcile_denies_first_and_ensures_nothing():
    observed = Observed("scan", {}, 2, "/out", policy_denial="spec.pod.image 'evil:1' is not allowed")
    decision = reconcile(observed)
    assert decision.patch["phase"] == "Failed" and decision.patch["reason"] == "PolicyDenied"
    assert decision.ensure_attempt is None and decision.event[1] == "PolicyDenied"
    assert not decision.needs and decision.release_lease is None  # not even the output's Lease is asked for
    # negative control: the same observation without a denial asks for the output's Lease, and
    # with the Lease held creates attempt 1
    assert reconcile(Observed("scan", {}, 2, "/out", lease_name="lease-a")).needs == {"lease"}
    held = Observed("scan", {}, 2, "/out", lease_name="lease-a", lease=LeaseState("lease-a", True))
    assert reconcile(held).ensure_attempt == 1
    assert (
        reconcile(dataclasses.replace(held, policy_denial="spec.pod.image 'evil:1' is not allowed")).ensure_attempt
        is None
    )


# --- the real operator against KMock ------------------------------------------------------------

DENIED = {
    **BASE,
    "pod": {
        "image": "evil.example/miner:1",
        "volumes": [HOST],
        "volumeMounts": [{"name": "node", "mountPath": "/host"}],
        "tolerations": [CONTROL_PLANE],
    },
}


@pytest.mark.slow
@pytest.mark.integration
@pytest.mark.asyncio
@pytest.mark.timeout(120)
async def test_a_denied_job_fails_with_policy_denied_and_creates_nothing():
    async with emulator() as c, operator_running(cfg := fast_config(c.url)):
        await c.apply(manifest("greedy", DENIED))
        await wait_for(lambda: c.status("greedy").get("phase") == "Failed", what="Failed")
        await passes(cfg, "greedy", 3)  # three more passes over the failed job: none may create anything
        status = c.status("greedy")
        assert status["reason"] == "PolicyDenied"
        assert "evil.example/miner:1" in status["message"] and "hostPath" in status["message"]
        assert "node-role.kubernetes.io/control-plane" in status["message"]
        for resource in (JOB_RES, ROLE_RES, ROLEBINDING_RES, DASK_RES):
            assert c.live(resource) == {}, resource
        created = {
            r.resource.plural
            for r in c.k
            if r.action == kmock.action.CREATE
            and r.resource is not None
            and r.headers.get("User-Agent", "").startswith(("kopf/", "h5ngff-operator/"))
        }
        assert created <= {"events"}, created
        assert "PolicyDenied" in [e["reason"] for e in c.events()]


@pytest.mark.integration
@pytest.mark.asyncio
@pytest.mark.timeout(120)
async def test_the_same_job_runs_when_the_policy_allows_it():
    """Negative control: what denied the job above is the policy, not the spec."""
    policy = TenantPolicy(
        allowed_images=("evil.example/*",),
        allowed_volume_types=(*DEFAULT_VOLUME_TYPES, "hostPath"),
        allowed_toleration_keys=("node-role.kubernetes.io/*",),
    )
    async with emulator() as c, operator_running(fast_config(c.url, policy=policy)):
        await c.apply(manifest("greedy", DENIED))
        # The status announces the attempt before its Job is created (record before acting).
        await wait_for(
            lambda: c.status("greedy").get("phase") == "Pending" and c.status("greedy").get("runnerJobUid"),
            what="Pending, Job recorded",
        )
        assert list(c.jobs()) == ["greedy-runner-1"]
        (role,) = c.live(ROLE_RES).values()
        (binding,) = c.live(ROLEBINDING_RES).values()
    assert role == {**build_runner_role(Owner("default", "greedy", "uid-greedy")), "metadata": role["metadata"]}
    assert role["rules"] == [
        {
            "apiGroups": ["h5ngff.dev"],
            "resources": ["conversionjobs/status"],
            "resourceNames": ["greedy"],
            "verbs": ["patch"],
        }
    ]
    assert role["metadata"]["ownerReferences"][0]["uid"] == "uid-greedy"
    # the test harness's operator has no default runner account: the pod runs as "default"
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "default", "namespace": "default"}]
    assert binding["roleRef"]["name"] == role["metadata"]["name"]


# --- RBAC: the runner patches only its own job's status -----------------------------------------


def allows(roles: list[dict], bindings: list[dict], sa: str, verb: str, resource: str, name: str) -> bool:
    """Kubernetes RBAC's decision for a namespaced request (rules are additive; resourceNames,
    when present, must list the object's name)."""
    group, _, rest = resource.partition("|")
    by_name = {r["metadata"]["name"]: r for r in roles}
    for b in bindings:
        if not any(s["kind"] == "ServiceAccount" and s["name"] == sa for s in b["subjects"]):
            continue
        for rule in by_name[b["roleRef"]["name"]]["rules"]:
            if (
                group in rule["apiGroups"]
                and rest in rule["resources"]
                and verb in rule["verbs"]
                and ("resourceNames" not in rule or name in rule["resourceNames"])
            ):
                return True
    return False


def _namespace_role(rules) -> tuple[dict, dict]:
    role = {"metadata": {"name": "h5ngff-runner"}, "rules": role_rules(rules)}
    binding = {"roleRef": {"name": "h5ngff-runner"}, "subjects": [{"kind": "ServiceAccount", "name": DEFAULT_SA}]}
    return role, binding


STATUS = "h5ngff.dev|conversionjobs/status"


def test_the_runner_may_patch_its_own_jobs_status_only():
    spec = parse_job_spec(BASE)
    account = runner_account(spec, DEFAULT_SA)
    ns_role, ns_binding = _namespace_role(RUNNER_RULES)
    mine = Owner("imaging", "mine", "u1")
    roles = [ns_role, build_runner_role(mine)]
    bindings = [ns_binding, build_runner_role_binding(mine, account)]
    assert allows(roles, bindings, account, "patch", STATUS, "mine")
    assert not allows(roles, bindings, account, "patch", STATUS, "theirs")
    assert allows(
        roles, bindings, account, "create", "kubernetes.dask.org|daskclusters", "x"
    )  # the rest stays namespace-wide


def test_the_namespace_wide_grant_of_before_lets_a_runner_patch_any_job():
    """Negative control: with conversionjobs/status in the namespace Role (as before issue 12),
    the evaluator above lets the runner patch another team's job."""
    ns_role, ns_binding = _namespace_role(RUNNER_RULES + RUNNER_JOB_RULES)
    assert allows([ns_role], [ns_binding], DEFAULT_SA, "patch", STATUS, "theirs")


def test_the_chart_no_longer_grants_status_namespace_wide():
    sys.path.insert(0, str(ROOT / "scripts"))
    import render_manifests as rm

    runner_roles = [
        o for o in rm.render_objects({}) if o["kind"] == "Role" and o["metadata"]["name"].endswith("-runner")
    ]
    assert runner_roles
    for role in runner_roles:
        assert not any("conversionjobs/status" in r["resources"] for r in role["rules"]), role["rules"]
