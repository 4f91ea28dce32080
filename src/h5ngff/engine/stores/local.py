"""A directory as a Store: each object written to a temporary name in its directory and renamed
onto its key, so a reader or a resumed run never sees half a chunk, shard or document.

The temporary name is ``.<name>.h5ngff-tmp-<random>``: a writer killed before its rename leaves
it behind, and ``sweep`` (run on resume and before the completion marker, when nothing else is
writing) removes it. Chunks and shards are not fsynced (a lost machine loses the unfinished run,
which the manifest does not vouch for); ``sync=True`` fsyncs before the rename, for metadata.

Its capabilities (engine.stores.base): it appends in place (the manifest's one file), has no
conditional writes (the output is locked by ``flock`` on ``local_path``), and ``--overwrite`` may
replace a Zarr store that h5ngff did not write.
"""

from __future__ import annotations

import errno
import os
import shutil
import uuid
from contextlib import contextmanager, nullcontext
from typing import Any, BinaryIO, ContextManager, Collection, Iterable, Iterator, Sequence

from ...errors import DiskFullError, OutputError
from .base import ConditionalWritesUnsupported, RetryPolicy

TMP_MARK = ".h5ngff-tmp-"


class LocalStore:
    supports_append = True
    supports_conditional_writes = False
    overwrites_foreign_zarr = True

    def __init__(self, root: str):
        self.root = root
        #: Directories known to exist (made or seen by this store): one makedirs per directory,
        #: not one per chunk. A stale entry (a directory removed by --overwrite) is repaired on
        #: the FileNotFoundError it causes.
        self._dirs: set[str] = set()

    @property
    def local_path(self) -> str:
        return self.root

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
            raise _write_error(path, exc) from exc
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

    def append(self, key: str, data: bytes, sync: bool = False) -> None:
        """One write at the end of the file (created if absent): it reaches the kernel at once, so
        a killed process loses nothing appended; ``sync`` fsyncs it, for a lost machine."""
        path = self._path(key)
        try:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(path, "ab") as f:
                f.write(data)
                f.flush()
                if sync:
                    os.fsync(f.fileno())
        except OSError as exc:
            raise _write_error(path, exc) from exc

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
            self._prune(target)
        return len(keys)

    def _prune(self, top: str) -> None:
        """Remove the directories under ``top`` left empty (and links to directories, which a walk
        does not enter), deepest first; ``top`` itself stays."""
        if not os.path.isdir(top):
            return
        for directory, subdirs, _ in os.walk(top, topdown=False):
            for name in subdirs:
                entry = os.path.join(directory, name)
                if os.path.islink(entry):
                    os.unlink(entry)
            if directory != top:
                try:
                    os.rmdir(directory)
                except OSError:
                    pass  # holds a kept key
        self._dirs.clear()

    def occupied(self, ignore: Collection[str] = ()) -> bool:
        if not os.path.exists(self.root):
            return False
        if not os.path.isdir(self.root):
            return True  # a file where the directory would be
        return any(name not in ignore for name in os.listdir(self.root))

    def check_creatable(self) -> None:
        """The nearest existing ancestor must be a directory we may write into."""
        parent = os.path.abspath(self.root)
        while not os.path.exists(parent):
            parent = os.path.dirname(parent)
        if not os.path.isdir(parent):
            raise OutputError(
                f"output.path: cannot create {self.root!r}: {parent!r} is a file, not a directory. Choose a writable location."
            )
        if not os.access(parent, os.W_OK | os.X_OK):
            raise OutputError(
                f"output.path: cannot create {self.root!r}: {unwritable_reason(parent)} ({parent}). Choose a writable location."
            )

    def sweep(self) -> int:
        """Delete the temporary files killed writers left (only ours: they carry TMP_MARK)."""
        removed = 0
        for key in self.leftovers():
            _remove_quietly(self._path(key))
            removed += 1
        return removed

    def leftovers(self) -> tuple[str, ...]:
        """The temporary files killed writers left (they carry TMP_MARK), as keys."""
        return tuple(
            os.path.relpath(os.path.join(directory, name), self.root).replace(os.sep, "/")
            for directory, _, files in os.walk(self.root)
            for name in files
            if TMP_MARK in name
        )

    def overlapped(self, depth: int) -> ContextManager[None]:
        """Nothing to overlap: a write returns once the kernel holds the bytes, without a round
        trip to wait for."""
        return nullcontext()

    # -- no conditional writes: a directory is locked by flock (engine.write.lock) ---------------------
    def create(self, key: str, data: bytes, policy: RetryPolicy | None = None) -> str | None:
        raise ConditionalWritesUnsupported(f"{self.root} is a directory: it is locked with flock, not a lease object")

    def replace(self, key: str, data: bytes, etag: str, policy: RetryPolicy | None = None) -> str | None:
        raise ConditionalWritesUnsupported(f"{self.root} is a directory: it is locked with flock, not a lease object")

    def get_tagged(self, key: str, policy: RetryPolicy | None = None) -> tuple[bytes, str] | None:
        raise ConditionalWritesUnsupported(f"{self.root} is a directory: it is locked with flock, not a lease object")

    def as_zarr_store(self) -> Any:
        """zarr-python's read-only view of the directory (its own file reads)."""
        from zarr.storage import LocalStore as ZarrLocalStore

        return ZarrLocalStore(self.root, read_only=True)


def unwritable_reason(path: str) -> str:
    """Why this process cannot write into the existing directory ``path``: a read-only filesystem
    (mounted ro: permissions will not help) or permission denied."""
    try:
        if os.statvfs(path).f_flag & os.ST_RDONLY:
            return "it is on a read-only filesystem"
    except OSError:
        pass
    return "permission denied"


def _write_error(path: str, exc: OSError) -> OutputError:
    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return DiskFullError(
            f"No space left on the output device while writing {path}. Free space and re-run the same command; finished slabs are kept."
        )
    if exc.errno == errno.EROFS:
        return OutputError(
            f"Cannot write {path}: the filesystem is read-only (mounted ro). Choose an output on a writable filesystem."
        )
    return OutputError(f"Cannot write {path}: {exc.strerror or exc}. Check that the output location is writable.")


def _remove_quietly(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass
