"""docker/Dockerfile, checked with BuildKit's own parser (PyPI ``dockerfile``), without building it;
tests/test_image.py builds and runs the image itself (marker ``image``, podman).

What must hold: a base pinned by digest or exact release, a multi-stage build that installs the
hashed requirements/image.txt (the lock's versions of what a pod imports) and h5ngff from stages
of their own, pinned apt packages, jemalloc installed and preloaded with h5ngff's MALLOC_CONF, a
non-root user, OCI labels, a HEALTHCHECK, and an entrypoint that runs its arguments as the
command (every h5ngff pod passes only ``args``). Each rule has a negative control on edited text.
The jemalloc settings are also tried for real: the MALLOC_CONF string is accepted by Debian's
libjemalloc2 (``abort_conf`` would abort on a bad option), and the healthcheck script probes a
real HTTP endpoint. requirements/image.txt is checked against the lock and the dependency
closure installed here.
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


#: The OCI labels every image carries (scripts/image fills their values).
OCI_LABELS = ("title", "version", "revision", "created", "licenses", "base.name", "base.digest")


def problems(text: str) -> list[str]:
    """Everything wrong with a Dockerfile's text, by the rules above; [] when all hold."""
    out = []
    args, stages = _args(text), _stages(text)
    if len(stages) < 2:
        return ["not multi-stage"]
    names = {c.value[2].lower() for s in stages for c in s[:1] if len(c.value) == 3 and c.value[1].upper() == "AS"}
    final = stages[-1]
    for stage in stages:
        base = _base(stage[0], args)
        if base.lower() not in names and not PINNED.match(base):
            out.append(f"base not pinned: {base}")
    runs = [" ".join(c.value) for c in final if c.cmd == "RUN"]
    every_run = [" ".join(c.value) for s in stages for c in s if c.cmd == "RUN"]
    install = [r for r in every_run if "pip" in r and "install" in r and "requirements/image.txt" in r]
    if not install:
        out.append("requirements/image.txt is not installed")
    elif not all("--require-hashes" in r and "--no-deps" in r for r in install):
        # the hashes pin the bytes; the file is the whole closure (the lock's versions)
        out.append("requirements/image.txt is not installed with --require-hashes --no-deps")
    copied = {f.split("=", 1)[1] for c in final if c.cmd == "COPY" for f in c.flags if f.startswith("--from=")}
    if not {"deps", "app"} <= copied:
        out.append(f"the final stage does not take the deps and app stages' layers (takes {sorted(copied)})")
    for r in every_run:
        for packages in re.findall(r"apt-get install((?:\s+[^&|;]+)+)", r):
            loose = [p for p in packages.split() if not p.startswith("-") and "=" not in p]
            if loose:
                out.append(f"apt packages not pinned: {loose}")
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
    labels = " ".join(" ".join(c.value) for c in final if c.cmd == "LABEL")
    missing = [k for k in OCI_LABELS if f"org.opencontainers.image.{k}" not in labels]
    if missing:
        out.append(f"OCI labels missing: {missing}")
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
        (lambda t: re.sub(r"ARG PYTHON_IMAGE=\S+", "ARG PYTHON_IMAGE=python:3.11-slim", t), "base not pinned"),
        (lambda t: re.sub(r"ARG PYTHON_IMAGE=\S+", "ARG PYTHON_IMAGE=python:latest", t), "base not pinned"),
        (lambda t: t.replace("FROM deps AS app", "FROM debian:bookworm AS app"), "base not pinned"),
        (
            lambda t: re.sub(r"(?s)FROM \$\{PYTHON_IMAGE\} AS deps.*?(?=FROM \$\{PYTHON_IMAGE\}\n)", "", t),
            "not multi-stage",
        ),
        (lambda t: t.replace("libjemalloc2=5.3.0-1 tini", "tini"), "libjemalloc2 is not installed"),
        (lambda t: t.replace("libjemalloc2=5.3.0-1", "libjemalloc2"), "apt packages not pinned"),
        (lambda t: t.replace("binutils=2.40-2", "binutils"), "apt packages not pinned"),
        (
            lambda t: t.replace(
                "    LD_PRELOAD=/usr/local/lib/libjemalloc.so.2 \\", "    NO_PRELOAD=/usr/local/lib/libjemalloc.so.2 \\"
            ),
            "jemalloc is not preloaded",
        ),
        (lambda t: t.replace("muzzy_decay_ms:0", "muzzy_decay_ms:1000"), "MALLOC_CONF"),
        (lambda t: t.replace("    PYTHONSAFEPATH=1 \\\n", ""), "PYTHONSAFEPATH"),
        (lambda t: t.replace("USER 10001:10001", "USER root"), "non-root"),
        (lambda t: t.replace("USER 10001:10001", "USER 0"), "non-root"),
        (lambda t: t.replace("USER 10001:10001\n", ""), "non-root"),
        (lambda t: re.sub(r"(?s)HEALTHCHECK .*?healthcheck\"\]\n", "", t), "no HEALTHCHECK"),
        (lambda t: t.replace('ENTRYPOINT ["/usr/bin/tini", "--"]', 'ENTRYPOINT ["h5ngff"]'), "ENTRYPOINT"),
        (
            lambda t: t.replace(
                "--no-deps --require-hashes -r /tmp/requirements/image.txt", "-r /tmp/requirements/image.txt"
            ),
            "--require-hashes",
        ),
        (lambda t: t.replace("/tmp/requirements/image.txt", "/tmp/requirements/other.txt"), "is not installed"),
        (lambda t: t.replace("COPY --from=app ", "COPY --from=deps "), "deps and app"),
        (lambda t: t.replace("org.opencontainers.image.base.digest=", "base-digest="), "OCI labels missing"),
        (lambda t: t.replace("org.opencontainers.image.revision=", "revision="), "OCI labels missing"),
    ],
    ids=[
        "floating-minor",
        "latest",
        "unpinned-stage-base",
        "single-stage",
        "no-jemalloc",
        "jemalloc-unpinned",
        "binutils-unpinned",
        "no-preload",
        "other-malloc-conf",
        "no-safe-path",
        "user-root",
        "uid-0",
        "no-user",
        "no-healthcheck",
        "entrypoint-swallows-args",
        "unhashed",
        "not-the-image-requirements",
        "no-app-layer",
        "no-base-digest-label",
        "no-revision-label",
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
    assert set(sources) == {
        "pyproject.toml",
        "README.md",
        "requirements/image.txt",
        "requirements/image-build.txt",
        "src",
        "docker/healthcheck.py",
    }
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


# --- requirements/image.txt: the lock's versions of exactly what a pod imports ------------------

REQUIREMENTS = ROOT / "requirements"


def pins(path: Path) -> dict[str, str]:
    """name -> version of every ``name==version`` requirement in a pip requirements file."""
    from packaging.utils import canonicalize_name

    found = re.findall(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==([^\s;\\]+)", path.read_text(), re.M)
    return {canonicalize_name(name): version for name, version in found}


def dropped() -> set[str]:
    """The packages requirements/image-overrides.txt leaves out (a marker that never holds)."""
    text = (REQUIREMENTS / "image-overrides.txt").read_text()
    return set(re.findall(r'^([A-Za-z0-9._-]+)\s*;\s*sys_platform == "never"', text, re.M))


def project_requires() -> list[str]:
    """h5ngff's own requirements, from pyproject.toml (an editable install's metadata lags it),
    as Requires-Dist lines with their extra markers."""
    import tomllib

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    lines = list(project["dependencies"])
    for extra, requirements in project["optional-dependencies"].items():
        lines += [f'{r}; extra == "{extra}"' for r in requirements]
    return lines


def closure(extras: tuple[str, ...], leave_out: set[str]) -> set[str]:
    """Every distribution ``h5ngff[extras]`` needs on this platform (the dependencies' installed
    metadata), without ``leave_out`` and what only they need."""
    from importlib.metadata import distribution

    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    seen: set[str] = set()
    done: set[tuple[str, tuple[str, ...]]] = set()
    todo = [("h5ngff", extras)]
    while todo:
        name, wanted = todo.pop()
        if name in leave_out or (name, wanted) in done:
            continue
        done.add((name, wanted))
        seen.add(name)
        for line in project_requires() if name == "h5ngff" else distribution(name).requires or []:
            req = Requirement(line)
            environments = [{"extra": e} for e in wanted] or [{"extra": ""}]
            if req.marker is not None and not any(req.marker.evaluate(env) for env in environments):
                continue
            todo.append((canonicalize_name(req.name), tuple(sorted(req.extras))))
    return seen - {"h5ngff"}


def test_image_requirements_are_the_locks_versions_of_what_pods_import():
    image, lock = pins(REQUIREMENTS / "image.txt"), pins(REQUIREMENTS / "lock.txt")
    assert dropped() == {"kubernetes", "pykube-ng"}
    assert set(image) == closure(("kubernetes", "s3"), dropped())
    assert {name: version for name, version in image.items() if lock.get(name) != version} == {}
    assert "matplotlib" not in image  # a workstation's plots, not a pod's
    # every requirement carries hashes (pip --require-hashes refuses the file otherwise)
    blocks = re.split(r"\n(?=[A-Za-z0-9])", (REQUIREMENTS / "image.txt").read_text().split("\n", 2)[2])
    assert all("--hash=sha256:" in block for block in blocks if "==" in block)


def test_negative_control_the_closure_sees_what_the_overrides_drop_and_an_extra():
    full = closure(("kubernetes", "s3"), set())
    assert {"kubernetes", "pykube-ng", "requests-oauthlib"} <= full - set(pins(REQUIREMENTS / "image.txt"))
    assert "matplotlib" in closure(("plots",), set())
