"""A batch's items: many sources, one output template (docs/batch.md).

``h5ngff convert 'runs/2026-11-*/*.h5:/data' 'out/{stem}.ome.zarr'`` names its sources with
glob patterns and its outputs with one template. This module turns them into items, each a
source as one conversion would take it and the output it goes to, and refuses a batch whose
items would collide before anything starts: two sources mapped to one output, or one output
inside another (a second writer there would corrupt the first).
"""

from __future__ import annotations

import glob
import os
import re
import string
from dataclasses import dataclass
from typing import Callable, Iterable, Iterator, Sequence

from ..errors import SpecError
from ..spec import url_scheme

#: The fields an output template may use, with what each is for ``runs/day1/cell_07.h5``.
TEMPLATE_FIELDS = {
    "stem": "the file name without its last suffix (cell_07)",
    "name": "the file name (cell_07.h5)",
    "parent": "the name of the directory holding the file (day1)",
}
#: A template field with a format spec or a conversion (``{stem:>9}``, ``{stem!r}``), which
#: ``_parts`` refuses; the CRD refuses the same with this pattern (operator/schema/crd.py). A
#: brace after a brace is an escaped one (``{{a:b}}`` is the literal text ``{a:b}``).
FORMATTED_FIELD_PATTERN = r"(^|[^{])\{[^{}]*[:!][^{}]*\}"
#: Characters that make a pattern a glob (Python's glob module: *, ?, [...], and ** with recursion).
GLOB_CHARS = re.compile(r"[*?\[]")


@dataclass(frozen=True)
class BatchItem:
    """One conversion of a batch."""

    #: The source as ``h5ngff convert`` takes it: FILE.h5:/dataset, or a whole container (.ims, .xml).
    source: str
    #: The file the source reads (the glob's match).
    path: str
    output: str


def is_template(output: str) -> bool:
    """An output naming a template field ({stem}, {name}, {parent}) makes the command a batch."""
    return bool(_fields(output))


def _parts(template: str) -> list[tuple[str, str | None]]:
    """(literal text, field name or None) pieces of ``template``. A field is a bare name: a format
    spec or a conversion (``{stem:>100000000}``, ``{stem!r}``) is refused, because Python's
    formatting would pad, truncate or repr the value (one such spec made a 100 MB output path)."""
    try:
        parsed = list(string.Formatter().parse(template))
    except ValueError as exc:  # an unmatched brace
        raise SpecError(
            "output",
            f"Expected an output template such as out/{{stem}}.ome.zarr. Got {_quoted(template)}, which is not one ({exc}), instead.",
        ) from None
    for _, name, spec, conversion in parsed:
        if name is not None and (spec or conversion):
            field = "{" + name + (f"!{conversion}" if conversion else "") + (f":{spec}" if spec else "") + "}"
            raise SpecError(
                "output",
                f"Expected template fields without a format spec or conversion ({{stem}}, {{name}}, {{parent}}). "
                f"Got {_cut(field)} in {_quoted(template)} instead.",
            )
    return [(literal, name) for literal, name, _, _ in parsed]


def _quoted(text: str, limit: int = 200) -> str:
    """``text`` quoted for a message, cut to ``limit`` characters: messages quote what the user
    wrote, and a status message must stay small."""
    return repr(text) if len(text) <= limit else repr(text[:limit]) + f"... ({len(text)} characters)"


def _cut(text: str, limit: int = 200) -> str:
    return text if len(text) <= limit else text[:limit] + f"... ({len(text)} characters)"


def _fields(template: str) -> list[str]:
    return [name for _, name in _parts(template) if name is not None]


def split_pattern(pattern: str) -> tuple[str, str | None]:
    """``runs/*/*.h5:/data`` -> (``runs/*/*.h5``, ``/data``); a whole container's pattern
    (``runs/*.ims``) has no dataset part. A URL's ``scheme://`` is never the ':'."""
    scheme = len(pattern.partition("://")[0]) + 3 if url_scheme(pattern) else 0
    head, sep, tail = pattern[scheme:].rpartition(":")
    if sep and head and tail.startswith("/"):
        return pattern[:scheme] + head, tail
    return pattern, None


#: Lists the objects a glob in a bucket matches (``batch.listing.bucket_lister``): given by the
#: CLI, so that this module, which the operator's controller reads for templates and collisions,
#: never imports the engine that lists a bucket.
BucketGlob = Callable[[str], list[str]]


def expand_sources(patterns: Sequence[str], bucket_glob: BucketGlob | None = None) -> list[tuple[str, str]]:
    """Every (source, file) the patterns name, in natural order (cell_2 before cell_10), each
    source once. A pattern that matches nothing is an error that names it: a batch that silently
    skips a mistyped directory would look like success. Every path a glob matches is kept, a
    dangling link or a directory included: planning refuses it with its reason, so the summary
    names it instead of dropping it. Two datasets of one file are two sources, never one. A
    pattern in a bucket (``s3://bucket/run/*.h5:/data``) lists the bucket under its prefix with
    ``bucket_glob``."""
    found: dict[str, str] = {}
    for pattern in patterns:
        files, dataset = split_pattern(pattern)
        if not GLOB_CHARS.search(files):
            matches = [files]
        elif url_scheme(files):
            if bucket_glob is None:
                raise SpecError("source", f"Expected local files here: {files!r} would list a bucket.")
            matches = sorted(bucket_glob(files), key=_natural)
        else:
            matches = sorted(glob.glob(files, recursive=True), key=_natural)
        if not matches:
            where = "in the bucket" if url_scheme(files) else f"(from {os.getcwd()!r})"
            raise SpecError(
                "source",
                f"Expected the pattern {files!r} to match HDF5 files. It matches none {where}: check the "
                f"directory and the quoting (quote the pattern so the shell does not expand it).",
            )
        for path in matches:
            source = f"{path}:{dataset}" if dataset else path
            found.setdefault(source, path)
    return list(found.items())


def _natural(text: str) -> list[object]:
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", text)]


def render_output(template: str, path: str) -> str:
    """The template with ``path``'s fields filled in."""
    parts = _parts(template)
    unknown = [f for _, f in parts if f is not None and f not in TEMPLATE_FIELDS]
    if unknown:
        known = ", ".join("{" + f + "}" for f in TEMPLATE_FIELDS)
        raise SpecError(
            "output",
            f"Expected template fields from {known}. Got {_cut('{' + unknown[0] + '}')} in {_quoted(template)} instead.",
        )
    name = os.path.basename(path)
    if url_scheme(path):  # s3://bucket/run/a.h5: the key's parent (the bucket's name at its root)
        parent = path.partition("://")[2].rstrip("/").split("/")[-2]
    else:
        parent = os.path.basename(os.path.dirname(os.path.abspath(path)))
    values = {"stem": os.path.splitext(name)[0], "name": name, "parent": parent}
    # Plain substitution, not str.format: the fields were checked to be bare names.
    return "".join(literal + (values[field] if field is not None else "") for literal, field in parts)


def batch_items(patterns: Sequence[str], template: str, bucket_glob: BucketGlob | None = None) -> list[BatchItem]:
    """The items of ``h5ngff convert PATTERN... TEMPLATE``, checked for collisions."""
    items = [
        BatchItem(source, path, render_output(template, path)) for source, path in expand_sources(patterns, bucket_glob)
    ]
    refuse_collisions(items)
    return items


def output_key(output: str) -> str:
    """One spelling per output: an absolute normalised path, or the URL without trailing slashes."""
    if url_scheme(output):
        scheme, _, rest = output.partition("://")
        return f"{scheme.lower()}://{re.sub('/+', '/', rest).rstrip('/')}"
    return os.path.normpath(os.path.abspath(output))


def refuse_collisions(items: Iterable[BatchItem], fix: str | None = None) -> None:
    """Two items writing one output, or one output inside another, are refused before anything
    starts. ``fix`` says how to tell two items' outputs apart where they come from (default: the
    command's output template)."""
    seen: dict[str, BatchItem] = {}
    for item in items:
        key = output_key(item.output)
        if key in seen:
            other = seen[key]
            raise SpecError(
                "output",
                f"Expected one output per source. Got {other.source!r} and {item.source!r} both written to "
                f"{item.output!r} instead: {fix or template_fix()}.",
            )
        seen[key] = item
    for key, item in seen.items():
        outer = next((seen[a] for a in _ancestors(key) if a in seen), None)
        if outer is not None:
            raise SpecError(
                "output",
                f"Expected outputs apart from one another. Got {item.output!r} inside {outer.output!r} "
                f"instead: one conversion would write into the other's image.",
            )
    for item in seen.values():
        if (
            url_scheme(item.output) is None
            and url_scheme(item.path) is None
            and output_key(item.path) == output_key(item.output)
        ):
            raise SpecError(
                "output",
                f"Expected an output apart from its source. Got {item.output!r} for the source file itself instead.",
            )


def _ancestors(key: str) -> Iterator[str]:
    """The directories (or bucket prefixes) above an output's key."""
    scheme, sep, rest = key.partition("://")
    if sep:
        parts = rest.split("/")
        yield from (f"{scheme}://{'/'.join(parts[:n])}" for n in range(len(parts) - 1, 0, -1))
        return
    while (parent := os.path.dirname(key)) != key:
        yield parent
        key = parent


def template_fix() -> str:
    """How to tell two outputs of one template apart."""
    return f"add a field that tells them apart to the template ({_field_hint()})"


def _field_hint() -> str:
    return "; ".join("{" + f + "}: " + what for f, what in TEMPLATE_FIELDS.items())
