"""The backend contract (docs/backends.md), checked against a real backend, as zarr-python checks
every store with one base test class.

A backend's test class subclasses ``BackendContract`` and provides ``new_backend`` (a fresh
backend per call; each session may need its own cluster name). Everything runs for real: a
session of the backend sized by a real plan, Dask workers whose settings are read back from the
worker processes, a worker killed with SIGKILL, a real conversion read back through zarr.

The checks are plain functions that raise ``ContractViolation``, so a deliberately broken backend
can be run through them and shown to fail (tests/test_backend_contract.py, the negative controls).
"""

from __future__ import annotations

import copy
import multiprocessing.forkserver as mp_forkserver
import os
import signal
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import dask
import numpy as np
import psutil
import pytest
import zarr
from conftest import smooth, spec_for, write_h5

from h5ngff.backends.base import Backend, Session, dask_memory_config
from h5ngff.backends.diagnostics import ClusterEvents, WorkerReport
from h5ngff.planner.model import Capacity, Plan
from h5ngff.runner import RunSummary, plan_job, run_job

#: The contract's conversion: small enough for seconds, two workers so per-worker reports and a
#: worker's death can be told apart, a 2-level pyramid so more than one task runs per worker.
SHAPE = (32, 96, 80)
RESOURCES = {"workers": 2, "threadsPerWorker": 1, "memoryPerWorker": "1GiB", "slab": [8, 96, 80]}
#: How long a killed worker may take to come back (a nanny spawns a fresh interpreter).
RESTART_TIMEOUT = 60.0
#: How long the worker processes may take to exit after the session has closed.
TEARDOWN_TIMEOUT = 20.0


class ContractViolation(AssertionError):
    """A backend does not do what the runner relies on."""


def _require(condition: Any, message: str) -> None:
    if not condition:
        raise ContractViolation(message)


# -- what is observed ---------------------------------------------------------------------------


@dataclass
class SessionObservation:
    plan: Plan
    owns_workers: bool
    session: Any = None
    client_status: str = ""
    #: scheduler_info()["workers"] while the session was open, by address.
    workers: dict[str, dict[str, Any]] = field(default_factory=dict)
    #: The Dask memory settings each worker process itself reads, by address.
    worker_config: dict[str, dict[str, Any]] = field(default_factory=dict)
    #: The worker killed with SIGKILL, and the session's reports after its nanny restarted it.
    killed: str = ""
    reports_after_kill: list[WorkerReport] = field(default_factory=list)
    #: Worker and nanny pids seen during the session (after the restart too).
    pids: set[int] = field(default_factory=set)
    #: Those still running once the session had closed (and TEARDOWN_TIMEOUT passed).
    alive_after: set[int] = field(default_factory=set)
    client_status_after: str = ""


def worker_settings_function() -> Callable[..., dict[str, Any]]:
    """The function each worker runs to report its pid, nanny and Dask memory settings. Defined
    locally so cloudpickle ships it by value: worker processes cannot import this test module."""
    keys = dask_memory_config_keys()

    def worker_settings(dask_worker=None) -> dict[str, Any]:
        import os

        return {
            "pid": os.getpid(),
            "nanny_pid": os.getppid(),
            "name": str(dask_worker.name),
            **{k: dask.config.get(k, None) for k in keys},
        }

    return worker_settings


def dask_memory_config_keys() -> list[str]:
    return [
        "distributed.worker.memory.target",
        "distributed.worker.memory.spill",
        "distributed.worker.memory.pause",
        "distributed.worker.memory.terminate",
        "distributed.worker.memory.monitor-interval",
    ]


def _running(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _kill_one_worker(session: Session, plan: Plan, observed: SessionObservation, since: float) -> None:
    """SIGKILL one worker process (as the kernel's OOM killer does) and wait for its nanny to
    start a new one; then ask the session for its per-worker reports."""
    client = session.client
    settings = client.run(worker_settings_function())
    address = sorted(settings)[0]
    victim = settings[address]
    observed.killed = victim["name"]
    os.kill(victim["pid"], signal.SIGKILL)
    deadline = time.monotonic() + RESTART_TIMEOUT
    while time.monotonic() < deadline:
        workers = client.scheduler_info(n_workers=-1)["workers"]
        names = {str(w.get("name")): a for a, w in workers.items()}
        if len(workers) >= plan.workers and names.get(victim["name"], address) != address:
            break
        time.sleep(0.2)
    else:
        raise ContractViolation(f"the killed worker {victim['name']} did not come back within {RESTART_TIMEOUT:.0f} s")
    for info in client.run(worker_settings_function()).values():
        observed.pids |= {info["pid"], info["nanny_pid"]}
    observed.reports_after_kill = session.worker_reports(plan, {}, ClusterEvents.collect(client, since))


@dataclass
class ConversionObservation:
    plan: Plan
    data: np.ndarray
    output: str
    summary: RunSummary


class _OpenSession:
    """``backend`` with its session already open: the runner's ``run_job`` converts on the
    session under test instead of starting a second cluster (a cluster start is most of the
    contract's time on two cores)."""

    def __init__(self, backend: Backend, session: Session):
        self.backend, self.open = backend, session
        self.name = backend.name

    def capacity(self) -> Capacity:
        return self.backend.capacity()

    def fit(self, spec):
        return self.backend.fit(spec)

    def describe(self, spec, plan):
        return self.backend.describe(spec, plan)

    @contextmanager
    def session(self, plan: Plan) -> Iterator[Session]:
        yield self.open


def contract_job(backend: Backend, directory: str):
    """The contract's conversion job, planned for ``backend`` by the real runner."""
    data = smooth(SHAPE, "uint16", seed=11)
    source = write_h5(os.path.join(directory, "contract.h5"), data)
    output = os.path.join(directory, "contract.ome.zarr")
    spec = spec_for(source, output, output={"chunks": [8, 32, 32]}, pyramid={"levels": 2}, resources=RESOURCES)
    return plan_job(spec, backend), data


def observe_session(
    backend: Backend, plan: Plan, owns_workers: bool, job=None, teardown_timeout: float = TEARDOWN_TIMEOUT
) -> tuple[SessionObservation, ConversionObservation | None]:
    """Open one session of ``backend`` for ``plan``, look at it from the inside, run ``job``'s
    conversion on it (when given) through the real runner, kill a worker, close the session, and
    look again. ``owns_workers``: what the backend's entry in the factory says (backends/factory.py)."""
    observed = SessionObservation(plan, owns_workers)
    converted = None
    since = time.time()
    with backend.session(plan) as session:
        observed.session = session
        observed.client_status = session.client.status
        observed.workers = session.client.scheduler_info(n_workers=-1)["workers"]
        observed.worker_config = session.client.run(worker_settings_function())
        for info in observed.worker_config.values():
            observed.pids |= {info["pid"], info["nanny_pid"]}
        if job is not None:
            planned, data = job
            summary = run_job(planned, _OpenSession(backend, session))
            # Pod reports are live objects the session keeps updating: keep the run's figures
            # apart from the kill that follows.
            summary.workers = copy.deepcopy(summary.workers)
            converted = ConversionObservation(planned.plan, data, planned.spec.output.path, summary)
            since = time.time()  # the kill's events only
        _kill_one_worker(session, plan, observed, since)
    observed.client_status_after = session.client.status
    observed.pids.discard(os.getpid())  # LocalCluster's nannies live in this process
    # The local backend's workers are forked from a fork server (backends/forkserver.py), their
    # parent: it holds no worker's memory and serves this process's next local cluster.
    observed.pids.discard(getattr(mp_forkserver._forkserver, "_forkserver_pid", None))
    deadline = time.monotonic() + teardown_timeout
    while time.monotonic() < deadline and any(_running(p) for p in observed.pids):
        if not observed.owns_workers:
            break  # someone else's workers: they must stay
        time.sleep(0.2)
    observed.alive_after = {p for p in observed.pids if _running(p)}
    return observed, converted


# -- the checks ---------------------------------------------------------------------------------


def check_protocol(backend: Any) -> None:
    _require(
        isinstance(backend, Backend),
        f"{type(backend).__name__} lacks part of the Backend protocol (name, capacity, fit, describe, session)",
    )
    _require(
        isinstance(backend.name, str) and backend.name,
        f"a backend's name must be a non-empty string, got {backend.name!r}",
    )


def check_capacity(capacity: Any) -> None:
    _require(isinstance(capacity, Capacity), f"capacity() must return a Capacity, got {capacity!r}")
    _require(capacity.cores >= 1, f"capacity().cores must be at least 1, got {capacity.cores}")
    _require(
        capacity.memory_bytes >= 256 << 20,
        f"capacity().memory_bytes must leave room for a worker, got {capacity.memory_bytes}",
    )
    _require(
        capacity.default_workers is None or capacity.default_workers >= 1,
        f"capacity().default_workers must be None or >= 1, got {capacity.default_workers}",
    )


def check_session(observed: SessionObservation) -> None:
    _require(
        isinstance(observed.session, Session), f"session() must yield a Session, got {type(observed.session).__name__}"
    )
    _require(
        observed.client_status == "running",
        f"the session's client must be connected, its status was {observed.client_status!r}",
    )
    _require(
        len(observed.workers) == observed.plan.workers,
        f"the plan has {observed.plan.workers} workers; the session had {len(observed.workers)} connected",
    )


def check_worker_sizes(observed: SessionObservation) -> None:
    """Workers run with the plan's memory_limit and threads (on a cluster the backend does not
    own: the plan fits inside the workers it was fitted to)."""
    plan = observed.plan
    for address, info in observed.workers.items():
        limit, threads = info.get("memory_limit"), info.get("nthreads")
        if observed.owns_workers:
            _require(
                limit == plan.memory.memory_limit,
                f"worker {address} has memory_limit {limit}, the plan says {plan.memory.memory_limit}",
            )
            _require(
                threads == plan.threads_per_worker,
                f"worker {address} has {threads} threads, the plan says {plan.threads_per_worker}",
            )
        else:
            _require(
                limit and limit >= plan.memory.memory_limit,
                f"the plan's memory_limit {plan.memory.memory_limit} does not fit worker {address}'s {limit}",
            )


def check_thresholds(observed: SessionObservation) -> None:
    """Each worker process reads the plan's Dask memory thresholds (where the backend starts it)."""
    if not observed.owns_workers:
        return
    expected = {k: v for k, v in dask_memory_config(observed.plan).items() if k in dask_memory_config_keys()}
    for address, seen in observed.worker_config.items():
        for key, value in expected.items():
            _require(
                str(seen.get(key)) == str(value),
                f"worker {address} reads {key} = {seen.get(key)!r}, the plan says {value!r}",
            )


def check_failure_reported(observed: SessionObservation) -> None:
    """A worker killed during the session shows in the session's own per-worker figures."""
    report = next((r for r in observed.reports_after_kill if r.name == observed.killed), None)
    restarts = report.nanny_restarts + report.pod_restarts if report else 0
    _require(
        restarts >= 1,
        f"worker {observed.killed} was killed and restarted, but the session's reports say {observed.reports_after_kill}",
    )


def check_teardown(observed: SessionObservation) -> None:
    _require(
        observed.client_status_after in ("closed", "closing"),
        f"the session's client is still {observed.client_status_after!r} after the session",
    )
    if observed.owns_workers:
        _require(
            not observed.alive_after, f"worker or nanny processes {sorted(observed.alive_after)} outlived the session"
        )
    else:
        _require(observed.alive_after, "the session stopped the workers of a cluster it does not own")


def check_conversion(converted: ConversionObservation) -> None:
    _require(converted.summary.status == "Succeeded", f"the conversion ended {converted.summary.status}")
    written = zarr.open_group(converted.output, mode="r")["0"][...]
    _require(np.array_equal(written, converted.data), "the converted level 0 differs from the source")


def check_worker_reports(converted: ConversionObservation) -> None:
    plan, workers = converted.plan, converted.summary.workers
    _require(
        len(workers) == plan.workers,
        f"{len(workers)} worker reports for {plan.workers} planned workers: {[w.name for w in workers]}",
    )
    _require(
        len({w.name for w in workers}) == len(workers), f"worker reports repeat a name: {[w.name for w in workers]}"
    )
    for w in workers:
        _require(w.peak_rss > 0, f"worker {w.name} reports no peak RSS")
        _require(
            w.memory_limit == plan.memory.memory_limit and w.predicted_peak == plan.memory.predicted_peak,
            f"worker {w.name}'s report does not carry the plan: {w}",
        )
        _require(
            w.oom_kills == 0 and w.nanny_restarts == 0, f"worker {w.name} failed during a run that should not fail: {w}"
        )
    _require(converted.summary.timeline, "no memory timeline was sampled during the run")


SESSION_CHECKS: tuple[Callable[[SessionObservation], None], ...] = (
    check_session,
    check_worker_sizes,
    check_thresholds,
    check_failure_reported,
    check_teardown,
)


# -- the base test class ------------------------------------------------------------------------


class BackendContract:
    """Subclass as ``TestMyBackend(BackendContract)``, name the backend's ``kind`` (its entry in
    backends/factory.py, which says whether it owns its workers) and define the classmethod
    ``new_backend``."""

    kind = ""

    @classmethod
    def new_backend(cls) -> Backend:
        raise NotImplementedError

    @classmethod
    def owns_workers(cls) -> bool:
        from h5ngff.backends.factory import BACKENDS

        return BACKENDS[cls.kind].owns_workers

    @pytest.fixture(scope="class")
    @classmethod
    def contract_run(cls, tmp_path_factory) -> tuple[SessionObservation, ConversionObservation]:
        backend = cls.new_backend()
        job = contract_job(backend, str(tmp_path_factory.mktemp("contract")))
        observed, converted = observe_session(backend, job[0].plan, cls.owns_workers(), job)
        assert converted is not None
        return observed, converted

    @pytest.fixture(scope="class")
    @classmethod
    def observed(cls, contract_run) -> SessionObservation:
        return contract_run[0]

    @pytest.fixture(scope="class")
    @classmethod
    def converted(cls, contract_run) -> ConversionObservation:
        return contract_run[1]

    def test_satisfies_the_protocol(self):
        check_protocol(self.new_backend())

    def test_capacity_is_sane(self):
        check_capacity(self.new_backend().capacity())

    def test_session_yields_a_connected_client_with_the_planned_workers(self, observed):
        check_session(observed)

    def test_workers_get_the_plans_memory_limit_and_threads(self, observed):
        check_worker_sizes(observed)

    def test_workers_get_the_plans_thresholds(self, observed):
        check_thresholds(observed)

    def test_a_killed_worker_shows_in_the_sessions_reports(self, observed):
        check_failure_reported(observed)

    def test_teardown_leaves_no_worker_process(self, observed):
        check_teardown(observed)

    def test_a_real_conversion(self, converted):
        check_conversion(converted)

    def test_one_report_per_worker(self, converted):
        check_worker_reports(converted)
