"""Listing a bucket for a batch's glob (``s3://bucket/run/*.h5:/data``), apart from
``batch.items``: the operator's controller reads that module for templates and collisions, and a
bucket is listed through the engine's source readers, which the controller must never import
(docs/architecture.md, "The operator's rooms")."""

from __future__ import annotations

from typing import Mapping

from ..engine.sources.access import Access
from ..engine.sources.objects import Bucket
from ..engine.stores import open_object_reader
from .items import BucketGlob


def bucket_lister(source_options: Mapping[str, str] | None) -> BucketGlob:
    """A glob over a bucket's objects, read with ``source_options``, as the source readers list them."""
    bucket = Bucket(open_object_reader, tuple(sorted((source_options or {}).items())))

    def glob(pattern: str) -> list[str]:
        return Access(bucket).glob(pattern)

    return glob
