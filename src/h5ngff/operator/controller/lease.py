"""One writer per output: a ``coordination.k8s.io/v1`` Lease per output, held by a ConversionJob.

The operator takes the Lease before it creates a run's first runner Job and gives it back when
the run ends (Succeeded, Failed, deleted). A second ConversionJob on the same output, or on one
nested inside it (``/data/a.ome.zarr`` and ``/data/a.ome.zarr/b.ome.zarr``, either way round),
waits (phase Pending, reason ``OutputBusy``) until the Lease is free. The Lease is not time-based
(no renewals, no expiry): a runner keeps writing while the operator is down, so only the end of
the holder's run, or the holder's deletion, frees the output. A holder that vanished without its
finalizer (a force-deleted namespace) is noticed by the next job that wants the output: a Lease
whose holder ConversionJob no longer exists (or is another object of the same name) is taken over.

The key says where the output is, as the pods see it:

* ``url:s3://bucket/prefix``: a bucket prefix is one output cluster-wide.
* ``pvc:NS/claim:/path``: a path inside a PersistentVolumeClaim. A claim is namespaced, so the
  namespace is part of the key; the same claim mounted at two paths is one output, two claims at
  one path are two.
* ``path:/path``: any other path (``output.path`` joined to ``pod.workingDir``). It may be on a
  volume shared across namespaces (nfs, hostPath, an inline CSI volume) or private to the pod (an
  emptyDir, the image's filesystem); the operator cannot tell which, so it errs on the side of
  one writer: the key is cluster-wide, and two jobs in two namespaces writing pod-private paths of
  the same spelling merely run one after the other.

Paths are normalised so every spelling of a location gives one key: ``//data`` (which POSIX, and
so ``posixpath.normpath``, keeps apart from ``/data``), ``/data/./x/``, ``s3://b//p``.

All Leases live in one namespace, the operator's (``OperatorConfig.lease_namespace``), because the
keys of URL and plain-path outputs are cluster-wide: Leases in the jobs' namespaces would let two
namespaces write one bucket prefix. An ownerReference cannot point across namespaces (the garbage
collector would take the owner for missing and delete the Lease at once), so a Lease in another
namespace than its holder has none; the holder's finalizer, the end of its run and the takeover
above free it instead. An earlier build kept Leases, under a bare name, in the job's namespace:
``release`` and ``acquire`` look there too, so a run started before an upgrade keeps its output
and gives its Lease back.
"""

from __future__ import annotations

import asyncio
import datetime
import hashlib
import posixpath
from dataclasses import dataclass, field
from typing import Any

from ...k8s import LABEL_COMPONENT, labels, owner_reference
from ...spec import url_scheme
from ...jobspec import API_VERSION, BATCH_KIND, BATCH_PLURAL, KIND, PLURAL, ConversionJobSpec
from ..kube import Conflict, KubeApi, KubeError, namespaced

LEASE_API = "coordination.k8s.io/v1"
COMPONENT = "output-lease"
#: Annotation holding the full key (the name is a hash of it).
KEY_ANNOTATION = "h5ngff.dev/output"
#: Annotation naming the holder's kind (ConversionJob or ConversionBatch); a Lease without it is
#: a ConversionJob's (earlier builds).
HOLDER_KIND_ANNOTATION = "h5ngff.dev/holder-kind"
#: The plural of each holder kind, to look the holder up.
HOLDER_PLURALS = {KIND: PLURAL, BATCH_KIND: BATCH_PLURAL}


@dataclass(frozen=True)
class LeaseState:
    name: str
    held: bool  #: by the asking ConversionJob
    holder: str = ""  #: holderIdentity when someone else holds it
    since: str = ""


@dataclass
class LeaseScope:
    """Where one operator process keeps the output Leases, and the lock under which it acquires
    them: acquire lists the held Leases, then creates one, so two passes of one process must not
    interleave. Peering keeps other replicas idle (one active operator at a time), so a lock per
    process is all the serialisation needed."""

    namespace: str
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)


def _norm(path: str) -> str:
    """``posixpath.normpath``, and one leading slash: POSIX lets ``//x`` differ from ``/x``, but no
    Kubernetes volume, container filesystem or object store does."""
    path = posixpath.normpath(path)
    return "/" + path.lstrip("/") if path.startswith("/") else path


def output_key(spec: ConversionJobSpec, namespace: str | None = None) -> str:
    """What identifies an output location across pods: the claim and path inside it, the bucket
    prefix, or the path. ``namespace`` (the job's) qualifies a claim; without it the key says
    where the output is inside the job's namespace."""
    path = spec.output.path
    if url_scheme(path) is not None:
        # A bucket prefix is the same output from every pod and every namespace's point of view;
        # the working directory and the volumes do not change it.
        scheme, _, rest = path.partition("://")
        return f"url:{scheme.lower()}://{_norm('/' + rest).lstrip('/')}"
    if not posixpath.isabs(path) and spec.pod.working_dir:
        path = posixpath.join(spec.pod.working_dir, path)
    path = _norm(path)
    volumes = {v.get("name"): v for v in spec.pod.volumes or ()}
    best = None
    for mount in spec.pod.volume_mounts or ():
        root = _norm(mount.get("mountPath") or "/")
        if _within(path, root) and (best is None or len(root) > len(best[0])):
            best = (root, mount)
    if best is not None:
        root, mount = best
        claim = (volumes.get(mount["name"]) or {}).get("persistentVolumeClaim", {}).get("claimName")
        if claim:
            inside = _norm(posixpath.join("/", mount.get("subPath") or "", posixpath.relpath(path, root)))
            return f"pvc:{namespace + '/' if namespace else ''}{claim}:{inside}"
    return f"path:{path}"


def _within(path: str, root: str) -> bool:
    """``path`` is ``root`` or below it (whole components: /data/ab is not below /data/a)."""
    return path == root or path.startswith(root.rstrip("/") + "/")


def _split(key: str) -> tuple[str, str]:
    """(what holds the path, the path): ("url:s3://bucket", "/prefix"), ("pvc:ns/claim", "/p"),
    ("path", "/p"). Claim names and namespaces have no ':'; paths may."""
    kind, _, rest = key.partition(":")
    if kind == "url":
        scheme, _, where = rest.partition("://")
        bucket, _, prefix = where.partition("/")
        return f"url:{scheme}://{bucket}", "/" + prefix
    if kind == "pvc":
        claim, _, path = rest.partition(":")
        return f"pvc:{claim}", path
    return kind, rest


def overlaps(a: str, b: str) -> bool:
    """One key's output is the other's, or contains it: two writers would clash."""
    (sa, pa), (sb, pb) = _split(a), _split(b)
    return sa == sb and (_within(pa, pb) or _within(pb, pa))


def _legacy_key(key: str, namespace: str) -> str:
    """A key an earlier build wrote in a job's namespace, as this build spells it."""
    scope, path = _split(key)
    if scope.startswith("pvc:") and "/" not in scope:
        return f"pvc:{namespace}/{scope[4:]}:{_norm(path)}"
    return key if scope.startswith("url:") else f"{scope}:{_norm(path)}"


def lease_name(key: str) -> str:
    return f"h5ngff-output-{hashlib.sha256(key.encode()).hexdigest()[:20]}"


def holder_identity(namespace: str, name: str, uid: str) -> str:
    return f"{namespace}/{name}/{uid}"


def lease_body(
    key: str, namespace: str, name: str, uid: str, api_version: str, kind: str, lease_namespace: str | None = None
) -> dict[str, Any]:
    """The Lease of ``key`` held by ConversionJob ``namespace/name``, in ``lease_namespace``
    (default: the job's own)."""
    where = lease_namespace or namespace
    when = datetime.datetime.now(tz=datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")
    meta: dict[str, Any] = {
        "name": lease_name(key),
        "namespace": where,
        "labels": labels(name, COMPONENT),
        "annotations": {KEY_ANNOTATION: key, HOLDER_KIND_ANNOTATION: kind},
    }
    if where == namespace:
        # The garbage collector frees the output if the holder is deleted without its finalizer.
        meta["ownerReferences"] = [owner_reference(api_version, kind, name, uid, block=False)]
    return {
        "apiVersion": LEASE_API,
        "kind": "Lease",
        "metadata": meta,
        "spec": {"holderIdentity": holder_identity(namespace, name, uid), "acquireTime": when, "renewTime": when},
    }


async def acquire(kube: KubeApi, body: dict[str, Any], job_namespace: str | None = None) -> LeaseState:
    """Take the Lease of ``body``'s key unless a live job holds that output or one nested with
    it; a Lease whose holder is gone is deleted on the way. Idempotent: holding it counts as held.
    ``job_namespace``: the asking job's, where an earlier build's Leases may be.

    Not atomic (list, then create): the caller runs one acquire at a time (handlers.py)."""
    meta = body["metadata"]
    name, namespace, me, key = (
        meta["name"],
        meta["namespace"],
        body["spec"]["holderIdentity"],
        meta["annotations"][KEY_ANNOTATION],
    )
    for lease_ns, lease in await _output_leases(kube, namespace, job_namespace):
        lmeta, spec = lease.get("metadata") or {}, lease.get("spec") or {}
        theirs = (lmeta.get("annotations") or {}).get(KEY_ANNOTATION) or ""
        theirs = theirs if lease_ns == namespace else _legacy_key(theirs, lease_ns)
        holder = spec.get("holderIdentity") or ""
        if holder == me:
            if (lease_ns, lmeta.get("name"), theirs) == (namespace, name, key):
                return LeaseState(name, True)
            continue  # our own Lease of another output (an earlier run's, being released)
        if not overlaps(key, theirs):
            continue
        if await _holder_gone(kube, holder, (lmeta.get("annotations") or {}).get(HOLDER_KIND_ANNOTATION) or KIND):
            await kube.delete(namespaced(LEASE_API, lease_ns, "leases", lmeta["name"]))
            continue
        what = "" if theirs == key else f" (output {theirs})"
        return LeaseState(lmeta["name"], False, holder + what, str(spec.get("acquireTime") or ""))
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
    theirs = ((current.get("metadata") or {}).get("annotations") or {}).get(KEY_ANNOTATION)
    if holder == me and theirs in (None, key):
        return LeaseState(name, True)
    return LeaseState(name, False, holder, str(spec.get("acquireTime") or ""))


async def _output_leases(kube: KubeApi, namespace: str, job_namespace: str | None) -> list[tuple[str, dict[str, Any]]]:
    """Every output Lease of the lease namespace, and an earlier build's in the job's namespace."""
    out = []
    for ns in dict.fromkeys(filter(None, (namespace, job_namespace))):
        out += [
            (ns, lease) for lease in await kube.list(namespaced(LEASE_API, ns, "leases"), {LABEL_COMPONENT: COMPONENT})
        ]
    return out


async def _holder_gone(kube: KubeApi, holder: str, kind: str = KIND) -> bool:
    """True if the ConversionJob (or ConversionBatch: ``kind``) named by ``holder`` no longer exists
    (404, or a new object of the same name). A holder we may not read (403: a namespace no longer
    served), or of a kind this build does not know, counts as alive."""
    namespace, _, rest = holder.partition("/")
    name, _, uid = rest.partition("/")
    plural = HOLDER_PLURALS.get(kind)
    if not (namespace and name and uid and plural):
        return False  # not ours to judge: never delete a Lease we cannot attribute
    try:
        found = await kube.get(namespaced(API_VERSION, namespace, plural, name))
    except KubeError as exc:
        if exc.status == 403:
            return False
        raise
    return found is None or (found.get("metadata") or {}).get("uid") != uid


async def release(kube: KubeApi, namespace: str, name: str, me: str, job_namespace: str | None = None) -> bool:
    """Delete the Lease ``name`` if we hold it, in the lease namespace and (an earlier build's)
    in the job's; a Lease someone else holds is theirs to release."""
    released = False
    for ns in dict.fromkeys(filter(None, (namespace, job_namespace))):
        current = await kube.get(namespaced(LEASE_API, ns, "leases", name))
        if current is not None and (current.get("spec") or {}).get("holderIdentity") == me:
            released = await kube.delete(namespaced(LEASE_API, ns, "leases", name)) or released
    return released


async def release_all(kube: KubeApi, namespace: str, me: str, job_namespace: str | None = None) -> list[str]:
    """Delete every output Lease ``me`` holds (a deleted object's, once its pods are gone): also
    one a pass took but did not live to record in the status. Returns their names."""
    released = []
    for lease_ns, lease in await _output_leases(kube, namespace, job_namespace):
        if (lease.get("spec") or {}).get("holderIdentity") == me:
            name = (lease.get("metadata") or {}).get("name") or ""
            if name and await kube.delete(namespaced(LEASE_API, lease_ns, "leases", name)):
                released.append(name)
    return released
