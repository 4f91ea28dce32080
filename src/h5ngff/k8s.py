"""Kubernetes conventions shared by the operator and the kubernetes backend: object names, labels,
owner references, and the shape every h5ngff pod has (security contexts, the scratch volume,
a user's spec.pod placement and storage).

Neutral ground: the operator builds the runner Job with these and finds what the runner made by
them; the kubernetes backend, in the runner pod, builds the DaskCluster with the same. Neither
imports the other for them. Pure functions of their arguments (no Kubernetes client here).
"""

from __future__ import annotations

import hashlib
from typing import Any

from .jobspec import GROUP, SCRATCH_VOLUME, PodSettings

LABEL_JOB = f"{GROUP}/conversionjob"
LABEL_ATTEMPT = f"{GROUP}/attempt"
LABEL_COMPONENT = "app.kubernetes.io/component"
#: Kubernetes object names that end up in DNS labels and pod labels must fit 63 characters.
MAX_NAME = 63
#: dask-kubernetes names worker pods ``<cluster>-default-worker-<10 hex>`` (26 more characters).
MAX_CLUSTER_NAME = MAX_NAME - len("-default-worker-0123456789")
#: The image's non-root user and group (docker/Dockerfile's ``USER 10001:10001``; a test keeps
#: them equal). Named numerically because kubelet can verify ``runAsNonRoot`` only for a numeric
#: user: an image naming its user by name would be refused to start.
RUN_AS_USER = 10001
RUN_AS_GROUP = 10001
#: The writable scratch directory of every container: the root filesystem is read-only, and
#: Python's tempfile, matplotlib's and Dask's config caches, and a Dask worker's local directory
#: (where it spills, ``dask-scratch-space``) all write under /tmp. Disk-backed, not memory-backed:
#: a tmpfs would charge spilled data to the very pod memory limit the plan sizes.
SCRATCH_PATH = "/tmp"
#: The environment variables naming the ConversionJob (or ConversionBatch) of a runner pod: part
#: of its runner contract (operator/contract.py), and what the metrics exporter labels its series
#: with (metrics/exporter.py; ``h5ngff convert`` reads them too).
JOB_NAME_ENV = "H5NGFF_JOB_NAME"
JOB_NAMESPACE_ENV = "H5NGFF_JOB_NAMESPACE"


def child_name(base: str, suffix: str, limit: int = MAX_NAME) -> str:
    """``<base>-<suffix>``, shortened with a hash of ``base`` when too long, so names stay unique
    and deterministic (an operator restart must find the same child, not create a twin)."""
    name = f"{base}-{suffix}"
    if len(name) <= limit:
        return name
    digest = hashlib.sha256(base.encode()).hexdigest()[:8]
    keep = limit - len(suffix) - len(digest) - 2
    return f"{base[:keep].rstrip('-.')}-{digest}-{suffix}"


def label_value(name: str) -> str:
    """Label values are limited to 63 characters too (object names to 253): hash the rest."""
    if len(name) <= MAX_NAME:
        return name
    return f"{name[: MAX_NAME - 9].rstrip('-.')}-{hashlib.sha256(name.encode()).hexdigest()[:8]}"


def dask_cluster_name(job_name: str) -> str:
    return child_name(job_name, "dask", MAX_CLUSTER_NAME)


def runner_job_name(job_name: str, attempt: int) -> str:
    """``<job>-runner-<attempt>``: deterministic, so a restarted operator finds, not duplicates, it."""
    return child_name(job_name, f"runner-{attempt}")


def labels(job_name: str, component: str, attempt: int | None = None) -> dict[str, str]:
    """The labels every child of a ConversionJob carries (selectors and cleanup use them)."""
    out = {
        "app.kubernetes.io/name": "h5ngff",
        "app.kubernetes.io/managed-by": "h5ngff",
        LABEL_COMPONENT: component,
        LABEL_JOB: label_value(job_name),
    }
    if attempt is not None:
        out[LABEL_ATTEMPT] = str(attempt)
    return out


def owner_reference(api_version: str, kind: str, name: str, uid: str, block: bool = True) -> dict[str, Any]:
    """Makes the child garbage-collected with its ConversionJob."""
    return {
        "apiVersion": api_version,
        "kind": kind,
        "name": name,
        "uid": uid,
        "controller": True,
        "blockOwnerDeletion": block,
    }


#: The scheduler container's probes (its dashboard's /health); the workers have none. Here, not in
#: backends/kubernetes.py, because the operator's guard (operator/schema/policy.py) holds a DaskCluster's
#: probes to exactly these: an ``exec`` probe runs a command, and ``httpGet.host`` makes the kubelet
#: send requests from the node's network.
SCHEDULER_PROBES: dict[str, dict[str, Any]] = {
    "readinessProbe": {
        "httpGet": {"port": "http-dashboard", "path": "/health"},
        "initialDelaySeconds": 0,
        "periodSeconds": 1,
        "timeoutSeconds": 300,
    },
    "livenessProbe": {
        "httpGet": {"port": "http-dashboard", "path": "/health"},
        "initialDelaySeconds": 15,
        "periodSeconds": 20,
    },
}


def pod_placement(pod: PodSettings) -> dict[str, Any]:
    """The pod-level fields a user's ``spec.pod`` contributes to every pod."""
    out: dict[str, Any] = {}
    if pod.volumes:
        out["volumes"] = [dict(v) for v in pod.volumes]
    if pod.node_selector:
        out["nodeSelector"] = dict(pod.node_selector)
    if pod.tolerations:
        out["tolerations"] = [dict(t) for t in pod.tolerations]
    return out


def container_storage(pod: PodSettings) -> dict[str, Any]:
    out: dict[str, Any] = {}
    if pod.volume_mounts:
        out["volumeMounts"] = [dict(m) for m in pod.volume_mounts]
    if pod.working_dir:
        out["workingDir"] = pod.working_dir
    if pod.image_pull_policy:
        out["imagePullPolicy"] = pod.image_pull_policy
    return out


#: The environment variables an S3 output's credentials may set, the only keys of a job's
#: ``credentialsSecret`` that reach a container: what obstore and ``engine/stores`` (s3.py,
#: awsconfig.py) read for credentials, region and endpoint. Named keys, never the whole Secret
#: (``envFrom``): a Secret the tenant writes could otherwise set LD_PRELOAD or PYTHONPATH in the
#: runner, which holds a service-account token. AWS_CONFIG_FILE and AWS_SHARED_CREDENTIALS_FILE
#: are left out on purpose: they name files, and a profile's ``credential_process`` runs a command.
CREDENTIAL_ENV = (
    "AWS_ACCESS_KEY_ID",
    "AWS_SECRET_ACCESS_KEY",
    "AWS_SESSION_TOKEN",
    "AWS_REGION",
    "AWS_DEFAULT_REGION",
    "AWS_ENDPOINT_URL",
    "AWS_ENDPOINT_URL_S3",
    "AWS_ALLOW_HTTP",
)


def credential_env(pod: PodSettings) -> list[dict[str, Any]]:
    """``env`` entries taking each of :data:`CREDENTIAL_ENV` from the job's credentials Secret.

    A secretKeyRef has no namespace field: the kubelet reads the Secret from the pod's own
    namespace, so a tenant can only ever name its own Secrets, and the operator never reads it
    (no Secret RBAC). ``optional``: a Secret holds only some of the keys (no session token, no
    endpoint for AWS itself); Kubernetes then also starts the pod when the Secret itself is
    missing, and the runner's S3 check fails the attempt with "no AWS credentials"."""
    if not pod.credentials_secret:
        return []
    return [
        {"name": key, "valueFrom": {"secretKeyRef": {"name": pod.credentials_secret, "key": key, "optional": True}}}
        for key in CREDENTIAL_ENV
    ]


def pod_security_context() -> dict[str, Any]:
    """The pod-level half of the ``restricted`` Pod Security Standard: a numeric non-root user
    and the runtime's default seccomp profile. No fsGroup: a recursive chown of a large data
    volume at every pod start would cost minutes, and the image's user 10001 is what wrote the
    output before this context existed."""
    return {
        "runAsNonRoot": True,
        "runAsUser": RUN_AS_USER,
        "runAsGroup": RUN_AS_GROUP,
        "seccompProfile": {"type": "RuntimeDefault"},
    }


def container_security_context() -> dict[str, Any]:
    """The container-level half: no privilege escalation, no capabilities (h5ngff binds no port
    below 1024 and changes no file ownership), and a read-only root filesystem (writes go to the
    scratch volume and the user's volumes)."""
    return {
        "allowPrivilegeEscalation": False,
        "capabilities": {"drop": ["ALL"]},
        "readOnlyRootFilesystem": True,
        "runAsNonRoot": True,
        "seccompProfile": {"type": "RuntimeDefault"},
    }


#: Every container h5ngff starts runs Python with this set (``python -P``'s variable, 3.11+): the
#: working directory (``spec.pod.workingDir``, on a tenant's volume) is never put first on the
#: import path, so a package the tenant left there cannot run in a runner, scheduler or worker.
#: The Dask nanny starts each worker with ``python -c``, which would put it there (issue 41).
SAFE_PATH_ENV = {"PYTHONSAFEPATH": "1"}


def with_scratch(pod_spec: dict[str, Any]) -> dict[str, Any]:
    """Give every container of ``pod_spec`` the pod's scratch emptyDir at /tmp (unless the user
    mounts something there already), HOME=/tmp and PYTHONSAFEPATH=1, and set the restricted
    security contexts."""
    containers = pod_spec["containers"]
    needs_scratch = False
    for c in containers:
        c["securityContext"] = container_security_context()
        if not any(m.get("mountPath") == SCRATCH_PATH for m in c.get("volumeMounts") or ()):
            c["volumeMounts"] = [*(c.get("volumeMounts") or ()), {"name": SCRATCH_VOLUME, "mountPath": SCRATCH_PATH}]
            needs_scratch = True
        env = c.setdefault("env", [])
        if not any(e.get("name") == "HOME" for e in env):
            env.append({"name": "HOME", "value": SCRATCH_PATH})  # ~/.config/dask and friends
        for name, value in SAFE_PATH_ENV.items():
            if not any(e.get("name") == name for e in env):
                env.append({"name": name, "value": value})
    if needs_scratch:
        pod_spec["volumes"] = [*(pod_spec.get("volumes") or ()), {"name": SCRATCH_VOLUME, "emptyDir": {}}]
    pod_spec["securityContext"] = pod_security_context()
    return pod_spec


def env_list(env: dict[str, str]) -> list[dict[str, str]]:
    return [{"name": k, "value": str(v)} for k, v in sorted(env.items())]
