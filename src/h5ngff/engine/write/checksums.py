"""CRC32C checksums of NGFF 0.4 (Zarr v2) chunk files, kept in a sidecar that ``verify`` reads.

Zarr v3 has a crc32c codec, so NGFF 0.5 outputs carry a checksum inside every chunk
(``chunkio.stored_pieces``). Zarr v2 has none, so for NGFF 0.4 each slab task takes the CRC32C
of every chunk file it writes (the whole file's bytes, as stored), the client records them in the
manifest with the slab, and ``finish_output`` writes them, per level, to

    OUT/0/.h5ngff-checksums/<level>.json
    {"format": "h5ngff-checksums/1", "algorithm": "crc32c", "level": 0, "array": "0",
     "chunks": {"0/0/0": "1c2a3b4d", ...}}

``chunks`` maps every chunk key written (relative to the level's array, as in the store) to the
CRC32C (Castagnoli, as in Zarr v3's crc32c codec) of the file's bytes, 8 lowercase hex digits,
keys sorted. A key that is absent was never written (an all-fill chunk skipped, or none). Only
the client writes the sidecar, once, from the manifest, before the completion marker: one writer
per file, and a resumed run (whose manifest holds the first run's records) writes the same bytes.

Why inside the full-resolution array ``0/`` and not beside it: zarr-python 3 lists every entry of
a group to find its members and warns about each one that is neither an array nor a group
(``Object at .h5ngff-checksums is not recognized as a component of a Zarr hierarchy``), on
``members()``, ``tree()`` and every reader built on them; it never lists an array's own directory.
An array reads only the keys its chunk grid names, so the sidecar, whose name is no chunk key,
is invisible there. Outputs written before this move kept it at ``OUT/.h5ngff-checksums/``
(LEGACY_SIDECAR_DIR): ``load_sidecar`` reads those too, so they still verify.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Iterable

import google_crc32c

from ..stores import Store

if TYPE_CHECKING:
    from .chunkio import ArrayLayout

#: The sidecar directory, relative to the output: inside level 0's array (see above).
SIDECAR_DIR = "0/.h5ngff-checksums"
#: Where outputs written before the move keep it (zarr-python 3 warns about it there).
LEGACY_SIDECAR_DIR = ".h5ngff-checksums"
SIDECAR_FORMAT = "h5ngff-checksums/1"


def crc32c_hex(pieces: Iterable[bytes]) -> str:
    """The CRC32C of the concatenated pieces (one file's bytes), as 8 hex digits."""
    crc = 0
    for piece in pieces:
        crc = google_crc32c.extend(crc, piece)
    return f"{crc:08x}"


class FileChecksums:
    """``write_block``'s ``on_file``: collects (level, key, crc) of every file a slab writes."""

    def __init__(self) -> None:
        self.entries: list[tuple[int, str, str]] = []
        self.level = 0

    def on_file(self, layout: "ArrayLayout") -> "FileChecksums | None":
        """The callback for one level's ``write_block`` (None where no sidecar is kept: Zarr v3
        carries its checksums in the chunks, and checksums may be off)."""
        if not layout.checksums or layout.zarr_format != 2:
            return None
        self.level = layout.level
        return self

    def __call__(self, key: str, pieces: list[bytes]) -> None:
        self.entries.append((self.level, key, crc32c_hex(pieces)))


def sidecar_key(level: int, directory: str = SIDECAR_DIR) -> str:
    """The sidecar's key in the output's store."""
    return f"{directory}/{level}.json"


def write_sidecars(store: Store, checksums: dict[int, dict[str, str]], level_paths: dict[int, str]) -> None:
    """One sidecar per level (levels with no file written get an empty one), each stored whole
    and durable (fsynced before its rename in a directory) before the completion marker."""
    for level, array in sorted(level_paths.items()):
        doc = {
            "format": SIDECAR_FORMAT,
            "algorithm": "crc32c",
            "level": level,
            "array": array,
            "chunks": dict(sorted(checksums.get(level, {}).items())),
        }
        store.put(sidecar_key(level), json.dumps(doc, indent=0).encode(), sync=True)


def load_sidecar(store: Store, level: int) -> dict[str, str] | None:
    """key -> CRC32C of one level (None: no sidecar). Raises ValueError on a malformed one."""
    for directory in (SIDECAR_DIR, LEGACY_SIDECAR_DIR):
        key = sidecar_key(level, directory)
        try:
            doc = json.loads(store.get(key))
        except KeyError:
            continue
        if not isinstance(doc, dict) or doc.get("format") != SIDECAR_FORMAT or not isinstance(doc.get("chunks"), dict):
            raise ValueError(f"{store.root}/{key} is not an {SIDECAR_FORMAT} sidecar")
        chunks: dict[str, str] = doc["chunks"]
        return chunks
    return None
