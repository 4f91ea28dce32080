"""One reconcile pass of a ConversionBatch, without kopf (jobpass.py is the ConversionJob's).

It gathers what the controller observes (the spec's items, the status, the runner Job from the
shared ``runner_jobs`` index, and on request the items' output Leases and the batch's pods),
calls the pure ``reconcile_batch`` and carries the decision out in the order that survives a
crash between any two calls: children deleted and Leases given back before the status write that
forgets them; the status write that announces an attempt (its items, their Leases) before its
runner Job is created; the Job's uid recorded right after.

The runner Job of a batch is a ConversionJob's runner Job (manifests.build_runner_job) whose
runner contract (operator/contract.py) names the kind and the items of the attempt; ``h5ngff
runner`` then runs operator/runner/batch.py.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Mapping

from ...jobspec import API_VERSION, BATCH_KIND, BATCH_PLURAL, KIND, Owner
from ...k8s import label_value
from ..kube import namespaced
from ..schema.batchspec import ConversionBatchSpec, PlannedItem, parse_batch_spec
from ..schema.policy import policy_violations
from ..schema.status import bounded, now
from .batchreconcile import BatchDecision, BatchObserved, DesiredItem, LeaseAnswer, reconcile_batch
from .children import create_runner_job, delete_cluster, delete_job, ensure_runner_rbac, pods_of
from .diagnose import job_summary
from .lease import acquire, holder_identity, lease_body, lease_name, output_key, release
from .manifests import build_runner_job, runner_account
from .names import name_taken
from .state import ControllerState, count_error, parse_once, Names, OperatorConfig, RunnerJobs

#: How long a pass waits for its own previous status write to show up (jobpass.CONSISTENCY_WINDOW).
CONSISTENCY_WINDOW = 15.0


def desired_items(spec: ConversionBatchSpec, namespace: str) -> tuple[dict[str, PlannedItem], tuple[DesiredItem, ...]]:
    planned = {p.id: p for p in spec.planned_items()}
    desired = tuple(
        DesiredItem(
            p.id,
            p.item.source,
            p.output,
            p.conversion_hash(),
            lease_name(output_key(p.spec, namespace)),
            accepted_hashes=(p.spec.written_conversion_hash(), p.spec.legacy_conversion_hash()),
        )
        for p in planned.values()
    )
    return planned, desired


async def reconcile_batch_once(
    cfg: OperatorConfig, state: ControllerState, body: Mapping[str, Any], index: RunnerJobs, names: Names
) -> None:
    meta, status = body["metadata"], dict(body.get("status") or {})
    owner = Owner(meta["namespace"], meta["name"], meta["uid"], kind=BATCH_KIND)
    if _stale(state, owner.uid, status):
        return
    spec, error = parse_once(state.batch_parsed, body, parse_batch_spec)
    if error is not None:
        count_error(cfg.metrics, "invalid_spec")
    planned, desired = desired_items(spec, owner.namespace) if spec is not None else ({}, None)
    denial = None
    if spec is not None:
        denial = "; ".join(policy_violations(spec, cfg.policy, cfg.image, cfg.runner_service_account)) or None
    jobs = tuple(j for j in index.get((owner.namespace, label_value(owner.name)), ()) if j.owner_uid in ("", owner.uid))
    observed = BatchObserved(
        owner.name,
        status,
        desired,
        backoff_limit=spec.backoff_limit if spec is not None else 0,
        jobs=jobs,
        now=now(),
        generation=int(meta.get("generation") or 1),
        spec_error=error,
        policy_denial=denial,
        name_taken=name_taken(BATCH_KIND, KIND, meta, names),
    )
    decision = reconcile_batch(observed)
    for _ in range(4):  # each lookup at most once: the runner Job, the Leases, the pods
        if not decision.needs:
            break
        observed = await _look_up(state, owner, planned, observed, decision)
        decision = reconcile_batch(observed)
    await _act(cfg, state, owner, spec, body, decision)
    if cfg.metrics is not None:
        cfg.metrics.reconciled(owner.namespace, f"{BATCH_KIND}/{owner.name}")


def _stale(state: ControllerState, uid: str, status: dict[str, Any]) -> bool:
    """True while the object does not yet show the attempt our last pass announced."""
    expected = state.batch_expected.get(uid)
    if expected is None:
        return False
    if int(status.get("attempts") or 0) >= expected[0] or time.monotonic() > expected[1]:
        state.batch_expected.pop(uid, None)
        return False
    return True


async def _look_up(
    state: ControllerState, owner: Owner, planned: dict[str, PlannedItem], o: BatchObserved, d: BatchDecision
) -> BatchObserved:
    kube = state.kube
    update: dict[str, Any] = {}
    if "job" in d.needs and not o.job_checked:
        found = await kube.get(namespaced("batch/v1", owner.namespace, "jobs", o.status.get("runnerJob") or "-"))
        summary = job_summary(found) if found else None
        mine = summary is not None and summary.owner_uid in ("", owner.uid)
        update.update(jobs=o.jobs + ((summary,) if summary is not None and mine else ()), job_checked=True)
    if "leases" in d.needs and o.leases is None:
        answers = {}
        async with state.leases.lock:
            for item_id in d.acquire:
                item = planned.get(item_id)
                if item is None:
                    continue
                key = output_key(item.spec, owner.namespace)
                body = lease_body(
                    key, owner.namespace, owner.name, owner.uid, API_VERSION, BATCH_KIND, state.leases.namespace
                )
                answer = await acquire(kube, body, owner.namespace)
                answers[item_id] = LeaseAnswer(answer.name, answer.held, answer.holder)
        update["leases"] = answers
    if "pods" in d.needs and not o.pods_checked:
        update.update(pods=tuple(await pods_of(kube, owner.namespace, owner.name)), pods_checked=True)
    return dataclasses.replace(o, **update)


async def _act(
    cfg: OperatorConfig,
    state: ControllerState,
    owner: Owner,
    spec: ConversionBatchSpec | None,
    body: Mapping[str, Any],
    d: BatchDecision,
) -> None:
    kube = state.kube
    if d.delete_job:
        await delete_job(kube, owner.namespace, d.delete_job)
    if d.delete_cluster:
        await delete_cluster(kube, owner.namespace, owner.name)
    me = holder_identity(owner.namespace, owner.name, owner.uid)
    for name in d.release_leases:  # before the status write that forgets them: a failed write leaves a retry
        await release(kube, state.leases.namespace, name, me, owner.namespace)
    status = dict(body.get("status") or {})
    if d.patch:
        await _write_status(state, owner, d.patch)
        if d.ensure_attempt:
            state.batch_expected[owner.uid] = (d.ensure_attempt, time.monotonic() + CONSISTENCY_WINDOW)
    if d.ensure_attempt is not None and spec is not None:
        items = d.patch.get("runningItems") or status.get("runningItems") or []
        attempt_owner = dataclasses.replace(owner, attempt=d.ensure_attempt)
        await ensure_runner_rbac(kube, attempt_owner, runner_account(spec, cfg.runner_service_account))
        job = build_runner_job(
            attempt_owner,
            spec,
            d.ensure_attempt,
            cfg.image,
            default_service_account=cfg.runner_service_account,
            items=items,
            resume_items=d.resume,
        )
        uid, refusal = await create_runner_job(kube, owner.namespace, job)
        if uid:
            await _write_status(state, owner, {"runnerJobUid": uid})
        if refusal is not None:
            state.emit(
                body,
                "Warning",
                "Rejected",
                bounded(f"Kubernetes refused runner Job {job['metadata']['name']}: {refusal}") or "",
            )
    if d.event:
        kind, reason, message = d.event
        state.emit(body, kind, reason, bounded(message) or "")


async def _write_status(state: ControllerState, owner: Owner, patch: dict[str, Any]) -> None:
    await state.kube.patch_merge(
        namespaced(API_VERSION, owner.namespace, BATCH_PLURAL, owner.name, "status"), {"status": patch}
    )
