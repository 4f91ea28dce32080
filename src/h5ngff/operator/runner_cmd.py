"""``h5ngff runner``: what the runner Job's container executes (hidden from ``h5ngff --help``).

It reads the job's spec from ``H5NGFF_SPEC`` (put there by the operator, so each attempt runs
exactly the spec it was created for), plans in the pod that can open the HDF5 file, converts on
a Dask cluster made for the run, and reports every step into the ConversionJob's status. The exit
code tells the Job controller (and so the operator) how the attempt ended: 0 done, 2 bad input,
1 anything else.

``H5NGFF_BACKEND=local`` runs the Dask cluster in the runner's own container instead of as pods:
for tests and for clusters without the Dask Operator. ``local-pods`` does the same with every
worker in its own memory cgroup at the pod limit (as ``h5ngff convert --enforce-pod-limits``), and
``H5NGFF_POD_LIMIT`` then overrides the planned limit (experiments and negative controls).
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..errors import H5ngffError, SpecError
from ..jobspec import ConversionJobSpec, parse_job_spec
from ..runner import Linger
from ..units import parse_bytes
from .attempt import AttemptOptions, run_attempt
from .batchspec import BATCH_KIND, KIND_ENV
from .manifests import BACKEND_ENV, SPEC_ENV
from .reporter import StatusReporter
from .runner_metrics import metrics_linger, runner_exporter
from .status import now, runner_report

if TYPE_CHECKING:
    from ..backends.base import Backend

log = logging.getLogger(__name__)

POD_LIMIT_ENV = "H5NGFF_POD_LIMIT"


@dataclass(frozen=True)
class RunnerArgs:
    namespace: str
    name: str
    uid: str
    attempt: int


def spec_from_env() -> ConversionJobSpec:
    text = os.environ.get(SPEC_ENV)
    if not text:
        raise SpecError(
            "", f"Expected the job's spec as JSON in ${SPEC_ENV} (the operator sets it). Got nothing instead."
        )
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise SpecError("", f"Expected JSON in ${SPEC_ENV}. Got invalid JSON instead ({exc}).") from None
    return parse_job_spec(data)


def runner_backend(args: RunnerArgs, spec: ConversionJobSpec) -> Backend:
    """The backend ``$H5NGFF_BACKEND`` names (default kubernetes), from the one factory: one
    that starts its own workers, since a runner Job makes the cluster for its attempt."""
    from ..backends.factory import BACKENDS, BackendOptions, make_backend, owning_kinds
    from ..jobspec import KIND, Owner

    kind = os.environ.get(BACKEND_ENV, "kubernetes")
    entry = BACKENDS.get(kind)
    if entry is None or not entry.owns_workers:
        kinds = owning_kinds()
        raise SpecError(
            "",
            f"Expected ${BACKEND_ENV} to be {', '.join(kinds[:-1])} or {kinds[-1]} (a backend that starts its own workers). "
            f"Got {kind!r} instead.",
        )
    limit = os.environ.get(POD_LIMIT_ENV)
    owner_kind = BATCH_KIND if os.environ.get(KIND_ENV) == BATCH_KIND else KIND
    options = BackendOptions(
        pod_limit=parse_bytes(limit) if limit else None,
        image=spec.pod.image or "",
        pod=spec.pod,
        owner=Owner(args.namespace, args.name, args.uid, args.attempt, owner_kind),
    )
    return make_backend(kind, options)


def main(args: RunnerArgs) -> int:
    if os.environ.get(KIND_ENV) == BATCH_KIND:  # a ConversionBatch's attempt (operator/batchrunner.py)
        from .batchrunner import main as batch_main

        return batch_main(args, runner_backend)
    reporter = StatusReporter(args.namespace, args.name)
    try:
        try:
            spec = spec_from_env()
            backend = runner_backend(args, spec)
        except H5ngffError as exc:
            reporter(runner_report(args.attempt, "Failed", now(), exc.reason, str(exc)), True)
            return exc.exit_code
        log.info(
            "attempt %d of ConversionJob %s/%s on the %s backend", args.attempt, args.namespace, args.name, backend.name
        )
        metrics = runner_exporter(lambda exporter, port: exporter.for_spec(spec.conversion(), port))
        # The outcome's patch is final: the reporter delivers it before the metrics linger.
        linger = Linger(metrics_linger(), until_scraped=True) if metrics is not None else Linger()
        result = run_attempt(spec, backend, reporter, args.attempt, AttemptOptions(metrics=metrics, linger=linger))
        reporter.flush(10.0)
        return result.exit_code
    finally:
        reporter.close()
