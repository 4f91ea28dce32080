"""What ``--overwrite`` may delete: the objects of a Zarr hierarchy and h5ngff's own, nothing else.

An output path can hold more than an image. A user keeps the raw acquisition in ``out/raw/``, a
README beside the chunks, a folder of TIFFs; a Zarr store's root metadata alone said nothing about
them, and ``--overwrite`` once deleted the HDF5 source of its own run that way. So before anything
is deleted, every object under the output is classified, and an output holding one object that is
neither a member of its Zarr hierarchy nor h5ngff's own is refused whole (``foreign_objects``).

A member of the hierarchy is:

- a node's metadata document (``zarr.json``; ``.zgroup``, ``.zarray``, ``.zattrs``; ``.zmetadata``),
  where the node hangs from the root through groups only;
- a chunk (or shard) of an array node: the key below the array is a chunk key of either Zarr format,
  ``c/0/1/2``, ``c.0.1.2``, ``0/1/2`` or ``0.1.2``.

h5ngff's own objects are its lock, its manifest directory ``.h5ngff/``, its checksum sidecars
(``.h5ngff-checksums/``) and the temporary files its killed writers leave (they carry TMP_MARK).

On a directory, a symbolic link is never ours (h5ngff writes none), and a link to a directory is not
even listed by a walk: both count as foreign.
"""

from __future__ import annotations

import json
import os
import posixpath
import re
from typing import Callable, Iterable

from ..stores.local import TMP_MARK
from ..stores.s3lease import LOCK_KEY
from .checksums import LEGACY_SIDECAR_DIR
from .manifest import MANIFEST_DIR

_NODE_DOCUMENTS = ("zarr.json", ".zgroup", ".zarray")
_METADATA_DOCUMENTS = (*_NODE_DOCUMENTS, ".zattrs", ".zmetadata")
#: A chunk key below its array: v3's default encoding (``c`` then indices, '/' or '.'), or v2's /
#: v3's "v2" encoding (indices alone; ``0`` for a 0-d array).
_CHUNK_KEY = re.compile(r"c(?:[./]\d+)*|\d+(?:[./]\d+)*")


def is_own(key: str) -> bool:
    """h5ngff's lock, manifest, checksum sidecars and killed writers' temporary files."""
    parts = key.split("/")
    return key == LOCK_KEY or parts[0] == MANIFEST_DIR or LEGACY_SIDECAR_DIR in parts[:-1] or TMP_MARK in parts[-1]


def node_kinds(keys: Iterable[str], read: Callable[[str], bytes]) -> dict[str, str]:
    """prefix ('' for the root, else 'a/b/') -> 'array' or 'group', for every node a metadata
    document declares. A ``zarr.json`` that does not parse declares nothing."""
    kinds: dict[str, str] = {}
    for key in keys:
        directory, name = posixpath.split(key)
        prefix = f"{directory}/" if directory else ""
        if name == ".zarray":
            kinds[prefix] = "array"
        elif name == ".zgroup":
            kinds.setdefault(prefix, "group")
        elif name == "zarr.json":
            try:
                kind = json.loads(read(key)).get("node_type")
            except (KeyError, ValueError, OSError, AttributeError):
                continue
            if kind in ("array", "group"):
                kinds[prefix] = kind
    return kinds


def _ancestors(prefix: str) -> list[str]:
    """'a/b/' -> ['', 'a/']: the prefixes strictly above ``prefix``."""
    parts = prefix.rstrip("/").split("/") if prefix else []
    return ["/".join(parts[:i]) + "/" if i else "" for i in range(len(parts))]


def _reachable(prefix: str, kinds: dict[str, str]) -> bool:
    """The node at ``prefix`` hangs from the root through groups only."""
    return prefix in kinds and all(kinds.get(a) == "group" for a in _ancestors(prefix))


def is_member(key: str, kinds: dict[str, str]) -> bool:
    """Whether ``key`` is a metadata document or a chunk of the hierarchy ``kinds`` describes."""
    directory, name = posixpath.split(key)
    prefix = f"{directory}/" if directory else ""
    if name in _METADATA_DOCUMENTS and _reachable(prefix, kinds):
        return True
    for array in (a for a in [*_ancestors(prefix), prefix] if kinds.get(a) == "array"):
        if _reachable(array, kinds) and _CHUNK_KEY.fullmatch(key[len(array) :]):
            return True
    return False


def our_nodes(levels: int) -> dict[str, str]:
    """The nodes an h5ngff output of ``levels`` levels has, whether or not their documents are
    stored yet: its metadata is stored levels first and root last, and deleted (--overwrite)
    before its chunks, so a kill at either leaves chunks without their array's document."""
    return {"": "group", **{f"{level}/": "array" for level in range(levels)}}


def foreign_objects(
    keys: Iterable[str],
    read: Callable[[str], bytes],
    local_root: str | None = None,
    known: dict[str, str] | None = None,
) -> list[str]:
    """The keys (sorted) that are neither members of the Zarr hierarchy rooted at the output nor
    h5ngff's own; on a directory (``local_root``), every symbolic link under it too. ``known``:
    nodes taken as there without their documents (``our_nodes`` of an h5ngff output)."""
    keys = list(keys)
    kinds = {**node_kinds((k for k in keys if posixpath.basename(k) in _NODE_DOCUMENTS), read), **(known or {})}
    foreign = {k for k in keys if not is_own(k) and not is_member(k, kinds)}
    if local_root is not None:
        foreign.update(_links(local_root))
    return sorted(foreign)


def _links(root: str) -> list[str]:
    """Every symbolic link under ``root``, to a file or a directory (a walk lists the former among
    the files and the latter among the directories, and enters neither)."""
    found = []
    for directory, subdirs, files in os.walk(root):
        for name in (*subdirs, *files):
            full = os.path.join(directory, name)
            if os.path.islink(full):
                found.append(os.path.relpath(full, root).replace(os.sep, "/"))
    return found
