"""The built image, run for real (marker ``image``): podman runs what scripts/image built from this
checkout, and plays the pods h5ngff's own builders render, under their real memory limits.

What must hold (issue 43), each with a negative control that shows the check can fail:

* the image runs as uid 10001 with tini as PID 1, and ``h5ngff --version`` is this checkout's;
* jemalloc is mapped in every process of a worker pod (control: a pod rendered for glibc);
* a conversion in the image, under a read-only root filesystem without capabilities, is
  byte-identical to the host's (control: another compression level differs);
* the worker pods, as the operator renders them and with their ``resources.limits.memory``,
  succeed at the planned limit with no OOM kill; below the pods' pinned peak (anon + shmem +
  unevictable, sampled from the host) the kernel kills, and h5ngff's report of the existing
  cluster (``--scheduler``) says OOMKilled with the kernel's count and the limit that held;
* the runner Job's container runs under tini (control: the old ``command`` bypasses it);
* the image is at most 450 MB, carries the OCI labels, and has no matplotlib (``--memory-report``
  says so before a run).

The image is built once, by scripts/test before the suite (CI) or here when missing; its tag is
the hash of the build's inputs, so a stale image is never tested. Skips with the reason where
podman cannot run.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

import podman_pods
from podman_pods import Pods, as_pod, inspect, run

pytestmark = [
    pytest.mark.image,
    pytest.mark.integration,
    pytest.mark.slow,
    # The image's Python is Debian's 3.11.2 where scripts/image builds the base, the host's may be
    # another 3.11 patch release: Dask warns, and the two talk the same protocol.
    pytest.mark.filterwarnings("ignore::distributed.versions.VersionMismatchWarning"),
    # The first test builds the image where scripts/test did not (2.5 min from scratch on 2 cores).
    pytest.mark.timeout(600),
]

MB = 1_000_000
MiB = 1 << 20
#: issue 43: at most this many bytes uncompressed.
SIZE_LIMIT = 450 * MB
#: The host's own command, for the reference conversions and the existing cluster's client.
H5NGFF = [sys.executable, "-m", "h5ngff.cli"]
CONVERSION = ["--chunks", "64,64,64", "--levels", "2"]


@pytest.fixture(scope="session")
def image():
    reason = podman_pods.podman_missing()
    if reason:
        pytest.skip(reason)
    tag = podman_pods.checkout_tag()
    if not podman_pods.has_image(tag):
        podman_pods.build_image(tag)
    return tag


@pytest.fixture(scope="module")
def shared(tmp_path_factory):
    """A directory the pods' user (10001) can write, with a real HDF5 input whose chunks need
    hdf5plugin's Blosc/Zstd filter (a plugin the image strips of debug sections)."""
    import h5py
    import hdf5plugin

    path = tmp_path_factory.mktemp("image")
    path.chmod(0o777)
    shape = (128, 512, 512)
    z, y, x = (np.arange(n, dtype=np.uint32) for n in shape)
    with h5py.File(path / "in.h5", "w") as f:
        data = f.create_dataset(
            "/volume/data",
            shape=shape,
            dtype="uint16",
            chunks=(16, 128, 128),
            **hdf5plugin.Blosc(cname="zstd", clevel=3, shuffle=hdf5plugin.Blosc.SHUFFLE),
        )
        for i in range(shape[0]):  # plane by plane: a few MiB at a time
            plane = (z[i] * 131 + y[:, None] * 7 + x[None, :] * 3 + (y[:, None] * x[None, :]) % 17) % 65521
            data[i] = plane.astype(np.uint16)
    (path / "in.h5").chmod(0o644)
    return path


@pytest.fixture(scope="module")
def host_reference(shared):
    """The host's conversion of the input: what every conversion in the image must equal."""
    out = shared / "host.ome.zarr"
    subprocess.run(
        [*H5NGFF, "convert", f"{shared}/in.h5:/volume/data", str(out), *CONVERSION], check=True, capture_output=True
    )
    return out


def tree_differences(a: Path, b: Path) -> list[str]:
    """Files that differ between two directory trees, by relative path; [] when byte-identical."""

    def files(root: Path) -> dict[str, bytes]:
        return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}

    left, right = files(a), files(b)
    missing = sorted(set(left) ^ set(right))
    return missing + [name for name in sorted(set(left) & set(right)) if left[name] != right[name]]


# --- the image itself ----------------------------------------------------------------------------


def identity_problems(output: str) -> list[str]:
    """From ``id -u; id -g; cat /proc/1/cmdline``: a non-root numeric user and tini as PID 1."""
    uid, gid, pid1 = (output.splitlines() + ["", "", ""])[:3]
    problems = []
    if uid != "10001" or gid != "10001":
        problems.append(f"runs as {uid}:{gid}, not 10001:10001")
    if not pid1.startswith("/usr/bin/tini"):
        problems.append(f"PID 1 is {pid1!r}, not tini")
    return problems


def test_the_image_runs_as_10001_under_tini(image, tmp_path):
    probe = ("sh", "-c", "id -u; id -g; tr '\\0' ' ' < /proc/1/cmdline")
    ok = run(image, *probe, cwd=tmp_path)
    assert ok.returncode == 0, ok.stderr
    assert identity_problems(ok.stdout) == []
    # Negative control: as root, and with the entrypoint replaced, the check says so.
    bad = run(image, "-c", probe[2], cwd=tmp_path, options=("--user", "0", "--entrypoint", "sh"))
    assert bad.returncode == 0, bad.stderr
    found = identity_problems(bad.stdout)
    assert any("0:0" in p for p in found) and any("not tini" in p for p in found), found


def test_h5ngff_version_is_this_checkouts(image, tmp_path):
    import h5ngff

    result = run(image, "h5ngff", "--version", cwd=tmp_path)
    assert result.returncode == 0 and result.stdout.strip() == f"h5ngff {h5ngff.__version__}", result
    # Negative control: the base image (everything but h5ngff) has no such command.
    base = inspect(image, "image")["Config"]["Labels"]["org.opencontainers.image.base.name"]
    assert run(base, "h5ngff", "--version", cwd=tmp_path).returncode != 0


def label_problems(labels: dict[str, str]) -> list[str]:
    wanted = ("title", "version", "revision", "created", "licenses", "base.name", "base.digest")
    problems = [f"no org.opencontainers.image.{k}" for k in wanted if not labels.get(f"org.opencontainers.image.{k}")]
    base = labels.get("org.opencontainers.image.base.name", "")
    if "@" in base and base.split("@")[1] != labels.get("org.opencontainers.image.base.digest"):
        problems.append("base.name's digest is not base.digest")
    return problems


def test_size_labels_and_base_digest(image, tmp_path):
    found = inspect(image, "image")
    size, labels = found["Size"], found["Config"]["Labels"]
    assert size <= SIZE_LIMIT, f"{size / MB:.0f} MB uncompressed, more than {SIZE_LIMIT / MB:.0f} MB"
    assert label_problems(labels) == []
    base = labels["org.opencontainers.image.base.name"]
    assert inspect(base, "image")["Digest"] == labels["org.opencontainers.image.base.digest"]
    assert (
        labels["org.opencontainers.image.version"] == run(image, "h5ngff", "--version", cwd=tmp_path).stdout.split()[-1]
    )
    # Negative control: the base image carries none of them.
    assert len(label_problems(inspect(base, "image")["Config"]["Labels"] or {})) >= 5


def test_memory_report_is_refused_in_the_image_before_the_run(image, shared, tmp_path):
    """matplotlib is a workstation's (h5ngff[plots]): the image leaves it out, and says so."""
    result = run(
        image,
        *("h5ngff", "convert", f"{shared}/in.h5:/volume/data", "/tmp/out.zarr", "--memory-report", "/tmp/r.png"),
        cwd=tmp_path,
        options=("-v", f"{shared}:{shared}:ro"),
    )
    assert result.returncode == 2 and "h5ngff[plots]" in result.stderr, result.stderr
    assert run(image, "python", "-c", "import matplotlib", cwd=tmp_path).returncode != 0
    # Negative control: where matplotlib is installed (this venv), the same path is accepted.
    from h5ngff.metrics.timeline import check_report_path

    check_report_path(str(shared / "r.png"))


#: Imported in the image: every h5ngff module, and what the runner and the operator import
#: outside h5ngff (dask-kubernetes' KubeCluster, kopf, kr8s, kubernetes_asyncio) and a worker
#: writing a bucket (obstore, botocore's config chain).
IMPORTS = """
import importlib, pkgutil, h5ngff
failed = []
for module in pkgutil.walk_packages(h5ngff.__path__, "h5ngff."):
    try:
        importlib.import_module(module.name)
    except Exception as exc:
        failed.append(f"{module.name}: {exc!r}")
from dask_kubernetes.operator import KubeCluster
import botocore.session, kopf, kr8s, kubernetes_asyncio.client, obstore
print(len(failed), *failed, sep="\\n")
"""


def test_what_the_pods_import_is_in_the_image_and_what_was_left_out_is_not(image, tmp_path):
    result = run(image, "python", "-c", IMPORTS, cwd=tmp_path, options=("--env", "HOME=/tmp"))
    assert result.returncode == 0 and result.stdout.strip() == "0", result.stdout + result.stderr[-2000:]
    # Negative control: the packages the image leaves out fail to import there, so the check
    # above would have failed had a pod needed one.
    for left_out in ("kubernetes", "pykube", "matplotlib"):
        assert run(image, "python", "-c", f"import {left_out}", cwd=tmp_path).returncode != 0, left_out


def test_a_conversion_in_the_image_is_byte_identical_to_the_hosts(image, shared, host_reference, tmp_path):
    out = shared / "image.ome.zarr"
    result = run(
        image,
        *("h5ngff", "convert", f"{shared}/in.h5:/volume/data", str(out), *CONVERSION),
        cwd=tmp_path,
        # as the pods run it: read-only root, no capabilities, no privilege gain, scratch at /tmp
        options=(
            *("--read-only", "--cap-drop", "ALL", "--security-opt", "no-new-privileges"),
            *("--tmpfs", "/tmp", "--env", "HOME=/tmp", "-v", f"{shared}:{shared}"),
        ),
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert tree_differences(host_reference, out) == []
    # Negative control: one byte of one chunk changed, and the comparison names that file.
    chunk = next(p for p in sorted(out.rglob("c/*/*/*")) if p.is_file())
    data = bytearray(chunk.read_bytes())
    data[len(data) // 2] ^= 0xFF
    chunk.write_bytes(bytes(data))
    assert tree_differences(host_reference, out) == [str(chunk.relative_to(out))]


# --- the pods the operator renders ---------------------------------------------------------------


def render_cluster(image: str, shared: Path, allocator: str = "auto") -> dict:
    """The DaskCluster the runner would create for a job on ``shared`` (``h5ngff operator render
    --plan``'s code path), with the input and output on a hostPath volume at the same path."""
    from h5ngff.job import parse_manifest
    from h5ngff.operator.schema.policy import TenantPolicy
    from h5ngff.clirender import RenderOptions, render_objects

    manifest = parse_manifest(job_manifest(image, shared, allocator))
    policy = TenantPolicy(allowed_volume_types=("hostPath", "emptyDir"))
    (cluster,) = [
        o
        for o in render_objects(manifest, RenderOptions(image=image, plan=True, policy=policy))
        if o["kind"] == "DaskCluster"
    ]
    return cluster


def job_manifest(image: str, shared: Path, allocator: str = "auto") -> dict:
    return {
        "apiVersion": "h5ngff.dev/v1alpha1",
        "kind": "ConversionJob",
        "metadata": {"name": "image-test", "namespace": "h5ngff"},
        "spec": {
            "source": {"path": f"{shared}/in.h5", "dataset": "/volume/data"},
            "output": {"path": f"{shared}/pods.ome.zarr", "chunks": [64, 64, 64]},
            "pyramid": {"levels": 2},
            "resources": {"workers": 2, "threadsPerWorker": 1, "allocator": allocator},
            "pod": {
                "image": image,
                "volumes": [{"name": "data", "hostPath": {"path": str(shared), "type": "Directory"}}],
                "volumeMounts": [{"name": "data", "mountPath": str(shared)}],
            },
        },
    }


def worker_pod(cluster: dict, name: str, scheduler: str, limit: str | None = None) -> dict:
    """One worker pod of ``cluster``, with what the Dask Operator adds (the scheduler's address and
    the worker's name), and ``limit`` instead of the planned memory limit where given."""
    spec = cluster["spec"]["worker"]["spec"]
    if limit:
        spec = json.loads(json.dumps(spec))
        spec["containers"][0]["resources"] = {"requests": {"memory": limit}, "limits": {"memory": limit}}
    return as_pod(name, spec, {"DASK_SCHEDULER_ADDRESS": scheduler, "DASK_WORKER_NAME": name})


def processes_without_jemalloc(container: str) -> list[str]:
    return [p["cmdline"] for p in Pods.processes(container).values() if "libjemalloc" not in p["maps"]]


def convert_on(scheduler: str, shared: Path, out: str, pod_limit: int) -> tuple[int, dict]:
    """``h5ngff convert --scheduler`` from the host, as a user of an existing cluster would, told
    the pods' memory (Dask's memory_limit is all a scheduler knows of it). umask 0: the pods' user
    (10001) writes chunks into the directories this root process creates."""
    result = subprocess.run(
        [
            *H5NGFF,
            *("convert", f"{shared}/in.h5:/volume/data", f"{shared}/{out}", *CONVERSION),
            *("--scheduler", scheduler, "--memory-per-worker", str(pod_limit), "--json"),
        ],
        capture_output=True,
        text=True,
        umask=0,
        timeout=240,
    )
    try:
        return result.returncode, json.loads(result.stdout)
    except json.JSONDecodeError:
        raise AssertionError(f"no JSON report (exit {result.returncode}): {result.stderr[-3000:]}") from None


def start_workers(pods: Pods, cluster: dict, scheduler: str, names: list[str], limit: str | None = None) -> float:
    """Play the worker pods; seconds until every one of them is connected to the scheduler."""
    from distributed import Client

    started = time.monotonic()
    for name in names:
        pods.play(worker_pod(cluster, name, scheduler, limit))
    with Client(scheduler, timeout=60) as client:
        client.wait_for_workers(len(names), timeout=180)
        return time.monotonic() - started


def stop_workers(pods: Pods, scheduler: str, names: list[str]) -> None:
    """Remove the worker pods, and wait until the scheduler has let them go (the next pods'
    conversion must see only its own workers)."""
    from distributed import Client

    pods.remove(*names)
    with Client(scheduler, timeout=60) as client:
        deadline = time.monotonic() + 60
        while client.scheduler_info(n_workers=-1)["workers"] and time.monotonic() < deadline:
            time.sleep(0.2)


@dataclass
class PodRun:
    """One conversion on worker pods, with what the host saw of them."""

    code: int
    report: dict
    #: each worker container's memory limit, as its cgroup holds it
    limits: list[int | None]
    #: the command lines of worker-pod processes without jemalloc mapped
    without_jemalloc: list[str]
    #: OOM kills the kernel counted in the worker containers' cgroups
    kernel_kills: int
    #: the most any worker pod pinned (anon + shmem + unevictable) before the conversion
    idle: int
    #: the least of the worker pods' pinned peaks during it (h5ngff's pod sampler, every 25 ms)
    peak: int
    #: seconds from ``podman kube play`` of the worker pods until both were connected
    start_seconds: float


@dataclass
class ClusterPods:
    """The rendered DaskCluster's scheduler pod, running; worker pods come and go per run."""

    pods: Pods
    cluster: dict
    scheduler: str
    scheduler_container: str
    shared: Path

    @property
    def planned_limit(self) -> int:
        from h5ngff.units import parse_bytes

        return parse_bytes(self.cluster["spec"]["worker"]["spec"]["containers"][0]["resources"]["limits"]["memory"])


@pytest.fixture(scope="module")
def cluster_pods(image, shared, tmp_path_factory):
    from distributed import Client

    cluster = render_cluster(image, shared)
    with Pods(tmp_path_factory.mktemp("pods")) as pods:
        (container,) = pods.play(as_pod(podman_pods.unique("scheduler"), cluster["spec"]["scheduler"]["spec"]))
        scheduler = f"tcp://{Pods.address(container)}:8786"
        with Client(scheduler, timeout=60):
            pass  # it answers
        yield ClusterPods(pods, cluster, scheduler, container, shared)


def run_worker_pods(at: ClusterPods, out: str, limit: int | None = None) -> PodRun:
    """Two worker pods as rendered (with ``limit`` instead of the planned memory limit where
    given), and ``h5ngff convert --scheduler`` on them, sampled from the host."""
    from h5ngff.backends.podwatch import PodWatcher

    names = [podman_pods.unique("worker") for _ in range(2)]
    seconds = start_workers(at.pods, at.cluster, at.scheduler, names, f"{limit // MiB}Mi" if limit else None)
    try:
        containers = [f"{n}-worker" for n in names]
        without = [cmd for c in containers for cmd in processes_without_jemalloc(c)]
        watcher = PodWatcher()
        for name, container in zip(names, containers):
            watcher.watch(name, Pods.cgroup(container), Pods.main_pid(container))
        watcher.sample()
        idle = max(p.pinned for p in watcher.peaks.values())
        watcher.start()
        try:
            code, report = convert_on(at.scheduler, at.shared, out, at.planned_limit)
        finally:
            watcher.stop()
        return PodRun(
            code=code,
            report=report,
            limits=[Pods.cgroup(c).limit() for c in containers],
            without_jemalloc=without,
            kernel_kills=sum(Pods.cgroup(c).oom_kills() for c in containers),
            idle=idle,
            peak=min(p.pinned for p in watcher.peaks.values()),
            start_seconds=seconds,
        )
    finally:
        stop_workers(at.pods, at.scheduler, names)


@pytest.fixture(scope="module")
def at_planned_limit(cluster_pods) -> PodRun:
    return run_worker_pods(cluster_pods, "pods.ome.zarr")


def test_worker_pods_succeed_at_the_planned_limit(cluster_pods, at_planned_limit, host_reference, shared):
    run = at_planned_limit
    planned = cluster_pods.planned_limit
    assert run.limits == [planned, planned]  # the pod's limit is a real cgroup limit
    assert run.code == 0 and run.report["status"] == "Succeeded", run.report.get("message")
    assert [w["oom_kills"] for w in run.report["workers"]] == [0, 0] and run.kernel_kills == 0
    assert tree_differences(host_reference, shared / "pods.ome.zarr") == []
    print(
        f"worker pods connected {run.start_seconds:.1f} s after kube play (image present); planned limit "
        f"{planned / MiB:.0f} MiB, pinned idle {run.idle / MiB:.0f} MiB, pinned peak {run.peak / MiB:.0f} MiB"
    )


def test_jemalloc_is_mapped_in_every_process_of_the_pods(cluster_pods, at_planned_limit, image, shared):
    """Every process of the worker pods (tini, the nanny, the worker, its resource tracker) and of
    the scheduler pod. Negative control: a pod rendered for ``allocator: glibc`` has processes
    without it, and the check names them."""
    at = cluster_pods
    assert at_planned_limit.without_jemalloc == []
    assert len(Pods.processes(at.scheduler_container)) >= 2
    assert processes_without_jemalloc(at.scheduler_container) == []
    name = podman_pods.unique("glibc")
    start_workers(at.pods, render_cluster(image, shared, allocator="glibc"), at.scheduler, [name])
    try:
        assert any("dask worker" in cmd for cmd in processes_without_jemalloc(f"{name}-worker"))
    finally:
        stop_workers(at.pods, at.scheduler, [name])


def test_worker_pods_below_their_pinned_peak_are_oom_killed_and_the_report_says_so(cluster_pods, at_planned_limit):
    """A limit half-way between what the pods pin idle and at their peak: the workers start, and
    the kernel must kill them. The report of the existing cluster (--scheduler) counts the
    kernel's kills and quotes the limit that held. Negative control: the run at the planned
    limit, whose report and kernel counters say 0 (test_worker_pods_succeed_at_the_planned_limit)."""
    before = at_planned_limit
    limit = (before.idle + before.peak) // 2 // MiB * MiB
    assert before.peak - limit >= 8 * MiB and limit - before.idle >= 8 * MiB, (before.idle, before.peak)
    run = run_worker_pods(cluster_pods, "oom.ome.zarr", limit)
    reported = sum(w["oom_kills"] for w in run.report["workers"])
    assert run.limits == [limit, limit]
    assert run.code != 0 and run.report["status"] == "Failed" and run.report["reason"] == "OOMKilled", run.report
    assert f"OOMKilled by the kernel (pod limit {limit // MiB} MiB)" in run.report["message"], run.report["message"]
    # The client reads the events when the run fails; a worker still running may be killed after.
    assert 1 <= reported <= run.kernel_kills, (reported, run.kernel_kills)
    # each killed worker's limit is the one its pod held (one never killed has no exit to tell it)
    assert {w["pod_limit"] for w in run.report["workers"] if w["oom_kills"]} == {limit}
    print(
        f"below the pinned peak ({limit / MiB:.0f} MiB): {reported} OOM kill(s) reported, {run.kernel_kills} by the kernel"
    )


def test_the_runner_job_runs_under_tini(image, shared, tmp_path):
    """The runner Job's container as the operator renders it, started by podman: the image's
    entrypoint runs its args. Negative control: the old manifest's ``command`` replaces tini."""
    from h5ngff.job import parse_manifest
    from h5ngff.operator.schema.policy import TenantPolicy
    from h5ngff.clirender import RenderOptions, render_objects

    manifest = parse_manifest(job_manifest(image, shared))
    policy = TenantPolicy(allowed_volume_types=("hostPath", "emptyDir"))
    (job,) = [o for o in render_objects(manifest, RenderOptions(image=image, policy=policy)) if o["kind"] == "Job"]
    template = job["spec"]["template"]["spec"]
    with Pods(tmp_path) as pods:
        (runner,) = pods.play(as_pod(podman_pods.unique("runner"), template))
        started = inspect(runner)
        assert [started["Path"], *started["Args"][:3]] == ["/usr/bin/tini", "--", "h5ngff", "runner"], started["Args"]
        old = json.loads(json.dumps(template))
        old["containers"][0]["command"] = old["containers"][0]["args"][:2]
        old["containers"][0]["args"] = old["containers"][0]["args"][2:]
        (bypass,) = pods.play(as_pod(podman_pods.unique("runner-old"), old))
        assert inspect(bypass)["Path"] == "h5ngff"
    assert os.path.exists(shared / "in.h5")  # the runner pods had the volume and touched nothing
