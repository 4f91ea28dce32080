"""The kopf handlers: thin. They gather what the operator observes, call the pure
``reconcile`` and carry out its decision.

One timer per ConversionJob does all the work, first at once when the object appears, then
every ``interval`` seconds (finished jobs too: that is where a spec edit is noticed; such a pass
makes no API call). Runner Jobs
are watched through a kopf index, so a pass costs no API call unless something must change.
Handlers are idempotent: children have deterministic names, an existing child is kept (HTTP 409
means "already there"), and a pass that sees its own previous write not yet reflected in the
object waits for the watch to catch up instead of acting twice.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import logging
import os
import random
import threading
import time
from dataclasses import dataclass, field
from datetime import timedelta
from typing import TYPE_CHECKING, Any, TypedDict

import kopf

from ..k8s import LABEL_COMPONENT, label_value
from ..jobspec import ConversionJobSpec, parse_job_spec
from .handling import count_error, not_deleted, parse_once
from .kube import Conflict, Kube, KubeConfig, KubeError, Transient, namespaced
from .lease import LeaseScope, acquire, holder_identity, lease_body, lease_name, output_key, release
from .manifests import (
    API_VERSION,
    DEFAULT_IMAGE,
    GROUP,
    KIND,
    LABEL_JOB,
    PLURAL,
    VERSION,
    Owner,
    build_runner_job,
    build_runner_role,
    build_runner_role_binding,
    dask_cluster_name,
    runner_account,
)
from .batchhandlers import register_batch_handlers
from .guard import register_cluster_guard
from .policy import TenantPolicy, policy_violations
from .diagnose import JobSummary, job_summary, live_pods
from .reconcile import Decision, Observed, reconcile
from ..phases import TERMINAL_PHASES
from .status import now

if TYPE_CHECKING:
    from ..metrics.operator import OperatorMetrics

log = logging.getLogger(__name__)


class _Resource(TypedDict):
    """kopf's keyword arguments naming a resource."""

    group: str
    version: str
    plural: str


CJ: _Resource = {"group": GROUP, "version": VERSION, "plural": PLURAL}
#: The runner Jobs index (id ``runner_jobs``): (namespace, job label) -> the Jobs' summaries.
RunnerJobs = kopf.Index[tuple[str, str], JobSummary]
OPERATOR_AGENT = "h5ngff-operator"
#: How long a pass waits for its own previous status write to show up before acting anyway.
CONSISTENCY_WINDOW = 15.0


@dataclass
class OperatorConfig:
    """How one operator process runs; every field has a command-line flag in ``h5ngff operator``."""

    #: Image of runner and Dask pods when a ConversionJob names none.
    image: str = DEFAULT_IMAGE
    #: Service account of runner pods when a ConversionJob names none (needs the runner RBAC).
    runner_service_account: str | None = None
    #: What a ConversionJob may ask for beyond the two defaults above (operator/policy.py).
    policy: TenantPolicy = field(default_factory=TenantPolicy)
    #: Seconds between reconcile passes of an unfinished job (a runner's end is noticed within it).
    interval: float = 5.0
    api: KubeConfig = field(default_factory=KubeConfig.from_env)
    #: Namespaces to serve; empty = the whole cluster.
    namespaces: tuple[str, ...] = ()
    #: kopf peering name (a KopfPeering/ClusterKopfPeering object); None = standalone.
    peering: str | None = "h5ngff"
    #: Peering priority: the live replica with the highest one acts, the others stand by. kopf
    #: pauses *all* replicas of equal priority, so each process draws its own unless told.
    priority: int = field(default_factory=lambda: random.randint(1, 1_000_000))
    #: Backoffs (s) of kopf's own API retries on 5xx and network errors.
    error_backoffs: tuple[float, ...] = (1, 1, 2, 3, 5, 8, 13)
    #: Seconds a handler waits after a transient API error before trying again.
    retry_delay: float = 5.0
    #: Seconds a deleted ConversionJob's finalizer waits for its pods to exit before it lets go
    #: (the garbage collector removes what is left).
    delete_wait: float = 120.0
    metrics: OperatorMetrics | None = None
    #: Namespace of every output Lease (operator/lease.py: the keys of URL and plain-path outputs
    #: are cluster-wide, so their Leases must all be in one place): the operator's own, which the
    #: Helm chart passes as POD_NAMESPACE (downward API). Outside a pod "default", which every
    #: cluster has, so operators started by hand against one cluster still agree on it.
    lease_namespace: str = field(default_factory=lambda: os.environ.get("POD_NAMESPACE") or "default")


@dataclass
class Expectation:
    attempts: int
    phase: str
    deadline: float


#: A spec as validated once per generation: (the spec, or None and the reason).
Parsed = tuple[ConversionJobSpec | None, str | None]


class OperatorMemo(kopf.Memo):
    """What the operator keeps between passes (kopf's memo, attributes declared). kopf gives each
    ConversionJob a shallow copy of the operator's memo, so these objects are shared."""

    kube: Kube
    #: ConversionJob uid -> what our last status write should make the object show.
    expectations: dict[str, Expectation]
    #: ConversionJob uid -> (its spec as JSON, what parsing it gave).
    parsed: dict[str, tuple[str, Parsed]]
    leases: LeaseScope
    #: (ConversionJob uid, attempt) whose runner Job create this process saw refused.
    uncreated: set[tuple[str, int]]
    #: ConversionBatches (operator/batchhandlers.py): parsed specs and announced attempts, by uid.
    batch_parsed: dict[str, Any]
    batch_expected: dict[str, tuple[int, float]]


def build_settings(cfg: OperatorConfig) -> kopf.OperatorSettings:
    settings = kopf.OperatorSettings()
    # Keep kopf's bookkeeping in annotations: .status is ours and schema-checked.
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=GROUP)
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix=GROUP, key="last-handled-configuration"
    )
    # kopf would post every INFO log (e.g. each timer pass) as an Event; we post our own.
    settings.posting.level = logging.WARNING
    settings.networking.error_backoffs = cfg.error_backoffs
    settings.peering.mandatory = False
    return settings


def build_registry(cfg: OperatorConfig) -> kopf.OperatorRegistry:
    registry = kopf.OperatorRegistry()
    register_cluster_guard(registry, cfg)  # DaskClusters the runners create (operator/guard.py)
    register_batch_handlers(
        registry, cfg
    )  # ConversionBatches (operator/batchhandlers.py); they share the runner_jobs index

    # Explicit ids: the default is the qualified name ("build_registry.<locals>.…"), and the
    # index's id is also the keyword under which handlers receive it.
    @kopf.on.login(id="login", registry=registry)
    def login(**kwargs: Any) -> kopf.ConnectionInfo | None:
        if cfg.api.url:
            return kopf.ConnectionInfo(server=cfg.api.url.rstrip("/"), insecure=True, default_namespace="default")
        return kopf.login_with_service_account(**kwargs) or kopf.login_with_kubeconfig(**kwargs)

    @kopf.on.startup(id="startup", registry=registry)
    async def startup(memo: OperatorMemo, **_: Any) -> None:
        memo.kube = await Kube.connect(cfg.api, agent=OPERATOR_AGENT)
        memo.expectations = {}
        memo.parsed = {}
        memo.leases = LeaseScope(cfg.lease_namespace)
        memo.uncreated = set()
        memo.batch_parsed = {}
        memo.batch_expected = {}

    @kopf.on.cleanup(id="cleanup", registry=registry)
    async def cleanup(memo: OperatorMemo, **_: Any) -> None:
        await memo.kube.close()

    @kopf.index(
        "batch",
        "v1",
        "jobs",
        labels={LABEL_JOB: kopf.PRESENT, LABEL_COMPONENT: "runner"},
        id="runner_jobs",
        registry=registry,
    )
    def runner_jobs(
        body: kopf.Body, namespace: str | None, labels: kopf.Labels, **_: Any
    ) -> dict[tuple[str, str], JobSummary]:
        return {(_namespace(namespace), labels[LABEL_JOB]): job_summary(dict(body))}

    @kopf.on.event(**CJ, id="observe", registry=registry)
    def observe(type: str | None, name: str, namespace: str | None, status: kopf.Status, **_: Any) -> None:
        if cfg.metrics is not None:
            ns = _namespace(namespace)
            cfg.metrics.forget(ns, name) if type == "DELETED" else cfg.metrics.observe(ns, name, status.get("phase"))

    @kopf.timer(
        **CJ, interval=cfg.interval, when=not_deleted, backoff=cfg.retry_delay, id="reconcile", registry=registry
    )
    async def reconcile_job(body: kopf.Body, memo: OperatorMemo, **kwargs: Any) -> None:
        # kopf passes every index under its id; a parameter of that name would not fit kopf's types.
        index: RunnerJobs = kwargs["runner_jobs"]
        try:
            await _reconcile(cfg, body, memo, index)
        except (Transient, Conflict) as exc:  # a write race or a hiccup: the next pass sees fresh state
            count_error(cfg.metrics, "conflict" if isinstance(exc, Conflict) else "transient")
            raise kopf.TemporaryError(str(exc), delay=cfg.retry_delay) from None
        except KubeError as exc:
            count_error(cfg.metrics, f"http{exc.status or ''}")
            raise kopf.TemporaryError(str(exc), delay=cfg.retry_delay * 6) from None

    @kopf.on.delete(**CJ, backoff=cfg.retry_delay, id="delete_children", registry=registry)
    async def delete_children(
        name: str,
        namespace: str | None,
        uid: str,
        status: kopf.Status,
        memo: OperatorMemo,
        logger: kopf.Logger,
        runtime: timedelta,
        **_: Any,
    ) -> None:
        namespace = _namespace(namespace)
        try:
            left = await remove_children(
                memo.kube, Owner(namespace, name, uid), status.get("outputLease"), cfg.lease_namespace
            )
        except Transient as exc:
            count_error(cfg.metrics, "transient")
            raise kopf.TemporaryError(str(exc), delay=cfg.retry_delay) from None
        if left and runtime.total_seconds() < cfg.delete_wait:
            # The finalizer holds the ConversionJob until its pods have exited, so a job that is
            # gone never has a runner or worker still writing its output.
            raise kopf.TemporaryError(
                f"waiting for {len(left)} pod(s) to exit: {', '.join(left[:5])}", delay=cfg.retry_delay
            )
        if left:
            logger.warning(
                "giving up waiting for pod(s) %s after %.0f s; the garbage collector removes them",
                left,
                cfg.delete_wait,
            )
        memo.parsed.pop(uid, None)
        logger.info("removed the children of ConversionJob %s/%s", namespace, name)

    return registry


def _namespace(namespace: str | None) -> str:
    """ConversionJobs and Jobs are namespaced: kopf passes None only for cluster-wide objects."""
    if namespace is None:
        raise kopf.PermanentError("Expected a namespaced object. Got one without a namespace instead.")
    return namespace


def observe_job(
    owner: Owner, body: kopf.Body, spec: ConversionJobSpec | None, error: str | None, index: RunnerJobs
) -> Observed:
    """What a pass knows without an API call: the object, its spec, and the runner Jobs index."""
    meta, status = body["metadata"], dict(body.get("status") or {})
    jobs = tuple(j for j in index.get((owner.namespace, label_value(owner.name)), ()) if j.owner_uid in ("", owner.uid))
    t, generation = now(), int(meta.get("generation") or 1)
    if spec is None:
        return Observed(
            owner.name, status, 0, status.get("output") or "", jobs=jobs, now=t, generation=generation, spec_error=error
        )
    delays = tuple(spec.retry.delay(n) for n in range(1, spec.backoff_limit + 2))
    return Observed(
        owner.name,
        status,
        spec.backoff_limit,
        spec.output.path,
        conversion=spec.conversion_hash(),
        legacy_conversion=spec.legacy_conversion_hash(),
        retry_delays=delays,
        deadline_seconds=spec.active_deadline_seconds,
        lease_name=lease_name(output_key(spec, owner.namespace)),
        jobs=jobs,
        now=t,
        generation=generation,
        spec_error=error,
    )


async def _reconcile(cfg: OperatorConfig, body: kopf.Body, memo: OperatorMemo, index: RunnerJobs) -> None:
    meta, status = body["metadata"], dict(body.get("status") or {})
    owner = Owner(meta["namespace"], meta["name"], meta["uid"])
    if _stale(memo, owner.uid, status):
        return
    spec, error = parse_once(memo.parsed, body, parse_job_spec)
    if error is not None:
        count_error(cfg.metrics, "invalid_spec")
    observed = observe_job(owner, body, spec, error, index)
    if spec is not None:
        denial = "; ".join(policy_violations(spec, cfg.policy, cfg.image, cfg.runner_service_account)) or None
        observed = dataclasses.replace(observed, policy_denial=denial)
    attempt = int(status.get("attempts") or 0)
    observed = dataclasses.replace(observed, known_uncreated=(owner.uid, attempt) in memo.uncreated)
    decision = await _decide(memo.kube, owner, spec, observed, memo.leases)
    refusal = await _act(cfg, memo, owner, spec, body, decision)
    if refusal is not None:  # Kubernetes refused the runner Job for good: end the attempt now, saying why
        observed = dataclasses.replace(observed, status=_merged(status, decision.patch), create_rejected=refusal)
        await _act(cfg, memo, owner, spec, body, await _decide(memo.kube, owner, spec, observed, memo.leases))
    if cfg.metrics is not None:
        cfg.metrics.reconciled(owner.namespace, owner.name)


async def _decide(
    kube: Kube, owner: Owner, spec: ConversionJobSpec | None, observed: Observed, leases: LeaseScope
) -> Decision:
    decision = reconcile(observed)
    for _ in range(4):  # each lookup at most once: the runner Job, pods (and Events), the Lease
        if not decision.needs:
            break
        observed = await _look_up(kube, owner, spec, observed, decision, leases)
        decision = reconcile(observed)
    return decision


async def _act(
    cfg: OperatorConfig,
    memo: OperatorMemo,
    owner: Owner,
    spec: ConversionJobSpec | None,
    body: kopf.Body,
    decision: Decision,
) -> str | None:
    """Carry a decision out in the order that survives a crash between any two calls: children
    deleted and the Lease given back before the status write that forgets them; the status
    write that announces an attempt before its runner Job is created; the Job's uid recorded
    right after. Returns Kubernetes' message when it refused the runner Job for good."""
    await _clean_up(memo.kube, owner, decision, memo.leases)
    if decision.patch:
        await _write_status(memo, owner, decision.patch)
        merged = _merged(dict(body.get("status") or {}), decision.patch)
        memo.expectations[owner.uid] = Expectation(
            int(merged.get("attempts") or 0), merged.get("phase") or "", time.monotonic() + CONSISTENCY_WINDOW
        )
    refusal = None
    if decision.ensure_attempt is not None and spec is not None:
        uid, refusal = await _create_runner(cfg, memo, owner, spec, decision)
        if uid:
            await _write_status(memo, owner, {"runnerJobUid": uid})
    if decision.event:
        kind, reason, message = decision.event
        kopf.event(body, type=kind, reason=reason, message=message)
    return refusal


def _merged(status: dict[str, Any], patch: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in {**status, **patch}.items() if v is not None}


async def _look_up(
    kube: Kube, owner: Owner, spec: ConversionJobSpec | None, o: Observed, d: Decision, leases: LeaseScope
) -> Observed:
    update: dict[str, Any] = {}
    if "job" in d.needs and not o.job_checked:
        found = await kube.get(namespaced("batch/v1", owner.namespace, "jobs", o.status.get("runnerJob") or "-"))
        summary = job_summary(found) if found else None
        mine = summary is not None and summary.owner_uid in ("", owner.uid)
        update.update(jobs=o.jobs + ((summary,) if mine else ()), job_checked=True)
    if "pods" in d.needs and not o.pods_checked:
        update.update(pods=tuple(await pods_of(kube, owner.namespace, owner.name)), pods_checked=True)
    if "events" in d.needs and not o.events_checked:
        events = await kube.list(
            namespaced("v1", owner.namespace, "events"),
            field_selector={"involvedObject.kind": "Job", "involvedObject.name": o.status.get("runnerJob") or ""},
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
            leases.namespace,
        )
        async with leases.lock:
            if d.release_lease:
                await release(kube, leases.namespace, d.release_lease, me, owner.namespace)
            update["lease"] = await acquire(kube, body, owner.namespace)
    return dataclasses.replace(o, **update)


async def pods_of(kube: Kube, namespace: str, name: str) -> list[dict[str, Any]]:
    """The runner pods of every attempt and the pods of the job's DaskCluster."""
    pods = await kube.list(namespaced("v1", namespace, "pods"), {LABEL_JOB: label_value(name)})
    seen = {p["metadata"]["name"] for p in pods}
    dask = await kube.list(namespaced("v1", namespace, "pods"), {"dask.org/cluster-name": dask_cluster_name(name)})
    return pods + [p for p in dask if p["metadata"]["name"] not in seen]


async def _write_status(memo: OperatorMemo, owner: Owner, patch: dict[str, Any]) -> None:
    # Our own client, not kopf's ``patch``: kopf applies a timer's patch outside the handler, where
    # an API error (a 409, say) ends the timer for good; here it is a TemporaryError and a retry.
    await memo.kube.patch_merge(
        namespaced(API_VERSION, owner.namespace, PLURAL, owner.name, "status"), {"status": patch}
    )


def _stale(memo: OperatorMemo, uid: str, status: dict[str, Any]) -> bool:
    """True while the object does not yet show what our last pass wrote (the watch lags)."""
    expected: Expectation | None = memo.expectations.get(uid)
    if expected is None:
        return False
    caught_up = int(status.get("attempts") or 0) >= expected.attempts and (
        status.get("phase") == expected.phase or expected.phase not in TERMINAL_PHASES
    )
    if caught_up or time.monotonic() > expected.deadline:
        memo.expectations.pop(uid, None)
        return False
    return True


async def _clean_up(kube: Kube, owner: Owner, decision: Decision, leases: LeaseScope) -> None:
    if decision.delete_job:
        if await kube.delete(namespaced("batch/v1", owner.namespace, "jobs", decision.delete_job)):
            log.info("deleted runner Job %s/%s", owner.namespace, decision.delete_job)
    if decision.delete_cluster:
        await kube.delete(
            namespaced("kubernetes.dask.org/v1", owner.namespace, "daskclusters", dask_cluster_name(owner.name))
        )
    if decision.release_lease and "lease" not in decision.needs:
        # Before the status write that forgets it: a failed write leaves a retry, never a leak.
        me = holder_identity(owner.namespace, owner.name, owner.uid)
        await release(kube, leases.namespace, decision.release_lease, me, owner.namespace)


#: HTTP answers to a create that no retry changes: the object itself is invalid.
PERMANENT_REFUSALS = (400, 422)


async def _create_runner(
    cfg: OperatorConfig, memo: OperatorMemo, owner: Owner, spec: ConversionJobSpec, decision: Decision
) -> tuple[str | None, str | None]:
    """Create the attempt's runner Job: (its uid, None), (None, None) when it exists already, or
    (None, Kubernetes' message) when Kubernetes refuses it for good."""
    kube = memo.kube
    attempt = decision.ensure_attempt or 0
    await _ensure_runner_rbac(kube, owner, runner_account(spec, cfg.runner_service_account))
    job = build_runner_job(
        owner, spec, attempt, cfg.image, resume=decision.resume, default_service_account=cfg.runner_service_account
    )
    try:
        created = await kube.create(namespaced("batch/v1", owner.namespace, "jobs"), job)
    except Conflict:
        # Created by an earlier pass (or a restarted operator): keep it, never make a twin.
        log.info("runner Job %s/%s already exists", owner.namespace, job["metadata"]["name"])
        return None, None
    except Transient:
        raise  # no answer, or a busy server: the Job may exist, so nothing is known
    except KubeError as exc:
        memo.uncreated.add((owner.uid, attempt))  # a definite answer: it does not exist
        if exc.status in PERMANENT_REFUSALS:
            return None, exc.body_message
        raise
    memo.uncreated.discard((owner.uid, attempt))
    log.info("created runner Job %s/%s", owner.namespace, job["metadata"]["name"])
    return str(((created or {}).get("metadata") or {}).get("uid") or "") or None, None


async def _ensure_runner_rbac(kube: Kube, owner: Owner, account: str) -> None:
    """The runner's permission to patch its own job's status (rbac.py's RUNNER_JOB_RULES),
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


async def remove_children(kube: Kube, owner: Owner, lease: str | None, lease_namespace: str | None = None) -> list[str]:
    """Delete the runner Jobs (their pods go with them) and the DaskCluster of one ConversionJob;
    give back its output Lease (in ``lease_namespace``, or an earlier build's in the job's own)
    once nothing of it runs. Returns the pods still running."""
    namespace, name = owner.namespace, owner.name
    for job in await kube.list(namespaced("batch/v1", namespace, "jobs"), {LABEL_JOB: label_value(name)}):
        await kube.delete(namespaced("batch/v1", namespace, "jobs", job["metadata"]["name"]))
    await kube.delete(namespaced("kubernetes.dask.org/v1", namespace, "daskclusters", dask_cluster_name(name)))
    left = live_pods(tuple(await pods_of(kube, namespace, name)))
    if not left and lease:
        await release(kube, lease_namespace or namespace, lease, holder_identity(namespace, name, owner.uid), namespace)
    return left


#: What kopf accepts as its stop and ready flags (kopf._cogs.aiokits.aioadapters.Flag, not exported).
Flag = asyncio.Future[Any] | asyncio.Event | concurrent.futures.Future[Any] | threading.Event


async def run_operator(
    cfg: OperatorConfig, stop_flag: Flag | None = None, ready_flag: Flag | None = None, liveness: str | None = None
) -> None:
    """Run the operator until ``stop_flag`` is set (or forever). Peering (unless ``cfg.peering``
    is None) lets several replicas run: only the one with the highest priority acts."""
    await kopf.operator(
        registry=build_registry(cfg),
        settings=build_settings(cfg),
        clusterwide=not cfg.namespaces,
        namespaces=cfg.namespaces,
        standalone=cfg.peering is None,
        peering_name=cfg.peering,
        priority=cfg.priority,
        stop_flag=stop_flag,
        ready_flag=ready_flag,
        liveness_endpoint=liveness,
        memo=OperatorMemo(),
    )
