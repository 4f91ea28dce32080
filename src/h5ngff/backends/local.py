"""The embedded default: a Dask cluster on this machine, sized by the plan. Two backends:

* ``LocalBackend`` (``local``, the default): a ``LocalCluster`` of one worker process per planned
  worker, each with the planned ``memory_limit``, threads, Dask thresholds and allocator
  environment.
* ``LocalPodsBackend`` (``local-pods``, ``--enforce-pod-limits``): pod emulation. The scheduler
  runs here and every worker is a ``dask worker`` nanny process with its own memory cgroup limited
  to the planned pod limit, so nanny and worker share one limit exactly as they share a pod on
  Kubernetes.

Both plan against this machine (``MachineBackend``): its cores and memory, and a word where the
memory budget given is more than the machine has.
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, replace
from importlib.machinery import ModuleSpec
from typing import Any, ContextManager, Iterator

import dask
from distributed import Client, LocalCluster

from ..errors import ClusterError
from ..planner.model import Capacity, Plan
from ..spec import ConversionSpec
from ..units import format_bytes
from .allocator import allocator_env
from .base import (
    Description,
    Session,
    connect,
    dask_env,
    dask_memory_config,
    local_cluster,
    machine_capacity,
    wait_for_workers,
)
from .cgroups import MemoryCgroup, PeakMeter, create_pod_cgroup
from .diagnostics import WorkerReport, register_plugins
from .forkserver import environment, worker_start_method
from .interrupts import hold_termination
from .podwatch import PodPeaks, PodWatcher

log = logging.getLogger(__name__)
#: How long pod workers get to connect before the run gives up.
WORKER_START_TIMEOUT = 120


class MachineBackend:
    """What the two backends of this machine share: they plan against its cores and memory and
    start the workers as the plan sizes them."""

    def capacity(self) -> Capacity:
        return machine_capacity()

    def fit(self, spec: ConversionSpec) -> ConversionSpec:
        return spec  # the workers are started as the plan sizes them

    def describe(self, spec: ConversionSpec, plan: Plan) -> Description:
        return Description(notices=tuple(filter(None, [self._memory_beyond_machine(spec, plan)])))

    def _memory_beyond_machine(self, spec: ConversionSpec, plan: Plan) -> str | None:
        """A memory budget this machine does not have: the workers are started as the plan sizes
        them, and the budget given is trusted (only the default, a share of RAM, follows the
        machine), so a budget beyond the RAM is planned as if it were there. Say so; the kernel
        would otherwise say it, mid-run, by killing workers."""
        r = spec.resources
        machine = self.capacity().memory_bytes
        asked = r.memory_total_bytes if r.memory_per_worker_bytes is None else r.memory_per_worker_bytes * plan.workers
        if asked is None or asked <= machine:
            return None
        field = "resources.memoryPerWorker" if r.memory_per_worker_bytes is not None else "resources.memoryTotal"
        given = (
            f"{format_bytes(r.memory_per_worker_bytes)} per worker x {plan.workers} worker(s) = {format_bytes(asked)}"
            if r.memory_per_worker_bytes is not None
            else format_bytes(asked)
        )
        return (
            f"{field}: {given} is more than this machine's {format_bytes(machine)} of memory. The plan takes the budget as given; "
            f"a local run that reaches it is killed by the kernel, not stopped by Dask. Give at most "
            f"{format_bytes(machine // max(1, plan.workers))} per worker here (or leave the budget out: the default is a share of this machine's memory)."
        )


class LocalBackend(MachineBackend):
    """A ``LocalCluster`` sized by the plan."""

    name = "local"

    @contextmanager
    def session(self, plan: Plan) -> Iterator[Session]:
        config = dask_memory_config(plan)
        env = allocator_env(plan.allocator)
        with ExitStack() as stack:
            stack.enter_context(worker_environment(env))
            stack.enter_context(
                dask.config.set(
                    {
                        **config,
                        "distributed.nanny.pre-spawn-environ": env,
                        "distributed.worker.multiprocessing-method": worker_start_method(),
                    }
                )
            )
            stack.enter_context(workers_skip_main_module())
            with ctrl_c_after_start():
                cluster = stack.enter_context(
                    local_cluster(
                        n_workers=plan.workers,
                        threads_per_worker=plan.threads_per_worker,
                        memory_limit=plan.memory.memory_limit,
                        processes=True,
                        # ":0": a free port. The scheduler's HTTP server also serves /metrics.
                        dashboard_address=":0",
                        silence_logs=logging.ERROR,
                    )
                )
                client = stack.enter_context(connect(cluster))
            register_plugins(client)
            yield Session(client, self.name)


class LocalPodsBackend(MachineBackend):
    """Pod emulation: every worker in a memory cgroup of its own at the pod limit."""

    name = "local-pods"

    def __init__(self, pod_limit: int | None = None):
        #: Replaces the planned pod limit (experiments and negative controls).
        self.pod_limit = pod_limit

    @contextmanager
    def session(self, plan: Plan) -> Iterator[Session]:
        with ExitStack() as stack:
            pods = stack.enter_context(
                PodCluster(
                    plan,
                    dask_memory_config(plan),
                    allocator_env(plan.allocator),
                    self.pod_limit or plan.memory.pod_limit,
                )
            )
            client = stack.enter_context(connect(pods.scheduler_address))
            register_plugins(client)
            pods.wait_for_workers(client)
            yield Session(
                client,
                self.name,
                pods.reports,
                pods.refresh,
                pods.pod_limit,
                lambda: list(pods.watcher.timeline),
                take_segment=pods.take_segment,
            )


def worker_environment(env: dict[str, str]) -> ContextManager[None]:
    """The plan's worker variables in ``os.environ`` while the cluster lives, the earlier values
    back afterwards. Dask's nanny reads its pre-spawn variables with the process's own taking
    precedence, and writes them into ``os.environ`` for good: without this, a glibc plan after a
    jemalloc one in the same process started its workers with jemalloc still preloaded. The
    fork server (backends/forkserver.py) starts with this environment."""
    return environment(env)


@contextmanager
def ctrl_c_after_start() -> Iterator[None]:
    """Hold a Ctrl-C that arrives while the cluster starts until it has started, then raise it.

    Dask cannot close a cluster interrupted half-way through its start: the nannies it was
    starting stay in ``Status.init`` and its exit handler fails with a traceback. So SIGINT is
    blocked (not ignored: it stays pending) in this thread while the cluster starts, and delivered
    when it is unblocked, as a KeyboardInterrupt that closes the started cluster cleanly. The
    cluster's own thread, started meanwhile, inherits the blocked mask, and so do the worker
    processes it spawns: a Ctrl-C during their interpreter start-up (before ``worker_main`` runs)
    cannot kill them with a traceback either."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        with hold_termination():  # SIGTERM too (backends/interrupts.py: held, not blocked)
            yield
    finally:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})


@contextmanager
def workers_skip_main_module() -> Iterator[None]:
    """Start worker processes without re-running the caller's ``__main__``.

    Dask's nanny starts workers with multiprocessing's *spawn*, which re-imports the parent's
    main module in every worker (as ``__mp_main__``). A worker's baseline memory would then
    depend on who called h5ngff: the console script adds h5ngff.cli (2-3 MiB), a benchmark
    harness or a notebook helper whatever it imports (pytest added 7 MiB), so the plan's
    interpreter term could not hold for every caller. Slab tasks need nothing from ``__main__``
    (they live in h5ngff.engine), so the main module's spec and path are hidden from spawn for
    as long as the cluster lives: the nanny also spawns replacements for killed workers later.
    Interactive sessions already look like this to spawn (no ``__file__``, no ``__spec__``).

    Spawn runs ``worker_main`` instead: a few lines that make workers ignore SIGINT, so a
    terminal's Ctrl-C is handled by this process alone (it closes the cluster, and so the workers)."""
    main = sys.modules.get("__main__")
    if main is None:
        yield
        return
    hidden: dict[str, Any] = {k: main.__dict__[k] for k in ("__spec__", "__file__") if k in main.__dict__}
    main.__dict__["__spec__"] = ModuleSpec(f"{__package__}.worker_main", None)
    main.__dict__.pop("__file__", None)
    try:
        yield
    finally:
        main.__dict__.pop("__spec__", None)
        main.__dict__.update(hidden)


@dataclass
class Pod:
    index: int
    name: str
    process: subprocess.Popen[bytes]
    cgroup: MemoryCgroup
    log_path: str


class PodCluster:
    """A scheduler in this process and one cgroup-limited nanny+worker process per planned worker."""

    def __init__(self, plan: Plan, config: dict[str, Any], env: dict[str, str], pod_limit: int):
        self.plan = plan
        self.config = config
        self.env = env
        self.pod_limit = pod_limit
        self.pods: list[Pod] = []
        self.reports: dict[str, WorkerReport] = {}
        #: Each pod's non-reclaimable memory and its worker's VmHWM, sampled every 25 ms.
        self.watcher = PodWatcher()
        #: Each pod's cgroup high-water mark, whole and in segments (``take_segment``).
        self.meters: dict[str, PeakMeter] = {}
        #: Each pod's report when its current segment began (its counts run from the pod's start).
        self._counted: dict[str, WorkerReport] = {}
        #: ``refresh`` and ``take_segment`` run from the pollers', the batch items' and the
        #: batch's own threads: one at a time, so a segment's baseline counts (``_counted``) and
        #: each meter's read-then-reset pair are never interleaved, nor a meter closed under them.
        self._reading = threading.Lock()
        self._scheduler: LocalCluster | None = None
        self._dir: str | None = None  # made by __enter__, removed or kept by __exit__
        self._token = uuid.uuid4().hex[:8]
        self._closing = threading.Event()
        self._supervisor = threading.Thread(target=self._supervise, name="h5ngff-pod-supervisor", daemon=True)

    @property
    def scheduler_address(self) -> str:
        assert self._scheduler is not None
        return self._scheduler.scheduler_address

    def __enter__(self) -> "PodCluster":
        try:
            self._dir = tempfile.mkdtemp(prefix="h5ngff-pods-")
            with dask.config.set(self.config):
                self._scheduler = local_cluster(
                    n_workers=0, processes=True, dashboard_address=":0", silence_logs=logging.ERROR
                )
            for i in range(self.plan.workers):
                self.pods.append(self._start_pod(i))
        except BaseException:  # a Ctrl-C too: pods, cgroups and the directory must not outlive it
            self.__exit__(*sys.exc_info())
            raise
        self.watcher.start()
        self._supervisor.start()
        return self

    def _supervise(self) -> None:
        """Restart a pod whose nanny died, as kubelet restarts a container (with back-off). The
        kernel may OOM-kill the nanny too, not only its worker; without this the cluster would
        shrink for good."""
        while not self._closing.wait(0.5):
            for i, pod in enumerate(self.pods):
                if pod.process.poll() is None or self._closing.is_set():
                    continue
                report = self.reports[pod.name]
                delay = min(10.0, 0.5 * 2**report.pod_restarts)
                log.warning("Pod %s exited (%s); restarting it in %.1f s.", pod.name, pod.process.returncode, delay)
                if self._closing.wait(delay):
                    return
                report.pod_restarts += 1
                self.pods[i] = self._start_pod(pod.index, pod.cgroup)

    def _start_pod(self, index: int, group: MemoryCgroup | None = None) -> Pod:
        name = f"pod-{index}"
        group = group or create_pod_cgroup(f"h5ngff-{self._token}-{name}", self.pod_limit)
        if name not in self.meters:  # a restarted pod keeps its cgroup, and so its meter
            self.meters[name] = PeakMeter(group)
        assert self._dir is not None, "pods start inside __enter__"
        log_path = os.path.join(self._dir, f"{name}.log")
        env = {**os.environ, **self.env, **dask_env(self.config)}
        cmd = [
            sys.executable,
            "-m",
            "distributed.cli.dask_worker",
            self.scheduler_address,
            "--name",
            name,
            "--nthreads",
            str(self.plan.threads_per_worker),
            "--nworkers",
            "1",
            "--memory-limit",
            str(self.plan.memory.memory_limit),
            "--nanny",
            "--no-dashboard",
            "--local-directory",
            os.path.join(self._dir, name),
            "--death-timeout",
            "60",
        ]
        cgroup_procs = os.path.join(group.path, "cgroup.procs")

        def enter_cgroup() -> None:  # runs in the child between fork and exec
            with open(cgroup_procs, "w") as f:
                f.write(str(os.getpid()))

        with open(log_path, "ab") as log_file:
            process = subprocess.Popen(
                cmd, env=env, stdout=log_file, stderr=subprocess.STDOUT, preexec_fn=enter_cgroup, start_new_session=True
            )
        self.reports.setdefault(
            name,
            WorkerReport(
                name=name,
                pod_limit=self.pod_limit,
                memory_limit=self.plan.memory.memory_limit,
                predicted_peak=self.plan.memory.predicted_peak,
            ),
        )
        self.watcher.watch(name, group, process.pid)
        return Pod(index, name, process, group, log_path)

    def wait_for_workers(self, client: Client) -> None:
        def refuse(dead: Pod | None = None) -> ClusterError:
            tail = self._log_tail(dead or self.pods[0])
            return ClusterError(
                f"Pod-emulated workers did not start (pod limit {self.pod_limit >> 20} MiB). Last log lines:\n{tail}"
            )

        def check() -> None:
            dead = next((p for p in self.pods if p.process.poll() is not None), None)
            if dead is not None:
                raise refuse(dead)

        wait_for_workers(client, len(self.pods), WORKER_START_TIMEOUT, lambda have: refuse(), check, interval=0.1)

    def refresh(self) -> None:
        with self._reading:
            self._refresh()

    def _refresh(self) -> None:
        peaks = self.watcher.peaks
        for pod in self.pods:
            report = self.reports[pod.name]
            try:
                report.cgroup_peak = self.meters[pod.name].total()
                report.oom_kills = max(report.oom_kills, pod.cgroup.oom_kills())
            except OSError:
                pass
            if pod.name in peaks:
                p = peaks[pod.name]
                report.peak_rss = max(report.peak_rss, p.worker_hwm)
                for key, value in p.report_fields().items():
                    setattr(report, key, value)
            text = self._log_text(pod)  # append-only while the run lasts: a count never falls
            report.nanny_restarts = max(report.nanny_restarts, text.count("Restarting worker"))
            report.memory_terminations = max(report.memory_terminations, text.count("memory budget. Restarting"))

    def take_segment(self) -> dict[str, WorkerReport]:
        """Each pod's figures since the last call (or since the pods started), and a new segment
        from now: the peaks the watcher and the kernel saw in it and the kills, restarts and
        terminations counted in it. A batch charges each item with the segments it ran in
        (batch/run.py); ``reports`` stay the whole session's."""
        with self._reading:
            return self._take_segment()

    def _take_segment(self) -> dict[str, WorkerReport]:
        segments = self.watcher.take_segment()
        self._refresh()
        out = {}
        for pod in self.pods:
            total = self.reports[pod.name]
            before, self._counted[pod.name] = self._counted.get(pod.name), replace(total)
            p = segments.get(pod.name) or PodPeaks()
            try:
                cgroup_peak = self.meters[pod.name].take_segment()
            except OSError:  # the cgroup is going
                cgroup_peak = total.cgroup_peak
            segment = replace(total, peak_rss=p.worker_hwm, cgroup_peak=cgroup_peak, **p.report_fields())
            out[pod.name] = segment.counted_since(before)
        return out

    def _log_text(self, pod: Pod) -> str:
        try:
            with open(pod.log_path, errors="replace") as f:
                return f.read()
        except OSError:
            return ""

    def _log_tail(self, pod: Pod, lines: int = 15) -> str:
        return "\n".join(self._log_text(pod).splitlines()[-lines:])

    def __exit__(self, *exc: object) -> None:
        self._closing.set()
        if self._supervisor.is_alive():
            self._supervisor.join(timeout=15)
        self.refresh() if self.pods else None
        for pod in self.pods:
            _signal_group(pod.process, signal.SIGTERM)
        deadline = time.time() + 10
        for pod in self.pods:
            try:
                pod.process.wait(timeout=max(0.1, deadline - time.time()))
            except subprocess.TimeoutExpired:
                _signal_group(pod.process, signal.SIGKILL)
                pod.process.wait()
        for pod in self.pods:
            for pid in pod.cgroup.pids():  # stragglers (grandchildren) must go before rmdir
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        # The final figures, once nothing runs any more: the kill count and peaks the run reports
        # are these, read while the cgroups still exist.
        self.watcher.stop()
        self.refresh() if self.pods else None
        with self._reading:  # a batch's item thread may still be taking a segment
            for meter in self.meters.values():
                meter.close()
        for pod in self.pods:
            pod.cgroup.remove()
        if self._scheduler is not None:
            self._scheduler.close()
            self._scheduler = None
        self._remove_directory(troubled=exc[0] is not None)

    def _remove_directory(self, troubled: bool) -> None:
        """The pods' logs and Dask's local directories, in the system's temporary directory:
        removed after a clean session, kept (and named) where a pod was killed, restarted or
        terminated or the session failed, for whoever looks into it. Every run left them before."""
        if self._dir is None:
            return
        troubled = troubled or any(
            r.oom_kills or r.nanny_restarts or r.memory_terminations or r.pod_restarts for r in self.reports.values()
        )
        if troubled:
            log.warning("The emulated pods' logs are kept in %s.", self._dir)
        else:
            shutil.rmtree(self._dir, ignore_errors=True)


def _signal_group(process: subprocess.Popen[bytes], sig: int) -> None:
    try:
        os.killpg(process.pid, sig)
    except ProcessLookupError:
        pass
