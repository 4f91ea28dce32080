"""An in-memory Kubernetes API for the operator's property tests (tests/test_operator_invariants.py).

It answers the controller's calls (``kube.KubeApi``: get, list, create, delete, merge patch) with
the semantics the one-writer rules depend on, and nothing else:

* 404 is None (get) or False (delete); a create of an existing name raises Conflict (409);
* deleting a Job or a DaskCluster deletes its pods the way the garbage collector does: a pod that
  still runs only starts terminating (``deletionTimestamp``) and goes away when the test says
  its process exited (``pod_exited``), so pods that terminate slowly are the default here;
* faults a test arms: the next runner Job create refused (422), or answered by no one (the Job
  created or not), or a crash after a number of calls (the operator process dies mid-pass).

Not KMock: the state machine makes thousands of passes per example, and an HTTP round trip per
call would cost minutes where this costs seconds. The KMock tests cover the API's real shape.
"""

from __future__ import annotations

import copy
import itertools
from dataclasses import dataclass, field
from typing import Any

from h5ngff.operator.kube import Conflict, KubeError, Transient

ENDED = ("Succeeded", "Failed")


class Crash(Exception):
    """The operator process died here (raised by an armed API; not a KubeError, so nothing in
    the controller catches it)."""


Key = tuple[str, str, str, str]  # (group/version, namespace, plural, name)


def parse_path(path: str) -> tuple[str, str, str, str | None, str | None]:
    """(group/version, namespace, plural, name, subresource) of a namespaced API path."""
    parts = path.strip("/").split("/")
    if parts[0] == "api":
        gv, rest = parts[1], parts[2:]
    else:
        gv, rest = f"{parts[1]}/{parts[2]}", parts[3:]
    assert rest[0] == "namespaces", path
    namespace, plural = rest[1], rest[2]
    name = rest[3] if len(rest) > 3 else None
    sub = rest[4] if len(rest) > 4 else None
    return gv, namespace, plural, name, sub


def _matches(obj: dict[str, Any], labels: dict[str, str] | None, fields: dict[str, str] | None) -> bool:
    have = (obj.get("metadata") or {}).get("labels") or {}
    if any(have.get(k) != v for k, v in (labels or {}).items()):
        return False
    for path, value in (fields or {}).items():
        node: Any = obj
        for part in path.split("."):
            node = node.get(part) if isinstance(node, dict) else None
        if node != value:
            return False
    return True


def _merge(target: Any, patch: Any) -> Any:
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    out = dict(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if value is None:
            out.pop(key, None)
        else:
            out[key] = _merge(out.get(key), value)
    return out


@dataclass
class MemoryApi:
    objects: dict[Key, dict[str, Any]] = field(default_factory=dict)
    #: The next runner Job create: None (answered normally), "refused" (422), "lost-created"
    #: (created, but the answer is lost: Transient), "lost" (not created, Transient).
    job_create_fault: str | None = None
    #: Raise Crash once this many more calls have been made (None: never).
    crash_after: int | None = None
    calls: int = 0
    _ids: Any = field(default_factory=itertools.count)

    # -- the KubeApi protocol ------------------------------------------------------------------

    async def get(self, path: str) -> dict[str, Any] | None:
        self._tick()
        gv, ns, plural, name, _ = parse_path(path)
        obj = self.objects.get((gv, ns, plural, name or ""))
        return copy.deepcopy(obj) if obj is not None else None

    async def list(
        self, path: str, label_selector: dict[str, str] | None = None, field_selector: dict[str, str] | None = None
    ) -> list[dict[str, Any]]:
        self._tick()
        gv, ns, plural, _, _ = parse_path(path)
        return [
            copy.deepcopy(o)
            for (g, n, p, _), o in sorted(self.objects.items())
            if (g, n, p) == (gv, ns, plural) and _matches(o, label_selector, field_selector)
        ]

    async def create(self, path: str, body: dict[str, Any]) -> dict[str, Any] | None:
        self._tick()
        gv, ns, plural, _, _ = parse_path(path)
        if plural == "jobs" and self.job_create_fault is not None:
            fault, self.job_create_fault = self.job_create_fault, None
            if fault == "refused":
                raise KubeError("POST jobs: HTTP 422", 422, "spec.template.spec.volumes[1].name: Duplicate value")
            if fault == "lost":
                raise Transient("POST jobs: no answer")
            self.put(gv, ns, plural, body)  # "lost-created": made, but nobody heard
            raise Transient("POST jobs: no answer")
        return copy.deepcopy(self.put(gv, ns, plural, body))

    async def delete(self, path: str) -> bool:
        self._tick()
        gv, ns, plural, name, _ = parse_path(path)
        return self.remove((gv, ns, plural, name or ""))

    async def patch_merge(self, path: str, patch: dict[str, Any]) -> dict[str, Any] | None:
        self._tick()
        gv, ns, plural, name, _ = parse_path(path)
        key = (gv, ns, plural, name or "")
        if key not in self.objects:
            return None
        self.objects[key] = _merge(self.objects[key], patch)
        return copy.deepcopy(self.objects[key])

    # -- the rest of the cluster ---------------------------------------------------------------

    def _tick(self) -> None:
        self.calls += 1
        if self.crash_after is not None:
            if self.crash_after <= 0:
                self.crash_after = None
                raise Crash("the operator died mid-pass")
            self.crash_after -= 1

    def put(self, gv: str, ns: str, plural: str, body: dict[str, Any]) -> dict[str, Any]:
        meta = body.setdefault("metadata", {})
        key = (gv, ns, plural, meta["name"])
        if key in self.objects:
            raise Conflict(f"POST {plural}: HTTP 409", 409)
        n = next(self._ids)
        meta.setdefault("uid", f"uid-{n:05d}")
        meta.setdefault("creationTimestamp", f"2026-01-01T00:{n // 60 % 60:02d}:{n % 60:02d}Z")
        meta.setdefault("generation", 1)
        meta["namespace"] = ns
        self.objects[key] = copy.deepcopy(body)
        return self.objects[key]

    def remove(self, key: Key) -> bool:
        """Delete as the API server and the garbage collector do: a Job's or a DaskCluster's pods
        go with it (the running ones start terminating); a running pod terminates first."""
        obj = self.objects.get(key)
        if obj is None:
            return False
        gv, ns, plural, name = key
        if plural == "pods" and live(obj):
            obj["metadata"].setdefault("deletionTimestamp", "now")
            return True
        del self.objects[key]
        label = {"jobs": "job-name", "daskclusters": "dask.org/cluster-name"}.get(plural)
        if label is not None:
            for pod_key, pod in list(self.objects.items()):
                if pod_key[:3] == ("v1", ns, "pods") and (pod["metadata"].get("labels") or {}).get(label) == name:
                    self.remove(pod_key)
        return True

    def of(self, gv: str, ns: str, plural: str) -> dict[str, dict[str, Any]]:
        return {k[3]: o for k, o in self.objects.items() if k[:3] == (gv, ns, plural)}


def live(pod: dict[str, Any]) -> bool:
    """A pod that may still run, and so write: not Succeeded or Failed (terminating ones count)."""
    return (pod.get("status") or {}).get("phase") not in ENDED
