"""An output in an object store (``s3://bucket/prefix``): the same guarantees as a directory.

- Every chunk or shard is one object written by one PUT (chunkio; a large one a multipart upload
  that is completed or aborted), so no temporary names and no sweep.
- The manifest's header is the first object written (our claim on the prefix: a run killed at any
  later point leaves an output h5ngff resumes or replaces); then the array metadata, with no ``ome``
  attributes, PUT again on a resume; the root ``zarr.json`` (or
  ``.zattrs``) with the NGFF metadata and the completion marker is written last, one PUT; then the
  manifest is deleted. A reader polling the bucket never sees a finished image over missing chunks.
- The manifest lives in the bucket under ``.h5ngff/manifest/``: S3 has no append, so each
  recorded batch is its own small object, and loading lists them in order.
- ``--overwrite`` deletes only an output of ours, found by its manifest or its completion marker;
  any other object under the prefix (a foreign Zarr included) makes it refuse.
- One writer per prefix: the run's driver holds a lease object ``.h5ngff.lock`` under it
  (engine.stores.s3lease), which is neither a foreign object nor deleted by ``--overwrite``.
"""

from __future__ import annotations

import json
import logging
import time
import uuid
from typing import Any, Iterable

from zarr.storage import MemoryStore

from ...errors import OutputConflictError
from .manifest import FORMAT_VERSION, MANIFEST_DIR, Manifest, SlabRecord, fingerprint
from ..stores.s3lease import LOCK_KEY
from ..stores import Store, open_store

log = logging.getLogger(__name__)
MANIFEST_PREFIX = f"{MANIFEST_DIR}/manifest/"


class ObjectManifest(Manifest):
    """The resume manifest as objects: ``.h5ngff/manifest/<seq>-<id>.jsonl``, one per append."""

    def __init__(self, store: Store):
        super().__init__(store.root)
        self.store = store
        self._seq = 0

    @classmethod
    def load_from(cls, store: Store) -> "ObjectManifest | None":
        m = cls(store)
        keys = sorted(store.list(MANIFEST_PREFIX))
        for key in keys:
            for raw in store.get(key).split(b"\n"):
                if raw.strip():
                    m._entry(json.loads(raw))
        m._seq = len(keys)
        return m if m.header else None

    def _put(self, lines: list[str]) -> None:
        # The sequence number orders the objects (a lexical list); the random part keeps a
        # resumed run from overwriting a batch if two ever raced.
        self.store.put(f"{MANIFEST_PREFIX}{self._seq:010d}-{uuid.uuid4().hex[:8]}.jsonl", ("\n".join(lines) + "\n").encode())
        self._seq += 1

    def start(self, content: dict[str, Any]) -> None:
        self.header = {"kind": "header", "format": FORMAT_VERSION, "fingerprint": fingerprint(content), "content": content, "created": time.time()}
        self.records, self.units, self._seq = [], {}, 0
        self._put([json.dumps(self.header)])

    def append(self, records: Iterable[SlabRecord]) -> None:
        lines = []
        for r in records:
            self._add(r)
            lines.append(self._line(r))  # the same lines as a directory's manifest.jsonl
        if lines:
            self._put(lines)

    def verified_units(self, level_paths: dict[int, str]) -> dict[int, set[str]]:
        """Recorded objects that exist with their recorded size: one LIST per level."""
        good: dict[int, set[str]] = {}
        for level, entries in self.units.items():
            if level not in level_paths:
                continue
            sizes = self.store.list(f"{level}/")
            good[level] = {key for key, n in entries.items() if sizes.get(f"{level}/{key}") == n}
        return good


def output_store(spec) -> Store:
    return open_store(spec.output.path, spec.output.storage_options or {})


def object_marker(store: Store) -> dict[str, Any] | None:
    """The ``h5ngff`` root attribute of a finished output in ``store`` (None if unfinished)."""
    for name in ("zarr.json", ".zattrs"):
        try:
            doc = json.loads(store.get(name))
        except (KeyError, ValueError, OSError):  # absent, not JSON, or unreadable: not a finished output
            continue
        attrs = doc.get("attributes", {}) if name == "zarr.json" else doc
        marker = attrs.get("h5ngff") if isinstance(attrs, dict) else None
        if isinstance(marker, dict) and marker.get("complete"):
            return marker
    return None


def inspect_object_output(store: Store) -> tuple[bool, ObjectManifest | None, dict[str, Any] | None]:
    """(anything under the prefix, our manifest, our completion marker)."""
    keys = set(store.list("")) - {LOCK_KEY}  # our own run's lease is not content
    if not keys:
        return False, None, None
    return True, ObjectManifest.load_from(store), object_marker(store)


def refuse_foreign(store: Store, manifest, marker) -> None:
    if manifest is None and marker is None:
        raise OutputConflictError(
            f"output.path: {store.root!r} holds objects that h5ngff did not write (no manifest, no completion marker), so it is "
            f"neither resumed nor replaced, with or without --overwrite. Choose another prefix, or delete those objects yourself."
        )


def create_object_output(store: Store, create_arrays) -> None:
    """Build the group and every level's array metadata in memory with zarr (``create_arrays``
    takes the root group), then PUT each metadata document: the bytes are zarr's own."""
    memory = MemoryStore()
    create_arrays(memory)
    for key, buffer in sorted(memory._store_dict.items()):
        store.put(key, buffer.to_bytes())


def remove_ours(store: Store) -> int:
    """Delete our output but the lease, its claims last (the root documents, then the manifest's
    header): a run killed while deleting leaves an output that is still recognisably ours."""
    log.info("Removing the existing h5ngff output %s (--overwrite).", store.root)
    header = sorted(store.list(MANIFEST_PREFIX))[:1]
    removed = store.delete_prefix("", keep=(LOCK_KEY, "zarr.json", ".zattrs", *header))
    for key in ("zarr.json", ".zattrs", *header):
        if store.size(key) is not None:
            store.delete(key)
            removed += 1
    return removed
