"""Storage options of an ``s3://`` output, checked before any client exists (no obstore import):
a mistyped name, a bad number or a non-boolean is refused with exit 2 (SpecError) and the valid
names, never passed on to obstore (whose errors are Rust Debug text) or silently ignored.

The request bound (docs/engine.md, "Stores"): each request gives up after ``timeout`` (default
``TIMEOUT_S``); a failed request is retried with backoff up to ``retries`` attempts, but no new
attempt starts ``RETRY_DEADLINE_S`` after the first one was sent. A request therefore fails within
``worst_case_seconds()`` (under 2 minutes with the defaults), with a notice on stderr per retry.
"""

from __future__ import annotations

import difflib
import re
from typing import Any, Callable, Mapping

from ...errors import SpecError
from ...spec import UPLOADS_IN_FLIGHT

#: Options of the HTTP client rather than of S3 (obstore's ClientConfig).
CLIENT_KEYS = {
    "allow_http",
    "allow_invalid_certificates",
    "connect_timeout",
    "timeout",
    "pool_idle_timeout",
    "pool_max_idle_per_host",
    "proxy_url",
    "user_agent",
}
#: Our own options: when to switch to a multipart upload, its part size, retries, and the PUTs a
#: thread keeps in flight (read by the planner, which counts them: planner/plan.py upload_depth_for).
OWN_KEYS = {"multipart_threshold", "part_size", "retries", UPLOADS_IN_FLIGHT}
#: The one-writer lease's options: read by engine.stores.s3lease, not by the client.
LEASE_KEYS = {"lock", "lock_ttl"}
#: Friendly aliases (the names s3fs and the AWS CLI use) -> obstore's keys.
ALIASES = {
    "endpoint_url": "endpoint",
    "aws_endpoint_url": "endpoint",
    "region_name": "region",
    "key": "access_key_id",
    "secret": "secret_access_key",
    "token": "session_token",
    "aws_profile": "profile",
}
#: obstore 0.12's S3 configuration keys (its S3Config; the pinned version of the ``s3`` extra).
S3_KEYS = {
    "access_key_id",
    "bucket",
    "checksum_algorithm",
    "conditional_put",
    "container_credentials_relative_uri",
    "container_credentials_full_uri",
    "container_authorization_token_file",
    "copy_if_not_exists",
    "default_region",
    "disable_tagging",
    "disable_bulk_delete",
    "endpoint",
    "imdsv1_fallback",
    "metadata_endpoint",
    "region",
    "request_payer",
    "role_arn",
    "role_session_name",
    "secret_access_key",
    "server_side_encryption",
    "session_token",
    "skip_signature",
    "sse_bucket_key_enabled",
    "sse_kms_key_id",
    "sts_endpoint",
    "unsigned_payload",
    "virtual_hosted_style_request",
    "web_identity_token_file",
    "s3_express",
    "profile",
}
VALID = S3_KEYS | CLIENT_KEYS | OWN_KEYS | LEASE_KEYS | set(ALIASES)
#: Seconds one request may take (connecting included) before it is given up and retried.
TIMEOUT_S = 30.0
#: Seconds to connect before giving up on that attempt.
CONNECT_TIMEOUT_S = 5.0
#: No retry starts this many seconds after a request's first attempt was sent.
RETRY_DEADLINE_S = 80.0
#: Attempts per request, the first included (``retries``).
ATTEMPTS = 8
_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")
_DURATION = re.compile(r"\s*([0-9]+(?:\.[0-9]+)?)\s*(ms|s|m|min)?\s*", re.I)


def canonical(raw: str) -> str:
    """An option's name as the store reads it: lower case, aliases resolved, ``aws_`` dropped."""
    key = ALIASES.get(raw.lower(), raw.lower())
    if key.startswith("aws_") and key[4:] in VALID:
        key = key[4:]
    return key


def _refuse(key: str, expected: str, value: Any) -> SpecError:
    return SpecError("output.storageOptions", f"Expected {key} to be {expected}. Got {value!r} instead.")


def boolean(key: str, value: Any) -> bool:
    text = str(value).strip().lower()
    if text in _TRUE or text in _FALSE:
        return text in _TRUE
    raise _refuse(key, "true or false", value)


def whole(key: str, value: Any, low: int) -> int:
    if not re.fullmatch(r"\s*[0-9]+\s*", str(value)) or int(value) < low:
        raise _refuse(key, f"a whole number of at least {low}", value)
    return int(value)


def seconds(key: str, value: Any) -> float:
    """A duration (``30``, ``30s``, ``1500ms``, ``2m``) in seconds."""
    m = _DURATION.fullmatch(str(value))
    if not m or float(m.group(1)) <= 0:
        raise _refuse(key, "a positive duration such as 30s, 1500ms or 2m", value)
    scale = {"ms": 0.001, "m": 60.0, "min": 60.0}.get((m.group(2) or "s").lower(), 1.0)
    return float(m.group(1)) * scale


def lock_ttl(value: Any) -> float:
    try:
        ttl = float(value)
    except (TypeError, ValueError):
        ttl = -1.0
    if not 1.0 <= ttl <= 3600.0:
        raise _refuse("lock_ttl", "seconds between 1 and 3600", value)
    return ttl


def _unknown(raw: str) -> SpecError:
    close = difflib.get_close_matches(canonical(raw), sorted(VALID), n=1, cutoff=0.6)
    hint = f" Did you mean {close[0]}?" if close else ""
    return SpecError(
        "output.storageOptions",
        f"Expected one of the storage options {', '.join(sorted(VALID))}. Got {raw!r} instead.{hint}",
    )


_CHECKS: dict[str, Callable[[str, Any], object]] = {
    "retries": lambda k, v: whole(k, v, 1),
    "multipart_threshold": lambda k, v: whole(k, v, 1),
    "part_size": lambda k, v: whole(k, v, 1),
    "lock": boolean,
    "allow_http": boolean,
    "allow_invalid_certificates": boolean,
    "timeout": seconds,
    "connect_timeout": seconds,
    "lock_ttl": lambda k, v: lock_ttl(v),
}


def validate(options: Mapping[str, Any] | None) -> None:
    """Raise SpecError (exit 2) for an unknown name or a value its option cannot take."""
    for raw, value in (options or {}).items():
        key = canonical(raw)
        if key not in VALID:
            raise _unknown(raw)
        check = _CHECKS.get(key)
        if check is not None:
            check(key, value)


def timeouts(options: Mapping[str, Any] | None) -> tuple[float, float]:
    """(request timeout, connect timeout) in seconds from the options, or the defaults."""
    opts = {canonical(k): v for k, v in (options or {}).items()}
    request = seconds("timeout", opts["timeout"]) if "timeout" in opts else TIMEOUT_S
    connect = seconds("connect_timeout", opts["connect_timeout"]) if "connect_timeout" in opts else CONNECT_TIMEOUT_S
    return request, connect


def worst_case_seconds(options: Mapping[str, Any] | None = None) -> float:
    """The longest one request with its retries can take: the last attempt starts before the
    deadline, then runs at most one request timeout (its connect included)."""
    return RETRY_DEADLINE_S + timeouts(options)[0]
