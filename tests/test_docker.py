"""docker/Dockerfile, checked with BuildKit's own parser (PyPI ``dockerfile``): there is no Docker
engine here, so the image is never built in these tests (docs/deployment.md says so).

What must hold: a pinned slim base, a multi-stage build that installs h5ngff from its wheel with
the kubernetes extra, jemalloc installed and preloaded with h5ngff's MALLOC_CONF, a non-root user,
a HEALTHCHECK, and an entrypoint that runs its arguments as the command (the chart's Deployment
and h5ngff's Dask pods pass only ``args``). Each check has a negative control on edited text.
The jemalloc settings are also tried for real: the MALLOC_CONF string is accepted by Debian's
libjemalloc2 (``abort_conf`` would abort on a bad option), and the healthcheck script probes a
real HTTP endpoint.
"""

from __future__ import annotations

import fnmatch
import http.server
import os
import re
import subprocess
import sys
import threading
from pathlib import Path

import dockerfile
import pytest

from h5ngff.backends.allocator import JEMALLOC_CONF, JEMALLOC_PATHS
from h5ngff.backends.kubernetes import build_scheduler_pod_spec, build_worker_container

ROOT = Path(__file__).resolve().parents[1]
DOCKERFILE = ROOT / "docker" / "Dockerfile"
sys.path.insert(0, str(ROOT / "docker"))
import healthcheck  # noqa: E402

#: An exact Python patch release of a slim image, or any image pinned by digest.
PINNED = re.compile(r"^(python:\d+\.\d+\.\d+-slim(-\w+)?(@sha256:[0-9a-f]{64})?|[^@\s]+@sha256:[0-9a-f]{64})$")


def _args(text: str) -> dict[str, str]:
    """Global ARG defaults (before the first FROM), which FROM lines may use."""
    out = {}
    for cmd in dockerfile.parse_string(text):
        if cmd.cmd == "FROM":
            break
        if cmd.cmd == "ARG" and "=" in cmd.value[0]:
            key, _, value = cmd.value[0].partition("=")
            out[key] = value
    return out


def _stages(text: str) -> list[list[dockerfile.Command]]:
    stages: list[list] = []
    for cmd in dockerfile.parse_string(text):
        if cmd.cmd == "FROM":
            stages.append([])
        if stages:
            stages[-1].append(cmd)
    return stages


def _env(stage: list) -> dict[str, str]:
    env = {}
    for cmd in stage:
        if cmd.cmd == "ENV":
            pairs = cmd.value
            env.update({pairs[i]: pairs[i + 1].strip('"') for i in range(0, len(pairs), 2)})
    return env


def _base(cmd, args: dict[str, str]) -> str:
    return re.sub(r"\$\{?(\w+)\}?", lambda m: args.get(m.group(1), m.group(0)), cmd.value[0])


def problems(text: str) -> list[str]:
    """Everything wrong with a Dockerfile's text, by the rules above; [] when all hold."""
    out = []
    args, stages = _args(text), _stages(text)
    if len(stages) < 2:
        return ["not multi-stage"]
    builder, final = stages[0], stages[-1]
    for stage in stages:
        base = _base(stage[0], args)
        if not PINNED.match(base):
            out.append(f"base not pinned: {base}")
    runs = [" ".join(c.value) for c in final if c.cmd == "RUN"]
    builder_runs = " ".join(" ".join(c.value) for c in builder if c.cmd == "RUN")
    if "pip wheel" not in builder_runs:
        out.append("the builder builds no wheel")
    elif "-c requirements/lock.txt" not in builder_runs:
        # the memory model's constants were measured with the locked versions
        out.append("the builder does not pin the locked versions")
    install = [(c, " ".join(c.value)) for c in final if c.cmd == "RUN" and "pip install" in " ".join(c.value)]
    from_builder = [c for c, _ in install if any("from=builder" in f for f in c.flags)] + [
        c for c in final if c.cmd == "COPY" and "--from=builder" in c.flags
    ]
    if (
        not install
        or not from_builder
        or not any("--no-index" in t and '"h5ngff[kubernetes,s3]"' in t for _, t in install)
    ):
        out.append("h5ngff[kubernetes] is not installed from the builder's wheels")
    if not any(re.search(r"apt-get install[^&]*\blibjemalloc2\b", r) for r in runs):
        out.append("libjemalloc2 is not installed")
    env = _env(final)
    preload = env.get("LD_PRELOAD", "")
    # the preloaded file is jemalloc, at a path a RUN step creates or Debian's package installs
    if not preload.endswith("libjemalloc.so.2") or not (any(preload in r for r in runs) or preload in JEMALLOC_PATHS):
        out.append(f"jemalloc is not preloaded: LD_PRELOAD={preload!r}")
    if env.get("H5NGFF_JEMALLOC", preload) != preload:
        out.append("H5NGFF_JEMALLOC differs from LD_PRELOAD")
    if env.get("MALLOC_CONF") != JEMALLOC_CONF:
        out.append(f"MALLOC_CONF {env.get('MALLOC_CONF')!r} is not allocator.JEMALLOC_CONF {JEMALLOC_CONF!r}")
    if env.get("PYTHONSAFEPATH") != "1":  # issue 41: no working directory on the import path
        out.append("PYTHONSAFEPATH is not 1")
    users = [c.value[0] for c in final if c.cmd == "USER"]
    user = users[-1].split(":")[0] if users else "root"
    if not user.isdigit() or int(user) == 0:
        out.append(f"final user is not a numeric non-root uid: {user!r}")
    checks = [c for c in final if c.cmd == "HEALTHCHECK"]
    if not checks or checks[-1].value[0] != "CMD":
        out.append("no HEALTHCHECK")
    entry = [c for c in final if c.cmd == "ENTRYPOINT"]
    if not entry or not entry[-1].json or list(entry[-1].value[-1:]) != ["--"]:
        out.append("ENTRYPOINT does not run its arguments as the command (exec form ending in --)")
    return out


def test_the_dockerfile_holds_every_rule():
    assert problems(DOCKERFILE.read_text()) == []


TEXT = DOCKERFILE.read_text()


@pytest.mark.parametrize(
    "edit, problem",
    [
        (
            lambda t: t.replace("ARG PYTHON_IMAGE=python:3.11.13-slim-bookworm", "ARG PYTHON_IMAGE=python:3.11-slim"),
            "base not pinned",
        ),
        (
            lambda t: t.replace("ARG PYTHON_IMAGE=python:3.11.13-slim-bookworm", "ARG PYTHON_IMAGE=python:latest"),
            "base not pinned",
        ),
        (
            lambda t: re.sub(r"(?s)FROM \$\{PYTHON_IMAGE\} AS builder.*?(?=FROM \$\{PYTHON_IMAGE\}\n)", "", t),
            "not multi-stage",
        ),
        (lambda t: t.replace("libjemalloc2 tini", "tini"), "libjemalloc2 is not installed"),
        (
            lambda t: t.replace("ENV LD_PRELOAD=/usr/local/lib/libjemalloc.so.2 \\", "ENV \\"),
            "jemalloc is not preloaded",
        ),
        (lambda t: t.replace("muzzy_decay_ms:0", "muzzy_decay_ms:1000"), "MALLOC_CONF"),
        (lambda t: t.replace("    PYTHONSAFEPATH=1 \\\n", ""), "PYTHONSAFEPATH"),
        (lambda t: t.replace("USER 10001:10001", "USER root"), "non-root"),
        (lambda t: t.replace("USER 10001:10001", "USER 0"), "non-root"),
        (lambda t: t.replace("USER 10001:10001\n", ""), "non-root"),
        (lambda t: re.sub(r"(?s)HEALTHCHECK .*?healthcheck\"\]\n", "", t), "no HEALTHCHECK"),
        (lambda t: t.replace('ENTRYPOINT ["/usr/bin/tini", "--"]', 'ENTRYPOINT ["h5ngff"]'), "ENTRYPOINT"),
        (lambda t: t.replace('"h5ngff[kubernetes,s3]"', '"h5ngff"'), "h5ngff[kubernetes] is not installed"),
        (
            lambda t: t.replace("RUN --mount=type=bind,from=builder,source=/wheels,target=/wheels \\", "RUN \\"),
            "h5ngff[kubernetes] is not installed",
        ),
        (lambda t: t.replace(" -c requirements/lock.txt", ""), "does not pin the locked versions"),
    ],
    ids=[
        "floating-minor",
        "latest",
        "single-stage",
        "no-jemalloc",
        "no-preload",
        "other-malloc-conf",
        "no-safe-path",
        "user-root",
        "uid-0",
        "no-user",
        "no-healthcheck",
        "entrypoint-swallows-args",
        "no-kubernetes-extra",
        "not-from-builder",
        "unlocked",
    ],
)
def test_each_rule_catches_its_breakage(edit, problem):
    edited = edit(TEXT)
    assert edited != TEXT, "the edit did not apply; update this negative control"
    found = problems(edited)
    assert any(problem in p for p in found), found


def test_pods_rely_on_the_entrypoint_passing_args_through():
    """Why the ENTRYPOINT rule matters: h5ngff's Dask pods give only args (dask worker ...)."""
    from test_helm import _plan
    from h5ngff.jobspec import PodSettings

    worker = build_worker_container(_plan(), "img", PodSettings())
    scheduler = build_scheduler_pod_spec(_plan(), "img", PodSettings())["containers"][0]
    assert "command" not in worker and worker["args"][:2] == ["dask", "worker"]
    assert "command" not in scheduler and scheduler["args"][:2] == ["dask", "scheduler"]


def test_tini_is_installed_where_the_entrypoint_looks():
    (entry,) = [c for c in _stages(TEXT)[-1] if c.cmd == "ENTRYPOINT"]
    assert entry.value[0] == "/usr/bin/tini"  # Debian's tini package puts it there
    assert re.search(r"apt-get install[^&]*\btini\b", TEXT)


@pytest.mark.skipif(
    not any(os.path.exists(p) for p in JEMALLOC_PATHS),
    reason="libjemalloc2 is not installed here (scripts/setup installs it)",
)
def test_jemalloc_accepts_the_images_malloc_conf():
    """Run Python with the image's preload and MALLOC_CONF: jemalloc is mapped and, because
    abort_conf is on, a setting this jemalloc did not understand would have aborted the process.
    Negative control: a misspelt option aborts."""
    library = next(p for p in JEMALLOC_PATHS if os.path.exists(p))
    env = _env(_stages(TEXT)[-1])
    probe = "print(any('libjemalloc' in line for line in open('/proc/self/maps')))"
    good = subprocess.run(
        [sys.executable, "-c", probe],
        env={**os.environ, "LD_PRELOAD": library, "MALLOC_CONF": env["MALLOC_CONF"]},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert good.returncode == 0 and good.stdout.strip() == "True", good.stderr
    bad = subprocess.run(
        [sys.executable, "-c", "pass"],
        env={**os.environ, "LD_PRELOAD": library, "MALLOC_CONF": env["MALLOC_CONF"].replace("narenas", "narena")},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert bad.returncode != 0 and "narena" in bad.stderr


def _dockerignore_allows(path: str) -> bool:
    """Docker's .dockerignore rules, as far as ours uses them: the last pattern that matches the
    path or one of its parent directories wins; ``!`` re-includes; ``**/`` matches any depth."""
    parts = path.split("/")
    prefixes = ["/".join(parts[:i]) for i in range(1, len(parts) + 1)]
    allowed = True
    for line in (ROOT / ".dockerignore").read_text().splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        negate, pattern = line.startswith("!"), line.lstrip("!").rstrip("/")
        if pattern.startswith("**/"):
            hit = any(fnmatch.fnmatch(part, pattern[3:]) for part in parts)
        else:
            hit = any(
                fnmatch.fnmatchcase(prefix, pattern) and prefix.count("/") == pattern.count("/") for prefix in prefixes
            )
        if hit:
            allowed = negate
    return allowed


def test_the_build_context_has_what_the_dockerfile_copies_and_nothing_big():
    sources = [
        s
        for c in dockerfile.parse_string(TEXT)
        if c.cmd == "COPY" and not any(f.startswith("--from") for f in c.flags)
        for s in c.value[:-1]
    ]
    assert set(sources) == {"pyproject.toml", "README.md", "requirements/lock.txt", "src", "docker/healthcheck.py"}
    for source in sources:
        assert (ROOT / source).exists(), source
        assert _dockerignore_allows(source), f".dockerignore excludes {source}, which the Dockerfile copies"
    assert _dockerignore_allows("src/h5ngff/operator/schema/crd.yaml")
    for unwanted in (
        ".venv/bin/python",
        ".git/HEAD",
        "tests/test_helm.py",
        "h5ngff-demo/sample.h5",
        "src/h5ngff/__pycache__/cli.cpython-311.pyc",
        "src/h5ngff.egg-info/PKG-INFO",
    ):
        assert not _dockerignore_allows(unwanted), unwanted


@pytest.mark.parametrize(
    "argv, url",
    [
        (
            ["/usr/bin/tini", "--", "h5ngff", "operator", "--liveness", "http://0.0.0.0:8080/healthz", "--standalone"],
            "http://127.0.0.1:8080/healthz",
        ),
        (
            ["/usr/bin/tini", "--", "h5ngff", "operator", "--liveness=http://10.0.0.3:9000/live"],
            "http://10.0.0.3:9000/live",
        ),
        (["/usr/bin/tini", "--", "h5ngff", "operator"], None),
        (
            ["/usr/local/bin/python3.11", "/usr/local/bin/dask", "worker", "--dashboard-address", "8788"],
            "http://127.0.0.1:8788/health",
        ),
        (["/usr/bin/tini", "--", "dask", "scheduler", "--host", "0.0.0.0"], "http://127.0.0.1:8787/health"),
        (["/usr/bin/tini", "--", "dask", "worker", "tcp://sched:8786"], None),
        (["/usr/bin/tini", "--", "h5ngff", "runner", "--namespace", "ns", "--name", "job"], None),
    ],
)
def test_healthcheck_targets(argv, url):
    assert healthcheck.target_url(argv) == url


@pytest.mark.slow
def test_healthcheck_probes_a_real_endpoint():
    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200 if self.path == "/healthz" else 500)
            self.end_headers()

        def log_message(self, *args):
            pass

    server = http.server.HTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    port = server.server_address[1]
    try:
        assert healthcheck.check(["h5ngff", "operator", "--liveness", f"http://0.0.0.0:{port}/healthz"]) == 0
        assert healthcheck.check(["h5ngff", "operator", "--liveness", f"http://0.0.0.0:{port}/broken"]) == 1
    finally:
        server.shutdown()
        server.server_close()
    assert (
        healthcheck.check(["h5ngff", "operator", "--liveness", f"http://0.0.0.0:{port}/healthz"]) == 1
    )  # nothing listens now
