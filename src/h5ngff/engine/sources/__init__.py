"""Sources: a reader per container behind one interface (``base.Opened`` / ``base.SlabSource``).

``open_source(spec)`` detects the container and describes it (metadata only):

- a plain dataset: ``in.h5:/volume/data`` (``plain.open_plain``);
- several datasets of one file stacked along new t or c axes: ``in.h5:/ch{0..2}``, a list
  or a glob (``plain.open_stacked``);
- an Imaris ``.ims`` file (``imaris.open_imaris``);
- a BigDataViewer XML + HDF5 pair, named by either file (``bdv.open_bdv``).

docs/formats.md says what is read from where.
"""

from __future__ import annotations

import os
from dataclasses import replace
from typing import Any

from ...errors import SpecError, UnsupportedDatasetError
from ...spec import ConversionSpec, SourceSpec, parse_spec
from .access import Access, access_for
from .base import Opened, SlabSource, close_files
from .objects import Opener, in_bucket
from .plain import is_selection, open_plain, open_stacked, overridden

__all__ = [
    "Opened",
    "Opener",
    "SlabSource",
    "close_files",
    "detect",
    "open_source",
    "slab_source",
    "verify_source",
]


def detect(source: SourceSpec, access: Access | None = None) -> str:
    """Which reader a source needs: plain, stacked, imaris or bdv."""
    if source.path.lower().endswith(".xml"):
        return "bdv"
    if is_selection(source.dataset):
        return "stacked"
    if source.dataset.strip("/") == "":
        with (access or Access()).open_h5(source.path) as f:
            if "DataSet" in f and "DataSetInfo" in f:
                return "imaris"
            if "s00" in f and "t00000" in f:
                return "bdv"
    return "plain"


def open_source(spec: ConversionSpec, *, check_metadata: bool = True, objects: Opener | None = None) -> Opened:
    """Describe the spec's source: the planner's numbers, resume's identity, the workers' reader.

    Metadata the reader cannot map (an unknown unit) stops here unless the user's flags decide
    it; ``check_metadata=False`` (verify, which compares data only) lets it pass. ``objects``
    opens a bucket where the source is one (``engine.stores.open_object_reader``, passed by the
    rooms above: the sources never import the stores)."""
    access = access_for(spec, objects)
    opened = _open(spec, access)
    remote = opened.reader.remote
    if remote is not None:  # the planner prices the ranged reads (planner/memory.py, source_range_terms)
        info = replace(
            opened.info,
            hdf5_direct_read=False,
            remote_in_flight=remote.in_flight,
            remote_request_bytes=remote.largest_request,
            remote_stored_chunk_bytes=remote.largest_stored,
            remote_gap_bytes=remote.gap_bytes,
        )
        opened = replace(opened, info=info)
    if check_metadata:
        decided = overridden(spec)
        if "image.scale" in decided:
            decided.add("image.units")  # sizes given by the user are in the unit they give, or none
        for field_name, message in opened.conflicts:
            if field_name not in decided:
                raise UnsupportedDatasetError(message)
    return opened


def _open(spec: ConversionSpec, access: Access) -> Opened:
    if spec.source.stacks_files:  # one image from many files: each opened as one source below
        from .files import open_file_stack

        return open_file_stack(spec, lambda one: _open(one, access), access)
    kind = detect(spec.source, access)
    _check_options(spec.source, kind)
    if kind == "stacked":
        return open_stacked(spec, access)
    if kind == "imaris":
        from .imaris import open_imaris

        return open_imaris(spec, access)
    if kind == "bdv":
        from .bdv import open_bdv

        return open_bdv(spec, access)
    return open_plain(spec, access)


def _check_options(source: SourceSpec, kind: str) -> None:
    """Options of one container given for another are mistakes, not no-ops."""
    if source.stack is not None and kind != "stacked":
        raise SpecError(
            "source.stack",
            f"Expected source.stack only with several datasets (e.g. /ch{{0..2}}). Got stack {source.stack!r} for a {kind} source instead.",
        )
    for name in ("tile", "angle", "illumination"):
        if getattr(source, name) is not None and kind != "bdv":
            raise SpecError(
                f"source.{name}",
                f"Expected source.{name} only with a BigDataViewer source. Got {name} {getattr(source, name)} for a {kind} source instead.",
            )


def slab_source(spec: ConversionSpec, cache_bytes: int, objects: Opener | None = None) -> SlabSource:
    """The workers' reader with the plan's chunk cache."""
    return replace(open_source(spec, objects=objects).reader, cache_bytes=cache_bytes)


def verify_source(
    path: str,
    dataset: str,
    recorded: dict[str, Any] | None = None,
    objects: Opener | None = None,
    options: dict[str, str] | None = None,
) -> SlabSource:
    """The source ``verify --source`` compares with. Where the output's provenance names the same
    file and selection, its other choices (stack axes, BDV tile/angle) apply too. A source in a
    bucket is read with ``options`` (verify's ``--source-storage-option``) through ``objects``."""
    source: dict[str, Any] = {"path": path, "dataset": dataset}
    if (
        recorded
        and _same_path(str(recorded.get("path", "")), path)
        and recorded.get("dataset") == (dataset if dataset.startswith("/") else "/" + dataset)
    ):
        source = {**recorded, **source}
    source.pop("storageOptions", None)  # never recorded; and these are the ones given now
    if options is not None and in_bucket(path):
        source["storageOptions"] = options
    spec = parse_spec({"source": source, "output": {"path": "unused"}})
    # The output's units and sizes may have come from flags: only the data is compared.
    return open_source(spec, check_metadata=False, objects=objects).reader


def _same_path(a: str, b: str) -> bool:
    return a == b if in_bucket(a) or in_bucket(b) else os.path.abspath(a) == os.path.abspath(b)
