"""A runner pod's Prometheus exporter, as the operator asks for it in the runner Job's
environment: a ConversionJob's runner and a ConversionBatch's (operator/batchrunner.py) both
serve one when ``$H5NGFF_METRICS_PORT`` is set, and linger for a final scrape."""

from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING, Callable

from ..errors import H5ngffError
from .manifests import METRICS_PORT_ENV

if TYPE_CHECKING:  # prometheus-client loads only where metrics are served
    from ..metrics.exporter import MetricsExporter

log = logging.getLogger(__name__)

#: Seconds the runner keeps its metrics endpoint up after the attempt, until Prometheus has
#: scraped the final values once: two of the Helm chart's 15 s PodMonitor intervals by default.
METRICS_LINGER_ENV = "H5NGFF_METRICS_LINGER"
DEFAULT_METRICS_LINGER = 30.0


def runner_exporter(build: Callable[[type[MetricsExporter], int], MetricsExporter]) -> MetricsExporter | None:
    """``build(MetricsExporter, port)`` when the runner Job asks for metrics (the operator sets the
    port), else None. Metrics are worth a warning, never a failed attempt."""
    port = os.environ.get(METRICS_PORT_ENV)
    if not port:
        return None
    from ..metrics.exporter import MetricsExporter

    try:
        return build(MetricsExporter, int(port))
    except H5ngffError as exc:
        log.warning("No Prometheus metrics for this attempt: %s", exc)
        return None


def metrics_linger() -> float:
    text = os.environ.get(METRICS_LINGER_ENV)
    try:
        return float(text) if text else DEFAULT_METRICS_LINGER
    except ValueError:
        log.warning(
            "$%s=%r is not a number of seconds; lingering %.0f s", METRICS_LINGER_ENV, text, DEFAULT_METRICS_LINGER
        )
        return DEFAULT_METRICS_LINGER
