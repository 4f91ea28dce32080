"""The image's HEALTHCHECK: probe the health endpoint of whatever the container runs.

One image runs the operator, the runner and the Dask pods, so the check looks at PID 1's command
line (after tini's ``--``):

* ``h5ngff operator --liveness URL``: kopf's liveness endpoint, URL;
* ``dask scheduler`` / ``dask worker``: Dask's ``/health`` on the dashboard port;
* anything else (the runner, a one-shot CLI command) serves nothing: healthy while it runs.

Standard library only: it runs in the image's Python with nothing imported from h5ngff.
"""

from __future__ import annotations

import sys
import urllib.request
from urllib.parse import urlsplit, urlunsplit

#: Dask's default dashboard port of a scheduler (a worker's is random unless given).
SCHEDULER_DASHBOARD = 8787


def _option(argv: list[str], name: str) -> str | None:
    for i, arg in enumerate(argv):
        if arg == name and i + 1 < len(argv):
            return argv[i + 1]
        if arg.startswith(name + "="):
            return arg.split("=", 1)[1]
    return None


def _local(url: str) -> str:
    """A listen address (0.0.0.0, ::) is not a destination: probe the loopback instead."""
    parts = urlsplit(url)
    host = parts.hostname or "127.0.0.1"
    if host in ("0.0.0.0", "::", ""):
        netloc = "127.0.0.1" + (f":{parts.port}" if parts.port else "")
        parts = parts._replace(netloc=netloc)
    return urlunsplit(parts)


def _dashboard_port(address: str | None, default: int | None) -> int | None:
    if not address:
        return default
    port = address.rsplit(":", 1)[-1]
    return int(port) if port.isdigit() and int(port) > 0 else None


def target_url(argv: list[str]) -> str | None:
    """The URL to probe for a container whose PID 1 runs ``argv``, or None if nothing serves."""
    if "--" in argv[:2] and argv[0].endswith("tini"):
        argv = argv[argv.index("--") + 1:]
    if argv and argv[0].rsplit("/", 1)[-1].startswith("python"):  # a console script run via its shebang
        argv = argv[1:]
    names = [a.rsplit("/", 1)[-1] for a in argv[:2]]
    if names[:2] == ["h5ngff", "operator"]:
        url = _option(argv, "--liveness")
        return _local(url) if url else None
    if names[:1] == ["dask"] and len(names) > 1 and names[1] in ("scheduler", "worker"):
        default = SCHEDULER_DASHBOARD if names[1] == "scheduler" else None
        port = _dashboard_port(_option(argv, "--dashboard-address"), default)
        return f"http://127.0.0.1:{port}/health" if port else None
    return None


def pid1_argv() -> list[str]:
    with open("/proc/1/cmdline", "rb") as f:
        return [a.decode(errors="replace") for a in f.read().split(b"\0") if a]


def check(argv: list[str]) -> int:
    """0 if the process ``argv`` serves nothing or its endpoint answers 2xx, else 1."""
    url = target_url(argv)
    if url is None:
        return 0
    try:
        with urllib.request.urlopen(url, timeout=4) as response:
            ok = 200 <= response.status < 300
    except OSError as exc:
        print(f"unhealthy: {url}: {exc}", file=sys.stderr)
        return 1
    if not ok:
        print(f"unhealthy: {url} answered {response.status}", file=sys.stderr)
    return 0 if ok else 1


def main() -> int:
    return check(pid1_argv())


if __name__ == "__main__":
    sys.exit(main())
