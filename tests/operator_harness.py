"""Shared by the operator tests: a KMock Kubernetes emulator with our resources, the real kopf
operator running against it, and helpers to play the parts of the Job controller and kubelet.

Nothing here is a mock of our code: the operator is ``h5ngff.operator.handlers.run_operator``;
the emulator answers real HTTP with real list/watch/patch semantics (KMock, by kopf's author).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import threading
import time
from typing import Any, Callable

import kmock

from h5ngff.operator.handlers import OperatorConfig, run_operator
from h5ngff.operator.kube import KubeConfig
from h5ngff.operator.policy import TenantPolicy

VERBS = {"list", "watch", "get", "patch", "create", "delete", "update"}
CJ_PATH = "/apis/h5ngff.dev/v1alpha1/namespaces/{ns}/conversionjobs"
JOBS_PATH = "/apis/batch/v1/namespaces/{ns}/jobs"
PODS_PATH = "/api/v1/namespaces/{ns}/pods"
CJ_RES = "h5ngff.dev/v1alpha1/conversionjobs"
JOB_RES = "batch/v1/jobs"
POD_RES = "v1/pods"
DASK_RES = "kubernetes.dask.org/v1/daskclusters"
ROLE_RES = "rbac.authorization.k8s.io/v1/roles"
ROLEBINDING_RES = "rbac.authorization.k8s.io/v1/rolebindings"
#: Who made a request, by its User-Agent.
AGENTS = (("kmock/", "test"), ("kopf/", "operator"), ("h5ngff-operator/", "operator"), ("h5ngff-runner/", "runner"),
          ("kr8s/", "runner"))  # kr8s: dask-kubernetes' client, in the runner pod


def register_resources(k: kmock.KubernetesEmulator) -> None:
    info = kmock.ResourceInfo
    k.resources[CJ_RES] = info(kind="ConversionJob", namespaced=True, verbs=VERBS, subresources={"status"}, shortnames={"cj"})
    k.resources[JOB_RES] = info(kind="Job", namespaced=True, verbs=VERBS, subresources={"status"})
    k.resources[POD_RES] = info(kind="Pod", namespaced=True, verbs=VERBS, subresources={"status"})
    k.resources[DASK_RES] = info(kind="DaskCluster", namespaced=True, verbs=VERBS)
    k.resources[ROLE_RES] = info(kind="Role", namespaced=True, verbs=VERBS)
    k.resources[ROLEBINDING_RES] = info(kind="RoleBinding", namespaced=True, verbs=VERBS)
    # kopf starts watching only once the CRD resource itself is discoverable (DESIGN.md §4).
    k.resources["apiextensions.k8s.io/v1/customresourcedefinitions"] = info(kind="CustomResourceDefinition", namespaced=False, verbs=VERBS)
    k.resources["v1/namespaces"] = info(kind="Namespace", namespaced=False, verbs=VERBS)
    k.resources["v1/events"] = info(kind="Event", namespaced=True, verbs=VERBS)


def manifest(name: str, spec: dict[str, Any], namespace: str = "default", uid: str | None = None) -> dict[str, Any]:
    return {
        "apiVersion": "h5ngff.dev/v1alpha1",
        "kind": "ConversionJob",
        # KMock keeps resourceVersion as given; kopf needs one for its JSON-patch "test" ops.
        "metadata": {"name": name, "namespace": namespace, "uid": uid or f"uid-{name}", "resourceVersion": "1"},
        "spec": spec,
    }


class Cluster:
    """The emulator plus the verbs a test needs."""

    def __init__(self, k: kmock.KubernetesEmulator):
        self.k = k

    @property
    def url(self) -> str:
        return str(self.k.url).rstrip("/")

    async def apply(self, doc: dict[str, Any]) -> None:
        ns = doc["metadata"].get("namespace", "default")
        resp = await self.k.post(CJ_PATH.format(ns=ns), json=doc)
        assert resp.status in (200, 201), await resp.text()

    async def delete_cj(self, name: str, ns: str = "default") -> None:
        resp = await self.k.delete(f"{CJ_PATH.format(ns=ns)}/{name}")
        assert resp.status == 200, await resp.text()

    def cj(self, name: str, ns: str = "default") -> dict[str, Any] | None:
        key = (kmock.resource(CJ_RES), ns, name)
        if key not in self.k.objects:
            return None
        obj = self.k.objects[key]
        return None if obj.deleted else obj.raw

    def status(self, name: str, ns: str = "default") -> dict[str, Any]:
        return (self.cj(name, ns) or {}).get("status") or {}

    def live(self, resource: str, ns: str = "default") -> dict[str, dict[str, Any]]:
        """Objects of a resource that exist now (not soft-deleted), by name."""
        out = {}
        for (res, namespace, name), obj in self.k.objects.items():
            if res == kmock.resource(resource) and namespace == ns and not obj.deleted:
                out[name] = obj.raw
        return out

    def jobs(self, ns: str = "default") -> dict[str, dict[str, Any]]:
        return self.live(JOB_RES, ns)

    def job_creations(self, ns: str = "default") -> list[str]:
        """Names of the Jobs the API created, once per creation (a create answered 409 is none)."""
        made = []
        for (res, namespace, name), obj in self.k.objects.items():
            if res == kmock.resource(JOB_RES) and namespace == ns:
                history = list(obj.history)
                made += [name for i, v in enumerate(history) if v is not None and (i == 0 or history[i - 1] is None)]
        return sorted(made)

    def job_create_requests(self) -> list[str]:
        """Names in every Job create request, including those answered 409."""
        return [r.data["metadata"]["name"] for r in self.k if r.action == kmock.action.CREATE and r.resource == kmock.resource(JOB_RES)]

    async def patch_job_status(self, name: str, status: dict[str, Any], ns: str = "default") -> None:
        resp = await self.k.patch(f"{JOBS_PATH.format(ns=ns)}/{name}/status", json={"status": status},
                                  headers={"Content-Type": "application/merge-patch+json"})
        assert resp.status == 200, await resp.text()

    async def add_pod(self, job: dict[str, Any], terminated: dict[str, Any] | None, ns: str = "default") -> str:
        """Play the Job controller and kubelet: a pod of ``job`` that ended as ``terminated``."""
        template = job["spec"]["template"]
        name = f"{job['metadata']['name']}-abcde"
        container = template["spec"]["containers"][0]
        pod = {
            "apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name, "namespace": ns, "labels": {**template["metadata"]["labels"], "job-name": job["metadata"]["name"]}},
            "spec": template["spec"],
            "status": {"phase": "Failed" if terminated else "Running",
                       "containerStatuses": [{"name": container["name"], "state": {"terminated": terminated} if terminated else {"running": {}}}]},
        }
        resp = await self.k.post(PODS_PATH.format(ns=ns), json=pod)
        assert resp.status in (200, 201), await resp.text()
        return name

    def events(self, ns: str = "default") -> list[dict[str, Any]]:
        return [r.data for r in self.k if r.action == kmock.action.CREATE and r.resource == kmock.resource("v1/events") and isinstance(r.data, dict)]

    def api_calls(self) -> dict[str, set[tuple[str, str, str, str]]]:
        """(verb, apiGroup, resource, subresource) of every API request, by who made it:
        "operator" (kopf and the operator's own client), "runner", or "test" (this harness)."""
        calls: dict[str, set] = {"operator": set(), "runner": set(), "test": set(), "other": set()}
        for r in self.k:
            if r.resource is None or not r.resource.plural:
                continue  # discovery (/api, /apis/...): allowed to everyone by Kubernetes' defaults
            agent = r.headers.get("User-Agent", "")
            who = next((w for prefix, w in AGENTS if agent.startswith(prefix)), "other")
            calls[who].add((rbac_verb(r), r.resource.group or "", r.resource.plural, r.subresource or ""))
        return calls


def rbac_verb(r: Any) -> str:
    action = r.action.value.lower() if r.action is not None else r.method.value.lower()
    return {"fetch": "get", "update": "patch" if r.method == kmock.method.PATCH else "update"}.get(action, action)


async def wait_for(predicate: Callable[[], Any], timeout: float = 15.0, what: str = "condition") -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        await asyncio.sleep(0.05)


def fast_config(url: str, **overrides: Any) -> OperatorConfig:
    """Operator settings for tests: sub-second passes and retries, no peering."""
    # The tests' ConversionJobs name images of the test registry: the admin's policy allows them.
    base = dict(image="h5ngff:test", policy=TenantPolicy(allowed_images=("registry.example/*",)), interval=0.2, api=KubeConfig(url), peering=None, error_backoffs=(0.1, 0.2, 0.4), retry_delay=0.3)
    base.update(overrides)
    return OperatorConfig(**base)


class OperatorThread:
    """The real kopf operator in its own thread and event loop: kopf waits for every task of its
    loop at exit, and the emulator's server tasks must not be among them."""

    def __init__(self, cfg: OperatorConfig):
        self.cfg = cfg
        self.stop = threading.Event()
        self.ready = threading.Event()
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._main, name="kopf-operator", daemon=True)

    def _main(self) -> None:
        try:
            asyncio.run(run_operator(self.cfg, stop_flag=self.stop, ready_flag=self.ready))
        except BaseException as exc:  # surfaced by stop()
            self.error = exc

    async def start(self) -> "OperatorThread":
        self.thread.start()
        await wait_for(lambda: self.ready.is_set() or not self.thread.is_alive(), 20, "operator ready")
        if self.error:
            raise self.error
        return self

    async def halt(self) -> None:
        self.stop.set()
        await wait_for(lambda: not self.thread.is_alive(), 20, "operator exit")
        if self.error:
            raise self.error


@contextlib.asynccontextmanager
async def operator_running(cfg: OperatorConfig):
    """The real kopf operator, running until the block ends."""
    op = await OperatorThread(cfg).start()
    try:
        yield op
    finally:
        await op.halt()


class Emulator(kmock.KubernetesEmulator):
    """KMock plus ``metadata.generateName`` (kopf names its Events that way), as the API server."""

    async def _handle(self, request):
        if request.action == kmock.action.CREATE and isinstance(request.data, dict):
            meta = request.data.setdefault("metadata", {})
            if not meta.get("name") and meta.get("generateName"):
                meta["name"] = f"{meta['generateName']}{next(_names):05d}"
        return await super()._handle(request)


_names = itertools.count()


@contextlib.asynccontextmanager
async def emulator():
    async with Emulator() as k, kmock.Server(k):
        register_resources(k)
        # kr8s (dask-kubernetes' client) asks for "/version/"; KMock serves only "/version".
        k["get /version/"] << {"major": "1", "minor": "30", "gitVersion": "v1.30.0"}
        yield Cluster(k)
