"""Tenant policy: what a ConversionJob may ask the operator to run, set by the cluster admin.

The operator creates the runner Job and (through the runner) the Dask pods with its own
permissions, so whoever may create a ConversionJob could otherwise run any image, as any service
account of the namespace, with any volume (a hostPath is the node's root filesystem). The admin
sets the policy in the Helm values (``policy.*``); the chart passes it as ``h5ngff operator``
flags. A job asking for more fails at reconcile with reason ``PolicyDenied`` and nothing is
created for it.

Pure: ``policy_violations(spec, policy, default_image, default_sa) -> list[str]``; the messages say
what was asked, what is allowed and which Helm value to change.
"""

from __future__ import annotations

from dataclasses import dataclass
from fnmatch import fnmatchcase

from ..jobspec import ConversionJobSpec

#: Volume sources that reach only what the namespace already owns: its claims, config maps and
#: secrets, and scratch space. Everything else (hostPath above all, but also nfs, iscsi, or a
#: CSI inline volume) reaches storage the namespace's RBAC does not govern.
DEFAULT_VOLUME_TYPES = ("persistentVolumeClaim", "configMap", "secret", "emptyDir")


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


def volume_type(volume: dict) -> str:
    """The source type of a PodSpec volume (its one key besides ``name``); a volume with none is
    an emptyDir, as Kubernetes defaults it."""
    kinds = sorted(k for k in volume if k != "name")
    return ",".join(kinds) if kinds else "emptyDir"


def image_allowed(image: str, policy: TenantPolicy, default_image: str) -> bool:
    return image == default_image or any(fnmatchcase(image, pattern) for pattern in policy.allowed_images)


def policy_violations(spec: ConversionJobSpec, policy: TenantPolicy, default_image: str, default_sa: str | None) -> list[str]:
    """Every way ``spec`` asks for more than ``policy`` allows; [] when it may run."""
    out = []
    pod = spec.pod
    if pod.image is not None and not image_allowed(pod.image, policy, default_image):
        patterns = f" and images matching {list(policy.allowed_images)}" if policy.allowed_images else ""
        out.append(f"spec.pod.image {pod.image!r} is not allowed: allowed are the operator's image {default_image!r}{patterns}. "
                   f"Leave spec.pod.image out, or ask the cluster admin to add a pattern to the Helm value policy.allowedImages.")
    account = pod.service_account_name
    allowed_accounts = [a for a in (default_sa, *policy.allowed_service_accounts) if a]
    if account is not None and account not in allowed_accounts:
        out.append(f"spec.pod.serviceAccountName {account!r} is not allowed: allowed are {allowed_accounts or 'none'}. "
                   f"Leave it out to run as the runner account, or ask the cluster admin to add it to the Helm value policy.allowedServiceAccounts.")
    for volume in pod.volumes or ():
        kind = volume_type(volume)
        if kind not in policy.allowed_volume_types:
            out.append(f"spec.pod.volumes {volume.get('name')!r} is a {kind} volume, which is not allowed: allowed are "
                       f"{list(policy.allowed_volume_types)}. Ask the cluster admin to add it to the Helm value policy.allowedVolumeTypes.")
    return out
