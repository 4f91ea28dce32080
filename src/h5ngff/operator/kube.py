"""The few Kubernetes API calls h5ngff makes outside kopf, on kubernetes_asyncio.

kopf watches and patches the ConversionJobs; creating Jobs, listing pods, deleting children and
the runner's status reports need a plain client. Both the operator and the runner pod use this
one, configured the same way: ``H5NGFF_KUBE_API`` (a URL, for tests and local development), else
the pod's service account, else the kubeconfig.

Errors become three kinds the callers can act on: ``None`` for 404 (already gone), ``Conflict``
for 409 (already exists, or a write race), and ``Transient`` for 429/5xx/network errors (retry
later). Everything else (401, 403, 422) is a real error and propagates as ``KubeError``.
"""

from __future__ import annotations

import json

import asyncio
import logging
import os
from dataclasses import dataclass
from typing import Any, Protocol

from kubernetes_asyncio import client, config

from kubernetes_asyncio.client.exceptions import ApiException

from .. import __version__

log = logging.getLogger(__name__)

API_ENV = "H5NGFF_KUBE_API"
MERGE_PATCH = "application/merge-patch+json"
#: Seconds a single API call may take before it counts as a transient failure.
REQUEST_TIMEOUT = 30


class KubeError(RuntimeError):
    def __init__(self, message: str, status: int | None = None, api_message: str | None = None):
        self.status = status
        #: The API server's own words (the ``message`` of its Status answer), for users to read.
        self.body_message = api_message or message
        super().__init__(message)


class Conflict(KubeError):
    pass


class Transient(KubeError):
    pass


@dataclass(frozen=True)
class KubeConfig:
    """Where the API is. ``url`` set = plain HTTP(S) without credentials (an emulator, a proxy)."""

    url: str | None = None

    @classmethod
    def from_env(cls) -> "KubeConfig":
        return cls(os.environ.get(API_ENV) or None)


async def api_client(cfg: KubeConfig, agent: str) -> client.ApiClient:
    if cfg.url:
        conf = client.Configuration(host=cfg.url.rstrip("/"))
        conf.verify_ssl = False
        api = client.ApiClient(conf)
    else:
        if os.environ.get("KUBERNETES_SERVICE_HOST"):
            config.load_incluster_config()  # type: ignore[no-untyped-call]  # unannotated in kubernetes_asyncio
        else:
            await config.load_kube_config()
        api = client.ApiClient()
    # Audit logs (and our tests) tell the operator's calls from the runner's by this.
    api.user_agent = agent
    return api


def _classify(exc: BaseException, what: str) -> KubeError:
    if isinstance(exc, ApiException):
        status = exc.status or 0
        text = f"{what}: HTTP {status} {exc.reason}"
        if status == 409:
            return Conflict(text, status)
        if status == 429 or status >= 500:
            return Transient(text, status)
        return KubeError(f"{text}: {str(exc.body or '')[:300]}", status, _status_message(exc.body))
    return Transient(f"{what}: {exc!r}")


def _status_message(body: Any) -> str | None:
    """The ``message`` of a Kubernetes Status answer (what kubectl prints), if the body is one."""
    try:
        message = json.loads(body).get("message") if body else None
    except (ValueError, AttributeError):
        return None
    return str(message)[:1000] if message else None


class KubeApi(Protocol):
    """What the controller and the runner's reporter call: ``Kube``, or an in-memory API in the
    property tests (tests/test_operator_invariants.py). 404 is None (get, create) or False
    (delete); 409 raises Conflict; 429, 5xx and no answer raise Transient."""

    async def get(self, path: str) -> dict[str, Any] | None: ...

    async def list(
        self, path: str, label_selector: dict[str, str] | None = None, field_selector: dict[str, str] | None = None
    ) -> list[dict[str, Any]]: ...

    async def create(self, path: str, body: dict[str, Any]) -> dict[str, Any] | None: ...

    async def delete(self, path: str) -> bool: ...

    async def patch_merge(self, path: str, patch: dict[str, Any]) -> dict[str, Any] | None: ...


class Kube:
    """Async facade: paths in, plain dicts out."""

    def __init__(self, api: client.ApiClient):
        self.api = api

    @classmethod
    async def connect(cls, cfg: KubeConfig | None = None, agent: str = "h5ngff") -> "Kube":
        return cls(await api_client(cfg or KubeConfig.from_env(), f"{agent}/{__version__}"))

    async def close(self) -> None:
        await self.api.close()

    async def _call(
        self,
        method: str,
        path: str,
        body: Any = None,
        query: list[tuple[str, str]] | None = None,
        content_type: str | None = None,
    ) -> Any:
        headers = {"Accept": "application/json"}
        if body is not None:
            headers["Content-Type"] = content_type or "application/json"
        try:
            return await self.api.call_api(
                path,
                method,
                query_params=query or [],
                header_params=headers,
                body=body,
                response_types_map={200: "object", 201: "object", 202: "object"},
                auth_settings=["BearerToken"],
                _return_http_data_only=True,
                _request_timeout=REQUEST_TIMEOUT,
            )
        except (ApiException, OSError, asyncio.TimeoutError) as exc:
            if isinstance(exc, ApiException) and exc.status == 404:
                return None
            raise _classify(exc, f"{method} {path}") from None

    async def get(self, path: str) -> dict[str, Any] | None:
        return _object(await self._call("GET", path), f"GET {path}")

    async def list(
        self, path: str, label_selector: dict[str, str] | None = None, field_selector: dict[str, str] | None = None
    ) -> list[dict[str, Any]]:
        query = [("labelSelector", ",".join(f"{k}={v}" for k, v in label_selector.items()))] if label_selector else []
        if field_selector:
            query.append(("fieldSelector", ",".join(f"{k}={v}" for k, v in field_selector.items())))
        result = await self._call("GET", path, query=query)
        items = (result or {}).get("items") or []
        # Filter here too: an API server (or emulator) that ignores the selector must not make us
        # touch another job's children.
        return [i for i in items if _has_labels(i, label_selector or {}) and _has_fields(i, field_selector or {})]

    async def create(self, path: str, body: dict[str, Any]) -> dict[str, Any] | None:
        """The object created (None: the API answered 404, e.g. no such namespace)."""
        return _object(await self._call("POST", path, body), f"POST {path}")

    async def delete(self, path: str) -> bool:
        """True if something was deleted, False if it was already gone."""
        result = await self._call("DELETE", path, {"propagationPolicy": "Background"})
        return result is not None

    async def patch_merge(self, path: str, patch: dict[str, Any]) -> dict[str, Any] | None:
        return _object(await self._call("PATCH", path, patch, content_type=MERGE_PATCH), f"PATCH {path}")


def _object(answer: object, what: str) -> dict[str, Any] | None:
    """An API answer that must be one JSON object (None: 404)."""
    if answer is None or isinstance(answer, dict):
        return answer
    raise KubeError(f"{what}: expected a JSON object. Got {type(answer).__name__} instead.")


def _has_labels(obj: dict[str, Any], wanted: dict[str, str]) -> bool:
    have = (obj.get("metadata") or {}).get("labels") or {}
    return all(have.get(k) == v for k, v in wanted.items())


def _has_fields(obj: dict[str, Any], wanted: dict[str, str]) -> bool:
    for path, value in wanted.items():
        node: Any = obj
        for part in path.split("."):
            node = node.get(part) if isinstance(node, dict) else None
        if node != value:
            return False
    return True


def namespaced(group_version: str, namespace: str, plural: str, name: str | None = None, sub: str | None = None) -> str:
    """``/apis/batch/v1/namespaces/ns/jobs/name`` (``/api/v1/...`` for the core group)."""
    root = "/api/v1" if group_version == "v1" else f"/apis/{group_version}"
    path = f"{root}/namespaces/{namespace}/{plural}"
    if name:
        path += f"/{name}"
    if sub:
        path += f"/{sub}"
    return path
