"""The kubernetes backend's real KubeCluster session, against KMock and a stand-in Dask Operator.

``FakeDaskOperator`` plays the Dask Operator and the kubelet: when a DaskCluster appears in the
emulator, it starts the scheduler and worker containers' commands (from the DaskCluster our
backend built) as local processes, publishes the scheduler's Pod and a LoadBalancer Service at
127.0.0.1, and marks the cluster Running; when the DaskCluster is deleted it stops them. The
substitutions are the pod network (127.0.0.1 and free ports instead of the service DNS name) and
``dask`` as ``python -m distributed.cli.dask_*``. Everything of ours runs for real: dask-kubernetes'
``KubeCluster`` with our cluster spec, the worker limits and env, the runner command with
``H5NGFF_BACKEND=kubernetes``, and the teardown.
"""

from __future__ import annotations

import asyncio
import os
import re
import socket
import subprocess
import sys

import kmock
import numpy as np
import pytest
import zarr

from conftest import smooth, write_h5
from h5ngff.operator.schema.rbac import RUNNER_JOB_RULES, RUNNER_RULES, calls
from operator_harness import DASK_RES, emulator, fast_config, manifest, operator_running, wait_for
from test_operator_e2e import run_container
from test_operator_kmock import phases

pytestmark = [pytest.mark.asyncio, pytest.mark.timeout(240), pytest.mark.integration]

DASK_PATH = "/apis/kubernetes.dask.org/v1/namespaces/default/daskclusters"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env(container: dict, **extra: str) -> dict[str, str]:
    return {**os.environ, **{e["name"]: e["value"] for e in container.get("env") or ()}, **extra}


class FakeDaskOperator:
    def __init__(self, cluster, log_dir):
        self.c = cluster
        self.log_dir = log_dir
        self.procs: dict[str, list[subprocess.Popen]] = {}
        self.seen: dict[str, dict] = {}
        self._task: asyncio.Task | None = None

    async def __aenter__(self):
        self._task = asyncio.create_task(self._loop())
        return self

    async def __aexit__(self, *exc):
        self._task.cancel()
        for name in list(self.procs):
            self._stop(name)

    async def _loop(self):
        while True:
            live = self.c.live(DASK_RES)
            for name, obj in live.items():
                if name not in self.procs:
                    await self._start(name, obj)
            for name in [n for n in self.procs if n not in live]:
                self._stop(name)
            await asyncio.sleep(0.1)

    def _spawn(self, module: str, args: list[str], env: dict, log: str) -> subprocess.Popen:
        out = open(os.path.join(self.log_dir, log), "wb")
        return subprocess.Popen([sys.executable, "-m", module, *args], env=env, stdout=out, stderr=subprocess.STDOUT)

    async def _start(self, name: str, obj: dict) -> None:
        self.seen[name] = obj
        spec = obj["spec"]
        sched = spec["scheduler"]["spec"]["containers"][0]
        port, dash = free_port(), free_port()
        assert sched["args"][:2] == ["dask", "scheduler"]
        args = [a if a != "0.0.0.0" else "127.0.0.1" for a in sched["args"][2:]] + [
            "--port",
            str(port),
            "--dashboard-address",
            f"127.0.0.1:{dash}",
        ]
        procs = [self._spawn("distributed.cli.dask_scheduler", args, _env(sched), f"{name}-scheduler.log")]
        worker = spec["worker"]["spec"]["containers"][0]
        assert worker["args"][:2] == ["dask", "worker"]
        for i in range(spec["worker"]["replicas"]):
            wname = f"{name}-default-worker-{i}"
            env = _env(worker, DASK_WORKER_NAME=wname, DASK_SCHEDULER_ADDRESS=f"tcp://127.0.0.1:{port}")
            wargs = [a.replace("$(DASK_WORKER_NAME)", wname) for a in worker["args"][2:]]
            wargs[wargs.index("--dashboard-address") + 1] = "127.0.0.1:0"  # one host, many pods
            procs.append(self._spawn("distributed.cli.dask_worker", wargs, env, f"{wname}.log"))
        self.procs[name] = procs
        labels = {"dask.org/cluster-name": name, "dask.org/component": "scheduler"}
        ready = [{"type": "Ready", "status": "True"}, {"type": "ContainersReady", "status": "True"}]
        await self._post(
            "/api/v1/namespaces/default/pods",
            {
                "apiVersion": "v1",
                "kind": "Pod",
                "metadata": {"name": f"{name}-scheduler", "namespace": "default", "labels": labels},
                "status": {"phase": "Running", "conditions": ready},
            },
        )
        await self._post(
            "/api/v1/namespaces/default/services",
            {
                "apiVersion": "v1",
                "kind": "Service",
                "metadata": {"name": f"{name}-scheduler", "namespace": "default", "labels": labels},
                "spec": {
                    "type": "LoadBalancer",
                    "selector": labels,
                    "ports": [{"name": "tcp-comm", "port": port}, {"name": "http-dashboard", "port": dash}],
                },
                "status": {"loadBalancer": {"ingress": [{"ip": "127.0.0.1"}]}},
            },
        )
        resp = await self.c.k.patch(
            f"{DASK_PATH}/{name}/status",
            json={"status": {"phase": "Running"}},
            headers={"Content-Type": "application/merge-patch+json"},
        )
        assert resp.status == 200

    async def _post(self, path: str, body: dict) -> None:
        resp = await self.c.k.post(path, json=body)
        assert resp.status == 200, await resp.text()

    def _stop(self, name: str) -> None:
        for proc in self.procs.pop(name):
            proc.terminate()
        for path in (
            f"/api/v1/namespaces/default/pods/{name}-scheduler",
            f"/api/v1/namespaces/default/services/{name}-scheduler",
        ):
            asyncio.ensure_future(self.c.k.delete(path))


def kubeconfig(path, url: str) -> str:
    path.write_text(
        "apiVersion: v1\nkind: Config\n"
        f"clusters: [{{name: kmock, cluster: {{server: '{url}'}}}}]\n"
        "users: [{name: test, user: {}}]\n"
        "contexts: [{name: kmock, context: {cluster: kmock, user: test, namespace: default}}]\n"
        "current-context: kmock\n"
    )
    return str(path)


@pytest.mark.slow
async def test_the_runner_converts_on_a_daskcluster_sized_by_its_plan(tmp_path):
    data = smooth((32, 96, 80), "uint16", seed=3)
    source = write_h5(tmp_path / "scan.h5", data)
    output = str(tmp_path / "scan.ome.zarr")
    spec = {
        "source": {"path": source, "dataset": "/volume/data"},
        "output": {"path": output, "chunks": [16, 32, 32]},
        "pyramid": {"levels": 2},
        "resources": {"workers": 2, "threadsPerWorker": 1, "memoryPerWorker": "1Gi", "slab": [16, 96, 80]},
        "pod": {"image": "registry.example/h5ngff:1"},
    }
    async with (
        emulator() as c,
        FakeDaskOperator(c, str(tmp_path)) as dask_operator,
        operator_running(fast_config(c.url)),
    ):
        c.k.resources["v1/services"] = c.k.ResourceInfo(
            kind="Service", namespaced=True, verbs={"list", "watch", "get", "create", "delete", "patch"}
        )
        await c.apply(manifest("scan", spec))
        await wait_for(lambda: "scan-runner-1" in c.jobs(), what="runner Job")
        job = c.jobs()["scan-runner-1"]
        job_env = {e["name"]: e["value"] for e in job["spec"]["template"]["spec"]["containers"][0]["env"]}
        assert job_env["H5NGFF_BACKEND"] == "kubernetes"
        os.environ["KUBECONFIG"] = kubeconfig(tmp_path / "kubeconfig", c.url)  # kr8s (dask-kubernetes) reads it
        try:
            code, log = await run_container(job, c.url, str(tmp_path), backend="kubernetes")
        finally:
            os.environ.pop("KUBECONFIG", None)
        assert code == 0, log[-4000:]
        await c.patch_job_status(
            "scan-runner-1", {"succeeded": 1, "conditions": [{"type": "Complete", "status": "True"}]}
        )
        await wait_for(lambda: c.status("scan").get("phase") == "Succeeded", what="Succeeded")
        status = c.status("scan")
        cluster = dask_operator.seen["scan-dask"]
        made = c.api_calls()
        await wait_for(lambda: not dask_operator.procs, what="cluster torn down")

    assert c.live(DASK_RES) == {}  # the runner deleted its DaskCluster
    # The runner pod, KubeCluster included, needs exactly the runner RBAC of rbac.py.
    assert made["runner"] == calls(RUNNER_RULES + RUNNER_JOB_RULES) and made["other"] == set()
    assert phases(c, "scan") == ["Pending", "Planned", "Running", "Succeeded"]
    assert status["progress"]["percent"] == 100
    plan = status["plan"]
    worker = cluster["spec"]["worker"]
    (container,) = worker["spec"]["containers"]
    assert worker["replicas"] == plan["workers"] == 2
    assert (
        container["resources"]["limits"]["memory"] == container["resources"]["requests"]["memory"] == plan["podLimit"]
    )
    assert container["args"][container["args"].index("--memory-limit") + 1] == str(plan["memoryLimitBytes"])
    assert cluster["metadata"]["ownerReferences"][0]["uid"] == "uid-scan"
    np.testing.assert_array_equal(zarr.open_group(output, mode="r")["0"][...], data)
    # The worker processes came up with the planned limit and threads (Dask logs both at start).
    from dask.utils import format_bytes

    for i in range(2):
        text = open(os.path.join(tmp_path, f"scan-dask-default-worker-{i}.log")).read()
        assert re.search(rf"Memory:\s+{re.escape(format_bytes(plan['memoryLimitBytes']))}\n", text), text[-2000:]
        assert re.search(r"Threads:\s+1\n", text)


@pytest.mark.slow
async def test_a_runner_finds_a_stale_daskcluster_in_one_request_and_deletes_it(tmp_path):
    """Every runner looks for a DaskCluster left by an earlier attempt of its job before it creates
    its own. The first attempt has none, and kr8s' ``DaskCluster.get`` polled 2.5 s to say so.
    Counted in requests the API served for the name, not in seconds: load stretches any time."""
    from h5ngff.backends.kubernetes import delete_stale_cluster

    from kr8s._api import Api

    # kr8s keeps its client (an emulator's URL) for the thread's next caller, and its own test
    # suite's fixtures clear it: an earlier test's emulator listened elsewhere, and so will a later one's.
    Api._instances.clear()
    async with emulator() as c:
        os.environ["KUBECONFIG"] = kubeconfig(tmp_path / "kubeconfig", c.url)  # kr8s reads it
        try:
            assert await asyncio.to_thread(delete_stale_cluster, "fresh-dask", "default") is False
            lookups = _requests_for(c, "fresh-dask")
            stale = {
                "apiVersion": "kubernetes.dask.org/v1",
                "kind": "DaskCluster",
                "metadata": {"name": "retried-dask", "namespace": "default"},
                "spec": {},
            }
            resp = await c.k.post(DASK_PATH, json=stale)
            assert resp.status in (200, 201), await resp.text()
            assert "retried-dask" in c.live(DASK_RES)
            assert await asyncio.to_thread(delete_stale_cluster, "retried-dask", "default", 10.0) is True
            assert "retried-dask" not in c.live(DASK_RES)
            # Without the Dask Operator's CRD the lookup is answered 404: nothing stale, and the
            # cluster's creation says what is missing, not the lookup (blaming the runner's RBAC).
            dask_resource = c.k.resources.pop(DASK_RES)
            assert await asyncio.to_thread(delete_stale_cluster, "fresh-dask", "default") is False
            c.k.resources[DASK_RES] = dask_resource
            # Negative control: the lookup it replaced waits its whole timeout for a missing name.
            from kr8s import NotFoundError
            from kr8s.objects import new_class

            DaskCluster = new_class("DaskCluster", "kubernetes.dask.org/v1", namespaced=True)
            before = _requests_for(c, "fresh-dask")
            with pytest.raises(NotFoundError):
                await asyncio.to_thread(DaskCluster.get, "fresh-dask", namespace="default")
            polled = _requests_for(c, "fresh-dask") - before
        finally:
            os.environ.pop("KUBECONFIG", None)
            Api._instances.clear()
    assert lookups == 1 < polled, (lookups, polled)


def _requests_for(c, name: str) -> int:
    """How many requests the emulator served for the DaskCluster ``name`` so far: by name, or a
    list selecting it by name (kr8s looks objects up that way)."""
    selects = f"metadata.name={name}"
    return sum(
        1
        for r in c.k
        if r.resource == kmock.resource(DASK_RES)
        and (r.name == name or selects in r.url.query.get("fieldSelector", "").split(","))
    )
