"""``h5ngff runner``: what the runner Job's container executes (hidden from ``h5ngff --help``).

It reads its runner contract from the environment (operator/contract.py: put there by the
controller, so each attempt runs exactly the spec it was created for), plans in the pod that can
open the HDF5 file, converts on a Dask cluster made for the run, and reports every step into the
ConversionJob's status. The exit code tells the Job controller (and so the operator) how the
attempt ended: 0 done, 2 bad input, 1 anything else.

The contract's backend ``local`` runs the Dask cluster in the runner's own container instead of as
pods: for tests and for clusters without the Dask Operator. ``local-pods`` does the same with every
worker in its own memory cgroup at the pod limit (as ``h5ngff convert --enforce-pod-limits``), and
its ``pod_limit`` then overrides the planned limit (experiments and negative controls).
"""

from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING, Mapping

from ...errors import H5ngffError, SpecError
from ...jobspec import PLURAL, ConversionJobSpec, Owner, parse_job_spec
from ...runner import Linger
from ...units import parse_bytes
from ..contract import ENV, RunnerContract
from .attempt import AttemptOptions, run_attempt
from .metrics import runner_exporter
from .reporter import StatusReporter
from .reports import runner_report
from ..schema.status import now

if TYPE_CHECKING:
    from ...backends.base import Backend

log = logging.getLogger(__name__)


def runner_backend(contract: RunnerContract, spec: ConversionJobSpec) -> Backend:
    """The backend the contract names (default kubernetes), from the one factory: one that starts
    its own workers, since a runner Job makes the cluster for its attempt."""
    from ...backends.factory import BACKENDS, BackendOptions, make_backend, owning_kinds

    entry = BACKENDS.get(contract.backend)
    if entry is None or not entry.owns_workers:
        kinds = owning_kinds()
        raise SpecError(
            "",
            f"Expected ${ENV['backend']} to be {', '.join(kinds[:-1])} or {kinds[-1]} (a backend that starts its own "
            f"workers). Got {contract.backend!r} instead.",
        )
    options = BackendOptions(
        pod_limit=parse_bytes(contract.pod_limit) if contract.pod_limit else None,
        image=spec.pod.image or "",
        pod=spec.pod,
        owner=Owner(contract.namespace, contract.name, contract.uid, contract.attempt, contract.kind),
    )
    return make_backend(contract.backend, options)


def main(env: Mapping[str, str] | None = None, **identity: object) -> int:
    """Run the attempt the environment's contract describes; ``identity`` (namespace, name, uid,
    attempt: ``h5ngff runner``'s flags) overrides the contract's, for running a runner by hand."""
    try:
        contract = RunnerContract.from_env(os.environ if env is None else env).with_identity(**identity)
    except H5ngffError as exc:
        log.error("%s", exc)  # no contract, so no status to report into: the Job's exit code says it
        return exc.exit_code
    if contract.is_batch:  # a ConversionBatch's attempt (operator/runner/batch.py)
        from .batch import main as batch_main

        return batch_main(contract, runner_backend)
    return run_job_attempt(contract)


def run_job_attempt(contract: RunnerContract) -> int:
    reporter = StatusReporter(contract.namespace, contract.name, plural=PLURAL)
    try:
        try:
            spec = parse_job_spec(dict(contract.spec))
            backend = runner_backend(contract, spec)
        except H5ngffError as exc:
            reporter(runner_report(contract.attempt, "Failed", now(), exc.reason, str(exc)), True)
            return exc.exit_code
        log.info(
            "attempt %d of ConversionJob %s/%s on the %s backend",
            contract.attempt,
            contract.namespace,
            contract.name,
            backend.name,
        )
        metrics = runner_exporter(contract)
        # The outcome's patch is final: the reporter delivers it before the metrics linger.
        linger = Linger(contract.metrics_linger, until_scraped=True) if metrics is not None else Linger()
        options = AttemptOptions(metrics=metrics, linger=linger)
        result = run_attempt(spec, backend, reporter, contract.attempt, options)
        reporter.flush(10.0)
        return result.exit_code
    finally:
        reporter.close()
