"""Where the bytes go: one Store protocol with two implementations (docs/engine.md, "Stores").
What differs between them is in the protocol's capability members (base.py), so no caller
outside this package asks which one it holds.

- ``LocalStore``: a directory; every object written through a temporary name and a rename.
- ``S3Store``: an S3-compatible bucket (AWS, MinIO, Ceph RGW); every object one whole PUT, large
  ones a multipart upload that is completed or aborted.

``open_store(path, options)`` picks one by the path's URL scheme, cached per process: every
reader and writer of an output in a process (the driver, each Dask worker) shares one store, so a
worker builds a bucket's client once and reuses its connection pool. A level's layout carries its
output's storage options (``chunkio.ArrayLayout.store``), so a worker needs nothing else.
"""

from __future__ import annotations

import threading
from typing import Any, Mapping

from ...errors import SpecError
from ...spec import url_scheme
from .base import Store, StoreRetries, store_retries
from .local import LocalStore
from .options import validate

__all__ = [
    "Store",
    "LocalStore",
    "StoreRetries",
    "store_retries",
    "open_store",
    "open_object_reader",
    "forget_stores",
    "is_url",
    "split_url",
]

_lock = threading.Lock()
_open: dict[tuple[str, tuple[tuple[str, str], ...]], Store] = {}


def is_url(path: str) -> bool:
    return url_scheme(path) is not None


def split_url(url: str) -> tuple[str, str, str]:
    """``s3://bucket/a/b`` -> ("s3", "bucket", "a/b")."""
    scheme, _, rest = url.partition("://")
    bucket, _, key = rest.partition("/")
    return scheme.lower(), bucket, key.strip("/")


def open_store(path: str, options: Mapping[str, str] | None = None, field: str = "output.storageOptions") -> Store:
    """The store rooted at ``path``: a local directory, or ``s3://bucket/prefix``. Cached per
    process and options, so every caller in a process shares one client (and its pool).
    ``field``: the spec field the options came from, named by a refusal (a source's options are
    ``source.storageOptions``)."""
    with _lock:
        key = (path.rstrip("/"), tuple(sorted((options or {}).items())))
        store = _open.get(key)
        if store is None:
            if is_url(path):
                try:
                    validate(options)  # before any client: a mistyped option is exit 2, not obstore's Rust text
                    store = _s3_store_class().from_url(key[0], dict(options or {}))
                except SpecError as exc:
                    if exc.field != "output.storageOptions" or field == exc.field:
                        raise
                    raise SpecError(field, str(exc).removeprefix(f"{exc.field}: ")) from None
            else:
                store = LocalStore(path)
            _open[key] = store
        return store


def open_object_reader(bucket: str, options: Mapping[str, str] | None = None) -> Any:
    """What the source readers read a bucket through (engine.sources.objects.ObjectReader): the
    bucket's store, shared with every other reader and writer in the process. The sources never
    import this package (the engine's rooms); the rooms above pass this function to them."""
    return open_store(bucket, options, field="source.storageOptions")


def forget_stores(path: str) -> None:
    """Drop the stores at ``path`` and under it (its levels' arrays; any options) from the cache:
    a batch's worker converts hundreds of outputs, and each one ended would otherwise keep its
    stores (and a bucket's clients) for the worker's life. A later ``open_store`` opens afresh."""
    root = path.rstrip("/")
    with _lock:
        for key in [k for k in _open if k[0] == root or k[0].startswith(root + "/")]:
            del _open[key]


def _s3_store_class() -> Any:
    """engine.stores.s3.S3Store; obstore (and botocore) load only where a bucket is written, and
    are the ``s3`` extra: without it, say what to install instead of a traceback."""
    try:
        from .s3 import S3Store
    except ModuleNotFoundError as exc:
        if (exc.name or "").split(".")[0] not in ("obstore", "botocore"):
            raise
        raise SpecError(
            "output.path",
            f"Expected the s3 extra installed for an s3:// path (pip install 'h5ngff[s3]'). Got no {exc.name} module "
            f"instead: install the extra, or write to a local directory.",
        ) from None
    return S3Store
