"""Where the bytes go: one Store protocol with two implementations (docs/engine.md, "Stores").

- ``LocalStore``: a directory; every object written through a temporary name and a rename.
- ``S3Store``: an S3-compatible bucket (AWS, MinIO, Ceph RGW); every object one whole PUT, large
  ones a multipart upload that is completed or aborted.

``open_store(path, options)`` picks one by the path's URL scheme; the engine's chunk writer finds
the store of a chunk's URL with ``store_for`` (a per-process cache, so a Dask worker builds its
client once and reuses its connection pool).
"""

from __future__ import annotations

import threading
from typing import Mapping

from ...spec import url_scheme
from .base import Store, StoreRetries, store_retries
from .local import LocalStore

__all__ = ["Store", "LocalStore", "StoreRetries", "store_retries", "open_store", "is_url", "register", "store_for", "split_url"]

_lock = threading.Lock()
_registered: dict[str, dict[str, str]] = {}
_open: dict[tuple[str, tuple[tuple[str, str], ...]], Store] = {}


def is_url(path: str) -> bool:
    return url_scheme(path) is not None


def split_url(url: str) -> tuple[str, str, str]:
    """``s3://bucket/a/b`` -> ("s3", "bucket", "a/b")."""
    scheme, _, rest = url.partition("://")
    bucket, _, key = rest.partition("/")
    return scheme.lower(), bucket, key.strip("/")


def open_store(path: str, options: Mapping[str, str] | None = None) -> Store:
    """The store rooted at ``path``: a local directory, or ``s3://bucket/prefix``. Cached per
    process and options, so every caller in a process shares one client (and its pool)."""
    with _lock:
        if options is None:  # a caller that knows only the path: the options registered for it
            options = _registered.get(path.rstrip("/"))
        key = (path.rstrip("/"), tuple(sorted((options or {}).items())))
        store = _open.get(key)
        if store is None:
            if is_url(path):
                from .s3 import S3Store  # obstore loads only where a bucket is written

                store = S3Store.from_url(key[0], dict(options or {}))
            else:
                store = LocalStore(path)
            _open[key] = store
        return store


def register(root: str, options: Mapping[str, str]) -> None:
    """Remember the storage options of the output at ``root`` (a URL) in this process: the
    chunk writer sees only a chunk's URL."""
    with _lock:
        _registered[root.rstrip("/")] = dict(options)


def store_for(url: str) -> tuple[Store, str]:
    """The store of the registered output that holds ``url``, and the key of ``url`` in it."""
    with _lock:
        roots = sorted((r for r in _registered if url == r or url.startswith(r + "/")), key=len, reverse=True)
    if not roots:
        raise LookupError(f"no output registered for {url!r}")
    root = roots[0]
    return open_store(root, _registered[root]), url[len(root) :].lstrip("/")
