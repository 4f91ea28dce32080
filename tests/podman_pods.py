"""Real containers for the image tests (tests/test_image.py): podman runs the image scripts/image
built, and plays the Pod manifests h5ngff's own builders render (``podman kube play``), each
container under its ``resources.limits.memory`` as a real cgroup limit.

podman is not kubelet, and what it does differently is done here, each for a stated reason:

* kubelet expands ``$(VAR)`` in ``args`` from the container's env; podman 4.3 passes it on
  as text (measured: ``dask worker --name $(DASK_WORKER_NAME)``), so ``as_pod`` expands it;
* podman 4.3 publishes every ``containerPort`` on the host (two worker pods would fight over
  port 8788, and a test would hold host ports it did not choose), and turns an ``httpGet`` probe
  with a named port into ``curl http://localhost:0/...``, a command the image does not have:
  ``as_pod`` drops ``ports`` and probes, which change nothing a container runs;
* the Dask Operator gives each worker pod ``DASK_SCHEDULER_ADDRESS`` and ``DASK_WORKER_NAME``:
  the caller passes them as ``env``.

Every name a test creates starts with ``h5ngff-test-`` and a random part, and every pod is
removed on the way out: other sessions share the machine's podman. podman runs in a directory of
the test's own: conmon 2.1.6 (Debian 12) writes its ``oom`` marker into its working directory,
not the container's, which is also why ``podman inspect`` never reports OOMKilled here.
"""

from __future__ import annotations

import copy
import json
import os
import re
import shutil
import subprocess
import uuid
from pathlib import Path
from typing import Any

import yaml

from h5ngff.backends.cgroups import MemoryCgroup

ROOT = Path(__file__).resolve().parents[1]
#: Where the host sees a container's cgroup v1 memory hierarchy (podman's State.CgroupPath below it).
MEMORY_HIERARCHY = "/sys/fs/cgroup/memory"


def podman_missing() -> str | None:
    """None where podman can run containers here; otherwise why not."""
    if shutil.which("podman") is None:
        return "podman is not installed (scripts/setup installs it on Debian)"
    info = subprocess.run(["podman", "info", "--format", "{{.Host.OCIRuntime.Name}}"], capture_output=True, text=True)
    if info.returncode != 0:
        return f"podman cannot run here: {info.stderr.strip()[:300]}"
    return None


def checkout_tag() -> str:
    """The tag of the image built from this checkout (scripts/image --test-tag: its inputs' hash)."""
    return subprocess.run(
        [str(ROOT / "scripts" / "image"), "--test-tag"], capture_output=True, text=True, check=True, cwd=ROOT
    ).stdout.strip()


def has_image(tag: str) -> bool:
    return subprocess.run(["podman", "image", "exists", tag]).returncode == 0


def build_image(tag: str) -> None:
    """scripts/image, as CI's scripts/test runs it before the suite (here only when that was skipped)."""
    subprocess.run([str(ROOT / "scripts" / "image"), "--engine", "podman", "--tag", tag], check=True, cwd=ROOT)


def inspect(name: str, kind: str = "container") -> dict[str, Any]:
    out = subprocess.run(["podman", kind, "inspect", name], capture_output=True, text=True, check=True).stdout
    data = json.loads(out)
    return data[0] if isinstance(data, list) else data


def unique(prefix: str) -> str:
    return f"h5ngff-test-{prefix}-{uuid.uuid4().hex[:8]}"


def run(
    image: str, *command: str, cwd: Path, options: tuple[str, ...] = (), timeout: float = 300
) -> subprocess.CompletedProcess:
    """``podman run --rm`` of ``command`` in ``image`` (through its entrypoint), under a name of
    ours, from ``cwd`` (a directory of the test's)."""
    return subprocess.run(
        # --no-healthcheck: podman would schedule the image's HEALTHCHECK through systemd, which a
        # test machine may not run (it logs an error per container), and nothing here probes.
        ["podman", "run", "--rm", "--no-healthcheck", "--name", unique("run"), *options, image, *command],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=cwd,
    )


def expand_args(args: list[str], env: dict[str, str]) -> list[str]:
    """Kubernetes' ``$(VAR)`` expansion of a container's args: a defined variable is replaced,
    ``$$`` is a literal ``$``, anything else stays as written (kubelet's rule)."""

    def one(arg: str) -> str:
        return re.sub(
            r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_]*)\)",
            lambda m: "$" if m.group(0) == "$$" else env.get(m.group(1), m.group(0)),
            arg,
        )

    return [one(a) for a in args]


def as_pod(name: str, pod_spec: dict[str, Any], env: dict[str, str] | None = None) -> dict[str, Any]:
    """A Pod manifest of ``pod_spec`` as podman can play it (see the module's docstring)."""
    spec = copy.deepcopy(pod_spec)
    for container in spec["containers"]:
        for field in ("ports", "livenessProbe", "readinessProbe"):
            container.pop(field, None)
        container["env"] = [*container.get("env", []), *({"name": k, "value": v} for k, v in (env or {}).items())]
        values = {e["name"]: e["value"] for e in container["env"] if "value" in e}
        if "args" in container:
            container["args"] = expand_args(container["args"], values)
    spec.setdefault("restartPolicy", "Never")
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name}, "spec": spec}


class Pods:
    """The pods one test plays, removed when it leaves (``with Pods(tmp_path) as pods``)."""

    def __init__(self, workdir: Path):
        self.workdir = workdir
        self.names: list[str] = []

    def __enter__(self) -> "Pods":
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove(*self.names)

    def remove(self, *names: str) -> None:
        """Stop and remove pods, in one command (each takes seconds to tear down its network)."""
        if names:
            # --ignore: one pod already gone must not keep the others
            command = ["podman", "pod", "rm", "--force", "--ignore", "--time", "0", *names]
            subprocess.run(command, capture_output=True, cwd=self.workdir, check=True)
            self.names = [n for n in self.names if n not in names]

    def play(self, manifest: dict[str, Any]) -> list[str]:
        """Start the pod; its containers' names (podman names them ``<pod>-<container>``)."""
        name = manifest["metadata"]["name"]
        path = self.workdir / f"{name}.yaml"
        path.write_text(yaml.safe_dump(manifest))
        self.names.append(name)
        subprocess.run(
            ["podman", "kube", "play", str(path)], capture_output=True, text=True, check=True, cwd=self.workdir
        )
        return [f"{name}-{c['name']}" for c in manifest["spec"]["containers"]]

    @staticmethod
    def address(container: str) -> str:
        networks = inspect(container)["NetworkSettings"]["Networks"]
        return next(n["IPAddress"] for n in networks.values() if n.get("IPAddress"))

    @staticmethod
    def state(container: str) -> dict[str, Any]:
        state: dict[str, Any] = inspect(container)["State"]
        return state

    @staticmethod
    def cgroup(container: str) -> MemoryCgroup:
        """The container's memory cgroup, seen from the host (the kernel's counters of the pod)."""
        return MemoryCgroup(os.path.join(MEMORY_HIERARCHY, Pods.state(container)["CgroupPath"].lstrip("/")), 1)

    @staticmethod
    def main_pid(container: str) -> int:
        """The host pid of the process tini runs (the Dask nanny in a worker pod)."""
        tini = Pods.state(container)["Pid"]
        return int(Path(f"/proc/{tini}/task/{tini}/children").read_text().split()[0])

    @staticmethod
    def processes(container: str) -> dict[int, dict[str, str]]:
        """Every process in the container, by host pid: its command line and its mapped files."""
        out = {}
        for pid in Pods.cgroup(container).pids():
            try:
                cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode().strip()
                maps = Path(f"/proc/{pid}/maps").read_text()
            except OSError:  # exited meanwhile
                continue
            out[pid] = {"cmdline": cmdline, "maps": maps}
        return out
