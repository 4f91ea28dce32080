"""One writer per output path: a ``coordination.k8s.io/v1`` Lease per path, held by a ConversionJob.

The operator takes the Lease before it creates a run's first runner Job and gives it back when
the run ends (Succeeded, Failed, deleted). A second ConversionJob on the same path waits
(phase Pending, reason ``OutputBusy``) until the Lease is free. The Lease is not time-based
(no renewals, no expiry): a runner keeps writing while the operator is down, so only the end
of the holder's run, or the holder's deletion (the Lease's ownerReference lets the garbage
collector remove it), frees the path.

The key is the output path as the pods see it: ``output.path`` joined to ``pod.workingDir`` when
relative, normalised, plus the volume that holds it when that is a PersistentVolumeClaim (the
same claim mounted at two paths is one output; two claims at one path are two). Leases live in
the ConversionJob's namespace: jobs in different namespaces that share one volume are not
coordinated (see docs/operator.md).
"""

from __future__ import annotations

import datetime
import hashlib
import posixpath
from dataclasses import dataclass
from typing import Any

from ..k8s import labels, owner_reference
from ..spec import url_scheme
from ..jobspec import ConversionJobSpec
from .kube import Conflict, Kube, namespaced

LEASE_API = "coordination.k8s.io/v1"
#: Annotation holding the full key (the name is a hash of it).
KEY_ANNOTATION = "h5ngff.dev/output"


@dataclass(frozen=True)
class LeaseState:
    name: str
    held: bool  #: by the asking ConversionJob
    holder: str = ""  #: holderIdentity when someone else holds it
    since: str = ""


def output_key(spec: ConversionJobSpec) -> str:
    """What identifies an output location across pods: the claim and path inside it, or the path."""
    path = spec.output.path
    if url_scheme(path) is not None:
        # A bucket prefix is the same output from every pod and every namespace's point of view;
        # the working directory and the volumes do not change it.
        scheme, _, rest = path.partition("://")
        return f"url:{scheme.lower()}://{posixpath.normpath('/' + rest).lstrip('/')}"
    if not posixpath.isabs(path):
        path = posixpath.join(spec.pod.working_dir or "", path) if spec.pod.working_dir else path
    path = posixpath.normpath(path)
    volumes = {v.get("name"): v for v in spec.pod.volumes or ()}
    best = None
    for mount in spec.pod.volume_mounts or ():
        root = posixpath.normpath(mount.get("mountPath") or "/")
        if path == root or path.startswith(root.rstrip("/") + "/"):
            if best is None or len(root) > len(best[0]):
                best = (root, mount)
    if best is not None:
        root, mount = best
        claim = (volumes.get(mount["name"]) or {}).get("persistentVolumeClaim", {}).get("claimName")
        if claim:
            inside = posixpath.normpath(posixpath.join("/", mount.get("subPath") or "", posixpath.relpath(path, root)))
            return f"pvc:{claim}:{inside}"
    return f"path:{path}"


def lease_name(key: str) -> str:
    return f"h5ngff-output-{hashlib.sha256(key.encode()).hexdigest()[:20]}"


def holder_identity(namespace: str, name: str, uid: str) -> str:
    return f"{namespace}/{name}/{uid}"


def lease_body(key: str, namespace: str, name: str, uid: str, api_version: str, kind: str) -> dict[str, Any]:
    when = datetime.datetime.now(tz=datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")
    return {
        "apiVersion": LEASE_API,
        "kind": "Lease",
        "metadata": {
            "name": lease_name(key), "namespace": namespace, "labels": labels(name, "output-lease"),
            "annotations": {KEY_ANNOTATION: key},
            # The garbage collector frees the path if the holder is deleted without its finalizer.
            "ownerReferences": [owner_reference(api_version, kind, name, uid, block=False)],
        },
        "spec": {"holderIdentity": holder_identity(namespace, name, uid), "acquireTime": when, "renewTime": when},
    }


async def acquire(kube: Kube, body: dict[str, Any]) -> LeaseState:
    """Create the Lease, or find who holds it. Idempotent: holding it already counts as held."""
    meta = body["metadata"]
    name, namespace, me = meta["name"], meta["namespace"], body["spec"]["holderIdentity"]
    try:
        await kube.create(namespaced(LEASE_API, namespace, "leases"), body)
        return LeaseState(name, True)
    except Conflict:
        pass
    current = await kube.get(namespaced(LEASE_API, namespace, "leases", name))
    if current is None:  # released between our create and get: the next pass takes it
        return LeaseState(name, False, "(just released)")
    spec = current.get("spec") or {}
    holder = spec.get("holderIdentity") or ""
    key = ((current.get("metadata") or {}).get("annotations") or {}).get(KEY_ANNOTATION)
    if holder == me and key in (None, meta["annotations"][KEY_ANNOTATION]):
        return LeaseState(name, True)
    return LeaseState(name, False, holder, str(spec.get("acquireTime") or ""))


async def release(kube: Kube, namespace: str, name: str, me: str) -> bool:
    """Delete the Lease if we hold it; a Lease someone else holds is theirs to release."""
    current = await kube.get(namespaced(LEASE_API, namespace, "leases", name))
    if current is None or (current.get("spec") or {}).get("holderIdentity") != me:
        return False
    return await kube.delete(namespaced(LEASE_API, namespace, "leases", name))
