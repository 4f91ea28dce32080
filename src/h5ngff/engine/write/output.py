"""The output store: create it, resume it, or refuse it; and finish it with metadata written last.

Order of writes, so that no reader ever sees a finished-looking image over missing chunks:

1. the root group and every level's array metadata (zarr writes these; no ``ome`` attributes yet);
2. chunk files, each through a temporary name and a rename (engine.write.chunkio);
3. the root group's attributes, replaced in one atomic rename: the NGFF metadata (multiscales,
   omero) together with the completion marker ``h5ngff.complete`` and the content fingerprint;
4. the manifest directory ``.h5ngff`` is removed: a finished output is a plain OME-Zarr.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from dataclasses import dataclass
from typing import Any

import zarr
from zarr.storage import LocalStore

from ...errors import OutputConflictError, OutputError
from ...planner.layout import level_steps
from ...planner.model import Plan
from ...spec import ConversionSpec
from .chunkio import ArrayLayout
from .checksums import write_sidecars
from ..codecs import zarr_compressors
from .lock import LOCK_NAME, output_lock
from .manifest import MANIFEST_DIR, Manifest, fingerprint
from .ngff import root_attributes
from .objoutput import ObjectManifest, create_object_output, inspect_object_output, object_marker, output_store, refuse_foreign, remove_ours
from ..stores import Store, is_url, open_store
from ..sources.hdf5 import SourceIdentity

log = logging.getLogger(__name__)
_ZARR_MARKERS = ("zarr.json", ".zgroup", ".zarray")


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


def zarr_format(spec: ConversionSpec) -> int:
    return 3 if spec.output.ngff_version == "0.5" else 2


def level_layouts(plan: Plan, spec: ConversionSpec) -> tuple[ArrayLayout, ...]:
    fmt = zarr_format(spec)
    fill = False if plan.dtype.endswith("b1") else 0
    return tuple(
        ArrayLayout(
            path=os.path.join(spec.output.path, str(level.index)),
            shape=level.shape,
            chunks=plan.chunks,
            shards=plan.shards,
            dtype=plan.dtype,
            zarr_format=fmt,
            compressor=spec.output.compressor,
            level=level.index,
            fill_value=fill,
            storage_options=tuple(sorted((spec.output.storage_options or {}).items())) if is_url(spec.output.path) else None,
            checksums=spec.output.checksums,
        )
        for level in plan.levels
    )


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
    return {
        "source": {"path": source.path, "dataset": source.dataset, "size": source.size, "mtime_ns": source.mtime_ns},
        "shape": list(plan.dataset.shape),
        "dtype": plan.dtype,
        "ngffVersion": spec.output.ngff_version,
        "chunks": list(plan.chunks),
        "shards": list(plan.shards) if plan.shards else None,
        "compressor": spec.output.compressor.to_wire(),
        "levels": len(plan.levels),
        "method": spec.pyramid.method,
        "downsampled": downsampled_record(plan),
        # Only when on, so outputs written before checksums existed still resume with --no-checksums.
        **({"checksums": "crc32c"} if spec.output.checksums else {}),
    }


def prepare_output(plan: Plan, spec: ConversionSpec, source: SourceIdentity) -> Output:
    """Create a fresh output, or reopen a resumable one, or refuse with a reason. Never deletes
    anything that is not an h5ngff or Zarr output. The caller holds the output's lock
    (``lock.output_lock``), so what is inspected here cannot change under us."""
    path = spec.output.path
    content = content_of(plan, spec, source)
    print_ = fingerprint(content)
    layouts = level_layouts(plan, spec)
    fmt = zarr_format(spec)
    if is_url(path):
        return _prepare_object_output(plan, spec, content, layouts)
    if os.path.exists(path) and not _is_empty_dir(path):
        existing = Manifest.load(path) if os.path.isdir(path) else None
        finished = completion_marker(path)
        _refuse_existing(path, spec, content, existing, finished)
        if spec.output.overwrite:
            _remove_replaceable(path)
        else:
            if existing is None:
                log.info("%s is already complete; nothing to do.", path)
                return Output(path, fmt, layouts, Manifest(path), print_, resumed=True, complete=True)
            sweep_temporary_files(open_store(path))
            log.info("Resuming %s: %d slab(s) already recorded.", path, len(existing.records))
            return Output(path, fmt, layouts, existing, print_, resumed=True)
    _create(path, plan, spec, layouts)
    manifest = Manifest(path)
    manifest.start(content)
    return Output(path, fmt, layouts, manifest, print_, resumed=False)


def completion_marker(path: str, storage_options: dict[str, str] | None = None) -> dict[str, Any] | None:
    """The ``h5ngff`` root attribute of a finished output (None if absent or unfinished), read
    through the output's store: a directory or a bucket prefix alike."""
    return object_marker(open_store(path, storage_options))


def _is_empty_dir(path: str) -> bool:
    return os.path.isdir(path) and not [name for name in os.listdir(path) if name != LOCK_NAME]


def check_output(plan: Plan, spec: ConversionSpec, source: SourceIdentity) -> None:
    """Refuse an output that ``prepare_output`` would refuse, writing nothing: the CLI and the
    runner call it before they print the plan and start a cluster, so a conflict costs no wait."""
    path = spec.output.path
    if is_url(path):
        # The lease first: a prefix another run is starting on holds its objects before its claim
        # is readable, and that run is busy, not a conflict (nor objects to delete).
        with output_lock(path, spec.output.storage_options):
            _check_object_output(plan, spec, source)
        return
    if os.path.exists(path) and not _is_empty_dir(path):
        existing = Manifest.load(path) if os.path.isdir(path) else None
        _refuse_existing(path, spec, content_of(plan, spec, source), existing, completion_marker(path))
        return
    # The nearest existing ancestor must be a directory we may write into.
    parent = os.path.abspath(path)
    while not os.path.exists(parent):
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent):
        raise OutputError(f"output.path: cannot create {path!r}: {parent!r} is a file, not a directory. Choose a writable location.")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise OutputError(f"output.path: cannot create {path!r}: permission denied ({parent}). Choose a writable location.")


def _check_object_output(plan: Plan, spec: ConversionSpec, source: SourceIdentity) -> None:
    store = output_store(spec)
    present, manifest, marker = inspect_object_output(store)  # a 403 or a missing bucket fails here, before the cluster
    if present:
        refuse_foreign(store, manifest, marker)
        if not spec.output.overwrite:
            _refuse_existing(spec.output.path, spec, content_of(plan, spec, source), manifest, marker)


def _refuse_existing(path: str, spec: ConversionSpec, content: dict[str, Any], existing: Manifest | None, finished: dict[str, Any] | None) -> None:
    """Raise OutputConflictError unless the non-empty ``path`` may be resumed or (--overwrite) replaced."""
    ours = existing is not None or finished is not None
    if spec.output.overwrite:
        if not ours and not any(os.path.exists(os.path.join(path, m)) for m in _ZARR_MARKERS):
            raise OutputConflictError(
                f"output.path: {path!r} exists and is neither an h5ngff output nor a Zarr store; --overwrite only replaces those. "
                f"Remove it yourself or choose a new path."
            )
        return
    if not ours:
        raise OutputConflictError(
            f"output.path: {path!r} exists and is not an h5ngff output, so it cannot be resumed. "
            f"Choose a new path, or set output.overwrite (--overwrite) to replace it if it is a Zarr store."
        )
    old = existing.content if existing is not None else finished.get("content", {})
    differences = _differences(old, content)
    if differences:
        raise OutputConflictError(
            f"output.path: {path!r} holds an h5ngff output of a different conversion ({'; '.join(differences)}). "
            f"Re-run with the original options to resume it, choose a new path, or use --overwrite to start fresh."
        )


def _remove_replaceable(path: str) -> None:
    log.info("Removing the existing output %s (--overwrite).", path)
    if not os.path.isdir(path):
        os.unlink(path)
        return
    # Everything but the lock file we hold (engine.write.lock): removing the directory itself would
    # unlink it, and a second run could then lock a fresh file and write here beside us.
    for name in os.listdir(path):
        if name == LOCK_NAME:
            continue
        entry = os.path.join(path, name)
        if os.path.isdir(entry) and not os.path.islink(entry):
            shutil.rmtree(entry)
        else:
            os.unlink(entry)


def _differences(old: dict[str, Any], new: dict[str, Any]) -> list[str]:
    return [f"{key}: was {old.get(key)!r}, now {new.get(key)!r}" for key in sorted(set(old) | set(new)) if old.get(key) != new.get(key)]


def _create(path: str, plan: Plan, spec: ConversionSpec, layouts: tuple[ArrayLayout, ...]) -> None:
    try:
        os.makedirs(path, exist_ok=True)
        # Not overwrite=True: zarr would remove the whole directory, our held lock file with it.
        # The directory holds nothing else by now (new, empty, or emptied by --overwrite).
        _create_arrays(LocalStore(path), plan, spec, layouts)
    except PermissionError as exc:
        raise OutputError(f"output.path: cannot create {path!r}: permission denied ({exc.filename}). Choose a writable location.") from None
    except OSError as exc:
        raise OutputError(f"output.path: cannot create {path!r}: {exc.strerror or exc}. Choose a writable location.") from None


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
        write_sidecars(store, output.manifest.checksums, {lay.level: os.path.basename(lay.path) for lay in output.layouts})
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


def _prepare_object_output(plan: Plan, spec: ConversionSpec, content: dict[str, Any], layouts: tuple[ArrayLayout, ...]) -> Output:
    """prepare_output for an s3:// output (engine.write.objoutput has the rules). The manifest header is
    the first object written: our claim on the prefix, so a run killed at any later point leaves
    an output h5ngff resumes or replaces; the array metadata follows it, and is PUT again on a
    resume (the same bytes) in case the kill came before it."""
    path, fmt, print_ = spec.output.path, zarr_format(spec), fingerprint(content)
    store = output_store(spec)
    present, manifest, marker = inspect_object_output(store)
    if present:
        refuse_foreign(store, manifest, marker)
        if spec.output.overwrite:
            remove_ours(store)
        else:
            _refuse_existing(path, spec, content, manifest, marker)
            if manifest is None:
                log.info("%s is already complete; nothing to do.", path)
                return Output(path, fmt, layouts, ObjectManifest(store), print_, resumed=True, complete=True)
            log.info("Resuming %s: %d slab(s) already recorded.", path, len(manifest.records))
            if marker is None:  # finished but for the manifest's deletion: its metadata is whole
                create_object_output(store, lambda memory: _create_arrays(memory, plan, spec, layouts))
            return Output(path, fmt, layouts, manifest, print_, resumed=True)
    manifest = ObjectManifest(store)
    manifest.start(content)
    create_object_output(store, lambda memory: _create_arrays(memory, plan, spec, layouts))
    return Output(path, fmt, layouts, manifest, print_, resumed=False)
