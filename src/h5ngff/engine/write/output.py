"""The output: create it, resume it, or refuse it; and finish it with metadata written last. One
path for every store (a directory, a bucket prefix): what differs is asked of the store's
capability members (engine.stores.base), never of its type.

Order of writes, so that no reader ever sees a finished-looking image over missing chunks, and a
run killed at any point leaves an output h5ngff resumes or replaces:

1. the manifest's header (engine.write.manifest): our claim on the output;
2. the root group and every level's array metadata (zarr's own bytes, built in memory and stored
   object by object; no ``ome`` attributes yet), stored again on a resume (the same bytes) in
   case the kill came before them;
3. chunk files, each whole or absent (a temporary name and a rename, or one PUT; engine.write.chunkio);
4. the root group's attributes, replaced in one atomic write: the NGFF metadata (multiscales,
   omero) together with the completion marker ``h5ngff.complete`` and the content fingerprint;
5. the manifest ``.h5ngff/`` is removed: a finished output is a plain OME-Zarr.

``--overwrite`` deletes only an output of ours (found by its manifest or its completion marker),
or, where the store allows it (``overwrites_foreign_zarr``: a directory), a Zarr store; never the
one-writer lock (``LOCK_NAME``, a directory's flock file or a bucket's lease object). The record of
progress goes first (the completion marker, and every slab the manifest records; its header
stays), then the data, then the header: a run killed while deleting leaves an output that is still
recognisably ours and records nothing done, which a re-run resumes from the start or replaces,
and never takes for finished.
"""

from __future__ import annotations

import json
import logging
import os
import posixpath
from dataclasses import dataclass
from typing import Any, Literal

import zarr
from zarr.storage import MemoryStore

from ...errors import OutputConflictError, OutputError
from ...planner.layout import level_steps
from ...planner.model import Plan
from ...spec import ConversionSpec, url_scheme
from .chunkio import ArrayLayout
from .checksums import write_sidecars
from ..codecs import zarr_compressors
from .lock import LOCK_NAME, inspection_lock
from .manifest import MANIFEST_DIR, MANIFEST_PREFIX, Manifest, fingerprint
from .members import foreign_objects, is_own, our_nodes
from . import faults
from .ngff import root_attributes
from ..stores import Store, open_store
from ..stores.local import unwritable_reason
from ..sources.hdf5 import SourceIdentity

log = logging.getLogger(__name__)
_ZARR_MARKERS = ("zarr.json", ".zgroup", ".zarray")
#: The documents of a Zarr hierarchy's nodes and their attributes (v3 keeps both in zarr.json).
_NODE_DOCUMENTS = (*_ZARR_MARKERS, ".zattrs", ".zmetadata")
#: The root documents that carry the completion marker (Zarr v3, v2).
_ROOT_DOCUMENTS = ("zarr.json", ".zattrs")


@dataclass(frozen=True)
class Output:
    path: str
    zarr_format: int
    layouts: tuple[ArrayLayout, ...]
    manifest: Manifest
    fingerprint: str
    resumed: bool
    #: The output was already finished by an earlier run of the same conversion.
    complete: bool = False

    def store(self) -> Store:
        """Where the output's bytes go (engine.stores): every level, manifest and document."""
        return self.layouts[0].store()


def zarr_format(spec: ConversionSpec) -> Literal[2, 3]:
    return 3 if spec.output.ngff_version == "0.5" else 2


def level_layouts(plan: Plan, spec: ConversionSpec) -> tuple[ArrayLayout, ...]:
    fmt = zarr_format(spec)
    fill = False if plan.dtype.endswith("b1") else 0
    # Absolute: the layouts travel to workers whose working directory need not be the client's (an
    # existing cluster's, SLURM's), and a relative path there once wrote the chunks under the
    # worker's directory while the run reported success.
    root = spec.output.path if url_scheme(spec.output.path) else os.path.abspath(spec.output.path)
    return tuple(
        ArrayLayout(
            path=os.path.join(root, str(level.index)),
            shape=level.shape,
            chunks=level_chunks(plan.chunks, level.shape),
            shards=level_shards(plan.shards, plan.chunks, level.shape),
            dtype=plan.dtype,
            zarr_format=fmt,
            compressor=spec.output.compressor,
            level=level.index,
            fill_value=fill,
            storage_options=tuple(sorted((spec.output.storage_options or {}).items())),
            checksums=spec.output.checksums,
        )
        for level in plan.levels
    )


def level_chunks(chunks: tuple[int, ...], shape: tuple[int, ...]) -> tuple[int, ...]:
    """A level's chunk shape: level 0's, at most the level's own extent per axis, as level 0's is
    at most its shape (planner.layout). A (5, 16, 16) level kept (40, 64, 64) chunks before, so
    every reader decoded a buffer 32 times the level. The chunk grid is unchanged: an axis shorter
    than a chunk has one chunk either way."""
    return tuple(min(c, n) for c, n in zip(chunks, shape))


def level_shards(
    shards: tuple[int, ...] | None, chunks: tuple[int, ...], shape: tuple[int, ...]
) -> tuple[int, ...] | None:
    """A level's shard shape: level 0's, at most the whole chunks that cover the level (a multiple
    of the level's chunk, ``level_chunks``), so the shard grid is unchanged too."""
    if shards is None:
        return None
    inner = level_chunks(chunks, shape)
    return tuple(min(s, -(-n // c) * c) for s, c, n in zip(shards, inner, shape))


def _level_chunks_record(plan: Plan) -> list[list[int]] | None:
    """Each level's chunk shape where one differs from level 0's (content_of): an output written
    before levels had their own chunks must not be resumed with them."""
    per_level = [list(level_chunks(plan.chunks, level.shape)) for level in plan.levels]
    return per_level if any(c != list(plan.chunks) for c in per_level) else None


def downsampled_record(plan: Plan) -> list[bool] | list[list[bool]] | None:
    """The pyramid's halving rule as the output records it (``verify`` reads it back:
    levelcheck.pyramid_rule): None for one level; one list of axes when every step halves the
    same axes (the form outputs had before the anisotropy rule, so they still resume); else one
    list per step, ``[k]`` the axes halved from level k to level k+1."""
    steps = level_steps(plan.levels)
    if not steps:
        return None
    if all(s == steps[0] for s in steps):
        return list(steps[0])
    return [list(s) for s in steps]


def content_of(plan: Plan, spec: ConversionSpec, source: SourceIdentity) -> dict[str, Any]:
    """What determines the bytes of every chunk: if any of it changes, an old output is not ours to resume."""
    files = {"files": [list(f) for f in source.files]} if source.files else {}  # a stack of files: each one
    return {
        "source": {
            "path": source.path,
            "dataset": source.dataset,
            "size": source.size,
            "mtime_ns": source.mtime_ns,
            # An object in a bucket: its ETag (a replaced object of the same size is another source).
            **({"etag": source.etag} if source.etag else {}),
            **files,
        },
        "shape": list(plan.dataset.shape),
        "dtype": plan.dtype,
        "ngffVersion": spec.output.ngff_version,
        "chunks": list(plan.chunks),
        "shards": list(plan.shards) if plan.shards else None,
        "compressor": spec.output.compressor.to_wire(),
        "levels": len(plan.levels),
        "method": spec.pyramid.method,
        "downsampled": downsampled_record(plan),
        # Only when a level's chunks differ from level 0's, so outputs that never had such a level
        # still resume as before (``_LAYOUT_ONLY`` says what an older finished output may differ in).
        **({"levelChunks": record} if (record := _level_chunks_record(plan)) is not None else {}),
        # Only when on, so outputs written before checksums existed still resume with --no-checksums.
        **({"checksums": "crc32c"} if spec.output.checksums else {}),
    }


def output_store(spec: ConversionSpec) -> Store:
    return open_store(spec.output.path, spec.output.storage_options or {})


def prepare_output(plan: Plan, spec: ConversionSpec, source: SourceIdentity) -> Output:
    """Create a fresh output, or reopen a resumable one, or refuse with a reason. Never deletes
    anything that is not an h5ngff output (or, where the store allows it, a Zarr store). The
    caller holds the output's lock (``lock.output_lock``), so what is inspected here cannot
    change under us."""
    path = spec.output.path
    content = content_of(plan, spec, source)
    print_ = fingerprint(content)
    layouts = level_layouts(plan, spec)
    fmt = zarr_format(spec)
    store = output_store(spec)
    if store.occupied(ignore=(LOCK_NAME,)) and not _clear_unclaimed_start(store):
        existing, finished = Manifest.load(store), object_marker(store)
        _refuse_existing(store, path, spec, content, existing, finished)
        if spec.output.overwrite:
            remove_ours(store)
        else:
            if existing is None:
                log.info("%s is already complete; nothing to do.", path)
                return Output(path, fmt, layouts, Manifest(store), print_, resumed=True, complete=True)
            sweep_temporary_files(store)
            log.info("Resuming %s: %d slab(s) already recorded.", path, len(existing.records))
            if finished is None:  # (else finished but for the manifest's deletion: its metadata is whole)
                _store_metadata(store, plan, spec, layouts)
            return Output(path, fmt, layouts, existing, print_, resumed=True)
    manifest = Manifest(store)
    manifest.start(content)
    _store_metadata(store, plan, spec, layouts)
    return Output(path, fmt, layouts, manifest, print_, resumed=False)


def completion_marker(path: str, storage_options: dict[str, str] | None = None) -> dict[str, Any] | None:
    """The ``h5ngff`` root attribute of a finished output (None if absent or unfinished), read
    through the output's store: a directory or a bucket prefix alike."""
    return object_marker(open_store(path, storage_options))


def object_marker(store: Store) -> dict[str, Any] | None:
    """The ``h5ngff`` root attribute of a finished output in ``store`` (None if unfinished)."""
    for name in _ROOT_DOCUMENTS:
        try:
            doc = json.loads(store.get(name))
        except (KeyError, ValueError, OSError):  # absent, not JSON, or unreadable: not a finished output
            continue
        attrs = doc.get("attributes", {}) if name == "zarr.json" else doc
        marker = attrs.get("h5ngff") if isinstance(attrs, dict) else None
        if isinstance(marker, dict) and marker.get("complete"):
            return marker
    return None


def check_output(plan: Plan, spec: ConversionSpec, source: SourceIdentity) -> bool:
    """Refuse an output that ``prepare_output`` would refuse, writing nothing, and say whether it
    is already finished (a run would do nothing there, unless --overwrite): the CLI and the
    runner call it before they print the plan and start a cluster, so a conflict costs no wait.
    Where the lock is a lease it is taken first (``lock.inspection_lock``): a prefix another run
    is starting on holds its objects before its claim is readable, and that run is busy, not a
    conflict (nor objects to delete)."""
    store = output_store(spec)
    with inspection_lock(spec.output.path, spec.output.storage_options):
        # A 403 or a missing bucket fails here, before the cluster. What a run killed before its
        # claim left (``_unclaimed_start``) is as good as nothing: prepare_output clears it.
        if not store.occupied(ignore=(LOCK_NAME,)) or _unclaimed_start(store):
            store.check_creatable()
            return False
        finished, existing = object_marker(store), Manifest.load(store)
        _refuse_existing(store, spec.output.path, spec, content_of(plan, spec, source), existing, finished)
        _refuse_read_only(store, spec.output.path, finished is not None)
        return finished is not None and existing is None and not spec.output.overwrite


def _refuse_read_only(store: Store, path: str, finished: bool) -> None:
    """A local output this process may not write into is refused before the plan is printed: the
    run would fail only when it took the output's lock (a lock file in the directory)."""
    root = store.local_path
    if root is None or os.access(root, os.W_OK | os.X_OK, effective_ids=os.access in os.supports_effective_ids):
        return
    hint = f" It is a finished output: `h5ngff verify {path}` checks it without writing." if finished else ""
    raise OutputError(
        f"output.path: {path!r} is not writable ({unwritable_reason(root)}), so it can be neither resumed nor replaced. "
        f"Make it writable, or choose another path.{hint}"
    )


def _refuse_existing(
    store: Store,
    path: str,
    spec: ConversionSpec,
    content: dict[str, Any],
    existing: Manifest | None,
    finished: dict[str, Any] | None,
) -> None:
    """Raise OutputConflictError unless the occupied output may be resumed or (--overwrite) replaced."""
    ours = existing is not None or finished is not None
    if not ours and not store.overwrites_foreign_zarr:
        raise OutputConflictError(
            f"output.path: {store.root!r} holds objects that h5ngff did not write (no manifest, no completion marker), so it is "
            f"neither resumed nor replaced, with or without --overwrite. Choose another prefix, or delete those objects yourself."
        )
    if spec.output.overwrite:
        if not ours and not any(store.size(m) is not None for m in _ZARR_MARKERS):
            raise OutputConflictError(
                f"output.path: {path!r} exists and is neither an h5ngff output nor a Zarr store; --overwrite only replaces those. "
                f"Remove it yourself or choose a new path."
            )
        refuse_foreign(store, path, content["source"]["path"])
        return
    if not ours:
        raise OutputConflictError(
            f"output.path: {path!r} exists and is not an h5ngff output, so it cannot be resumed. "
            f"Choose a new path, or set output.overwrite (--overwrite) to replace it if it is a Zarr store."
        )
    old = existing.content if existing is not None else (finished or {}).get("content", {})
    differences = _differences(old, content)
    if differences and all(key in _LAYOUT_ONLY and key not in old for key in _changed(old, content)):
        if existing is None:  # finished by a version that stored every level with level 0's chunks:
            return  # the same image in a valid layout; a re-run has nothing to do
        raise OutputConflictError(
            f"output.path: {path!r} is an unfinished output of an earlier h5ngff, which stored every level with "
            f"level 0's chunk shape; this version gives each level its own. Re-run it with --overwrite to start it "
            f"afresh (or finish it with the earlier version)."
        )
    if differences:
        raise OutputConflictError(
            f"output.path: {path!r} holds an h5ngff output of a different conversion ({'; '.join(differences)}). "
            f"Re-run with the original options to resume it, choose a new path, or use --overwrite to start fresh."
        )


def refuse_foreign(store: Store, path: str, source: str | None = None) -> None:
    """Raise OutputConflictError if the output holds anything --overwrite must not delete: an
    object that is neither a member of its Zarr hierarchy nor h5ngff's own (engine.write.members),
    such as the run's own source, a README or a folder of TIFFs. Nothing has been deleted yet."""
    existing, marker = Manifest.load(store), object_marker(store)
    content = existing.content if existing is not None else (marker or {}).get("content")
    known = our_nodes(int(content.get("levels", 0))) if isinstance(content, dict) else None
    foreign = foreign_objects(store.list(""), store.get, store.local_path, known)
    if not foreign:
        return
    root = store.local_path
    if root is not None and source is not None:
        inside = os.path.relpath(os.path.realpath(source), os.path.realpath(root))
        if not inside.startswith(os.pardir) and inside.replace(os.sep, "/") in foreign:
            raise OutputConflictError(
                f"output.path: {path!r} holds the source of this conversion ({inside!r}), so --overwrite would delete it; "
                f"nothing was deleted. Move the source out of the output, or choose another output path."
            )
    shown = ", ".join(repr(key) for key in foreign[:5]) + (f" and {len(foreign) - 5} more" if len(foreign) > 5 else "")
    raise OutputConflictError(
        f"output.path: {path!r} holds {len(foreign)} object(s) that are no part of its Zarr hierarchy and that h5ngff "
        f"did not write ({shown}), so --overwrite would delete what this run did not write; nothing was deleted. "
        f"Move them out of the output, or choose another output path."
    )


def _unclaimed_start(store: Store) -> bool:
    """Whether the output holds only what a run killed before its claim was stored leaves: its
    lock, its manifest directory (empty, or a header's temporary file) and temporary files, and
    no manifest header. Such a start is nobody's output, and ours to clear."""
    keys = store.list("")
    top = {key.split("/")[0] for key in keys}
    return (
        all(is_own(key) for key in keys)
        and not store.occupied(ignore=(LOCK_NAME, MANIFEST_DIR, *(name for name in top if is_own(name))))
        and Manifest.load(store) is None
        and object_marker(store) is None
        and not foreign_objects(keys, store.get, store.local_path)
    )


def _clear_unclaimed_start(store: Store) -> bool:
    """Clear an unclaimed start (``_unclaimed_start``) and return True; else change nothing."""
    if not _unclaimed_start(store):
        return False
    log.info("Clearing %s: a run was killed there before it stored its claim.", store.root)
    store.delete_prefix("", keep=(LOCK_NAME,))  # a directory's emptied subdirectories go too
    return True


def remove_ours(store: Store) -> int:
    """Delete the output but the lock. What says how far it got goes first (``_record_nothing_done``),
    its claim (the manifest's header) last: a run killed while deleting leaves an output that is
    still recognisably ours and records nothing done. Deleting the claims last alone was not
    enough: a finished output killed mid-delete kept its completion marker over missing chunks,
    and the next run without --overwrite reported it finished."""
    # Checked again under the lock, right before the first delete: whatever the caller checked,
    # nothing outside the hierarchy and h5ngff's own objects is ever deleted.
    refuse_foreign(store, store.root)
    log.info("Removing the existing output %s (--overwrite).", store.root)
    claim = _record_nothing_done(store)
    # The chunks before the documents that make them a hierarchy's, deepest node first: a run
    # killed while deleting leaves chunks under their array's document, never orphans that the
    # next --overwrite would have to refuse as foreign (engine.write.members).
    documents = sorted(
        (k for k in store.list("") if posixpath.basename(k) in _NODE_DOCUMENTS and k not in claim),
        key=lambda k: (-k.count("/"), k),
    )
    removed = store.delete_prefix("", keep=(LOCK_NAME, *claim, *documents))
    for key in documents:
        store.delete(key)
        removed += 1
    for key in claim:
        if store.size(key) is not None:
            store.delete(key)
            removed += 1
    return removed


def _record_nothing_done(store: Store) -> tuple[str, ...]:
    """Leave the output's manifest with its header and no slab, and delete the completion marker;
    return the keys of the claim that stays, to be deleted last. The header keeps the old
    conversion's content, so a re-run with other options is still refused. A foreign Zarr store
    (``--overwrite`` where the store allows it) has no claim of ours: its root metadata is what
    makes it one, so that goes last instead, and a run killed while deleting it can be told to
    overwrite it again."""
    existing, marker = Manifest.load(store), object_marker(store)
    content = existing.content if existing is not None else (marker or {}).get("content")
    if content is None:
        last = (*(name for name in _ROOT_DOCUMENTS if name not in _ZARR_MARKERS), *_ZARR_MARKERS)  # a marker last
        return tuple(name for name in last if store.size(name) is not None)
    # A fresh header, whatever is there: in a bucket, the first object listed need not be one (a
    # kill while a finished output's manifest was deleted leaves records without their header).
    header = Manifest(store)
    header.start(content)  # a directory's one object is replaced whole by the header alone
    assert header.header_key is not None
    if not store.supports_append:
        store.delete_prefix(MANIFEST_PREFIX, keep=(header.header_key,))  # the records, before any data
    for name in _ROOT_DOCUMENTS:  # after the records: a kill between the two resumes from the start
        if store.size(name) is not None:
            store.delete(name)
    return (header.header_key,)


#: Content keys an earlier version's output lacks because it wrote the same image in an older
#: layout: a finished one is taken as complete, an unfinished one is refused with what to do.
_LAYOUT_ONLY = frozenset({"levelChunks"})


def _changed(old: dict[str, Any], new: dict[str, Any]) -> set[str]:
    return {key for key in set(old) | set(new) if old.get(key) != new.get(key)}


def _differences(old: dict[str, Any], new: dict[str, Any]) -> list[str]:
    out = []
    for key in sorted(_changed(old, new)):
        before, after = old.get(key), new.get(key)
        if key == "source" and isinstance(before, dict) and isinstance(after, dict) and after.get("files"):
            out.append(f"source: {_files_changed(before.get('files') or [[before.get('path'), 0, 0]], after['files'])}")
        else:
            out.append(f"{key}: was {before!r}, now {after!r}")
    return out


def _files_changed(before: list[list[Any]], after: list[list[Any]]) -> str:
    """Which files of a stack were added, removed or changed (size or mtime), by name, at most a few."""
    old, new = {f[0]: f[1:] for f in before}, {f[0]: f[1:] for f in after}
    said = [f"{p} added" for p in new if p not in old] + [f"{p} removed" for p in old if p not in new]
    said += [f"{p} changed (size, modification time or ETag)" for p in new if p in old and old[p] != new[p]]
    if not said and list(old) != list(new):
        said = ["the files' order changed"]
    shown = "; ".join(said[:3]) + (f"; and {len(said) - 3} more" if len(said) > 3 else "")
    return f"of the {len(old)} file(s) stacked, {shown}" if said else "the stacked files' identity changed"


def _store_metadata(store: Store, plan: Plan, spec: ConversionSpec, layouts: tuple[ArrayLayout, ...]) -> None:
    """The root group and every level's array metadata, built by zarr in memory and stored one
    document at a time (the bytes are zarr's own), in key order: the levels' before the root's.
    Never through zarr's ``overwrite=True``, which would remove the whole store, the held lock
    (a directory's lock file) with it."""
    documents: dict[str, Any] = {}  # key -> zarr Buffer: MemoryStore's own dict, given to it
    _create_arrays(MemoryStore(documents), plan, spec, layouts)
    for key, data in sorted(documents.items()):
        store.put(key, data.to_bytes())
        faults.crash_point("metadata")


def _create_arrays(store: Any, plan: Plan, spec: ConversionSpec, layouts: tuple[ArrayLayout, ...]) -> None:
    """The root group and every level's array metadata, no ``ome`` attributes yet (zarr writes them)."""
    fmt = zarr_format(spec)
    root = zarr.create_group(store=store, zarr_format=fmt)
    compressors = zarr_compressors(spec.output.compressor, fmt, spec.output.checksums)
    for layout in layouts:
        kwargs: dict[str, Any] = {}
        if fmt == 2:
            kwargs["chunk_key_encoding"] = {"name": "v2", "separator": "/"}
        else:
            kwargs["dimension_names"] = list(plan.axes)
            if layout.shards:
                kwargs["shards"] = layout.shards
        root.create_array(
            name=str(layout.level),
            shape=layout.shape,
            chunks=layout.chunks,
            dtype=layout.dtype,
            compressors=compressors,
            fill_value=layout.fill_value,
            **kwargs,
        )


def sweep_temporary_files(store: Store) -> int:
    """Delete what killed writers left behind in the output's store (a directory's temporary
    files, which carry TMP_MARK; a bucket has none)."""
    removed = store.sweep()
    if removed:
        log.info("Removed %d stale temporary chunk file(s) from an interrupted run.", removed)
    return removed


def finish_output(output: Output, plan: Plan, spec: ConversionSpec, windows: list[tuple[float, ...]]) -> None:
    """Write the NGFF metadata and the completion marker in one atomic write of the root document
    (a rename in a directory, one PUT in a bucket), then drop the manifest."""
    store = output.store()
    # A worker killed between writing a temporary file and renaming it leaves that file behind,
    # while Dask re-ran its task elsewhere and the chunk itself is whole. Sweep before the marker:
    # only the driver runs here, after every task, under the output's lock, so nothing is writing.
    sweep_temporary_files(store)
    if output.zarr_format == 2 and spec.output.checksums:  # before the marker: a finished output has them
        write_sidecars(
            store, output.manifest.checksums, {lay.level: os.path.basename(lay.path) for lay in output.layouts}
        )
    attrs = root_attributes(plan, spec, windows, output.zarr_format)
    attrs["h5ngff"].update({"complete": True, "fingerprint": output.fingerprint, "content": output.manifest.content})
    # Units left out as the fill value everywhere, per level: verify tells them from missing ones.
    attrs["h5ngff"]["emptyUnits"] = {str(level): n for level, n in sorted(output.manifest.empty_units().items()) if n}
    if output.zarr_format == 3:
        key = "zarr.json"
        doc = json.loads(store.get(key))
        doc["attributes"] = attrs
    else:
        key, doc = ".zattrs", attrs
    store.put(key, json.dumps(doc, indent=2, default=str).encode(), sync=True)
    store.delete_prefix(f"{MANIFEST_DIR}/")
