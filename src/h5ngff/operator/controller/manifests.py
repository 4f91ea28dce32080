"""Pure builders for what the controller creates: the runner Job of each attempt and its RBAC.

The Dask cluster's manifests (scheduler and worker pods sized by the plan) are built by the
runner, in ``h5ngff.backends.kubernetes``: only the runner knows the plan, because only its pod
can open the HDF5 file. Names, labels, owner references and the pod conventions come from
``h5ngff.k8s``, which both use, so the operator's cleanup finds everything the runner made. What
the runner pod is told is one value, ``operator.contract.RunnerContract``, as its environment.
"""

from __future__ import annotations

from typing import Any, Sequence

from ... import __version__
from ...jobspec import API_VERSION, BATCH_KIND, GROUP, KIND, PLURAL, VERSION, ConversionJobSpec, Owner
from ...k8s import (
    LABEL_ATTEMPT,
    LABEL_JOB,
    child_name,
    container_storage,
    credential_env,
    dask_cluster_name,
    env_list,
    labels,
    owner_reference,
    pod_placement,
    runner_job_name,
    with_scratch,
)
from ...units import GiB, k8s_quantity
from ..contract import RunnerContract
from ..schema.rbac import RUNNER_BATCH_RULES, RUNNER_JOB_RULES, role_rules

__all__ = [
    "GROUP",
    "VERSION",
    "PLURAL",
    "KIND",
    "API_VERSION",
    "LABEL_JOB",
    "LABEL_ATTEMPT",
    "Owner",
    "runner_job_name",
    "dask_cluster_name",
    "build_runner_job",
    "runner_contract",
    "labels",
    "owner_reference",
    "runner_account",
    "build_runner_role",
    "build_runner_role_binding",
]

#: Where the h5ngff image is published (helm/h5ngff/values.yaml's image.repository).
IMAGE_REPOSITORY = "ghcr.io/h5ngff/h5ngff"
#: Image of runner and Dask pods when neither the ConversionJob nor ``--image`` names one: this
#: release's, as the chart's default (appVersion) and manifests/ pin it. Not ``latest``: the
#: operator allows a job's pod.image only when it equals this, so the examples' pinned image
#: was refused (PolicyDenied), and ``latest`` would run another release's runner.
DEFAULT_IMAGE = f"{IMAGE_REPOSITORY}:{__version__}"
#: The runner service account the Helm chart (and manifests/h5ngff.yaml) creates and passes as
#: ``--runner-service-account``: what ``h5ngff operator render`` assumes unless told otherwise,
#: so it renders a job as the chart's operator would.
CHART_RUNNER_ACCOUNT = "h5ngff-runner"
#: The runner plans (HDF5 metadata only) and drives the conversion: it holds the manifest and a
#: few thousand futures, never slab data. 1 GiB is several times what that takes.
RUNNER_MEMORY = 1 * GiB
#: Requested, not limited: planning and task submission are short CPU bursts, and a CPU limit
#: would only throttle them.
RUNNER_CPU_REQUEST = "250m"
#: The runner's program, given as the container's ``args`` (no ``command``): the image's
#: entrypoint, tini, stays PID 1 and runs it, as in the operator and the Dask pods. A ``command``
#: replaces the entrypoint, and the runner then ran as PID 1 without tini (issue 43).
RUNNER_COMMAND = ["h5ngff", "runner"]
#: The runner serves the job's Prometheus metrics (progress, per-worker memory) on this port; the
#: Helm chart's PodMonitor scrapes the container port named "metrics".
RUNNER_METRICS_PORT = 9465


def runner_spec(spec: ConversionJobSpec, image: str, resume: bool) -> dict[str, Any]:
    """The spec the runner gets: the image resolved, and ``overwrite`` off once an attempt has
    written slabs, because a retry must resume the partial output, not wipe it."""
    pod = spec.pod.model_copy(update={"image": image})
    update: dict[str, Any] = {"pod": pod}
    if resume and spec.output.overwrite:
        update["output"] = spec.output.model_copy(update={"overwrite": False})
    return spec.model_copy(update=update).to_wire()


def runner_contract(
    owner: Owner,
    spec: ConversionJobSpec,
    attempt: int,
    image: str,
    resume: bool = False,
    items: Sequence[str] = (),
    resume_items: Sequence[str] = (),
) -> RunnerContract:
    """What the runner of one attempt is told: who it reports to, the spec it converts (for a
    batch: which items, and which of them it resumes)."""
    return RunnerContract(
        kind=owner.kind,
        namespace=owner.namespace,
        name=owner.name,
        uid=owner.uid,
        attempt=attempt,
        spec=runner_spec(spec, image, resume and owner.kind != BATCH_KIND),
        items=tuple(items),
        resume=tuple(resume_items),
        metrics_port=RUNNER_METRICS_PORT,
    )


def build_runner_job(
    owner: Owner,
    spec: ConversionJobSpec,
    attempt: int,
    default_image: str,
    resume: bool = False,
    default_service_account: str | None = None,
    items: Sequence[str] = (),
    resume_items: Sequence[str] = (),
) -> dict[str, Any]:
    """The ``batch/v1`` Job of one attempt. It never retries by itself (``backoffLimit: 0``): the
    operator decides about retries, because only it can tell an OOM (retry) from a bad input
    (do not), and it records why each attempt failed."""
    image = spec.pod.image or default_image
    name = runner_job_name(owner.name, attempt)
    meta_labels = labels(owner.name, "runner", attempt)
    memory = k8s_quantity(RUNNER_MEMORY)
    contract = runner_contract(owner, spec, attempt, image, resume, items, resume_items)
    container = {
        "name": "runner",
        "image": image,
        # args, not command: the image's entrypoint, tini, stays PID 1 and runs it (issue 43).
        "args": list(RUNNER_COMMAND),
        "env": env_list(contract.to_env()) + credential_env(spec.pod),
        "ports": [{"name": "metrics", "containerPort": RUNNER_METRICS_PORT, "protocol": "TCP"}],
        "resources": {"requests": {"memory": memory, "cpu": RUNNER_CPU_REQUEST}, "limits": {"memory": memory}},
        **container_storage(spec.pod),
    }
    pod_spec = with_scratch({"restartPolicy": "Never", "containers": [container], **pod_placement(spec.pod)})
    # The runner needs its RBAC (docs/operator.md); a job may name its own account, else the
    # operator's default (the Helm chart creates h5ngff-runner and passes it).
    account = spec.pod.service_account_name or default_service_account
    if account:
        pod_spec["serviceAccountName"] = account
    job_spec: dict[str, Any] = {
        "backoffLimit": 0,
        "template": {"metadata": {"labels": meta_labels}, "spec": pod_spec},
    }
    if spec.ttl_seconds_after_finished is not None:
        job_spec["ttlSecondsAfterFinished"] = spec.ttl_seconds_after_finished
    return {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": {
            "name": name,
            "namespace": owner.namespace,
            "labels": meta_labels,
            "ownerReferences": [owner_reference(API_VERSION, owner.kind, owner.name, owner.uid)],
        },
        "spec": job_spec,
    }


def runner_account(spec: ConversionJobSpec, default_service_account: str | None) -> str:
    """The service account the runner pod runs as (Kubernetes' ``default`` when none is named)."""
    return spec.pod.service_account_name or default_service_account or "default"


def runner_role_name(job_name: str) -> str:
    return child_name(job_name, "runner-status")


def build_runner_role(owner: Owner) -> dict[str, Any]:
    """The Role letting a runner patch the status of its own ConversionJob and no other
    (``resourceNames``); owned by the job, so it goes when the job goes."""
    return {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "Role",
        "metadata": {
            "name": runner_role_name(owner.name),
            "namespace": owner.namespace,
            "labels": labels(owner.name, "runner"),
            "ownerReferences": [owner_reference(API_VERSION, owner.kind, owner.name, owner.uid)],
        },
        "rules": role_rules(
            RUNNER_JOB_RULES if owner.kind == KIND else RUNNER_BATCH_RULES, resource_names=[owner.name]
        ),
    }


def build_runner_role_binding(owner: Owner, account: str) -> dict[str, Any]:
    """Binds :func:`build_runner_role` to the service account the runner pod runs as."""
    name = runner_role_name(owner.name)
    return {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "RoleBinding",
        "metadata": {
            "name": name,
            "namespace": owner.namespace,
            "labels": labels(owner.name, "runner"),
            "ownerReferences": [owner_reference(API_VERSION, owner.kind, owner.name, owner.uid)],
        },
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": name},
        "subjects": [{"kind": "ServiceAccount", "name": account, "namespace": owner.namespace}],
    }
