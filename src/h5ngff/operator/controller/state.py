"""The controller's settings and what it keeps between passes: plain dataclasses, no kopf.

``handlers.py`` (kopf) holds one ``ControllerState`` in kopf's memo and hands it to the passes
(``jobpass``, ``batchpass``), which also run without kopf: the property tests drive them over an
in-memory API (tests/test_operator_invariants.py).
"""

from __future__ import annotations

import json
import os
import random
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Iterable, Mapping, TypeVar

from ...errors import SpecError

from ..kube import KubeApi, KubeConfig
from ..schema.policy import TenantPolicy
from .diagnose import JobSummary
from .lease import LeaseScope
from .manifests import DEFAULT_IMAGE

if TYPE_CHECKING:
    from ...metrics.operator import OperatorMetrics

#: The runner Jobs index (kopf's ``runner_jobs``): (namespace, job label) -> the Jobs' summaries.
RunnerJobs = Mapping[tuple[str, str], Iterable[JobSummary]]
#: The objects of each kind by (namespace, name): (uid, creationTimestamp); kopf's ``job_names``
#: and ``batch_names`` indexes, to refuse a ConversionJob and a ConversionBatch of one name.
Names = Mapping[tuple[str, str], Iterable[tuple[str, str]]]
#: Posts a Kubernetes Event about an object: (the object's body, type, reason, message).
Emit = Callable[[Mapping[str, Any], str, str, str], None]


@dataclass
class OperatorConfig:
    """How one operator process runs; every field has a command-line flag in ``h5ngff operator``."""

    #: Image of runner and Dask pods when a ConversionJob names none.
    image: str = DEFAULT_IMAGE
    #: Service account of runner pods when a ConversionJob names none (needs the runner RBAC).
    runner_service_account: str | None = None
    #: What a ConversionJob may ask for beyond the two defaults above (operator/schema/policy.py).
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
    #: Namespace of every output Lease (operator/controller/lease.py: the keys of URL and
    #: plain-path outputs are cluster-wide, so their Leases must all be in one place): the
    #: operator's own, which the Helm chart passes as POD_NAMESPACE (downward API). Outside a pod
    #: "default", which every cluster has, so operators started by hand against one cluster
    #: still agree on it.
    lease_namespace: str = field(default_factory=lambda: os.environ.get("POD_NAMESPACE") or "default")


@dataclass
class Expectation:
    """What our last status write should make the object show, and until when to wait for it."""

    attempts: int
    phase: str
    deadline: float


S = TypeVar("S")


def count_error(metrics: OperatorMetrics | None, kind: str) -> None:
    if metrics is not None:
        metrics.reconcile_error(kind)


def parse_once(
    cache: dict[str, tuple[str, Any]], body: Mapping[str, Any], parse: Callable[[Any], S]
) -> tuple[S | None, str | None]:
    """(the spec, None) or (None, the error), validated once per change of the object's spec
    (both kinds are passed over every interval, finished ones too)."""
    meta, data = body["metadata"], dict(body.get("spec") or {})
    key = json.dumps(data, sort_keys=True, default=str)
    cached = cache.get(meta["uid"])
    if cached is not None and cached[0] == key:
        out: tuple[S | None, str | None] = cached[1]
        return out
    result: tuple[S | None, str | None]
    try:
        result = (parse(data), None)
    except SpecError as exc:
        result = (None, str(exc))
    cache[meta["uid"]] = (key, result)
    return result


def _no_event(body: Mapping[str, Any], type_: str, reason: str, message: str) -> None:
    return None


@dataclass
class ControllerState:
    """What the controller keeps between passes. One per operator process; kopf gives each
    object a shallow copy of its memo, so these containers are shared."""

    kube: KubeApi
    #: The namespace of the output Leases and the lock under which this process takes them.
    leases: LeaseScope
    emit: Emit = _no_event
    #: ConversionJob uid -> what our last status write should make the object show.
    expectations: dict[str, Expectation] = field(default_factory=dict)
    #: ConversionJob uid -> (its spec as JSON, what parsing it gave).
    parsed: dict[str, tuple[str, Any]] = field(default_factory=dict)
    #: (ConversionJob uid, attempt) whose runner Job create this process saw refused.
    uncreated: set[tuple[str, int]] = field(default_factory=set)
    #: ConversionBatches: parsed specs and announced attempts, by uid.
    batch_parsed: dict[str, tuple[str, Any]] = field(default_factory=dict)
    batch_expected: dict[str, tuple[int, float]] = field(default_factory=dict)
