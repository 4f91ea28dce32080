"""The kopf handlers: thin. They hand each object to its pass (jobpass, batchpass) and turn API
errors into kopf's retries; kopf is imported here and in ``guard`` only.

One timer per ConversionJob and per ConversionBatch does all the work, first at once when the
object appears, then every ``interval`` seconds (finished ones too: that is where a spec edit is
noticed; such a pass makes no API call). Runner Jobs and the objects' names are watched through
kopf indexes. Handlers are idempotent: children have deterministic names, an existing child is
kept (HTTP 409 means "already there").
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
from datetime import timedelta
from typing import Any, Awaitable, Callable, Mapping, TypedDict

import kopf

from ...jobspec import BATCH_KIND, BATCH_PLURAL, GROUP, KIND, PLURAL, VERSION, Owner
from ...k8s import LABEL_COMPONENT
from ..kube import Conflict, Kube, KubeError, Transient
from .children import remove_children
from .diagnose import JobSummary, job_summary
from .guard import register_cluster_guard
from .jobpass import reconcile_job
from .batchpass import reconcile_batch_once
from .lease import LeaseScope
from .manifests import LABEL_JOB
from .state import ControllerState, Names, OperatorConfig, RunnerJobs, count_error

__all__ = ["OperatorConfig", "build_registry", "build_settings", "run_operator"]

log = logging.getLogger(__name__)


class _Resource(TypedDict):
    """kopf's keyword arguments naming a resource."""

    group: str
    version: str
    plural: str


CJ: _Resource = {"group": GROUP, "version": VERSION, "plural": PLURAL}
CB: _Resource = {"group": GROUP, "version": VERSION, "plural": BATCH_PLURAL}
OPERATOR_AGENT = "h5ngff-operator"


class OperatorMemo(kopf.Memo):
    """kopf's memo: the one ControllerState of this process (kopf gives each object a shallow
    copy of the memo, so the state is shared)."""

    state: ControllerState


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


def not_deleted(meta: kopf.Meta, **_: Any) -> bool:
    # Every object gets passes, finished ones too: a pass on a finished, unchanged one costs no
    # API call, and it is where a spec edit is noticed (docs/operator.md, Lifecycle).
    return not meta.get("deletionTimestamp")


def _post_event(body: Mapping[str, Any], type_: str, reason: str, message: str) -> None:
    target: Any = dict(body)  # kopf reads apiVersion, kind and metadata of any mapping
    kopf.event(target, type=type_, reason=reason, message=message)


def build_registry(cfg: OperatorConfig) -> kopf.OperatorRegistry:
    registry = kopf.OperatorRegistry()
    register_cluster_guard(registry, cfg)  # DaskClusters the runners create (guard.py)

    # Explicit ids: the default is the qualified name ("build_registry.<locals>.…"), and an
    # index's id is also the keyword under which handlers receive it.
    @kopf.on.login(id="login", registry=registry)
    def login(**kwargs: Any) -> kopf.ConnectionInfo | None:
        if cfg.api.url:
            return kopf.ConnectionInfo(server=cfg.api.url.rstrip("/"), insecure=True, default_namespace="default")
        return kopf.login_with_service_account(**kwargs) or kopf.login_with_kubeconfig(**kwargs)

    @kopf.on.startup(id="startup", registry=registry)
    async def startup(memo: OperatorMemo, **_: Any) -> None:
        kube = await Kube.connect(cfg.api, agent=OPERATOR_AGENT)
        memo.state = ControllerState(kube, LeaseScope(cfg.lease_namespace), emit=_post_event)

    @kopf.on.cleanup(id="cleanup", registry=registry)
    async def cleanup(memo: OperatorMemo, **_: Any) -> None:
        kube = memo.state.kube
        if isinstance(kube, Kube):
            await kube.close()

    _register_indexes(registry)

    @kopf.on.event(**CJ, id="observe", registry=registry)
    def observe(type: str | None, name: str, namespace: str | None, status: kopf.Status, **_: Any) -> None:
        if cfg.metrics is not None:
            ns = _namespace(namespace)
            cfg.metrics.forget(ns, name) if type == "DELETED" else cfg.metrics.observe(ns, name, status.get("phase"))

    @kopf.timer(
        **CJ, interval=cfg.interval, when=not_deleted, backoff=cfg.retry_delay, id="reconcile", registry=registry
    )
    async def reconcile_job_timer(body: kopf.Body, memo: OperatorMemo, **kwargs: Any) -> None:
        # kopf passes every index under its id; a parameter of that name would not fit kopf's types.
        index: RunnerJobs = kwargs["runner_jobs"]
        names: Names = kwargs["batch_names"]
        await _retrying(cfg, lambda: reconcile_job(cfg, memo.state, body, index, names))

    @kopf.timer(
        **CB, interval=cfg.interval, when=not_deleted, backoff=cfg.retry_delay, id="reconcile_batch", registry=registry
    )
    async def reconcile_batch_timer(body: kopf.Body, memo: OperatorMemo, **kwargs: Any) -> None:
        index: RunnerJobs = kwargs["runner_jobs"]
        names: Names = kwargs["job_names"]
        await _retrying(cfg, lambda: reconcile_batch_once(cfg, memo.state, body, index, names))

    @kopf.on.delete(**CJ, backoff=cfg.retry_delay, id="delete_children", registry=registry)
    async def delete_children(
        name: str, namespace: str | None, uid: str, status: kopf.Status, memo: OperatorMemo, **kwargs: Any
    ) -> None:
        owner = Owner(_namespace(namespace), name, uid)
        await _remove(cfg, memo.state, owner, dict(status), kwargs["logger"], kwargs["runtime"])
        memo.state.parsed.pop(uid, None)

    @kopf.on.delete(**CB, backoff=cfg.retry_delay, id="delete_batch_children", registry=registry)
    async def delete_batch_children(
        name: str, namespace: str | None, uid: str, status: kopf.Status, memo: OperatorMemo, **kwargs: Any
    ) -> None:
        owner = Owner(_namespace(namespace), name, uid, kind=BATCH_KIND)
        await _remove(cfg, memo.state, owner, dict(status), kwargs["logger"], kwargs["runtime"])
        memo.state.batch_parsed.pop(uid, None)

    return registry


def _register_indexes(registry: kopf.OperatorRegistry) -> None:
    """kopf's indexes: runner Jobs by (namespace, job label) and both kinds' names (NameTaken).
    Explicit ids: an index's id is also the keyword under which handlers receive it."""

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

    @kopf.index(**CJ, id="job_names", registry=registry)
    def job_names(namespace: str | None, name: str, uid: str, meta: kopf.Meta, **_: Any) -> dict[Any, Any]:
        return {(namespace, name): (uid, str(meta.get("creationTimestamp") or ""))}

    @kopf.index(**CB, id="batch_names", registry=registry)
    def batch_names(namespace: str | None, name: str, uid: str, meta: kopf.Meta, **_: Any) -> dict[Any, Any]:
        return {(namespace, name): (uid, str(meta.get("creationTimestamp") or ""))}


async def _retrying(cfg: OperatorConfig, run: Callable[[], Awaitable[None]]) -> None:
    """A pass, its API errors as kopf retries: a write race or a hiccup is retried soon (the next
    pass sees fresh state), anything else later."""
    try:
        await run()
    except (Transient, Conflict) as exc:
        count_error(cfg.metrics, "conflict" if isinstance(exc, Conflict) else "transient")
        raise kopf.TemporaryError(str(exc), delay=cfg.retry_delay) from None
    except KubeError as exc:
        count_error(cfg.metrics, f"http{exc.status or ''}")
        raise kopf.TemporaryError(str(exc), delay=cfg.retry_delay * 6) from None


async def _remove(
    cfg: OperatorConfig,
    state: ControllerState,
    owner: Owner,
    status: dict[str, Any],
    logger: kopf.Logger,
    runtime: timedelta,
) -> None:
    """The finalizer: it holds the object until its pods have exited, so an object that is gone
    never has a runner or worker still writing its output (at most ``delete_wait`` seconds; the
    garbage collector removes what is left)."""
    ran = bool(int(status.get("attempts") or 0))
    try:
        left = await remove_children(state.kube, owner, ran, cfg.lease_namespace)
    except Transient as exc:
        count_error(cfg.metrics, "transient")
        raise kopf.TemporaryError(str(exc), delay=cfg.retry_delay) from None
    if left and runtime.total_seconds() < cfg.delete_wait:
        raise kopf.TemporaryError(
            f"waiting for {len(left)} pod(s) to exit: {', '.join(left[:5])}", delay=cfg.retry_delay
        )
    if left:
        logger.warning(
            "giving up waiting for pod(s) %s after %.0f s; the garbage collector removes them", left, cfg.delete_wait
        )
    kind = "ConversionBatch" if owner.kind == BATCH_KIND else KIND
    logger.info("removed the children of %s %s/%s (outputs are left alone)", kind, owner.namespace, owner.name)


def _namespace(namespace: str | None) -> str:
    """ConversionJobs and Jobs are namespaced: kopf passes None only for cluster-wide objects."""
    if namespace is None:
        raise kopf.PermanentError("Expected a namespaced object. Got one without a namespace instead.")
    return namespace


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
