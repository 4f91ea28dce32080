"""The resume manifest: the record of what has been written, kept inside the output.

``<output>/.h5ngff/manifest.jsonl`` starts with a header (the content fingerprint) followed by one
line per finished slab: every chunk or shard file it wrote, with its size, and the min/max it
saw. Only the client appends, and each line is flushed and fsynced before the slab counts as
done. A torn last line (the client was killed mid-write) is ignored.

When the output is finished, the completion marker goes into the root group's attributes and
this directory is removed. The manifest, not the presence of files, is the record: a chunk that is missing reads back as
the fill value, so presence proves nothing. On resume a slab is skipped only when every file it
owns is recorded *and* still has the recorded size; anything else is rewritten.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from dataclasses import dataclass, field
from typing import Any, Iterable

log = logging.getLogger(__name__)

#: The recorded size of a unit left out because it is the fill value everywhere (engine.write.chunkio).
EMPTY_UNIT_BYTES = 0

MANIFEST_DIR = ".h5ngff"
MANIFEST_FILE = "manifest.jsonl"
FORMAT_VERSION = 1
#: Seconds between fsyncs of the manifest (see Manifest.append).
FSYNC_INTERVAL = 1.0


def fingerprint(content: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(content, sort_keys=True).encode()).hexdigest()[:32]


@dataclass
class SlabRecord:
    pass_index: int
    slab: tuple[int, ...]
    #: (level, key, nbytes) of every file the slab wrote.
    units: list[tuple[int, str, int]]
    #: (channel, min, max) seen in level 0, for the omero window.
    stats: list[tuple[int, float, float]] = field(default_factory=list)
    #: (level, key, crc32c hex) of every file written, for Zarr v2's checksum sidecar (engine.write.checksums).
    checksums: list[tuple[int, str, str]] = field(default_factory=list)


class Manifest:
    """Append-only record of finished slabs for one output."""

    def __init__(self, root: str):
        self.root = root
        self.dir = os.path.join(root, MANIFEST_DIR)
        self.path = os.path.join(self.dir, MANIFEST_FILE)
        self.header: dict[str, Any] | None = None
        self.records: list[SlabRecord] = []
        #: level -> key -> size of every file the manifest vouches for
        self.units: dict[int, dict[str, int]] = {}
        #: level -> key -> CRC32C of every file recorded with one (Zarr v2 with checksums)
        self.checksums: dict[int, dict[str, str]] = {}
        self._synced = 0.0

    # -- reading ---------------------------------------------------------------------------
    @classmethod
    def load(cls, root: str) -> "Manifest | None":
        """The manifest of an existing output, or None if h5ngff did not write it."""
        m = cls(root)
        try:
            with open(m.path, "rb") as f:
                lines = f.read().split(b"\n")
        except FileNotFoundError:
            return None
        for number, raw in enumerate(lines):
            if not raw.strip():
                continue
            try:
                entry = json.loads(raw)
            except ValueError:
                if number >= len(lines) - 2:
                    log.warning("Ignoring a torn last line in %s (the previous run was interrupted while recording).", m.path)
                    break
                raise
            m._entry(entry)
        return m if m.header else None

    def _entry(self, entry: dict[str, Any]) -> None:
        if entry.get("kind") == "header":
            self.header = entry
        elif entry.get("kind") == "slab":
            self._add(SlabRecord(entry["pass"], tuple(entry["slab"]), [tuple(u) for u in entry["units"]], [tuple(s) for s in entry.get("stats", [])],
                                 [tuple(c) for c in entry.get("crc", [])]))

    @staticmethod
    def _line(r: SlabRecord) -> str:
        line: dict[str, Any] = {"kind": "slab", "pass": r.pass_index, "slab": list(r.slab), "units": [list(u) for u in r.units], "stats": [list(s) for s in r.stats]}
        if r.checksums:
            line["crc"] = [list(c) for c in r.checksums]
        return json.dumps(line)

    def _add(self, record: SlabRecord) -> None:
        self.records.append(record)
        for level, key, nbytes in record.units:
            self.units.setdefault(level, {})[key] = nbytes
        for level, key, crc in record.checksums:  # a rewritten slab's record comes later and wins
            self.checksums.setdefault(level, {})[key] = crc

    @property
    def fingerprint(self) -> str | None:
        return None if self.header is None else self.header.get("fingerprint")

    @property
    def content(self) -> dict[str, Any]:
        return {} if self.header is None else self.header.get("content", {})

    def verified_units(self, level_paths: dict[int, str]) -> dict[int, set[str]]:
        """Recorded files that still exist with their recorded size, and recorded empty units
        (size 0: the fill value everywhere, never stored) that still have no file."""
        good: dict[int, set[str]] = {}
        for level, entries in self.units.items():
            base = level_paths.get(level)
            if base is None:
                continue
            ok = good.setdefault(level, set())
            for key, nbytes in entries.items():
                try:
                    if os.stat(os.path.join(base, key)).st_size == nbytes:
                        ok.add(key)
                except FileNotFoundError:
                    if nbytes == EMPTY_UNIT_BYTES:
                        ok.add(key)
        return good

    def empty_units(self) -> dict[int, int]:
        """Per level, how many units were left out as the fill value everywhere."""
        counts: dict[int, int] = {}
        for level, entries in self.units.items():
            counts[level] = sum(1 for nbytes in entries.values() if nbytes == EMPTY_UNIT_BYTES)
        return counts

    def windows(self, channels: int) -> list[tuple[float, float]]:
        low = [float("inf")] * channels
        high = [float("-inf")] * channels
        for record in self.records:
            for channel, lo, hi in record.stats:
                low[channel] = min(low[channel], lo)
                high[channel] = max(high[channel], hi)
        return [(lo, hi) if lo <= hi else (0.0, 0.0) for lo, hi in zip(low, high)]

    # -- writing ---------------------------------------------------------------------------
    def start(self, content: dict[str, Any]) -> None:
        """Begin a fresh manifest (the output directory must already exist)."""
        os.makedirs(self.dir, exist_ok=True)
        self.header = {"kind": "header", "format": FORMAT_VERSION, "fingerprint": fingerprint(content), "content": content, "created": time.time()}
        with open(self.path, "w") as f:
            f.write(json.dumps(self.header) + "\n")
            f.flush()
            os.fsync(f.fileno())
        self.records = []
        self.units = {}
        self.checksums = {}

    def append(self, records: Iterable[SlabRecord]) -> None:
        lines = []
        for r in records:
            self._add(r)
            lines.append(self._line(r))
        if not lines:
            return
        # The write reaches the kernel at once, so a killed client loses nothing it recorded; the
        # fsync, which only matters if the machine itself goes down, is paced to once a second
        # because on network disks it can cost more than a small slab.
        with open(self.path, "a") as f:
            f.write("\n".join(lines) + "\n")
            f.flush()
            if time.monotonic() - self._synced >= FSYNC_INTERVAL:
                os.fsync(f.fileno())
                self._synced = time.monotonic()

