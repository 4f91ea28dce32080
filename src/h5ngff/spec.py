"""``ConversionSpec``: the one model of a conversion.

The CLI flags, the ``.spec`` of a ConversionJob YAML and the CRD's OpenAPI schema all come from
these classes. Field names are camelCase on the wire (Kubernetes style) and snake_case in Python.
The names ``source.path``, ``source.dataset``, ``output.path``, ``output.chunks``,
``pyramid.levels`` and ``resources.workers`` are a public contract: scripts and GitOps
repositories depend on them.

Everything here is pure validation; facts that need the data (does ``chunks`` have one entry per
axis?) are checked by the planner, which still names the spec field in its error.
"""

from __future__ import annotations

import difflib
import math
import re
from collections.abc import Sequence
from typing import Annotated, Any, Literal, TypeVar

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)
from pydantic.alias_generators import to_camel
from pydantic_core import ErrorDetails

from .codecs_table import (
    DEFAULT_CNAME,
    DEFAULT_CODEC,
    DEFAULT_LEVEL,
    DEFAULT_SHUFFLE,
    LEVEL_RANGES,
    BloscCname,
    BloscShuffle,
    CodecName,
)
from .errors import SpecError
from .units import MiB, parse_bytes

M = TypeVar("M", bound=BaseModel)
AXIS_TYPES = {"t": "time", "c": "channel", "z": "space", "y": "space", "x": "space"}
#: Units the NGFF specification allows (UDUNITS-2 names).
SPACE_UNITS = (
    "angstrom",
    "attometer",
    "centimeter",
    "decimeter",
    "exameter",
    "femtometer",
    "foot",
    "gigameter",
    "hectometer",
    "inch",
    "kilometer",
    "megameter",
    "meter",
    "micrometer",
    "mile",
    "millimeter",
    "nanometer",
    "parsec",
    "petameter",
    "picometer",
    "terameter",
    "yard",
    "yoctometer",
    "yottameter",
    "zeptometer",
    "zettameter",
)
TIME_UNITS = (
    "attosecond",
    "centisecond",
    "day",
    "decisecond",
    "exasecond",
    "femtosecond",
    "gigasecond",
    "hectosecond",
    "hour",
    "kilosecond",
    "megasecond",
    "microsecond",
    "millisecond",
    "minute",
    "nanosecond",
    "petasecond",
    "picosecond",
    "second",
    "terasecond",
    "yoctosecond",
    "yottasecond",
    "zeptosecond",
    "zettasecond",
)
#: NGFF images have at most 5 axes (tczyx): a per-axis list with more entries can never fit.
MAX_AXES = 5
#: Longest byte-quantity string accepted; bounds the CRD's CEL cost (operator/schema/admission.py).
MAX_QUANTITY_LENGTH = 64
#: The smallest worker any plan fits in: planner.memory.minimum_pod_limit() computes it from the
#: memory model's constants (the interpreter alone is about 100 MiB, plus the nanny and the room
#: below the pod limit). The spec sits below the planner (pyproject's import layers), so it holds
#: the number, and tests/test_operator_admission_limits.py fails when the two part.
MIN_WORKER_MEMORY = 226 * MiB

#: URL schemes an output path may carry; a path without ``scheme://`` is a local directory.
OUTPUT_SCHEMES: tuple[str, ...] = ("s3",)
#: URL schemes a source path may carry (an object in a bucket, read as byte ranges:
#: docs/engine.md, "Sources in a bucket"); a path without ``scheme://`` is a local file.
SOURCE_SCHEMES: tuple[str, ...] = ("s3",)
#: Storage options that only an output uses: a source read with an output's options leaves them out.
OUTPUT_ONLY_OPTIONS = ("lock", "lock_ttl", "multipart_threshold", "part_size", "uploads_in_flight")
#: What makes a path a URL (RFC 3986's scheme, then ``://``); the CRD's CEL rules use the same
#: regex (operator/schema/admission.py), so the API server and the model agree on what a URL is.
URL_PATTERN = "^[A-Za-z][A-Za-z0-9+.-]*://"
_SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://")
#: What a mistyped URL looks like: a scheme and a colon at the start of the path (``s3:/bucket``,
#: ``gs:bucket``), or any ``x://``. One letter and a colon is a Windows drive (``C:/data``), not a
#: scheme. Unless it is a supported URL, such a path would become a local directory named ``s3:``.
#: Only the start counts: ``./s3:odd`` and ``/data/a:b`` are local paths. The CRD uses it too.
SCHEME_LIKE_PATTERN = "^([A-Za-z][A-Za-z0-9+.-]+:|[A-Za-z]://)"
#: Leading or trailing whitespace. The characters are named because Python's ``\s`` (Unicode)
#: and the API server's RE2 ``\s`` (ASCII, no vertical tab) differ; the CRD uses it too.
PADDED_PATTERN = "^[ \\t\\n\\r\\f\\v]|[ \\t\\n\\r\\f\\v]$"
#: Longest source.path and output.path accepted (Linux's PATH_MAX); bounds the CRD's CEL cost.
MAX_PATH_LENGTH = 4096
#: The most files one image may stack (source.paths): bounds the spec's size in the CRD and the
#: manifest's identity of a stacked source; a larger acquisition is a batch, or a glob.
MAX_STACKED_FILES = 10000
#: The storage option that sets how many PUTs each worker thread keeps in flight (default: the
#: planner's choice by unit size, planner/memory.py upload_depth), and its largest value.
UPLOADS_IN_FLIGHT = "uploads_in_flight"
MAX_UPLOADS_IN_FLIGHT = 32


def url_scheme(path: str) -> str | None:
    """``s3`` for ``s3://bucket/x``; None for a local path (``out:1.ome.zarr`` has no ``://``)."""
    m = _SCHEME.match(path)
    return m.group(1).lower() if m else None


def _not_padded(path: str) -> None:
    # " out.ome.zarr" from a YAML or shell quoting slip would name a directory starting with a space.
    if re.search(PADDED_PATTERN, path):
        raise ValueError(f"Expected a path without leading or trailing whitespace. Got {path!r} instead.")


def _scheme_like(path: str) -> str | None:
    """The ``s3:`` of ``s3:/bucket/x``: a URL prefix without a supported ``scheme://``."""
    m = re.match(SCHEME_LIKE_PATTERN, path)
    return m.group(1) if m else None


def parse_output_path(path: str) -> str:
    """Refuse a URL whose scheme no store handles, or a mistyped one (``s3:/bucket``): it would
    otherwise be written as a local directory named ``s3:`` while the user believes the data is
    in a bucket."""
    _not_padded(path)
    scheme = url_scheme(path)
    if scheme in OUTPUT_SCHEMES:
        return path
    known = " or ".join(f"'{s}://'" for s in OUTPUT_SCHEMES)
    expected = f"a local directory or a {known} URL" if known else "a local directory (no URL scheme is supported)"
    if scheme is not None:
        raise ValueError(
            f"Expected {expected}. Got {path!r} instead ({scheme}:// is not supported; nothing was written)."
        )
    prefix = _scheme_like(path)
    if prefix is not None:
        raise ValueError(
            f"Expected {expected}. Got {path!r} instead: it starts like a URL ({prefix!r}) without a supported "
            f"'scheme://'. Write s3://bucket/prefix for a bucket, or ./{path} for a local directory; nothing was written."
        )
    return path


def parse_source_path(path: str) -> str:
    """Refuse a URL whose scheme no store reads, or a path that starts like one (``s3:/bucket``):
    a source is a file the workers see, or an object in a bucket (``s3://bucket/key``), and a
    mistyped URL would otherwise fail later, on a worker, as a file that does not exist."""
    _not_padded(path)
    scheme = url_scheme(path)
    if scheme in SOURCE_SCHEMES:
        if not path.partition("://")[2].partition("/")[0]:
            raise ValueError(f"Expected s3://BUCKET/KEY with a bucket name. Got {path!r} instead.")
        return path
    if scheme is not None:
        raise ValueError(
            f"Expected a path to the HDF5 file as the workers see it, or an s3://bucket/key URL. Got {path!r} instead "
            f"({scheme}:// is not read: copy the file to a volume or a bucket, and give its path)."
        )
    prefix = _scheme_like(path)
    if prefix is not None:
        raise ValueError(
            f"Expected a path to the HDF5 file as the workers see it, or an s3://bucket/key URL. Got {path!r} instead: "
            f"it starts like a URL ({prefix!r}); write s3://bucket/key for an object, or ./{path} for a local file whose "
            f"name has a colon."
        )
    return path


def _no_bool(value: Any) -> Any:
    # pydantic's lax mode reads True as 1: YAML's ``workers: yes`` would silently mean one worker.
    if isinstance(value, bool):
        raise ValueError(f"Expected a number, not a boolean. Got {value!r} instead.")
    return value


Int = Annotated[int, BeforeValidator(_no_bool)]
Float = Annotated[float, BeforeValidator(_no_bool)]


class _FieldError(ValueError):
    """A check made on a whole model that belongs to one of its fields: the error names that field
    (``output.shards``) rather than the model (``output``)."""

    def __init__(self, field: str, message: str):
        self.field = field
        super().__init__(message)


ByteQuantity = Annotated[
    int | str,
    Field(json_schema_extra={"x-kubernetes-int-or-string": True}),
]


class _Model(BaseModel):
    model_config = ConfigDict(
        alias_generator=to_camel,
        populate_by_name=True,
        extra="forbid",
        frozen=True,
    )

    def to_wire(self) -> dict[str, Any]:
        """The camelCase dict a ConversionJob's ``.spec`` holds, without unset defaults."""
        return self.model_dump(by_alias=True, exclude_none=True, mode="json")


def _int_or_auto(value: Any, allowed: str) -> Any:
    if isinstance(value, bool):
        raise ValueError(f"Expected {allowed}. Got {value!r} instead.")
    return value


def _number_or_auto(value: Any, allowed: str) -> Any:
    """An int-or-string field whose only string is 'auto': a number in quotes ("3") is refused,
    as the CRD's schema refuses it (the API server and the model give one answer, issue 41)."""
    if isinstance(value, str) and value.strip().lstrip("+-").replace(".", "", 1).isdigit():
        raise ValueError(f"Expected {allowed}. Got {value!r} (a string) instead: write a number without quotes.")
    return _int_or_auto(value, allowed)


def _positive_ints(name: str, value: list[int] | None) -> list[int] | None:
    if value is None:
        return None
    if not value:
        raise ValueError(f"Expected at least one positive integer. Got {value!r} instead.")
    if len(value) > MAX_AXES:
        raise ValueError(
            f"Expected at most {MAX_AXES} entries, one per axis (tczyx). Got {len(value)}: {value!r} instead."
        )
    bad = [v for v in value if v < 1]
    if bad:
        raise ValueError(f"Expected positive integers for every axis. Got {value!r} instead ({bad[0]} is not allowed).")
    return value


class SourceSpec(_Model):
    """The HDF5 input: one dataset, several stacked, or a container (Imaris, BigDataViewer). See docs/formats.md."""

    path: str = Field(
        "",
        min_length=1,
        max_length=MAX_PATH_LENGTH,
        description="Path to the HDF5 file (.h5, Imaris .ims, or a BigDataViewer .xml), as the workers see it, or an "
        "s3://bucket/key URL (read as byte ranges; docs/engine.md). With stack across files, a glob naming the files "
        "(/data/run/t*.h5 or s3://bucket/run/t*.h5, in natural order). Required unless paths is given.",
    )
    paths: list[Annotated[str, Field(min_length=1, max_length=MAX_PATH_LENGTH)]] | None = Field(
        None,
        min_length=1,
        max_length=MAX_STACKED_FILES,
        description="Files stacked in this order into one image, one dataset (or one Imaris or BigDataViewer image) "
        "each, along the new axis stack names (t, c or z). path is then the first of them.",
    )
    dataset: str = Field(
        min_length=1,
        description="Path of the dataset inside the file, e.g. /volume/data; several to stack: /ch{0..2}, /a,/b or a glob /ch*; / for a whole Imaris or BigDataViewer file.",
    )
    # --- formats (docs/formats.md) ---
    stack: str | None = Field(
        None,
        description="New axes for stacked datasets, one per {a..b} range or for a list or glob: c (default), t, or tc for two ranges.",
    )
    tile: Int | None = Field(None, ge=0, description="BigDataViewer: the tile to convert when the file holds several.")
    angle: Int | None = Field(
        None, ge=0, description="BigDataViewer: the angle to convert when the file holds several."
    )
    illumination: Int | None = Field(
        None, ge=0, description="BigDataViewer: the illumination to convert when the file holds several."
    )
    storage_options: dict[str, str] | None = Field(
        None,
        description="Object store options for an s3:// source, as output.storageOptions takes them (profile, endpoint, "
        "region, allow_http). Default: an s3:// output's own options; {} reads with the environment alone. "
        "Credentials belong in the environment (a Secret), not here.",
    )

    @model_validator(mode="before")
    @classmethod
    def _path_from_paths(cls, data: Any) -> Any:
        """``paths`` alone names the files: ``path`` is their first (so every reader of a spec
        finds a file in ``path``); given both, ``path`` must be that first file."""
        if isinstance(data, dict) and isinstance(data.get("paths"), list) and data["paths"] and not data.get("path"):
            return {**data, "path": data["paths"][0]}
        return data

    @field_validator("path")
    @classmethod
    def _source_path(cls, v: str) -> str:
        return parse_source_path(v) if v else v

    @field_validator("paths")
    @classmethod
    def _source_paths(cls, v: list[str] | None) -> list[str] | None:
        if v is not None:
            for p in v:
                parse_source_path(p)
        return v

    @field_validator("stack")
    @classmethod
    def _stack_axes(cls, v: str | None) -> str | None:
        if v is not None and (not v or any(a not in "tcz" for a in v) or len(set(v)) != len(v)):
            raise ValueError(
                f"Expected new axes from 't' and 'c' (and 'z' for files stacked into one image), e.g. 'c', 't' or "
                f"'tc'. Got {v!r} instead."
            )
        return v

    @model_validator(mode="after")
    def _files_or_datasets(self) -> "SourceSpec":
        if not self.path:
            raise _FieldError("path", "Expected a path to the HDF5 file, or paths: the files to stack. Got neither.")
        if self.paths and self.path != self.paths[0]:
            raise _FieldError(
                "path",
                f"Expected path to be the first of paths (or left out). Got {self.path!r} beside paths starting "
                f"{self.paths[0]!r} instead.",
            )
        files = self.stacks_files
        if files and (self.stack is None or len(self.stack) != 1):
            raise _FieldError(
                "stack",
                f"Expected one new axis (t, c or z) to stack the files {'of ' + repr(self.path) if not self.paths else 'in paths'} "
                f"into one image. Got {self.stack!r} instead. For one output per file, use a ConversionBatch "
                f"(h5ngff convert 'PATTERN' 'out/{{stem}}.ome.zarr').",
            )
        if not files and self.stack is not None and "z" in self.stack:
            raise _FieldError(
                "stack", f"Expected 'z' only to stack files (paths, or a glob in path). Got {self.stack!r} instead."
            )
        return self

    @model_validator(mode="after")
    def _files_in_one_place(self) -> "SourceSpec":
        kinds = {url_scheme(p) is not None for p in self.paths or []}
        if len(kinds) > 1:
            raise _FieldError(
                "paths",
                "Expected the files of one image all local or all objects in a bucket. Got local paths and URLs instead.",
            )
        return self

    @model_validator(mode="after")
    def _options_need_a_url(self) -> "SourceSpec":
        if self.storage_options is not None and not any(url_scheme(p) for p in [self.path, *(self.paths or [])] if p):
            raise _FieldError(
                "storageOptions",
                f"Expected storage options only with an s3:// source. Got {sorted(self.storage_options)} with the local "
                f"path {self.path!r} instead.",
            )
        return self

    @property
    def stacks_files(self) -> bool:
        """Several files make this one image: ``paths``, or a glob in ``path``."""
        return bool(self.paths) or any(ch in self.path for ch in "*?[")

    # --- end formats ---

    @field_validator("dataset")
    @classmethod
    def _absolute_dataset(cls, v: str) -> str:
        return v if v.startswith("/") else "/" + v


class CompressorSpec(_Model):
    """How chunks are compressed. One flat object so the CRD schema stays structural."""

    # The names, defaults and level ranges are the codec table's (h5ngff/codecs_table.py).
    codec: CodecName = Field(DEFAULT_CODEC, description="blosc (with cname/shuffle), zstd, gzip or none.")
    cname: BloscCname | None = Field(None, description="Blosc's inner compressor (blosc only; default zstd).")
    clevel: Int | None = Field(None, description="Compression level: blosc 0-9, zstd 1-22, gzip 1-9 (default 5).")
    shuffle: BloscShuffle | None = Field(None, description="Blosc's shuffle filter (blosc only; default bitshuffle).")

    @model_validator(mode="after")
    def _codec_options(self) -> "CompressorSpec":
        if self.codec != "blosc":
            for name in ("cname", "shuffle"):
                if getattr(self, name) is not None:
                    raise _FieldError(
                        name,
                        f"Expected {name} only with codec 'blosc'. Got {name}={getattr(self, name)!r} with codec {self.codec!r} instead.",
                    )
        levels = LEVEL_RANGES.get(self.codec)
        if levels is None and self.clevel is not None:
            raise _FieldError(
                "clevel", f"Expected no clevel with codec {self.codec!r}. Got clevel={self.clevel} instead."
            )
        if levels is not None and self.clevel is not None:
            low, high = levels
            if not low <= self.clevel <= high:
                raise _FieldError(
                    "clevel",
                    f"Expected clevel between {low} and {high} for codec {self.codec!r}. Got {self.clevel} instead.",
                )
        return self

    @property
    def level(self) -> int:
        return DEFAULT_LEVEL if self.clevel is None else self.clevel

    @property
    def blosc_cname(self) -> BloscCname:
        return self.cname or DEFAULT_CNAME

    @property
    def blosc_shuffle(self) -> BloscShuffle:
        return self.shuffle or DEFAULT_SHUFFLE

    def describe(self) -> str:
        if self.codec == "blosc":
            return f"blosc {self.blosc_cname} level {self.level} {self.blosc_shuffle}"
        if self.codec == "none":
            return "none"
        return f"{self.codec} level {self.level}"


class OutputSpec(_Model):
    """The OME-Zarr output."""

    path: str = Field(
        min_length=1,
        max_length=MAX_PATH_LENGTH,
        description="Output directory, conventionally ending in .ome.zarr, or an s3://bucket/prefix URL (docs/engine.md, Stores).",
    )
    ngff_version: Literal["0.4", "0.5"] = Field("0.5", description="0.5 writes Zarr v3 (default); 0.4 writes Zarr v2.")
    chunks: list[Int] | None = Field(
        None,
        description="Chunk shape, one entry per axis. Default: 64 per spatial axis in 3-D, 256 in 2-D, 1 for t and c.",
    )
    shards: list[Int] | None = Field(
        None, description="Shard shape (NGFF 0.5 only), a multiple of chunks on every axis."
    )
    compressor: CompressorSpec = Field(default_factory=CompressorSpec)
    overwrite: bool = Field(
        False, description="Replace an existing output that h5ngff or Zarr wrote. Never replaces other directories."
    )
    checksums: bool = Field(
        True,
        description="A CRC32C per chunk file: NGFF 0.5 writes the Zarr v3 crc32c codec, 0.4 a sidecar (0/.h5ngff-checksums/, local outputs only); h5ngff verify checks them.",
    )
    storage_options: dict[str, str] | None = Field(
        None,
        description="Object store options for an s3:// path, e.g. profile, endpoint, region, allow_http. Credentials belong in the environment (a Secret), not here.",
    )

    @field_validator("path")
    @classmethod
    def _known_scheme(cls, v: str) -> str:
        return parse_output_path(v)

    @field_validator("ngff_version", mode="before")
    @classmethod
    def _version_is_a_string(cls, v: Any) -> Any:
        # YAML reads an unquoted 0.5 as a float. The CRD declares a string and the API server
        # refuses the number, so accepting it here would pass a manifest locally that the cluster
        # refuses: say how to quote it instead.
        if isinstance(v, float):
            raise ValueError(
                f"Expected the string '0.4' or '0.5'. Got the number {v!r} instead (YAML reads an unquoted {v!r} as a number, "
                f'which the ConversionJob CRD refuses too): quote it, e.g. ngffVersion: "{v}".'
            )
        return v

    @field_validator("chunks", "shards")
    @classmethod
    def _positive(cls, v: list[int] | None, info) -> list[int] | None:
        return _positive_ints(info.field_name, v)

    @model_validator(mode="after")
    def _options_need_a_url(self) -> "OutputSpec":
        if self.storage_options and url_scheme(self.path) is None:
            raise _FieldError(
                "storageOptions",
                f"Expected storage options only with an s3:// output.path. Got {sorted(self.storage_options)} with the local path {self.path!r} instead.",
            )
        return self

    @field_validator("storage_options")
    @classmethod
    def _uploads_in_flight_is_a_count(cls, v: dict[str, str] | None) -> dict[str, str] | None:
        # The planner counts the uploads in flight in the memory plan, so it reads this option
        # itself (planner/plan.py upload_depth_for): it must be a small count before any plan.
        # Keys are case-insensitive, as the store reads them.
        for key, value in (v or {}).items():
            if key.lower() == UPLOADS_IN_FLIGHT and not (
                re.fullmatch(r"[0-9]{1,2}", str(value)) and int(value) <= MAX_UPLOADS_IN_FLIGHT
            ):
                raise ValueError(
                    f"Expected storageOptions.{key} to be a whole number from 0 (one PUT at a time) to {MAX_UPLOADS_IN_FLIGHT}. "
                    f"Got {value!r} instead."
                )
        return v

    @property
    def uploads_in_flight(self) -> int | None:
        """The ``uploads_in_flight`` storage option (its key in any case, as the store reads
        keys), or None where the planner chooses."""
        return next((int(v) for k, v in (self.storage_options or {}).items() if k.lower() == UPLOADS_IN_FLIGHT), None)

    @model_validator(mode="before")
    @classmethod
    def _no_sidecar_in_a_bucket(cls, data: Any) -> Any:
        # NGFF 0.4's checksums live in a sidecar written beside the chunk files, and the object
        # store writer writes none: a 0.4 bucket output defaults to no checksums (0.5's crc32c
        # codec travels inside every chunk and works on every store).
        if (
            isinstance(data, dict)
            and "checksums" not in data
            and isinstance(data.get("path"), str)
            and url_scheme(data["path"])
        ):
            if str(data.get("ngffVersion", data.get("ngff_version", "0.5"))) == "0.4":
                data = {**data, "checksums": False}
        return data

    @model_validator(mode="after")
    def _sidecar_needs_a_directory(self) -> "OutputSpec":
        if self.checksums and self.ngff_version == "0.4" and url_scheme(self.path):
            raise _FieldError(
                "checksums",
                "Expected checksums with ngffVersion '0.4' only for a local output (their sidecar is a directory beside the chunks). "
                "Got an object-store path instead: use ngffVersion '0.5' (checksums inside every chunk) or checksums: false.",
            )
        return self

    @model_validator(mode="after")
    def _shards_need_v3(self) -> "OutputSpec":
        if self.shards is not None:
            if self.ngff_version != "0.5":
                raise _FieldError(
                    "shards",
                    f"Expected shards only with ngffVersion '0.5' (Zarr v3). Got shards with ngffVersion {self.ngff_version!r} instead.",
                )
            if self.chunks is not None:
                if len(self.shards) != len(self.chunks):
                    raise _FieldError(
                        "shards",
                        f"Expected shards with as many entries as chunks ({len(self.chunks)}). Got {self.shards} instead.",
                    )
                bad = [i for i, (s, c) in enumerate(zip(self.shards, self.chunks)) if s % c]
                if bad:
                    raise _FieldError(
                        "shards",
                        f"Expected every shard entry to be a multiple of the chunk entry. Got shards {self.shards} for chunks {self.chunks} instead (axis {bad[0]}).",
                    )
        return self


class ImageSpec(_Model):
    """How the array maps to physical space. Anything omitted is read from HDF5 attributes or inferred."""

    axes: str | None = Field(None, description="Axis names in order, from t, c, z, y, x, e.g. 'tczyx' or 'zyx'.")
    scale: list[Float] | None = Field(None, description="Voxel size per axis, in `units`.")
    units: list[str] | None = Field(
        None,
        description="Unit per axis, e.g. micrometer or second; empty string for none. One space unit alone applies to every spatial axis.",
    )
    name: str | None = Field(None, description="Image name written to the multiscales metadata.")

    @field_validator("axes")
    @classmethod
    def _valid_axes(cls, v: str | None) -> str | None:
        if v is not None and v != v.strip():
            raise ValueError(f"Expected axis names without spaces, e.g. 'zyx'. Got {v!r} instead.")
        return None if v is None else parse_axes(v)

    @field_validator("units")
    @classmethod
    def _known_units(cls, v: list[str] | None) -> list[str] | None:
        if v is not None and len(v) > MAX_AXES:
            raise ValueError(f"Expected at most {MAX_AXES} units, one per axis (tczyx). Got {v!r} instead.")
        for unit in v or ():
            if unit and unit not in SPACE_UNITS + TIME_UNITS:
                raise ValueError(
                    f"Expected NGFF unit names such as 'micrometer', 'nanometer', 'millimeter', 'second' or '' for none. Got {unit!r} instead."
                )
        return v

    @field_validator("scale")
    @classmethod
    def _positive_scale(cls, v: list[float] | None) -> list[float] | None:
        if v is not None and len(v) > MAX_AXES:
            raise ValueError(f"Expected at most {MAX_AXES} voxel sizes, one per axis (tczyx). Got {v!r} instead.")
        if v is not None and (not v or any(not (s > 0 and math.isfinite(s)) for s in v)):
            raise ValueError(f"Expected a positive, finite voxel size for every axis. Got {v!r} instead.")
        return v


class PyramidSpec(_Model):
    """The multiscale pyramid built in the same pass as level 0."""

    levels: Annotated[int | Literal["auto"], Field(json_schema_extra={"x-kubernetes-int-or-string": True})] = Field(
        "auto",
        description="Number of levels including full resolution, or 'auto' (halve until one chunk holds the smallest level).",
    )

    @field_validator("levels", mode="before")
    @classmethod
    def _levels_not_bool(cls, v: Any) -> Any:
        return _number_or_auto(v, "'auto' or an integer from 1 to 16")

    method: Literal["mean", "nearest", "max"] = Field(
        "mean", description="mean (exact, rounded half to even for integers), nearest or max."
    )
    axes: str | None = Field(
        None,
        description="Axes to downsample at every level, e.g. 'yx'. Default: the spatial axes, each level halving those whose voxel size is finer than the coarsest (all of them once equal).",
    )

    @field_validator("levels")
    @classmethod
    def _levels_range(cls, v: int | str) -> int | str:
        if isinstance(v, int) and not 1 <= v <= 16:
            raise ValueError(f"Expected 'auto' or an integer from 1 to 16. Got {v} instead.")
        return v

    @field_validator("axes")
    @classmethod
    def _axes_letters(cls, v: str | None) -> str | None:
        if v is None:
            return None
        bad = [a for a in v if a not in "zyx"]
        if not v or bad or len(set(v)) != len(v):
            raise ValueError(f"Expected distinct spatial axes from 'zyx', e.g. 'yx'. Got {v!r} instead.")
        return v


class ResourcesSpec(_Model):
    """How much compute and memory the conversion may use."""

    workers: Annotated[int | Literal["auto"], Field(json_schema_extra={"x-kubernetes-int-or-string": True})] = Field(
        "auto", description="Dask worker processes. 'auto': one per core locally, 4 on Kubernetes."
    )
    threads_per_worker: Int = Field(1, ge=1, le=64, description="Threads per worker; each runs one slab at a time.")
    memory_per_worker: ByteQuantity | None = Field(
        None, description="Pod memory limit per worker, e.g. 1Gi. The plan must fit in it."
    )
    memory_total: ByteQuantity | None = Field(
        None, description="Memory for all workers together; the planner picks the worker count."
    )
    slab: list[Int] | None = Field(
        None, description="Read slab shape; re-aligned to the chunk grid with a notice if needed."
    )
    allocator: Literal["auto", "jemalloc", "glibc"] = Field(
        "auto", description="Worker malloc: jemalloc where installed, else glibc tuned to return memory."
    )

    @field_validator("workers", mode="before")
    @classmethod
    def _workers_not_bool(cls, v: Any) -> Any:
        return _number_or_auto(v, "'auto' or an integer from 1 to 4096")

    @field_validator("memory_per_worker", "memory_total", mode="before")
    @classmethod
    def _quantity_not_bool(cls, v: Any) -> Any:
        return _int_or_auto(v, "a byte quantity such as 1Gi")

    @field_validator("workers")
    @classmethod
    def _workers_range(cls, v: int | str) -> int | str:
        if isinstance(v, int) and not 1 <= v <= 4096:
            raise ValueError(f"Expected 'auto' or an integer from 1 to 4096. Got {v} instead.")
        return v

    @field_validator("memory_per_worker", "memory_total")
    @classmethod
    def _quantity(cls, v: int | str | None) -> int | str | None:
        if v is None:
            return None
        if isinstance(v, str) and len(v) > MAX_QUANTITY_LENGTH:
            raise ValueError(
                f"Expected a byte quantity such as 1Gi (at most {MAX_QUANTITY_LENGTH} characters). Got {len(v)} characters instead."
            )
        if parse_bytes(v) < MIN_WORKER_MEMORY:
            raise ValueError(
                f"Expected at least {MIN_WORKER_MEMORY // MiB}Mi, the smallest worker any plan fits in (Python and the "
                f"libraries alone take about 100Mi, and the nanny and the pod's headroom more). Got {v!r} instead: "
                f"raise it to at least {MIN_WORKER_MEMORY // MiB}Mi."
            )
        return v

    @field_validator("slab")
    @classmethod
    def _slab_positive(cls, v: list[int] | None) -> list[int] | None:
        return _positive_ints("slab", v)

    @model_validator(mode="after")
    def _one_budget(self) -> "ResourcesSpec":
        if self.memory_per_worker is not None and self.memory_total is not None:
            raise _FieldError(
                "memoryTotal",
                f"Expected memoryPerWorker or memoryTotal, not both. Got both (memoryPerWorker {self.memory_per_worker!r}, memoryTotal {self.memory_total!r}) instead.",
            )
        return self

    @property
    def memory_per_worker_bytes(self) -> int | None:
        return None if self.memory_per_worker is None else parse_bytes(self.memory_per_worker)

    @property
    def memory_total_bytes(self) -> int | None:
        return None if self.memory_total is None else parse_bytes(self.memory_total)


#: ``#SBATCH`` options the plan sets itself: a directive overriding them would break the plan.
SLURM_PLANNED_OPTIONS = (
    "--mem",
    "--mem-per-cpu",
    "--mem-per-gpu",
    "--cpus-per-task",
    "-c",
    "--ntasks",
    "-n",
    "--nodes",
    "-N",
)
#: A walltime as sbatch reads it: minutes, MM:SS, HH:MM:SS, D-HH, D-HH:MM or D-HH:MM:SS.
SLURM_WALLTIME = r"^(\d+-)?\d+(:\d{1,2}){0,2}$"
#: What SLURM_WALLTIME allows, in words (for the error message).
SLURM_WALLTIME_FORMATS = "minutes, MM:SS, HH:MM:SS, D-HH, D-HH:MM or D-HH:MM:SS (e.g. 90, 02:00:00, 1-12)"
#: An #SBATCH directive's option: its first word, after an optional ``#SBATCH``. The CRD matches
#: directives with the same expressions (operator/schema/admission.py).
SLURM_DIRECTIVE_PREFIX = r"^[ \t]*(#SBATCH)?[ \t]*"
SLURM_OPTION = SLURM_DIRECTIVE_PREFIX + r"(-[^ \t=]*)"
#: sbatch's short options that take no argument: they may precede another in one word (``-vc2``).
SBATCH_FLAG_LETTERS = "HOQVWhsuv"


def _planned_option_pattern() -> str:
    """A word of a directive that sbatch reads as an option the plan sets. sbatch reads every word
    of an #SBATCH line with getopt_long: a short option may carry its value (``-c2``) and follow
    argument-less flags (``-vc2``); a long option may be any prefix of its name (``--cpus-per-t=2``;
    a prefix shared with other options is refused by sbatch as ambiguous). Words in quotes or
    after a ``#`` are refused too: stricter than sbatch, never laxer."""
    longs = [o[2:] for o in SLURM_PLANNED_OPTIONS if o.startswith("--")]
    shorts = "".join(o[1] for o in SLURM_PLANNED_OPTIONS if not o.startswith("--"))
    prefixes = sorted({name[:i] for name in longs for i in range(1, len(name) + 1)}, key=lambda p: (-len(p), p))
    return f"({SLURM_DIRECTIVE_PREFIX}|[ \\t])(--({'|'.join(prefixes)})([ \\t=]|$)|-[{SBATCH_FLAG_LETTERS}]*[{shorts}])"


#: Matches a directive that sets an option the plan sets (SlurmSpec._not_planned; the CRD's rule).
SLURM_PLANNED_DIRECTIVE = _planned_option_pattern()
#: At most this many directives, of at most this many characters: bounds the CRD's CEL cost.
MAX_SLURM_DIRECTIVES = 64
MAX_SLURM_DIRECTIVE_LENGTH = 1024


def _one_line(v: str) -> str:
    if "\n" in v or "\r" in v:
        raise ValueError(f"Expected one line (it goes into the job script). Got {v!r} instead.")
    return v


class SlurmSpec(_Model):
    """Where the worker jobs run on a SLURM cluster (``--backend slurm``; docs/slurm.md). The job
    memory, CPUs and Dask limits come from the plan, never from here."""

    partition: str | None = Field(
        None, description="Partition for the worker jobs (#SBATCH -p); default: the cluster's default partition."
    )
    account: str | None = Field(None, description="Account charged for the worker jobs (#SBATCH -A).")
    qos: str | None = Field(None, description="Quality of service of the worker jobs (#SBATCH --qos).")
    walltime: str = Field(
        "01:00:00",
        pattern=SLURM_WALLTIME,
        description="Time limit of each worker job (#SBATCH -t), e.g. 02:00:00 or 1-00:00:00.",
    )
    directives: list[str] | None = Field(
        None,
        max_length=MAX_SLURM_DIRECTIVES,
        description="Extra #SBATCH options, one per entry, e.g. --constraint=skylake; not --mem or --cpus-per-task, which the plan sets.",
    )
    scratch: str = Field(
        "${TMPDIR:-/tmp}",
        min_length=1,
        description="Job-local scratch directory: the worker's Dask local directory (shell variables expand in the job, e.g. /scratch/$SLURM_JOB_ID).",
    )
    python: str | None = Field(
        None,
        description="Python interpreter the workers start with on the nodes (default: the one running h5ngff); it needs h5ngff installed.",
    )
    prologue: list[str] | None = Field(
        None,
        description="Shell lines run in the job before the worker starts, e.g. 'module load hdf5' or 'source /path/venv/bin/activate'.",
    )
    log_directory: str = Field(
        "h5ngff-slurm-logs",
        min_length=1,
        description="Where the jobs' .out and .err files go; it must be readable from where h5ngff runs (failures are read from them).",
    )
    pending_timeout: Int = Field(
        600,
        ge=1,
        le=7 * 86400,
        description="Seconds the worker jobs may pend before the run fails with reason WorkersPending and SLURM's pending reason.",
    )

    @field_validator("partition", "account", "qos", "scratch", "python", "log_directory")
    @classmethod
    def _single_line(cls, v: str | None) -> str | None:
        return None if v is None else _one_line(v)

    @field_validator("prologue")
    @classmethod
    def _prologue_lines(cls, v: list[str] | None) -> list[str] | None:
        return None if v is None else [_one_line(line) for line in v]

    @field_validator("directives")
    @classmethod
    def _not_planned(cls, v: list[str] | None) -> list[str] | None:
        for d in v or ():
            _one_line(d)
            if len(d) > MAX_SLURM_DIRECTIVE_LENGTH:
                raise ValueError(
                    f"Expected directives of at most {MAX_SLURM_DIRECTIVE_LENGTH} characters. Got {len(d)} characters instead."
                )
            match = re.match(SLURM_OPTION, d)
            if match is None:
                raise ValueError(f"Expected an sbatch option such as --constraint=skylake. Got {d!r} instead.")
            planned = re.search(SLURM_PLANNED_DIRECTIVE, d)
            if planned is not None:
                raise ValueError(
                    f"Expected no {_planned_word(planned.group(0))}: the plan sets the job's memory and CPUs "
                    f"(h5ngff plan --backend slurm shows them); change resources.memoryPerWorker or "
                    f"resources.threadsPerWorker instead. Got {d!r} instead."
                )
        return v


def _planned_word(match: str) -> str:
    """The option a SLURM_PLANNED_DIRECTIVE match sets, as sbatch reads it: ``-vc`` -> ``-c``,
    ``--cpus-per-t`` -> ``--cpus-per-t (sbatch reads a prefix as --cpus-per-task)``."""
    word = match.strip(" \t=").removeprefix("#SBATCH").strip(" \t")
    if not word.startswith("--"):
        return f"-{word[-1]}" + (f" (in {word}, as sbatch reads it)" if len(word) > 2 else "")
    if word in SLURM_PLANNED_OPTIONS:
        return word
    names = [o for o in SLURM_PLANNED_OPTIONS if o.startswith(word)]
    return f"{word} (sbatch reads an option's prefix as the option: {' or '.join(names)})"


class ConversionSpec(_Model):
    """One conversion: source, output, image metadata, pyramid and resources."""

    source: SourceSpec
    output: OutputSpec
    image: ImageSpec = Field(default_factory=ImageSpec)
    pyramid: PyramidSpec = Field(default_factory=PyramidSpec)
    resources: ResourcesSpec = Field(default_factory=ResourcesSpec)

    @property
    def source_storage_options(self) -> dict[str, str]:
        """The options an s3:// source is read with: its own where given (``{}``: the environment
        alone); else an s3:// output's, less the options only an output uses, as one endpoint
        usually serves both (docs/engine.md, "Sources in a bucket"); else none."""
        if self.source.storage_options is not None:
            return dict(self.source.storage_options)
        return source_options_from_output(self.output.path, self.output.storage_options)

    @model_validator(mode="after")
    def _agrees_with_axes(self) -> "ConversionSpec":
        """With ``image.axes`` given, the per-axis lists must fit it. The planner checks the same
        against the dataset (axes may also come from HDF5 attributes); checking here too lets the
        CRD refuse them at admission (operator/schema/admission.py mirrors these rules in CEL)."""
        axes = self.image.axes
        if axes is None:
            return self
        n = len(axes)
        for name, value in (
            ("output.chunks", self.output.chunks),
            ("output.shards", self.output.shards),
            ("image.scale", self.image.scale),
            ("resources.slab", self.resources.slab),
        ):
            if value is not None and len(value) != n:
                raise _FieldError(name, f"Expected {n} entries, one per axis {axes!r}. Got {list(value)} instead.")
        _check_units(self.image.units, axes)
        missing = [a for a in self.pyramid.axes or "" if a not in axes]
        if missing:
            raise _FieldError(
                "pyramid.axes",
                f"Expected axes present in the image axes {axes!r}. Got {self.pyramid.axes!r} instead ({missing[0]!r} is not an image axis).",
            )
        return self


def source_options_from_output(output_path: str, options: dict[str, str] | None) -> dict[str, str]:
    """A bucket source's default options: an s3:// output's, less those only an output uses."""
    if url_scheme(output_path) is None:
        return {}
    return {k: v for k, v in (options or {}).items() if k.lower() not in OUTPUT_ONLY_OPTIONS}


def _check_units(units: list[str] | None, axes: str) -> None:
    """The planner's unit rules (planner/layout.py, resolve_scale_units) for explicit axes."""
    if not units or (len(units) == 1 and units[0] in SPACE_UNITS):
        return  # none, or one space unit for every spatial axis
    if len(units) != len(axes):
        raise _FieldError("image.units", f"Expected {len(axes)} units, one per axis {axes!r}. Got {units} instead.")
    for axis, unit in zip(axes, units):
        allowed = SPACE_UNITS if AXIS_TYPES[axis] == "space" else TIME_UNITS if axis == "t" else ()
        if unit and unit not in allowed:
            raise _FieldError(
                "image.units",
                f"Expected a {AXIS_TYPES[axis]} unit for axis {axis!r} (or '' for none). Got {unit!r} instead.",
            )


def parse_axes(value: str) -> str:
    """Validate an NGFF axis string: time first, then channel, then 2 or 3 spatial axes."""
    v = value.strip().lower()
    unknown = sorted({a for a in v if a not in AXIS_TYPES})
    if unknown or len(set(v)) != len(v):
        raise ValueError(
            f"Expected distinct axis names from 't', 'c', 'z', 'y', 'x', e.g. 'tczyx'. Got {value!r} instead."
        )
    kinds = [AXIS_TYPES[a] for a in v]
    spatial = kinds.count("space")
    order = {"time": 0, "channel": 1, "space": 2}
    if not 2 <= spatial <= 3 or kinds != sorted(kinds, key=order.__getitem__):
        raise ValueError(
            f"Expected 2 or 3 spatial axes after optional 't' then 'c' (NGFF order), e.g. 'tczyx', 'czyx', 'yx'. Got {value!r} instead."
        )
    return v


#: Names pydantic puts into an error's location for the member of a union that failed.
_UNION_TAGS = {"int", "str", "float", "bool", "none"}


def _is_union_tag(part: Any) -> bool:
    return isinstance(part, str) and (part in _UNION_TAGS or "[" in part)


def _field_path(err: ErrorDetails) -> str:
    """The wire (camelCase) path of an error: ``output.chunks[1]``. A misspelt key is quoted as the
    user wrote it (camel-casing ``Workers`` would name a valid field)."""
    loc = list(err["loc"])
    extra = str(loc.pop()) if err["type"] == "extra_forbidden" and loc else None
    parts = [p for p in loc if not _is_union_tag(p)]
    error = (err.get("ctx") or {}).get("error")
    if isinstance(error, _FieldError):
        parts.append(error.field)
    path = ""
    for p in parts:
        path += f"[{p}]" if isinstance(p, int) else ("." if path else "") + ".".join(map(to_camel, str(p).split(".")))
    if extra is not None:
        path += ("." if path else "") + extra
    return path


#: What a field's pattern allows, in words: the pattern itself is no message.
_PATTERN_WORDS = {SLURM_WALLTIME: f"a SLURM time limit: {SLURM_WALLTIME_FORMATS}"}


def _expected(err: ErrorDetails) -> str:
    """What one failed check allows, as the object of 'Expected …'."""
    kind = err["type"]
    if kind == "literal_error":
        expected = str((err.get("ctx") or {}).get("expected"))
        return f"one of {expected}" if " or " in expected else expected
    if kind in ("greater_than_equal", "less_than_equal", "greater_than", "less_than"):
        return f"a number {err['msg'].removeprefix('Input should be ')}"
    if kind == "string_too_short":
        return "a non-empty string"
    if kind == "string_pattern_mismatch":
        pattern = str((err.get("ctx") or {}).get("pattern"))
        return _PATTERN_WORDS.get(pattern, f"a string matching {pattern}")
    # "a valid integer, unable to parse string as an integer" -> "a valid integer"
    return err["msg"].removeprefix("Input should be ").split(",")[0]


def _describe_pydantic_error(err: ErrorDetails, alternatives: Sequence[ErrorDetails] = ()) -> tuple[str, str]:
    """Turn one pydantic error into (field path, 'Expected … Got … instead.'). ``alternatives``
    are the other members of the same union that also failed: their allowed values are named too."""
    field = _field_path(err)
    got = err.get("input")
    kind = err["type"]
    if kind == "missing":
        return field, "Expected a value; this field is required. Got nothing instead."
    if kind == "extra_forbidden":
        return (
            field,
            f"Expected no such field (check its spelling and case; fields are camelCase). Got {got!r} instead.",
        )
    if kind == "value_error":
        return field, str((err.get("ctx") or {}).get("error", err["msg"])).removeprefix("Value error, ")
    allowed = " or ".join(dict.fromkeys(_expected(e) for e in [err, *alternatives]))
    return field, f"Expected {allowed}. Got {got!r} instead."


def _did_you_mean(key: str, errors: Sequence[ErrorDetails], model: type[BaseModel] | None) -> str:
    """' Did you mean source?' for a misspelt key: the closest field left missing beside it, else
    the closest field name anywhere in ``model``."""
    parent = list(errors[0]["loc"][:-1])
    missing = [str(e["loc"][-1]) for e in errors if e["type"] == "missing" and list(e["loc"][:-1]) == parent]
    candidates = [to_camel(m) for m in missing]
    if not candidates and model is not None:
        candidates = sorted(_field_names(model))
    close = difflib.get_close_matches(key, candidates, n=1, cutoff=0.6)
    return f" Did you mean {close[0]}?" if close else ""


def _field_names(model: type[BaseModel], seen: set[type] | None = None) -> set[str]:
    """Every field name (camelCase, as manifests spell them) in ``model`` and the models it holds."""
    seen = seen if seen is not None else set()
    if model in seen:
        return set()
    seen.add(model)
    names: set[str] = set()
    for name, info in model.model_fields.items():
        names.add(info.alias or to_camel(name))
        for inner in _models_in(info.annotation):
            names |= _field_names(inner, seen)
    return names


def _models_in(annotation: Any) -> list[type[BaseModel]]:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    return [m for arg in getattr(annotation, "__args__", ()) for m in _models_in(arg)]


def parse_model(model: type[M], data: Any) -> M:
    """Validate a ``.spec`` dict into ``model``, or raise SpecError naming the field."""
    if isinstance(data, model):
        return data
    if not isinstance(data, dict):
        raise SpecError("spec", f"Expected a mapping with source and output. Got {type(data).__name__} instead.")
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise spec_error_from(exc, model) from None


def parse_spec(data: Any) -> ConversionSpec:
    """Validate a ConversionJob ``.spec`` (a dict) into a ConversionSpec, or raise SpecError."""
    return parse_model(ConversionSpec, data)


def spec_error_from(exc: ValidationError, model: type[BaseModel] | None = None) -> SpecError:
    errors = exc.errors(include_url=False)
    # Union members each report a failure; keep the most specific one (a value_error beats a type
    # error), and name what every member allows. A misspelt key comes before the field it leaves
    # missing: "sourc: no such field, did you mean source?" says what to change, "source: a value
    # is required" hid the typo.
    errors.sort(key=lambda e: (e["type"] != "value_error", e["type"] != "extra_forbidden"))
    first = errors[0]
    same = [e for e in errors[1:] if _field_path(e) == _field_path(first) and e["type"] != "value_error"]
    field, message = _describe_pydantic_error(first, same if first["type"] != "value_error" else [])
    meant: set[str] = set()
    if first["type"] == "extra_forbidden":
        hint = _did_you_mean(str(first["loc"][-1]), errors, model)
        message += hint
        # The field the typo left missing is the same problem, not one more.
        meant = {_field_path(e) for e in errors if e["type"] == "missing" and hint.endswith(f" {e['loc'][-1]}?")}
        meant |= {p for p in (_field_path(e) for e in errors) if any(p.startswith(m + ".") for m in meant)}
    others = len({_field_path(e) for e in errors} - {field} - meant)
    extra = f" ({others} more problem(s) after fixing this one)" if others else ""
    return SpecError(field, message + extra)
