"""ConversionJob manifests as files: the YAML a user would ``kubectl apply``.

``h5ngff run job.yaml`` and ``h5ngff plan job.yaml`` read them here, with the same checks the
API server and the operator make, so a manifest that works on a workstation works in GitOps.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Callable, TypeVar

import yaml

from .errors import SpecError
from .jobspec import API_VERSION, KIND, ConversionJobSpec, parse_job_spec

MANIFEST_SUFFIXES = (".yaml", ".yml", ".json")
S = TypeVar("S")


@dataclass(frozen=True)
class JobManifest:
    path: str
    name: str
    namespace: str | None
    spec: ConversionJobSpec
    raw: dict[str, Any]


def is_manifest_path(text: str) -> bool:
    """``plan SOURCE`` takes FILE.h5:/dataset or a manifest; a manifest ends in .yaml/.yml/.json."""
    return text.lower().endswith(MANIFEST_SUFFIXES)


def load_job(path: str) -> JobManifest:
    """Read the (first) ConversionJob in a YAML file, or raise SpecError saying what is wrong."""
    return parse_manifest(load_document(path, KIND), path)


def load_document(path: str, kind: str | tuple[str, ...]) -> dict[str, Any]:
    """The first document of ``kind`` (or of any of several kinds) in a YAML file, or a SpecError
    that says what is wrong."""
    kinds = (kind,) if isinstance(kind, str) else kind
    kind = " or ".join(kinds)
    try:
        with open(path) as f:
            documents = [d for d in yaml.safe_load_all(f) if d is not None]
    except FileNotFoundError:
        raise SpecError("", f"Expected a {kind} manifest file. Got {path!r}, which does not exist, instead.") from None
    except IsADirectoryError:
        raise SpecError("", f"Expected a {kind} manifest file. Got {path!r}, which is a directory, instead.") from None
    except UnicodeDecodeError:
        raise SpecError(
            "",
            f"Expected a {kind} manifest (YAML text). Got {path!r}, which is not a YAML text file (binary data"
            f"{', an HDF5 file' if _is_hdf5(path) else ''}), instead. To convert an HDF5 file directly: "
            f"h5ngff convert {path}:/dataset out.ome.zarr",
        ) from None
    except OSError as exc:
        raise SpecError(
            "",
            f"Expected a readable {kind} manifest file. Got {path!r}, which cannot be read ({exc.strerror or exc}), instead.",
        ) from None
    except yaml.YAMLError as exc:
        raise SpecError("", f"Expected valid YAML in {path}. Got a syntax error instead: {exc}") from None
    found = [d for d in documents if isinstance(d, dict) and d.get("kind") in kinds]
    if not found:
        seen = [d.get("kind") if isinstance(d, dict) else type(d).__name__ for d in documents]
        raise SpecError(
            "kind", f"Expected a document with kind: {kind} in {path}. Got {seen or 'no documents'} instead."
        )
    return found[0]


def manifest_head(doc: dict[str, Any]) -> tuple[str, str | None]:
    """(name, namespace) of a manifest, its apiVersion checked."""
    api_version = doc.get("apiVersion")
    if api_version != API_VERSION:
        raise SpecError("apiVersion", f"Expected {API_VERSION}. Got {api_version!r} instead.")
    meta = doc.get("metadata")
    if not isinstance(meta, dict) or not isinstance(meta.get("name"), str) or not meta["name"]:
        raise SpecError("metadata.name", f"Expected a name, as Kubernetes requires. Got {meta!r} instead.")
    return meta["name"], meta.get("namespace")


def parse_spec_of(doc: dict[str, Any], parse: Callable[[Any], S]) -> S:
    """A manifest's ``.spec`` parsed by ``parse``; its errors name the field under ``spec.``."""
    try:
        return parse(doc.get("spec"))
    except SpecError as exc:
        message = str(exc)[len(exc.field) + 2 :] if exc.field else str(exc)
        raise SpecError(f"spec.{exc.field}" if exc.field else "spec", message) from None


def _is_hdf5(path: str) -> bool:
    with open(path, "rb") as f:
        return f.read(8) == b"\x89HDF\r\n\x1a\n"


def parse_manifest(doc: dict[str, Any], path: str = "<manifest>") -> JobManifest:
    return JobManifest(os.fspath(path), *manifest_head(doc), parse_spec_of(doc, parse_job_spec), doc)
