"""The tenant policy for DaskClusters: what a runner's cluster may hold (controller/guard.py runs
the check; the ValidatingAdmissionPolicy in the Helm chart refuses the same shapes at admission).

The runner's service account may create DaskClusters, and RBAC cannot say with which pods, so a
runner running an allowed image of the tenant's could otherwise start pods the policy refuses.
Pure: ``dask_cluster_violations(cluster, spec, policy, default_image, default_sa) -> list[str]``,
against what the runner of the attempt with ``spec`` builds (backends/kubernetes.py).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from ...jobspec import ConversionJobSpec, PodSettings
from ...k8s import (
    CREDENTIAL_ENV,
    SAFE_PATH_ENV,
    SCHEDULER_PROBES,
    SCRATCH_PATH,
    SCRATCH_VOLUME,
    container_security_context,
    pod_security_context,
)
from .policy import SYSTEM_PATHS, TenantPolicy, home_violation, image_allowed, image_path, mount_violation, volume_type

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


@dataclass(frozen=True)
class _Pod:
    """What a Dask pod is judged against: the attempt's ``spec.pod`` and image, the policy, and
    the pod's own volumes (an emptyDir over HOME is fine, a claim there is not)."""

    pod: PodSettings
    image: str
    policy: TenantPolicy
    default_image: str
    volumes: tuple[dict[str, Any], ...]


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
    ctx = _Pod(pod, image, policy, default_image, tuple(pod_spec.get("volumes") or ()))
    for key in CONTAINER_LISTS:
        for i, container in enumerate(pod_spec.get(key) or ()):
            out += container_violations(f"{where}.{key}[{i}] ({container.get('name')!r})", container, ctx)
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


def container_violations(where: str, container: dict[str, Any], ctx: _Pod) -> list[str]:
    out = []
    asked = container.get("image")
    if asked != ctx.image or not image_allowed(ctx.image, ctx.policy, ctx.default_image):
        out.append(f"{where} image {asked!r} is not allowed: the job's Dask pods run its image {ctx.image!r}.")
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
    for mount in container.get("volumeMounts") or ():
        message = mount_violation(f"{where}.volumeMounts", mount) or home_violation(mount, list(ctx.volumes))
        if message:
            out.append(message.replace("spec.pod.volumeMounts", f"{where}.volumeMounts"))
    return out + _env_violations(where, container, ctx.pod)


def _env_violations(where: str, container: dict[str, Any], pod: PodSettings) -> list[str]:
    out = []
    if container.get("envFrom"):
        out.append(
            f"{where}.envFrom is not allowed: a Secret's or ConfigMap's every key would become an environment variable "
            f"(LD_PRELOAD, PYTHONPATH, ...); credentials come as named keys {list(CREDENTIAL_ENV)}."
        )
    env = list(container.get("env") or ())
    expanded = expand_env(env)
    out += [
        f"{where}.env {e.get('name')!r} is not allowed: {why}" for e in env if (why := env_refusal(e, expanded, pod))
    ]
    for name, value in SAFE_PATH_ENV.items():
        if expanded.get(name) != value:
            out.append(
                f"{where}.env must set {name}={value}: the working directory (a tenant's volume) must never be on the "
                f"import path of the Dask processes (the nanny starts each worker with python -c)."
            )
    return out


#: Kubernetes' variable references in env values: ``$(NAME)`` of a variable defined earlier in the
#: list, ``$$`` for a literal ``$``.
_REFERENCE = re.compile(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_.-]*)\)")


def expand_env(env: list[dict[str, Any]]) -> dict[str, str]:
    """Each variable's value as the container sees it, after Kubernetes' ``$(VAR)`` expansion
    (a reference to a variable defined earlier is replaced by its value; an unknown one stays).
    A value is judged after expansion: ``MALLOC_ARENA_MAX='../x.so'`` then
    ``LD_PRELOAD='/usr/$(MALLOC_ARENA_MAX)'`` preloads ``/x.so`` (issue 41)."""
    values: dict[str, str] = {}
    for entry in env:
        raw = str(entry.get("value") or "") if "value" in entry else ""

        def resolve(match: re.Match[str]) -> str:
            return "$" if match.group(0) == "$$" else values.get(match.group(1), match.group(0))

        values[str(entry.get("name"))] = _REFERENCE.sub(resolve, raw)
    return values


def env_refusal(entry: dict[str, Any], expanded: dict[str, str], pod: PodSettings) -> str | None:
    """Why a Dask container's ``env`` entry is not one the builders make, or None when it is;
    values judged as the container sees them (``expanded``)."""
    name = str(entry.get("name"))
    value = expanded.get(name, "")
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
    if name in SAFE_PATH_ENV:
        return None if value == SAFE_PATH_ENV[name] else f"{name} must be {SAFE_PATH_ENV[name]!r}."
    if name == "LD_PRELOAD":
        libraries = re.split(r"[:\s]+", value.strip())
        if all(not lib or image_path(lib) for lib in libraries):
            return None
        return f"LD_PRELOAD may name only libraries of the image (under {list(SYSTEM_PATHS)}). Got {value!r} (after $(VAR) expansion)."
    if name in DASK_POD_ENV:
        return None
    return "it is none of the variables h5ngff sets, and variables such as LD_*, PYTHON* and DASK_* change what the pods run."
