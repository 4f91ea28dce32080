"""Every metric h5ngff exports: one catalogue (name, type, labels, help, source), and a pure
builder that turns the exporter's latest state into Prometheus metric families.

Label names: ``conversion_job`` and ``conversion_job_namespace`` on everything, ``worker`` on
per-worker series. Not ``job`` nor ``namespace``: Prometheus attaches its own target labels, ``job``
(the scrape job) everywhere and ``namespace`` (the pod's) under a PodMonitor, and renames a
clashing exported label to ``exported_job``/``exported_namespace``, so the same dashboard query
would match locally and miss under the Prometheus operator.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from .. import __version__
from ..engine.progress import Progress
from ..phases import ITEM_STATES, RUN_PHASES as PHASES
from .batch import BatchFigures
from .probes import SPILL_ACTIVITIES, ClusterSnapshot, WorkerFigures

JOB_LABELS = ("conversion_job", "conversion_job_namespace")
MEMORY_TYPES = ("managed", "unmanaged_old", "unmanaged_recent", "spilled")


@dataclass(frozen=True)
class MetricDef:
    name: str  #: as exposed; counters end in _total
    kind: str  #: gauge or counter
    help: str
    source: str  #: where the number comes from (for docs/metrics.md)
    worker: bool = False  #: per-worker (adds the ``worker`` label)
    extra: tuple[str, ...] = ()  #: labels beyond JOB_LABELS[, worker]

    @property
    def labels(self) -> tuple[str, ...]:
        return JOB_LABELS + (("worker",) if self.worker else ()) + self.extra


def _job(name, kind, help, source, extra=()):
    return MetricDef(name, kind, help, source, False, extra)


def _worker(name, kind, help, source, extra=()):
    return MetricDef(name, kind, help, source, True, extra)


CATALOGUE: tuple[MetricDef, ...] = (
    _job(
        "h5ngff_build_info",
        "gauge",
        "Always 1; the version label is the h5ngff that runs the job (served from before planning on).",
        "package version",
        ("version",),
    ),
    _job(
        "h5ngff_job_phase",
        "gauge",
        f"1 for the job's current phase ({', '.join(PHASES)}), 0 for the others.",
        "progress events",
        ("phase",),
    ),
    _job("h5ngff_job_planned_slabs", "gauge", "Slab tasks in the plan, all passes.", "plan"),
    _job(
        "h5ngff_job_slabs_done_total",
        "counter",
        "Slab tasks finished, including those found done in the manifest at start.",
        "progress events",
    ),
    _job(
        "h5ngff_job_resumed_slabs",
        "gauge",
        "Slab tasks found done in the manifest at start (resume).",
        "progress events",
    ),
    _job(
        "h5ngff_job_planned_passes",
        "gauge",
        "Passes over the data in the plan (one per group of pyramid levels built together).",
        "plan",
    ),
    _job("h5ngff_job_current_pass", "gauge", "Index of the pass being written (0-based).", "progress events"),
    _job(
        "h5ngff_job_read_bytes_total",
        "counter",
        "Uncompressed bytes read from the HDF5 source (or from a lower level for later passes).",
        "progress events",
    ),
    _job("h5ngff_job_written_bytes_total", "counter", "Encoded bytes written to the Zarr store.", "progress events"),
    _job(
        "h5ngff_store_retries_total",
        "counter",
        "Object store requests retried after a transient error (5xx, throttling, reset connection), summed over the workers' finished slabs.",
        "progress events",
    ),
    _job(
        "h5ngff_job_read_throughput_bytes_per_second",
        "gauge",
        "Source bytes read per second, averaged since the writing phase started.",
        "progress events",
    ),
    _job(
        "h5ngff_job_eta_seconds",
        "gauge",
        "Estimated seconds until every slab is written (absent until the first fresh slab finishes).",
        "progress events",
    ),
    _job(
        "h5ngff_job_last_progress_timestamp_seconds",
        "gauge",
        "Unix time of the last phase change or finished slab.",
        "progress events",
    ),
    _job("h5ngff_job_predicted_peak_bytes", "gauge", "The plan's predicted peak RSS of one worker.", "plan"),
    _job(
        "h5ngff_exporter_last_poll_timestamp_seconds",
        "gauge",
        "Unix time of the last successful poll of the Dask cluster; worker series are as of this time.",
        "exporter",
    ),
    _job(
        "h5ngff_exporter_poll_errors_total",
        "counter",
        "Polls of the Dask cluster that failed (the previous worker figures are kept).",
        "exporter",
    ),
    # A batch's runner (docs/metrics.md, "Batches"): the job labels name the batch.
    _job(
        "h5ngff_batch_items",
        "gauge",
        f"Items of the batch by state ({', '.join(ITEM_STATES)}); their sum is the batch's items.",
        "batch hooks",
        ("state",),
    ),
    _job(
        "h5ngff_batch_planned_slabs",
        "gauge",
        "Slab tasks in the plans of the batch's items (absent until every item is planned).",
        "batch hooks",
    ),
    _job(
        "h5ngff_batch_slabs_done_total",
        "counter",
        "Slab tasks the batch's items have finished, resumed ones and those of items found complete included.",
        "batch hooks",
    ),
    _job(
        "h5ngff_batch_last_progress_timestamp_seconds",
        "gauge",
        "Unix time of the batch's last step: an item's planning started, an item started or ended, or a phase change or finished slab of the running item.",
        "batch hooks",
    ),
    _worker(
        "h5ngff_worker_rss_bytes",
        "gauge",
        "Resident set size of the worker process, read by the worker from /proc/self/status.",
        "client.run on the worker",
    ),
    _worker(
        "h5ngff_worker_rss_peak_bytes",
        "gauge",
        "Highest RSS of the current worker process (kernel high-water mark VmHWM).",
        "client.run on the worker",
    ),
    _worker(
        "h5ngff_worker_memory_bytes",
        "gauge",
        "Dask's memory breakdown of the worker: managed + unmanaged_old + unmanaged_recent = process RSS at the last heartbeat; spilled is on disk.",
        "scheduler MemoryState",
        ("type",),
    ),
    _worker(
        "h5ngff_worker_memory_limit_bytes",
        "gauge",
        "The worker's Dask memory_limit (thresholds are fractions of it).",
        "scheduler",
    ),
    _worker(
        "h5ngff_worker_pod_limit_bytes",
        "gauge",
        "The pod memory limit of the worker: the emulated pod's limit, else the plan's.",
        "plan / pod emulation",
    ),
    _worker(
        "h5ngff_worker_pod_nonreclaimable_bytes",
        "gauge",
        "Memory the worker's pod cannot give back under pressure: anon + shmem + dirty + writeback + unevictable in its cgroup's memory.stat. Page cache beyond it is reclaimed; this is what the pod limit must cover.",
        "client.run on the worker (cgroup memory.stat)",
    ),
    _worker(
        "h5ngff_worker_pod_nonreclaimable_peak_bytes",
        "gauge",
        "Highest non-reclaimable memory of the worker's pod during this run (every 25 ms under pod emulation, else at each poll): compare it with h5ngff_worker_pod_limit_bytes.",
        "pod emulation sampler / client.run on the worker",
    ),
    _worker(
        "h5ngff_worker_cgroup_usage_bytes",
        "gauge",
        "Memory usage of the worker's own memory cgroup (its pod), page cache included.",
        "client.run on the worker (cgroup)",
    ),
    _worker(
        "h5ngff_worker_cgroup_working_set_bytes",
        "gauge",
        "Working set of the worker's memory cgroup: usage minus inactive file pages, as kubelet computes it.",
        "client.run on the worker (cgroup)",
    ),
    _worker(
        "h5ngff_worker_cgroup_limit_bytes",
        "gauge",
        "Memory limit the kernel enforces on the worker's cgroup.",
        "client.run on the worker (cgroup)",
    ),
    _worker(
        "h5ngff_worker_spill_count_total",
        "counter",
        "Keys the worker's SpillBuffer moved to or from disk since the worker (re)started.",
        "client.run on the worker (SpillBuffer)",
        ("activity",),
    ),
    _worker(
        "h5ngff_worker_spill_bytes_total",
        "counter",
        "Bytes the worker's SpillBuffer wrote to or read from disk since the worker (re)started.",
        "client.run on the worker (SpillBuffer)",
        ("activity",),
    ),
    _worker(
        "h5ngff_worker_paused",
        "gauge",
        "1 while Dask has paused the worker (memory above the pause threshold), else 0.",
        "scheduler",
    ),
    _worker(
        "h5ngff_worker_nanny_restarts_total",
        "counter",
        "Worker processes that died (non-zero exit) and were restarted by their nanny during this run.",
        "scheduler events / pod logs",
    ),
    _worker(
        "h5ngff_worker_memory_terminations_total",
        "counter",
        "Workers the nanny terminated for exceeding the Dask terminate threshold during this run.",
        "scheduler events / pod logs",
    ),
    _worker(
        "h5ngff_worker_oom_kills_total",
        "counter",
        "Workers OOM-killed by the kernel (pod limit exceeded) during this run.",
        "scheduler events / cgroup memory.oom_control",
    ),
)

BY_NAME = {m.name: m for m in CATALOGUE}


@dataclass
class ExportState:
    """Everything one scrape shows, copied under the exporter's lock."""

    progress: Progress | None = None
    last_progress: float | None = None
    throughput: float | None = None
    eta: float | None = None
    predicted_peak: int | None = None
    passes: int | None = None
    snapshot: ClusterSnapshot | None = None
    poll_errors: int = 0
    batch: BatchFigures | None = None


class _Families:
    def __init__(self, job_values: tuple[str, str]):
        self.job_values = list(job_values)
        self.families: dict[str, CounterMetricFamily | GaugeMetricFamily] = {}

    def add(self, name: str, value: float | None, worker: str | None = None, extra: tuple[str, ...] = ()) -> None:
        if value is None or (isinstance(value, float) and math.isnan(value)):
            return
        defn = BY_NAME[name]
        if name not in self.families:
            cls = CounterMetricFamily if defn.kind == "counter" else GaugeMetricFamily
            self.families[name] = cls(name, defn.help, labels=list(defn.labels))
        values = self.job_values + ([worker or ""] if defn.worker else []) + list(extra)
        self.families[name].add_metric(values, value)


def build_families(conversion_job: str, namespace: str, state: ExportState) -> list[Metric]:
    """The metric families for one scrape (pure: the same state gives the same output)."""
    out = _Families((conversion_job, namespace))
    out.add("h5ngff_build_info", 1.0, extra=(__version__,))
    _job_families(out, state)
    if state.batch is not None:
        _batch_families(out, state.batch)
    if state.snapshot is not None:
        out.add("h5ngff_exporter_last_poll_timestamp_seconds", state.snapshot.time)
        _worker_families(out, state.snapshot)
    out.add("h5ngff_exporter_poll_errors_total", state.poll_errors)
    return list(out.families.values())


def _job_families(out: _Families, state: ExportState) -> None:
    p = state.progress
    if p is None:
        return
    for phase in PHASES:
        out.add("h5ngff_job_phase", 1.0 if p.phase == phase else 0.0, extra=(phase,))
    out.add("h5ngff_job_planned_slabs", p.slabs_total)
    out.add("h5ngff_job_slabs_done_total", p.slabs_done)
    out.add("h5ngff_job_resumed_slabs", p.slabs_skipped)
    out.add("h5ngff_job_planned_passes", p.passes or state.passes)
    out.add("h5ngff_job_current_pass", p.pass_index)
    out.add("h5ngff_job_read_bytes_total", p.bytes_read)
    out.add("h5ngff_job_written_bytes_total", p.bytes_written)
    out.add("h5ngff_store_retries_total", p.store_retries)
    out.add("h5ngff_job_read_throughput_bytes_per_second", state.throughput)
    out.add("h5ngff_job_eta_seconds", state.eta)
    out.add("h5ngff_job_last_progress_timestamp_seconds", state.last_progress)
    out.add("h5ngff_job_predicted_peak_bytes", state.predicted_peak)


def _batch_families(out: _Families, batch: BatchFigures) -> None:
    for item_state in ITEM_STATES:  # every state, 0 included: the alert and the panels need no absent series
        out.add("h5ngff_batch_items", float(batch.states.count(item_state)), extra=(item_state,))
    if batch.planned:
        out.add("h5ngff_batch_planned_slabs", sum(batch.planned_slabs))
    out.add("h5ngff_batch_slabs_done_total", sum(batch.slabs_done))
    out.add("h5ngff_batch_last_progress_timestamp_seconds", batch.last_progress)


def _worker_families(out: _Families, snap: ClusterSnapshot) -> None:
    for name, w in sorted(snap.workers.items()):
        _worker_memory(out, name, w, snap.pod_limits.get(name))
        for activity in SPILL_ACTIVITIES:
            out.add("h5ngff_worker_spill_count_total", w.spill.get((activity, "count"), 0.0), name, (activity,))
            out.add("h5ngff_worker_spill_bytes_total", w.spill.get((activity, "bytes"), 0.0), name, (activity,))
        out.add("h5ngff_worker_paused", 1.0 if w.status == "paused" else 0.0, name)
    # Counters cover every worker seen during the run: a dead worker's kill matters most.
    for name in sorted(snap.oom_kills):
        out.add("h5ngff_worker_nanny_restarts_total", snap.nanny_restarts.get(name, 0), name)
        out.add("h5ngff_worker_memory_terminations_total", snap.memory_terminations.get(name, 0), name)
        out.add("h5ngff_worker_oom_kills_total", snap.oom_kills[name], name)
    for name in sorted(snap.pod_nonreclaimable_peaks):
        out.add("h5ngff_worker_pod_nonreclaimable_peak_bytes", snap.pod_nonreclaimable_peaks[name], name)


def _worker_memory(out: _Families, name: str, w: WorkerFigures, pod_limit: int | None) -> None:
    out.add("h5ngff_worker_rss_bytes", w.rss, name)
    out.add("h5ngff_worker_rss_peak_bytes", w.peak_rss, name)
    for kind in MEMORY_TYPES:
        out.add("h5ngff_worker_memory_bytes", getattr(w, kind), name, (kind,))
    out.add("h5ngff_worker_memory_limit_bytes", w.memory_limit or None, name)  # 0: no limit
    out.add("h5ngff_worker_pod_limit_bytes", pod_limit, name)
    if w.cgroup is not None:
        out.add("h5ngff_worker_cgroup_usage_bytes", w.cgroup.usage, name)
        out.add("h5ngff_worker_cgroup_working_set_bytes", w.cgroup.working_set, name)
        out.add("h5ngff_worker_cgroup_limit_bytes", w.cgroup.limit, name)
        out.add("h5ngff_worker_pod_nonreclaimable_bytes", w.cgroup.nonreclaimable, name)
