"""``h5ngff operator render job.yaml``: the objects the operator would create for a manifest (the
CLI side of the operator: it plans, so it may use the backends; the controller never does).

For review and diffs in GitOps: the runner Job of attempt 1, the Role and RoleBinding that let
that runner patch its own job's status, and (with ``plan=True``, which opens the HDF5 file)
the DaskCluster the runner would create, sized by the plan. A ConversionBatch gives the same
three objects (its runner Job running every item), without the DaskCluster: the batch's runner
sizes it by its largest item at run time. Everything comes from the same pure
builders the operator and the runner use; nothing here builds a manifest of its own.

The ConversionJob's uid is not known before the API server creates it: ownerReferences carry
the manifest's ``metadata.uid`` when it has one, else ``PLACEHOLDER_UID``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from .backends.factory import BackendOptions, make_backend
from .backends.kubernetes import build_dask_cluster
from .errors import PolicyDeniedError
from .job import JobManifest
from .jobspec import BATCH_KIND
from .operator.controller.manifests import (
    DEFAULT_IMAGE,
    Owner,
    build_runner_job,
    build_runner_role,
    build_runner_role_binding,
    runner_account,
)
from .operator.schema.batchspec import ConversionBatchSpec
from .operator.schema.policy import TenantPolicy, policy_violations

#: ownerReferences need the ConversionJob's uid, which only the API server assigns.
PLACEHOLDER_UID = "00000000-0000-0000-0000-000000000000"
#: Where the h5ngff image keeps jemalloc (docker/Dockerfile's H5NGFF_JEMALLOC; a test keeps them
#: equal): the worker pods' LD_PRELOAD, as the runner in that image would plan it.
IMAGE_JEMALLOC = "/usr/local/lib/libjemalloc.so.2"


@dataclass(frozen=True)
class RenderOptions:
    """The operator's settings that shape what it creates (its command-line flags)."""

    image: str = DEFAULT_IMAGE
    runner_service_account: str | None = None
    policy: TenantPolicy = field(default_factory=TenantPolicy)
    #: Namespace for a manifest that names none (kubectl's current namespace, in effect).
    namespace: str = "default"
    #: Also plan (opens the HDF5 file) and render the DaskCluster.
    plan: bool = False


def render_objects(manifest: JobManifest, opts: RenderOptions) -> list[dict[str, Any]]:
    """The Role, RoleBinding and runner Job (and with ``opts.plan`` the DaskCluster) the operator
    and its runner would create for ``manifest``; raises PolicyDeniedError as the operator would
    refuse it (reason PolicyDenied)."""
    spec = manifest.spec
    denial = policy_violations(spec, opts.policy, opts.image, opts.runner_service_account)
    if denial:
        raise PolicyDeniedError("spec.pod", "; ".join(denial))
    namespace = manifest.namespace or opts.namespace
    uid = (manifest.raw.get("metadata") or {}).get("uid") or PLACEHOLDER_UID
    owner = Owner(namespace, manifest.name, uid)
    objects = [
        build_runner_role(owner),
        build_runner_role_binding(owner, runner_account(spec, opts.runner_service_account)),
        build_runner_job(owner, spec, 1, opts.image, default_service_account=opts.runner_service_account),
    ]
    if opts.plan:
        objects.append(_dask_cluster(manifest, owner, opts))
    return objects


def render_batch_objects(
    spec: ConversionBatchSpec, name: str, namespace: str | None, uid: str | None, opts: RenderOptions
) -> list[dict[str, Any]]:
    """The Role, RoleBinding and runner Job of attempt 1 the operator would create for a
    ConversionBatch, its every item in the attempt (as when no other job holds their outputs);
    raises PolicyDeniedError as the operator would refuse it."""
    denial = policy_violations(spec, opts.policy, opts.image, opts.runner_service_account)
    if denial:
        raise PolicyDeniedError("spec.pod", "; ".join(denial))
    owner = Owner(namespace or opts.namespace, name, uid or PLACEHOLDER_UID, 1, BATCH_KIND)
    items = [p.id for p in spec.planned_items()]
    return [
        build_runner_role(owner),
        build_runner_role_binding(owner, runner_account(spec, opts.runner_service_account)),
        build_runner_job(owner, spec, 1, opts.image, default_service_account=opts.runner_service_account, items=items),
    ]


def _dask_cluster(manifest: JobManifest, owner: Owner, opts: RenderOptions) -> dict[str, Any]:
    """Plan as the runner pod would (the kubernetes backend's capacity, the image's allocator) and
    build its DaskCluster."""
    from .engine.sources.access import access_for
    from .engine.sources.hdf5 import inspect_source
    from .engine.stores import open_object_reader
    from .planner import DEFAULT_CONSTANTS, make_plan

    spec = manifest.spec
    image = spec.pod.image or opts.image
    backend = make_backend("kubernetes", BackendOptions(owner=owner, image=image, pod=spec.pod))
    access = access_for(spec.conversion(), open_object_reader)  # a source in a bucket is read from it
    dataset, _ = inspect_source(spec.source.path, spec.source.dataset, access)
    # The image preloads jemalloc, so "auto" resolves to jemalloc in the runner pod whatever this
    # machine has installed.
    allocator = "glibc" if spec.resources.allocator == "glibc" else "jemalloc"
    plan = make_plan(dataset, spec.conversion(), backend.capacity(), DEFAULT_CONSTANTS, allocator)
    return build_dask_cluster(plan, owner, image, spec.pod, allocator_library=IMAGE_JEMALLOC)
