"""An S3-compatible bucket as a Store, through obstore (Rust's object_store; chosen by measurement,
docs/engine.md "Choosing the S3 client").

Credentials, region and endpoint come from the standard AWS chain: storage options (spec
``output.storageOptions``, CLI ``--storage-option KEY=VALUE``) first, then the environment
(``AWS_ACCESS_KEY_ID``, ``AWS_SECRET_ACCESS_KEY``, ``AWS_SESSION_TOKEN``,
``AWS_REGION``/``AWS_DEFAULT_REGION``, ``AWS_ENDPOINT_URL``, ``AWS_ALLOW_HTTP``), then a profile
of the shared AWS files (``awsconfig``: ``AWS_PROFILE`` or the ``profile`` option).

Its capabilities (engine.stores.base): no append (the manifest writes one object per batch),
conditional writes (the one-writer lease object, engine.stores.s3lease), no local path, and
``--overwrite`` replaces only an output of ours.

obstore's own retries are switched off: ``base.retrying`` retries here, so every retry is counted
(h5ngff_store_retries_total) and a permanent error (403, no such bucket) is never retried.
"""

from __future__ import annotations

import io
import os
import re
from contextlib import contextmanager
from functools import partial
from datetime import timedelta
from typing import (
    Any,
    BinaryIO,
    Callable,
    Collection,
    ContextManager,
    Iterable,
    Iterator,
    NoReturn,
    Sequence,
    TypeVar,
    cast,
)

import obstore
from obstore import exceptions as obx
from obstore.store import S3Store as _ObS3Store

from ...errors import CredentialsError, SpecError, StoreObjectChangedError, StoreRefusedError
from . import options as opts
from .awsconfig import resolve_chain
from .base import ConditionalWritesUnsupported, RetryPolicy, TransientStoreError, retrying
from .fetches import FetchWindow
from .uploads import UploadWindow

T = TypeVar("T")

#: Objects above this many bytes go up as a multipart upload (S3 caps one PUT at 5 GiB; parts
#: let a large shard's upload be retried part by part instead of whole).
MULTIPART_THRESHOLD = 64 * 2**20
#: Multipart part size: S3's minimum is 5 MiB (except the last part).
PART_SIZE = 16 * 2**20
#: Parts of one multipart upload in flight at once: the parts buffered per upload (memory plan).
PART_CONCURRENCY = 2
_STATUS = re.compile(r"\b(?:status(?: code)?:?\s*|HTTP/1\.1 )(\d{3})\b", re.I)
#: obstore asked the instance metadata service (the last link of the AWS chain) for credentials.
_METADATA_SERVICE = re.compile(r"169\.254\.169\.254|fd00:ec2::254|/latest/api/token|/latest/meta-data/iam")
_PERMANENT_CODES = (
    "AccessDenied",
    "NoSuchBucket",
    "InvalidAccessKeyId",
    "SignatureDoesNotMatch",
    "AllAccessDisabled",
    "InvalidBucketName",
    "InvalidRange",
)
_WHAT_TO_CHANGE = {
    "AccessDenied": "grant the credentials s3:PutObject, s3:GetObject, s3:ListBucket and s3:DeleteObject on the bucket, or use other credentials",
    "NoSuchBucket": "create the bucket or correct its name in output.path",
    "InvalidAccessKeyId": "check AWS_ACCESS_KEY_ID (or the Secret the job names)",
    "SignatureDoesNotMatch": "check AWS_SECRET_ACCESS_KEY (or the Secret the job names)",
}


def parse_options(options: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    """Split storage options into (S3 config, client options, ours), aliases resolved and values
    checked (stores.options: a bad one is a SpecError naming what is expected)."""
    opts.validate(options)
    config: dict[str, Any] = {}
    client: dict[str, Any] = {}
    own: dict[str, Any] = {}
    for raw, value in options.items():
        key = opts.canonical(raw)
        if key in opts.LEASE_KEYS:
            continue
        if key in opts.OWN_KEYS:
            own[key] = int(value)
        elif key in opts.CLIENT_KEYS:
            client[key] = _client_value(key, value)
        else:
            config[key] = value
    return config, client, own


def _client_value(key: str, value: Any) -> Any:
    if key.startswith("allow"):
        return opts.boolean(key, value)
    if key.endswith("timeout") and key != "pool_idle_timeout":
        return f"{round(opts.seconds(key, value) * 1000)}ms"  # obstore's duration syntax
    return value


def _env_client_options() -> dict[str, Any]:
    allow = os.environ.get("AWS_ALLOW_HTTP", "")
    return {"allow_http": True} if allow.lower() in ("1", "true", "yes") else {}


def _with_aws_chain(root: str, config: dict[str, Any]) -> tuple[dict[str, Any], Any]:
    """(obstore's S3 config, its credential provider or None): the explicit options, completed by
    the environment and the shared AWS files (awsconfig). Explicit options always win."""
    config = dict(config)
    profile = config.pop("profile", None)
    chain = resolve_chain(root, config, profile)
    if chain is None:  # no profile, no shared files: obstore reads the environment itself
        env_endpoint = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
        if "endpoint" not in config and env_endpoint:
            config["endpoint"] = env_endpoint
        return config, None
    for key, value in (("region", chain.region), ("endpoint", chain.endpoint)):
        if value and key not in config:
            config[key] = value
    return config, chain.credentials


def _refuse_plain_http(endpoint: str | None, client: dict[str, Any]) -> None:
    # obstore refuses an http:// endpoint only when it sends a request, as a "builder error" that
    # reads like a network fault (and would be retried): say what to change before any work.
    if endpoint and str(endpoint).lower().startswith("http://") and not client.get("allow_http"):
        raise SpecError(
            "output.storageOptions",
            f"Expected allow_http with the plain-http endpoint {endpoint!r}. Got no allow_http instead: "
            'export AWS_ALLOW_HTTP=true or pass --storage-option allow_http=true (storageOptions.allow_http: "true").',
        )


class S3Store:
    supports_append = False
    supports_conditional_writes = True
    overwrites_foreign_zarr = False
    #: No directory on this machine holds the objects (so no flock: a lease object instead).
    local_path: str | None = None

    def __init__(self, bucket: str, prefix: str, options: dict[str, Any] | None = None):
        self.bucket = bucket
        self.prefix = prefix.strip("/")
        self.root = f"s3://{bucket}/{self.prefix}" if self.prefix else f"s3://{bucket}"
        config, client, own = parse_options(options or {})
        self.multipart_threshold = own.get("multipart_threshold", MULTIPART_THRESHOLD)
        self.part_size = max(5 * 2**20, own.get("part_size", PART_SIZE))
        self.policy = RetryPolicy(attempts=own.get("retries", RetryPolicy.attempts))
        client = {
            **_env_client_options(),
            "connect_timeout": f"{opts.CONNECT_TIMEOUT_S:.0f}s",
            "timeout": f"{opts.TIMEOUT_S:.0f}s",
            **client,
        }
        config, provider = _with_aws_chain(self.root, config)
        _refuse_plain_http(config.get("endpoint"), client)
        try:
            # The options are the user's KEY=VALUE strings: obstore checks them (raising the error
            # below), so the TypedDicts of its stubs cannot be met statically: passed untyped.
            user_options: dict[str, Any] = {"config": config, "client_options": client}
            self._store = _ObS3Store(
                bucket,
                prefix=self.prefix or None,
                retry_config={"max_retries": 0, "retry_timeout": timedelta(seconds=1)},
                credential_provider=provider,
                **user_options,
            )
        except obx.BaseError as exc:
            raise SpecError(
                "output.storageOptions",
                f"Expected S3 options obstore knows (endpoint, region, allow_http, access_key_id, ...). Got {sorted(options or {})} instead: {str(exc).strip().splitlines()[0]}",
            ) from None
        self._uploads = UploadWindow(bucket)
        self._fetches = FetchWindow(bucket)

    def as_zarr_store(self) -> Any:
        """zarr-python's read-only view of the same prefix, over this client (same endpoint,
        credentials and options): what verify reads through, so it shares no code with the writer
        beyond the connection."""
        from zarr.storage import ObjectStore

        return ObjectStore(self._store, read_only=True)

    @classmethod
    def from_url(cls, url: str, options: dict[str, Any]) -> "S3Store":
        scheme, _, rest = url.partition("://")
        bucket, _, prefix = rest.partition("/")
        if not bucket:
            raise SpecError(
                "output.path",
                "Expected s3://BUCKET/PREFIX with a bucket name. Got an s3:// URL with no bucket name instead: write s3://my-bucket/out.ome.zarr; nothing was written.",
            )
        return cls(bucket, prefix, options)

    def __reduce__(self) -> NoReturn:  # a Dask task may carry it: rebuild the client on the other side
        raise TypeError("S3Store is per process; pass the URL and options instead")

    # -- errors --------------------------------------------------------------------------------
    def _classify(self, what: str) -> Callable[[BaseException], Exception]:
        def classify(exc: BaseException) -> Exception:
            if isinstance(exc, (_Missing, _Conflict)):
                return exc
            if isinstance(exc, (obx.AlreadyExistsError, obx.PreconditionError)):
                return _Conflict()
            text = str(exc)
            if _METADATA_SERVICE.search(text):
                return CredentialsError(no_credentials_message(what, self.root, text))
            code = next((c for c in _PERMANENT_CODES if c in text), None)
            status = _STATUS.search(text)
            if (
                isinstance(exc, (obx.PermissionDeniedError, obx.UnauthenticatedError))
                or code
                or (status and status.group(1) in ("400", "401", "403", "404", "405", "416"))
            ):
                code = code or (
                    "AccessDenied"
                    if isinstance(exc, obx.PermissionDeniedError) or (status and status.group(1) == "403")
                    else "request refused"
                )
                hint = _WHAT_TO_CHANGE.get(code, "check the bucket, the endpoint and the credentials")
                first = text.strip().splitlines()[0][:300] if text.strip() else type(exc).__name__
                return StoreRefusedError(
                    f"{what}: {self.root} refused the request ({code}): {first}. To fix: {hint}.", code, first
                )
            return TransientStoreError(text.strip().splitlines()[0][:200] if text.strip() else type(exc).__name__)

        return classify

    def _call(self, what: str, call: Callable[[], T]) -> T:
        return retrying(call, what, self.policy, self._classify(what))

    # -- the protocol --------------------------------------------------------------------------
    def overlapped(self, depth: int) -> ContextManager[None]:
        """Within the block, this thread's PUTs (``put``, ``writer``) overlap its work, at most
        ``depth`` in flight (engine.stores.uploads); all are stored when the block exits."""
        return self._uploads.open(depth)

    def put(self, key: str, data: bytes | memoryview | Iterable[bytes], sync: bool = False) -> int:
        # ``sync`` needs nothing here: an acknowledged PUT is durable. It is also never overlapped:
        # a synced object (metadata, a marker) is one the caller must know is stored on return.
        if not isinstance(data, (bytes, bytearray, memoryview)):
            data = b"".join(data)
        n = len(data)
        if sync:
            self._put_now(key, data)
        else:
            self._uploads.submit(lambda: self._put_now(key, data))  # at once outside a window
        return n

    def _put_now(self, key: str, data: bytes | bytearray | memoryview) -> None:
        n = len(data)
        if n <= self.multipart_threshold:
            self._call(f"PUT {key}", lambda: obstore.put(self._store, key, data, use_multipart=False))
        else:
            # A failed multipart upload is retried whole from the held buffer; obstore aborts the
            # failed upload (tests/test_s3_store.py lists the bucket's uploads to check).
            self._call(
                f"multipart PUT {key}",
                lambda: obstore.put(
                    self._store,
                    key,
                    io.BytesIO(data),
                    use_multipart=True,
                    chunk_size=self.part_size,
                    max_concurrency=PART_CONCURRENCY,
                ),
            )

    @contextmanager
    def writer(self, key: str, sync: bool = False) -> Iterator[BinaryIO]:
        """Buffer the object in memory (the upload buffer of the memory plan) and PUT it whole
        once the block exits cleanly; nothing is sent if it raises. A PUT is atomic: a reader
        sees the old object or the new one, so there is no temporary name."""
        buffer = io.BytesIO()
        yield buffer
        self.put(key, buffer.getbuffer())

    def get(self, key: str) -> bytes:
        try:
            return bytes(self._call(f"GET {key}", lambda: _get_or_missing(self._store, key)))
        except _Missing:
            raise KeyError(key) from None

    def get_suffix(self, key: str, length: int) -> tuple[bytes, int]:
        """One ranged GET (``bytes=-length``): the tail and, from the response, the object's size."""
        try:
            body, size = self._call(
                f"GET {key} (last {length} bytes)", lambda: _suffix_or_missing(self._store, key, length)
            )
        except _Missing:
            raise KeyError(key) from None
        return bytes(body), size

    def get_ranges(self, key: str, ranges: Sequence[tuple[int, int]]) -> Iterator[bytes]:
        """The ranges in one call (obstore coalesces nearby ranges into few GETs): a request per
        inner chunk would cost more than the bytes. Held together, they are at most the object."""
        ranges = list(ranges)
        if not ranges:
            return iter(())
        starts, lengths = [r[0] for r in ranges], [r[1] for r in ranges]
        try:
            parts = self._call(
                f"GET {key} ({len(ranges)} ranges)", lambda: _ranges_or_missing(self._store, key, starts, lengths)
            )
        except _Missing:
            raise KeyError(key) from None
        return (bytes(part) for part in parts)

    def head(self, key: str) -> tuple[int, str]:
        """(size, ETag) of an object (a source's identity); KeyError if it is absent."""
        try:
            meta = self._call(f"HEAD {key}", lambda: _head_or_missing(self._store, key))
        except _Missing:
            raise KeyError(key) from None
        return int(meta["size"]), str(meta.get("e_tag") or "")

    def fetch(
        self, key: str, ranges: Sequence[tuple[int, int]], in_flight: int = 1, etag: str | None = None
    ) -> Iterator[bytes]:
        """The byte ranges ``(start, length)`` of ``key``, one GET each, at most ``in_flight`` at
        once (engine.stores.fetches), in order. With ``etag``, each GET is pinned to that object
        (If-Match): a replaced object raises StoreObjectChangedError rather than mixing two
        objects' bytes. A range past the object's end raises StoreRefusedError (code
        ``Truncated``); a missing object KeyError."""

        def get(start: int, length: int) -> bytes:
            what = f"GET {key} (bytes {start}-{start + length - 1})"
            try:
                body: bytes = self._call(what, lambda: _range_or_missing(self._store, key, start, length, etag))
            except _Missing:
                raise KeyError(key) from None
            except _Conflict:
                raise StoreObjectChangedError(
                    f"{what}: {self.root}/{key} is no longer the object of ETag {etag}: it was replaced while it was read."
                ) from None
            if len(body) != length:
                raise StoreRefusedError(
                    f"{what}: {self.root}/{key} ends before byte {start + length} ({len(body)} of {length} bytes came back).",
                    "Truncated",
                    f"{len(body)} of {length} bytes",
                )
            return body

        return self._fetches.fetch(get, ranges, in_flight)

    def size(self, key: str) -> int | None:
        try:
            return int(self._call(f"HEAD {key}", lambda: _head_or_missing(self._store, key))["size"])
        except _Missing:
            return None

    def list(self, prefix: str = "") -> dict[str, int]:
        def run() -> dict[str, int]:
            out: dict[str, int] = {}
            for batch in obstore.list(self._store, prefix=prefix.rstrip("/") or None, chunk_size=1000):
                for meta in batch:
                    if meta["path"].startswith(prefix):
                        out[meta["path"]] = int(meta["size"])
            return out

        return self._call(f"LIST {prefix or '/'}", run)

    def append(self, key: str, data: bytes, sync: bool = False) -> None:
        raise OSError(
            f"{self.root}: an object store has no append (supports_append is False); write one object per batch instead"
        )

    def occupied(self, ignore: Collection[str] = ()) -> bool:
        return bool(set(self.list("")) - set(ignore))

    def check_creatable(self) -> None:
        """Nothing to create: the listing that found the prefix empty proved the bucket readable
        (a 403 or a missing bucket fails there, before any cluster starts)."""

    def leftovers(self) -> tuple[str, ...]:
        return ()  # see sweep

    def delete(self, key: str) -> None:
        self._call(f"DELETE {key}", lambda: obstore.delete(self._store, key))  # S3 deletes a missing key without error

    def sweep(self) -> int:
        return 0  # a PUT is whole and a failed multipart upload is aborted: nothing is left behind

    def delete_prefix(self, prefix: str, keep: Collection[str] = ()) -> int:
        keys = sorted(set(self.list(prefix)) - set(keep))
        for i in range(0, len(keys), 1000):  # S3's DeleteObjects takes at most 1000 keys
            batch = keys[i : i + 1000]
            self._call(
                f"DELETE {len(batch)} objects under {prefix or '/'}", partial(obstore.delete, self._store, batch)
            )
        return len(keys)

    # -- conditional writes: the one-writer lease (engine.stores.s3lease) ------------------------------
    def create(self, key: str, data: bytes, policy: RetryPolicy | None = None) -> str | None:
        """PUT only if ``key`` is absent (If-None-Match: *): the new ETag, or None if it exists."""
        return self._conditional(f"PUT {key} (If-None-Match)", key, data, "create", policy)

    def replace(self, key: str, data: bytes, etag: str, policy: RetryPolicy | None = None) -> str | None:
        """PUT only if ``key``'s ETag is still ``etag`` (If-Match): the new ETag, or None if the
        object changed or is gone."""
        return self._conditional(f"PUT {key} (If-Match)", key, data, {"e_tag": etag}, policy)

    def _conditional(self, what: str, key: str, data: bytes, mode: Any, policy: RetryPolicy | None) -> str | None:
        plain = self._classify(what)

        def classify(exc: BaseException) -> Exception:
            text = str(exc)
            if (
                isinstance(exc, obx.NotSupportedError)
                or "NotImplemented" in text
                or re.search(r"status(?: code)?:?\s*501\b", text)
            ):
                return ConditionalWritesUnsupported(
                    text.strip().splitlines()[0][:300] if text.strip() else type(exc).__name__
                )
            return plain(exc)

        try:
            result = retrying(
                lambda: obstore.put(self._store, key, data, mode=mode, use_multipart=False),
                what,
                policy or self.policy,
                classify,
            )
        except _Conflict:
            return None
        if not result.get("e_tag"):
            raise ConditionalWritesUnsupported(f"{what}: the store returned no ETag")
        return result["e_tag"]

    def get_tagged(self, key: str, policy: RetryPolicy | None = None) -> tuple[bytes, str] | None:
        """The object's bytes and ETag, or None if it is absent."""

        def run() -> tuple[bytes, str]:
            try:
                result = obstore.get(self._store, key)
            except (obx.NotFoundError, FileNotFoundError):
                raise _Missing from None
            etag: Any = result.meta["e_tag"]  # S3 always sends one (a store that does not is refused at create)
            return bytes(result.bytes()), etag

        try:
            return retrying(run, f"GET {key}", policy or self.policy, self._classify(f"GET {key}"))
        except _Missing:
            return None


def no_credentials_message(what: str, root: str, text: str) -> str:
    first = text.strip().splitlines()[0][:200] if text.strip() else ""
    return (
        f"{what}: no AWS credentials were found for {root}. They are looked for in the storage options (access_key_id and "
        f"secret_access_key, or profile), the environment (AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, AWS_SESSION_TOKEN, "
        f"AWS_PROFILE, AWS_WEB_IDENTITY_TOKEN_FILE), the shared files (~/.aws/credentials and ~/.aws/config, or "
        f"AWS_SHARED_CREDENTIALS_FILE and AWS_CONFIG_FILE), and last the instance metadata service, which did not give any "
        f"({first}). To fix: export AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, or set AWS_PROFILE to a profile that has them."
    )


class _Missing(Exception):
    pass


class _Conflict(Exception):
    """412 Precondition Failed (or obstore's AlreadyExists for If-None-Match)."""


def _get_or_missing(store: Any, key: str) -> Any:
    try:
        return obstore.get(store, key).bytes()
    except (obx.NotFoundError, FileNotFoundError):
        raise _Missing from None


def _suffix_or_missing(store: Any, key: str, length: int) -> tuple[Any, int]:
    # The body is read inside the retried call: it is what a reset connection loses.
    try:
        result = obstore.get(store, key, options={"range": {"suffix": length}})
        return result.bytes(), int(result.meta["size"])
    except (obx.NotFoundError, FileNotFoundError):
        raise _Missing from None


def _ranges_or_missing(store: Any, key: str, starts: list[int], lengths: list[int]) -> Any:
    try:
        return obstore.get_ranges(store, key, starts=starts, lengths=lengths)
    except (obx.NotFoundError, FileNotFoundError):
        raise _Missing from None


def _range_or_missing(store: Any, key: str, start: int, length: int, etag: str | None) -> bytes:
    # The body is read inside the retried call: it is what a reset connection loses. It stays
    # obstore's buffer (no copy): the readers take it through the buffer protocol.
    options: dict[str, Any] = {"range": (start, start + length)}
    if etag:
        options["if_match"] = etag
    try:
        # obstore.Bytes: a read-only buffer, as bytes are to every reader here.
        return cast(bytes, obstore.get(store, key, options=options).bytes())  # type: ignore[arg-type]
    except (obx.NotFoundError, FileNotFoundError):
        raise _Missing from None


def _head_or_missing(store: Any, key: str) -> Any:
    try:
        return obstore.head(store, key)
    except (obx.NotFoundError, FileNotFoundError):
        raise _Missing from None
