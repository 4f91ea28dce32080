"""A directory as a Store: each object through a temporary name and a rename, as chunkio does."""

from __future__ import annotations

import os
import shutil
import uuid
from typing import Collection, Iterable

TMP_MARK = ".h5ngff-tmp-"


class LocalStore:
    def __init__(self, root: str):
        self.root = root

    def _path(self, key: str) -> str:
        return os.path.join(self.root, *key.split("/")) if key else self.root

    def put(self, key: str, data: bytes | memoryview | Iterable[bytes]) -> int:
        path = self._path(key)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        tmp = f"{path}{TMP_MARK}{uuid.uuid4().hex[:12]}"
        pieces = [data] if isinstance(data, (bytes, bytearray, memoryview)) else data
        n = 0
        try:
            with open(tmp, "wb") as f:
                for piece in pieces:
                    n += f.write(piece)
            os.replace(tmp, path)
        except BaseException:
            try:
                os.unlink(tmp)
            except OSError:
                pass
            raise
        return n

    def get(self, key: str) -> bytes:
        try:
            with open(self._path(key), "rb") as f:
                return f.read()
        except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
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

    def delete_prefix(self, prefix: str, keep: Collection[str] = ()) -> int:
        keys = [k for k in self.list(prefix) if k not in keep]
        target = self._path(prefix.rstrip("/"))
        if os.path.isdir(target) and prefix.endswith("/") and not set(keep) & set(self.list(prefix)):
            shutil.rmtree(target)
        else:
            for key in keys:
                os.unlink(self._path(key))
        return len(keys)
