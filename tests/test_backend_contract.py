"""Every backend runs the one contract suite (tests/backend_contract.py, docs/backends.md).

* local and local-pods (pod emulation under real cgroup limits) and external (an existing
  LocalCluster) run it for real;
* kubernetes runs it against KMock with ``FakeDaskOperator`` (tests/test_operator_kubecluster.py)
  playing the Dask Operator and kubelet: the backend's real ``KubeCluster`` session, our
  DaskCluster manifest, and the worker commands and environment it carries, started as local
  processes. Not covered there: real pod scheduling, kubelet's cgroup limits, image pulls and the
  cluster DNS (the scheduler is reached at 127.0.0.1).

The negative control runs a deliberately broken backend through the same checks and shows that
each check it breaks raises.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import threading
from contextlib import contextmanager
from typing import Iterator

import dask
import pytest
from backend_contract import (
    SESSION_CHECKS,
    BackendContract,
    ContractViolation,
    check_failure_reported,
    check_protocol,
    check_session,
    check_teardown,
    check_thresholds,
    check_worker_sizes,
    contract_job,
    observe_session,
)
from conftest import requires_cgroups
from slurm_local import slurm_cluster  # noqa: F401  (session fixture)
from distributed import Client, LocalCluster

from h5ngff.backends.base import Backend, Description, Session
from h5ngff.backends.factory import BACKENDS, BackendOptions, make_backend
from h5ngff.jobspec import Owner
from h5ngff.backends.local import LocalBackend
from h5ngff.planner.model import Plan

pytestmark = [pytest.mark.timeout(240), pytest.mark.integration, pytest.mark.slow]


def test_the_factory_builds_every_registered_backend():
    options = BackendOptions(scheduler="tcp://127.0.0.1:1", owner=Owner("ns", "job", "uid"), image="img")
    for kind in BACKENDS:
        backend: Backend = make_backend(kind, options)
        check_protocol(backend)
    with pytest.raises(
        ValueError, match="Expected one of local, local-pods, external, kubernetes, slurm. Got 'pbs' instead"
    ):
        make_backend("pbs")


class TestLocal(BackendContract):
    kind = "local"

    @classmethod
    def new_backend(cls) -> Backend:
        return make_backend("local")


@requires_cgroups
@pytest.mark.cgroup
class TestLocalPods(BackendContract):
    kind = "local-pods"

    @classmethod
    def new_backend(cls) -> Backend:
        return make_backend("local-pods")


class TestExternal(BackendContract):
    kind = "external"
    address = ""

    @pytest.fixture(scope="class", autouse=True)
    @classmethod
    def existing_cluster(cls):
        cluster = LocalCluster(
            n_workers=2,
            threads_per_worker=1,
            memory_limit="2GiB",
            processes=True,
            dashboard_address=None,
            silence_logs=logging.ERROR,
        )
        cls.address = cluster.scheduler_address
        yield cluster
        cluster.close()

    @classmethod
    def new_backend(cls) -> Backend:
        return make_backend("external", BackendOptions(scheduler=cls.address))


class TestSlurm(BackendContract):
    """The worker jobs of a real single-node SLURM (tests/slurm_local.py), cgroup-enforced --mem."""

    kind = "slurm"
    logs = ""

    @pytest.fixture(scope="class", autouse=True)
    @classmethod
    def slurm(cls, request, tmp_path_factory):
        cluster = request.getfixturevalue("slurm_cluster")  # started before the contract run
        cls.logs = str(tmp_path_factory.mktemp("slurm-contract-logs"))
        yield cluster

    @classmethod
    def new_backend(cls) -> Backend:
        from h5ngff.spec import SlurmSpec

        return make_backend("slurm", BackendOptions(slurm=SlurmSpec(logDirectory=cls.logs, pendingTimeout=120)))


class KubeHarness:
    """KMock and the stand-in Dask Operator, served by an event loop of their own in a thread:
    the backend's session blocks (it is synchronous), and the emulator must keep answering."""

    def __init__(self, log_dir: str):
        self.log_dir = log_dir
        self.loop = asyncio.new_event_loop()
        self.ready = threading.Event()
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, name="kmock", daemon=True)

    def _run(self) -> None:
        try:
            self.loop.run_until_complete(self._main())
        except BaseException as exc:  # surfaced by start()
            self.error = exc
            self.ready.set()

    async def _main(self) -> None:
        import kmock
        from operator_harness import emulator
        from test_operator_kubecluster import FakeDaskOperator

        self._stop = asyncio.Event()
        async with emulator() as c, FakeDaskOperator(c, self.log_dir) as fake:
            c.k.resources["v1/services"] = kmock.ResourceInfo(
                kind="Service", namespaced=True, verbs={"list", "watch", "get", "create", "delete", "patch"}
            )
            self.cluster, self.fake = c, fake
            self.ready.set()
            await self._stop.wait()

    @contextmanager
    def running(self, kubeconfig_path) -> Iterator["KubeHarness"]:
        from test_operator_kubecluster import kubeconfig

        self.thread.start()
        self.ready.wait(30)
        if self.error is not None:
            raise self.error
        os.environ["KUBECONFIG"] = kubeconfig(kubeconfig_path, self.cluster.url)  # kr8s reads it
        try:
            yield self
        finally:
            os.environ.pop("KUBECONFIG", None)
            self.loop.call_soon_threadsafe(self._stop.set)
            self.thread.join(30)


class TestKubernetes(BackendContract):
    kind = "kubernetes"
    names = itertools.count(1)

    @pytest.fixture(scope="class", autouse=True)
    @classmethod
    def kube(cls, tmp_path_factory):
        pytest.importorskip("dask_kubernetes")
        directory = tmp_path_factory.mktemp("kube")
        with KubeHarness(str(directory)).running(directory / "kubeconfig") as harness:
            yield harness

    @classmethod
    def new_backend(cls) -> Backend:
        # Each session its own DaskCluster name: the stand-in operator reacts to names.
        name = f"contract-{next(cls.names)}"
        return make_backend(
            "kubernetes", BackendOptions(owner=Owner("default", name, f"uid-{name}"), image="registry.example/h5ngff:1")
        )


# -- the negative control ----------------------------------------------------------------------


class BrokenBackend:
    """Everything a careless new backend might get wrong, each of which the runner relies on: it
    starts its workers with twice the plan's memory_limit, without the plan's thresholds and
    without our Dask plugins (so a worker's death goes unrecorded), and leaves them running."""

    name = "broken"

    def __init__(self) -> None:
        self.leaked: list[LocalCluster] = []

    def capacity(self):
        return LocalBackend().capacity()

    def fit(self, spec):
        return spec

    def describe(self, spec, plan):
        return Description()

    @contextmanager
    def session(self, plan: Plan) -> Iterator[Session]:
        with dask.config.set({"distributed.worker.memory.target": 0.99}):
            cluster = LocalCluster(
                n_workers=plan.workers,
                threads_per_worker=plan.threads_per_worker,
                memory_limit=2 * plan.memory.memory_limit,
                processes=True,
                dashboard_address=None,
                silence_logs=logging.ERROR,
            )
        self.leaked.append(cluster)
        client = Client(cluster, set_as_default=False)
        try:
            yield Session(client, self.name)
        finally:
            client.close()  # the cluster (and its worker processes) is never closed


def test_negative_control_a_broken_backend_fails_the_contract(tmp_path):
    broken = BrokenBackend()
    check_protocol(broken)  # it has the right shape: only running it shows what is wrong
    job, _ = contract_job(broken, str(tmp_path))
    try:
        observed, _ = observe_session(broken, job.plan, owns_workers=True, teardown_timeout=3.0)
    finally:
        for cluster in broken.leaked:
            cluster.close()
    check_session(observed)  # connected, right worker count: the part it gets right passes
    for check, what in [
        (check_worker_sizes, "memory_limit"),
        (check_thresholds, "distributed.worker.memory.target"),
        (check_failure_reported, "was killed and restarted"),
        (check_teardown, "outlived the session"),
    ]:
        with pytest.raises(ContractViolation, match=what):
            check(observed)
    assert set(SESSION_CHECKS) == {
        check_session,
        check_worker_sizes,
        check_thresholds,
        check_failure_reported,
        check_teardown,
    }


def test_negative_control_an_incomplete_backend_fails_the_protocol():
    class NoFit:
        name = "nofit"

        def capacity(self): ...

        def session(self, plan): ...

    with pytest.raises(ContractViolation, match="lacks part of the Backend protocol"):
        check_protocol(NoFit())
