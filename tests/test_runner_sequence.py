"""The one run sequence (``runner.execute``, docs/architecture.md "One run sequence") and what the
backends give it: the refusals before any cluster starts, the order of the outcome and the last
scrape, the backend's description, the factory's kinds and the one wait for workers.

Real parts throughout: real HDF5 files, the real planner, a real Dask cluster (the shared one,
through the real ExternalBackend), the real output lock."""

from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import replace
from typing import Iterator

import pytest
from conftest import smooth, spec_for, write_h5

from h5ngff.backends.base import Description, Session, connect, wait_for_workers
from h5ngff.backends.diagnostics import WorkerReport
from h5ngff.backends.external import ExternalBackend
from h5ngff.backends.factory import BACKENDS, owning_kinds
from h5ngff.backends.local import LocalBackend, LocalPodsBackend
from h5ngff.engine.write.lock import output_lock
from h5ngff.errors import ClusterError, OutputBusyError, OutputConflictError, SpecError
from h5ngff.planner.model import Capacity, Plan
from h5ngff.runner import Linger, Outcome, execute, plan_job, run_job
from h5ngff.spec import ConversionSpec

# The sequence runs on the suite's shared Dask cluster (real processes).
pytestmark = pytest.mark.integration


class Spy:
    """The shared cluster through the real ExternalBackend, with a notice of its own, recording
    whether a session was ever opened."""

    name = "spy"

    def __init__(self, address: str):
        self.real = ExternalBackend(address)
        self.sessions = 0

    def capacity(self) -> Capacity:
        return self.real.capacity()

    def fit(self, spec: ConversionSpec) -> ConversionSpec:
        return self.real.fit(spec)

    def describe(self, spec: ConversionSpec, plan: Plan) -> Description:
        return Description(notices=("the spy's notice",))

    @contextmanager
    def session(self, plan: Plan) -> Iterator[Session]:
        self.sessions += 1
        with self.real.session(plan) as session:
            yield session


class Metrics:
    """Stands in for the exporter where only the order of close and linger is asked."""

    def __init__(self, log: list[str]):
        self.log = log

    def __call__(self, progress) -> None:
        pass

    @contextmanager
    def attached(self, poller, plan):
        yield self

    def settle(self, workers) -> None:
        pass

    def linger(self, seconds: float, until_scraped: bool = False) -> bool:
        self.log.append(f"linger {seconds} {until_scraped}")
        return False

    def close(self) -> None:
        self.log.append("close")


@pytest.fixture
def source(tmp_path):
    return write_h5(tmp_path / "in.h5", smooth((16, 64, 64)))


def test_a_run_goes_plan_notices_run_outcome_then_linger(shared_cluster, source, tmp_path):
    spy, log = Spy(shared_cluster.scheduler_address), []
    seen: list[Outcome] = []

    def on_plan(job) -> None:
        log.append("plan")
        assert "the spy's notice" in job.notices  # the backend's notices come with the plan

    def on_end(outcome: Outcome) -> None:
        log.append("end")
        seen.append(outcome)

    summary = execute(
        spec_for(source, str(tmp_path / "out.ome.zarr")),
        spy,
        [lambda p: None],
        Metrics(log),
        on_plan=on_plan,
        on_end=on_end,
        linger=Linger(2.5, until_scraped=True),
    )
    assert summary.status == "Succeeded" and spy.sessions == 1
    assert log == ["plan", "end", "linger 2.5 True"]  # the outcome never waits for the last scrape
    assert seen[0].summary is summary and seen[0].error is None and seen[0].job is summary.job


def test_a_busy_output_is_refused_before_the_plan_and_any_cluster(shared_cluster, source, tmp_path):
    out = tmp_path / "busy.ome.zarr"
    spy, log = Spy(shared_cluster.scheduler_address), []
    ended: list[Outcome] = []
    with output_lock(str(out)):  # another run is writing it
        with pytest.raises(OutputBusyError):
            execute(
                spec_for(source, str(out)),
                spy,
                (),
                Metrics(log),
                on_plan=lambda job: log.append("plan"),
                on_end=ended.append,
            )
    assert spy.sessions == 0 and log == ["close"]  # no plan shown, no cluster, nothing to linger for
    assert isinstance(ended[0].error, OutputBusyError) and ended[0].job is None
    # Negative control: once the other run is gone, the same call runs.
    assert execute(spec_for(source, str(out)), spy).status == "Succeeded" and spy.sessions == 1


def test_an_output_that_is_not_ours_is_refused_before_any_cluster(shared_cluster, source, tmp_path):
    out = tmp_path / "theirs.ome.zarr"
    out.mkdir()
    (out / "somebody-elses.txt").write_text("not ours")
    spy = Spy(shared_cluster.scheduler_address)
    with pytest.raises(OutputConflictError):
        execute(spec_for(source, str(out)), spy, on_plan=lambda job: pytest.fail("the plan was shown"))
    assert spy.sessions == 0


def test_a_failed_run_reports_its_outcome_and_still_lingers(shared_cluster, source, tmp_path):
    class Broken(Spy):
        @contextmanager
        def session(self, plan: Plan) -> Iterator[Session]:
            self.sessions += 1
            raise ClusterError("no cluster today")
            yield  # pragma: no cover

    log: list[str] = []
    ended: list[Outcome] = []
    with pytest.raises(ClusterError, match="no cluster today"):
        execute(
            spec_for(source, str(tmp_path / "out.ome.zarr")),
            Broken(shared_cluster.scheduler_address),
            (),
            Metrics(log),
            on_end=lambda o: (ended.append(o), log.append("end")),
            linger=Linger(1.0),
        )
    assert log == ["end", "linger 1.0 False"]
    assert isinstance(ended[0].error, ClusterError) and ended[0].job is not None and ended[0].summary is None


def test_the_factory_says_which_backends_start_their_own_workers():
    assert owning_kinds() == ["local", "local-pods", "kubernetes", "slurm"]
    assert not BACKENDS["external"].owns_workers


@pytest.mark.parametrize("kind", ["external", "pbs"])
def test_the_runner_job_refuses_a_backend_that_does_not_start_workers(kind):
    from h5ngff.jobspec import KIND, parse_job_spec
    from h5ngff.operator.contract import RunnerContract
    from h5ngff.operator.runner.main import runner_backend

    wire = {"source": {"path": "in.h5", "dataset": "/d"}, "output": {"path": "out.ome.zarr"}}
    spec = parse_job_spec(wire)

    def contract(backend: str) -> RunnerContract:
        return RunnerContract(KIND, "ns", "job", "uid", 1, wire, backend=backend)

    with pytest.raises(SpecError, match=f"to be local, local-pods, kubernetes or slurm .*Got '{kind}' instead"):
        runner_backend(contract(kind), spec)
    # Negative control: a backend that starts its own workers is built.
    assert isinstance(runner_backend(contract("local-pods"), spec), LocalPodsBackend)


def test_the_local_backends_are_two_classes_that_plan_alike(source, tmp_path):
    spec = spec_for(source, str(tmp_path / "out.ome.zarr"), resources={"workers": 2})
    local, pods = LocalBackend(), LocalPodsBackend(pod_limit=1 << 30)
    assert (local.name, pods.name) == ("local", "local-pods")
    assert plan_job(spec, local).plan == plan_job(spec, pods).plan
    assert local.describe(spec, plan_job(spec, local).plan) == Description()


def test_a_budget_beyond_this_machine_is_described(source, tmp_path):
    machine = LocalBackend().capacity().memory_bytes
    spec = spec_for(
        source, str(tmp_path / "out.ome.zarr"), resources={"workers": 2, "memoryPerWorker": f"{machine // 2**20}MiB"}
    )
    (notice,) = LocalPodsBackend().describe(spec, plan_job(spec, LocalPodsBackend()).plan).notices
    assert notice.startswith("resources.memoryPerWorker:") and "is more than this machine's" in notice


def test_the_slurm_backend_describes_its_job_script(source, tmp_path):
    from h5ngff.backends.slurm import SlurmBackend

    backend = SlurmBackend()
    plan = plan_job(spec_for(source, str(tmp_path / "out.ome.zarr"), resources={"workers": 1}), backend).plan
    description = backend.describe(spec_for(source, str(tmp_path / "out.ome.zarr")), plan)
    assert description.job_script == backend.job_script(plan) and description.notices == ()


def test_the_wait_for_workers_returns_stops_on_a_known_failure_and_times_out(shared_cluster):
    with connect(shared_cluster.scheduler_address) as client:
        wait_for_workers(client, 2, 5, lambda have: AssertionError("two workers are there"))  # returns at once
        with pytest.raises(ClusterError, match="pod-0 exited"):
            wait_for_workers(
                client,
                3,
                60,
                lambda have: AssertionError("should not time out"),
                check=_raise(ClusterError("pod-0 exited")),
            )
        t0 = time.monotonic()
        with pytest.raises(ClusterError, match="only 2 of 3"):
            wait_for_workers(client, 3, 0.3, lambda have: ClusterError(f"only {have} of 3"), interval=0.05)
        assert time.monotonic() - t0 < 5


def _raise(exc: BaseException):
    def check() -> None:
        raise exc

    return check


class LateFigures:
    """The shared cluster through the real ExternalBackend, with figures of its own that it reads
    again once its session has closed, as pod emulation and SLURM do (the kernel's last kill
    count, slurmstepd's oom-kill lines): a kill that shows only then."""

    name = "late-figures"

    def __init__(self, address: str):
        self.real = ExternalBackend(address)
        self.reports = {"late": WorkerReport("late")}
        self.during: list[int] = []

    def __getattr__(self, name):
        return getattr(self.real, name)

    @contextmanager
    def session(self, plan: Plan) -> Iterator[Session]:
        try:
            with self.real.session(plan) as session:
                yield replace(session, extra_reports=self.reports)
                self.during.append(self.reports["late"].oom_kills)
        finally:
            self.reports["late"].oom_kills = 2
            self.reports["late"].cgroup_peak = 123 << 20


@pytest.mark.parametrize("fails", [False, True], ids=["succeeds", "fails"])
def test_a_single_run_takes_the_figures_its_backend_reads_after_closing(
    shared_cluster, source, tmp_path, monkeypatch, fails
):
    """The summary's worker reports are copies of the backend's (a batch's items each get their
    own); what the backend reads after its last process stopped still reaches them, on a failure
    that is not a killed worker too."""
    import h5ngff.runner as runner_module
    from h5ngff.errors import SourceError

    backend = LateFigures(shared_cluster.scheduler_address)
    job = plan_job(spec_for(source, str(tmp_path / "out.ome.zarr"), resources={"workers": 1}), backend)
    if fails:

        def broken(*args, **kwargs):
            raise SourceError("a slab could not be read")

        monkeypatch.setattr(runner_module, "run_conversion", broken)
        with pytest.raises(SourceError) as caught:
            run_job(job, backend)
        summary = caught.value.summary
    else:
        summary = run_job(job, backend)
        assert backend.during == [0]  # the kill was not there while the session was open
    (worker,) = summary.workers
    assert (worker.oom_kills, worker.cgroup_peak) == (2, 123 << 20), worker
    assert worker.predicted_peak == job.plan.memory.predicted_peak
    assert backend.reports["late"].predicted_peak == 0  # the backend's own report is not the summary's


def test_final_reports_fall_back_to_the_backends_own_where_collecting_failed():
    """A run whose figures could not be collected (a broken cluster) still reports the backend's
    own, with its plan's figures; where they were collected, each takes the backend's last read."""
    from types import SimpleNamespace

    from h5ngff.runner import final_reports

    plan = SimpleNamespace(memory=SimpleNamespace(predicted_peak=10, memory_limit=20, pod_limit=30))
    pods = {"pod-0": WorkerReport("pod-0", oom_kills=1, cgroup_peak=25)}
    session = Session(None, "local-pods", pods)
    (filled,) = final_reports([], session, plan)
    assert (filled.oom_kills, filled.cgroup_peak, filled.predicted_peak, filled.pod_limit) == (1, 25, 10, 30)
    assert filled is not pods["pod-0"]
    (merged,) = final_reports([WorkerReport("pod-0", peak_rss=7, predicted_peak=10)], session, plan)
    assert (merged.peak_rss, merged.oom_kills, merged.predicted_peak) == (7, 1, 10)
    # Negative control: a backend with no figures of its own leaves an empty list empty.
    assert final_reports([], Session(None, "local"), plan) == []
