"""How one conversion reaches its source files: the filesystem, or a bucket (engine.sources.objects).

Every container reader (plain, stacked, Imaris, BigDataViewer, files stacked into one image)
asks an ``Access`` for what it needs: whether a file exists, the file opened with h5py (over
byte ranges for an object), its identity for resume (size and mtime, or size and ETag), a small
file whole (a BigDataViewer XML), a glob's matches, and, for an object, the ``RemoteLayout`` the
workers read it by. So no reader knows which of the two it reads; only this module does.
"""

from __future__ import annotations

import fnmatch
import glob as globbing
import os
import re
from dataclasses import dataclass, field
from typing import Mapping, Sequence

import h5py

from ...errors import SourceError, SourceNotFoundError, SpecError
from ...spec import ConversionSpec
from .chunkindex import read_index
from .hdf5 import SourceIdentity, missing, unopenable
from .objects import Bucket, Opener, in_bucket, split_url
from .remote import RemoteLayout


@dataclass(frozen=True)
class Access:
    """The filesystem (``bucket`` None), or a bucket for the URLs among the source's paths."""

    bucket: Bucket | None = None
    #: Each object's (size, ETag) as first seen: one description of a source uses one snapshot
    #: (the metadata read, the chunk index and the identity all name the same object).
    _stats: dict[str, tuple[int, str]] = field(default_factory=dict, compare=False, repr=False)

    def remote(self, path: str) -> bool:
        return in_bucket(path)

    def _bucket(self) -> Bucket:
        if self.bucket is None:  # the rooms above pass an opener wherever a spec may name a URL
            raise RuntimeError("a source in a bucket was opened without an object-store opener")
        return self.bucket

    def stat(self, url: str, field: str = "source.path") -> tuple[int, str]:
        """An object's (size, ETag), the first answer kept."""
        if url not in self._stats:
            self._stats[url] = self._bucket().stat(url, field)
        return self._stats[url]

    def exists(self, path: str) -> bool:
        if not self.remote(path):
            return os.path.exists(path)
        try:
            self.stat(path)
        except SourceNotFoundError:
            return False
        return True

    def open_h5(self, path: str, field: str = "source.path", what: str = "file") -> h5py.File:
        if self.remote(path):
            return self._bucket().open_h5(path, field, self.stat(path, field))
        if not os.path.exists(path):
            raise SourceNotFoundError(missing(path, what, field))
        try:
            return h5py.File(path, "r")
        except OSError as exc:
            raise SourceError(unopenable(path, exc, field)) from None

    def identity(self, path: str, selection: str) -> SourceIdentity:
        """What must not change before a resume: size and mtime, or an object's size and ETag."""
        if self.remote(path):
            size, etag = self.stat(path)
            return SourceIdentity(path, selection, size, 0, etag=etag)
        stat = os.stat(path)
        return SourceIdentity(os.path.abspath(path), selection, stat.st_size, stat.st_mtime_ns)

    def read_bytes(self, path: str, field: str = "source.path") -> bytes:
        if self.remote(path):
            size, etag = self.stat(path, field)
            return b"".join(self._bucket().fetch(path, [(0, size)] if size else [], 1, etag or None, field))
        with open(path, "rb") as f:
            return f.read()

    def glob(self, pattern: str) -> list[str]:
        """The files a glob matches (directories left out), unordered: a bucket is listed under
        the pattern's literal prefix and each key matched as ``glob`` would (``*`` stays within one
        ``/`` level; ``**`` spans levels)."""
        if not self.remote(pattern):
            return [p for p in globbing.glob(pattern, recursive=True) if not os.path.isdir(p)]
        literal = re.split(r"[*?\[]", pattern, maxsplit=1)[0]
        # The listing's prefix ends at a '/': a store lists by whole path segments.
        listed = self._bucket().list(literal[: literal.rfind("/") + 1], "source.path")
        matcher = re.compile(glob_regex(pattern))
        return [url for url in listed if matcher.fullmatch(url)]

    def layout(self, path: str, pieces: Sequence[str], datasets: Sequence[h5py.Dataset]) -> RemoteLayout | None:
        """For an object, what the workers read it by: every piece's chunk index, read now."""
        if not self.remote(path):
            return None
        etag = self.stat(path)[1]
        indexes = tuple(read_index(ds, f"{name!r} in {path}") for name, ds in zip(pieces, datasets))
        return RemoteLayout(self._bucket(), (path,) * len(pieces), (etag,) * len(pieces), indexes)


def glob_regex(pattern: str) -> str:
    """A glob as a regular expression over whole paths: ``*`` and ``?`` stay within one ``/``
    level, ``**/`` spans any number of levels, ``[...]`` is a character class (fnmatch's)."""
    out, i = [], 0
    while i < len(pattern):
        if pattern.startswith("**/", i):
            out.append("(?:[^/]*/)*")
            i += 3
        elif pattern[i] == "*":
            out.append("[^/]*")
            i += 1
        elif pattern[i] == "?":
            out.append("[^/]")
            i += 1
        elif pattern[i] == "[" and "]" in pattern[i + 1 :]:
            end = pattern.index("]", i + 1)
            out.append(fnmatch.translate(pattern[i : end + 1])[4:-3])  # fnmatch's class, without its anchors
            i = end + 1
        else:
            out.append(re.escape(pattern[i]))
            i += 1
    return "".join(out)


def source_options(spec: ConversionSpec) -> Mapping[str, str]:
    """The storage options a bucket source is read with: ``source.storageOptions`` where given
    (``{}`` for the environment alone), else an s3:// output's (one endpoint for both, the usual
    case), else none (docs/engine.md, "Sources in a bucket")."""
    return spec.source_storage_options


def access_for(spec: ConversionSpec, opener: Opener | None) -> Access:
    """The Access of ``spec``'s source: a bucket where any of its paths is a URL."""
    paths = [spec.source.path, *(spec.source.paths or [])]
    if not any(in_bucket(p) for p in paths):
        return Access()
    if opener is None:
        raise RuntimeError("a source in a bucket needs an object-store opener (engine.stores.open_object_reader)")
    roots = {split_url(p)[0] for p in paths if in_bucket(p)}
    if len(roots) > 1 or not all(in_bucket(p) for p in paths):
        raise SpecError(
            "source.paths",
            f"Expected every file of one image in one bucket. Got files in {sorted(roots | {'local files'} if not all(in_bucket(p) for p in paths) else roots)} instead.",
        )
    return Access(Bucket(opener, tuple(sorted(source_options(spec).items()))))
