"""The Prometheus exporter every conversion run serves on ``--metrics-port``.

``MetricsExporter`` is a progress listener (job progress) and, while attached to the run's
``ClusterPoller`` (the one sampler of the workers, which the runner runs), a listener of its
snapshots (per-worker memory, limits, cgroup view, restarts, OOM kills). Prometheus scrapes the
latest of both.

Why a custom collector rather than prometheus_client Gauges/Counters:

* workers come and go (a nanny restart gives a new process, an external cluster may scale); a
  collector shows exactly the workers of the latest poll, where labelled gauges would keep a dead
  worker's last value until someone remembered to remove it;
* every scrape is one consistent snapshot (all worker series come from the same poll);
* the counters (OOM kills, restarts, spill counts, slabs done) are absolute values counted
  elsewhere (kernel, scheduler events, SpillBuffer, the driver); ``Counter`` only has ``inc()``.

After the run the exporter keeps serving the final values until the process exits
(``--metrics-linger`` keeps the process alive long enough for Prometheus to scrape them; the
Kubernetes runner lingers only until one scrape has read them, ``$H5NGFF_METRICS_LINGER`` s at most).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import posixpath
import threading
import time
from contextlib import contextmanager
from typing import Iterator, Sequence

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import Metric

from ..engine.progress import Progress
from .. import k8s
from ..errors import SpecError
from ..planner.model import Plan
from ..phases import ITEMS_TO_DO, Phase, TERMINAL_PHASES
from .batch import BatchFigures, BatchMetrics
from .families import ExportState, build_families
from .probes import ClusterPoller, ClusterSnapshot

log = logging.getLogger(__name__)

#: Environment variables the Kubernetes runner sets to label the series with the ConversionJob.
JOB_NAME_ENV, JOB_NAMESPACE_ENV = k8s.JOB_NAME_ENV, k8s.JOB_NAMESPACE_ENV


class _Collector:
    def __init__(self, exporter: "MetricsExporter"):
        self.exporter = exporter

    def collect(self) -> Iterator[Metric]:
        yield from self.exporter.families()
        self.exporter._scraped()


class MetricsExporter:
    """Serves the metrics of one conversion job on ``addr:port`` (port 0 picks a free one)."""

    def __init__(self, port: int, job: str, namespace: str = "local", addr: str = "0.0.0.0"):
        self.job = job
        self.namespace = namespace
        self._lock = threading.Lock()
        self._state = ExportState()
        self._poller: ClusterPoller | None = None
        #: The batch this exporter serves (``start_batch``), None for one conversion.
        self.batch: BatchMetrics | None = None
        #: Completed scrapes, so ``linger`` can tell when the final values were read.
        self.scrapes = 0
        #: ``scrapes`` when the job reached Succeeded or Failed: later scrapes read the final values.
        self._final_mark: int | None = None
        self._scrape = threading.Condition()
        # Our own registry: the exposition is exactly our catalogue, whatever else the process
        # (an in-process Dask scheduler, say) registers in prometheus_client's global one.
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(_Collector(self))
        try:
            self._server, _ = start_http_server(port, addr, registry=self.registry)
        except (OSError, OverflowError) as exc:  # OverflowError: a number no port has (bind's own check)
            why = exc.strerror if isinstance(exc, OSError) else "ports are 0-65535"
            raise SpecError(
                "--metrics-port",
                f"Expected a free TCP port on {addr}. Got {port} instead ({why}). Pick another port, or 0 for any free one.",
            ) from None
        log.info("Serving Prometheus metrics on http://%s:%d/metrics", addr, self.port)

    @classmethod
    def for_spec(cls, spec, port: int, **kwargs) -> "MetricsExporter":
        """Labels from the environment (set by the Kubernetes runner), else from the output path."""
        stem = os.path.basename(os.path.normpath(spec.output.path)).split(".")[0] or "h5ngff"
        return cls(port, os.environ.get(JOB_NAME_ENV) or stem, os.environ.get(JOB_NAMESPACE_ENV) or "local", **kwargs)

    @classmethod
    def for_batch(cls, outputs: Sequence[str], port: int, **kwargs) -> "MetricsExporter":
        """The exporter of a batch of ``len(outputs)`` items, its ``batch`` started. Labels from
        the environment (set by the Kubernetes runner), else the directory the outputs share
        (``out/{stem}.ome.zarr`` gives ``out``)."""
        exporter = cls(
            port,
            os.environ.get(JOB_NAME_ENV) or _shared_directory(outputs),
            os.environ.get(JOB_NAMESPACE_ENV) or "local",
            **kwargs,
        )
        exporter.start_batch(len(outputs))
        return exporter

    def start_batch(self, items: int) -> BatchMetrics:
        """Serve the figures of a batch of ``items`` items from now on (its clock starts now).
        Feed it through its hooks (``BatchMetrics.around``), and pass this exporter to
        ``run_batch`` too, for the job and worker series of the item running."""
        self.batch = BatchMetrics(items, self._batch_figures)
        return self.batch

    def _batch_figures(self, figures: BatchFigures) -> None:
        with self._lock:
            self._state.batch = figures
        if not any(state in ITEMS_TO_DO for state in figures.states):
            with self._scrape:  # every item has ended: later scrapes read the batch's final values
                self._final_mark = self.scrapes

    @property
    def port(self) -> int:
        return self._server.server_port

    # -- progress listener -------------------------------------------------------------------

    def __call__(self, progress: Progress) -> None:
        snapshot = dataclasses.replace(progress)
        with self._lock:
            before = self._state.progress
            if before is None or (before.phase, before.slabs_done) != (snapshot.phase, snapshot.slabs_done):
                self._state.last_progress = time.time()
            self._state.progress = snapshot
        if snapshot.phase in TERMINAL_PHASES:
            with self._scrape:
                self._final_mark = (
                    self.scrapes
                )  # Computed now, not at scrape time: after the run they must stay the final figures.
            self._state.throughput = (
                snapshot.read_throughput if snapshot.phase not in (Phase.PENDING, Phase.PLANNED) else None
            )
            self._state.eta = snapshot.eta_seconds

    # -- cluster polling ---------------------------------------------------------------------

    def attach(self, poller: ClusterPoller, plan: Plan) -> None:
        """Export every snapshot ``poller`` reads from now on (the runner runs the poller)."""
        self.detach()
        self._poller = poller
        with self._lock:
            self._state.predicted_peak = plan.memory.predicted_peak
            self._state.passes = len(plan.passes)
        poller.listeners.append(self._snapshot)

    def detach(self, poller: ClusterPoller | None = None) -> bool:
        """Stop listening (to ``poller`` only, where given: a batch item's run that ends must not
        detach the poller of an item attached after it); the last figures stay exported. True
        where it stopped listening to one."""
        if self._poller is not None and (poller is None or poller is self._poller):
            self._poller.listeners.remove(self._snapshot)
            self._poller = None
            return True
        return False

    def _snapshot(self, snapshot: ClusterSnapshot | None) -> None:
        with self._lock:
            if snapshot is None:  # a poll of a dying cluster failed: counted, never fatal
                self._state.poll_errors += 1
            else:
                self._state.snapshot = snapshot

    def settle(self, workers) -> None:
        """Export the run's final per-worker figures (``WorkerReport``), read once the cluster has
        stopped: the counts a scrape shows are then the ones the summary and the message give."""
        with self._lock:
            snapshot = self._state.snapshot
            if snapshot is None:
                return
            snapshot = dataclasses.replace(
                snapshot,
                oom_kills=dict(snapshot.oom_kills),
                nanny_restarts=dict(snapshot.nanny_restarts),
                memory_terminations=dict(snapshot.memory_terminations),
                pod_nonreclaimable_peaks=dict(snapshot.pod_nonreclaimable_peaks),
            )
            for w in workers:
                snapshot.oom_kills[w.name] = w.oom_kills
                snapshot.nanny_restarts[w.name] = max(w.nanny_restarts, snapshot.nanny_restarts.get(w.name, 0))
                snapshot.memory_terminations[w.name] = max(
                    w.memory_terminations, snapshot.memory_terminations.get(w.name, 0)
                )
                if w.pod_nonreclaimable_peak:
                    snapshot.pod_nonreclaimable_peaks[w.name] = max(
                        w.pod_nonreclaimable_peak, snapshot.pod_nonreclaimable_peaks.get(w.name, 0)
                    )
            self._state.snapshot = snapshot

    @contextmanager
    def attached(self, poller: ClusterPoller, plan: Plan) -> Iterator["MetricsExporter"]:
        self.attach(poller, plan)
        try:
            yield self
        finally:
            self.detach(poller)

    # -- serving -----------------------------------------------------------------------------

    def families(self) -> list[Metric]:
        with self._lock:
            state = dataclasses.replace(self._state)
        return build_families(self.job, self.namespace, state)

    def _scraped(self) -> None:
        with self._scrape:
            self.scrapes += 1
            self._scrape.notify_all()

    def linger(self, seconds: float, until_scraped: bool = False) -> bool:
        """Keep the process (and so the HTTP server) alive so Prometheus scrapes the final state:
        ``seconds`` long, or with ``until_scraped`` only until one scrape has read the final
        values (at most ``seconds``). True if a scrape happened while lingering."""
        if seconds <= 0:
            return False
        with self._scrape:
            before = self.scrapes if self._final_mark is None else self._final_mark
            log.info("Metrics: serving the final values for %s%.0f s more.", "up to " if until_scraped else "", seconds)
            if until_scraped:
                return self._scrape.wait_for(lambda: self.scrapes > before, seconds)
        time.sleep(seconds)
        return self.scrapes > before

    def close(self) -> None:
        self.detach()
        self._server.shutdown()
        self._server.server_close()


def _shared_directory(outputs: Sequence[str]) -> str:
    """The last name of the directory every output is in ("batch" where they share none)."""
    try:
        shared = posixpath.commonpath([posixpath.dirname(o.rstrip("/")) for o in outputs]) if outputs else ""
    except ValueError:  # absolute and relative paths mixed
        shared = ""
    return posixpath.basename(shared.rstrip("/")) or "batch"
