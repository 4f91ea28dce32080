"""Kubernetes: a dask-kubernetes ``KubeCluster`` whose pods are sized by the plan.

The runner Job (see ``h5ngff.operator``) uses this backend. It creates one ``DaskCluster``
resource, which the Dask Operator (dask-kubernetes' controller, installed in the cluster) turns
into a scheduler pod and ``plan.workers`` worker pods. Every worker pod carries the plan:

* memory ``requests == limits`` = the planned pod limit, and CPU ``requests == limits`` = the
  worker's threads, so the pod has Guaranteed QoS (evicted last, never throttled below its plan);
* ``--memory-limit`` = the planned Dask limit (never ``auto``: Dask's auto-detection reads the
  node, not always the container), and ``--nthreads``;
* the Dask memory thresholds as ``DASK_DISTRIBUTED__WORKER__MEMORY__*`` environment variables;
* the allocator environment (jemalloc's ``LD_PRELOAD`` and ``MALLOC_CONF``): it must be in place
  when the process starts, so it goes into the pod, not into Dask config.

The manifests come from pure ``build_*`` functions (unit-tested without a cluster), with the
names, labels and pod conventions the operator uses too (``h5ngff.k8s``); only
``KubernetesBackend.session`` talks to Kubernetes. This is the only module that imports
``dask_kubernetes``, and it imports it lazily: it takes about 2 s and only runner pods need it.
"""

from __future__ import annotations

import copy
import logging
import time
from contextlib import contextmanager
from typing import Any, Iterator

from distributed import Client

from ..errors import ClusterError
from ..jobspec import API_VERSION, Owner, PodSettings
from ..k8s import (
    SCHEDULER_PROBES,
    container_storage,
    credential_env,
    dask_cluster_name,
    env_list,
    labels,
    owner_reference,
    pod_placement,
    with_scratch,
)
from ..planner.model import Capacity, Plan
from ..spec import ConversionSpec
from ..units import GiB, k8s_quantity
from .allocator import allocator_env
from .base import REMOTE_DEFAULT_WORKERS, Description, Session, connect, dask_env, dask_memory_config, wait_for_workers
from .diagnostics import register_plugins

log = logging.getLogger(__name__)

#: The scheduler holds task state only (slabs go worker -> storage); a few thousand tasks take
#: well under 300 MiB, so 1 GiB is ample. Guaranteed QoS too: losing it loses the run.
SCHEDULER_MEMORY = 1 * GiB
SCHEDULER_CPU = "1"
#: How long the worker pods get to be scheduled, pull the image and connect.
WORKER_START_TIMEOUT = 600
#: Seconds to wait for the Dask Operator to act on a DaskCluster (create/delete).
RESOURCE_TIMEOUT = 300
WORKER_DASHBOARD_PORT = 8788


def worker_env(plan: Plan, allocator_library: str | None = None) -> dict[str, str]:
    """Dask's memory thresholds and the allocator, as the worker process must see them at start."""
    return {**dask_env(dask_memory_config(plan)), **allocator_env(plan.allocator, allocator_library)}


def build_worker_container(
    plan: Plan, image: str, pod: PodSettings, allocator_library: str | None = None
) -> dict[str, Any]:
    """The worker container: planned limits, ``--memory-limit``, threads, thresholds, allocator."""
    memory = k8s_quantity(plan.memory.pod_limit)
    cpu = str(plan.threads_per_worker)
    args = [
        "dask",
        "worker",
        # The Dask Operator sets DASK_WORKER_NAME and DASK_SCHEDULER_ADDRESS in every worker pod.
        "--name",
        "$(DASK_WORKER_NAME)",
        "--nthreads",
        cpu,
        "--nworkers",
        "1",
        "--memory-limit",
        str(plan.memory.memory_limit),
        "--nanny",
        "--death-timeout",
        "60",
        "--dashboard-address",
        str(WORKER_DASHBOARD_PORT),
    ]
    return {
        "name": "worker",
        "image": image,
        "args": args,
        "env": env_list(worker_env(plan, allocator_library)) + credential_env(pod),
        "resources": {"requests": {"memory": memory, "cpu": cpu}, "limits": {"memory": memory, "cpu": cpu}},
        "ports": [{"name": "http-dashboard", "containerPort": WORKER_DASHBOARD_PORT, "protocol": "TCP"}],
        **container_storage(pod),
    }


def build_worker_pod_spec(
    plan: Plan, image: str, pod: PodSettings, allocator_library: str | None = None
) -> dict[str, Any]:
    return with_scratch(
        {
            "containers": [build_worker_container(plan, image, pod, allocator_library)],
            # Workers read and write files only; they need no Kubernetes API access.
            "automountServiceAccountToken": False,
            **pod_placement(pod),
        }
    )


def build_scheduler_pod_spec(plan: Plan, image: str, pod: PodSettings) -> dict[str, Any]:
    memory = k8s_quantity(SCHEDULER_MEMORY)
    container = {
        "name": "scheduler",
        "image": image,
        "args": ["dask", "scheduler", "--host", "0.0.0.0"],
        # The scheduler enforces allowed-failures (a slab that kills its workers fails the run).
        "env": env_list(dask_env(dask_memory_config(plan))),
        "resources": {
            "requests": {"memory": memory, "cpu": SCHEDULER_CPU},
            "limits": {"memory": memory, "cpu": SCHEDULER_CPU},
        },
        "ports": [
            {"name": "tcp-comm", "containerPort": 8786, "protocol": "TCP"},
            {"name": "http-dashboard", "containerPort": 8787, "protocol": "TCP"},
        ],
        **copy.deepcopy(SCHEDULER_PROBES),
    }
    if pod.image_pull_policy:
        container["imagePullPolicy"] = pod.image_pull_policy
    placement = {k: v for k, v in pod_placement(pod).items() if k != "volumes"}  # the scheduler touches no data
    return with_scratch({"containers": [container], "automountServiceAccountToken": False, **placement})


def build_dask_cluster(
    plan: Plan, owner: Owner, image: str, pod: PodSettings, allocator_library: str | None = None
) -> dict[str, Any]:
    """The ``DaskCluster`` resource (kubernetes.dask.org/v1) for one run of ``plan``."""
    name = dask_cluster_name(owner.name)
    return {
        "apiVersion": "kubernetes.dask.org/v1",
        "kind": "DaskCluster",
        "metadata": {
            "name": name,
            "namespace": owner.namespace,
            "labels": labels(owner.name, "dask-cluster", owner.attempt),
            # blockOwnerDeletion would need update rights on conversionjobs/finalizers; the
            # operator's finalizer deletes the cluster anyway.
            "ownerReferences": [owner_reference(API_VERSION, owner.kind, owner.name, owner.uid, block=False)],
        },
        "spec": {
            "idleTimeout": 0,
            "worker": {"replicas": plan.workers, "spec": build_worker_pod_spec(plan, image, pod, allocator_library)},
            "scheduler": {
                "spec": build_scheduler_pod_spec(plan, image, pod),
                "service": {
                    "type": "ClusterIP",
                    "selector": {"dask.org/cluster-name": name, "dask.org/component": "scheduler"},
                    "ports": [
                        {"name": "tcp-comm", "protocol": "TCP", "port": 8786, "targetPort": "tcp-comm"},
                        {"name": "http-dashboard", "protocol": "TCP", "port": 8787, "targetPort": "http-dashboard"},
                    ],
                },
            },
        },
    }


class KubernetesBackend:
    """Runs each conversion on its own DaskCluster, created for the run and deleted after it."""

    name = "kubernetes"

    def __init__(
        self, owner: Owner, image: str, pod: PodSettings | None = None, default_workers: int = REMOTE_DEFAULT_WORKERS
    ):
        self.owner = owner
        self.image = image
        self.pod = pod or PodSettings()
        self.default_workers = default_workers

    def capacity(self) -> Capacity:
        # Nodes are not ours to count: the plan sizes the pods and Kubernetes finds room for them.
        return Capacity(cores=self.default_workers, memory_bytes=1 << 50, default_workers=self.default_workers)

    def fit(self, spec: ConversionSpec) -> ConversionSpec:
        return spec  # the pods are created as the plan sizes them

    def describe(self, spec: ConversionSpec, plan: Plan) -> Description:
        return Description()  # the pods are the plan's; `h5ngff operator render --plan` shows them

    @contextmanager
    def session(self, plan: Plan) -> Iterator[Session]:
        from dask_kubernetes.operator import KubeCluster
        from dask_kubernetes.operator.kubecluster.kubecluster import CreateMode

        spec = build_dask_cluster(plan, self.owner, self.image, self.pod)
        name = spec["metadata"]["name"]
        delete_stale_cluster(name, self.owner.namespace)
        log.info(
            "creating DaskCluster %s/%s: %d worker(s) of %s",
            self.owner.namespace,
            name,
            plan.workers,
            k8s_quantity(plan.memory.pod_limit),
        )
        try:
            cluster = KubeCluster(
                custom_cluster_spec=spec,
                namespace=self.owner.namespace,
                create_mode=CreateMode.CREATE_ONLY,
                shutdown_on_close=True,
                resource_timeout=RESOURCE_TIMEOUT,
                quiet=True,
            )
        except Exception as exc:  # dask-kubernetes raises RuntimeError, TimeoutError, httpx errors
            raise ClusterError(
                f"Could not start DaskCluster {self.owner.namespace}/{name}: {exc}. Is the Dask Operator installed and may the runner's service account create daskclusters?"
            ) from exc
        try:
            with connect(cluster) as client:
                register_plugins(client)
                _wait_for_workers(client, plan.workers, name)
                yield Session(client, self.name)
        finally:
            # Success or failure, the worker pods must go: they hold their full memory requests.
            cluster.close()


def _wait_for_workers(client: Client, n: int, name: str) -> None:
    def refuse(have: int) -> ClusterError:
        return ClusterError(
            f"Only {have} of {n} worker pod(s) of DaskCluster {name} connected within {WORKER_START_TIMEOUT} s. "
            f"Check `kubectl describe pods -l dask.org/cluster-name={name}`: too little free memory on the nodes for the planned pod limit is the usual cause."
        )

    # A look every 0.25 s (one small RPC to the scheduler); a look a second cost a run 0.375 s more on average.
    wait_for_workers(client, n, WORKER_START_TIMEOUT, refuse)


def delete_stale_cluster(name: str, namespace: str, timeout: float = RESOURCE_TIMEOUT) -> bool:
    """Delete a DaskCluster left by an attempt that died (its runner pod was killed), and wait."""
    import kr8s
    from kr8s.objects import new_class

    DaskCluster = new_class("DaskCluster", "kubernetes.dask.org/v1", namespaced=True)
    try:
        # One list request. kr8s' DaskCluster.get polls for 2 s before it reports a name missing,
        # and a first attempt (every run but a retried one) has no stale cluster: 2.5 s per run.
        found = list(DaskCluster.list(namespace=namespace, field_selector={"metadata.name": name}))
    except kr8s.ServerError as exc:
        if exc.response is not None and exc.response.status_code == 404:
            return False  # no DaskCluster resource at all: creating the cluster says the operator is missing
        raise ClusterError(
            f"Cannot look up DaskCluster {namespace}/{name}: {exc}. May the runner's service account list daskclusters?"
        ) from exc
    except Exception as exc:  # kr8s raises httpx errors for unreachable servers
        raise ClusterError(
            f"Cannot look up DaskCluster {namespace}/{name}: {exc}. Is the Kubernetes API server reachable from the runner?"
        ) from exc
    stale = next((c for c in found if isinstance(c, DaskCluster) and c.name == name), None)
    if stale is None:
        return False
    log.warning("deleting DaskCluster %s/%s left by an earlier attempt", namespace, name)
    stale.delete()
    deadline = time.monotonic() + timeout
    while stale.exists():
        if time.monotonic() > deadline:
            raise ClusterError(
                f"DaskCluster {namespace}/{name} from an earlier attempt was not deleted within {timeout:.0f} s; delete it by hand and retry."
            )
        time.sleep(1)
    return True
