"""A directory as a Store: each object written to a temporary name in its directory and renamed
onto its key, so a reader or a resumed run never sees half a chunk, shard or document.

The temporary name is ``.<name>.h5ngff-tmp-<random>``: a writer killed before its rename leaves
it behind, and ``sweep`` (run on resume and before the completion marker, when nothing else is
writing) removes it. Chunks and shards are not fsynced (a lost machine loses the unfinished run,
which the manifest does not vouch for); ``sync=True`` fsyncs before the rename, for metadata.
"""

from __future__ import annotations

import errno
import os
import shutil
import uuid
from contextlib import contextmanager, nullcontext
from typing import BinaryIO, ContextManager, Collection, Iterable, Iterator, Sequence

from ...errors import DiskFullError, OutputError

TMP_MARK = ".h5ngff-tmp-"


class LocalStore:
    def __init__(self, root: str):
        self.root = root
        #: Directories known to exist (made or seen by this store): one makedirs per directory,
        #: not one per chunk. A stale entry (a directory removed by --overwrite) is repaired on
        #: the FileNotFoundError it causes.
        self._dirs: set[str] = set()

    def _path(self, key: str) -> str:
        return os.path.join(self.root, *key.split("/")) if key else self.root

    def _open_new(self, directory: str, tmp: str) -> BinaryIO:
        if directory not in self._dirs:
            os.makedirs(directory, exist_ok=True)
            self._dirs.add(directory)
        try:
            return open(tmp, "wb")
        except FileNotFoundError:
            os.makedirs(directory, exist_ok=True)
            return open(tmp, "wb")

    @contextmanager
    def writer(self, key: str, sync: bool = False) -> Iterator[BinaryIO]:
        path = self._path(key)
        directory, name = os.path.split(path)
        tmp = os.path.join(directory, f".{name}{TMP_MARK}{uuid.uuid4().hex[:12]}")
        try:
            with self._open_new(directory, tmp) as f:
                yield f
                if sync:
                    f.flush()
                    os.fsync(f.fileno())
            os.replace(tmp, path)
        except OSError as exc:
            _remove_quietly(tmp)
            if exc.errno in (errno.ENOSPC, errno.EDQUOT):
                raise DiskFullError(f"No space left on the output device while writing {path}. Free space and re-run the same command; finished slabs are kept.") from exc
            raise OutputError(f"Cannot write {path}: {exc.strerror or exc}. Check that the output location is writable.") from exc
        except BaseException:
            _remove_quietly(tmp)
            raise

    def put(self, key: str, data: bytes | memoryview | Iterable[bytes], sync: bool = False) -> int:
        pieces = [data] if isinstance(data, (bytes, bytearray, memoryview)) else data
        n = 0
        with self.writer(key, sync) as f:
            for piece in pieces:
                n += f.write(piece)
        return n

    def get(self, key: str) -> bytes:
        try:
            with open(self._path(key), "rb") as f:
                return f.read()
        except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
            raise KeyError(key) from None

    def get_suffix(self, key: str, length: int) -> tuple[bytes, int]:
        fd = self._open_read(key)
        try:
            size = os.fstat(fd).st_size
            return os.pread(fd, min(length, size), max(0, size - length)), size
        finally:
            os.close(fd)

    def get_ranges(self, key: str, ranges: Sequence[tuple[int, int]]) -> Iterator[bytes]:
        # One descriptor for all ranges, each read when the caller asks for it: the caller holds
        # one range at a time (a shard's inner chunks, issue 18). KeyError at the first range.
        fd = self._open_read(key)
        try:
            for start, length in ranges:
                yield os.pread(fd, length, start)
        finally:
            os.close(fd)

    def _open_read(self, key: str) -> int:
        try:
            return os.open(self._path(key), os.O_RDONLY)
        except (FileNotFoundError, NotADirectoryError):
            raise KeyError(key) from None

    def size(self, key: str) -> int | None:
        try:
            st = os.stat(self._path(key))
        except (FileNotFoundError, NotADirectoryError):
            return None
        return None if os.path.isdir(self._path(key)) else st.st_size

    def list(self, prefix: str = "") -> dict[str, int]:
        out: dict[str, int] = {}
        for directory, _, files in os.walk(self._path(prefix.rstrip("/"))):
            for name in files:
                full = os.path.join(directory, name)
                key = os.path.relpath(full, self.root).replace(os.sep, "/")
                if key.startswith(prefix):
                    out[key] = os.stat(full).st_size
        return out

    def delete(self, key: str) -> None:
        _remove_quietly(self._path(key))

    def delete_prefix(self, prefix: str, keep: Collection[str] = ()) -> int:
        keys = [k for k in self.list(prefix) if k not in keep]
        target = self._path(prefix.rstrip("/"))
        if os.path.isdir(target) and prefix.endswith("/") and not set(keep) & set(self.list(prefix)):
            shutil.rmtree(target)
        else:
            for key in keys:
                os.unlink(self._path(key))
        return len(keys)

    def sweep(self) -> int:
        """Delete the temporary files killed writers left (only ours: they carry TMP_MARK)."""
        removed = 0
        for directory, _, files in os.walk(self.root):
            for name in files:
                if TMP_MARK in name:
                    _remove_quietly(os.path.join(directory, name))
                    removed += 1
        return removed

    def overlapped(self, depth: int) -> ContextManager[None]:
        """Nothing to overlap: a write returns once the kernel holds the bytes, without a round
        trip to wait for."""
        return nullcontext()


def _remove_quietly(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass
