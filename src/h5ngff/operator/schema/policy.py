"""Tenant policy: what a ConversionJob may ask the operator to run, set by the cluster admin.

The operator creates the runner Job and (through the runner) the Dask pods with its own
permissions, so whoever may create a ConversionJob could otherwise run any image, as any service
account of the namespace, with any volume (a hostPath is the node's root filesystem), on any
node a toleration opens (a taint keeps nodes for someone: a team's GPUs, the control plane). The admin
sets the policy in the Helm values (``policy.*``); the chart passes it as ``h5ngff operator``
flags. A job asking for more fails at reconcile with reason ``PolicyDenied`` and nothing is
created for it.

Pure: ``policy_violations(spec, policy, default_image, default_sa) -> list[str]``; the messages say
what was asked, what is allowed and which Helm value to change. ``dask_cluster_violations`` checks
a DaskCluster the same way (operator/controller/guard.py runs it): the runner's service account may create
DaskClusters, and RBAC cannot say with which pods, so a runner running an allowed image of the
tenant's could otherwise start pods the policy refuses.
"""

from __future__ import annotations

import posixpath
import re
from dataclasses import dataclass
from fnmatch import fnmatchcase
from typing import Any

from ...jobspec import ConversionJobSpec, PodSettings
from ...k8s import (
    CREDENTIAL_ENV,
    SCHEDULER_PROBES,
    SCRATCH_PATH,
    SCRATCH_VOLUME,
    container_security_context,
    pod_security_context,
)

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


# --- DaskClusters ---------------------------------------------------------------------------------

#: Plain environment variables the runner's builders give Dask containers besides HOME and
#: LD_PRELOAD (checked by value) and the credential keys: backends/allocator.py's allocator
#: settings and backends/base.py's ``dask_env(dask_memory_config(plan))``. An allow-list because
#: a deny-list misses too much: LD_*, PYTHON* and Dask config variables such as
#: DASK_DISTRIBUTED__WORKER__PRELOAD all load code. tests/test_operator_tenant_escape.py keeps it
#: in step with the builders (a cluster as the runner builds it passes).
DASK_POD_ENV = frozenset(
    {
        "MALLOC_CONF",
        "MALLOC_MMAP_THRESHOLD_",
        "MALLOC_TRIM_THRESHOLD_",
        "MALLOC_ARENA_MAX",
        "DASK_DISTRIBUTED__WORKER__MEMORY__TARGET",
        "DASK_DISTRIBUTED__WORKER__MEMORY__SPILL",
        "DASK_DISTRIBUTED__WORKER__MEMORY__PAUSE",
        "DASK_DISTRIBUTED__WORKER__MEMORY__TERMINATE",
        "DASK_DISTRIBUTED__WORKER__MEMORY__MONITOR_INTERVAL",
        "DASK_DISTRIBUTED__SCHEDULER__ALLOWED_FAILURES",
        "DASK_DISTRIBUTED__WORKER__PROFILE__ENABLED",
        "DASK_DISTRIBUTED__ADMIN__TICK__INTERVAL",
    }
)
CONTAINER_LISTS = ("containers", "initContainers", "ephemeralContainers")
#: Pod-level fields refused with a message of their own (pod_spec_violations).
HOST_NAMESPACES = ("hostNetwork", "hostPID", "hostIPC")
#: The PodSpec fields the runner's builders write (backends/kubernetes.py, k8s.pod_placement,
#: k8s.with_scratch); a Dask pod may hold no other. An allow-list, as for env, because a
#: deny-list misses too much and Kubernetes keeps adding fields: ``nodeName`` skips the scheduler
#: and the NoSchedule taints that keep pods off reserved nodes, ``priorityClassName`` preempts
#: other tenants' pods, ``schedulerName`` and ``runtimeClassName`` pick another scheduler or
#: container runtime, ``affinity`` and ``topologySpreadConstraints`` steer pods onto nodes the job
#: never asked for.
POD_SPEC_FIELDS = frozenset(
    {
        "containers",
        "volumes",
        "securityContext",
        "automountServiceAccountToken",
        "nodeSelector",
        "tolerations",
        "serviceAccountName",
        "serviceAccount",
        *HOST_NAMESPACES,
    }
)
#: The container fields the builders write. ``command`` is not one (the image's entrypoint runs
#: ``args``), nor ``lifecycle`` (hooks run commands), nor ``envFrom`` (refused with its own reason).
CONTAINER_FIELDS = frozenset(
    {
        "name",
        "image",
        "args",
        "env",
        "resources",
        "ports",
        "volumeMounts",
        "workingDir",
        "imagePullPolicy",
        "securityContext",
        "readinessProbe",
        "livenessProbe",
        "envFrom",
    }
)
#: Annotations that loosen a container's confinement, by key: the Dask Operator copies a
#: DaskCluster's annotations (and ``spec.<role>.metadata``'s) onto every pod, where
#: ``container.apparmor.security.beta.kubernetes.io/worker: unconfined`` lifts AppArmor (the
#: ``securityContext``, held to h5ngff's own, is the newer way to say the same). A deny-list, not
#: an allow-list: admission webhooks and tools annotate objects for their own bookkeeping.
CONFINEMENT_ANNOTATIONS = ("apparmor.security.beta.kubernetes.io/", "seccomp.security.alpha.kubernetes.io/")
#: The scheduler Service's fields the builders write: ``externalIPs``, ``loadBalancerIP`` or a
#: port's ``nodePort`` would reach the scheduler, which runs any code a client sends, from
#: outside the cluster as surely as a LoadBalancer would.
SERVICE_FIELDS = frozenset({"type", "selector", "ports"})
SERVICE_PORT_FIELDS = frozenset({"name", "protocol", "port", "targetPort"})


def dask_cluster_violations(
    cluster: dict[str, Any],
    spec: ConversionJobSpec | None,
    policy: TenantPolicy,
    default_image: str,
    default_sa: str | None,
) -> list[str]:
    """Every way a DaskCluster's pods differ from what the runner of the ConversionJob with
    ``spec`` builds (backends/kubernetes.py) and the policy allows; [] when it may stay.
    ``spec`` is None when no ConversionJob (with a valid spec) of the namespace owns the name."""
    name = (cluster.get("metadata") or {}).get("name")
    if spec is None:
        return [
            f"DaskCluster {name!r} is not the cluster of any ConversionJob of its namespace (a job's cluster is named after "
            f"the job, <job>-dask); only the operator's runners create DaskClusters here."
        ]
    image = spec.pod.image or default_image
    body = cluster.get("spec") or {}
    out = annotation_violations("metadata", cluster.get("metadata") or {})
    out += service_violations((body.get("scheduler") or {}).get("service") or {})
    for role in ("scheduler", "worker"):
        out += annotation_violations(f"spec.{role}.metadata", (body.get(role) or {}).get("metadata") or {})
        pod_spec = (body.get(role) or {}).get("spec")
        if pod_spec is not None:
            out += pod_spec_violations(
                f"spec.{role}.spec", pod_spec, spec.pod, image, policy, default_image, default_sa
            )
    return out


def annotation_violations(where: str, metadata: dict[str, Any]) -> list[str]:
    """Annotations the Dask Operator would copy onto the pods that loosen their confinement."""
    loosening = sorted(
        key for key in metadata.get("annotations") or {} if any(p in key for p in CONFINEMENT_ANNOTATIONS)
    )
    if not loosening:
        return []
    return [
        f"{where}.annotations {', '.join(loosening)} are not allowed: the Dask Operator copies them onto the pods, "
        f"whose AppArmor and seccomp profiles h5ngff sets in their securityContext."
    ]


def service_violations(service: dict[str, Any]) -> list[str]:
    """The scheduler's Service against the ClusterIP Service the builders write."""
    kind = service.get("type", "ClusterIP")
    out = []
    if kind != "ClusterIP":
        out.append(
            f"spec.scheduler.service.type {kind!r} is not allowed: the scheduler runs any code a client sends, so it "
            f"stays inside the cluster (ClusterIP)."
        )
    out += _unknown_fields("spec.scheduler.service", service, SERVICE_FIELDS, "the scheduler stays inside the cluster")
    for i, port in enumerate(service.get("ports") or ()):
        out += _unknown_fields(
            f"spec.scheduler.service.ports[{i}]", port, SERVICE_PORT_FIELDS, "the scheduler stays inside the cluster"
        )
    return out


def _unknown_fields(where: str, body: dict[str, Any], known: frozenset[str], why: str) -> list[str]:
    extra = sorted(k for k in body if k not in known)
    if not extra:
        return []
    return [f"{where} sets {', '.join(extra)}, which h5ngff never writes there: {why}."]


def pod_spec_violations(
    where: str,
    pod_spec: dict[str, Any],
    pod: PodSettings,
    image: str,
    policy: TenantPolicy,
    default_image: str,
    default_sa: str | None,
) -> list[str]:
    """A Dask pod spec against what ``with_scratch`` and the job's ``spec.pod`` make of it."""
    out = [
        f"{where}.{key} is not allowed: Dask pods share no host namespace."
        for key in HOST_NAMESPACES
        if pod_spec.get(key)
    ]
    out += _unknown_fields(
        where, pod_spec, POD_SPEC_FIELDS, "a Dask pod is placed and run only as its ConversionJob's spec.pod says"
    )
    for key, asked_by_job in (("nodeSelector", pod.node_selector), ("tolerations", pod.tolerations)):
        if (pod_spec.get(key) or None) != (asked_by_job or None):
            out.append(
                f"{where}.{key} {pod_spec.get(key) or '(none)'!r} is not the job's spec.pod.{key} "
                f"{asked_by_job or '(none)'!r}: Dask pods go only where their ConversionJob asks."
            )
    if len(pod_spec.get("containers") or ()) != 1:
        out.append(f"{where}.containers must be exactly one container, as h5ngff builds it.")
    if pod_spec.get("automountServiceAccountToken") is not False:
        out.append(f"{where}.automountServiceAccountToken must be false: Dask pods need no Kubernetes API access.")
    account = pod_spec.get("serviceAccountName") or pod_spec.get("serviceAccount")
    allowed_accounts = [a for a in (default_sa, pod.service_account_name, *policy.allowed_service_accounts) if a]
    if account and account not in allowed_accounts:
        out.append(f"{where}.serviceAccountName {account!r} is not allowed: allowed are {allowed_accounts or 'none'}.")
    if pod_spec.get("securityContext") != pod_security_context():
        out.append(
            f"{where}.securityContext {pod_spec.get('securityContext')!r} is not the one h5ngff sets: {pod_security_context()!r}."
        )
    out += _volume_violations(where, pod_spec.get("volumes") or (), pod, policy)
    for key in CONTAINER_LISTS:
        for i, container in enumerate(pod_spec.get(key) or ()):
            out += container_violations(
                f"{where}.{key}[{i}] ({container.get('name')!r})", container, pod, image, policy, default_image
            )
    return out


def _volume_violations(where: str, volumes: Any, pod: PodSettings, policy: TenantPolicy) -> list[str]:
    out = []
    known = [{"name": SCRATCH_VOLUME, "emptyDir": {}}, *(pod.volumes or ())]
    for volume in volumes:
        kind = volume_type(volume)
        if kind not in policy.allowed_volume_types:
            out.append(
                f"{where}.volumes {volume.get('name')!r} is a {kind} volume, which is not allowed: allowed are {list(policy.allowed_volume_types)}."
            )
        elif volume not in known:
            out.append(
                f"{where}.volumes {volume.get('name')!r} is not one of the job's spec.pod.volumes nor the scratch volume."
            )
    return out


def container_violations(
    where: str, container: dict[str, Any], pod: PodSettings, image: str, policy: TenantPolicy, default_image: str
) -> list[str]:
    out = []
    asked = container.get("image")
    if asked != image or not image_allowed(image, policy, default_image):
        out.append(f"{where} image {asked!r} is not allowed: the job's Dask pods run its image {image!r}.")
    out += _unknown_fields(where, container, CONTAINER_FIELDS, "a Dask container runs only what the runner builds")
    out += [
        f"{where}.{probe} is not the probe h5ngff writes: a probe may run a command or make the kubelet call an address of "
        f"the node's network."
        for probe in SCHEDULER_PROBES
        if probe in container and container[probe] != SCHEDULER_PROBES[probe]
    ]
    out += [
        f"{where}.ports[{i}] sets hostPort or hostIP, which is not allowed: Dask pods take no port of the node."
        for i, port in enumerate(container.get("ports") or ())
        if "hostPort" in port or "hostIP" in port
    ]
    if container.get("securityContext") != container_security_context():
        out.append(
            f"{where}.securityContext {container.get('securityContext')!r} is not the one h5ngff sets: {container_security_context()!r}."
        )
    out += [
        m
        for m in (mount_violation(f"{where}.volumeMounts", mount) for mount in container.get("volumeMounts") or ())
        if m
    ]
    if container.get("envFrom"):
        out.append(
            f"{where}.envFrom is not allowed: a Secret's or ConfigMap's every key would become an environment variable "
            f"(LD_PRELOAD, PYTHONPATH, ...); credentials come as named keys {list(CREDENTIAL_ENV)}."
        )
    out += [
        f"{where}.env {e.get('name')!r} is not allowed: {why}"
        for e in container.get("env") or ()
        if (why := env_refusal(e, pod))
    ]
    return out


def env_refusal(entry: dict[str, Any], pod: PodSettings) -> str | None:
    """Why a Dask container's ``env`` entry is not one the builders make, or None when it is."""
    name, value = entry.get("name"), entry.get("value")
    if "valueFrom" in entry:
        ref = entry["valueFrom"].get("secretKeyRef") or {}
        if (
            name in CREDENTIAL_ENV
            and list(entry["valueFrom"]) == ["secretKeyRef"]
            and ref.get("key") == name
            and ref.get("name") == pod.credentials_secret
        ):
            return None
        return f"only {list(CREDENTIAL_ENV)} may come from a Secret, each from the key of its name in the job's credentialsSecret."
    if name == "HOME":
        return None if value == SCRATCH_PATH else f"HOME must be the scratch directory {SCRATCH_PATH!r}."
    if name == "LD_PRELOAD":
        libraries = re.split(r"[:\s]+", str(value or "").strip())
        if all(not lib or image_path(lib) for lib in libraries):
            return None
        return f"LD_PRELOAD may name only libraries of the image (under {list(SYSTEM_PATHS)}). Got {value!r}."
    if name in DASK_POD_ENV:
        return None
    return "it is none of the variables h5ngff sets, and variables such as LD_*, PYTHON* and DASK_* change what the pods run."
