"""The compressor spec as numcodecs codecs (what the engine encodes with) and as Zarr metadata (what
readers decode with). The two must agree byte for byte; tests read every codec back with zarr.

One class per codec, as zarr's codec classes are: its encoder, its Zarr v2 and v3 metadata, and
the spec read back from that metadata. Its pure facts (name, level range, memory term) are the
codec table's entry (h5ngff/codecs_table.py), which the layers below the engine read; ``CODECS``
here is keyed by the same names (tests/test_one_definition.py checks both halves agree)."""

from __future__ import annotations

import gzip
from collections.abc import Mapping
from functools import lru_cache
from typing import TYPE_CHECKING, Any, ClassVar

import numcodecs
from numcodecs import Blosc, GZip, Zstd

from ..codecs_table import BLOSC_SHUFFLES, CODECS as FACTS, CodecFacts
from ..spec import CompressorSpec

if TYPE_CHECKING:
    from zarr.abc.codec import BytesBytesCodec
    from zarr.abc.numcodec import Numcodec
    from zarr.core.array import CompressorsLike


class DeterministicGZip(GZip):  # type: ignore[misc]  # numcodecs ships no type information
    """numcodecs' GZip stamps the current time into every gzip header, so two runs never write the
    same bytes; a zero mtime makes outputs reproducible (and resumed runs bit-identical). Readers
    decode it like any gzip stream."""

    def encode(self, buf: Any) -> bytes:
        return gzip.compress(
            memoryview(numcodecs.compat.ensure_contiguous_ndarray(buf)), compresslevel=self.level, mtime=0
        )


class CodecEntry:
    """One codec's engine half (its entry in ``CODECS``). Its name is the codec table's, numcodecs' ``codec_id`` (Zarr v2)
    and zarr's codec ``name`` (Zarr v3) at once."""

    facts: ClassVar[CodecFacts]

    def encoder(self, spec: CompressorSpec) -> Numcodec | None:
        """The numcodecs codec for one chunk's bytes (None: stored raw)."""
        return None

    def v2_compressor(self, spec: CompressorSpec) -> Numcodec | None:
        """The ``compressor`` of a Zarr v2 array (its ``.zarray``)."""
        return self.encoder(spec)

    def v3_codec(self, spec: CompressorSpec) -> BytesBytesCodec | None:
        """The bytes-to-bytes codec of a Zarr v3 array (its ``zarr.json``)."""
        return None

    def from_config(self, config: Mapping[str, Any]) -> CompressorSpec:
        """The spec back from this codec's v2 compressor or v3 ``configuration`` (tests and
        benches write into existing outputs with it: engine/existing.py)."""
        return CompressorSpec(codec=self.facts.name, clevel=config.get("level"))


class BloscEntry(CodecEntry):
    facts = FACTS["blosc"]
    #: numcodecs' shuffle constants (what a v2 ``.zarray`` records) by the spec's names.
    SHUFFLE: ClassVar[dict[str, int]] = dict(
        zip(BLOSC_SHUFFLES, (Blosc.NOSHUFFLE, Blosc.SHUFFLE, Blosc.BITSHUFFLE), strict=True)
    )

    def encoder(self, spec: CompressorSpec) -> Numcodec:
        # blocksize 0 lets blosc choose, as zarr's BloscCodec does; typesize comes from the array.
        codec: Numcodec = Blosc(
            cname=spec.blosc_cname, clevel=spec.level, shuffle=self.SHUFFLE[spec.blosc_shuffle], blocksize=0
        )
        return codec

    def v3_codec(self, spec: CompressorSpec) -> BytesBytesCodec:
        from zarr.codecs import BloscCodec as ZarrBlosc

        return ZarrBlosc(cname=spec.blosc_cname, clevel=spec.level, shuffle=spec.blosc_shuffle)

    def from_config(self, config: Mapping[str, Any]) -> CompressorSpec:
        shuffle = config["shuffle"]
        if isinstance(shuffle, int):  # Zarr v2 records numcodecs' constant, v3 the name
            shuffle = {v: k for k, v in self.SHUFFLE.items()}[shuffle]
        return CompressorSpec(codec="blosc", cname=config["cname"], clevel=config["clevel"], shuffle=shuffle)


class ZstdEntry(CodecEntry):
    facts = FACTS["zstd"]

    def encoder(self, spec: CompressorSpec) -> Numcodec:
        codec: Numcodec = Zstd(level=spec.level)
        return codec

    def v3_codec(self, spec: CompressorSpec) -> BytesBytesCodec:
        from zarr.codecs import ZstdCodec as ZarrZstd

        return ZarrZstd(level=spec.level, checksum=False)


class GzipEntry(CodecEntry):
    facts = FACTS["gzip"]

    def encoder(self, spec: CompressorSpec) -> Numcodec:
        codec: Numcodec = DeterministicGZip(level=spec.level)
        return codec

    def v2_compressor(self, spec: CompressorSpec) -> Numcodec:
        # numcodecs' own GZip in the metadata: readers need not know our encoder's subclass.
        codec: Numcodec = GZip(level=spec.level)
        return codec

    def v3_codec(self, spec: CompressorSpec) -> BytesBytesCodec:
        from zarr.codecs import GzipCodec as ZarrGzip

        return ZarrGzip(level=spec.level)


class NoneEntry(CodecEntry):
    """Chunks stored raw: no encoder, no compressor in either format."""

    facts = FACTS["none"]


#: Every codec of the codec table, by its name.
CODECS: dict[str, CodecEntry] = {c.facts.name: c for c in (BloscEntry(), ZstdEntry(), GzipEntry(), NoneEntry())}


@lru_cache(maxsize=None)
def chunk_codec(spec: CompressorSpec) -> Numcodec | None:
    """The numcodecs codec for one chunk's bytes (None: stored raw)."""
    return CODECS[spec.codec].encoder(spec)


def zarr_compressors(spec: CompressorSpec, zarr_format: int, checksums: bool = False) -> CompressorsLike:
    """The ``compressors`` argument of ``zarr.create_array`` for this spec (None: no compression).

    With ``checksums`` in Zarr v3 the crc32c codec comes last, so every stored chunk ends in the
    CRC32C of its compressed bytes (``chunkio.checksum_piece``). Zarr v2 has no such codec: h5ngff
    records its checksums in a sidecar instead (``engine.write.checksums``)."""
    codec = CODECS[spec.codec]
    if zarr_format == 2:
        return codec.v2_compressor(spec)
    inner = codec.v3_codec(spec)
    if checksums:
        from zarr.codecs import Crc32cCodec

        return [Crc32cCodec()] if inner is None else [inner, Crc32cCodec()]
    return inner


def spec_from_metadata(compressor: Mapping[str, Any] | None) -> CompressorSpec:
    """The spec back from a Zarr v2 ``compressor`` (``id``) or a v3 codec (``name``,
    ``configuration``); None: no compressor."""
    if compressor is None:
        return CompressorSpec(codec="none")
    name = compressor.get("id", compressor.get("name"))
    config = compressor if "id" in compressor else compressor.get("configuration", {})
    return CODECS[name].from_config(config)
