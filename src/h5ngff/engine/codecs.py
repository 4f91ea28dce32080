"""The compressor spec as numcodecs codecs (what the engine encodes with) and as Zarr metadata (what
readers decode with). The two must agree byte for byte; tests read every codec back with zarr."""

from __future__ import annotations

from functools import lru_cache

import numcodecs
from numcodecs import Blosc, GZip, Zstd

from ..spec import CompressorSpec

class DeterministicGZip(GZip):
    """numcodecs' GZip stamps the current time into every gzip header, so two runs never write the
    same bytes; a zero mtime makes outputs reproducible (and resumed runs bit-identical). Readers
    decode it like any gzip stream."""

    def encode(self, buf):
        import gzip

        return gzip.compress(memoryview(numcodecs.compat.ensure_contiguous_ndarray(buf)), compresslevel=self.level, mtime=0)


_BLOSC_SHUFFLE = {"noshuffle": Blosc.NOSHUFFLE, "shuffle": Blosc.SHUFFLE, "bitshuffle": Blosc.BITSHUFFLE}


@lru_cache(maxsize=None)
def chunk_codec(spec: CompressorSpec) -> numcodecs.abc.Codec | None:
    """The numcodecs codec for one chunk's bytes (None: stored raw)."""
    if spec.codec == "blosc":
        # blocksize 0 lets blosc choose, as zarr's BloscCodec does; typesize comes from the array.
        return Blosc(cname=spec.blosc_cname, clevel=spec.level, shuffle=_BLOSC_SHUFFLE[spec.blosc_shuffle], blocksize=0)
    if spec.codec == "zstd":
        return Zstd(level=spec.level)
    if spec.codec == "gzip":
        return DeterministicGZip(level=spec.level)
    return None


def zarr_compressors(spec: CompressorSpec, zarr_format: int, checksums: bool = False):
    """The ``compressors`` argument of ``zarr.create_array`` for this spec (None: no compression).

    With ``checksums`` in Zarr v3 the crc32c codec comes last, so every stored chunk ends in the
    CRC32C of its compressed bytes (``chunkio.checksum_piece``). Zarr v2 has no such codec: h5ngff
    records its checksums in a sidecar instead (``engine.write.checksums``)."""
    if zarr_format == 3 and checksums:
        from zarr.codecs import Crc32cCodec

        inner = _v3_compressor(spec)
        return [Crc32cCodec()] if inner is None else [inner, Crc32cCodec()]
    if spec.codec == "none":
        return None
    if zarr_format == 2:
        return GZip(level=spec.level) if spec.codec == "gzip" else chunk_codec(spec)
    return _v3_compressor(spec)


def _v3_compressor(spec: CompressorSpec):
    from zarr.codecs import BloscCodec, GzipCodec, ZstdCodec

    if spec.codec == "none":
        return None
    if spec.codec == "blosc":
        return BloscCodec(cname=spec.blosc_cname, clevel=spec.level, shuffle=spec.blosc_shuffle)
    if spec.codec == "zstd":
        return ZstdCodec(level=spec.level, checksum=False)
    return GzipCodec(level=spec.level)
