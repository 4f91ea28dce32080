"""The DaskCluster guard, the second line behind the ValidatingAdmissionPolicy (docs/operator.md,
"Tenant code"): every DaskCluster h5ngff's runners made is checked against the tenant policy and
the attempt that made it, and deleted when it asks for more.

Why: the runner's service account may create DaskClusters (schema/rbac.py's RUNNER_RULES), and
RBAC cannot limit ``create`` to some pod specs. The Dask Operator then creates the pods with its
own permissions. So a runner running an image the policy allows but the tenant wrote could
create a DaskCluster with a forbidden image, a hostPath or a privileged container. The admission
policy (helm/h5ngff/templates/admission-policy.yaml) refuses those before they are stored; this
guard catches what a cluster without it lets through. The check itself is pure
(``policy.dask_cluster_violations``); this module finds what to judge it against, deletes and
reports.

What it touches: only clusters h5ngff's runners made, labelled ``app.kubernetes.io/managed-by:
h5ngff`` and owned (ownerReferences) by a ConversionJob or ConversionBatch. Another team's
notebook cluster in a served namespace is none of its business (the admission policy makes a
runner's cluster carry both marks). What it judges against: the spec of the attempt that made the
cluster (its runner Job's contract), not the object's spec now: an edit the docs say keeps the
conversion (``pod.image`` to another allowed image, ``nodeSelector``) must not end an attempt in
flight; the next attempt runs with the edited spec.

A raw event handler, not ``on.create``/``on.resume``: kopf stores no state in the DaskCluster (no
annotation patches, so no ``patch`` permission), and every change of the object is checked too.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections import Counter
from typing import Any, Mapping, Protocol

import kopf

from ...errors import SpecError
from ...jobspec import API_VERSION, BATCH_KIND, BATCH_PLURAL, GROUP, KIND, PLURAL, ConversionJobSpec, parse_job_spec
from ...k8s import LABEL_ATTEMPT, dask_cluster_name, runner_job_name
from ..contract import ENV
from ..kube import KubeApi, Transient, namespaced
from ..schema.batchspec import parse_batch_spec
from ..schema.daskpolicy import dask_cluster_violations
from ..schema.policy import TenantPolicy

log = logging.getLogger(__name__)

DASK_API = "kubernetes.dask.org/v1"
DENIED = "PolicyDenied"
MANAGED_BY = ("app.kubernetes.io/managed-by", "h5ngff")
#: How often each (namespace, DaskCluster) was judged (or, ``skipped``, left alone as none of
#: h5ngff's), in this process: what tests wait for instead of sleeping.
checked: Counter[tuple[str, str]] = Counter()
skipped: Counter[tuple[str, str]] = Counter()


class GuardConfig(Protocol):
    """What the guard reads of the operator's OperatorConfig (handlers.py, which imports this)."""

    @property
    def policy(self) -> TenantPolicy: ...
    @property
    def image(self) -> str: ...
    @property
    def runner_service_account(self) -> str | None: ...
    @property
    def retry_delay(self) -> float: ...


class GuardState(Protocol):
    kube: KubeApi


class GuardMemo(Protocol):
    """What the guard reads of kopf's memo (handlers.OperatorMemo)."""

    state: GuardState


def register_cluster_guard(registry: kopf.OperatorRegistry, cfg: GuardConfig) -> None:
    """Add the DaskCluster check to ``registry`` (``cfg`` is the operator's OperatorConfig: its
    policy, image and runner account)."""

    @kopf.on.event("kubernetes.dask.org", "v1", "daskclusters", id="cluster_guard", registry=registry)
    async def cluster_guard(
        type: str, body: kopf.Body, namespace: str | None, name: str, meta: kopf.Meta, memo: GuardMemo, **_: Any
    ) -> None:
        if type == "DELETED" or meta.get("deletionTimestamp") or namespace is None:
            return
        cluster = dict(body)
        owner = h5ngff_owner(cluster)
        if owner is None:
            skipped[namespace, name] += 1  # not a runner's: another team's cluster
            return
        await _judge(cfg, memo.state.kube, cluster, namespace, name, owner)


def h5ngff_owner(cluster: Mapping[str, Any]) -> dict[str, Any] | None:
    """The ownerReference to a ConversionJob or ConversionBatch of a cluster h5ngff's runner
    made (labelled managed-by h5ngff), or None."""
    meta = cluster.get("metadata") or {}
    if (meta.get("labels") or {}).get(MANAGED_BY[0]) != MANAGED_BY[1]:
        return None
    for ref in meta.get("ownerReferences") or ():
        if str(ref.get("apiVersion", "")).startswith(f"{GROUP}/") and ref.get("kind") in (KIND, BATCH_KIND):
            return dict(ref)
    return None


async def attempt_spec(kube: KubeApi, namespace: str, cluster: Mapping[str, Any], ref: Mapping[str, Any]) -> Any:
    """The spec the attempt that made ``cluster`` runs (its runner Job's contract), else the
    owner's spec now (the Job is gone), else None (no such owner: not h5ngff's to keep)."""
    owner = await kube.get(
        namespaced(API_VERSION, namespace, PLURAL if ref["kind"] == KIND else BATCH_PLURAL, ref["name"])
    )
    if owner is None or (owner.get("metadata") or {}).get("uid") != ref.get("uid"):
        return None
    parse = parse_batch_spec if ref["kind"] == BATCH_KIND else parse_job_spec
    data: Any = owner.get("spec") or {}
    attempt = ((cluster.get("metadata") or {}).get("labels") or {}).get(LABEL_ATTEMPT)
    if attempt and attempt.isdigit():
        job = await kube.get(namespaced("batch/v1", namespace, "jobs", runner_job_name(ref["name"], int(attempt))))
        refs = ((job or {}).get("metadata") or {}).get("ownerReferences") or ()
        if job is not None and any(r.get("uid") == ref.get("uid") for r in refs):
            env = {
                e.get("name"): e.get("value") for e in job["spec"]["template"]["spec"]["containers"][0].get("env") or ()
            }
            data = json.loads(env.get(ENV["spec"]) or "null") or data
    try:
        return parse(data)
    except (SpecError, ValueError):
        return None  # an invalid spec never gets a runner, so neither a cluster


async def _judge(
    cfg: GuardConfig, kube: KubeApi, cluster: dict[str, Any], namespace: str, name: str, ref: dict[str, Any]
) -> None:
    """Delete ``cluster`` if it asks for more than its attempt and the policy allow."""
    spec: ConversionJobSpec | None = await attempt_spec(kube, namespace, cluster, ref)
    violations = dask_cluster_violations(cluster, spec, cfg.policy, cfg.image, cfg.runner_service_account)
    if spec is not None and name != dask_cluster_name(ref["name"]):
        violations.append(
            f"DaskCluster {name!r} is not {ref['kind']} {ref['name']}'s: its cluster is {dask_cluster_name(ref['name'])!r}."
        )
    if violations:
        message = f"Deleted DaskCluster {namespace}/{name}: " + "; ".join(violations)
        log.warning("%s", message)
        await _delete(kube, namespace, name, cfg.retry_delay)
        # On the ConversionJob (or batch) when there is one: that is where its author looks.
        target: Any = (
            {
                "apiVersion": API_VERSION,
                "kind": ref["kind"],
                "metadata": {"name": ref["name"], "namespace": namespace, "uid": ref["uid"]},
            }
            if spec is not None
            else cluster
        )
        kopf.event(target, type="Warning", reason=DENIED, message=message[:1024])
    checked[namespace, name] += 1


async def _delete(kube: KubeApi, namespace: str, name: str, delay: float, tries: int = 3) -> None:
    # An event handler is not retried by kopf: retry a hiccup here, or the cluster would stay
    # until its next change.
    for attempt in range(tries):
        try:
            await kube.delete(namespaced(DASK_API, namespace, "daskclusters", name))
            return
        except Transient:
            if attempt == tries - 1:
                raise
            await asyncio.sleep(delay)
