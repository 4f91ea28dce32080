"""Human-readable plan and run summaries (rich tables), and the rich progress bar."""

from __future__ import annotations

import math

import numpy as np
from rich.console import Console, Group, RenderableType
from rich.progress import (
    BarColumn,
    Progress,
    TaskID,
    TaskProgressColumn,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)
from rich.table import Table
from rich.text import Text

from .engine.progress import Progress as ProgressEvent
from .phases import Phase
from .planner import Plan
from .runner import PlannedJob, RunSummary
from .units import MiB, format_bytes, k8s_quantity


def _mib(n: float) -> str:
    return f"{n / MiB:,.1f}"


def _rate(bytes_per_s: float) -> str:
    """GB/s for big runs; MB/s or kB/s for small ones, which would all read '0.00 GB/s'."""
    for scale, unit in ((1e9, "GB/s"), (1e6, "MB/s")):
        if bytes_per_s >= scale:
            return f"{bytes_per_s / scale:.2f} {unit}"
    return f"{bytes_per_s / 1e3:.1f} kB/s"


def _storage(plan: Plan) -> str:
    ds = plan.dataset
    if ds.hdf5_chunks is None:
        return "contiguous"
    filters = f", {'+'.join(ds.hdf5_filters)}" if ds.hdf5_filters else ""
    return f"chunked {ds.hdf5_chunks}{filters}"


def plan_renderable(job: PlannedJob, notices: bool = True) -> Group:
    """The plan's tables; with ``notices``, its notices below them (the CLI prints them apart,
    on stderr: ``notices_renderable``)."""
    plan, spec = job.plan, job.spec
    ds = plan.dataset
    head = Table.grid(padding=(0, 2))
    head.add_column(style="bold")
    head.add_column()
    head.add_row(
        "source",
        f"{spec.source.path}:{spec.source.dataset}  {ds.shape} {np.dtype(ds.dtype).name}, {_storage(plan)}, {format_bytes(ds.nbytes)}",
    )
    unit = f", shards {plan.shards}" if plan.shards else ""
    head.add_row(
        "output",
        f"{spec.output.path}  NGFF {spec.output.ngff_version} (Zarr v{3 if spec.output.ngff_version == '0.5' else 2}), axes {plan.axes}, chunks {plan.chunks}{unit}, {spec.output.compressor.describe()}",
    )
    head.add_row(
        "pyramid",
        f"{len(plan.levels)} level(s), {spec.pyramid.method}: "
        + ", ".join(str(lv.shape) for lv in plan.levels[:4])
        + (" …" if len(plan.levels) > 4 else ""),
    )
    head.add_row(
        "workers",
        f"{plan.workers} x {plan.threads_per_worker} thread(s), allocator {plan.allocator}, {plan.inflight_per_worker} task(s) in flight per worker, {plan.n_tasks} tasks",
    )

    passes = Table(title="Passes", title_justify="left", show_edge=False)
    for col in ("pass", "reads", "writes levels", "slab", "slabs", "predicted peak MiB"):
        passes.add_column(col, justify="right" if col in ("slabs", "predicted peak MiB") else "left")
    for p in plan.passes:
        reads = "HDF5" if p.source_level < 0 else f"level {p.source_level}"
        passes.add_row(
            str(p.index), reads, ",".join(map(str, p.levels)), str(p.slab), f"{p.n_slabs:,}", _mib(p.predicted_peak)
        )

    mem = Table(title="Memory per worker (the pass that needs most)", title_justify="left", show_edge=False)
    mem.add_column("term")
    mem.add_column("MiB", justify="right")
    mem.add_column("why", style="dim")
    for t in plan.memory.terms:
        mem.add_row(t.name, _mib(t.bytes), t.why)
    mem.add_row(
        Text("predicted peak RSS", style="bold"),
        Text(_mib(plan.memory.predicted_peak), style="bold"),
        "sum of the terms above",
    )
    mem.add_row(
        "dask memory_limit",
        _mib(plan.memory.memory_limit),
        plan.memory.memory_limit_why or "the worker's --memory-limit",
    )
    for i, t in enumerate(plan.memory.pod_terms):
        mem.add_row(("+ " if i else "") + t.name, _mib(t.bytes), t.why)
    th = plan.memory.thresholds
    mem.add_row(
        Text("pod limit", style="bold"),
        Text(_mib(plan.memory.pod_limit), style="bold"),
        f"pod resources: requests = limits = {k8s_quantity(plan.memory.pod_limit)} (Guaranteed QoS)",
    )
    mem.add_row(
        "dask thresholds",
        "",
        f"target {th.target}, spill {th.spill}, pause {th.pause}, terminate {th.terminate:.0%} of memory_limit ({_mib(th.terminate * plan.memory.memory_limit)} MiB)",
    )
    parts: list[RenderableType] = [head, Text(""), passes, Text(""), mem]
    if notices and job.notices:
        parts.append(notices_renderable(job.notices))
    return Group(*parts)


def plan_summary_renderable(job: PlannedJob, source: str) -> Text:
    """The plan in two lines, what ``convert`` shows before it starts (``h5ngff plan SOURCE``,
    or ``convert -v``, gives every term)."""
    plan = job.plan
    passes = f"{len(plan.passes)} pass{'es' if len(plan.passes) != 1 else ''}"
    return Text.assemble(
        ("plan", "bold"),
        f": {plan.n_tasks:,} slab(s) in {passes}, {len(plan.levels)} level(s); {plan.workers} worker(s) x "
        f"{plan.threads_per_worker} thread(s), pod limit {_mib(plan.memory.pod_limit)} MiB each "
        f"(predicted peak {_mib(plan.memory.predicted_peak)} MiB)\n",
        (f"      every term: h5ngff plan {source}, or convert -v", "dim"),
    )


def notices_renderable(notices: list[str]) -> Group:
    return Group(*(Text(f"notice: {notice}", style="yellow") for notice in notices))


def summary_renderable(summary: RunSummary) -> Group:
    plan = summary.job.plan
    head = Table.grid(padding=(0, 2))
    head.add_column(style="bold")
    head.add_column()
    t = summary.totals
    head.add_row(
        "status",
        f"[green]{summary.status}[/green]" if summary.status == Phase.SUCCEEDED else f"[red]{summary.status}[/red]",
    )
    head.add_row("output", summary.job.spec.output.path + ("  (resumed)" if summary.resumed else ""))
    if t:
        head.add_row("time", f"{summary.seconds:.2f} s  ({_rate(summary.gb_per_s * 1e9)} of source data)")
        head.add_row("slabs", f"{t.slabs_written} written, {t.slabs_skipped} already done")
        head.add_row(
            "bytes",
            f"{format_bytes(t.bytes_read)} read, {format_bytes(t.bytes_written)} written (ratio {t.bytes_read / max(1, t.bytes_written):.2f})",
        )
    workers = Table(title="Memory per worker: measured against the plan", title_justify="left", show_edge=False)
    cols = ["worker", "peak RSS MiB", "predicted MiB", "peak/plan", "memory_limit MiB", "pod limit MiB"]
    has_cgroup = any(w.cgroup_peak is not None for w in summary.workers)
    if has_cgroup:
        # cgroup peak includes clean page cache (it reaches the limit on any long run); the
        # non-reclaimable peak is what the pod really needed, and its ratio to the limit is the
        # pod limit's margin.
        cols += ["pod non-reclaimable peak MiB", "pod limit/need", "cgroup peak MiB", "OOM kills", "restarts"]
    # Without cgroups a worker can still die (the machine's OOM killer, a crash) and be restarted
    # by its nanny, its slabs retried: the run succeeds, and the table is where it shows.
    restarted = not has_cgroup and any(w.nanny_restarts or w.memory_terminations for w in summary.workers)
    if restarted:  # a memory termination is a restart too: the second column says how many were
        cols += ["restarts (any cause)", "memory terminations"]
    for c in cols:
        workers.add_column(c, justify="left" if c == "worker" else "right")
    for w in summary.workers:
        ratio = w.peak_rss / plan.memory.predicted_peak if plan.memory.predicted_peak else math.nan
        style = "green" if ratio <= 1.0 else "red"
        row: list[RenderableType] = [
            w.name,
            _mib(w.peak_rss),
            _mib(plan.memory.predicted_peak),
            Text(f"{ratio:.2f}", style=style),
            _mib(plan.memory.memory_limit),
            _mib(w.pod_limit or plan.memory.pod_limit),
        ]
        if has_cgroup:
            need = w.pod_nonreclaimable_peak
            pod = w.pod_limit or plan.memory.pod_limit
            row += [
                "" if need is None else _mib(need),
                "" if not need else f"{pod / need:.2f}",
                _mib(w.cgroup_peak or 0),
                str(w.oom_kills),
                str(w.nanny_restarts),
            ]
        if restarted:
            row += [str(w.nanny_restarts), str(w.memory_terminations)]
        workers.add_row(*row)
    return Group(head, Text(""), workers)


class ProgressBar:
    """A rich progress bar fed by progress events: slabs, bytes/s and ETA."""

    def __init__(self, console: Console):
        self.bar = Progress(
            TextColumn("[bold]{task.fields[phase]}"),
            BarColumn(),
            TaskProgressColumn(),
            TextColumn("{task.completed:.0f}/{task.total:.0f} slabs"),
            TextColumn("{task.fields[rate]}"),
            TimeElapsedColumn(),
            TextColumn("eta"),
            TimeRemainingColumn(),
            console=console,
            transient=False,
        )
        self.task: TaskID | None = None

    def __enter__(self) -> "ProgressBar":
        self.bar.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self.bar.__exit__(*exc)

    def __call__(self, p: ProgressEvent) -> None:
        rate = f"{p.read_throughput / 1e6:,.0f} MB/s" if p.bytes_read else ""
        if self.task is None:
            self.task = self.bar.add_task("convert", total=max(p.slabs_total, 1), phase=p.phase, rate=rate)
        self.bar.update(self.task, completed=p.slabs_done, total=max(p.slabs_total, 1), phase=p.phase, rate=rate)


def slurm_job_renderable(plan: Plan, script) -> Group:
    """The SLURM job every worker gets (``h5ngff plan --backend slurm``): ``--mem`` term by term
    (the pod limit's terms: the job's cgroup counts what a pod's does), then the script itself."""
    mem = Table(title="SLURM job per worker (--backend slurm)", title_justify="left", show_edge=False)
    mem.add_column("term")
    mem.add_column("MiB", justify="right")
    mem.add_column("why", style="dim")
    for i, t in enumerate(script.mem_terms):
        mem.add_row(("+ " if i else "") + t.name, _mib(t.bytes), t.why)
    why = "the job's memory cgroup (task/cgroup, ConstrainRAMSpace): the kernel kills above it"
    if script.mem_override:
        why = f"{script.mem_override}; " + why
    mem.add_row(Text("#SBATCH --mem", style="bold"), Text(_mib(script.mem_bytes), style="bold"), why)
    mem.add_row(
        "#SBATCH --cpus-per-task",
        str(plan.threads_per_worker),
        "the worker's threads (-n 1: one nanny + worker per job)",
    )
    mem.add_row(
        "worker --memory-limit",
        _mib(plan.memory.memory_limit),
        "Dask's limit, given explicitly (auto would read the node's RAM)",
    )
    mem.add_row(
        "allocator",
        "",
        f"{plan.allocator}: "
        + (
            "LD_PRELOAD libjemalloc.so.2 where the node has it, else tuned glibc (said in the job's .err)"
            if plan.allocator == "jemalloc"
            else "glibc tuned to return freed slabs"
        ),
    )
    mem.add_row("jobs", str(plan.workers), f"--memory-total is their sum: {_mib(plan.workers * script.mem_bytes)} MiB")
    return Group(
        Text(""),
        mem,
        Text(""),
        Text("job script (one per worker; SCHEDULER and WORKER are filled in at submission):", style="bold"),
        Text(script.text(), style="dim", no_wrap=True, overflow="ignore"),
    )


def slurm_job_dict(script) -> dict:
    return {
        "mem_bytes": script.mem_bytes,
        "mem_terms": [{"name": t.name, "bytes": t.bytes, "why": t.why} for t in script.mem_terms],
        "mem_override": script.mem_override or None,
        "header": list(script.header),
        "script": script.text(),
    }
