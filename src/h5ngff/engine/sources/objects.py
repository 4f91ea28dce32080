"""Sources in an object store: a bucket as the source readers see it (docs/engine.md, "Sources in
a bucket").

The readers never import the stores (the engine's rooms: sources and stores are siblings that do
not reach each other, pyproject.toml). They read a bucket through an ``ObjectReader``, which
the stores' ``S3Store`` is, obtained from an ``Opener`` that the rooms above them pass in
(``engine.stores.open_object_reader``; the runner, the write driver and verify pass it). The
opener is a module-level function, so a ``Bucket`` pickles by reference to the workers, and each
worker opens the bucket's store once: one client, one connection pool, the same credentials,
profiles, retries and retry counting as an output in a bucket.

What a reader asks of a bucket, and what each failure becomes here (one message each):
- ``stat``: the object's size and ETag (resume's identity): a missing object or bucket is
  SourceNotFoundError; a refusal (403) is SourceError naming the permission to grant;
- ``fetch``: byte ranges, pinned to the ETag the client saw (a replaced object is refused, not
  mixed); a range past the object's end is a truncated object; a store that keeps throttling or
  failing after every retry is SourceUnavailableError (the run failed; it resumes);
- ``open_h5``: h5py over ``RangeFile``, for the client's metadata reads only (the workers read
  chunks by their index, engine.sources.ranged);
- ``list``: the objects under a prefix, for globs.
"""

from __future__ import annotations

import io
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Mapping, NoReturn, Protocol, Sequence

import h5py

from ...errors import (
    CredentialsError,
    SourceError,
    SourceNotFoundError,
    SourceUnavailableError,
    StoreObjectChangedError,
    StoreRefusedError,
    StoreUnavailableError,
)
from ...spec import url_scheme


class ObjectReader(Protocol):
    """What the source readers need of a bucket (engine.stores.s3.S3Store has it)."""

    root: str

    def head(self, key: str) -> tuple[int, str]: ...
    def fetch(
        self, key: str, ranges: Sequence[tuple[int, int]], in_flight: int = 1, etag: str | None = None
    ) -> Iterator[bytes]: ...
    def list(self, prefix: str = "") -> dict[str, int]: ...


#: ("s3://bucket", storage options) -> that bucket's reader, shared in the process.
Opener = Callable[[str, Mapping[str, str] | None], ObjectReader]


def in_bucket(path: str) -> bool:
    return url_scheme(path) is not None


def split_url(url: str) -> tuple[str, str]:
    """``s3://bucket/run/a.h5`` -> ("s3://bucket", "run/a.h5")."""
    scheme, _, rest = url.partition("://")
    bucket, _, key = rest.partition("/")
    return f"{scheme.lower()}://{bucket}", key


def join_url(base: str, relative: str) -> str:
    """A key beside ``base`` (BigDataViewer's XML names its HDF5 file relative to itself)."""
    root, key = split_url(base)
    parts = key.split("/")[:-1]
    for part in relative.split("/"):
        if part in ("", "."):
            continue
        if part == "..":
            if parts:
                parts.pop()
            continue
        parts.append(part)
    return f"{root}/{'/'.join(parts)}"


@dataclass(frozen=True)
class Bucket:
    """Where a source's objects are read from: picklable (the opener is a module function), so
    the workers open the same bucket with the same options themselves."""

    opener: Opener
    options: tuple[tuple[str, str], ...] = ()

    def _reader(self, url: str) -> tuple[ObjectReader, str]:
        root, key = split_url(url)
        return self.opener(root, dict(self.options)), key

    def stat(self, url: str, field: str = "source.path") -> tuple[int, str]:
        """(size, ETag) of the object at ``url``."""
        reader, key = self._reader(url)
        try:
            return reader.head(key)
        except Exception as exc:  # noqa: BLE001 - every store error becomes a source error
            raise_source_error(url, exc, field)

    def fetch(
        self, url: str, ranges: Sequence[tuple[int, int]], in_flight: int, etag: str | None, field: str = "source.path"
    ) -> Iterator[bytes]:
        """The byte ranges of the object, at most ``in_flight`` GETs at once, in order."""
        reader, key = self._reader(url)
        bodies = reader.fetch(key, ranges, in_flight, etag)
        while True:
            try:
                body = next(bodies)
            except StopIteration:
                return
            except Exception as exc:  # noqa: BLE001
                raise_source_error(url, exc, field)
            yield body

    def list(self, url_prefix: str, field: str = "source.path") -> dict[str, int]:
        """Every object under ``url_prefix`` (a key prefix), as URLs, with its size."""
        reader, prefix = self._reader(url_prefix)
        root = split_url(url_prefix)[0]
        try:
            found = reader.list(prefix)
        except Exception as exc:  # noqa: BLE001
            raise_source_error(url_prefix, exc, field)
        return {f"{root}/{key}": size for key, size in found.items()}

    def open_h5(self, url: str, field: str, stat: tuple[int, str]) -> h5py.File:
        """h5py over the byte ranges of the object of ``stat`` (size, ETag): metadata only, the
        client's inspection."""
        raw = RangeFile(self, url, stat[0], stat[1], field)
        try:
            return h5py.File(raw, "r")
        except SourceError:
            raise
        except OSError as exc:
            if isinstance(exc.__context__, SourceError):  # a range read failed under h5py
                raise exc.__context__ from None
            raise SourceError(
                f"{field}: {url!r} cannot be opened as HDF5 ({exc}). Is it a complete, uncorrupted HDF5 file "
                f"(a truncated upload reads as 'truncated file')?"
            ) from None


def raise_source_error(url: str, exc: BaseException, field: str = "source.path") -> NoReturn:
    """A store's error on a source object, as the one message a user acts on."""
    if isinstance(exc, SourceError):
        raise exc
    if isinstance(exc, KeyError):
        raise SourceNotFoundError(
            f"{field}: {url} does not exist (no such object in the bucket). Check the key and the bucket; the "
            f"workers read it with the same storage options."
        ) from None
    if isinstance(exc, StoreObjectChangedError):
        raise SourceError(
            f"{field}: {url} was replaced while it was converted ({exc}). Nothing of the new object was written; "
            f"convert it again with --overwrite (output.overwrite) once nothing writes it."
        ) from None
    if isinstance(exc, StoreRefusedError):
        raise _refused(url, exc, field) from None
    if isinstance(exc, StoreUnavailableError):
        raise SourceUnavailableError(f"Reading the source {url}: {exc}") from None
    if isinstance(exc, CredentialsError):
        raise SourceError(f"{field}: {exc}") from None
    raise exc


def _refused(url: str, exc: StoreRefusedError, field: str) -> SourceError:
    if exc.code in ("Truncated", "InvalidRange"):
        return SourceError(
            f"{field}: {url} is truncated: its HDF5 index names bytes past the object's end ({exc.detail}). "
            f"Upload the file again, whole."
        )
    if exc.code == "NoSuchBucket":
        return SourceNotFoundError(f"{field}: the bucket of {url} does not exist ({exc.detail}). Check its name.")
    if exc.code == "AccessDenied":
        return SourceError(
            f"{field}: {url} cannot be read: the store refused these credentials (AccessDenied: {exc.detail}). "
            f"To fix: grant them s3:GetObject on the object (and s3:ListBucket for a glob), or give other credentials "
            f"(source.storageOptions, AWS_PROFILE, the environment)."
        )
    return SourceError(
        f"{field}: {url} cannot be read: the store refused the request ({exc.code}: {exc.detail}). "
        f"Check the bucket, the endpoint and the credentials."
    )


#: The client reads HDF5 metadata in blocks of this size (superblock, object headers, B-tree
#: nodes and heaps are small and mostly near each other), the last ``_CACHED_BLOCKS`` kept (16 MiB):
#: HDF5 revisits nodes while it walks a B-tree, and each block costs a round trip.
BLOCK_BYTES = 256 * 1024
_CACHED_BLOCKS = 64


class RangeFile(io.RawIOBase):
    """A read-only file over an object's byte ranges, for h5py's ``fileobj`` driver."""

    def __init__(self, bucket: Bucket, url: str, size: int, etag: str, field: str = "source.path"):
        super().__init__()
        self.bucket, self.url, self.size, self.etag, self.field = bucket, url, size, etag, field
        self._pos = 0
        self._blocks: OrderedDict[int, bytes] = OrderedDict()
        self._lock = threading.Lock()

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self.size}[whence]
        self._pos = base + offset
        return self._pos

    def readinto(self, buffer: Any) -> int:
        view = memoryview(buffer).cast("B")
        end = min(self._pos + len(view), self.size)
        done = 0
        while self._pos + done < end:
            at = self._pos + done
            block = self._block(at // BLOCK_BYTES)
            inside = at % BLOCK_BYTES
            n = min(len(block) - inside, end - at)
            if n <= 0:
                break
            view[done : done + n] = block[inside : inside + n]
            done += n
        self._pos += done
        return done

    def _block(self, index: int) -> bytes:
        with self._lock:
            block = self._blocks.get(index)
            if block is not None:
                self._blocks.move_to_end(index)
                return block
        start = index * BLOCK_BYTES
        length = min(BLOCK_BYTES, self.size - start)
        block = b"".join(self.bucket.fetch(self.url, [(start, length)], 1, self.etag or None, self.field))
        with self._lock:
            self._blocks[index] = block
            while len(self._blocks) > _CACHED_BLOCKS:
                self._blocks.popitem(last=False)
        return block
