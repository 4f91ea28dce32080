"""A runner pod's Prometheus exporter, as its runner contract asks for it: a ConversionJob's
runner and a ConversionBatch's (operator/runner/batch.py) both serve one when the contract has a
metrics port, labelled with the object's name and namespace, and linger for a final scrape."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Callable

from ...errors import H5ngffError
from ..contract import RunnerContract

if TYPE_CHECKING:  # prometheus-client loads only where metrics are served
    from ...metrics.exporter import MetricsExporter

log = logging.getLogger(__name__)


def runner_exporter(
    contract: RunnerContract, start: Callable[[MetricsExporter], None] | None = None
) -> MetricsExporter | None:
    """The attempt's exporter when the contract asks for metrics, else None; ``start`` prepares
    it (a batch's figures). Metrics are worth a warning, never a failed attempt."""
    if contract.metrics_port is None:
        return None
    from ...metrics.exporter import MetricsExporter

    try:
        exporter = MetricsExporter(contract.metrics_port, contract.name, contract.namespace)
    except H5ngffError as exc:
        log.warning("No Prometheus metrics for this attempt: %s", exc)
        return None
    if start is not None:
        start(exporter)
    return exporter
