"""The one place that turns a backend's name and options into a ``Backend``.

Every entry point builds its backend here: the CLI (``convert``, ``plan``, ``run``) from its
flags, the Kubernetes runner Job from ``$H5NGFF_BACKEND``. Adding a backend is one entry in
``BACKENDS`` (plus the module that implements ``base.Backend``, and its class in the contract
suite, tests/test_backend_contract.py); docs/backends.md says how. The entry also says whether
the backend starts its own workers for each run (``owns_workers``): the runner Job accepts only
those, and the contract checks that such a backend sizes its workers by the plan and stops them.

Each builder imports its module only when called: the kubernetes backend pulls in kr8s and
dask-kubernetes lazily, and a laptop running ``h5ngff convert`` needs neither.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

from ..errors import SpecError
from .base import Backend

if TYPE_CHECKING:
    from ..jobspec import Owner, PodSettings
    from ..spec import SlurmSpec


@dataclass(frozen=True)
class BackendOptions:
    """What the builders may need; each reads only its own fields."""

    #: external: the scheduler's address (tcp://host:8786).
    scheduler: str | None = None
    #: local-pods: replaces the planned pod limit (experiments and negative controls), bytes.
    pod_limit: int | None = None
    #: kubernetes: the ConversionJob the DaskCluster belongs to (None: planning only, as
    #: ``h5ngff plan --kubernetes`` does).
    owner: Owner | None = None
    #: kubernetes: the image of the scheduler and worker pods.
    image: str = ""
    #: kubernetes: the job's spec.pod (volumes, placement, pull policy).
    pod: PodSettings | None = None
    #: slurm: the slurm: block (partition, account, walltime, ...), flags merged in.
    slurm: SlurmSpec | None = None
    #: slurm: replaces the planned job --mem (experiments and negative controls), bytes.
    job_mem: int | None = None


BackendBuilder = Callable[[BackendOptions], Backend]


@dataclass(frozen=True)
class BackendKind:
    build: BackendBuilder
    #: True where ``session`` starts the workers itself, sized by the plan (its memory_limit,
    #: threads and Dask thresholds), and stops every worker process when it exits. False for a
    #: cluster that exists before and after the session: the plan is fitted to its workers
    #: (``Backend.fit``) and the session leaves them running.
    owns_workers: bool


def _local(options: BackendOptions) -> Backend:
    from .local import LocalBackend

    return LocalBackend()


def _local_pods(options: BackendOptions) -> Backend:
    from .local import LocalPodsBackend

    return LocalPodsBackend(pod_limit=options.pod_limit)


def _external(options: BackendOptions) -> Backend:
    from .external import ExternalBackend

    if not options.scheduler:
        raise SpecError(
            "--scheduler", "Expected the address of a running Dask scheduler (tcp://host:8786). Got nothing instead."
        )
    return ExternalBackend(options.scheduler)


def _kubernetes(options: BackendOptions) -> Backend:
    from ..jobspec import Owner
    from .kubernetes import KubernetesBackend

    owner = options.owner or Owner("", "plan", "")
    return KubernetesBackend(owner, image=options.image, pod=options.pod)


def _slurm(options: BackendOptions) -> Backend:
    from .slurm import SlurmBackend  # dask-jobqueue loads only where SLURM is asked for

    return SlurmBackend(options.slurm, job_mem=options.job_mem)


#: Every backend, by the name ``--backend``-like settings use ($H5NGFF_BACKEND in the runner Job).
#: Register a new backend here (one line) and nowhere else.
BACKENDS: dict[str, BackendKind] = {
    "local": BackendKind(_local, owns_workers=True),
    "local-pods": BackendKind(_local_pods, owns_workers=True),
    "external": BackendKind(_external, owns_workers=False),
    "kubernetes": BackendKind(_kubernetes, owns_workers=True),
    "slurm": BackendKind(_slurm, owns_workers=True),
}


def make_backend(kind: str, options: BackendOptions | None = None) -> Backend:
    """The backend called ``kind``, built from ``options``."""
    entry = BACKENDS.get(kind)
    if entry is None:
        raise SpecError("backend", f"Expected one of {', '.join(BACKENDS)}. Got {kind!r} instead.")
    return entry.build(options or BackendOptions())


def owning_kinds() -> list[str]:
    """The backends that start their own workers for each run (what a runner Job may use)."""
    return [kind for kind, entry in BACKENDS.items() if entry.owns_workers]
