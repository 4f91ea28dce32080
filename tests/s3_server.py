"""A real S3 HTTP endpoint on loopback (moto's server mode, as s3fs's and zarr-python's own tests
use), and a tiny fault-injecting proxy in front of it. Nothing here is a mock of our code: the
engine talks HTTP to these exactly as it would to MinIO or AWS."""

from __future__ import annotations

import http.client
import logging
import socket
import threading
import time
import uuid
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

REGION = "us-east-1"
CREDENTIALS = {"access_key_id": "h5ngff-test", "secret_access_key": "h5ngff-test-secret", "region": REGION}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class S3Endpoint:
    url: str
    server: object

    def options(self, endpoint: str | None = None) -> dict[str, str]:
        """Storage options for h5ngff (its spec's output.storageOptions)."""
        return {"endpoint": endpoint or self.url, "allow_http": "true", **CREDENTIALS}

    def client(self):
        import botocore.session

        return botocore.session.get_session().create_client(
            "s3",
            endpoint_url=self.url,
            region_name=REGION,
            aws_access_key_id=CREDENTIALS["access_key_id"],
            aws_secret_access_key=CREDENTIALS["secret_access_key"],
        )

    def new_bucket(self) -> str:
        name = f"b-{uuid.uuid4().hex[:12]}"
        self.client().create_bucket(Bucket=name)
        return name

    def keys(self, bucket: str, prefix: str = "") -> dict[str, bytes]:
        c = self.client()
        out = {}
        for page in c.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix):
            for obj in page.get("Contents", []):
                out[obj["Key"]] = c.get_object(Bucket=bucket, Key=obj["Key"])["Body"].read()
        return out

    def env(self) -> dict[str, str]:
        """The AWS environment that points s3fs/botocore readers (ome-zarr-py, ngff-zarr) here."""
        return {
            "AWS_ENDPOINT_URL": self.url,
            "AWS_ACCESS_KEY_ID": CREDENTIALS["access_key_id"],
            "AWS_SECRET_ACCESS_KEY": CREDENTIALS["secret_access_key"],
            "AWS_DEFAULT_REGION": REGION,
            "AWS_REGION": REGION,
            "AWS_ALLOW_HTTP": "true",
        }


def start_moto() -> S3Endpoint:
    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # one line per request otherwise
    port = free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    return S3Endpoint(f"http://127.0.0.1:{port}", server)


@dataclass
class Faults:
    """What the proxy does to the next requests: each rule is (method or None, action, count)."""

    rules: list[list] = field(default_factory=list)
    seen: list[tuple[str, str, str]] = field(default_factory=list)
    #: Every request the proxy received: (method, path, Range header or None).
    requests: list[tuple[str, str, str | None]] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def add(self, action: str, count: int, method: str | None = None, path_contains: str = "") -> None:
        with self.lock:
            self.rules.append([method, path_contains, action, count])

    def take(self, method: str, path: str) -> str | None:
        with self.lock:
            for rule in self.rules:
                m, part, action, count = rule
                if count > 0 and (m is None or m == method) and part in path:
                    rule[3] -= 1
                    self.seen.append((method, path, action))
                    return action
        return None

    def injected(self, action: str) -> int:
        with self.lock:
            return sum(1 for _, _, a in self.seen if a == action)


class FaultProxy:
    """A loopback HTTP proxy to the moto server that answers some requests itself: ``503`` (S3's
    SlowDown), ``reset`` (the connection closed with no response), ``403`` (AccessDenied) or ``501``
    (NotImplemented: what a store without conditional writes answers to If-None-Match); or
    forwards them late: ``delay:SECONDS`` (a distant endpoint's round trip)."""

    def __init__(self, upstream: str):
        host, port = upstream.removeprefix("http://").split(":")
        self.faults = Faults()
        faults = self.faults

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):
                pass

            def _handle(self):
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                with faults.lock:
                    faults.requests.append((self.command, self.path, self.headers.get("Range")))
                action = faults.take(self.command, self.path)
                if action and action.startswith("delay:"):
                    time.sleep(float(action.split(":", 1)[1]))
                    action = None
                if action == "reset":
                    self.close_connection = True
                    self.connection.shutdown(socket.SHUT_RDWR)
                    return
                if action in ("503", "403", "501"):
                    code, text = {
                        "503": ("SlowDown", "Please reduce your request rate."),
                        "403": ("AccessDenied", "Access Denied"),
                        "501": (
                            "NotImplemented",
                            "A header you provided implies functionality that is not implemented.",
                        ),
                    }[action]
                    payload = f'<?xml version="1.0" encoding="UTF-8"?><Error><Code>{code}</Code><Message>{text}</Message></Error>'.encode()
                    self.send_response(int(action))
                    self.send_header("Content-Type", "application/xml")
                    self.send_header("Content-Length", str(len(payload)))
                    self.end_headers()
                    self.wfile.write(payload)
                    return
                conn = http.client.HTTPConnection(host, int(port), timeout=60)
                headers = {k: v for k, v in self.headers.items() if k.lower() not in ("connection",)}
                conn.request(self.command, self.path, body=body, headers=headers)
                resp = conn.getresponse()
                data = resp.read()
                self.send_response(resp.status)
                for k, v in resp.getheaders():
                    if k.lower() not in ("transfer-encoding", "connection", "content-length", "server", "date"):
                        self.send_header(k, v)
                # A HEAD answer has no body but the object's length: sizes come from it.
                self.send_header(
                    "Content-Length",
                    resp.getheader("Content-Length", "0") if self.command == "HEAD" else str(len(data)),
                )
                self.end_headers()
                self.wfile.write(data)
                conn.close()

            do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _handle

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> "FaultProxy":
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()
