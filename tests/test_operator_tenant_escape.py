"""Ways around the tenant policy (operator/schema/policy.py) through an image it allows, each closed:

1. the job's credentials Secret reaches the pods as named keys only, never ``envFrom`` (a key
   LD_PRELOAD or PYTHONPATH of the Secret would run code in the runner, which holds a token);
2. no volume may be mounted at, under or over the image's system paths (a ConfigMap as
   ``sitecustomize.py``, a volume over site-packages, /etc, the service-account token), nor a
   volume the tenant writes over HOME (/tmp), where Python reads user site-packages;
3. a DaskCluster the runner (any allowed image) creates is checked against the policy and its
   ConversionJob, and deleted when it asks for more (operator/controller/guard.py), because RBAC cannot
   limit ``create`` to some pod specs.

New names are imported inside the tests, so on the code before the fix each test fails on its
own assertion (or import) rather than all of them at collection. Run once against the operator
at 9bb18a8: every test fails there except the negative controls (a volume elsewhere, an emptyDir
over HOME) and the guard that ``spec.pod.env`` does not exist.
"""

from __future__ import annotations

import posixpath

import copy
import re
from pathlib import Path

import pytest

from h5ngff.backends.kubernetes import KubernetesBackend, build_dask_cluster
from h5ngff.errors import SpecError
from h5ngff.jobspec import Owner, parse_job_spec
from h5ngff.operator.controller.manifests import build_runner_job
from h5ngff.operator.schema.policy import TenantPolicy, policy_violations
from h5ngff.planner import DEFAULT_CONSTANTS, DatasetInfo, make_plan
from operator_harness import DASK_RES, emulator, fast_config, manifest, operator_running, wait_for
from test_operator_kmock import SPEC

ROOT = Path(__file__).resolve().parents[1]
IMAGE = "registry.example/h5ngff:1"
POLICY = TenantPolicy(allowed_images=("registry.example/*",), allowed_service_accounts=("h5ngff-runner",))
ROGUE_IMAGE = "evil.example/miner:1"
DEFAULT_IMAGE = "ghcr.io/h5ngff/h5ngff:1"  #: the operator's --image


def job_spec(**extra):
    """A valid ConversionJob spec with the job's own storage and account (as test_operator_manifests')."""
    base = {
        "source": {"path": "/data/in.h5", "dataset": "/volume/data"},
        "output": {"path": "/data/out.ome.zarr", "overwrite": True},
        "resources": {"workers": 3, "threadsPerWorker": 2, "memoryPerWorker": "2Gi"},
        "pod": {
            "volumes": [{"name": "data", "persistentVolumeClaim": {"claimName": "scans"}}],
            "volumeMounts": [{"name": "data", "mountPath": "/data"}],
            "serviceAccountName": "h5ngff-runner",
            "workingDir": "/data",
        },
    }
    return parse_job_spec({**base, **extra})


def plan_for(spec, allocator="jemalloc"):
    ds = DatasetInfo(shape=(128, 512, 512), dtype="<u2", itemsize=2)
    return make_plan(
        ds,
        spec.conversion(),
        KubernetesBackend(Owner("ns", "j", "u"), image="img").capacity(),
        DEFAULT_CONSTANTS,
        allocator,
    )


def _containers(pod_spec: dict) -> list[dict]:
    return [c for key in ("containers", "initContainers") for c in pod_spec.get(key) or ()]


# --- 1. credentials as named keys -----------------------------------------------------------------


def test_credentials_reach_runner_and_workers_as_named_keys_never_as_the_whole_secret():
    spec = job_spec(pod={"credentialsSecret": "s3-writer"})
    runner = build_runner_job(Owner("science", "scan", "u"), spec, attempt=1, default_image=IMAGE)
    cluster = build_dask_cluster(plan_for(spec), Owner("science", "scan", "u"), IMAGE, spec.pod)
    pods = [runner["spec"]["template"]["spec"], cluster["spec"]["worker"]["spec"], cluster["spec"]["scheduler"]["spec"]]
    containers = [c for p in pods for c in _containers(p)]
    assert not [c["name"] for c in containers if "envFrom" in c]
    refs = [(c["name"], e) for c in containers for e in c.get("env") or () if "valueFrom" in e]
    assert {name for name, _ in refs} == {"runner", "worker"}  # the scheduler touches no data
    for _, e in refs:
        assert e["valueFrom"] == {"secretKeyRef": {"name": "s3-writer", "key": e["name"], "optional": True}}
    names = {e["name"] for _, e in refs}
    assert {
        "AWS_ACCESS_KEY_ID",
        "AWS_SECRET_ACCESS_KEY",
        "AWS_SESSION_TOKEN",
        "AWS_REGION",
        "AWS_DEFAULT_REGION",
        "AWS_ENDPOINT_URL",
    } <= names
    assert not {n for n in names if not n.startswith("AWS_")}  # never LD_PRELOAD, PYTHONPATH, ...


def test_the_credential_keys_cover_what_the_s3_store_reads_from_the_environment():
    """Every AWS_* variable engine/stores reads is a credential key, or deliberately left out:
    the shared-file variables name files whose profiles may run a ``credential_process``, and a web
    identity token file is the cluster's to mount (EKS's pod identity webhook sets it), not a key."""
    from h5ngff.k8s import CREDENTIAL_ENV

    read = set()
    for path in (ROOT / "src/h5ngff/engine/stores").glob("*.py"):
        read |= set(re.findall(r"\b(AWS_[A-Z0-9_]+)\b", path.read_text()))
    files_and_profiles = {
        "AWS_CONFIG_FILE",
        "AWS_SHARED_CREDENTIALS_FILE",
        "AWS_PROFILE",
        "AWS_DEFAULT_PROFILE",
        "AWS_WEB_IDENTITY_TOKEN_FILE",
    }
    assert read - files_and_profiles <= set(CREDENTIAL_ENV), read - set(CREDENTIAL_ENV)
    assert not files_and_profiles & set(CREDENTIAL_ENV)
    assert len(set(CREDENTIAL_ENV)) == len(CREDENTIAL_ENV)


def test_a_job_cannot_set_environment_variables_at_all():
    """There is no spec.pod.env: LD_PRELOAD or PYTHONPATH cannot come from the spec."""
    with pytest.raises(SpecError, match="env"):
        job_spec(pod={"env": [{"name": "LD_PRELOAD", "value": "/data/evil.so"}]})


# --- 2. mounts over the image ---------------------------------------------------------------------

REFUSED_MOUNTS = [
    ("/usr/local/lib/python3.11/site-packages/sitecustomize.py", "sitecustomize.py"),  # a ConfigMap key via subPath
    ("/usr/local/lib/python3.11/site-packages/h5ngff", None),
    ("/usr/local/bin", None),
    ("/usr", None),
    ("/etc", None),
    ("/etc/ld.so.preload", "x"),
    ("/bin", None),
    ("/lib", None),
    ("/opt/venv", None),
    ("/proc", None),
    ("/sys", None),
    ("/dev", None),
    ("/var/run/secrets/kubernetes.io", None),
    ("/run", None),
    ("/", None),
    ("/var", None),
    ("//usr/local/lib", None),
    ("/./etc", None),
    ("/usr/local/", None),
    ("/data/../usr/lib", None),
    ("usr/lib", None),
]


@pytest.mark.parametrize(("path", "sub"), REFUSED_MOUNTS)
def test_a_volume_at_under_or_over_the_images_system_paths_is_refused(path, sub):
    mount = {"name": "code", "mountPath": path, **({"subPath": sub} if sub else {})}
    pod = {"volumes": [{"name": "code", "configMap": {"name": "evil"}}], "volumeMounts": [mount]}
    try:
        spec = job_spec(pod=pod)
    except SpecError as exc:  # the spec itself refuses some shapes (a relative mountPath)
        assert "mountPath" in str(exc)
        return
    (message,) = policy_violations(spec, POLICY, IMAGE, "h5ngff-runner")
    assert f"mountPath {path!r}" in message and "/usr" in message and "/etc" in message


@pytest.mark.parametrize("path", ["/data", "/tmp/in", "/scratch/out", "/usr2", "/data/etc", "/mnt/usr"])
def test_a_volume_elsewhere_is_allowed(path):
    """Negative control of the test above."""
    spec = job_spec(
        pod={
            "volumes": [{"name": "d", "configMap": {"name": "cfg"}}],
            "volumeMounts": [{"name": "d", "mountPath": path}],
        }
    )
    assert policy_violations(spec, POLICY, IMAGE, "h5ngff-runner") == []


@pytest.mark.parametrize(
    "path",
    [
        "/tmp",
        "/tmp/",
        "/tmp/.local",
        "/tmp/.local/lib/python3.11/site-packages",
        "/tmp/.config/dask",
        "/tmp/.aws",
        "//tmp/./.config",
    ],
)
@pytest.mark.parametrize(
    "volume",
    [
        {"persistentVolumeClaim": {"claimName": "scans"}},
        {"configMap": {"name": "evil"}},
        {"secret": {"secretName": "s"}},
    ],
)
def test_a_volume_the_tenant_writes_is_refused_over_home_where_python_dask_and_aws_read_start_up_code(path, volume):
    """HOME is /tmp: a claim there holding .local/lib/python3.11/site-packages/x.pth runs code in
    the runner (user site-packages), as ~/.config/dask preloads and ~/.aws credential_process do.
    A mountPath not in normal form (``/tmp/``, ``//tmp/./.config``) is refused before the policy
    looks at it (issue 41: the CRD and the model refuse it alike)."""
    pod = {"volumes": [{"name": "v", **volume}], "volumeMounts": [{"name": "v", "mountPath": path}]}
    if path != posixpath.normpath("/" + path.lstrip("/")):
        with pytest.raises(SpecError, match="normal form"):
            job_spec(pod=pod)
        return
    (message,) = policy_violations(job_spec(pod=pod), POLICY, IMAGE, "h5ngff-runner")
    assert f"mountPath {path!r}" in message and "HOME" in message and "emptyDir" in message


@pytest.mark.parametrize(
    ("path", "volume"),
    [
        ("/tmp", {"emptyDir": {"medium": "Memory"}}),
        ("/tmp/.config", {"emptyDir": {}}),
        ("/tmp/work", {"persistentVolumeClaim": {"claimName": "scans"}}),
    ],
)
def test_an_empty_dir_over_home_or_a_claim_under_it_is_allowed(path, volume):
    """Negative control of the test above: a fresh emptyDir holds no code, nor does a plain subdirectory."""
    spec = job_spec(pod={"volumes": [{"name": "v", **volume}], "volumeMounts": [{"name": "v", "mountPath": path}]})
    assert policy_violations(spec, POLICY, IMAGE, "h5ngff-runner") == []


# --- 3. DaskClusters the runner creates -------------------------------------------------------------


def _job(**pod):
    base = {
        "image": IMAGE,
        "volumes": [{"name": "data", "persistentVolumeClaim": {"claimName": "scans"}}],
        "volumeMounts": [{"name": "data", "mountPath": "/data"}],
        "credentialsSecret": "s3-writer",
    }
    return job_spec(pod={**base, **pod})


def _cluster(spec, allocator="jemalloc", library=None):
    image = spec.pod.image or DEFAULT_IMAGE  # as the runner gets it (manifests.runner_spec)
    return build_dask_cluster(
        plan_for(spec, allocator), Owner("science", "scan", "u"), image, spec.pod, allocator_library=library
    )


def _violations(cluster, spec):
    from h5ngff.operator.schema.daskpolicy import dask_cluster_violations

    return dask_cluster_violations(cluster, spec, POLICY, DEFAULT_IMAGE, "h5ngff-runner")


@pytest.mark.parametrize(
    ("allocator", "library"), [("jemalloc", "/usr/local/lib/libjemalloc.so.2"), ("jemalloc", None), ("glibc", None)]
)
def test_a_cluster_as_the_runner_builds_it_passes(allocator, library):
    spec = _job()
    assert _violations(_cluster(spec, allocator, library), spec) == []
    assert _violations(_cluster(job_spec()), job_spec()) == []  # no credentials, no image of its own


PLACED = {
    "nodeSelector": {"dedicated": "imaging"},
    "tolerations": [{"key": "dedicated", "operator": "Equal", "value": "imaging", "effect": "NoSchedule"}],
}


def test_a_cluster_placed_as_its_job_asks_passes_and_placed_otherwise_is_refused():
    placed = _job(**PLACED)
    cluster = _cluster(placed)
    assert _worker(cluster)["tolerations"] == PLACED["tolerations"]  # the builders carry the job's placement
    assert _violations(cluster, placed) == []
    # The same cluster held against a job that asked for no placement: both fields refused, on both pods.
    violations = _violations(cluster, _job())
    assert {v.split(" ")[0] for v in violations} == {
        f"spec.{role}.spec.{key}" for role in ("worker", "scheduler") for key in PLACED
    }, violations


def _worker(c):
    return c["spec"]["worker"]["spec"]


def _env(c, name, value=None, **extra):
    _worker(c)["containers"][0]["env"].append(
        {"name": name, **({"value": value} if value is not None else {}), **extra}
    )


ROGUE = {
    "worker image": (lambda c: _worker(c)["containers"][0].update(image=ROGUE_IMAGE), ROGUE_IMAGE),
    "scheduler image": (
        lambda c: c["spec"]["scheduler"]["spec"]["containers"][0].update(image=ROGUE_IMAGE),
        ROGUE_IMAGE,
    ),
    "init container": (
        lambda c: _worker(c).update(initContainers=[{"name": "x", "image": ROGUE_IMAGE}]),
        "initContainers",
    ),
    "hostPath volume": (
        lambda c: _worker(c)["volumes"].append({"name": "root", "hostPath": {"path": "/"}}),
        "hostPath",
    ),
    "another claim": (
        lambda c: _worker(c)["volumes"].append({"name": "other", "persistentVolumeClaim": {"claimName": "theirs"}}),
        "spec.pod.volumes",
    ),
    "hostNetwork": (lambda c: _worker(c).update(hostNetwork=True), "hostNetwork"),
    "hostPID": (lambda c: _worker(c).update(hostPID=True), "hostPID"),
    "privileged": (lambda c: _worker(c)["containers"][0]["securityContext"].update(privileged=True), "securityContext"),
    "capabilities": (
        lambda c: _worker(c)["containers"][0]["securityContext"].update(capabilities={"add": ["SYS_ADMIN"]}),
        "securityContext",
    ),
    "root user": (lambda c: _worker(c)["securityContext"].update(runAsUser=0, runAsNonRoot=False), "securityContext"),
    "token": (lambda c: _worker(c).update(automountServiceAccountToken=True), "automountServiceAccountToken"),
    "service account": (lambda c: _worker(c).update(serviceAccountName="ci-deployer"), "ci-deployer"),
    "LD_PRELOAD of a volume": (lambda c: _env(c, "LD_PRELOAD", "/data/evil.so"), "LD_PRELOAD"),
    "LD_PRELOAD climbing out": (lambda c: _env(c, "LD_PRELOAD", "/usr/../data/evil.so"), "LD_PRELOAD"),
    # Issue 41: values are judged as the container sees them, after Kubernetes' $(VAR) expansion.
    "LD_PRELOAD through $(VAR) expansion": (
        lambda c: (
            _env(c, "MALLOC_ARENA_MAX", "../../data/evil.so"),
            _env(c, "LD_PRELOAD", "/usr/$(MALLOC_ARENA_MAX)"),
        ),
        "after $(VAR) expansion",
    ),
    "HOME through $(VAR) expansion": (
        lambda c: (
            _worker(c)["containers"][0]["env"].__setitem__(
                slice(None), [e for e in _worker(c)["containers"][0]["env"] if e["name"] != "HOME"]
            ),
            _env(c, "MALLOC_ARENA_MAX", "/data"),
            _env(c, "HOME", "$(MALLOC_ARENA_MAX)"),
        ),
        "HOME must be",
    ),
    # Issue 41: the job's own claim mounted at HOME in a Dask container (~/.local runs code).
    "the job's claim at HOME": (
        lambda c: _worker(c)["containers"][0]["volumeMounts"].append({"name": "data", "mountPath": "/tmp/.local"}),
        "HOME",
    ),
    # Issue 41: the working directory (a tenant's volume) on the import path of python -c.
    "no PYTHONSAFEPATH": (
        lambda c: _worker(c)["containers"][0].update(
            env=[e for e in _worker(c)["containers"][0]["env"] if e["name"] != "PYTHONSAFEPATH"]
        ),
        "PYTHONSAFEPATH=1",
    ),
    "PYTHONSAFEPATH off": (
        lambda c: _worker(c)["containers"][0].update(
            env=[
                {**e, "value": "0"} if e["name"] == "PYTHONSAFEPATH" else e for e in _worker(c)["containers"][0]["env"]
            ]
        ),
        "PYTHONSAFEPATH",
    ),
    "PYTHONPATH": (lambda c: _env(c, "PYTHONPATH", "/data"), "PYTHONPATH"),
    "PYTHONSTARTUP": (lambda c: _env(c, "PYTHONSTARTUP", "/data/x.py"), "PYTHONSTARTUP"),
    "Dask preload": (lambda c: _env(c, "DASK_DISTRIBUTED__WORKER__PRELOAD", "/data/x.py"), "PRELOAD"),
    "HOME on a volume": (
        lambda c: [e.update(value="/data") for e in _worker(c)["containers"][0]["env"] if e["name"] == "HOME"],
        "HOME",
    ),
    "envFrom": (
        lambda c: _worker(c)["containers"][0].update(envFrom=[{"secretRef": {"name": "s3-writer"}}]),
        "envFrom",
    ),
    "another Secret's key": (
        lambda c: _env(
            c, "AWS_ACCESS_KEY_ID", valueFrom={"secretKeyRef": {"name": "admin", "key": "AWS_ACCESS_KEY_ID"}}
        ),
        "Secret",
    ),
    "a credential key as PYTHONPATH": (
        lambda c: _env(c, "PYTHONPATH", valueFrom={"secretKeyRef": {"name": "s3-writer", "key": "AWS_REGION"}}),
        "PYTHONPATH",
    ),
    "mount over site-packages": (
        lambda c: _worker(c)["containers"][0]["volumeMounts"].append(
            {"name": "data", "mountPath": "/usr/local/lib/python3.11/site-packages/sitecustomize.py", "subPath": "x.py"}
        ),
        "sitecustomize",
    ),
    "public scheduler": (lambda c: c["spec"]["scheduler"]["service"].update(type="LoadBalancer"), "LoadBalancer"),
    # Placement: the pods go where the job asked (here nowhere in particular), and nowhere else.
    "nodeName, past the scheduler and its taints": (
        lambda c: _worker(c).update(nodeName="control-plane-0"),
        "nodeName",
    ),
    "priorityClassName, preempting other tenants": (
        lambda c: _worker(c).update(priorityClassName="system-cluster-critical"),
        "priorityClassName",
    ),
    "schedulerName": (lambda c: _worker(c).update(schedulerName="my-scheduler"), "schedulerName"),
    "runtimeClassName": (lambda c: _worker(c).update(runtimeClassName="unconfined"), "runtimeClassName"),
    "affinity": (
        lambda c: _worker(c).update(
            affinity={"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": []}}}
        ),
        "affinity",
    ),
    "a toleration the job did not ask for": (
        lambda c: _worker(c).update(
            tolerations=[{"key": "node-role.kubernetes.io/control-plane", "operator": "Exists", "effect": "NoSchedule"}]
        ),
        "tolerations",
    ),
    "a nodeSelector the job did not ask for": (
        lambda c: c["spec"]["scheduler"]["spec"].update(nodeSelector={"dedicated": "team-b"}),
        "nodeSelector",
    ),
    "a container command": (lambda c: _worker(c)["containers"][0].update(command=["sh", "-c", "id"]), "command"),
    "a lifecycle hook": (
        lambda c: _worker(c)["containers"][0].update(lifecycle={"postStart": {"exec": {"command": ["id"]}}}),
        "lifecycle",
    ),
    "a port of the node": (lambda c: _worker(c)["containers"][0]["ports"][0].update(hostPort=8788), "hostPort"),
    "a scheduler on external IPs": (
        lambda c: c["spec"]["scheduler"]["service"].update(externalIPs=["203.0.113.7"]),
        "externalIPs",
    ),
    "an annotation the Dask Operator copies onto the pods": (
        lambda c: (
            c["metadata"]
            .setdefault("annotations", {})
            .update({"container.apparmor.security.beta.kubernetes.io/worker": "unconfined"})
        ),
        "apparmor",
    ),
    "an annotation of the worker group": (
        lambda c: c["spec"]["worker"].update(
            metadata={"annotations": {"container.apparmor.security.beta.kubernetes.io/worker": "unconfined"}}
        ),
        "spec.worker.metadata",
    ),
    "an exec probe": (
        lambda c: c["spec"]["scheduler"]["spec"]["containers"][0].update(
            livenessProbe={"exec": {"command": ["sh", "-c", "id"]}}
        ),
        "livenessProbe",
    ),
    "a probe that makes the kubelet call the node's network": (
        lambda c: c["spec"]["scheduler"]["spec"]["containers"][0]["readinessProbe"]["httpGet"].update(
            host="169.254.169.254"
        ),
        "readinessProbe",
    ),
    "a probe on a worker": (
        lambda c: _worker(c)["containers"][0].update(livenessProbe={"tcpSocket": {"port": 22, "host": "10.0.0.1"}}),
        "livenessProbe",
    ),
    "a second container shaped like the worker": (
        lambda c: _worker(c)["containers"].append({**copy.deepcopy(_worker(c)["containers"][0]), "name": "sidecar"}),
        "exactly one container",
    ),
    "a scheduler on a node port": (
        lambda c: c["spec"]["scheduler"]["service"]["ports"][0].update(nodePort=30786),
        "nodePort",
    ),
}


@pytest.mark.parametrize("case", sorted(ROGUE))
def test_a_cluster_asking_for_more_than_its_job_and_the_policy_allow_is_refused(case):
    change, word = ROGUE[case]
    spec = _job()
    cluster = _cluster(spec)
    assert _violations(copy.deepcopy(cluster), spec) == []  # negative control: the same cluster before the change
    change(cluster)
    violations = _violations(cluster, spec)
    assert violations and word in " ".join(violations), violations


def test_a_cluster_no_conversionjob_owns_is_refused():
    from h5ngff.operator.schema.daskpolicy import dask_cluster_violations

    spec = _job()
    (message,) = dask_cluster_violations(_cluster(spec), None, POLICY, IMAGE, "h5ngff-runner")
    assert "'scan-dask' is not the cluster of any ConversionJob" in message


# --- 3, against the real operator -------------------------------------------------------------------

DASK_PATH = "/apis/kubernetes.dask.org/v1/namespaces/default/daskclusters"


async def _post_cluster(c, cluster: dict) -> None:
    resp = await c.k.post(DASK_PATH, json=cluster)
    assert resp.status in (200, 201), await resp.text()


def _as_runner_builds(c, name: str, image: str = IMAGE) -> dict:
    spec = parse_job_spec(SPEC)
    cluster = build_dask_cluster(plan_for(spec), Owner("default", name, c.cj(name)["metadata"]["uid"]), IMAGE, spec.pod)
    for role in ("worker", "scheduler"):
        cluster["spec"][role]["spec"]["containers"][0]["image"] = image
    cluster["metadata"]["resourceVersion"] = "1"
    return cluster


@pytest.mark.slow
@pytest.mark.integration
@pytest.mark.asyncio
@pytest.mark.timeout(120)
async def test_the_operator_deletes_a_rogue_dask_cluster_and_keeps_the_one_the_runner_builds():
    async with emulator() as c, operator_running(fast_config(c.url)):
        for name in ("scan", "other"):  # two outputs: one writer per output
            await c.apply(manifest(name, {**SPEC, "output": {"path": f"/data/{name}.ome.zarr"}}))
        await wait_for(lambda: {"scan-runner-1", "other-runner-1"} <= set(c.jobs()), what="runner Jobs")
        await _post_cluster(c, _as_runner_builds(c, "scan"))
        await _post_cluster(c, _as_runner_builds(c, "other", image=ROGUE_IMAGE))
        stray = _as_runner_builds(c, "scan")
        stray["metadata"]["name"] = "stray-dask"
        await _post_cluster(c, stray)
        # Another team's notebook cluster in a served namespace: none of h5ngff's business.
        notebook = _as_runner_builds(c, "scan")
        notebook["metadata"] = {
            "name": "notebook",
            "namespace": "default",
            "resourceVersion": "1",
            "labels": {"team": "imaging"},
        }
        notebook["spec"]["worker"]["spec"]["hostNetwork"] = True
        await _post_cluster(c, notebook)
        await wait_for(
            lambda: not {"other-dask", "stray-dask"} & set(c.live(DASK_RES)), what="the rogue clusters deleted"
        )

        from h5ngff.operator.controller.guard import checked, skipped

        await wait_for(lambda: checked["default", "scan-dask"] >= 1, what="the legit cluster checked")
        await wait_for(lambda: skipped["default", "notebook"] >= 1, what="the notebook cluster seen")
        assert {"scan-dask", "notebook"} <= set(c.live(DASK_RES))

        # Kopf posts its events in the background, after the handler that deleted the cluster: wait
        # for the two that this test is about, not for the first one to arrive.
        def denials() -> dict:
            return {e["involvedObject"]["name"]: e for e in c.events() if e.get("reason") == "PolicyDenied"}

        on = await wait_for(lambda: denials() if {"other", "scan"} <= set(denials()) else None, what="PolicyDenied")
        assert on["other"]["involvedObject"]["kind"] == "ConversionJob" and ROGUE_IMAGE in on["other"]["message"]
        assert on["scan"]["type"] == "Warning" and "'stray-dask' is not ConversionJob scan's" in on["scan"]["message"]
        # Edits the docs say keep the conversion (another allowed image, placement) end no attempt:
        # the cluster is judged against the attempt that made it, on every event and restart.
        await c.edit("scan", {"spec": {"pod": {"image": "registry.example/h5ngff:2", "nodeSelector": {"pool": "b"}}}})
        before = checked["default", "scan-dask"]
        resp = await c.k.patch(
            f"{DASK_PATH}/scan-dask",
            json={"metadata": {"labels": {"touched": "yes"}}},
            headers={"Content-Type": "application/merge-patch+json"},
        )
        assert resp.status == 200, await resp.text()
        await wait_for(lambda: checked["default", "scan-dask"] > before, what="the legit cluster checked again")
        assert "scan-dask" in c.live(DASK_RES)
        # ... and a rogue change of it is not kept.
        rogue = copy.deepcopy(c.live(DASK_RES)["scan-dask"]["spec"])
        rogue["worker"]["spec"]["hostNetwork"] = True
        resp = await c.k.patch(
            f"{DASK_PATH}/scan-dask", json={"spec": rogue}, headers={"Content-Type": "application/merge-patch+json"}
        )
        assert resp.status == 200, await resp.text()
        await wait_for(lambda: "scan-dask" not in c.live(DASK_RES), what="the changed cluster deleted")
        assert set(c.live(DASK_RES)) == {"notebook"}


# --- 4. Tenant code never runs in the pods' Python processes (issue 41) --------------------------------


def _python_in(cwd: Path, env: dict[str, str]) -> str:
    """What ``python -c`` (as the Dask nanny starts each worker) imports as ``json`` when started in
    ``cwd`` (the container's workingDir, a tenant's volume) with ``env``."""
    import subprocess
    import sys

    code = "import json, sys; print(json.__file__)"
    run = subprocess.run([sys.executable, "-c", code], cwd=cwd, env=env, capture_output=True, text=True, timeout=60)
    return run.stdout.strip()


def test_a_package_on_the_working_directory_never_runs_in_the_runner_scheduler_or_workers(tmp_path):
    """The tenant's workingDir holds a module shadowing one every process imports: with the
    environment every container h5ngff builds carries (PYTHONSAFEPATH=1), Python does not put
    the working directory on the import path, so the tenant's module is not the one imported."""
    import os

    (tmp_path / "json.py").write_text("raise SystemExit('tenant code ran')\n")
    spec = _job(workingDir=str(tmp_path))
    runner = build_runner_job(Owner("science", "scan", "u"), spec, 1, DEFAULT_IMAGE)["spec"]["template"]["spec"]
    cluster = _cluster(spec)
    pod_specs = [runner, _worker(cluster), cluster["spec"]["scheduler"]["spec"]]
    base = {"PATH": os.environ.get("PATH", ""), "HOME": str(tmp_path)}
    assert [p["containers"][0].get("workingDir") for p in pod_specs[:2]] == [str(tmp_path)] * 2
    for pod_spec in pod_specs:
        (container,) = pod_spec["containers"]
        env = {e["name"]: e["value"] for e in container["env"] if "value" in e and e["name"] == "PYTHONSAFEPATH"}
        assert env == {"PYTHONSAFEPATH": "1"}, container["name"]
        imported = _python_in(tmp_path, {**base, **env})
        assert imported and not imported.startswith(str(tmp_path)), imported
    # Negative control: without it, the tenant's module is the one imported (the run exits early).
    assert _python_in(tmp_path, base) == ""
