"""moto's S3 server whose ranged GETs read only the bytes asked for (bench only).

moto 5.2's server reads the whole object for every GET, ranged or not (``FakeKey.value`` reads
its whole buffer; ``S3Response._handle_range_header`` then slices it): a 1 MiB range of a 1 GB
object costs a 1 GB read. No real store does that (S3, MinIO and Ceph serve a range in time
proportional to the range), and it would make any reader of byte ranges look slow against a
local file for moto's reason. Here, while a GET with one ``Range`` is answered, the key's value
is a window onto its buffer that reads just the sliced bytes; everything else is moto's own.

    python -m bench.moto_ranged -H 127.0.0.1 -p PORT     # as python -m moto.server
"""

from __future__ import annotations

import sys
import threading
from typing import Any

from moto.s3 import models, responses

_ranged = threading.local()


class _Window:
    """The object's bytes, read from its buffer only where sliced."""

    def __init__(self, key: Any):
        self._key = key

    def __len__(self) -> int:
        return int(self._key.size)

    def __getitem__(self, part: slice) -> bytes:
        start, stop, _ = part.indices(len(self))
        with self._key.lock:
            self._key._value_buffer.seek(start)
            return self._key._value_buffer.read(stop - start)


_value = models.FakeKey.value


def _windowed_value(key: Any) -> Any:
    return _Window(key) if getattr(_ranged, "on", False) else _value.fget(key)  # type: ignore[attr-defined]


_get_object = responses.S3Response.get_object


def _get_object_ranged(self: Any) -> Any:
    header = self.headers.get("range") or ""
    _ranged.on = header.startswith("bytes=") and "," not in header
    try:
        return _get_object(self)
    finally:
        _ranged.on = False


models.FakeKey.value = property(_windowed_value, _value.fset)  # type: ignore[method-assign, assignment]
responses.S3Response.get_object = _get_object_ranged  # type: ignore[method-assign]

if __name__ == "__main__":
    from moto.server import main

    sys.exit(main())
