"""The kopf handlers of ConversionBatches: thin, as the ConversionJob's (operator/handlers.py).

One timer per ConversionBatch gathers what the operator observes (the spec's items, the status,
the runner Job from the shared ``runner_jobs`` index, and on request the items' output Leases and
the batch's pods), calls the pure ``reconcile_batch`` and carries the decision out in the order
that survives a crash between any two calls: children deleted and Leases given back before the
status write that forgets them; the status write that announces an attempt (its items) before
its runner Job is created; the Job's uid recorded right after.

The runner Job of a batch is a ConversionJob's runner Job (manifests.build_runner_job) whose
environment names the kind and the items of the attempt (``H5NGFF_KIND``, ``H5NGFF_ITEMS``,
``H5NGFF_RESUME``); ``h5ngff runner`` then runs operator/batchrunner.py.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Protocol

import kopf

from ..k8s import label_value
from .batchreconcile import BatchDecision, BatchObserved, DesiredItem, LeaseAnswer, reconcile_batch
from .batchspec import (
    BATCH_KIND,
    BATCH_PLURAL,
    ConversionBatchSpec,
    PlannedItem,
    parse_batch_spec,
    runner_env,
)
from .diagnose import JobSummary, job_summary, live_pods
from .handling import count_error, not_deleted, parse_once
from .kube import Conflict, Kube, KubeError, Transient, namespaced
from .lease import LeaseScope, acquire, holder_identity, lease_body, lease_name, output_key, release
from .manifests import (
    API_VERSION,
    GROUP,
    LABEL_JOB,
    VERSION,
    Owner,
    build_runner_job,
    build_runner_role,
    build_runner_role_binding,
    dask_cluster_name,
    runner_account,
)
from .policy import TenantPolicy, policy_violations
from .status import now

if TYPE_CHECKING:
    from ..metrics.operator import OperatorMetrics

log = logging.getLogger(__name__)

#: How long a pass waits for its own previous status write to show up (handlers.CONSISTENCY_WINDOW).
CONSISTENCY_WINDOW = 15.0
Parsed = tuple[ConversionBatchSpec | None, str | None]


class BatchConfig(Protocol):
    """What the batch handlers read of handlers.OperatorConfig."""

    @property
    def image(self) -> str: ...
    @property
    def runner_service_account(self) -> str | None: ...
    @property
    def policy(self) -> TenantPolicy: ...
    @property
    def interval(self) -> float: ...
    @property
    def retry_delay(self) -> float: ...
    @property
    def delete_wait(self) -> float: ...
    @property
    def lease_namespace(self) -> str: ...
    @property
    def metrics(self) -> OperatorMetrics | None: ...


class BatchMemo(Protocol):
    """What the batch handlers keep in kopf's memo (handlers.OperatorMemo)."""

    kube: Kube
    leases: LeaseScope
    #: ConversionBatch uid -> (its spec as JSON, what parsing it gave).
    batch_parsed: dict[str, tuple[str, Parsed]]
    #: ConversionBatch uid -> (attempts our last write announced, until when to wait for it).
    batch_expected: dict[str, tuple[int, float]]


def register_batch_handlers(registry: kopf.OperatorRegistry, cfg: BatchConfig) -> None:
    @kopf.timer(
        GROUP,
        VERSION,
        BATCH_PLURAL,
        interval=cfg.interval,
        when=not_deleted,
        backoff=cfg.retry_delay,
        id="reconcile_batch",
        registry=registry,
    )
    async def reconcile_batch_timer(body: kopf.Body, memo: BatchMemo, **kwargs: Any) -> None:
        index: kopf.Index[tuple[str, str], JobSummary] = kwargs["runner_jobs"]
        try:
            await reconcile_one(cfg, body, memo, index)
        except (Transient, Conflict) as exc:
            count_error(cfg.metrics, "conflict" if isinstance(exc, Conflict) else "transient")
            raise kopf.TemporaryError(str(exc), delay=cfg.retry_delay) from None
        except KubeError as exc:
            count_error(cfg.metrics, f"http{exc.status or ''}")
            raise kopf.TemporaryError(str(exc), delay=cfg.retry_delay * 6) from None

    @kopf.on.delete(
        GROUP, VERSION, BATCH_PLURAL, backoff=cfg.retry_delay, id="delete_batch_children", registry=registry
    )
    async def delete_batch_children(
        name: str,
        namespace: str | None,
        uid: str,
        status: kopf.Status,
        memo: BatchMemo,
        logger: kopf.Logger,
        runtime: timedelta,
        **_: Any,
    ) -> None:
        if namespace is None:
            raise kopf.PermanentError("Expected a namespaced ConversionBatch.")
        owner = Owner(namespace, name, uid, kind=BATCH_KIND)
        leases = [e["outputLease"] for e in status.get("items") or () if e.get("outputLease")]
        try:
            left = await remove_batch_children(memo.kube, owner, leases, cfg.lease_namespace)
        except Transient as exc:
            raise kopf.TemporaryError(str(exc), delay=cfg.retry_delay) from None
        if left and runtime.total_seconds() < cfg.delete_wait:
            raise kopf.TemporaryError(
                f"waiting for {len(left)} pod(s) to exit: {', '.join(left[:5])}", delay=cfg.retry_delay
            )
        memo.batch_parsed.pop(uid, None)
        logger.info("removed the children of ConversionBatch %s/%s (outputs are left alone)", namespace, name)


def _stale(memo: BatchMemo, uid: str, status: dict[str, Any]) -> bool:
    """True while the object does not yet show the attempt our last pass announced."""
    expected = memo.batch_expected.get(uid)
    if expected is None:
        return False
    if int(status.get("attempts") or 0) >= expected[0] or time.monotonic() > expected[1]:
        memo.batch_expected.pop(uid, None)
        return False
    return True


async def reconcile_one(
    cfg: BatchConfig, body: kopf.Body, memo: BatchMemo, index: kopf.Index[tuple[str, str], JobSummary]
) -> None:
    meta, status = body["metadata"], dict(body.get("status") or {})
    owner = Owner(meta["namespace"], meta["name"], meta["uid"], kind=BATCH_KIND)
    if _stale(memo, owner.uid, status):
        return
    spec, error = parse_once(memo.batch_parsed, body, parse_batch_spec)
    if error is not None:
        count_error(cfg.metrics, "invalid_spec")
    planned = {p.id: p for p in spec.planned_items()} if spec is not None else {}
    desired = (
        tuple(
            DesiredItem(
                p.id, p.item.source, p.output, p.conversion_hash(), lease_name(output_key(p.spec, owner.namespace))
            )
            for p in planned.values()
        )
        if spec is not None
        else None
    )
    denial = (
        "; ".join(policy_violations(spec, cfg.policy, cfg.image, cfg.runner_service_account)) or None
        if spec is not None
        else None
    )
    jobs = tuple(j for j in index.get((owner.namespace, label_value(owner.name)), ()) if j.owner_uid in ("", owner.uid))
    observed = BatchObserved(
        owner.name,
        status,
        desired,
        spec.backoff_limit if spec is not None else 0,
        jobs,
        now(),
        int(meta.get("generation") or 1),
        error,
        denial,
    )
    decision = reconcile_batch(observed)
    for _ in range(4):  # each lookup at most once: the runner Job, the Leases, the pods
        if not decision.needs:
            break
        observed = await _look_up(cfg, memo, owner, planned, observed, decision)
        decision = reconcile_batch(observed)
    await _act(cfg, memo, owner, spec, body, decision)
    if cfg.metrics is not None:
        cfg.metrics.reconciled(owner.namespace, f"{BATCH_KIND}/{owner.name}")


async def _look_up(
    cfg: BatchConfig, memo: BatchMemo, owner: Owner, planned: dict[str, PlannedItem], o: BatchObserved, d: BatchDecision
) -> BatchObserved:
    kube = memo.kube
    update: dict[str, Any] = {}
    if "job" in d.needs and not o.job_checked:
        found = await kube.get(namespaced("batch/v1", owner.namespace, "jobs", o.status.get("runnerJob") or "-"))
        summary = job_summary(found) if found else None
        mine = summary is not None and summary.owner_uid in ("", owner.uid)
        update.update(jobs=o.jobs + ((summary,) if summary is not None and mine else ()), job_checked=True)
    if "leases" in d.needs and o.leases is None:
        answers = {}
        async with memo.leases.lock:
            for item_id in d.acquire:
                item = planned.get(item_id)
                if item is None:
                    continue
                body = lease_body(
                    output_key(item.spec, owner.namespace),
                    owner.namespace,
                    owner.name,
                    owner.uid,
                    API_VERSION,
                    BATCH_KIND,
                    memo.leases.namespace,
                )
                state = await acquire(kube, body, owner.namespace)
                answers[item_id] = LeaseAnswer(state.name, state.held, state.holder)
        update["leases"] = answers
    if "pods" in d.needs and not o.pods_checked:
        update.update(pods=tuple(await batch_pods(kube, owner.namespace, owner.name)), pods_checked=True)
    return dataclasses.replace(o, **update)


async def batch_pods(kube: Kube, namespace: str, name: str) -> list[dict[str, Any]]:
    """The runner pods of every attempt and the pods of the batch's DaskCluster."""
    pods = await kube.list(namespaced("v1", namespace, "pods"), {LABEL_JOB: label_value(name)})
    seen = {p["metadata"]["name"] for p in pods}
    dask = await kube.list(namespaced("v1", namespace, "pods"), {"dask.org/cluster-name": dask_cluster_name(name)})
    return pods + [p for p in dask if p["metadata"]["name"] not in seen]


async def _act(
    cfg: BatchConfig, memo: BatchMemo, owner: Owner, spec: ConversionBatchSpec | None, body: kopf.Body, d: BatchDecision
) -> None:
    kube = memo.kube
    if d.delete_job:
        await kube.delete(namespaced("batch/v1", owner.namespace, "jobs", d.delete_job))
    if d.delete_cluster:
        await kube.delete(
            namespaced("kubernetes.dask.org/v1", owner.namespace, "daskclusters", dask_cluster_name(owner.name))
        )
    me = holder_identity(owner.namespace, owner.name, owner.uid)
    for (
        name
    ) in d.release_leases:  # before the status write that forgets them: a failed write leaves a retry, never a leak
        await release(kube, memo.leases.namespace, name, me, owner.namespace)
    status = dict(body.get("status") or {})
    if d.patch:
        await kube.patch_merge(
            namespaced(API_VERSION, owner.namespace, BATCH_PLURAL, owner.name, "status"), {"status": d.patch}
        )
        if d.ensure_attempt:
            memo.batch_expected[owner.uid] = (d.ensure_attempt, time.monotonic() + CONSISTENCY_WINDOW)
    if d.ensure_attempt is not None and spec is not None:
        items = d.patch.get("runningItems") or status.get("runningItems") or []
        uid = await _create_runner(
            cfg,
            kube,
            Owner(owner.namespace, owner.name, owner.uid, d.ensure_attempt, BATCH_KIND),
            spec,
            items,
            d.resume,
        )
        if uid:
            await kube.patch_merge(
                namespaced(API_VERSION, owner.namespace, BATCH_PLURAL, owner.name, "status"),
                {"status": {"runnerJobUid": uid}},
            )
    if d.event:
        kind, reason, message = d.event
        kopf.event(body, type=kind, reason=reason, message=message)


async def _create_runner(
    cfg: BatchConfig, kube: Kube, owner: Owner, spec: ConversionBatchSpec, items: list[str], resume: tuple[str, ...]
) -> str | None:
    """Create the attempt's runner Job (its RBAC first); an existing one is kept (HTTP 409)."""
    rbac = "rbac.authorization.k8s.io/v1"
    account = runner_account(spec, cfg.runner_service_account)
    for plural, obj in (
        ("roles", build_runner_role(owner)),
        ("rolebindings", build_runner_role_binding(owner, account)),
    ):
        try:
            await kube.create(namespaced(rbac, owner.namespace, plural), obj)
        except Conflict:
            pass
    env = runner_env(items, resume)
    job = build_runner_job(
        owner, spec, owner.attempt, cfg.image, default_service_account=cfg.runner_service_account, extra_env=env
    )
    try:
        created = await kube.create(namespaced("batch/v1", owner.namespace, "jobs"), job)
    except Conflict:
        log.info("runner Job %s/%s already exists", owner.namespace, job["metadata"]["name"])
        return None
    log.info("created runner Job %s/%s for %d item(s)", owner.namespace, job["metadata"]["name"], len(items))
    return str(((created or {}).get("metadata") or {}).get("uid") or "") or None


async def remove_batch_children(kube: Kube, owner: Owner, leases: list[str], lease_namespace: str) -> list[str]:
    """Delete a batch's runner Jobs and DaskCluster, and give back its Leases once nothing of it
    runs. Outputs are never touched. Returns the pods still running."""
    namespace, name = owner.namespace, owner.name
    for job in await kube.list(namespaced("batch/v1", namespace, "jobs"), {LABEL_JOB: label_value(name)}):
        refs = (job.get("metadata") or {}).get("ownerReferences") or ()
        if any(r.get("uid") == owner.uid for r in refs):
            await kube.delete(namespaced("batch/v1", namespace, "jobs", job["metadata"]["name"]))
    await kube.delete(namespaced("kubernetes.dask.org/v1", namespace, "daskclusters", dask_cluster_name(name)))
    left = live_pods(tuple(await batch_pods(kube, namespace, name)))
    if not left:
        me = holder_identity(namespace, name, owner.uid)
        for lease in leases:
            await release(kube, lease_namespace, lease, me, namespace)
    return left
