"""The DaskCluster guard: every DaskCluster in the served namespaces is checked against the tenant
policy and the ConversionJob it belongs to, and deleted when it asks for more.

Why: the runner's service account may create DaskClusters (rbac.py's RUNNER_RULES), and RBAC
cannot limit ``create`` to some pod specs. The Dask Operator then creates the pods with its own
permissions. So a runner running an image the policy allows but the tenant wrote could create a
DaskCluster with a forbidden image, a hostPath or a privileged container; the policy would hold
for the runner Job only. The check itself is pure (``policy.dask_cluster_violations``); this
module watches, deletes and reports.

A raw event handler, not ``on.create``/``on.resume``: kopf stores no state in the DaskCluster (no
annotation patches, so no ``patch`` permission), and every change of the object is checked too,
not only its creation. The owning ConversionJobs come from a kopf index, which kopf fills before
any handler runs, so a legit cluster is never judged before its job is known.
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from typing import Any, Protocol

import kopf

from ...errors import SpecError
from ...jobspec import (
    API_VERSION,
    BATCH_KIND,
    BATCH_PLURAL,
    GROUP,
    KIND,
    PLURAL,
    VERSION,
    ConversionJobSpec,
    parse_job_spec,
)
from ...k8s import dask_cluster_name
from ..kube import KubeApi, Transient, namespaced
from ..schema.batchspec import parse_batch_spec
from ..schema.policy import TenantPolicy, dask_cluster_violations

log = logging.getLogger(__name__)

DASK_API = "kubernetes.dask.org/v1"
DENIED = "PolicyDenied"
#: How often each (namespace, DaskCluster) was judged, in this process: what tests wait for
#: instead of sleeping ("it stays" means it was checked and kept).
checked: Counter[tuple[str, str]] = Counter()
#: A DaskCluster's owning ConversionJob: its name, uid and spec.
Owner = tuple[str, str, dict[str, Any]]


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
    """Add the index of ConversionJobs by cluster name and the DaskCluster check to ``registry``
    (``cfg`` is the operator's OperatorConfig: its policy, image and runner account)."""

    @kopf.index(GROUP, VERSION, PLURAL, id="cluster_owners", registry=registry)
    def cluster_owners(
        namespace: str | None, name: str, uid: str, spec: kopf.Spec, **_: Any
    ) -> dict[tuple[str | None, str], Owner]:
        return {(namespace, dask_cluster_name(name)): (name, uid, dict(spec))}

    @kopf.on.event("kubernetes.dask.org", "v1", "daskclusters", id="cluster_guard", registry=registry)
    async def cluster_guard(
        type: str, body: kopf.Body, namespace: str | None, name: str, meta: kopf.Meta, memo: GuardMemo, **kwargs: Any
    ) -> None:
        if type == "DELETED" or meta.get("deletionTimestamp") or namespace is None:
            return
        # kopf passes every index under its id; a parameter of that name would not fit kopf's types.
        owners: kopf.Index[tuple[str | None, str], Owner] = kwargs["cluster_owners"]
        owner = next(iter(owners.get((namespace, name), ())), None)
        kind = KIND
        if owner is None:
            owner = await _batch_owner(memo.state.kube, dict(body), namespace, name)
            kind = BATCH_KIND if owner is not None else KIND
        await _judge(cfg, memo.state.kube, dict(body), namespace, name, owner, kind)


async def _batch_owner(kube: KubeApi, body: dict[str, Any], namespace: str, name: str) -> Owner | None:
    """The ConversionBatch whose cluster this is: named by the cluster's ownerReference, and only
    if that batch exists with that uid and its cluster has this name (a runner cannot borrow
    another batch's spec by naming it: the name would not match)."""
    for ref in (body.get("metadata") or {}).get("ownerReferences") or ():
        if ref.get("kind") != BATCH_KIND or dask_cluster_name(str(ref.get("name"))) != name:
            continue
        batch = await kube.get(namespaced(API_VERSION, namespace, BATCH_PLURAL, str(ref["name"])))
        if batch is not None and (batch.get("metadata") or {}).get("uid") == ref.get("uid"):
            return str(ref["name"]), str(ref["uid"]), dict(batch.get("spec") or {})
    return None


async def _judge(
    cfg: GuardConfig,
    kube: KubeApi,
    body: dict[str, Any],
    namespace: str,
    name: str,
    owner: Owner | None,
    kind: str = KIND,
) -> None:
    """Delete the DaskCluster ``body`` if it asks for more than its job (or batch) and the policy allow."""
    violations = dask_cluster_violations(body, _spec_of(owner, kind), cfg.policy, cfg.image, cfg.runner_service_account)
    if violations:
        message = f"Deleted DaskCluster {namespace}/{name}: " + "; ".join(violations)
        log.warning("%s", message)
        await _delete(kube, namespace, name, cfg.retry_delay)
        # On the ConversionJob when there is one: that is where its author looks.
        job = (
            {
                "apiVersion": API_VERSION,
                "kind": kind,
                "metadata": {"name": owner[0], "namespace": namespace, "uid": owner[1]},
            }
            if owner
            else None
        )
        target: Any = job or body
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


def _spec_of(owner: Owner | None, kind: str = KIND) -> ConversionJobSpec | None:
    if owner is None:
        return None
    try:
        return parse_batch_spec(owner[2]) if kind == BATCH_KIND else parse_job_spec(owner[2])
    except SpecError:
        return None  # a job with an invalid spec never gets a runner, so neither a cluster
