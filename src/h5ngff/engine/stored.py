"""A pyramid level as zarr-python reads it: what ``verify`` decodes with.

``verify`` must not share the writer's code (``chunkio``): a bug common to the writer's encoder
and decoder would pass unseen. Here the array metadata, the chunk keys, the codec pipeline and
the crc32c check are all zarr-python's; h5ngff only chooses which region to read, one chunk at a
time. The one thing zarr cannot tell is whether a chunk is *absent* (it reads as the fill value
either way), so that is asked of the store directly; and for Zarr v2, which has no checksum
codec, each file's raw bytes are checked against the CRC32C sidecar (``engine.checksums``).
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass, field
from itertools import product
from typing import Any

import google_crc32c
import numpy as np
import zarr
from zarr.core.buffer import default_buffer_prototype
from zarr.core.sync import sync

from ..planner.grid import ceil_div

#: zarr-python's Crc32cCodec message: "Stored and computed checksum do not match. Stored: b'..'. Computed: b'..'."
_ZARR_CRC = re.compile(r"checksum do not match\. Stored: (b'.*?'|b\".*?\")\. Computed: (b'.*?'|b\".*?\")\.")


class ChecksumMismatch(ValueError):
    """A chunk's bytes no longer match the CRC32C written with them."""

    def __init__(self, expected: str, actual: str, where: str):
        super().__init__(f"checksum mismatch ({where}: CRC32C expected {expected}, actual {actual}): the file changed after it was written.")
        self.expected = expected
        self.actual = actual


def _hex_crc(raw: bytes) -> str:
    return f"{int.from_bytes(raw, 'little'):08x}"


def checksum_error(exc: BaseException) -> ChecksumMismatch | None:
    """zarr-python's crc32c failure as a ChecksumMismatch (None for any other error)."""
    match = _ZARR_CRC.search(str(exc))
    if match is None:
        return None
    stored, computed = (ast.literal_eval(g) for g in match.groups())
    return ChecksumMismatch(_hex_crc(stored), _hex_crc(computed), "Zarr v3 crc32c codec")


@dataclass
class StoredLevel:
    """One level of an OME-Zarr opened with zarr-python, read one chunk at a time."""

    level: int
    array: Any  # zarr.Array
    #: Output finished (completion marker set): an absent chunk is a skipped all-fill chunk.
    complete: bool = True
    #: Zarr v2: key -> CRC32C (8 hex digits) of every chunk file written, from the sidecar.
    recorded: dict[str, str] | None = None
    _index_problems: dict[tuple[int, ...], str | None] = field(default_factory=dict)

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.array.shape)

    @property
    def chunks(self) -> tuple[int, ...]:
        return tuple(self.array.chunks)

    @property
    def shards(self) -> tuple[int, ...] | None:
        return None if self.array.shards is None else tuple(self.array.shards)

    @property
    def dtype(self) -> str:
        return np.dtype(self.array.dtype).str

    @property
    def fill_value(self):
        return self.array.fill_value

    @property
    def crc_codec(self) -> bool:
        """Zarr v3 chunks end in the crc32c codec (inside shards: the inner chunks)."""
        codecs = self.array.metadata.to_dict().get("codecs", [])
        if codecs and codecs[0].get("name") == "sharding_indexed":
            codecs = codecs[0]["configuration"]["codecs"]
        return any(c.get("name") == "crc32c" for c in codecs)

    @property
    def unit(self) -> tuple[int, ...]:
        return self.shards or self.chunks

    @property
    def unit_grid(self) -> tuple[int, ...]:
        return tuple(ceil_div(n, u) for n, u in zip(self.shape, self.unit))

    def key(self, unit: tuple[int, ...]) -> str:
        """The store key of a chunk or shard file, by zarr's own chunk key encoding."""
        return self.array.metadata.encode_chunk_key(unit)

    def unit_region(self, unit: tuple[int, ...]) -> tuple[slice, ...]:
        return tuple(slice(i * u, min((i + 1) * u, n)) for i, u, n in zip(unit, self.unit, self.shape))

    def inner_chunks(self, unit: tuple[int, ...]):
        """The chunks (level chunk indices) stored in one unit that lie inside the array."""
        per = tuple(u // c for u, c in zip(self.unit, self.chunks))
        grid = tuple(ceil_div(n, c) for n, c in zip(self.shape, self.chunks))
        ranges = [range(i * p, min((i + 1) * p, g)) for i, p, g in zip(unit, per, grid)]
        return product(*ranges)

    def exists(self, unit: tuple[int, ...]) -> bool:
        return bool(sync((self.array.store_path / self.key(unit)).exists()))

    def missing(self, unit: tuple[int, ...]) -> bool:
        """Absent, and not a legitimately skipped all-fill chunk: the output is unfinished, or the
        checksum sidecar says the file was written."""
        if self.complete and (self.recorded is None or self.key(unit) not in self.recorded):
            return False  # not asked of the store: a finished output may skip all-fill chunks
        return not self.exists(unit)

    def read(self, region: tuple[slice, ...]) -> np.ndarray:
        """A region decoded by zarr-python (absent chunks read as the fill value). A crc32c
        failure is raised as ChecksumMismatch; any other decode failure as zarr raised it."""
        try:
            return np.asarray(self.array[region])
        except Exception as exc:
            mismatch = checksum_error(exc)
            if mismatch is None:
                raise
            raise mismatch from exc

    def read_chunk(self, chunk: tuple[int, ...], check: bool = True) -> np.ndarray:
        """One chunk (clipped at the array's edge), after the sidecar's CRC32C in Zarr v2 (unless
        ``check`` is off: the data of a chunk already reported, to say how it differs too)."""
        if check and self.recorded is not None and self.shards is None:
            self.check_recorded(chunk)
        return self.read(tuple(slice(i * c, min((i + 1) * c, n)) for i, c, n in zip(chunk, self.chunks, self.shape)))

    def check_recorded(self, unit: tuple[int, ...]) -> None:
        """Zarr v2: the file's raw bytes against the CRC32C the writer recorded in the sidecar."""
        key = self.key(unit)
        expected = (self.recorded or {}).get(key)
        raw = sync((self.array.store_path / key).get(prototype=default_buffer_prototype()))
        if raw is None:
            return  # absent: ``missing`` decides
        actual = f"{google_crc32c.value(raw.to_bytes()):08x}"
        if expected is None:
            raise ChecksumMismatch("none recorded", actual, "checksum sidecar")
        if actual != expected:
            raise ChecksumMismatch(expected, actual, "checksum sidecar")

    def index_problem(self, unit: tuple[int, ...]) -> str | None:
        """Why a shard's index cannot be read (None: it reads), asked of zarr's sharding codec
        once per shard, so a broken index is reported once and not once per inner chunk."""
        if self.shards is None:
            return None
        if unit not in self._index_problems:
            codec = self.array.metadata.codecs[0]
            per = tuple(s // c for s, c in zip(self.shards, self.chunks))
            try:
                # zarr's own (private) index reader: the crc32c of the index, its size and layout.
                sync(codec._load_shard_index_maybe(self.array.store_path / self.key(unit), per))
                problem = None
            except Exception as exc:
                mismatch = checksum_error(exc)
                problem = f"shard index {mismatch or f'does not decode ({type(exc).__name__}: {exc})'}"
            self._index_problems[unit] = problem
        return self._index_problems[unit]


def open_levels(path: str, multiscale: dict[str, Any], complete: bool, sidecars: dict[int, dict[str, str] | None] | None = None) -> tuple[list[StoredLevel], list[str]]:
    """Every level of ``multiscale`` opened with zarr-python, and the problems of those that do
    not open."""
    levels, problems = [], []
    group = zarr.open_group(path, mode="r")
    for index, ds in enumerate(multiscale.get("datasets", [])):
        try:
            array = group[ds["path"]]
            if not isinstance(array, zarr.Array):
                raise ValueError(f"{ds['path']!r} is a group, not an array")
        except (KeyError, ValueError, OSError, TypeError) as exc:
            problems.append(f"level {ds.get('path')}: unreadable array metadata ({type(exc).__name__}: {exc}).")
            continue
        recorded = None if sidecars is None else sidecars.get(index)
        levels.append(StoredLevel(index, array, complete, recorded))
    return levels, problems
