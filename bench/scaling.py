"""Where a conversion's CPU and wall time go outside the slab tasks, for machines too small to
show the 16-core wall times (2 cores here): CPU-seconds of every process, the fixed cost before
the first task and after the last, and the tail of the task list on N workers.

    PYTHONPATH=src .venv/bin/python -m bench.scaling --scale 0.25 --workers 2,8,16 [--repeat 1] \
        [--case f32] [--levels 1] [--tail-workers 2,16,64,256] [--result out.json]

Per round: the limit (``bench.limit``, one core, in this process: its ``cpu_seconds``), then one
``h5ngff convert … --json --workers W`` per W, each in its own process group through
``bench.scaling_client`` (the console script's ``cli.main`` with timestamps and a task recorder
attached from outside; nothing in h5ngff changes). Every output is verified (``bench.verify``)
and deleted. ``BENCH_SCALING_ARGS`` adds arguments to every such command (``--threads 2`` with
``--workers 1``: one worker with two threads instead of two with one).

1. **CPU-seconds**, every process the command starts. Exact totals from the kernel: this
   process is made a child subreaper (``PR_SET_CHILD_SUBREAPER``), so a descendant orphaned by
   the client's exit is adopted here, waited for and counted; ``getrusage(RUSAGE_CHILDREN)`` of
   this process, before and after, is then the whole tree's CPU. ``wait4`` of the client gives
   the client plus the descendants it waited for, and the client's own ``getrusage`` when its
   ``main`` returns splits that into the client (self) and its waited-for children (the workers).
   Per process, ``psutil`` polls every descendant's ``cpu_times`` (and the client's threads')
   every ``--interval`` seconds until it exits: those sampled figures give the split by kind
   (client main thread / event-loop thread, which runs the scheduler, the nannies and the
   client's comms / other threads; workers; other processes such as multiprocessing's resource
   tracker) and the CPU spent up to a moment (for the fixed costs); what a process spent after its
   last poll shows as the difference to the exact totals.
2. **Fixed cost**: from the command's start (just before ``fork``) to the first slab task
   running (the worker's ``compute`` start, the earliest over all tasks), and from the last
   task's end (the latest ``compute`` stop) to the client process's exit (``wait4`` returned), in
   wall seconds and CPU-seconds, split at the client's timestamps (planned, cluster up, slabs
   back, cluster closed, metadata written, ``main`` returned).
3. **The tail**: the measured task times (compute stop - start) in the submitted order (the
   order the scheduler first saw the keys), list-scheduled on N workers (``makespan``), against
   total / N; also largest-first. The same simulation on the run's own worker count is set
   against the span the run measured (first start to last stop) as a check of the model. On an
   oversubscribed machine (W workers > cores) the task times include waiting for a core: the
   run with the fewest workers gives the task times nearest their cost on a core of their own.
"""

from __future__ import annotations

import argparse
import bisect
import ctypes
import heapq
import json
import os
import resource
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, Iterable, Sequence

import psutil

from .config import BENCH_DIR, CODEC, REPO_DIR, available_cores, build_cases, scale_tag
from .data import ensure_input, warm_page_cache
from .limit import measure_limit

# ---------------------------------------------------------------------------------------------
# 3. The tail: pure functions.


def makespan(durations: Sequence[float], workers: int, ready: Sequence[float] | None = None) -> float:
    """List scheduling: tasks taken in the given order, each by the worker that is free first
    (ties: any, the makespan does not depend on which). Returns when the last task ends.
    ``ready``: when each worker can take its first task (default: all at 0)."""
    if workers < 1:
        raise ValueError(f"Expected at least 1 worker. Got {workers} instead.")
    if ready is not None and len(ready) != workers:
        raise ValueError(f"Expected one ready time per worker ({workers}). Got {len(ready)} instead.")
    free = list(ready) if ready is not None else [0.0] * min(workers, len(durations))
    heapq.heapify(free)
    end = 0.0
    for d in durations:
        t = heapq.heappop(free) + d
        end = max(end, t)
        heapq.heappush(free, t)
    return end


def makespan_passes(
    tasks: Sequence[tuple[int, float]], workers: int, order: str = "submitted", ready: Sequence[float] | None = None
) -> float:
    """``tasks``: (pass index, seconds) in the submitted order. Passes run one after another (a
    pass reads the level the one before wrote), each list-scheduled on ``workers``; ``order``
    "largest-first" sorts each pass's tasks by time, longest first. ``ready``: when each worker
    can take its first task, for the first pass."""
    if order not in ("submitted", "largest-first"):
        raise ValueError(f"Expected order 'submitted' or 'largest-first'. Got {order!r} instead.")
    passes: dict[int, list[float]] = defaultdict(list)
    for index, seconds in tasks:
        passes[index].append(seconds)
    total = 0.0
    for number, index in enumerate(sorted(passes)):
        durations = passes[index]
        if order == "largest-first":
            durations = sorted(durations, reverse=True)
        total += makespan(durations, workers, ready if number == 0 else None)
    return total


def tail_rows(tasks: Sequence[tuple[int, float]], worker_counts: Iterable[int]) -> list[dict[str, float]]:
    """Per N: total / N (perfect balance), the longest task, and the makespans in both orders."""
    seconds = [s for _, s in tasks]
    total = sum(seconds)
    longest = max(seconds, default=0.0)
    rows = []
    for n in worker_counts:
        ideal = total / n
        submitted = makespan_passes(tasks, n, "submitted")
        largest = makespan_passes(tasks, n, "largest-first")
        rows.append(
            {
                "workers": n,
                "ideal": ideal,
                "longest": longest,
                "submitted": submitted,
                "largest_first": largest,
                "submitted_x": submitted / ideal if ideal else 0.0,
                "largest_first_x": largest / ideal if ideal else 0.0,
            }
        )
    return rows


# ---------------------------------------------------------------------------------------------
# 1. Process accounting.


def _cpu(times: Any) -> float:
    return float(times.user + times.system)


#: In the command line of multiprocessing's fork server and of every process forked from it.
FORK_SERVER = "multiprocessing.forkserver import main"


def _kind(proc: psutil.Process, client_pid: int, nannies: set[int]) -> str:
    """client, worker, nanny (only with --enforce-pod-limits: in a LocalCluster the nannies run
    in the client process), other; "pending" for a child forked but not yet exec'd (it still
    shows its parent's command line): asked again at the next poll."""
    if proc.pid == client_pid:
        return "client"
    try:
        cmdline = proc.cmdline()
        parent = proc.ppid()
        if FORK_SERVER in " ".join(cmdline):
            # The local backend's fork server (a child of the client) imports Dask once for every
            # worker, and each worker is a fork of it with its command line: both count as workers.
            return "worker"
        if cmdline == psutil.Process(parent).cmdline():
            return "pending"
    except psutil.Error:
        return "other"
    cmd = " ".join(cmdline)
    if "resource_tracker" in cmd:
        return "other"
    if "dask_worker" in cmd or "dask-worker" in cmd:
        nannies.add(proc.pid)
        return "nanny"
    if "spawn_main" in cmd and (parent == client_pid or parent in nannies):
        return "worker"  # spawned by a nanny (in the client process, or a nanny process)
    return "other"


@dataclass
class ProcRecord:
    pid: int
    kind: str
    command: str
    ppid: int
    created: float
    cpu: float = 0.0  # user + system at the last poll
    last_poll: float = 0.0


@dataclass
class Series:
    """Cumulative CPU per kind at each poll (exited processes at their last polled value)."""

    times: list[float] = field(default_factory=list)
    cpu: list[dict[str, float]] = field(default_factory=list)

    def at(self, t: float, kind: str | None = None) -> float:
        """CPU up to ``t`` (linear between polls; 0 before the first)."""

        def value(i: int) -> float:
            row = self.cpu[i]
            return sum(row.values()) if kind is None else row.get(kind, 0.0)

        if not self.times or t <= self.times[0]:
            return value(0) if self.times else 0.0
        i = bisect.bisect_right(self.times, t)
        if i >= len(self.times):
            return value(len(self.times) - 1)
        t0, t1 = self.times[i - 1], self.times[i]
        v0, v1 = value(i - 1), value(i)
        return v0 + (v1 - v0) * (t - t0) / (t1 - t0) if t1 > t0 else v1


class Accountant(threading.Thread):
    """Polls every descendant of this process (the client, its workers, adopted orphans)."""

    def __init__(self, client_pid: int, interval: float, launched: float):
        super().__init__(daemon=True, name="bench-scaling-accountant")
        self.client_pid = client_pid
        self.interval = interval
        self.procs: dict[int, ProcRecord] = {}
        self.threads: dict[int, float] = {}  # client thread id -> user + system at the last poll
        self.series = Series([launched], [{}])  # nothing has run before the launch
        self.nannies: set[int] = set()
        self._handles: dict[int, psutil.Process] = {}
        self._halt = threading.Event()
        self._me = psutil.Process()

    def stop(self) -> None:
        self._halt.set()
        self.join()
        self.poll()  # once more: nothing is left running, the last values stand
        for record in self.procs.values():
            if record.kind == "pending":
                record.kind = "other"  # forked and never exec'd

    def run(self) -> None:
        while not self._halt.is_set():
            self.poll()
            self._halt.wait(self.interval)

    def poll(self) -> None:
        try:
            found = self._me.children(recursive=True)
        except psutil.Error:
            found = []
        for proc in found:
            if proc.pid not in self._handles:
                try:
                    record = ProcRecord(
                        proc.pid,
                        _kind(proc, self.client_pid, self.nannies),
                        " ".join(proc.cmdline()[:8])[:200],
                        proc.ppid(),
                        proc.create_time(),
                    )
                except psutil.Error:
                    continue
                self._handles[proc.pid] = proc
                self.procs[proc.pid] = record
        now = time.time()
        for pid, proc in list(self._handles.items()):
            record = self.procs[pid]
            try:
                if record.kind == "pending":
                    record.kind = _kind(proc, self.client_pid, self.nannies)
                    record.command = " ".join(proc.cmdline()[:8])[:200]
                with proc.oneshot():
                    # A zombie (exited, not yet waited for) still shows its final CPU times.
                    record.cpu = max(record.cpu, _cpu(proc.cpu_times()))
                    record.last_poll = now
                    if proc.status() == psutil.STATUS_ZOMBIE:
                        raise psutil.NoSuchProcess(pid)
                    if pid == self.client_pid:
                        for t in proc.threads():
                            self.threads[t.id] = max(self.threads.get(t.id, 0.0), t.user_time + t.system_time)
            except psutil.Error:
                del self._handles[pid]  # exited: its last polled value stands
        row: dict[str, float] = defaultdict(float)
        for record in self.procs.values():
            row[record.kind] += record.cpu
        self.series.times.append(now)
        self.series.cpu.append(dict(row))


def _set_subreaper() -> bool:
    """Orphans of the client (a helper it did not wait for) are re-parented here instead of to
    init, so they are waited for and their CPU counted. Linux only."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(36, 1, 0, 0, 0) == 0  # PR_SET_CHILD_SUBREAPER
    except (OSError, AttributeError):
        return False


def _children_cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


@dataclass
class Launched:
    returncode: int
    launched: float
    exited: float
    timed_out: bool
    client_wait4_cpu: float  # the client plus every descendant it waited for
    tree_cpu: float  # every process of the run (RUSAGE_CHILDREN of this process, before and after)
    strays: list[str]
    accountant: Accountant


# ---------------------------------------------------------------------------------------------
# One conversion, measured.


def derive(r: dict[str, Any], tail_ns: Sequence[int]) -> None:
    """The tail's figures of one run, from its recorded tasks (also for --from-json)."""
    tasks = list(zip(r["task_passes"], r["task_seconds"]))
    r["tail_rows"] = tail_rows(tasks, tail_ns)
    r["model_check"] = makespan_passes(tasks, r["workers"])
    ready = _worker_ready(r["tasks"])
    r["model_check_ready"] = makespan_passes(tasks, len(ready), ready=ready) if ready else None
    r["worker_ready"] = ready
    r["idle"] = worker_idle(r["tasks"], r["workers"])


def worker_idle(tasks: Sequence[dict[str, Any]], workers: int) -> dict[str, float]:
    """Worker-seconds of the span (first task start to last task end) x workers that ran no task:
    before a worker's first task (start-up skew), between its tasks (waiting for the next), after
    its last (the tail), and whole spans of workers that never ran a task."""
    per: dict[str, list[tuple[float, float]]] = defaultdict(list)
    for t in tasks:
        per[t["worker"]].append((t["start"], t["stop"]))
    if not per:
        return {}
    first = min(a for spans in per.values() for a, _ in spans)
    last = max(b for spans in per.values() for _, b in spans)
    out = {
        "span_x_workers": (last - first) * workers,
        "busy": 0.0,
        "before_first": 0.0,
        "between": 0.0,
        "after_last": 0.0,
        "never_ran": (last - first) * max(0, workers - len(per)),
    }
    for spans in per.values():
        spans.sort()
        out["busy"] += sum(b - a for a, b in spans)
        out["before_first"] += spans[0][0] - first
        out["between"] += sum(max(0.0, spans[i + 1][0] - spans[i][1]) for i in range(len(spans) - 1))
        out["after_last"] += last - spans[-1][1]
    return out


def _worker_ready(tasks: Sequence[dict[str, Any]]) -> list[float]:
    """Each worker's first task start, from the run's first (workers that ran no task: left out)."""
    first: dict[str, float] = {}
    for t in tasks:
        first[t["worker"]] = min(first.get(t["worker"], t["start"]), t["start"])
    origin = min(first.values(), default=0.0)
    return sorted(v - origin for v in first.values())


def _pass_of(key: str) -> int:
    # h5ngff.engine.write.tasks.SlabTask.key: "h5ngff-slab-p{pass}-{i.j.k}-{token}"
    try:
        return int(key.split("-p", 1)[1].split("-", 1)[0])
    except (IndexError, ValueError):
        return 0


def convert_argv(
    source: str, dataset: str, out: str, workers: int, levels: int, chunks: Sequence[int], record: str
) -> list[str]:
    argv = [
        sys.executable,
        "-m",
        "bench.scaling_client",
        record,
        "convert",
        f"{source}:{dataset}",
        out,
        "--json",
        "--no-progress",
        "--chunks",
        ",".join(map(str, chunks)),
        "--compressor",
        f"{CODEC['cname']}:{CODEC['clevel']}:{CODEC['shuffle']}",
        "--levels",
        str(levels),
        "--workers",
        str(workers),
    ]
    if levels > 1:
        argv += ["--downsample", "mean"]
    argv += shlex.split(os.environ.get("BENCH_SCALING_ARGS", ""))
    return argv


def analyse(launched: Launched, record: dict[str, Any], summary: dict[str, Any]) -> dict[str, Any]:
    """Everything the tables show, from one run's accountant, client record and --json summary."""
    acct = launched.accountant
    marks = dict(record.get("marks", {}))
    tasks = sorted((t for t in record.get("tasks", []) if t.get("start") is not None), key=lambda t: t["submitted"])
    first = min(t["start"] for t in tasks) if tasks else float("nan")
    last = max(t["stop"] for t in tasks) if tasks else float("nan")
    t0, t_exit = launched.launched, launched.exited

    # Exact (kernel) figures: the tree, the client with its waited-for children, the split of
    # that at main's return.
    self_at_main = sum(record.get("rusage_self", {}).values())
    children_at_main = sum(record.get("rusage_children", {}).values())
    # client_self and workers_waited: the client's getrusage when its main returned;
    # teardown_and_strays: the rest (interpreter teardown, descendants waited for later or adopted).
    # Workers forked from the fork server are its children, not the client's: the server (with
    # them) is waited for by this tool after the client has exited, so their exact CPU is the
    # tree's less what the client waited for.
    forked = any(FORK_SERVER in p.command for p in acct.procs.values())
    workers_exact = launched.tree_cpu - launched.client_wait4_cpu if forked else children_at_main
    exact = {
        "tree": launched.tree_cpu,
        "client_and_waited": launched.client_wait4_cpu,
        "client_self": self_at_main,
        "workers_waited": workers_exact,
        "teardown_and_strays": launched.tree_cpu - self_at_main - workers_exact,
    }
    # Sampled per kind (each process up to its last poll) and per client thread.
    by_kind: dict[str, float] = defaultdict(float)
    count: dict[str, int] = defaultdict(int)
    for p in acct.procs.values():
        by_kind[p.kind] += p.cpu
        count[p.kind] += 1
    names = record.get("threads", {})
    by_thread: dict[str, float] = defaultdict(float)
    for tid, cpu in acct.threads.items():
        name = names.get(str(tid), "")
        group = (
            "main thread (planning, driver loop, manifest, metadata)"
            if name == "MainThread"
            else "event-loop thread (scheduler, nannies, client comms)"
            if name == "IO loop"
            else "other named threads"
            if name
            else "threads not named (ended before a mark)"
        )
        by_thread[group] += cpu
    sampled_total = sum(by_kind.values())

    def window(a: float, b: float, kind: str | None = None) -> float:
        return acct.series.at(b, kind) - acct.series.at(a, kind)

    # Phases, in time order: command start -> ... -> exit.
    order = [
        "launched",
        "main",
        "cli_imported",
        "planned",
        "cluster_up",
        "first_task_start",
        "last_task_end",
        "slabs_done",
        "cluster_closed",
        "metadata_written",
        "main_returned",
        "exited",
    ]
    stamps = {**marks, "launched": t0, "first_task_start": first, "last_task_end": last, "exited": t_exit}
    present = [m for m in order if m in stamps and stamps[m] == stamps[m]]
    phases = []
    for a, b in zip(present, present[1:]):
        ta, tb = stamps[a], stamps[b]
        phases.append(
            {
                "from": a,
                "to": b,
                "wall": tb - ta,
                "cpu": window(ta, tb),
                "cpu_client": window(ta, tb, "client"),
                "cpu_workers": window(ta, tb, "worker"),
            }
        )
    # The fixed costs. The tail's CPU ends at the exact tree total (what a process spent after
    # its last poll is in it); the head's ends at a poll-interpolated figure.
    head = {
        "wall": first - t0,
        "cpu": acct.series.at(first),
        "cpu_client": acct.series.at(first, "client"),
        "cpu_workers": acct.series.at(first, "worker"),
    }
    tail = {
        "wall": t_exit - last,
        "cpu": launched.tree_cpu - acct.series.at(last),
        "cpu_client": (launched.client_wait4_cpu - children_at_main) - acct.series.at(last, "client"),
        "cpu_workers": workers_exact - acct.series.at(last, "worker"),
    }
    durations = [(_pass_of(t["key"]), t["stop"] - t["start"]) for t in tasks]
    return {
        "wall": t_exit - t0,
        "returncode": launched.returncode,
        "timed_out": launched.timed_out,
        "strays": launched.strays,
        "cpu_exact": exact,
        "cpu_sampled_by_kind": dict(by_kind),
        "processes_by_kind": dict(count),
        "cpu_sampled_total": sampled_total,
        "cpu_client_threads_sampled": dict(by_thread),
        "stamps": stamps,
        "phases": phases,
        "head": head,
        "tail": tail,
        "tasks": tasks,
        "task_seconds": [d for _, d in durations],
        "task_passes": [p for p, _ in durations],
        "span": last - first,
        "in_tasks_cpu_window": window(first, last),
        "summary": {
            k: summary.get(k)
            for k in ("status", "seconds", "slabs_written", "stage_seconds", "bytes_read", "bytes_written")
        },
        "plan": {
            k: (summary.get("plan") or {}).get(k) for k in ("workers", "n_tasks", "inflight_per_worker", "passes")
        },
        "worker_peaks": [w.get("peak_rss") for w in summary.get("workers", [])],
        # A worker the nanny restarted (a loaded machine's missed heartbeat) is one more process.
        "worker_restarts": sum(int(w.get("nanny_restarts") or 0) for w in summary.get("workers", [])),
        "processes": [
            {
                "pid": p.pid,
                "kind": p.kind,
                "ppid": p.ppid,
                "cpu_sampled": p.cpu,
                "created": p.created,
                "last_poll": p.last_poll,
                "command": p.command,
            }
            for p in acct.procs.values()
        ],
    }


def run_one(
    case, source: str, workers: int, levels: int, work: str, logs: str, timeout: float, interval: float, do_verify: bool
) -> dict[str, Any]:
    tag = f"{case.name}-w{workers}-l{levels}-{time.strftime('%H%M%S')}"
    out = os.path.join(work, f"{tag}.ome.zarr")
    record_path = os.path.join(work, f"{tag}.record.json")
    log_path = os.path.join(logs, f"{tag}.log")
    summary_path = os.path.join(work, f"{tag}.summary.json")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.path.join(REPO_DIR, "src"), REPO_DIR])}
    warm_page_cache(source)
    argv = convert_argv(source, case.dataset, out, workers, levels, case.chunks, record_path)
    # stdout is the --json summary; stderr (warnings) goes to the log.
    with open(summary_path, "wb") as stdout_file:
        launched = launch(argv, env, stdout_file, log_path, timeout, interval)
    try:
        with open(record_path) as f:
            record = json.load(f)
    except (OSError, ValueError):
        record = {}
    try:
        with open(summary_path) as f:
            summary = json.load(f)
    except (OSError, ValueError):
        summary = {}
    result = analyse(launched, record, summary)
    result.update(workers=workers, levels=levels, command=" ".join(argv[argv.index("convert") :]), log=log_path)
    if do_verify and launched.returncode == 0:
        from .verify import verify

        verdict = verify(out, source, case, levels, "mean")
        result["verified"] = {"ok": verdict.ok, "text": verdict.message}
    shutil.rmtree(out, ignore_errors=True)
    subprocess.run(["sync"], check=False)
    return result


def launch(
    argv: list[str], env: dict[str, str], stdout_file, log_path: str, timeout: float, interval: float
) -> Launched:
    """Run ``argv`` in its own session (stdout to ``stdout_file``, stderr to ``log_path``) and
    account for the CPU of every process it starts."""
    before = _children_cpu()
    with open(log_path, "ab") as log:
        launched = time.time()
        proc = subprocess.Popen(argv, stdout=stdout_file, stderr=log, env=env, start_new_session=True, cwd=REPO_DIR)
    return _account(proc, launched, before, timeout, interval)


def _account(proc: subprocess.Popen, launched: float, before: float, timeout: float, interval: float) -> Launched:
    accountant = Accountant(proc.pid, interval, launched)
    accountant.start()
    timed_out = threading.Event()

    def kill() -> None:
        timed_out.set()
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass

    timer = threading.Timer(timeout, kill)
    timer.start()
    _, status, usage = os.wait4(proc.pid, 0)  # blocking: the exit time is exact
    exited = time.time()
    timer.cancel()
    proc.returncode = os.waitstatus_to_exitcode(status)
    # Adopted orphans (this process is their subreaper) and anything else left: a grace period to
    # exit on their own, then killed; either way waited for, so RUSAGE_CHILDREN includes them.
    strays = psutil.Process().children(recursive=True)
    names = []
    for p in strays:
        try:
            names.append(" ".join(p.cmdline()[:6])[:120])
        except psutil.Error:
            names.append(str(p.pid))
    _, alive = psutil.wait_procs(strays, timeout=5.0)
    for p in alive:
        try:
            p.kill()
        except psutil.Error:
            pass
    psutil.wait_procs(alive, timeout=5.0)
    accountant.stop()
    return Launched(
        proc.returncode,
        launched,
        exited,
        timed_out.is_set(),
        usage.ru_utime + usage.ru_stime,
        _children_cpu() - before,
        names,
        accountant,
    )


# ---------------------------------------------------------------------------------------------
# Report.


def _f(v: float | None, digits: int = 2) -> str:
    return "-" if v is None or v != v else f"{v:.{digits}f}"


def paired_ratio(run: dict[str, Any], limits: list[dict[str, Any]]) -> float | None:
    """The run's whole-tree CPU against the limit measured in its own round, just before the
    round's runs. This machine's speed drifts by 10-20 % within minutes (the same limit measured
    16.5 and 19.2 CPU-s ten minutes apart), so the least limit of all rounds makes every run but
    the fastest round's look worse than it is; the paired ratio does not."""
    round_index = run["round"] - 1
    if not 0 <= round_index < len(limits):
        return None
    return run["cpu_exact"]["tree"] / limits[round_index]["cpu_seconds"]


def report(doc: dict[str, Any]) -> str:
    lines: list[str] = []
    add = lines.append
    limit = doc.get("limit_cpu")
    add(
        f"Case {doc['case']}: {doc['describe']}; scale {doc['scale']}, levels {doc['levels']}, {doc['cores']} cores, "
        f"load (1 min) {_f(doc['load'][0], 1)} before, {_f(doc['load'][1], 1)} after."
    )
    add("")
    if doc.get("limits"):
        add("#### The limit (bench.limit, one core, in one process)")
        add("")
        add("| round | CPU s | wall s | read | extract | encode | write |")
        add("|---|---|---|---|---|---|---|")
        for i, lim in enumerate(doc["limits"]):
            st = lim["stages"]
            add(
                f"| {i + 1} | {_f(lim['cpu_seconds'])} | {_f(lim['total'])} | {_f(st['read'])} | {_f(st['extract'])} | {_f(st['encode'])} | {_f(st['write'])} |"
            )
        add("")
        add(f"Limit CPU-seconds (least of the rounds): **{_f(limit)}**.")
        add("")
    runs = doc["runs"]
    add("#### 1. CPU-seconds of every process of the conversion")
    add("")
    add(
        "Exact (kernel) columns: whole tree = this process's RUSAGE_CHILDREN around the run (orphans adopted and waited for); "
        "client self and workers = the client's own getrusage when its main returned (workers forked from the fork server, "
        "and the server: all the tree but what the client waited for); teardown = the rest. "
        "Sampled columns: psutil per process and per client thread, each up to its last poll."
    )
    add("")
    add(
        "| round | workers | wall s | CPU whole tree | x limit CPU | x its round's limit | client self (exact) | workers (exact) | teardown + strays | "
        "client main thread | event loop (scheduler, nannies) | client other threads | workers (sampled) | other processes | verified |"
    )
    add("|" + "---|" * 15)
    for r in runs:
        ex, th, kind = r["cpu_exact"], r["cpu_client_threads_sampled"], r["cpu_sampled_by_kind"]
        ratio = ex["tree"] / limit if limit else None
        paired = paired_ratio(r, doc.get("limits") or [])
        main_t = th.get("main thread (planning, driver loop, manifest, metadata)", 0.0)
        loop_t = th.get("event-loop thread (scheduler, nannies, client comms)", 0.0)
        other_t = sum(
            v
            for k, v in th.items()
            if k
            not in (
                "main thread (planning, driver loop, manifest, metadata)",
                "event-loop thread (scheduler, nannies, client comms)",
            )
        )
        verified = (
            r.get("verified", {}).get("text", "not verified") if r["returncode"] == 0 else f"exit {r['returncode']}"
        )
        add(
            f"| {r['round']} | {r['workers']} | {_f(r['wall'])} | **{_f(ex['tree'])}** | {_f(ratio)}x | {_f(paired)}x | {_f(ex['client_self'])} | "
            f"{_f(ex['workers_waited'])} | {_f(ex['teardown_and_strays'])} | {_f(main_t)} | {_f(loop_t)} | {_f(other_t)} | "
            f"{_f(kind.get('worker', 0.0))} ({r['processes_by_kind'].get('worker', 0)}) | {_f(kind.get('other', 0.0) + kind.get('nanny', 0.0))} "
            f"({r['processes_by_kind'].get('other', 0) + r['processes_by_kind'].get('nanny', 0)}) | {verified} |"
        )
    add("")
    add("#### 2. Fixed cost: command start to the first task running, last task's end to exit")
    add("")
    add(
        "| round | workers | tasks | start -> first task: wall s | CPU s (client, workers) | first start -> last end: wall s | CPU s | "
        "last end -> exit: wall s | CPU s (client, workers) | in tasks (sum of task wall s) |"
    )
    add("|" + "---|" * 10)
    for r in runs:
        h, t = r["head"], r["tail"]
        add(
            f"| {r['round']} | {r['workers']} | {len(r['task_seconds'])} | {_f(h['wall'])} | {_f(h['cpu'])} ({_f(h['cpu_client'])}, {_f(h['cpu_workers'])}) | "
            f"{_f(r['span'])} | {_f(r['in_tasks_cpu_window'])} | {_f(t['wall'])} | {_f(t['cpu'])} ({_f(t['cpu_client'])}, {_f(t['cpu_workers'])}) | "
            f"{_f(sum(r['task_seconds']))} |"
        )
    add("")
    add("Phases (wall s / CPU s of all processes; client timestamps, task times from the workers):")
    add("")
    header = "| phase | " + " | ".join(f"r{r['round']} {r['workers']} workers" for r in runs) + " |"
    add(header)
    add("|---|" + "---|" * len(runs))
    names: list[tuple[str, str]] = []
    for r in runs:
        for p in r["phases"]:
            if (p["from"], p["to"]) not in names:
                names.append((p["from"], p["to"]))
    for a, b in names:
        cells = []
        for r in runs:
            p = next((p for p in r["phases"] if (p["from"], p["to"]) == (a, b)), None)
            cells.append(f"{_f(p['wall'])} / {_f(p['cpu'])}" if p else "-")
        add(f"| {a} -> {b} | " + " | ".join(cells) + " |")
    add("")
    add("#### 3. The tail: measured task times list-scheduled on N workers")
    add("")
    add(
        "| tasks from | tasks | sum s | longest s | N | total/N s | submitted order s | x total/N | largest first s | x total/N |"
    )
    add("|" + "---|" * 10)
    for r in runs:
        secs = r["task_seconds"]
        for row in r["tail_rows"]:
            add(
                f"| r{r['round']} {r['workers']} workers | {len(secs)} | {_f(sum(secs))} | {_f(max(secs, default=0.0))} | {row['workers']} | {_f(row['ideal'])} | "
                f"{_f(row['submitted'])} | {_f(row['submitted_x'], 3)} | {_f(row['largest_first'])} | {_f(row['largest_first_x'], 3)} |"
            )
    add("")
    add(
        "Check of the model on each run's own worker count, against the span measured (first task start to last task end): "
        "simulated with every worker ready at the first start, and with each worker from its own first task start (the spread of those is the cluster's start-up skew):"
    )
    add("")
    for r in runs:
        ready = r.get("worker_ready") or [0.0]
        add(
            f"- r{r['round']} {r['workers']} workers: measured {_f(r['span'])} s; simulated {_f(r['model_check'])} s (all ready), "
            f"{_f(r['model_check_ready'])} s (ready as measured; the last of {len(ready)} workers took its first task {_f(max(ready))} s after the first)"
        )
        idle = r.get("idle") or {}
        if idle:
            add(
                f"  worker-seconds of span x workers {_f(idle['span_x_workers'])}: in tasks {_f(idle['busy'])}, before a worker's first task "
                f"{_f(idle['before_first'])}, between tasks {_f(idle['between'])}, after a worker's last task {_f(idle['after_last'])}"
                + (f", workers that ran no task {_f(idle['never_ran'])}" if idle["never_ran"] else "")
            )
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.scaling", description=__doc__.split("\n\n")[0])
    p.add_argument("--scale", type=float, default=0.25)
    p.add_argument("--case", default="f32")
    p.add_argument("--workers", default="2,8,16", help="h5ngff --workers per run, in this order")
    p.add_argument("--levels", type=int, default=1)
    p.add_argument("--repeat", type=int, default=1, help="rounds, interleaved (limit, then each worker count)")
    p.add_argument("--tail-workers", default="2,16,64,256")
    p.add_argument("--interval", type=float, default=0.05, help="psutil poll interval, seconds")
    p.add_argument("--timeout", type=float, default=None, help="per run, seconds (default bench's 120 + 1500 x scale)")
    p.add_argument("--no-limit", action="store_true", help="skip the limit")
    p.add_argument("--no-verify", action="store_true")
    p.add_argument("--data-dir", default=os.path.join(BENCH_DIR, "data"))
    p.add_argument("--work-dir", default=None)
    p.add_argument("--result", default=None, help="JSON path (default bench/results/scaling-<time>-scale<S>.json)")
    p.add_argument(
        "--from-json",
        default=None,
        help="measure nothing: print the tables of an earlier result (tail re-derived with --tail-workers)",
    )
    args = p.parse_args(argv)
    if args.from_json:
        with open(args.from_json) as f:
            doc = json.load(f)
        for r in doc["runs"]:
            derive(r, [int(n) for n in args.tail_workers.split(",")])
        print(report(doc))
        return 0
    from .config import default_timeout

    case = build_cases(args.scale)[args.case]
    workers = [int(w) for w in args.workers.split(",")]
    tail_ns = [int(n) for n in args.tail_workers.split(",")]
    timeout = args.timeout or default_timeout(args.scale)
    subreaper = _set_subreaper()
    source, meta = ensure_input(case, args.scale, args.data_dir)
    work = args.work_dir or tempfile.mkdtemp(prefix="h5ngff-scaling-")
    os.makedirs(work, exist_ok=True)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    result_path = args.result or os.path.join(
        BENCH_DIR, "results", f"scaling-{stamp}-scale{scale_tag(args.scale)}.json"
    )
    os.makedirs(os.path.dirname(os.path.abspath(result_path)), exist_ok=True)
    logs = os.path.join(work, "logs")
    os.makedirs(logs, exist_ok=True)
    load_before = os.getloadavg()[0]
    limits, runs = [], []
    for number in range(args.repeat):
        if not args.no_limit:
            out = os.path.join(work, f"limit-{number}.zarr")
            warm_page_cache(source)
            limits.append(measure_limit(source, case.dataset, out, case.chunks))
            shutil.rmtree(out, ignore_errors=True)
            subprocess.run(["sync"], check=False)
        for w in workers:
            load = os.getloadavg()[0]
            r = run_one(case, source, w, args.levels, work, logs, timeout, args.interval, not args.no_verify)
            r.update(round=number + 1, load_before=load, load_after=os.getloadavg()[0])
            derive(r, tail_ns)
            runs.append(r)
            print(
                f"[round {number + 1}] {w} workers: wall {r['wall']:.2f} s, CPU {r['cpu_exact']['tree']:.2f} s, "
                f"exit {r['returncode']}, load {load:.1f}",
                file=sys.stderr,
                flush=True,
            )
    doc = {
        "command": "PYTHONPATH=src .venv/bin/python -m bench.scaling "
        + " ".join(argv if argv is not None else sys.argv[1:]),
        "started": stamp,
        "case": case.name,
        "describe": case.describe(),
        "scale": args.scale,
        "levels": args.levels,
        "cores": available_cores(),
        "blosc_ratio": meta.get("blosc_ratio"),
        "load": [load_before, os.getloadavg()[0]],
        "interval": args.interval,
        "subreaper": subreaper,
        "limits": limits,
        "limit_cpu": min((lim["cpu_seconds"] for lim in limits), default=None),
        "runs": runs,
    }
    text = report(doc)
    doc["report"] = text
    with open(result_path, "w") as f:
        json.dump(doc, f, indent=1, default=str)
    print(text)
    print(f"\nJSON: {result_path}")
    if not args.work_dir:
        shutil.rmtree(work, ignore_errors=True)
    return 0 if all(r["returncode"] == 0 and r.get("verified", {}).get("ok", True) for r in runs) else 1


if __name__ == "__main__":
    raise SystemExit(main())
