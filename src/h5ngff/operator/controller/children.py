"""What a ConversionJob and a ConversionBatch own in the cluster, and the calls that make, find and
remove it: runner Jobs (with their RBAC), the DaskCluster, their pods. Shared by both kinds'
passes (jobpass, batchpass); every call goes through ``kube.KubeApi``."""

from __future__ import annotations

import logging
from typing import Any

from ...jobspec import Owner
from ...k8s import label_value
from ..kube import Conflict, KubeApi, KubeError, Transient, namespaced
from .diagnose import live_pods
from .lease import holder_identity, release_all
from .manifests import LABEL_JOB, build_runner_role, build_runner_role_binding, dask_cluster_name

log = logging.getLogger(__name__)

#: HTTP answers to a create that no retry changes: the object itself is invalid.
PERMANENT_REFUSALS = (400, 422)
DASK_API = "kubernetes.dask.org/v1"


async def pods_of(kube: KubeApi, namespace: str, name: str) -> list[dict[str, Any]]:
    """The runner pods of every attempt and the pods of the object's DaskCluster: every pod that
    may write its outputs. By name, not by owner: a pod of a Job or cluster already deleted is
    still found while it terminates (and it still counts: it may still write)."""
    pods = await kube.list(namespaced("v1", namespace, "pods"), {LABEL_JOB: label_value(name)})
    seen = {p["metadata"]["name"] for p in pods}
    dask = await kube.list(namespaced("v1", namespace, "pods"), {"dask.org/cluster-name": dask_cluster_name(name)})
    return pods + [p for p in dask if p["metadata"]["name"] not in seen]


async def delete_job(kube: KubeApi, namespace: str, name: str) -> None:
    if await kube.delete(namespaced("batch/v1", namespace, "jobs", name)):
        log.info("deleted runner Job %s/%s", namespace, name)


async def delete_cluster(kube: KubeApi, namespace: str, name: str) -> None:
    """Delete the object's DaskCluster (its pods go with it): after an attempt, and again while
    waiting for pods (a runner that was starting could have created it once more)."""
    await kube.delete(namespaced(DASK_API, namespace, "daskclusters", dask_cluster_name(name)))


async def ensure_runner_rbac(kube: KubeApi, owner: Owner, account: str) -> None:
    """The runner's permission to patch its own object's status (rbac.py's RUNNER_*_RULES),
    before the runner exists; an existing Role or RoleBinding (an earlier attempt's) is kept."""
    rbac = "rbac.authorization.k8s.io/v1"
    for plural, obj in (
        ("roles", build_runner_role(owner)),
        ("rolebindings", build_runner_role_binding(owner, account)),
    ):
        try:
            await kube.create(namespaced(rbac, owner.namespace, plural), obj)
        except Conflict:
            pass


async def create_runner_job(kube: KubeApi, namespace: str, job: dict[str, Any]) -> tuple[str | None, str | None]:
    """Create a runner Job: (its uid, None); (None, None) when it exists already (an earlier pass
    or a restarted operator made it: kept, never a twin); or (None, Kubernetes' message) when
    Kubernetes refuses it for good (HTTP 400, 422). Another definite refusal raises KubeError,
    and no answer raises Transient (the Job may exist: nothing is known)."""
    name = job["metadata"]["name"]
    try:
        created = await kube.create(namespaced("batch/v1", namespace, "jobs"), job)
    except Conflict:
        log.info("runner Job %s/%s already exists", namespace, name)
        return None, None
    except Transient:
        raise
    except KubeError as exc:
        if exc.status in PERMANENT_REFUSALS:
            return None, exc.body_message
        raise
    log.info("created runner Job %s/%s", namespace, name)
    return str(((created or {}).get("metadata") or {}).get("uid") or "") or None, None


async def remove_children(kube: KubeApi, owner: Owner, ran: bool, lease_namespace: str) -> list[str]:
    """On deletion: delete the object's runner Jobs (their pods go with them) and its
    DaskCluster, and give back every output Lease it holds once none of its pods runs. Returns
    the pods still running. An object that never started an attempt (``ran`` False: a refused
    one, say a ConversionJob and a ConversionBatch of one name) owns no child: nothing of the
    same name is touched, and only its Leases go back."""
    namespace, name = owner.namespace, owner.name
    me = holder_identity(namespace, name, owner.uid)
    if not ran:
        await release_all(kube, lease_namespace, me, namespace)
        return []
    for job in await kube.list(namespaced("batch/v1", namespace, "jobs"), {LABEL_JOB: label_value(name)}):
        refs = (job.get("metadata") or {}).get("ownerReferences") or ()
        if not refs or any(r.get("uid") == owner.uid for r in refs):
            await delete_job(kube, namespace, job["metadata"]["name"])
    await delete_cluster(kube, namespace, name)
    left = live_pods(tuple(await pods_of(kube, namespace, name)))
    if not left:
        await release_all(kube, lease_namespace, me, namespace)
    return left
