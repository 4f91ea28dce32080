"""Shared by the operator tests: a KMock Kubernetes emulator with our resources, the real kopf
operator running against it, and helpers to play the parts of the Job controller and kubelet.

Nothing here is a mock of our code: the operator is ``h5ngff.operator.controller.handlers.run_operator``;
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

from h5ngff.patches import apply_merge_patch

from h5ngff.metrics.operator import OperatorMetrics
from h5ngff.operator.controller.handlers import OperatorConfig, run_operator
from h5ngff.operator.kube import KubeConfig
from h5ngff.operator.schema.policy import TenantPolicy

VERBS = {"list", "watch", "get", "patch", "create", "delete", "update"}
CJ_PATH = "/apis/h5ngff.dev/v1alpha1/namespaces/{ns}/conversionjobs"
JOBS_PATH = "/apis/batch/v1/namespaces/{ns}/jobs"
PODS_PATH = "/api/v1/namespaces/{ns}/pods"
CJ_RES = "h5ngff.dev/v1alpha1/conversionjobs"
CB_PATH = "/apis/h5ngff.dev/v1alpha1/namespaces/{ns}/conversionbatches"
CB_RES = "h5ngff.dev/v1alpha1/conversionbatches"
JOB_RES = "batch/v1/jobs"
POD_RES = "v1/pods"
DASK_RES = "kubernetes.dask.org/v1/daskclusters"
LEASE_RES = "coordination.k8s.io/v1/leases"
ROLE_RES = "rbac.authorization.k8s.io/v1/roles"
ROLEBINDING_RES = "rbac.authorization.k8s.io/v1/rolebindings"
#: Who made a request, by its User-Agent.
AGENTS = (
    ("kmock/", "test"),
    ("kopf/", "operator"),
    ("h5ngff-operator/", "operator"),
    ("h5ngff-runner/", "runner"),
    ("kr8s/", "runner"),
)  # kr8s: dask-kubernetes' client, in the runner pod


def register_resources(k: kmock.KubernetesEmulator) -> None:
    info = kmock.ResourceInfo
    k.resources[CJ_RES] = info(
        kind="ConversionJob", namespaced=True, verbs=VERBS, subresources={"status"}, shortnames={"cj"}
    )
    k.resources[CB_RES] = info(
        kind="ConversionBatch", namespaced=True, verbs=VERBS, subresources={"status"}, shortnames={"cb"}
    )
    k.resources[JOB_RES] = info(kind="Job", namespaced=True, verbs=VERBS, subresources={"status"})
    k.resources[POD_RES] = info(kind="Pod", namespaced=True, verbs=VERBS, subresources={"status"})
    k.resources[DASK_RES] = info(kind="DaskCluster", namespaced=True, verbs=VERBS)
    k.resources[LEASE_RES] = info(kind="Lease", namespaced=True, verbs=VERBS)
    k.resources[ROLE_RES] = info(kind="Role", namespaced=True, verbs=VERBS)
    k.resources[ROLEBINDING_RES] = info(kind="RoleBinding", namespaced=True, verbs=VERBS)
    # kopf starts watching only once the CRD resource itself is discoverable (docs/architecture.md, "The machines the tests run on").
    k.resources["apiextensions.k8s.io/v1/customresourcedefinitions"] = info(
        kind="CustomResourceDefinition", namespaced=False, verbs=VERBS
    )
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


def batch_manifest(name: str, spec: dict[str, Any], namespace: str = "default") -> dict[str, Any]:
    """A ConversionBatch (operator/schema/batchspec.py) to ``Cluster.apply_batch``."""
    return {**manifest(name, spec, namespace), "kind": "ConversionBatch"}


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

    async def edit(self, name: str, patch: dict[str, Any], ns: str = "default") -> None:
        """``kubectl patch --type merge`` (or a GitOps sync) of a ConversionJob."""
        resp = await self.k.patch(
            f"{CJ_PATH.format(ns=ns)}/{name}", json=patch, headers={"Content-Type": "application/merge-patch+json"}
        )
        assert resp.status == 200, await resp.text()

    async def apply_batch(self, doc: dict[str, Any]) -> None:
        resp = await self.k.post(CB_PATH.format(ns=doc["metadata"].get("namespace", "default")), json=doc)
        assert resp.status in (200, 201), await resp.text()

    async def edit_batch(self, name: str, patch: dict[str, Any], ns: str = "default") -> None:
        """A GitOps sync of a ConversionBatch (a merge patch: a list such as spec.items is replaced whole)."""
        resp = await self.k.patch(
            f"{CB_PATH.format(ns=ns)}/{name}", json=patch, headers={"Content-Type": "application/merge-patch+json"}
        )
        assert resp.status == 200, await resp.text()

    def batch_status(self, name: str, ns: str = "default") -> dict[str, Any]:
        key = (kmock.resource(CB_RES), ns, name)
        obj = self.k.objects[key] if key in self.k.objects else None
        return ((obj.raw if obj is not None and not obj.deleted else None) or {}).get("status") or {}

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
        return [
            r.data["metadata"]["name"]
            for r in self.k
            if r.action == kmock.action.CREATE and r.resource == kmock.resource(JOB_RES)
        ]

    async def patch_job_status(self, name: str, status: dict[str, Any], ns: str = "default") -> None:
        resp = await self.k.patch(
            f"{JOBS_PATH.format(ns=ns)}/{name}/status",
            json={"status": status},
            headers={"Content-Type": "application/merge-patch+json"},
        )
        assert resp.status == 200, await resp.text()

    async def add_pod(self, job: dict[str, Any], terminated: dict[str, Any] | None, ns: str = "default") -> str:
        """Play the Job controller and kubelet: a pod of ``job`` that ended as ``terminated``."""
        template = job["spec"]["template"]
        name = f"{job['metadata']['name']}-abcde"
        container = template["spec"]["containers"][0]
        pod = {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {
                "name": name,
                "namespace": ns,
                "labels": {**template["metadata"]["labels"], "job-name": job["metadata"]["name"]},
            },
            "spec": template["spec"],
            "status": {
                "phase": "Failed" if terminated else "Running",
                "containerStatuses": [
                    {"name": container["name"], "state": {"terminated": terminated} if terminated else {"running": {}}}
                ],
            },
        }
        resp = await self.k.post(PODS_PATH.format(ns=ns), json=pod)
        assert resp.status in (200, 201), await resp.text()
        return name

    def events(self, ns: str = "default") -> list[dict[str, Any]]:
        return [
            r.data
            for r in self.k
            if r.action == kmock.action.CREATE
            and r.resource == kmock.resource("v1/events")
            and isinstance(r.data, dict)
        ]

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
    """Operator settings for tests: sub-second passes and retries, no peering, pass counting."""
    # The tests' ConversionJobs name images of the test registry: the admin's policy allows them.
    base = dict(
        image="h5ngff:test",
        policy=TenantPolicy(allowed_images=("registry.example/*",)),
        interval=0.2,
        api=KubeConfig(url),
        peering=None,
        error_backoffs=(0.1, 0.2, 0.4),
        retry_delay=0.3,
        delete_wait=20.0,
        metrics=OperatorMetrics(),
    )
    base.update(overrides)
    return OperatorConfig(**base)


async def passes(cfg: OperatorConfig, name: str, n: int = 3, ns: str = "default", timeout: float = 15.0) -> None:
    """Wait until the operator has finished ``n`` more reconcile passes of one ConversionJob:
    "nothing happened" then means the operator looked ``n`` times (the first may have started
    before the test's last change) and did nothing, not that a sleep was long enough."""
    start = cfg.metrics.passes_of(ns, name)
    await wait_for(
        lambda: cfg.metrics.passes_of(ns, name) >= start + n, timeout, f"{n} reconcile passes of {ns}/{name}"
    )


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
    """KMock plus what the API server does and the operator relies on: ``metadata.generateName``
    (kopf names its Events that way), a ``uid`` for every new object, and ``metadata.generation``
    (1 on create, +1 on every change of ``spec``; status and metadata writes leave it)."""

    async def _handle(self, request):
        if request.action == kmock.action.CREATE and isinstance(request.data, dict):
            meta = request.data.setdefault("metadata", {})
            if not meta.get("name") and meta.get("generateName"):
                meta["name"] = f"{meta['generateName']}{next(_names):05d}"
            meta.setdefault("uid", f"uid-{next(_names):05d}")
            meta.setdefault("generation", 1)
        elif (
            request.action == kmock.action.UPDATE
            and not request.subresource
            and isinstance(request.data, dict)
            and "spec" in request.data
        ):
            key = (request.resource, request.namespace, request.name)
            current = self.objects[key].raw if key in self.objects and not self.objects[key].deleted else None
            if current is not None and apply_merge_patch(
                current.get("spec") or {}, request.data["spec"]
            ) != current.get("spec"):
                generation = int((current.get("metadata") or {}).get("generation") or 1) + 1
                request.data.setdefault("metadata", {})["generation"] = generation
        return await super()._handle(request)


_names = itertools.count()


@contextlib.asynccontextmanager
async def emulator():
    async with Emulator() as k, kmock.Server(k):
        register_resources(k)
        # kr8s (dask-kubernetes' client) asks for "/version/"; KMock serves only "/version".
        k["get /version/"] << {"major": "1", "minor": "30", "gitVersion": "v1.30.0"}
        yield Cluster(k)


class Kubelet:
    """Plays the garbage collector, the Job controller, the kubelet and the Dask Operator for what
    the operator made, with their real-Kubernetes semantics:

    * a pod whose Job (or DaskCluster) is gone is deleted, as ownerReferences make the garbage
      collector do; a DaskCluster gets a scheduler and ``workers`` worker pods (API objects only);
    * a pod with a process carries a finalizer, so its deletion only marks it (deletionTimestamp,
      "Terminating"); its process gets SIGTERM, SIGKILL after ``grace`` s, and the pod is gone
      only once the process has exited, as the kubelet does;
    * a process that exits ends its pod (Succeeded/Failed) and its Job (Complete/Failed);
    * a Job whose pod vanished before it ended fails (runner Jobs have ``backoffLimit: 0``)."""

    FINALIZER = "test.h5ngff.dev/kubelet"

    def __init__(self, cluster: Cluster, grace: float = 2.0, workers: int = 2):
        self.c = cluster
        self.grace = grace
        self.workers = workers
        self.procs: dict[str, asyncio.subprocess.Process] = {}
        self._done: set[str] = set()
        self._clusters: set[str] = set()
        self._pods_of: dict[str, str] = {}  #: Job name -> its pod's name
        self._task: asyncio.Task | None = None

    async def __aenter__(self) -> "Kubelet":
        self._task = asyncio.create_task(self._loop())
        return self

    async def __aexit__(self, *exc: Any) -> None:
        self._task.cancel()
        for proc in self.procs.values():
            if proc.returncode is None:
                _signal_group(proc, 9)
                await proc.wait()

    async def run_pod(
        self, job_name: str, command: list[str] | None = None, env: dict[str, str] | None = None, cwd: str | None = None
    ) -> str:
        """Start the Job's pod: Running in the API, and ``command`` as a real process if given."""
        import os

        job = self.c.jobs()[job_name]
        name = f"{job_name}-abcde"
        template = job["spec"]["template"]
        pod = {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {
                "name": name,
                "namespace": "default",
                "labels": {**template["metadata"]["labels"], "job-name": job_name},
                "finalizers": [self.FINALIZER] if command else [],
            },
            "spec": template["spec"],
            "status": {"phase": "Running", "containerStatuses": [{"name": "runner", "state": {"running": {}}}]},
        }
        resp = await self.c.k.post(PODS_PATH.format(ns="default"), json=pod)
        assert resp.status in (200, 201), await resp.text()
        await self.c.patch_job_status(job_name, {"active": 1})
        self._pods_of[job_name] = name
        if command:
            log = open(os.path.join(cwd or ".", f"{name}.log"), "wb")
            self.procs[name] = await asyncio.create_subprocess_exec(
                *command, env=env, cwd=cwd, stdout=log, stderr=asyncio.subprocess.STDOUT, start_new_session=True
            )
        return name

    async def _loop(self) -> None:
        while True:
            await self._collect()
            await asyncio.sleep(0.05)

    async def _collect(self) -> None:
        jobs, clusters, pods = self.c.jobs(), self.c.live(DASK_RES), self.c.live(POD_RES)
        for name in set(clusters) - self._clusters:
            await self._dask_pods(name)
        self._clusters = set(clusters)
        for name, pod in pods.items():
            labels = pod["metadata"].get("labels") or {}
            owner_job, owner_cluster = labels.get("job-name"), labels.get("dask.org/cluster-name")
            gone = (owner_job and owner_job not in jobs) or (owner_cluster and owner_cluster not in clusters)
            if gone and not pod["metadata"].get("deletionTimestamp"):
                await self.c.k.delete(f"{PODS_PATH.format(ns='default')}/{name}")
        for job_name, pod_name in list(self._pods_of.items()):
            job = self.c.jobs().get(job_name)
            if (
                job is not None
                and pod_name not in self.c.live(POD_RES)
                and not (job.get("status") or {}).get("conditions")
            ):
                del self._pods_of[job_name]
                await self.c.patch_job_status(
                    job_name,
                    {
                        "active": 0,
                        "failed": 1,
                        "conditions": [
                            {
                                "type": "Failed",
                                "status": "True",
                                "reason": "BackoffLimitExceeded",
                                "message": "Job has reached the specified backoff limit",
                            }
                        ],
                    },
                )
        for name, proc in list(self.procs.items()):
            pod = self.c.live(POD_RES).get(name)
            if pod is None:
                continue
            if proc.returncode is None and pod["metadata"].get("deletionTimestamp") and name not in self._done:
                self._done.add(name)
                asyncio.ensure_future(self._terminate(name, proc))
            elif proc.returncode is not None and name not in self._done:
                self._done.add(name)
                await self._ended(name, proc.returncode)

    async def _dask_pods(self, cluster: str) -> None:
        for role in ["scheduler"] + [f"default-worker-{i}" for i in range(self.workers)]:
            pod = {
                "apiVersion": "v1",
                "kind": "Pod",
                "status": {"phase": "Pending"},
                "metadata": {
                    "name": f"{cluster}-{role}",
                    "namespace": "default",
                    "labels": {"dask.org/cluster-name": cluster},
                },
            }
            await self.c.k.post(PODS_PATH.format(ns="default"), json=pod)

    async def _terminate(self, name: str, proc: asyncio.subprocess.Process) -> None:
        _signal_group(proc, 15)
        try:
            await asyncio.wait_for(proc.wait(), self.grace)
        except asyncio.TimeoutError:
            _signal_group(proc, 9)
            await proc.wait()
        await self.c.k.patch(
            f"{PODS_PATH.format(ns='default')}/{name}",
            json={"metadata": {"finalizers": []}},
            headers={"Content-Type": "application/merge-patch+json"},
        )

    async def _ended(self, pod_name: str, code: int) -> None:
        pod = self.c.live(POD_RES)[pod_name]
        job_name = pod["metadata"]["labels"]["job-name"]
        term = {"exitCode": code, "reason": "Completed" if code == 0 else "Error"}
        await self.c.k.patch(
            f"{PODS_PATH.format(ns='default')}/{pod_name}",
            json={
                "metadata": {"finalizers": []},
                "status": {
                    "phase": "Succeeded" if code == 0 else "Failed",
                    "containerStatuses": [{"name": "runner", "state": {"terminated": term}}],
                },
            },
            headers={"Content-Type": "application/merge-patch+json"},
        )
        if job_name in self.c.jobs():
            done = (
                {"type": "Complete", "status": "True"}
                if code == 0
                else {"type": "Failed", "status": "True", "reason": "BackoffLimitExceeded"}
            )
            await self.c.patch_job_status(
                job_name, {"active": 0, "succeeded" if code == 0 else "failed": 1, "conditions": [done]}
            )


def _signal_group(proc: asyncio.subprocess.Process, sig: int) -> None:
    import os

    try:
        os.killpg(proc.pid, sig)
    except ProcessLookupError:
        pass
