"""Admission rules of the ConversionJob CRD: what the API server refuses at ``kubectl apply``.

The pydantic models (``spec.py``, ``jobspec.py``) give the CRD its shape, types, enums and plain
ranges (``crd.py``). The rules here add what a JSON schema derived from pydantic cannot say:
OpenAPI keys the models check in validators (patterns, list lengths, item ranges), and CEL
``x-kubernetes-validations`` for rules across fields and for ``int | 'auto'`` fields. Together
they refuse exactly what the model refuses for the spec alone (``tests/test_admission.py`` runs a
table of specs through both and demands the same verdict), so ``kubectl apply --dry-run=server``
shows the error instead of the operator, minutes later.

Kubernetes' CEL functions used beyond standard CEL: ``find`` (Kubernetes' regex library, 1.24+),
to read a byte quantity's number. CEL cost: every list a rule iterates has ``maxItems`` and every
string a rule matches has ``maxLength`` or a bounded pattern, so the API server's cost estimate
stays far below its per-rule limit.

Each rule's ``path`` is a dotted path into ``.spec`` (``[]`` = every item of a list).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from itertools import permutations
from typing import Any

from ...codecs_table import DEFAULT_CODEC, LEVEL_RANGES, CodecName
from ...jobspec import (
    DEFAULT_MAX_RETRY_INTERVAL,
    DEFAULT_RETRY_INTERVAL,
    MAX_VOLUME_NAME,
    MAX_VOLUMES,
    MOUNT_PATH_PATTERN,
    SCRATCH_VOLUME,
)
from ...spec import (
    MAX_AXES,
    MAX_QUANTITY_LENGTH,
    MAX_SLURM_DIRECTIVE_LENGTH,
    MAX_UPLOADS_IN_FLIGHT,
    MIN_WORKER_MEMORY,
    OUTPUT_SCHEMES,
    PADDED_PATTERN,
    SCHEME_LIKE_PATTERN,
    SLURM_DIRECTIVE_PREFIX,
    SLURM_PLANNED_DIRECTIVE,
    SLURM_PLANNED_OPTIONS,
    SOURCE_SCHEMES,
    SPACE_UNITS,
    TIME_UNITS,
    UPLOADS_IN_FLIGHT,
    URL_PATTERN,
)
from ...units import MAX_BYTES, SPACE, MiB


def _cel_string(regex: str) -> str:
    """``regex`` as the body of a single-quoted CEL string literal (its backslashes escaped)."""
    return regex.replace("\\", "\\\\")


@dataclass(frozen=True)
class SchemaRule:
    """OpenAPI keys merged into the node at ``path``."""

    path: str
    keys: dict[str, Any]
    why: str


@dataclass(frozen=True)
class CelRule:
    """One ``x-kubernetes-validations`` entry on the node at ``path``."""

    path: str
    rule: str
    message: str
    field_path: str | None = None
    why: str = ""
    extra: dict[str, Any] = field(default_factory=dict)

    def validation(self) -> dict[str, Any]:
        out = {"rule": self.rule, "message": self.message}
        if self.field_path:
            out["fieldPath"] = self.field_path
        return out


def _spatial_permutations(lengths: tuple[int, ...], letters: str) -> list[str]:
    return sorted({"".join(p) for n in lengths for p in permutations(letters, n)}, key=lambda s: (-len(s), s))


def _axes_pattern() -> str:
    """parse_axes as a pattern: optional t, optional c, then 2 or 3 distinct spatial axes; either
    case, as the model lower-cases."""
    spatial = "|".join("".join(f"[{c}{c.upper()}]" for c in p) for p in _spatial_permutations((3, 2), "zyx"))
    return f"^[tT]?[cC]?({spatial})$"


_NUMBER = "[0-9]*\\.?[0-9]+([eE][+-]?[0-9]+)?"
#: units.parse_bytes' grammar: a number, optional spaces, then nothing, B, or k/M/G/T with an
#: optional i and an optional B, in any case.
QUANTITY_PATTERN = f"^{SPACE}*{_NUMBER}{SPACE}*([kKmMgGtT][iI]?)?[bB]?{SPACE}*$"
_MULTIPLIERS = [
    ("[kK][iI]", 1 << 10),
    ("[kK]", 10**3),
    ("[mM][iI]", 1 << 20),
    ("[mM]", 10**6),
    ("[gG][iI]", 1 << 30),
    ("[gG]", 10**9),
    ("[tT][iI]", 1 << 40),
    ("[tT]", 10**12),
]


def _quantity_bytes_expr() -> str:
    """CEL for the byte count of a string ``self`` already matching QUANTITY_PATTERN."""
    mult = "1.0"
    for suffix, factor in reversed(_MULTIPLIERS):
        mult = f"self.matches('[0-9.]{_cel_string(SPACE)}*{suffix}[bB]?{_cel_string(SPACE)}*$') ? {float(factor)!r} : {mult}"
    return f"double(self.find('{_NUMBER.replace(chr(92), chr(92) * 2)}')) * ({mult})"


def _quantity_rule(path: str, name: str) -> CelRule:
    # A string's bytes are computed in doubles, as units.parse_bytes computes them: the bounds
    # agree, and 1e300Gi (infinite) is refused like any quantity past MAX_BYTES. A JSON integer
    # is an int64 here, always below MAX_BYTES.
    floor = MIN_WORKER_MEMORY
    in_range = f"n >= {float(floor)!r} && n < {float(MAX_BYTES)!r}"
    return CelRule(
        path,
        f"type(self) == int ? self >= {floor} : (self.matches('{_cel_string(QUANTITY_PATTERN)}') && "
        f"[{_quantity_bytes_expr()}].all(n, {in_range}))",
        f"{name} must be at least {floor // MiB}Mi (the smallest worker any plan fits in) and below 2**63 bytes, "
        f"as a byte count or a quantity such as 1Gi or 512MiB",
        why="units.parse_bytes and ResourcesSpec._quantity's floor, spec.MIN_WORKER_MEMORY (planner.memory.minimum_pod_limit)",
    )


def _int_or_auto(path: str, low: int, high: int, name: str) -> CelRule:
    return CelRule(
        path,
        f"type(self) == int ? self >= {low} && self <= {high} : self == 'auto'",
        f"{name} must be 'auto' or an integer from {low} to {high}",
        why="an int-or-string field: OpenAPI cannot range-check only its integers",
    )


def _per_axis(list_path: str, label: str) -> CelRule:
    section, name = list_path.split(".")
    root = f"self.{section}"
    return CelRule(
        "",
        f"!has(self.image) || !has(self.image.axes) || !has({root}) || !has({root}.{name}) || size({root}.{name}) == size(self.image.axes)",
        f"{list_path} must have one entry per axis of image.axes",
        f".{list_path}",
        why=f"planner: {label}",
    )


#: Among NGFF's unit names (the schema's enum for image.units items), the time units are exactly
#: these; every other one is a space unit. Shorter (and cheaper) than listing 49 names in CEL.
TIME_UNIT_PATTERN = "^(.*second|minute|hour|day)$"


def _unit_kind_rule() -> CelRule:
    terms = []
    for i in range(MAX_AXES):
        u = f"self.image.units[{i}]"
        kind = (
            f"(self.image.axes.matches('^.{{{i}}}[tT]') ? {u}.matches('{TIME_UNIT_PATTERN}') : "
            f"!self.image.axes.matches('^.{{{i}}}[cC]') && !{u}.matches('{TIME_UNIT_PATTERN}'))"
        )
        terms.append(f"(size(self.image.units) <= {i} || {u} == '' || {kind})")
    guard = "!has(self.image) || !has(self.image.axes) || !has(self.image.units) || size(self.image.units) != size(self.image.axes)"
    return CelRule(
        "",
        f"{guard} || ({' && '.join(terms)})",
        "image.units must give a space unit for z, y and x, a time unit for t, and '' for c",
        ".image.units",
        why="planner: resolve_scale_units",
    )


def _level_range_rule() -> CelRule:
    """``clevel`` within its codec's range (the codec table's LEVEL_RANGES); a spec without
    ``codec`` has the default codec's range."""

    def within(codec: CodecName) -> str:
        low, high = LEVEL_RANGES[codec]
        return f"self.clevel >= {low} && self.clevel <= {high}"

    branches = [f"has(self.codec) && self.codec == '{c}' ? {within(c)} : " for c in LEVEL_RANGES if c != DEFAULT_CODEC]
    branches.append(f"!has(self.codec) || self.codec == '{DEFAULT_CODEC}' ? {within(DEFAULT_CODEC)} : true")
    ranges = ", ".join(f"{low}-{high} for {c}" for c, (low, high) in LEVEL_RANGES.items())
    return CelRule(
        "output.compressor",
        "!has(self.clevel) || (" + "".join(branches) + ")",
        f"output.compressor.clevel must be {ranges}",
        ".clevel",
        why="codecs_table.LEVEL_RANGES",
    )


def _shard_multiple_rule() -> CelRule:
    terms = " && ".join(
        f"(size(self.chunks) <= {i} || self.shards[{i}] % self.chunks[{i}] == 0)" for i in range(MAX_AXES)
    )
    return CelRule(
        "output",
        f"!has(self.shards) || !has(self.chunks) || size(self.shards) != size(self.chunks) || ({terms})",
        "output.shards must be a multiple of output.chunks on every axis",
        ".shards",
        why="OutputSpec._shards_need_v3",
    )


def _any_case(text: str) -> str:
    return "".join(f"[{c.lower()}{c.upper()}]" if c.isalpha() else c for c in text)


def _output_scheme_rule() -> CelRule:
    """parse_output_path: a URL's scheme (case-insensitive, as url_scheme lower-cases) must be one
    a store handles; a path without ``scheme://`` is a local directory."""
    known = "|".join(_any_case(s) for s in OUTPUT_SCHEMES)
    schemes = " or ".join(f"an {s}://" for s in OUTPUT_SCHEMES)
    return CelRule(
        "output.path",
        f"!self.matches('{URL_PATTERN}') || self.matches('^({known})://')",
        f"output.path must be a local directory or {schemes} URL (gs://, http://, file:// and other schemes are not supported)",
        why="OutputSpec._known_scheme (parse_output_path)",
    )


def _url_like_output_rule() -> CelRule:
    """parse_output_path: a path that starts like a URL but is none (``s3:/bucket``)."""
    return CelRule(
        "output.path",
        f"!self.matches('{SCHEME_LIKE_PATTERN}') || self.matches('{URL_PATTERN}')",
        "output.path must not start like a URL without '://' (s3:/bucket, gs:bucket): write s3://bucket/prefix, "
        "or ./NAME for a local directory whose name has a colon",
        why="OutputSpec._known_scheme (parse_output_path, SCHEME_LIKE_PATTERN)",
    )


def _source_url() -> str:
    """What parse_source_path accepts as a URL: a known scheme (any case) and a bucket name."""
    known = "|".join(_any_case(s) for s in SOURCE_SCHEMES)
    return f"^({known})://[^/]+"


def _source_scheme_rule() -> CelRule:
    """parse_source_path: a source is a path, or an s3://bucket/key URL; other schemes and
    URL-like prefixes (``s3:/bucket``) are refused."""
    return CelRule(
        "source.path",
        f"!self.matches('{SCHEME_LIKE_PATTERN}') || self.matches('{_source_url()}')",
        "source.path must be a path to the HDF5 file as the workers see it, or an s3://bucket/key URL (gs://, http://, "
        "file:// and URL-like prefixes such as s3:/bucket are not read)",
        why="SourceSpec._source_path (parse_source_path)",
    )


def _not_padded_rule(path: str) -> CelRule:
    return CelRule(
        path,
        f"!self.matches('{_cel_string(PADDED_PATTERN)}')",
        f"{path} must not begin or end with whitespace",
        why="parse_output_path / parse_source_path (PADDED_PATTERN)",
    )


def _file_stack_rules() -> tuple[CelRule, ...]:
    """SourceSpec._files_or_datasets, _source_paths and _options_need_a_url: one image from several
    files (source.paths, or a glob in source.path) needs exactly one new axis; 'z' only there;
    path, when given beside paths, is their first; the files are all paths or all s3:// URLs;
    storage options come with a URL."""
    files = "(has(self.paths) || (has(self.path) && self.path.matches('[*?\\\\[]')))"
    scheme, padded = SCHEME_LIKE_PATTERN, _cel_string(PADDED_PATTERN)
    return (
        CelRule(
            "source",
            "has(self.path) || has(self.paths)",
            "source needs path (the HDF5 file) or paths (the files to stack into one image)",
            why="SourceSpec._files_or_datasets: a path or paths",
        ),
        CelRule(
            "source",
            f"!{files} || (has(self.stack) && size(self.stack) == 1)",
            "source.stack must name one new axis (t, c or z) to stack several files into one image; for one output per "
            "file, use a ConversionBatch",
            ".stack",
            why="SourceSpec._files_or_datasets: files need one stack axis",
        ),
        CelRule(
            "source",
            f"!has(self.stack) || !self.stack.contains('z') || {files}",
            "source.stack 'z' stacks files (paths, or a glob in path) into one image",
            ".stack",
            why="SourceSpec._files_or_datasets: z only for files",
        ),
        CelRule(
            "source",
            "!has(self.path) || !has(self.paths) || self.path == self.paths[0]",
            "source.path must be the first of source.paths, or left out",
            ".path",
            why="SourceSpec._files_or_datasets: path is paths' first",
        ),
        CelRule(
            "source.paths",
            f"self.all(p, (!p.matches('{scheme}') || p.matches('{_source_url()}')) && !p.matches('{padded}'))",
            "source.paths must be paths to the HDF5 files as the workers see them, or s3://bucket/key URLs, with no "
            "surrounding whitespace",
            why="SourceSpec._source_paths (parse_source_path)",
        ),
        CelRule(
            "source.paths",
            f"self.all(p, p.matches('{URL_PATTERN}')) || self.all(p, !p.matches('{URL_PATTERN}'))",
            "source.paths must all be local files or all objects in a bucket",
            why="SourceSpec._files_in_one_place",
        ),
        CelRule(
            "source",
            f"!has(self.storageOptions) || (has(self.path) && self.path.matches('{URL_PATTERN}')) || "
            f"(has(self.paths) && self.paths.exists(p, p.matches('{URL_PATTERN}')))",
            "source.storageOptions are only for an s3:// source",
            ".storageOptions",
            why="SourceSpec._options_need_a_url",
        ),
    )


def _slurm_planned_rule() -> CelRule:
    """SlurmSpec._not_planned: RE2 has no negative lookahead, so a pattern cannot refuse the
    options the plan sets; CEL can, with the model's own expression (SLURM_PLANNED_DIRECTIVE: any
    word sbatch reads as one of them, ``-c2``, ``-vc2``, ``--cpus-per-t=2`` included)."""
    return CelRule(
        "slurm.directives",
        f"self.all(d, !d.matches('{_cel_string(SLURM_PLANNED_DIRECTIVE)}'))",
        f"slurm.directives must not set {', '.join(SLURM_PLANNED_OPTIONS)}: the plan sets the job's memory and CPUs (change resources.memoryPerWorker or resources.threadsPerWorker instead)",
        why="SlurmSpec._not_planned",
    )


def _positive_axis_list(path: str, why: str) -> SchemaRule:
    return SchemaRule(path, {"minItems": 1, "maxItems": MAX_AXES, "items": {"minimum": 1}}, why)


_VOLUME_NAME = {"type": "string", "minLength": 1, "maxLength": MAX_VOLUME_NAME}
#: SlurmSpec._one_line: the value goes into the job script, one line.
_ONE_LINE = {"pattern": "^[^\\n\\r]*$"}


def _one_line(path: str) -> SchemaRule:
    return SchemaRule(path, _ONE_LINE, "SlurmSpec._single_line: it goes into the job script")


SCHEMA_RULES: tuple[SchemaRule, ...] = (
    _positive_axis_list("output.chunks", "positive, one per axis, at most 5 axes (tczyx)"),
    _positive_axis_list("output.shards", "positive, one per axis, at most 5 axes (tczyx)"),
    _positive_axis_list("resources.slab", "positive, one per axis, at most 5 axes (tczyx)"),
    SchemaRule(
        "image.axes",
        {"maxLength": MAX_AXES, "pattern": _axes_pattern()},
        "parse_axes: t, then c, then 2 or 3 distinct spatial axes",
    ),
    SchemaRule(
        "image.scale",
        {"minItems": 1, "maxItems": MAX_AXES, "items": {"minimum": 0, "exclusiveMinimum": True}},
        "a positive voxel size per axis",
    ),
    # maxLength adds nothing to the enum but bounds the CEL cost of matching a unit.
    SchemaRule(
        "image.units",
        {
            "maxItems": MAX_AXES,
            "items": {"enum": [*SPACE_UNITS, *TIME_UNITS, ""], "maxLength": max(map(len, SPACE_UNITS + TIME_UNITS))},
        },
        "NGFF (UDUNITS-2) unit names, '' for none",
    ),
    SchemaRule(
        "pyramid.axes",
        {"maxLength": 3, "pattern": "^(" + "|".join(_spatial_permutations((3, 2, 1), "zyx")) + ")$"},
        "distinct spatial axes",
    ),
    SchemaRule(
        "resources.memoryPerWorker",
        {"maxLength": MAX_QUANTITY_LENGTH, "pattern": QUANTITY_PATTERN},
        "units.parse_bytes' grammar",
    ),
    SchemaRule(
        "resources.memoryTotal",
        {"maxLength": MAX_QUANTITY_LENGTH, "pattern": QUANTITY_PATTERN},
        "units.parse_bytes' grammar",
    ),
    SchemaRule(
        "pod.volumes",
        {"maxItems": MAX_VOLUMES, "items": {"required": ["name"], "properties": {"name": _VOLUME_NAME}}},
        "PodSettings._named; known to CEL so mounts can be matched to volumes",
    ),
    SchemaRule(
        "pod.volumeMounts",
        {
            "maxItems": MAX_VOLUMES,
            "items": {
                "required": ["name", "mountPath"],
                "properties": {
                    "name": _VOLUME_NAME,
                    "mountPath": {"type": "string", "maxLength": 4096, "pattern": MOUNT_PATH_PATTERN},
                },
            },
        },
        "PodSettings._named; PodSettings._kubernetes_accepts: an absolute mountPath in normal form (MOUNT_PATH_PATTERN)",
    ),
    SchemaRule(
        "pod.image", {"pattern": "[^ \\t\\n\\r]"}, "PodSettings._kubernetes_accepts: an image name, not an empty string"
    ),
    SchemaRule(
        "source.stack",
        {"maxLength": 2, "pattern": "^(t|c|z|tc|ct)$"},
        "SourceSpec._stack_axes: distinct new axes from 't' and 'c', or 'z' for files",
    ),
    *(_one_line(f"slurm.{name}") for name in ("partition", "account", "qos", "scratch", "python", "logDirectory")),
    SchemaRule("slurm.prologue", {"items": _ONE_LINE}, "SlurmSpec._prologue_lines"),
    SchemaRule(
        "slurm.directives",
        {"items": {"maxLength": MAX_SLURM_DIRECTIVE_LENGTH, "pattern": SLURM_DIRECTIVE_PREFIX + "-[^\\n\\r]*$"}},
        "SlurmSpec._not_planned: one line, an sbatch option; maxLength bounds the CEL rule's cost",
    ),
)

CEL_RULES: tuple[CelRule, ...] = (
    _int_or_auto("resources.workers", 1, 4096, "resources.workers"),
    _int_or_auto("pyramid.levels", 1, 16, "pyramid.levels"),
    _quantity_rule("resources.memoryPerWorker", "resources.memoryPerWorker"),
    _quantity_rule("resources.memoryTotal", "resources.memoryTotal"),
    CelRule(
        "resources",
        "!has(self.memoryPerWorker) || !has(self.memoryTotal)",
        "give resources.memoryPerWorker or resources.memoryTotal, not both",
        ".memoryTotal",
        why="ResourcesSpec._one_budget",
    ),
    CelRule(
        "output.compressor",
        "!has(self.cname) || !has(self.codec) || self.codec == 'blosc'",
        "output.compressor.cname is for codec blosc only",
        ".cname",
        why="CompressorSpec._codec_options",
    ),
    CelRule(
        "output.compressor",
        "!has(self.shuffle) || !has(self.codec) || self.codec == 'blosc'",
        "output.compressor.shuffle is for codec blosc only",
        ".shuffle",
        why="CompressorSpec._codec_options",
    ),
    CelRule(
        "output.compressor",
        "!has(self.clevel) || !has(self.codec) || self.codec != 'none'",
        "output.compressor.clevel is not allowed with codec none",
        ".clevel",
        why="CompressorSpec._codec_options",
    ),
    _level_range_rule(),
    CelRule(
        "output",
        "!has(self.shards) || !has(self.ngffVersion) || self.ngffVersion == '0.5'",
        "output.shards needs ngffVersion '0.5' (Zarr v3)",
        ".shards",
        why="OutputSpec._shards_need_v3",
    ),
    CelRule(
        "output",
        "!has(self.shards) || !has(self.chunks) || size(self.shards) == size(self.chunks)",
        "output.shards must have as many entries as output.chunks",
        ".shards",
        why="OutputSpec._shards_need_v3",
    ),
    _shard_multiple_rule(),
    _per_axis("output.chunks", "resolve_chunks"),
    _per_axis("output.shards", "resolve_chunks"),
    _per_axis("image.scale", "resolve_scale_units"),
    _per_axis("resources.slab", "the slab has one entry per dataset axis"),
    CelRule(
        "",
        "!has(self.image) || !has(self.image.axes) || !has(self.image.units) || size(self.image.units) == 0 || "
        "size(self.image.units) == size(self.image.axes) || (size(self.image.units) == 1 && self.image.units[0] != '' && "
        f"!self.image.units[0].matches('{TIME_UNIT_PATTERN}'))",
        "image.units must have one entry per axis of image.axes, or be one space unit for every spatial axis",
        ".image.units",
        why="planner: resolve_scale_units",
    ),
    _unit_kind_rule(),
    CelRule(
        "",
        "!has(self.image) || !has(self.image.axes) || !has(self.pyramid) || !has(self.pyramid.axes) || "
        "((!self.pyramid.axes.contains('z') || self.image.axes.matches('[zZ]')) && "
        "(!self.pyramid.axes.contains('y') || self.image.axes.matches('[yY]')) && "
        "(!self.pyramid.axes.contains('x') || self.image.axes.matches('[xX]')))",
        "pyramid.axes must be axes of image.axes",
        ".pyramid.axes",
        why="planner: resolve_downsampled",
    ),
    _output_scheme_rule(),
    _source_scheme_rule(),
    CelRule(
        "output",
        f"!has(self.storageOptions) || size(self.storageOptions) == 0 || self.path.matches('{URL_PATTERN}')",
        "output.storageOptions are only for an s3:// output.path",
        ".storageOptions",
        why="OutputSpec._options_need_a_url",
    ),
    CelRule(
        "output",
        f"!has(self.storageOptions) || self.storageOptions.all(k, !k.matches('(?i)^{UPLOADS_IN_FLIGHT}$') || "
        f"(self.storageOptions[k].matches('^[0-9]{{1,2}}$') && int(self.storageOptions[k]) <= {MAX_UPLOADS_IN_FLIGHT}))",
        f"output.storageOptions.{UPLOADS_IN_FLIGHT} must be a whole number from 0 to {MAX_UPLOADS_IN_FLIGHT}",
        ".storageOptions",
        why="OutputSpec._uploads_in_flight_is_a_count",
    ),
    CelRule(
        "output",
        f"!has(self.checksums) || !self.checksums || !has(self.ngffVersion) || self.ngffVersion != '0.4' || "
        f"!self.path.matches('{URL_PATTERN}')",
        "output.checksums with ngffVersion '0.4' need a local output.path (their sidecar is a directory): use ngffVersion '0.5' "
        "or checksums: false",
        ".checksums",
        why="OutputSpec._sidecar_needs_a_directory",
    ),
    _url_like_output_rule(),
    _not_padded_rule("output.path"),
    _not_padded_rule("source.path"),
    *_file_stack_rules(),
    CelRule(
        "retry",
        f"(has(self.maxIntervalSeconds) ? self.maxIntervalSeconds : {DEFAULT_MAX_RETRY_INTERVAL}) >= "
        f"(has(self.intervalSeconds) ? self.intervalSeconds : {DEFAULT_RETRY_INTERVAL})",
        f"retry.maxIntervalSeconds (default {DEFAULT_MAX_RETRY_INTERVAL}) must be at least retry.intervalSeconds (default {DEFAULT_RETRY_INTERVAL})",
        ".maxIntervalSeconds",
        why="RetryPolicy._ordered",
    ),
    _slurm_planned_rule(),
    CelRule(
        "pod",
        "!has(self.volumeMounts) || self.volumeMounts.all(m, has(self.volumes) && self.volumes.exists(v, v.name == m.name))",
        "every pod.volumeMounts entry must name one of pod.volumes",
        ".volumeMounts",
        why="PodSettings._mounts_name_volumes",
    ),
    # Kubernetes refuses these in the runner Job (HTTP 422); refusing them here fails the apply,
    # not a run. mountPaths are in normal form (the pattern above), so equal paths are equal strings.
    CelRule(
        "pod.volumes",
        "self.all(v, !has(v.name) || self.exists_one(w, has(w.name) && w.name == v.name))",
        "pod.volumes names must be unique",
        why="PodSettings._kubernetes_accepts",
    ),
    CelRule(
        "pod.volumes",
        f"!self.exists(v, has(v.name) && v.name == '{SCRATCH_VOLUME}')",
        f"pod.volumes must not use the name {SCRATCH_VOLUME} (the operator's scratch volume)",
        why="PodSettings._kubernetes_accepts",
    ),
    CelRule(
        "pod.volumeMounts",
        "self.all(m, !has(m.mountPath) || self.exists_one(n, has(n.mountPath) && n.mountPath == m.mountPath))",
        "pod.volumeMounts mountPaths must be unique",
        why="PodSettings._kubernetes_accepts",
    ),
)


def node_at(root: dict[str, Any], path: str) -> dict[str, Any]:
    """The schema node of ``path`` (dotted, relative to ``.spec``; "" = ``.spec`` itself)."""
    node = root
    for part in filter(None, path.split(".")):
        node = node["properties"][part]
    return node


def _merge(node: dict[str, Any], keys: dict[str, Any]) -> None:
    for key, value in keys.items():
        if isinstance(value, dict) and isinstance(node.get(key), dict):
            _merge(node[key], value)
        else:
            node[key] = value


def apply_rules(spec_schema: dict[str, Any]) -> dict[str, Any]:
    """Add SCHEMA_RULES and CEL_RULES to the ``.spec`` schema (in place; returned too)."""
    for rule in SCHEMA_RULES:
        _merge(node_at(spec_schema, rule.path), rule.keys)
    for cel in CEL_RULES:
        node_at(spec_schema, cel.path).setdefault("x-kubernetes-validations", []).append(cel.validation())
    return spec_schema
