"""Tenant policy: what a ConversionJob may ask the operator to run, set by the cluster admin.

The operator creates the runner Job and (through the runner) the Dask pods with its own
permissions, so whoever may create a ConversionJob could otherwise run any image, as any service
account of the namespace, with any volume (a hostPath is the node's root filesystem), on any
node a toleration opens (a taint keeps nodes for someone: a team's GPUs, the control plane). The admin
sets the policy in the Helm values (``policy.*``); the chart passes it as ``h5ngff operator``
flags. A job asking for more fails at reconcile with reason ``PolicyDenied`` and nothing is
created for it.

Pure: ``policy_violations(spec, policy, default_image, default_sa) -> list[str]``; the messages say
what was asked, what is allowed and which Helm value to change. ``daskpolicy`` checks a
DaskCluster the same way.
"""

from __future__ import annotations

import posixpath
import re
from dataclasses import dataclass
from fnmatch import fnmatchcase
from typing import Any

from ...jobspec import ConversionJobSpec
from ...k8s import SCRATCH_PATH

#: Volume sources that reach only what the namespace already owns: its claims, config maps and
#: secrets, and scratch space. Everything else (hostPath above all, but also nfs, iscsi, or a
#: CSI inline volume) reaches storage the namespace's RBAC does not govern.
DEFAULT_VOLUME_TYPES = ("persistentVolumeClaim", "configMap", "secret", "emptyDir")


#: Where the image keeps what every process runs: the interpreter and h5ngff's packages
#: (docker/Dockerfile: the python image installs into /usr/local, pip into
#: /usr/local/lib/python3.X/site-packages), the system libraries jemalloc is preloaded from, the
#: dynamic loader's and Python's configuration (/etc), and the kernel's and kubelet's files (the
#: service-account token is under /var/run/secrets). A volume mounted at or under one of these (a
#: ConfigMap as ``sitecustomize.py`` with subPath, say), or over one of them (``/``, ``/var``),
#: replaces code the runner runs with its service-account token. Not a Helm value: no conversion
#: needs its data there.
SYSTEM_PATHS = (
    "/bin",
    "/sbin",
    "/lib",
    "/lib32",
    "/lib64",
    "/libx32",
    "/usr",
    "/etc",
    "/opt",
    "/boot",
    "/root",
    "/proc",
    "/sys",
    "/dev",
    "/run",
    "/var/run",
)


def normal_mount_path(path: str) -> str | None:
    """``path`` as the container runtime resolves it (``//``, ``/./`` and a trailing ``/``
    collapsed), or None when it has a ``..`` component, which could climb anywhere."""
    if ".." in path.split("/"):
        return None
    return posixpath.normpath("/" + re.sub("/+", "/", path).lstrip("/"))


def system_mount(path: str) -> bool:
    """True when a volume at ``path`` would cover or replace part of the image (SYSTEM_PATHS)."""
    norm = normal_mount_path(path)
    if norm is None:
        return True
    return image_path(norm) or any(p.startswith(norm.rstrip("/") + "/") for p in SYSTEM_PATHS)


def image_path(path: str) -> bool:
    """True when ``path`` lies under SYSTEM_PATHS, where no tenant volume can be (see above)."""
    norm = normal_mount_path(path) if path.startswith("/") else None
    return norm is not None and any(norm == p or norm.startswith(p + "/") for p in SYSTEM_PATHS)


def mount_violation(where: str, mount: dict[str, Any]) -> str | None:
    path = str(mount.get("mountPath") or "")
    if not system_mount(path):
        return None
    return (
        f"{where} {mount.get('name')!r} at mountPath {path!r} is not allowed: no volume may be mounted at, under or over "
        f"the image's system paths {list(SYSTEM_PATHS)} (nor at a path with '..'), because it would replace code the pods "
        f"run. Mount data elsewhere (/data, say)."
    )


def home_violation(mount: dict[str, Any], volumes: list[dict[str, Any]]) -> str | None:
    """HOME is the scratch directory (k8s.with_scratch), and Python, Dask and the AWS SDK load
    code and config from it at start: ~/.local (user site-packages: ``.pth`` files and
    usercustomize run in the runner, which holds a token), ~/.config/dask (preload), ~/.aws
    (``credential_process``). A volume whose content the tenant writes may not be mounted
    there; an emptyDir (fresh at every start) may."""
    norm = normal_mount_path(str(mount.get("mountPath") or ""))
    if norm is None or not (norm == SCRATCH_PATH or norm.startswith(SCRATCH_PATH + "/.")):
        return None
    volume = next((v for v in volumes if v.get("name") == mount.get("name")), {})
    if volume_type(volume) == "emptyDir":
        return None
    return (
        f"spec.pod.volumeMounts {mount.get('name')!r} at mountPath {mount.get('mountPath')!r} is not allowed: {SCRATCH_PATH} is "
        f"the pods' HOME, where Python, Dask and the AWS SDK read start-up code and config (~/.local, ~/.config, ~/.aws); only "
        f"an emptyDir may be mounted there or on its dot-directories. Mount the {volume_type(volume)} volume elsewhere."
    )


@dataclass(frozen=True)
class TenantPolicy:
    """What a ConversionJob's ``spec.pod`` may ask for, beyond the operator's own defaults."""

    #: Image patterns (shell globs, ``*`` matches across ``/``: ``registry.example.org/lab/*``)
    #: a job's ``spec.pod.image`` may name. The operator's own ``--image`` is always allowed.
    #: Default none: an image runs with the runner's service account, which may create pods; a
    #: tenant's own image is a choice for the admin, not for the tenant.
    allowed_images: tuple[str, ...] = ()
    #: Service accounts a job's ``spec.pod.serviceAccountName`` may name. The chart's runner
    #: account (``--runner-service-account``) is always allowed. Default none: another account of
    #: the namespace may hold permissions (a CI deployer's, say) the job's author lacks.
    allowed_service_accounts: tuple[str, ...] = ()
    #: Volume source types (PodSpec field names) ``spec.pod.volumes`` may use.
    allowed_volume_types: tuple[str, ...] = DEFAULT_VOLUME_TYPES
    #: Taint keys (shell globs) ``spec.pod.tolerations`` may tolerate. Default none: a taint is
    #: how an admin keeps nodes for someone (a team's GPU nodes, the control plane), and a
    #: toleration is the key to them; ``*`` allows any key, and only it allows a toleration
    #: without a key, which tolerates every taint.
    allowed_toleration_keys: tuple[str, ...] = ()


def volume_type(volume: dict[str, Any]) -> str:
    """The source type of a PodSpec volume (its one key besides ``name``); a volume with none is
    an emptyDir, as Kubernetes defaults it."""
    kinds = sorted(k for k in volume if k != "name")
    return ",".join(kinds) if kinds else "emptyDir"


def image_allowed(image: str, policy: TenantPolicy, default_image: str) -> bool:
    return image == default_image or any(fnmatchcase(image, pattern) for pattern in policy.allowed_images)


def policy_violations(
    spec: ConversionJobSpec, policy: TenantPolicy, default_image: str, default_sa: str | None
) -> list[str]:
    """Every way ``spec`` asks for more than ``policy`` allows; [] when it may run."""
    out = []
    pod = spec.pod
    if pod.image is not None and not image_allowed(pod.image, policy, default_image):
        patterns = f" and images matching {list(policy.allowed_images)}" if policy.allowed_images else ""
        out.append(
            f"spec.pod.image {pod.image!r} is not allowed: allowed are the operator's image {default_image!r}{patterns}. "
            f"Leave spec.pod.image out, or ask the cluster admin to add a pattern to the Helm value policy.allowedImages."
        )
    account = pod.service_account_name
    allowed_accounts = [a for a in (default_sa, *policy.allowed_service_accounts) if a]
    if account is not None and account not in allowed_accounts:
        out.append(
            f"spec.pod.serviceAccountName {account!r} is not allowed: allowed are {allowed_accounts or 'none'}. "
            f"Leave it out to run as the runner account, or ask the cluster admin to add it to the Helm value policy.allowedServiceAccounts."
        )
    for volume in pod.volumes or ():
        kind = volume_type(volume)
        if kind not in policy.allowed_volume_types:
            out.append(
                f"spec.pod.volumes {volume.get('name')!r} is a {kind} volume, which is not allowed: allowed are "
                f"{list(policy.allowed_volume_types)}. Ask the cluster admin to add it to the Helm value policy.allowedVolumeTypes."
            )
    for mount in pod.volume_mounts or ():
        message = mount_violation("spec.pod.volumeMounts", mount) or home_violation(mount, pod.volumes or [])
        if message:
            out.append(message)
    for toleration in pod.tolerations or ():
        key = str(toleration.get("key") or "")
        if not any(fnmatchcase(key, pattern) for pattern in policy.allowed_toleration_keys):
            what = f"taint key {key!r}" if key else "every taint (it names no key)"
            allowed = list(policy.allowed_toleration_keys) or "none"
            out.append(
                f"spec.pod.tolerations {toleration!r} tolerates {what}, which is not allowed: allowed keys are {allowed}. "
                f"Taints keep nodes for others; ask the cluster admin to add the key to the Helm value "
                f"policy.allowedTolerationKeys."
            )
    return out
