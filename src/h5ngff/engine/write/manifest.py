"""The resume manifest: the record of what has been written, kept inside the output's store.

It holds a header (the content fingerprint) followed by one line per finished slab: every chunk or
shard file it wrote, with its size, and the min/max it saw. Only the client writes it, and a slab
counts as done once its line is stored. One class over the Store protocol, in one of two forms
by what the store can do (engine.stores.base):

- a store that appends (a directory): one object ``.h5ngff/manifest.jsonl``, the header written
  whole (fsynced), then each batch of lines appended; the append reaches the kernel at once and
  is fsynced at most once a second (``FSYNC_INTERVAL``). A torn last line (the client was killed
  mid-write) is ignored;
- a store that does not (a bucket: S3 has no append): one object per batch,
  ``.h5ngff/manifest/<seq>-<id>.jsonl``, the header the first; loading lists them in order.

When the output is finished, the completion marker goes into the root group's attributes and
``.h5ngff/`` is removed. The manifest, not the presence of files, is the record: a chunk that is
missing reads back as the fill value, so presence proves nothing. On resume a slab is skipped only
when every file it owns is recorded *and* still has the recorded size; anything else is rewritten.
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Iterable

from ..stores import Store, open_store
from . import faults

log = logging.getLogger(__name__)

#: The recorded size of a unit left out because it is the fill value everywhere (engine.write.chunkio).
EMPTY_UNIT_BYTES = 0

MANIFEST_DIR = ".h5ngff"
MANIFEST_FILE = "manifest.jsonl"
#: The appended form's one object (a store that appends).
MANIFEST_KEY = f"{MANIFEST_DIR}/{MANIFEST_FILE}"
#: The batch form's objects (a store that does not): ``<seq>-<id>.jsonl`` under this prefix.
MANIFEST_PREFIX = f"{MANIFEST_DIR}/manifest/"
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
    """Append-only record of finished slabs for one output, in its store."""

    def __init__(self, store: Store | str):
        self.store = open_store(store) if isinstance(store, str) else store
        self.root = self.store.root
        self.header: dict[str, Any] | None = None
        self.records: list[SlabRecord] = []
        #: level -> key -> size of every file the manifest vouches for
        self.units: dict[int, dict[str, int]] = {}
        #: level -> key -> CRC32C of every file recorded with one (Zarr v2 with checksums)
        self.checksums: dict[int, dict[str, str]] = {}
        self._synced = 0.0
        #: The next batch object's sequence number (the batch form).
        self._seq = 0
        #: The object ``start`` wrote the header into (the batch form's holds the header alone).
        self.header_key: str | None = None

    # -- reading ---------------------------------------------------------------------------
    @classmethod
    def load(cls, store: Store | str) -> "Manifest | None":
        """The manifest of an existing output, or None if h5ngff did not write it."""
        m = cls(store)
        if m.store.supports_append:
            m._read_appended()
        else:
            keys = sorted(m.store.list(MANIFEST_PREFIX))
            for key in keys:
                for raw in m.store.get(key).split(b"\n"):
                    if raw.strip():
                        m._entry(json.loads(raw))
            m._seq = len(keys)
        return m if m.header else None

    def _read_appended(self) -> None:
        try:
            lines = self.store.get(MANIFEST_KEY).split(b"\n")
        except KeyError:
            return
        for number, raw in enumerate(lines):
            if not raw.strip():
                continue
            try:
                entry = json.loads(raw)
            except ValueError:
                if number >= len(lines) - 2:
                    log.warning(
                        "Ignoring a torn last line in %s/%s (the previous run was interrupted while recording).",
                        self.root,
                        MANIFEST_KEY,
                    )
                    break
                raise
            self._entry(entry)

    def _entry(self, entry: dict[str, Any]) -> None:
        if entry.get("kind") == "header":
            self.header = entry
        elif entry.get("kind") == "slab":
            self._add(
                SlabRecord(
                    entry["pass"],
                    tuple(entry["slab"]),
                    [tuple(u) for u in entry["units"]],
                    [tuple(s) for s in entry.get("stats", [])],
                    [tuple(c) for c in entry.get("crc", [])],
                )
            )

    @staticmethod
    def _line(r: SlabRecord) -> str:
        line: dict[str, Any] = {
            "kind": "slab",
            "pass": r.pass_index,
            "slab": list(r.slab),
            "units": [list(u) for u in r.units],
            "stats": [list(s) for s in r.stats],
        }
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
        (size 0: the fill value everywhere, never stored) that still have no file: one listing
        per level. ``level_paths`` names the levels to check (level ``k``'s keys are ``k/...``)."""
        good: dict[int, set[str]] = {}
        for level, entries in self.units.items():
            if level not in level_paths:
                continue
            sizes = self.store.list(f"{level}/")
            good[level] = {
                key
                for key, nbytes in entries.items()
                if sizes.get(f"{level}/{key}", EMPTY_UNIT_BYTES if nbytes == EMPTY_UNIT_BYTES else None) == nbytes
            }
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
        """Begin a fresh manifest: the header, stored whole and durable (the output's claim)."""
        self.header = {
            "kind": "header",
            "format": FORMAT_VERSION,
            "fingerprint": fingerprint(content),
            "content": content,
            "created": time.time(),
        }
        self.records, self.units, self.checksums, self._seq = [], {}, {}, 0
        line = json.dumps(self.header) + "\n"
        if self.store.supports_append:
            with self.store.writer(MANIFEST_KEY, sync=True) as f:  # whole or absent
                f.write(line.encode())
                faults.crash_point("manifest")
            self.header_key = MANIFEST_KEY
        else:
            faults.crash_point("manifest")  # one PUT: a kill leaves it sent whole or not at all
            self.header_key = self._put_batch(line)

    def append(self, records: Iterable[SlabRecord]) -> None:
        lines = []
        for r in records:
            self._add(r)
            lines.append(self._line(r))
        if not lines:
            return
        text = "\n".join(lines) + "\n"
        if not self.store.supports_append:
            self._put_batch(text)
            return
        # The write reaches the kernel at once, so a killed client loses nothing it recorded; the
        # fsync, which only matters if the machine itself goes down, is paced to once a second
        # because on network disks it can cost more than a small slab.
        sync = time.monotonic() - self._synced >= FSYNC_INTERVAL
        self.store.append(MANIFEST_KEY, text.encode(), sync=sync)
        if sync:
            self._synced = time.monotonic()

    def _put_batch(self, text: str) -> str:
        # The sequence number orders the objects (a lexical list); the random part keeps a
        # resumed run from overwriting a batch if two ever raced.
        key = f"{MANIFEST_PREFIX}{self._seq:010d}-{uuid.uuid4().hex[:8]}.jsonl"
        self.store.put(key, text.encode())
        self._seq += 1
        return key
