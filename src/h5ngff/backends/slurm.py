"""SLURM: dask-jobqueue's ``SLURMCluster``, one worker job per planned worker, sized by the plan.

The scheduler runs in the h5ngff process; every worker is one SLURM job whose script comes from
:func:`~h5ngff.backends.slurmscript.build_job_script` (``--mem`` = the planned pod limit,
``--cpus-per-task`` = threads, the planned ``--memory-limit``, thresholds and allocator). This is
the only module that imports ``dask_jobqueue``, lazily.

What SLURM reports becomes the run's reason:

* jobs still pending after ``slurm.pendingTimeout`` -> ``WorkersPending``, with SLURM's reason;
* a worker killed by its job's memory cgroup (the nanny's cgroup counter while the job runs,
  slurmstepd's "oom-kill event" line in the job's .err once it ends, or ``OUT_OF_MEMORY``) ->
  ``OOMKilled`` with the worker's figures (runner + diagnostics.classify_failure);
* jobs that reached their time limit (``JobState=TIMEOUT``) -> ``WorkersLost`` naming the limit
  and ``slurm.walltime``; jobs cancelled by someone else (``CANCELLED``) -> ``WorkersLost`` saying so;
* sbatch unable to reach slurmctld, or to read its configuration -> ``ClusterError`` quoting SLURM.

Every job of the run is cancelled when the session ends, whatever the outcome: by the session
(success, failure, Ctrl-C) and, should the h5ngff process die without cleaning up, by the reaper
(backends/slurmreaper.py), which cancels the run's jobs by their unique job name.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from typing import Any

import dask
from distributed import Client

from ..errors import (
    ClusterError,
    H5ngffError,
    NannyTerminatedError,
    OOMKilledError,
    WorkerFailedError,
    WorkersLostError,
    WorkersPendingError,
)
from ..planner.model import Capacity, Plan
from ..spec import ConversionSpec, SlurmSpec
from ..units import MiB, format_bytes
from .base import REMOTE_DEFAULT_WORKERS, Description, JobScript, Session, connect, dask_memory_config, wait_for_workers
from .diagnostics import ClusterEvents, WorkerReport, register_plugins
from .slurmctl import (
    NO_CONFIGURATION,
    UNREACHABLE,
    JobState,
    cancel_by_name,
    job_state,
    largest_node_memory,
    oom_events,
    pending_advice,
    queued_ids,
    sbatch_refusal,
    stop_by_name,
)
from .slurmscript import build_job_script, job_mem_mib

log = logging.getLogger(__name__)

#: Seconds to wait for SLURM to take the cancelled jobs out of the queue before giving up.
CANCEL_WAIT = 30
#: Seconds a worker may be gone (restarting after a kill) before its job is given up.
LOST_WORKER_TIMEOUT = 120
#: Seconds the run waits for its workers to read their jobs' cgroups. A worker whose task holds
#: the GIL (a C extension that never releases it) cannot answer, and without a bound the run's
#: end waited for it (about 250 s once); the jobs' .err files still tell the kills.
FIGURES_TIMEOUT = 10


class SlurmBackend:
    """Runs each conversion on worker jobs submitted for the run and cancelled after it."""

    name = "slurm"

    def __init__(
        self,
        settings: SlurmSpec | None = None,
        job_mem: int | None = None,
        default_workers: int = REMOTE_DEFAULT_WORKERS,
    ):
        self.settings = settings or SlurmSpec()
        #: Replaces the planned --mem (experiments and negative controls only).
        self.job_mem = job_mem
        self.default_workers = default_workers
        self.python = self.settings.python or sys.executable

    def capacity(self) -> Capacity:
        # Nodes are SLURM's to find: the plan sizes each job and SLURM schedules it.
        return Capacity(cores=self.default_workers, memory_bytes=1 << 50, default_workers=self.default_workers)

    def fit(self, spec: ConversionSpec) -> ConversionSpec:
        return spec  # each job is sized by the plan: nothing to fit to

    def largest_node_bytes(self) -> int | None:
        """The most memory a node of the partition offers (sinfo), or None where SLURM cannot say."""
        return largest_node_memory(self.settings.partition)

    def job_mem_bytes(self, plan: Plan) -> int:
        """What each worker job asks for: ``--mem`` in whole MiB."""
        return job_mem_mib(self.job_mem or plan.memory.pod_limit) * MiB

    def job_script(self, plan: Plan, job_name: str = "h5ngff-RUN", **names: str) -> JobScript:
        return build_job_script(plan, self.settings, self.python, job_name=job_name, job_mem=self.job_mem, **names)

    def describe(self, spec: ConversionSpec, plan: Plan) -> Description:
        """The worker job's script, and a word where the budget is more than any node has."""
        return Description(
            notices=tuple(filter(None, [self._budget_beyond_nodes(spec, plan)])), job_script=self.job_script(plan)
        )

    def _budget_beyond_nodes(self, spec: ConversionSpec, plan: Plan) -> str | None:
        """On SLURM, --memory-per-worker is the most one job's --mem may be; each job asks for what
        its plan needs. A budget no node has is worth a word (it was accepted in silence), and a
        planned --mem no node has would pend for ever; sinfo is asked only for a budget the user gave."""
        per_job = spec.resources.memory_per_worker_bytes
        if per_job is None:
            return None
        largest = self.largest_node_bytes()
        if largest is None or per_job <= largest:
            return None
        where = f"partition {self.settings.partition}" if self.settings.partition else "this SLURM cluster"
        mem = self.job_mem_bytes(plan)
        fits = "fits a node" if mem <= largest else "fits no node either: the jobs would pend until pendingTimeout"
        return (
            f"resources.memoryPerWorker: {format_bytes(per_job)} is more than any node of {where} offers "
            f"({format_bytes(largest)}, sinfo RealMemory). Each worker job asks for what its plan needs, at most the budget: "
            f"--mem={mem >> 20}M here, which {fits}. Give at most {format_bytes(largest)} per worker."
        )

    @contextmanager
    def session(self, plan: Plan) -> Iterator[Session]:
        job_name = f"h5ngff-{uuid.uuid4().hex[:10]}"
        log_dir = os.path.abspath(os.path.expanduser(self.settings.log_directory))
        os.makedirs(log_dir, exist_ok=True)
        settings = self.settings.model_copy(update={"log_directory": log_dir})
        # The limit SLURM enforces: --mem in whole MiB, rounded up.
        jobs = SlurmJobs(
            plan, job_name, log_dir, job_mem_mib(self.job_mem or plan.memory.pod_limit) * MiB, settings.walltime
        )
        refusal = sbatch_refusal(
            build_job_script(plan, settings, self.python, job_name=job_name, job_mem=self.job_mem).text()
        )
        if refusal:
            raise refusal_error(refusal, jobs.job_mem)
        with ExitStack() as stack:
            stack.enter_context(_reaper(job_name))  # stopped only after the jobs are gone
            stack.callback(jobs.close)  # cancel everything, then read the final figures
            # dask-jobqueue cancels the job of a worker that stays away this long. A worker killed
            # by its job's cgroup is restarted by its nanny in the same job, which takes seconds
            # on a loaded node; cancelling the job would turn an OOM kill into WorkersLost.
            stack.enter_context(dask.config.set({"distributed.deploy.lost-worker-timeout": f"{LOST_WORKER_TIMEOUT}s"}))
            cluster = stack.enter_context(_cluster(plan, settings, self, job_name))
            jobs.cluster = cluster
            # Once the client is closed, nothing of the workers is needed: stop every process of
            # the run's jobs (SIGTERM to each nanny, SIGKILL after STOP_GRACE) before dask-jobqueue
            # cancels them. Cancelling first would send SIGTERM, and a nanny busy restarting its
            # worker holds the job for SLURM's KillWait (30 s by default); a job already
            # cancelling can no longer be signalled. SIGKILL alone left the nannies' semaphores
            # in the node's /dev/shm (slurmctl.stop_by_name).
            stack.callback(stop_by_name, job_name)
            client = stack.enter_context(connect(cluster))
            register_plugins(client)
            cluster.scale(plan.workers)
            jobs.wait_for_workers(client, plan.workers, settings.pending_timeout)
            stack.enter_context(jobs.watching())
            yield SlurmSession(
                client,
                "slurm",
                jobs.reports,
                lambda: jobs.refresh(client),
                jobs.job_mem,
                limit_name="job --mem",
                jobs=jobs,
            )


def refusal_error(refusal: str, job_mem: int) -> ClusterError:
    """sbatch --test-only's refusal as the run's error: SLURM's own words, and advice that fits them."""
    conf = os.environ.get("SLURM_CONF")
    where = f"SLURM_CONF={conf}" if conf else "SLURM_CONF is not set, so /etc/slurm/slurm.conf or DNS SRV records"
    if UNREACHABLE in refusal:
        return ClusterError(
            f"SLURM's controller cannot be reached; sbatch --test-only says: {refusal}. Check that slurmctld is up "
            f"(scontrol ping) and that this machine reads the cluster's configuration ({where})."
        )
    if any(words in refusal for words in NO_CONFIGURATION):
        return ClusterError(
            f"SLURM's commands cannot read their configuration here; sbatch --test-only says: {refusal}. "
            f"Point SLURM_CONF at the cluster's slurm.conf, or run h5ngff on a login node ({where})."
        )
    return ClusterError(
        f"SLURM refuses the worker job script (sbatch --test-only): {refusal}. "
        f"h5ngff plan --backend slurm shows the script; check slurm.partition, slurm.account, slurm.qos and slurm.directives, "
        f"and that --mem={job_mem // MiB}M fits a node of the partition (resources.memoryPerWorker)."
    )


@dataclass
class SlurmSession(Session):
    """A Session whose failures SLURM can explain: a job's time limit, or a cancel by someone else."""

    jobs: "SlurmJobs | None" = None

    def diagnose(
        self, failure: BaseException, events: ClusterEvents, plan: Plan, workers: list[WorkerReport]
    ) -> WorkerFailedError:
        err = super().diagnose(failure, events, plan, workers)
        if isinstance(err, (OOMKilledError, NannyTerminatedError)) or self.jobs is None:
            return err
        lost = self.jobs.lost_error()
        if lost is None:
            return err
        lost.oom_kills, lost.memory_terminations = (
            err.oom_kills,
            err.memory_terminations,
        )  # classify_failure's counts, 0 here
        return lost


def _import_jobqueue() -> Any:
    """dask_jobqueue's SLURMCluster. Importing dask_jobqueue installs a SIGINT handler of its
    own (``sys.exit()``, for its SLURMRunner), which turned a Ctrl-C into exit status 0 with the
    jobs left to their death timeout; the handler that was in place is put back."""
    previous = signal.getsignal(signal.SIGINT)
    from dask_jobqueue import SLURMCluster

    if previous is not None and threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGINT, previous)
    return SLURMCluster


@contextmanager
def _cluster(plan: Plan, settings: SlurmSpec, backend: SlurmBackend, job_name: str) -> Iterator[Any]:
    SLURMCluster = _import_jobqueue()

    def script(worker_name: str, scheduler: str) -> JobScript:
        return build_job_script(
            plan,
            settings,
            backend.python,
            job_name=job_name,
            scheduler=scheduler,
            worker_name=worker_name,
            job_mem=backend.job_mem,
        )

    # The scheduler enforces allowed-failures, so it needs the plan's Dask config too.
    with dask.config.set(dask_memory_config(plan)):
        try:
            cluster = SLURMCluster(
                job_cls=_planned_job_class(),
                h5ngff_script=script,
                name="slurm",
                cores=plan.threads_per_worker,
                processes=1,
                memory=f"{plan.memory.memory_limit}B",
                job_name=job_name,
                log_directory=settings.log_directory,
                walltime=settings.walltime,
                # ":0": a free port (8787 may be taken); the scheduler's HTTP server serves /metrics.
                scheduler_options={"dashboard_address": ":0"},
                silence_logs=logging.ERROR,
            )
        except (OSError, RuntimeError, ValueError) as exc:
            raise ClusterError(f"Could not start the SLURM cluster's scheduler: {exc}") from exc
    try:
        yield cluster
    finally:
        try:
            cluster.close(timeout=CANCEL_WAIT)
        except Exception:  # the jobs are cancelled by name below in any case
            log.debug("SLURMCluster.close failed", exc_info=True)


def _planned_job_class() -> Any:
    """dask-jobqueue's SLURMJob with the script replaced by the plan's (imported lazily)."""
    from dask_jobqueue.slurm import SLURMJob

    class PlannedSLURMJob(SLURMJob):
        def __init__(
            self,
            scheduler: str | None = None,
            name: str | None = None,
            *,
            h5ngff_script: Callable[..., JobScript],
            **kwargs: Any,
        ) -> None:
            untyped_init: Any = super().__init__  # dask-jobqueue is untyped
            untyped_init(scheduler=scheduler, name=name, **kwargs)
            script = h5ngff_script(worker_name=str(name), scheduler=str(scheduler))
            self.shebang = script.shebang
            self.job_header = "\n".join(script.header)
            self._job_script_prologue = [*script.environment, *script.prologue]
            self._command_template = script.command

    return PlannedSLURMJob


@contextmanager
def _reaper(job_name: str) -> Iterator[None]:
    """Start the watcher that cancels the run's jobs if this process dies without doing so."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "h5ngff.backends.slurmreaper", str(os.getpid()), job_name],
        start_new_session=True,
        stdin=subprocess.DEVNULL,
    )
    try:
        yield
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


class SlurmJobs:
    """The run's worker jobs: their states, their .err files and their per-worker reports."""

    def __init__(self, plan: Plan, job_name: str, log_dir: str, job_mem: int, walltime: str = ""):
        self.plan = plan
        self.walltime = walltime
        self.job_name = job_name
        self.log_dir = log_dir
        self.job_mem = job_mem
        self.cluster: Any = None
        self.reports: dict[str, WorkerReport] = {}
        #: worker name -> SLURM job id
        self.job_ids: dict[str, str] = {}
        self.states: dict[str, JobState] = {}
        #: Jobs seen ending while the run watched them: before h5ngff cancelled anything itself.
        self.ended: dict[str, JobState] = {}
        self._stop = threading.Event()

    def _known_jobs(self) -> dict[str, str]:
        for name, job in list(getattr(self.cluster, "workers", {}).items()):
            if getattr(job, "job_id", None):
                self.job_ids[str(name)] = str(job.job_id)
                self.reports.setdefault(
                    str(name),
                    WorkerReport(
                        name=str(name),
                        pod_limit=self.job_mem,
                        memory_limit=self.plan.memory.memory_limit,
                        predicted_peak=self.plan.memory.predicted_peak,
                    ),
                )
        return dict(self.job_ids)

    def wait_for_workers(self, client: Client, n: int, timeout: float) -> None:
        """Until ``n`` workers connected; a job that ends first or pends past ``timeout`` fails the run."""
        states: dict[str, JobState | None] = {}

        def check() -> None:
            states.clear()
            states.update({name: job_state(jid) for name, jid in self._known_jobs().items()})
            ended = {name: s for name, s in states.items() if s is not None and s.finished}
            if ended:
                name, s = next(iter(ended.items()))
                raise self._ended_error(name, s)

        wait_for_workers(
            client, n, timeout, lambda have: self._pending_error(n, have, states, timeout), check, interval=0.5
        )
        self._known_jobs()

    def _pending_error(
        self, n: int, have: int, states: dict[str, JobState | None], timeout: float
    ) -> WorkersPendingError:
        pending = {name: s for name, s in states.items() if s is not None and s.state == "PENDING"}
        reasons = ", ".join(sorted({s.reason for s in pending.values()})) or "not submitted"
        ids = ", ".join(s.job_id for s in pending.values()) or "none"
        advice = "; ".join(
            dict.fromkeys(a for a in map(pending_advice, sorted({s.reason for s in pending.values()})) if a)
        )
        advice = advice or (
            "wait for room (raise slurm.pendingTimeout), choose another slurm.partition or slurm.qos, or plan smaller jobs "
            "(resources.memoryPerWorker, resources.workers)"
        )
        return WorkersPendingError(
            f"WorkersPending: only {have} of {n} worker job(s) started within {timeout:.0f} s; job(s) {ids} still pending, "
            f"SLURM's reason: {reasons}. Each job asks for --mem={self.job_mem // MiB}M and --cpus-per-task={self.plan.threads_per_worker}: "
            f"{advice}.",
            reasons=reasons,
        )

    def _ended_error(self, name: str, s: JobState) -> H5ngffError:
        err = self._err_text(s.job_id).strip().splitlines()[-8:]
        tail = "\n".join(err) or f"(no .err file in {self.log_dir})"
        if s.state == "OUT_OF_MEMORY" or oom_events(self._err_text(s.job_id)):
            return OOMKilledError(
                f"OOMKilled by the kernel (job --mem {self.job_mem // MiB} MiB): worker job {s.job_id} ({name}) was killed by its "
                f"memory cgroup before its worker connected; the nanny and an idle worker alone did not fit (the plan's "
                f"interpreter and nanny terms are {(self.plan.memory.terms[0].bytes + self.plan.memory.pod_terms[1].bytes) // MiB} MiB). "
                f"Raise resources.memoryPerWorker, or drop --slurm-job-mem.",
                worker=name,
            )
        if s.state in ("CANCELLED", "TIMEOUT"):
            return WorkersLostError(
                f"WorkersLost: before its worker connected, worker job {s.job_id} ({name}) {self._ended_words(s)}.",
                worker=name,
            )
        return ClusterError(
            f"Worker job {s.job_id} ({name}) ended {s.state} (exit {s.exit_code}, reason {s.reason}) before its worker "
            f"connected. Last lines of {self._err_path(s.job_id)}:\n{tail}"
        )

    def _ended_words(self, s: JobState) -> str:
        if s.state == "TIMEOUT":
            return (
                f"reached its time limit -t {self.walltime or '?'} (SLURM: JobState=TIMEOUT Reason={s.reason}): raise slurm.walltime "
                f"(--slurm-walltime) so the jobs outlast the conversion; a re-run resumes where this one stopped"
            )
        return (
            f"was cancelled (SLURM: JobState=CANCELLED Reason={s.reason}) by someone other than h5ngff: scancel, an administrator "
            f"or a preemption"
        )

    def lost_error(self) -> WorkersLostError | None:
        """Why the run lost its workers, where SLURM ended their jobs under it (TIMEOUT first)."""
        for name, s in list(self.ended.items()):
            if s.state == "COMPLETING":  # ending before h5ngff cancelled anything: its final state is its own
                self.ended[name] = job_state(s.job_id) or s
        for wanted in ("TIMEOUT", "CANCELLED"):
            hit = {name: s for name, s in self.ended.items() if s.state == wanted}
            if hit:
                ids = ", ".join(f"{s.job_id} ({name})" for name, s in sorted(hit.items()))
                return WorkersLostError(
                    f"WorkersLost: during the run, worker job(s) {ids} {self._ended_words(next(iter(hit.values())))}.",
                    worker=next(iter(hit)),
                )
        return None

    def _err_path(self, job_id: str) -> str:
        return os.path.join(self.log_dir, f"{self.job_name}-{job_id}.err")

    def _err_text(self, job_id: str) -> str:
        try:
            with open(self._err_path(job_id), errors="replace") as f:
                return f.read()
        except OSError:
            return ""

    @contextmanager
    def watching(self) -> Iterator[None]:
        """Record job states during the run (a cancelled or timed-out job explains WorkersLost)."""

        def loop() -> None:
            while not self._stop.wait(2.0):
                self._record()

        thread = threading.Thread(target=loop, name="h5ngff-slurm-jobs", daemon=True)
        thread.start()
        try:
            yield
        finally:
            self._stop.set()
            thread.join(timeout=5)
            self._record()  # the last look before h5ngff kills and cancels the jobs itself

    def _record(self) -> None:
        for name, jid in self._known_jobs().items():
            state = job_state(jid)
            if state is not None:
                self.states[name] = state
                if state.finished or state.state == "COMPLETING":
                    self.ended.setdefault(name, state)

    def refresh(self, client: Client | None = None) -> None:
        """Re-read every job's figures: its cgroup through the worker (while it runs), its .err."""
        self._known_jobs()
        figures = running_job_figures(client) if client is not None else {}
        for name, report in self.reports.items():
            fig = figures.get(name, {})
            if fig.get("limit"):  # the limit SLURM really put on the job's cgroup
                report.pod_limit = fig["limit"]
            if fig.get("max_usage"):
                report.cgroup_peak = max(report.cgroup_peak or 0, fig["max_usage"])
            kills = max(fig.get("oom_kills") or 0, oom_events(self._err_text(self.job_ids.get(name, ""))))
            state = self.states.get(name)
            if state is not None and state.state == "OUT_OF_MEMORY":
                kills = max(kills, 1)
            report.oom_kills = max(report.oom_kills, kills)

    def close(self) -> None:
        """Cancel every job of the run and wait until SLURM has taken them out of the queue; then
        the .err files are complete (slurmstepd writes its oom-kill line as the step ends)."""
        self._known_jobs()
        cancel_by_name(self.job_name)
        deadline = time.monotonic() + CANCEL_WAIT
        while queued_ids(self.job_name) and time.monotonic() < deadline:
            time.sleep(0.25)
        left = queued_ids(self.job_name)
        if left:
            log.warning(
                "SLURM jobs %s of this run are still queued %d s after scancel; cancel them by hand (scancel --name %s).",
                ", ".join(left),
                CANCEL_WAIT,
                self.job_name,
            )
        for name, jid in self.job_ids.items():
            state = job_state(jid)
            if state is not None:
                self.states[name] = state
        self.refresh()


def running_job_figures(client: Client, timeout: float = FIGURES_TIMEOUT) -> dict[str, dict[str, Any]]:
    """Each running worker's ``job_cgroup_figures``, by worker name; none where the workers do not
    answer within ``timeout`` seconds or the cluster is closing (the .err files still tell)."""
    try:
        # Client.sync takes callback_timeout from run's keywords: the wait, not the workers' call.
        answers = client.run(job_cgroup_figures, on_error="ignore", callback_timeout=timeout)
    except Exception:
        return {}
    return {str(v.get("name")): v for v in answers.values() if isinstance(v, dict)}


def job_cgroup_figures(dask_worker: Any = None) -> dict[str, Any]:
    """Runs in a worker: its SLURM job's memory cgroup (v1) limit, peak and OOM kills, read from
    ``/proc/self/cgroup`` up to the ``job_<id>`` directory. Empty where there is none."""
    out: dict[str, Any] = {"name": str(getattr(dask_worker, "name", ""))}
    try:
        with open("/proc/self/cgroup") as f:
            rel = next(line.split(":", 2)[2].strip() for line in f if "memory" in line.split(":")[1].split(","))
    except (OSError, StopIteration, IndexError):
        return out
    own = "/sys/fs/cgroup/memory" + rel
    path = own
    while path.startswith("/sys/fs/cgroup/memory/") and not os.path.basename(path).startswith("job_"):
        path = os.path.dirname(path)
    if not os.path.basename(path).startswith("job_"):
        return out

    def read(directory: str, name: str) -> str:
        with open(os.path.join(directory, name)) as f:
            return f.read()

    try:
        out["limit"] = int(read(path, "memory.limit_in_bytes"))
        out["max_usage"] = int(read(path, "memory.max_usage_in_bytes"))
        # cgroup v1 counts a kill where the killed task lives (the step's task cgroup)
        out["oom_kills"] = max(
            int(line.split()[1])
            for d in {own, path}
            for line in read(d, "memory.oom_control").splitlines()
            if line.startswith("oom_kill ")
        )
    except (OSError, ValueError):
        pass
    return out
