"""Every codec h5ngff writes, one entry each: the pure facts about it.

The spec (its enums, defaults and level ranges), the CLI's ``--compressor`` parser, the CRD's
admission rule on ``clevel`` and the planner's codec-context term all read this table. It imports
nothing, so the layers below the engine (spec, planner) can use it; the engine's half of each
codec (its numcodecs encoder, its Zarr v2/v3 metadata, reading that metadata back) is
``engine/codecs.py``, keyed by the same names (docs/architecture.md, "Where new things go").

The ``Literal`` types say the names to mypy and to pydantic (and so to the CRD schema); a Literal
cannot be built from a table, so the import-time check below ties each one to its table.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Literal, get_args

#: What ``output.compressor.codec`` may say.
CodecName = Literal["blosc", "zstd", "gzip", "none"]
#: Blosc's inner compressors (``output.compressor.cname``).
BloscCname = Literal["zstd", "lz4", "lz4hc", "zlib", "blosclz"]
#: Blosc's shuffle filters (``output.compressor.shuffle``).
BloscShuffle = Literal["noshuffle", "shuffle", "bitshuffle"]
#: The per-thread state an encoder keeps between chunks, which the planner prices in its "chunk
#: and encode buffers" term (``MemoryConstants.codec_context_zstd`` / ``codec_context_other``,
#: docs/memory-model.md): a zstd compression context (window, hash tables) or about 1 MiB.
Context = Literal["zstd", "other"]


@dataclass(frozen=True)
class CodecFacts:
    """One codec as the spec, the CLI and the planner see it."""

    name: CodecName
    #: Allowed ``clevel``, inclusive; None: the codec takes no level. zstd's negative "fast"
    #: levels are excluded on purpose: they are rarely wanted for archives and complicate the
    #: level's meaning.
    levels: tuple[int, int] | None
    #: The codec's own name for ``--compressor`` (None: named by its inner compressor, as blosc's
    #: ``zstd:5:bitshuffle`` is). Plain zstd is ``plain-zstd`` because ``zstd`` means blosc zstd.
    cli_name: str | None
    #: The encoder's per-thread context (None: its inner compressor's, see ``BLOSC_CNAMES``).
    context: Context | None


#: The codecs, in the order the spec's enum and the docs list them.
CODECS: dict[CodecName, CodecFacts] = {
    c.name: c
    for c in (
        CodecFacts("blosc", (0, 9), None, None),
        CodecFacts("zstd", (1, 22), "plain-zstd", "zstd"),
        CodecFacts("gzip", (1, 9), "gzip", "other"),
        CodecFacts("none", None, "none", "other"),
    )
}
DEFAULT_CODEC: CodecName = "blosc"
#: The level a codec that takes one gets when ``clevel`` is not given.
DEFAULT_LEVEL = 5
#: Blosc's inner compressors and the context each keeps.
BLOSC_CNAMES: dict[BloscCname, Context] = {
    "zstd": "zstd",
    "lz4": "other",
    "lz4hc": "other",
    "zlib": "other",
    "blosclz": "other",
}
DEFAULT_CNAME: BloscCname = "zstd"
BLOSC_SHUFFLES: tuple[BloscShuffle, ...] = get_args(BloscShuffle)
DEFAULT_SHUFFLE: BloscShuffle = "bitshuffle"
#: Allowed ``clevel`` per codec that takes one, inclusive.
LEVEL_RANGES: dict[CodecName, tuple[int, int]] = {name: c.levels for name, c in CODECS.items() if c.levels is not None}


def context(codec: CodecName, cname: BloscCname) -> Context:
    """The per-thread context of ``codec`` (``cname``: blosc's inner compressor)."""
    own = CODECS[codec].context
    return BLOSC_CNAMES[cname] if own is None else own


def same_names(literal: object, names: Iterable[str], what: str) -> None:
    """Raise if a Literal and a table name different things (or the same in another order: the
    order is the CRD enum's)."""
    said, listed = get_args(literal), tuple(names)
    if said != listed:
        raise AssertionError(
            f"{what}: the Literal says {said}, the table {listed}; change both (h5ngff/codecs_table.py)."
        )


same_names(CodecName, CODECS, "codec names")
same_names(BloscCname, BLOSC_CNAMES, "blosc cnames")
