"""A ConversionJob and a ConversionBatch of one name in one namespace: the younger is refused.

Their children would share every name (``<name>-runner-<n>``, ``<name>-dask``, the job label), so
each would take the other's runner Job for its own, wait on the other's pods, and delete the
other's children. The Kubernetes API cannot refuse the second at admission (a validating policy
sees one object), so the controller does, before the younger one creates anything: it fails with
reason ``NameTaken`` and holds no Lease, and deleting it touches nothing of the other's
(children.remove_children). The older one runs as if the younger did not exist.
"""

from __future__ import annotations

from typing import Any, Mapping

from ...jobspec import BATCH_KIND
from .state import Names

REASON = "NameTaken"


def name_taken(kind: str, other_kind: str, meta: Mapping[str, Any], others: Names) -> str | None:
    """Why this object (``kind``, its ``meta``) must not run: an object of ``other_kind`` of the
    same name is older (created earlier; at the same second the ConversionJob is), or None."""
    namespace, name = str(meta.get("namespace") or ""), str(meta.get("name") or "")
    mine = _rank(str(meta.get("creationTimestamp") or ""), kind, str(meta.get("uid") or ""))
    for uid, created in others.get((namespace, name), ()):
        if _rank(created, other_kind, uid) < mine:
            return (
                f"A {other_kind} named {name!r} already exists in namespace {namespace!r}: a ConversionJob and a "
                f"ConversionBatch of one name would share runner Jobs, a DaskCluster and output Leases, so this "
                f"{kind} starts nothing. Rename it (or delete the {other_kind}) and apply it again."
            )
    return None


def _rank(created: str, kind: str, uid: str) -> tuple[str, int, str]:
    return created, 1 if kind == BATCH_KIND else 0, uid
