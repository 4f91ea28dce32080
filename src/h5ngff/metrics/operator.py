"""The operator's own Prometheus metrics: ConversionJobs by phase, and reconcile errors.

The operator feeds them from its handlers (``observe``/``forget`` on every ConversionJob event,
``reconciled`` after every pass, ``reconcile_error`` when a pass fails); ``serve`` exposes them on ``/metrics``. The phase gauge
is computed at scrape time from what the operator last saw, so it needs no bookkeeping of
increments and decrements, and a restart rebuilds it from kopf's initial listing.
"""

from __future__ import annotations

import threading
from collections import Counter as Tally

from prometheus_client import CollectorRegistry, Counter, Info, start_http_server
from prometheus_client.core import GaugeMetricFamily

from .. import __version__
from ..phases import JOB_PHASES as PHASES

#: The operator's metrics (the dashboard's Operator row; docs/metrics.md), beside the catalogue of
#: the runner's exporter (families.CATALOGUE). Counters are exposed with ``_total``.
OPERATOR_METRICS = (
    "h5ngff_build_info",
    "h5ngff_operator_conversionjobs",
    "h5ngff_operator_reconcile_errors_total",
    "h5ngff_operator_reconcile_passes_total",
)


class _PhaseCollector:
    def __init__(self, metrics: "OperatorMetrics"):
        self.metrics = metrics

    def collect(self):
        family = GaugeMetricFamily(
            "h5ngff_operator_conversionjobs", "ConversionJobs the operator sees, by phase.", labels=["phase"]
        )
        counts = self.metrics.phase_counts()
        for phase in PHASES:
            family.add_metric([phase], counts.get(phase, 0))
        for phase, n in sorted(counts.items()):
            if phase not in PHASES:  # "" for jobs not yet reconciled
                family.add_metric([phase or "Unknown"], n)
        yield family


class OperatorMetrics:
    """Thread-safe: kopf handlers run in the operator's event loop, scrapes in the server thread."""

    def __init__(self, registry: CollectorRegistry | None = None):
        self.registry = registry or CollectorRegistry()
        self._phases: dict[tuple[str, str], str] = {}
        self._lock = threading.Lock()
        self.errors = Counter(
            "h5ngff_operator_reconcile_errors",
            "Failed reconcile passes, by error kind.",
            ["kind"],
            registry=self.registry,
        )
        self.passes = Counter(
            "h5ngff_operator_reconcile_passes",
            "Completed reconcile passes over all ConversionJobs.",
            registry=self.registry,
        )
        #: Completed passes per ConversionJob (not exported: one series per job would grow without
        #: bound); tests count them instead of sleeping ("N passes later, nothing happened").
        self._passes: Tally = Tally()
        self.registry.register(_PhaseCollector(self))
        Info(
            "h5ngff_build", "Always 1; the version label is the running operator's h5ngff.", registry=self.registry
        ).info({"version": __version__})

    def observe(self, namespace: str, name: str, phase: str | None) -> None:
        with self._lock:
            self._phases[(namespace, name)] = phase or ""

    def forget(self, namespace: str, name: str) -> None:
        with self._lock:
            self._phases.pop((namespace, name), None)

    def reconciled(self, namespace: str, name: str) -> None:
        self.passes.inc()
        with self._lock:
            self._passes[(namespace, name)] += 1

    def passes_of(self, namespace: str, name: str) -> int:
        with self._lock:
            return self._passes[(namespace, name)]

    def reconcile_error(self, kind: str) -> None:
        self.errors.labels(kind=kind).inc()

    def phase_counts(self) -> dict[str, int]:
        with self._lock:
            return dict(Tally(self._phases.values()))

    def serve(self, port: int, addr: str = "0.0.0.0"):
        """Serve ``/metrics`` from a daemon thread; returns (server, thread)."""
        return start_http_server(port, addr=addr, registry=self.registry)
