"""The DaskCluster ValidatingAdmissionPolicy's rules (Kubernetes 1.30, CEL): the first line of the
tenant policy for the clusters h5ngff's runners create; controller/guard.py is the second.

A runner runs an image the policy allows but code the tenant may have written, and its service
account may create DaskClusters (RBAC cannot say with which pods). The guard deleted a rogue
cluster after it was stored, while a Dask Operator watching the same events could already act on
it. This policy refuses it before it is stored: a DaskCluster created or changed by a runner's
service account must carry h5ngff's marks and hold only what daskpolicy.py allows, by the same
lists. What needs the job's spec (its image, placement and volumes) stays the guard's.

``policy_rules()`` gives the rules with four placeholders the chart fills from its values
(helm/h5ngff/templates/admission-policy.yaml): ``__IMAGES__`` and ``__IMAGE_PATTERNS__`` (the
images and patterns a job may name), ``__VOLUME_TYPES__`` and ``__ACCOUNTS__`` (the runner
service accounts' name pattern). Standard CEL only (``matches``, macros over lists and maps), so
tests/test_admission_policy.py evaluates the rendered rules with cel-python.
"""

from __future__ import annotations

import re
from typing import Any

from ...jobspec import BATCH_KIND, GROUP, KIND, MOUNT_PATH_PATTERN
from ...k8s import CREDENTIAL_ENV, SAFE_PATH_ENV, SCRATCH_PATH
from .daskpolicy import CONFINEMENT_ANNOTATIONS, CONTAINER_FIELDS, DASK_POD_ENV, HOST_NAMESPACES, POD_SPEC_FIELDS
from .daskpolicy import SERVICE_FIELDS, SERVICE_PORT_FIELDS
from .policy import SYSTEM_PATHS

ROLES = ("scheduler", "worker")
ENV_NAMES = sorted({*DASK_POD_ENV, "HOME", "LD_PRELOAD", *SAFE_PATH_ENV, *CREDENTIAL_ENV})
_SYSTEM = "(" + "|".join(re.escape(p) for p in SYSTEM_PATHS) + ")"
#: LD_PRELOAD's value: libraries of the image only (daskpolicy.env_refusal's rule; no ``..``,
#: and no ``$(`` anywhere, so no expansion can change it).
LD_PRELOAD_PATTERN = rf"^\s*{_SYSTEM}/[^:\s]*([:\s]+{_SYSTEM}/[^:\s]*)*\s*$"


def _list(values: Any) -> str:
    return "[" + ", ".join(_string(v) for v in values) + "]"


def _string(text: str) -> str:
    return "'" + text.replace("\\", "\\\\").replace("'", "\\'") + "'"


def _pod_rules(role: str) -> list[dict[str, str]]:
    there = f"has(object.spec.{role}) && has(object.spec.{role}.spec)"
    p = f"object.spec.{role}.spec"
    where = f"spec.{role}.spec"

    def rule(expression: str, message: str) -> dict[str, str]:
        return {"expression": f"!({there}) || ({expression})", "message": f"{where}: {message}"}

    each = f"{p}.containers.all(c, {{}})"
    return [
        rule(
            " && ".join(f"(!has({p}.{k}) || {p}.{k} == false)" for k in HOST_NAMESPACES),
            "Dask pods share no host namespace (hostNetwork, hostPID, hostIPC)",
        ),
        rule(f"{p}.all(k, k in {_list(sorted(POD_SPEC_FIELDS))})", "only the pod fields h5ngff's runner writes"),
        rule(f"has({p}.containers) && size({p}.containers) == 1", "exactly one container, as h5ngff builds it"),
        rule(
            f"has({p}.automountServiceAccountToken) && {p}.automountServiceAccountToken == false",
            "automountServiceAccountToken must be false: Dask pods need no Kubernetes API access",
        ),
        rule(
            f"has({p}.securityContext) && has({p}.securityContext.runAsNonRoot) && {p}.securityContext.runAsNonRoot == true",
            "the pod runs as non-root (securityContext.runAsNonRoot)",
        ),
        rule(
            f"!has({p}.volumes) || {p}.volumes.all(v, v.all(k, k == 'name' || k in __VOLUME_TYPES__))",
            "volumes of the types the tenant policy allows only (policy.allowedVolumeTypes; no hostPath)",
        ),
        rule(
            each.format(f"c.all(k, k in {_list(sorted(CONTAINER_FIELDS - {'envFrom'}))})"),
            "only the container fields h5ngff's runner writes (no command, lifecycle or envFrom)",
        ),
        rule(
            each.format("c.image in __IMAGES__ || __IMAGE_PATTERNS__.exists(r, c.image.matches(r))"),
            "images the tenant policy allows only (policy.allowedImages)",
        ),
        rule(
            each.format(
                "has(c.securityContext) && has(c.securityContext.allowPrivilegeEscalation) && "
                "c.securityContext.allowPrivilegeEscalation == false && "
                "(!has(c.securityContext.privileged) || c.securityContext.privileged == false) && "
                "(!has(c.securityContext.capabilities) || !has(c.securityContext.capabilities.add))"
            ),
            "no privilege, no privilege escalation, no added capabilities",
        ),
        rule(
            each.format("!has(c.ports) || c.ports.all(q, !has(q.hostPort) && !has(q.hostIP))"),
            "Dask pods take no port of the node (hostPort, hostIP)",
        ),
        *_env_rules(rule, each),
        *_mount_rules(rule, each, p),
    ]


def _env_rules(rule: Any, each: str) -> list[dict[str, str]]:
    safe = " && ".join(
        f"c.env.exists(e, e.name == {_string(k)} && has(e.value) && e.value == {_string(v)})"
        for k, v in SAFE_PATH_ENV.items()
    )
    return [
        rule(
            each.format(
                f"!has(c.env) || c.env.all(e, e.name in {_list(ENV_NAMES)} && (!has(e.value) || !e.value.contains('$(')) "
                f"&& (!has(e.valueFrom) || (e.name in {_list(CREDENTIAL_ENV)} && has(e.valueFrom.secretKeyRef) "
                f"&& e.valueFrom.secretKeyRef.key == e.name)))"
            ),
            "only the environment variables h5ngff sets, with no $(VAR) reference; only the credential keys from a Secret",
        ),
        rule(
            each.format(
                f"!has(c.env) || c.env.all(e, e.name != 'LD_PRELOAD' || (has(e.value) && !e.value.contains('..') "
                f"&& e.value.matches({_string(LD_PRELOAD_PATTERN)})))"
            ),
            "LD_PRELOAD may name only libraries of the image",
        ),
        rule(
            each.format(
                f"!has(c.env) || c.env.all(e, e.name != 'HOME' || (has(e.value) && e.value == {_string(SCRATCH_PATH)}))"
            ),
            f"HOME must be the scratch directory {SCRATCH_PATH}",
        ),
        rule(each.format(f"has(c.env) && {safe}"), "PYTHONSAFEPATH must be 1: no working directory on the import path"),
    ]


def _mount_rules(rule: Any, each: str, p: str) -> list[dict[str, str]]:
    home = _string(SCRATCH_PATH)
    return [
        rule(
            each.format(
                f"!has(c.volumeMounts) || c.volumeMounts.all(m, m.mountPath.matches({_string(MOUNT_PATH_PATTERN)}) && "
                f"m.mountPath != '/' && !{_list(SYSTEM_PATHS)}.exists(s, m.mountPath == s || "
                f"m.mountPath.startsWith(s + '/') || s.startsWith(m.mountPath + '/')))"
            ),
            "no volume at, under or over the image's system paths (mountPath in normal form)",
        ),
        rule(
            each.format(
                f"!has(c.volumeMounts) || c.volumeMounts.all(m, !(m.mountPath == {home} || "
                f"m.mountPath.startsWith({home} + '/.')) || (has({p}.volumes) && {p}.volumes.exists(v, "
                f"v.name == m.name && has(v.emptyDir))))"
            ),
            f"only an emptyDir at HOME ({SCRATCH_PATH}) or its dot-directories, where Python, Dask and the AWS SDK read start-up code",
        ),
    ]


def _object_rules() -> list[dict[str, str]]:
    annotations = f"!{_list(CONFINEMENT_ANNOTATIONS)}.exists(a, k.contains(a))"
    metas = ["object.metadata", *(f"object.spec.{r}.metadata" for r in ROLES)]
    svc = "object.spec.scheduler.service"
    return [
        {
            "expression": "has(object.metadata.labels) && 'app.kubernetes.io/managed-by' in object.metadata.labels && "
            "object.metadata.labels['app.kubernetes.io/managed-by'] == 'h5ngff'",
            "message": "a runner's DaskCluster carries app.kubernetes.io/managed-by: h5ngff (the guard judges only those)",
        },
        {
            "expression": f"has(object.metadata.ownerReferences) && object.metadata.ownerReferences.exists(r, "
            f"r.apiVersion.startsWith('{GROUP}/') && r.kind in {_list((KIND, BATCH_KIND))})",
            "message": "a runner's DaskCluster is owned by its ConversionJob or ConversionBatch (ownerReferences)",
        },
        *(
            {
                "expression": f"!has({m}) || !has({m}.annotations) || {m}.annotations.all(k, {annotations})",
                "message": f"{m.removeprefix('object.')}: no AppArmor or seccomp annotations (the Dask Operator copies them onto the pods)",
            }
            for m in metas
        ),
        {
            "expression": f"!has(object.spec.scheduler) || !has({svc}) || ((!has({svc}.type) || {svc}.type == 'ClusterIP') "
            f"&& {svc}.all(k, k in {_list(sorted(SERVICE_FIELDS))}) && (!has({svc}.ports) || {svc}.ports.all(q, "
            f"q.all(k, k in {_list(sorted(SERVICE_PORT_FIELDS))}))))",
            "message": "spec.scheduler.service: a ClusterIP Service as h5ngff writes it (the scheduler runs any code a client sends)",
        },
    ]


def policy_rules() -> dict[str, Any]:
    """The match condition and the validations, placeholders and all (module docstring)."""
    return {
        "matchCondition": "request.userInfo.username.matches(__ACCOUNTS__)",
        "validations": [*_object_rules(), *(r for role in ROLES for r in _pod_rules(role))],
    }
