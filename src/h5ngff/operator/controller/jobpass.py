"""One reconcile pass of a ConversionJob, without kopf: gather what the controller observes, call
the pure ``reconcile`` and carry its decision out (handlers.py runs it from a kopf timer; the
property tests run it over an in-memory API).

A pass costs no API call unless something must change: runner Jobs come from a kopf index, and
the pure function asks for anything else (the Job by name, the pods and Events, the Lease) by
``Decision.needs``. Decisions are carried out in the order that survives a crash between any two
calls: children deleted and the Lease given back before the status write that forgets them; the
status write that announces an attempt before its runner Job is created; the Job's uid recorded
right after. A pass that sees its own previous write not yet reflected in the object waits for
the watch to catch up instead of acting twice.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Mapping

from ...jobspec import API_VERSION, BATCH_KIND, KIND, PLURAL, ConversionJobSpec, Owner, parse_job_spec
from ...k8s import label_value
from ...phases import TERMINAL_PHASES
from ..kube import KubeError, Transient, namespaced
from ..schema.policy import policy_violations
from ..schema.status import ConversionJobStatus, bounded, now, read_status
from .children import create_runner_job, delete_cluster, delete_job, ensure_runner_rbac, pods_of
from .diagnose import job_summary
from .lease import acquire, holder_identity, lease_body, lease_name, output_key, release
from .manifests import build_runner_job, runner_account
from .names import name_taken
from .jobdecision import Decision, Observed, patched
from .reconcile import reconcile
from .state import ControllerState, count_error, parse_once, Expectation, Names, OperatorConfig, RunnerJobs

#: How long a pass waits for its own previous status write to show up before acting anyway.
CONSISTENCY_WINDOW = 15.0


def observe_job(
    owner: Owner,
    body: Mapping[str, Any],
    status: ConversionJobStatus,
    spec: ConversionJobSpec | None,
    error: str | None,
    index: RunnerJobs,
) -> Observed:
    """What a pass knows without an API call: the object (and its ``status``, as the model), its
    spec, and the runner Jobs index."""
    meta = body["metadata"]
    jobs = tuple(j for j in index.get((owner.namespace, label_value(owner.name)), ()) if j.owner_uid in ("", owner.uid))
    t, generation = now(), int(meta.get("generation") or 1)
    if spec is None:
        return Observed(
            owner.name, status, 0, status.output or "", jobs=jobs, now=t, generation=generation, spec_error=error
        )
    delays = tuple(spec.retry.delay(n) for n in range(1, spec.backoff_limit + 2))
    return Observed(
        owner.name,
        status,
        spec.backoff_limit,
        spec.output.path,
        conversion=spec.conversion_hash(),
        legacy_conversion=spec.legacy_conversion_hash(),
        other_conversions=(spec.written_conversion_hash(),),
        retry_delays=delays,
        deadline_seconds=spec.active_deadline_seconds,
        lease_name=lease_name(output_key(spec, owner.namespace)),
        jobs=jobs,
        now=t,
        generation=generation,
        spec_error=error,
    )


async def reconcile_job(
    cfg: OperatorConfig, state: ControllerState, body: Mapping[str, Any], index: RunnerJobs, names: Names
) -> None:
    meta = body["metadata"]
    status = read_status(ConversionJobStatus, body.get("status"))
    owner = Owner(meta["namespace"], meta["name"], meta["uid"])
    if _stale(state, owner.uid, status):
        return
    spec, error = parse_once(state.parsed, body, parse_job_spec)
    if error is not None:
        count_error(cfg.metrics, "invalid_spec")
    observed = observe_job(owner, body, status, spec, error, index)
    if spec is not None:
        denial = "; ".join(policy_violations(spec, cfg.policy, cfg.image, cfg.runner_service_account)) or None
        taken = name_taken(KIND, BATCH_KIND, meta, names)
        observed = dataclasses.replace(observed, policy_denial=denial, name_taken=taken)
    attempt = status.attempts or 0
    observed = dataclasses.replace(observed, known_uncreated=(owner.uid, attempt) in state.uncreated)
    decision = await _decide(state, owner, spec, observed)
    refusal = await _act(cfg, state, owner, spec, body, status, decision)
    if refusal is not None:  # Kubernetes refused the runner Job for good: end the attempt now, saying why
        observed = dataclasses.replace(observed, status=patched(status, decision.patch), create_rejected=refusal)
        await _act(cfg, state, owner, spec, body, status, await _decide(state, owner, spec, observed))
    if cfg.metrics is not None:
        cfg.metrics.reconciled(owner.namespace, owner.name)


async def _decide(state: ControllerState, owner: Owner, spec: ConversionJobSpec | None, observed: Observed) -> Decision:
    decision = reconcile(observed)
    for _ in range(4):  # each lookup at most once: the runner Job, pods (and Events), the Lease
        if not decision.needs:
            break
        observed = await _look_up(state, owner, spec, observed, decision)
        decision = reconcile(observed)
    return decision


async def _act(
    cfg: OperatorConfig,
    state: ControllerState,
    owner: Owner,
    spec: ConversionJobSpec | None,
    body: Mapping[str, Any],
    status: ConversionJobStatus,
    decision: Decision,
) -> str | None:
    """Carry a decision out, in the crash-safe order (module docstring). Returns Kubernetes'
    message when it refused the runner Job for good. ``status`` is the one the pass read."""
    await _clean_up(state, owner, decision)
    if decision.patch:
        await _write_status(state, owner, decision.patch)
        written = patched(status, decision.patch)
        state.expectations[owner.uid] = Expectation(
            written.attempts or 0, written.phase or "", time.monotonic() + CONSISTENCY_WINDOW
        )
    refusal = None
    if decision.ensure_attempt is not None and spec is not None:
        uid, refusal = await _create_runner(cfg, state, owner, spec, decision)
        if uid:
            await _write_status(state, owner, {"runnerJobUid": uid})
    if decision.event:
        kind, reason, message = decision.event
        state.emit(body, kind, reason, bounded(message) or "")
    return refusal


async def _look_up(
    state: ControllerState, owner: Owner, spec: ConversionJobSpec | None, o: Observed, d: Decision
) -> Observed:
    kube = state.kube
    update: dict[str, Any] = {}
    if "job" in d.needs and not o.job_checked:
        found = await kube.get(namespaced("batch/v1", owner.namespace, "jobs", o.status.runner_job or "-"))
        summary = job_summary(found) if found else None
        mine = summary is not None and summary.owner_uid in ("", owner.uid)
        update.update(jobs=o.jobs + ((summary,) if summary is not None and mine else ()), job_checked=True)
    if "pods" in d.needs and not o.pods_checked:
        update.update(pods=tuple(await pods_of(kube, owner.namespace, owner.name)), pods_checked=True)
    if "events" in d.needs and not o.events_checked:
        events = await kube.list(
            namespaced("v1", owner.namespace, "events"),
            field_selector={"involvedObject.kind": "Job", "involvedObject.name": o.status.runner_job or ""},
        )
        update.update(events=tuple(events), events_checked=True)
    if "lease" in d.needs and o.lease is None and spec is not None:
        me = holder_identity(owner.namespace, owner.name, owner.uid)
        body = lease_body(
            output_key(spec, owner.namespace),
            owner.namespace,
            owner.name,
            owner.uid,
            API_VERSION,
            KIND,
            state.leases.namespace,
        )
        async with state.leases.lock:
            if d.release_lease:
                await release(kube, state.leases.namespace, d.release_lease, me, owner.namespace)
            update["lease"] = await acquire(kube, body, owner.namespace)
    return dataclasses.replace(o, **update)


async def _write_status(state: ControllerState, owner: Owner, patch: dict[str, Any]) -> None:
    # Our own client, not kopf's ``patch``: kopf applies a timer's patch outside the handler, where
    # an API error (a 409, say) ends the timer for good; here it is a TemporaryError and a retry.
    await state.kube.patch_merge(
        namespaced(API_VERSION, owner.namespace, PLURAL, owner.name, "status"), {"status": patch}
    )


def _stale(state: ControllerState, uid: str, status: ConversionJobStatus) -> bool:
    """True while the object does not yet show what our last pass wrote (the watch lags)."""
    expected = state.expectations.get(uid)
    if expected is None:
        return False
    caught_up = (status.attempts or 0) >= expected.attempts and (
        status.phase == expected.phase or expected.phase not in TERMINAL_PHASES
    )
    if caught_up or time.monotonic() > expected.deadline:
        state.expectations.pop(uid, None)
        return False
    return True


async def _clean_up(state: ControllerState, owner: Owner, decision: Decision) -> None:
    if decision.delete_job:
        await delete_job(state.kube, owner.namespace, decision.delete_job)
    if decision.delete_cluster:
        await delete_cluster(state.kube, owner.namespace, owner.name)
    if decision.release_lease and "lease" not in decision.needs:
        # Before the status write that forgets it: a failed write leaves a retry, never a leak.
        me = holder_identity(owner.namespace, owner.name, owner.uid)
        await release(state.kube, state.leases.namespace, decision.release_lease, me, owner.namespace)


async def _create_runner(
    cfg: OperatorConfig, state: ControllerState, owner: Owner, spec: ConversionJobSpec, decision: Decision
) -> tuple[str | None, str | None]:
    """Create the attempt's runner Job: (its uid, None), (None, None) when it exists already, or
    (None, Kubernetes' message) when Kubernetes refuses it for good."""
    attempt = decision.ensure_attempt or 0
    await ensure_runner_rbac(state.kube, owner, runner_account(spec, cfg.runner_service_account))
    job = build_runner_job(
        owner, spec, attempt, cfg.image, resume=decision.resume, default_service_account=cfg.runner_service_account
    )
    try:
        uid, refusal = await create_runner_job(state.kube, owner.namespace, job)
    except Transient:
        raise  # no answer, or a busy server: the Job may exist, so nothing is known
    except KubeError:
        state.uncreated.add((owner.uid, attempt))  # a definite answer: it does not exist
        raise
    if refusal is not None:
        state.uncreated.add((owner.uid, attempt))
    else:
        state.uncreated.discard((owner.uid, attempt))
    return uid, refusal
