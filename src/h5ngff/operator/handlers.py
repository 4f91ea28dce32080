"""The kopf handlers: thin. They gather what the operator observes, call the pure
``reconcile`` and carry out its decision.

One timer per unfinished ConversionJob does all the work, first at once when the object
appears, then every ``interval`` seconds until the job reaches Succeeded or Failed. Runner Jobs
are watched through a kopf index, so a pass costs no API call unless something must change.
Handlers are idempotent: children have deterministic names, an existing child is kept (HTTP 409
means "already there"), and a pass that sees its own previous write not yet reflected in the
object waits for the watch to catch up instead of acting twice.
"""

from __future__ import annotations

import dataclasses
import logging
import random
import time
from dataclasses import dataclass, field
from typing import Any

import kopf

from ..backends.kubernetes import LABEL_COMPONENT, label_value
from ..errors import SpecError
from ..jobspec import ConversionJobSpec, parse_job_spec
from .kube import Conflict, Kube, KubeConfig, KubeError, Transient, namespaced
from .manifests import (
    API_VERSION,
    DEFAULT_IMAGE,
    GROUP,
    LABEL_ATTEMPT,
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
from .policy import TenantPolicy, policy_violations
from .reconcile import Decision, Observed, job_summary, reconcile
from .status import TERMINAL_PHASES, invalid_patch, now

log = logging.getLogger(__name__)

CJ = {"group": GROUP, "version": VERSION, "plural": PLURAL}
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
    metrics: Any = None  #: an OperatorMetrics, or None


@dataclass
class Expectation:
    attempts: int
    phase: str
    deadline: float


def build_settings(cfg: OperatorConfig) -> kopf.OperatorSettings:
    settings = kopf.OperatorSettings()
    # Keep kopf's bookkeeping in annotations: .status is ours and schema-checked.
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=GROUP)
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(prefix=GROUP, key="last-handled-configuration")
    # kopf would post every INFO log (e.g. each timer pass) as an Event; we post our own.
    settings.posting.level = logging.WARNING
    settings.networking.error_backoffs = cfg.error_backoffs
    settings.peering.mandatory = False
    return settings


def build_registry(cfg: OperatorConfig) -> kopf.OperatorRegistry:
    registry = kopf.OperatorRegistry()

    # Explicit ids: the default is the qualified name ("build_registry.<locals>.…"), and the
    # index's id is also the keyword under which handlers receive it.
    @kopf.on.login(id="login", registry=registry)
    def login(**kwargs: Any) -> kopf.ConnectionInfo | None:
        if cfg.api.url:
            return kopf.ConnectionInfo(server=cfg.api.url.rstrip("/"), insecure=True, default_namespace="default")
        return kopf.login_with_service_account(**kwargs) or kopf.login_with_kubeconfig(**kwargs)

    @kopf.on.startup(id="startup", registry=registry)
    async def startup(memo: kopf.Memo, **_: Any) -> None:
        memo.kube = await Kube.connect(cfg.api, agent=OPERATOR_AGENT)
        memo.expectations = {}

    @kopf.on.cleanup(id="cleanup", registry=registry)
    async def cleanup(memo: kopf.Memo, **_: Any) -> None:
        await memo.kube.close()

    @kopf.index("batch", "v1", "jobs", labels={LABEL_JOB: kopf.PRESENT, LABEL_COMPONENT: "runner"}, id="runner_jobs", registry=registry)
    def runner_jobs(body: kopf.Body, namespace: str, labels: kopf.Labels, **_: Any) -> dict:
        return {(namespace, labels[LABEL_JOB]): job_summary(dict(body))}

    @kopf.on.event(**CJ, id="observe", registry=registry)
    def observe(type: str | None, name: str, namespace: str, status: kopf.Status, **_: Any) -> None:
        if cfg.metrics is not None:
            cfg.metrics.forget(namespace, name) if type == "DELETED" else cfg.metrics.observe(namespace, name, status.get("phase"))

    @kopf.timer(**CJ, interval=cfg.interval, when=_unfinished, backoff=cfg.retry_delay, id="reconcile", registry=registry)
    async def reconcile_job(body: kopf.Body, memo: kopf.Memo, runner_jobs: kopf.Index, **_: Any) -> None:
        try:
            await _reconcile(cfg, body, memo, runner_jobs)
        except (Transient, Conflict) as exc:  # a write race or a hiccup: the next pass sees fresh state
            _count_error(cfg, "conflict" if isinstance(exc, Conflict) else "transient")
            raise kopf.TemporaryError(str(exc), delay=cfg.retry_delay) from None
        except KubeError as exc:
            _count_error(cfg, f"http{exc.status or ''}")
            raise kopf.TemporaryError(str(exc), delay=cfg.retry_delay * 6) from None

    @kopf.on.delete(**CJ, backoff=cfg.retry_delay, id="delete_children", registry=registry)
    async def delete_children(name: str, namespace: str, memo: kopf.Memo, logger: kopf.Logger, **_: Any) -> None:
        try:
            removed = await remove_children(memo.kube, namespace, name)
        except Transient as exc:
            _count_error(cfg, "transient")
            raise kopf.TemporaryError(str(exc), delay=cfg.retry_delay) from None
        logger.info("removed %d child object(s) of ConversionJob %s/%s", removed, namespace, name)

    return registry


def _unfinished(status: kopf.Status, meta: kopf.Meta, **_: Any) -> bool:
    return status.get("phase") not in TERMINAL_PHASES and not meta.get("deletionTimestamp")


def _count_error(cfg: OperatorConfig, kind: str) -> None:
    if cfg.metrics is not None:
        cfg.metrics.reconcile_error(kind)


async def _reconcile(cfg: OperatorConfig, body: kopf.Body, memo: kopf.Memo, index: kopf.Index) -> None:
    meta, status = body["metadata"], dict(body.get("status") or {})
    owner = Owner(meta["namespace"], meta["name"], meta["uid"])
    if _stale(memo, owner.uid, status):
        return
    try:
        spec = parse_job_spec(dict(body.get("spec") or {}))
    except SpecError as exc:
        await _write_status(memo, owner, invalid_patch(str(exc), now()))
        kopf.event(body, type="Warning", reason="InvalidSpec", message=str(exc))
        _count_error(cfg, "invalid_spec")
        raise kopf.PermanentError(f"InvalidSpec: {exc}") from None
    jobs = tuple(j for j in index.get((owner.namespace, label_value(owner.name)), ()) if j.owner_uid in ("", owner.uid))
    denial = "; ".join(policy_violations(spec, cfg.policy, cfg.image, cfg.runner_service_account)) or None
    observed = Observed(owner.name, status, spec.backoff_limit, spec.output.path, jobs, now=now(), policy_denial=denial)
    decision = reconcile(observed)
    if decision.needs_pods:
        attempt = int(status.get("attempts") or 0)
        pods = await memo.kube.list(namespaced("v1", owner.namespace, "pods"), {LABEL_JOB: label_value(owner.name), LABEL_ATTEMPT: str(attempt)})
        decision = reconcile(dataclasses.replace(observed, pods=tuple(pods), pods_checked=True))
    await _carry_out(cfg, memo, owner, spec, decision)
    if decision.patch:
        await _write_status(memo, owner, decision.patch)
        merged = {**status, **decision.patch}
        memo.expectations[owner.uid] = Expectation(int(merged.get("attempts") or 0), merged.get("phase") or "", time.monotonic() + CONSISTENCY_WINDOW)
    if decision.event:
        kind, reason, message = decision.event
        kopf.event(body, type=kind, reason=reason, message=message)


async def _write_status(memo: kopf.Memo, owner: Owner, patch: dict[str, Any]) -> None:
    # Our own client, not kopf's ``patch``: kopf applies a timer's patch outside the handler, where
    # an API error (a 409, say) ends the timer for good; here it is a TemporaryError and a retry.
    await memo.kube.patch_merge(namespaced(API_VERSION, owner.namespace, PLURAL, owner.name, "status"), {"status": patch})


def _stale(memo: kopf.Memo, uid: str, status: dict[str, Any]) -> bool:
    """True while the object does not yet show what our last pass wrote (the watch lags)."""
    expected: Expectation | None = memo.expectations.get(uid)
    if expected is None:
        return False
    caught_up = int(status.get("attempts") or 0) >= expected.attempts and (status.get("phase") == expected.phase or expected.phase not in TERMINAL_PHASES)
    if caught_up or time.monotonic() > expected.deadline:
        memo.expectations.pop(uid, None)
        return False
    return True


async def _carry_out(cfg: OperatorConfig, memo: kopf.Memo, owner: Owner, spec: ConversionJobSpec, decision: Decision) -> None:
    kube: Kube = memo.kube
    if decision.delete_cluster:
        await kube.delete(namespaced("kubernetes.dask.org/v1", owner.namespace, "daskclusters", dask_cluster_name(owner.name)))
    if decision.ensure_attempt is not None:
        await _ensure_runner_rbac(kube, owner, runner_account(spec, cfg.runner_service_account))
        job = build_runner_job(owner, spec, decision.ensure_attempt, cfg.image, resume=decision.resume,
                               default_service_account=cfg.runner_service_account)
        try:
            await kube.create(namespaced("batch/v1", owner.namespace, "jobs"), job)
            log.info("created runner Job %s/%s", owner.namespace, job["metadata"]["name"])
        except Conflict:
            # Created by an earlier pass (or a restarted operator): keep it, never make a twin.
            log.info("runner Job %s/%s already exists", owner.namespace, job["metadata"]["name"])


async def _ensure_runner_rbac(kube: Kube, owner: Owner, account: str) -> None:
    """The runner's permission to patch its own job's status (rbac.py's RUNNER_JOB_RULES),
    before the runner exists; an existing Role or RoleBinding (an earlier attempt's) is kept."""
    rbac = "rbac.authorization.k8s.io/v1"
    for plural, obj in (("roles", build_runner_role(owner)), ("rolebindings", build_runner_role_binding(owner, account))):
        try:
            await kube.create(namespaced(rbac, owner.namespace, plural), obj)
        except Conflict:
            pass


async def remove_children(kube: Kube, namespace: str, name: str) -> int:
    """Delete the runner Jobs (with their pods) and the DaskCluster of one ConversionJob."""
    removed = 0
    selector = {LABEL_JOB: label_value(name)}
    for job in await kube.list(namespaced("batch/v1", namespace, "jobs"), selector):
        removed += await kube.delete(namespaced("batch/v1", namespace, "jobs", job["metadata"]["name"]))
    removed += await kube.delete(namespaced("kubernetes.dask.org/v1", namespace, "daskclusters", dask_cluster_name(name)))
    return removed


async def run_operator(cfg: OperatorConfig, stop_flag: Any = None, ready_flag: Any = None, liveness: str | None = None) -> None:
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
        memo=kopf.Memo(),
    )
