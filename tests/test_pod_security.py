"""Every pod h5ngff creates or ships meets the ``restricted`` Pod Security Standard: the runner
Job's pod, the Dask scheduler and worker pods, and the operator's own Deployment from the Helm
chart. The checker (tests/pod_security.py) is written from the documented rules; each rule has
a negative control here showing it catches a pod that breaks it."""

from __future__ import annotations

import copy
import re
import sys
from pathlib import Path

import pytest

from h5ngff.backends.kubernetes import build_dask_cluster
from h5ngff.k8s import RUN_AS_GROUP, RUN_AS_USER, SCRATCH_PATH
from h5ngff.operator.controller.manifests import Owner, build_runner_job

sys.path.insert(0, str(Path(__file__).parent))
from pod_security import pod_specs, violations  # noqa: E402
from test_operator_manifests import job_spec, plan_for  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def created_objects() -> list[dict]:
    spec = job_spec()
    runner = build_runner_job(
        Owner("science", "scan-42", "uid"), spec, 1, "img:1", default_service_account="h5ngff-runner"
    )
    cluster = build_dask_cluster(plan_for(spec), Owner("science", "scan-42", "uid"), "img:1", spec.pod)
    return [runner, cluster]


def helm_deployment() -> dict:
    sys.path.insert(0, str(ROOT / "scripts"))
    import render_manifests as rm

    (deployment,) = [o for o in rm.render_objects({}) if o["kind"] == "Deployment"]
    return deployment


def all_pods() -> list[tuple[str, dict, dict]]:
    return [p for obj in [*created_objects(), helm_deployment()] for p in pod_specs(obj)]


PODS = all_pods()


@pytest.mark.parametrize("where, pod, annotations", PODS, ids=[p[0] for p in PODS])
def test_every_pod_meets_the_restricted_profile(where, pod, annotations):
    assert violations(pod, annotations) == []


def test_all_four_pods_are_checked():
    names = [p[0] for p in PODS]
    assert names[:3] == [
        "Job/scan-42-runner-1",
        "DaskCluster/scan-42-dask scheduler",
        "DaskCluster/scan-42-dask worker",
    ]
    assert len(names) == 4 and names[3].startswith("Deployment/") and names[3].endswith("-operator")


@pytest.mark.parametrize("where, pod, annotations", PODS[:3], ids=[p[0] for p in PODS[:3]])
def test_h5ngff_pods_run_as_the_images_user_on_a_read_only_root_with_scratch(where, pod, annotations):
    assert pod["securityContext"]["runAsUser"] == RUN_AS_USER and pod["securityContext"]["runAsGroup"] == RUN_AS_GROUP
    volumes = {v["name"]: v for v in pod["volumes"]}
    for c in pod["containers"]:
        assert c["securityContext"]["readOnlyRootFilesystem"] is True
        (scratch,) = [m for m in c["volumeMounts"] if m["mountPath"] == SCRATCH_PATH]
        # disk-backed: a tmpfs would charge Dask's spilled data to the planned pod memory limit
        assert volumes[scratch["name"]] == {"name": scratch["name"], "emptyDir": {}}
        assert {"name": "HOME", "value": SCRATCH_PATH} in c["env"]


def test_the_images_user_is_the_pods_user():
    """runAsNonRoot needs a numeric user; the pods name the Dockerfile's, so file ownership on
    the data volumes is what it was when the image's USER alone decided."""
    dockerfile = (ROOT / "docker/Dockerfile").read_text()
    (user,) = re.findall(r"^USER (\d+):(\d+)$", dockerfile, re.M)
    assert (int(user[0]), int(user[1])) == (RUN_AS_USER, RUN_AS_GROUP) and RUN_AS_USER != 0


def test_a_user_mount_at_tmp_replaces_the_scratch_volume():
    spec = job_spec(
        pod={
            "volumes": [{"name": "fast", "emptyDir": {"medium": "Memory"}}],
            "volumeMounts": [{"name": "fast", "mountPath": "/tmp"}],
        }
    )
    job = build_runner_job(Owner("ns", "j", "u"), spec, 1, "img")
    pod = job["spec"]["template"]["spec"]
    assert [m["mountPath"] for m in pod["containers"][0]["volumeMounts"]] == ["/tmp"]
    assert [v["name"] for v in pod["volumes"]] == ["fast"]


# --- negative controls: the checker catches each rule --------------------------------------------

RUNNER = PODS[0][1]


def _container(pod: dict) -> dict:
    return pod["containers"][0]


BREAKS = {
    # restricted
    "no runAsNonRoot": lambda p: (
        p["securityContext"].pop("runAsNonRoot"),
        _container(p)["securityContext"].pop("runAsNonRoot"),
    ),
    "container runAsNonRoot false": lambda p: _container(p)["securityContext"].update(runAsNonRoot=False),
    "runAsUser 0": lambda p: p["securityContext"].update(runAsUser=0),
    "container runAsUser 0": lambda p: _container(p)["securityContext"].update(runAsUser=0),
    "no seccomp": lambda p: (
        p["securityContext"].pop("seccompProfile"),
        _container(p)["securityContext"].pop("seccompProfile"),
    ),
    "seccomp Unconfined": lambda p: _container(p)["securityContext"].update(seccompProfile={"type": "Unconfined"}),
    "no allowPrivilegeEscalation": lambda p: _container(p)["securityContext"].pop("allowPrivilegeEscalation"),
    "allowPrivilegeEscalation true": lambda p: _container(p)["securityContext"].update(allowPrivilegeEscalation=True),
    "capabilities not dropped": lambda p: _container(p)["securityContext"].pop("capabilities"),
    "adds NET_RAW": lambda p: _container(p)["securityContext"]["capabilities"].update(add=["NET_RAW"]),
    "nfs volume": lambda p: p["volumes"].append({"name": "n", "nfs": {"server": "s", "path": "/"}}),
    # baseline
    "hostNetwork": lambda p: p.update(hostNetwork=True),
    "hostPID": lambda p: p.update(hostPID=True),
    "hostIPC": lambda p: p.update(hostIPC=True),
    "hostPath": lambda p: p["volumes"].append({"name": "h", "hostPath": {"path": "/"}}),
    "hostPort": lambda p: _container(p)["ports"].append({"containerPort": 80, "hostPort": 80}),
    "privileged": lambda p: _container(p)["securityContext"].update(privileged=True),
    "adds SYS_ADMIN": lambda p: _container(p)["securityContext"]["capabilities"].update(add=["SYS_ADMIN"]),
    "unsafe sysctl": lambda p: p["securityContext"].update(sysctls=[{"name": "kernel.msgmax", "value": "1"}]),
    "AppArmor Unconfined": lambda p: _container(p)["securityContext"].update(appArmorProfile={"type": "Unconfined"}),
    "SELinux user": lambda p: p["securityContext"].update(seLinuxOptions={"user": "root"}),
    "SELinux type": lambda p: _container(p)["securityContext"].update(seLinuxOptions={"type": "spc_t"}),
    "procMount Unmasked": lambda p: _container(p)["securityContext"].update(procMount="Unmasked"),
    "hostProcess": lambda p: p["securityContext"].update(windowsOptions={"hostProcess": True}),
    "privileged init container": lambda p: p.update(
        initContainers=[
            {
                **copy.deepcopy(_container(p)),
                "name": "init",
                "securityContext": {**_container(p)["securityContext"], "privileged": True},
            }
        ]
    ),
}


@pytest.mark.parametrize("name", BREAKS)
def test_the_checker_catches_a_pod_that_breaks_a_rule(name):
    pod = copy.deepcopy(RUNNER)
    BREAKS[name](pod)
    assert violations(pod) != [], name


def test_the_checker_catches_an_apparmor_annotation():
    assert violations(RUNNER, {"container.apparmor.security.beta.kubernetes.io/runner": "unconfined"})
    assert violations(RUNNER, {"container.apparmor.security.beta.kubernetes.io/runner": "runtime/default"}) == []


def test_pods_as_built_before_this_change_fail():
    """Negative control on the real builders: without the security contexts (as before
    issue 12) every h5ngff pod is refused by a namespace enforcing ``restricted``."""
    for where, pod, pod_annotations in PODS[:3]:
        bare = copy.deepcopy(pod)
        bare.pop("securityContext")
        for c in bare["containers"]:
            c.pop("securityContext")
        found = violations(bare, pod_annotations)
        assert any(v.startswith("Privilege Escalation") for v in found), where
        assert any(v.startswith("Running as Non-root") for v in found), where
        assert any(v.startswith("Seccomp") for v in found), where
        assert any(v.startswith("Capabilities") for v in found), where


# --- readOnlyRootFilesystem, for real: the Dask processes on a read-only root -------------------

RO_ROOT = """set -e
if [ -n "$KEEP" ]; then mkdir -p /run/h5ngff-keep && mount --bind "$KEEP" /run/h5ngff-keep; fi
mount -o remount,ro,bind /
if [ "$SCRATCH" = 1 ]; then
  mount -t tmpfs -o size=512m tmpfs /tmp
  if [ -n "$KEEP" ]; then mkdir -p "$KEEP" && mount --bind /run/h5ngff-keep "$KEEP"; fi
fi
exec "$@"
"""


def _read_only_root_works() -> str | None:
    import shutil
    import subprocess

    if shutil.which("unshare") is None:
        return "no unshare(1)"
    probe = subprocess.run(
        [
            "unshare",
            "--mount",
            "--propagation",
            "private",
            "sh",
            "-c",
            "mount -o remount,ro,bind / && ! touch /ro-probe",
        ],
        capture_output=True,
        timeout=30,
    )
    return (
        None
        if probe.returncode == 0
        else f"cannot make a read-only mount namespace here: {probe.stderr.decode()[:200]}"
    )


def _start(container: dict, tmp_path: Path, name: str, extra_args: list[str], extra_env: dict, scratch: bool):
    """Run a built container's command (``dask scheduler|worker …`` with its env) in a private
    mount namespace whose root filesystem is read-only, with a fresh /tmp only if ``scratch``
    (the pod's emptyDir)."""
    import os
    import subprocess

    script = tmp_path / "ro-root.sh"
    script.write_text(RO_ROOT)
    env = {
        **os.environ,
        **{e["name"]: e["value"] for e in container["env"]},
        **extra_env,
        "SCRATCH": "1" if scratch else "0",
        "PYTHONPATH": str(ROOT / "src"),
        "PYTHONDONTWRITEBYTECODE": "1",
        # A checkout under /tmp (with its .venv) would vanish under the scratch mount: the
        # script binds it back in. A pod's image has its code outside /tmp.
        "KEEP": str(ROOT) if str(ROOT.resolve()).startswith("/tmp/") else "",
    }
    args = [a.replace("$(DASK_WORKER_NAME)", name) for a in container["args"]]
    module = {"worker": "distributed.cli.dask_worker", "scheduler": "distributed.cli.dask_scheduler"}[args[1]]
    cmd = [
        "unshare",
        "--mount",
        "--propagation",
        "private",
        "sh",
        str(script),
        sys.executable,
        "-m",
        module,
        *args[2:],
        *extra_args,
    ]
    log = open(tmp_path / f"{name}.log", "w+")
    return subprocess.Popen(cmd, env=env, cwd="/", stdout=log, stderr=subprocess.STDOUT), log


@pytest.mark.slow
@pytest.mark.integration
@pytest.mark.timeout(180)
def test_the_scheduler_and_worker_run_on_a_read_only_root_with_the_scratch_volume(tmp_path):
    """The scheduler and worker containers as built (args, env with HOME=/tmp) start and compute
    with every filesystem read-only except the scratch /tmp; without the scratch volume the
    worker cannot start (negative control), so the emptyDir is what makes
    readOnlyRootFilesystem possible."""
    import socket

    from distributed import Client

    reason = _read_only_root_works()
    if reason:
        pytest.skip(reason)
    spec = job_spec(resources={"workers": 1, "threadsPerWorker": 1, "memoryPerWorker": "1Gi"}, pod={})
    cluster = build_dask_cluster(plan_for(spec), Owner("ns", "ro", "u"), "img", spec.pod)
    (scheduler,) = cluster["spec"]["scheduler"]["spec"]["containers"]
    (worker,) = cluster["spec"]["worker"]["spec"]["containers"]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    address = f"tcp://127.0.0.1:{port}"
    procs = []
    try:
        procs.append(
            _start(
                scheduler, tmp_path, "scheduler", ["--port", str(port), "--dashboard-address", ":0"], {}, scratch=True
            )
        )
        procs.append(
            _start(
                worker,
                tmp_path,
                "worker-ro",
                ["--dashboard-address", ":0"],
                {"DASK_SCHEDULER_ADDRESS": address},
                scratch=True,
            )
        )
        with Client(address, timeout=60) as client:
            client.wait_for_workers(1, timeout=90)
            (local_dir,) = client.run(lambda dask_worker: dask_worker.local_directory).values()
            assert local_dir.startswith("/tmp/")
            assert client.submit(lambda: sum(range(1000)), pure=False).result(timeout=60) == 499500

            def cannot_write_root() -> str:
                try:
                    open("/h5ngff-probe", "w")
                except OSError as exc:
                    return exc.strerror
                return "written"

            assert set(client.run(cannot_write_root).values()) == {"Read-only file system"}
            # negative control: the same worker without the scratch volume does not start
            bare, log = _start(
                worker,
                tmp_path,
                "worker-bare",
                ["--dashboard-address", ":0"],
                {"DASK_SCHEDULER_ADDRESS": address},
                scratch=False,
            )
            procs.append((bare, log))
            code = bare.wait(timeout=90)
            log.seek(0)
            text = log.read()
            # Python's tempfile finds no writable directory on the read-only root
            assert code != 0 and "No usable temporary directory" in text, text[-2000:]
            assert len(client.scheduler_info()["workers"]) == 1
    finally:
        for proc, log in procs:
            proc.terminate()
            try:
                proc.wait(30)
            except Exception:
                proc.kill()
            log.close()
