"""One output, one writer: the output Lease's key and where the Lease lives (operator/controller/lease.py).

Pure tests of ``output_key`` (every spelling of one location is one key) and of nesting, then the
real kopf operator against the KMock emulator: jobs in two namespaces on one bucket prefix, nested
outputs, a Lease whose holder vanished, and a run started by a build that kept Leases in the job's
namespace. "Nothing happened" is checked after counted reconcile passes, never after a sleep.

Run once against the operator at 9bb18a8: every test fails there but two pure guards (three or
more leading slashes, and bucket URL spellings, which normpath already folded) and the chart's
POD_NAMESPACE check (it renders this tree's chart).
"""

from __future__ import annotations

import pytest

from h5ngff.errors import SpecError

from h5ngff.jobspec import GROUP, parse_job_spec
from h5ngff.operator.controller.lease import lease_name, output_key
from operator_harness import LEASE_RES, emulator, fast_config, manifest, operator_running, passes, wait_for
from test_operator_kmock import SPEC

COMPLETE = {"active": 0, "succeeded": 1, "conditions": [{"type": "Complete", "status": "True"}]}
SOURCE = {"path": "/data/in.h5", "dataset": "/volume/data"}
CLAIM = {
    "volumes": [{"name": "data", "persistentVolumeClaim": {"claimName": "scans"}}],
    "volumeMounts": [{"name": "data", "mountPath": "/data"}],
}
LEASES_PATH = "/apis/coordination.k8s.io/v1/namespaces/{ns}/leases"
#: The operator's namespace in these tests: neither job's.
OPS = "h5ngff-system"

pytestmark = [pytest.mark.timeout(120), pytest.mark.integration]


def key(path: str, pod: dict | None = None, namespace: str | None = None) -> str:
    spec = parse_job_spec({"source": SOURCE, "output": {"path": path}, "pod": pod or {}})
    return output_key(spec, namespace) if namespace else output_key(spec)


# --- keys -----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "path, pod",
    [
        ("//data/out.ome.zarr", {}),
        ("///data//./out.ome.zarr/", {}),
        ("out.ome.zarr", {"workingDir": "//data"}),
        ("./out.ome.zarr", {"workingDir": "//data/"}),
    ],
    ids=["double-slash-path", "many-slashes", "double-slash-workingDir", "double-slash-workingDir-trailing"],
)
def test_every_spelling_of_a_plain_path_is_one_key(path, pod):
    # POSIX (and so posixpath.normpath) keeps a leading "//" apart from "/"; no volume does.
    assert key(path, pod) == key("/data/out.ome.zarr") == "path:/data/out.ome.zarr"


def test_a_path_with_a_leading_double_slash_is_the_same_claim():
    assert key("//data/out.ome.zarr", CLAIM) == key("/data/out.ome.zarr", CLAIM) == "pvc:scans:/out.ome.zarr"
    # A mountPath is in normal form since issue 41 (the CRD and the model refuse "//data" alike).
    with pytest.raises(SpecError, match="normal form"):
        key("/data/out.ome.zarr", {**CLAIM, "volumeMounts": [{"name": "data", "mountPath": "//data"}]})
    sub = {**CLAIM, "volumeMounts": [{"name": "data", "mountPath": "/mnt", "subPath": "//data"}]}
    assert key("/mnt/out.ome.zarr", sub) == "pvc:scans:/data/out.ome.zarr"


def test_every_spelling_of_a_bucket_prefix_is_one_key():
    # Regression guard (already so on 9bb18a8): the URL key drops every leading slash.
    for path in (
        "s3://scans/run-7/out.ome.zarr",
        "S3:///scans//run-7/./out.ome.zarr/",
        "s3:////scans/run-7/out.ome.zarr",
    ):
        assert key(path, {"workingDir": "//elsewhere"}) == "url:s3://scans/run-7/out.ome.zarr"


def test_a_claim_key_names_the_claims_namespace_and_a_bucket_or_plain_path_key_does_not():
    # A claim is namespaced: "scans" in team-a and in team-b are two volumes.
    assert key("/data/out.ome.zarr", CLAIM, "team-a") == "pvc:team-a/scans:/out.ome.zarr"
    assert key("/data/out.ome.zarr", CLAIM, "team-a") != key("/data/out.ome.zarr", CLAIM, "team-b")
    # A bucket prefix, or a path on a volume the operator cannot attribute, is one place cluster-wide.
    assert key("s3://scans/out.ome.zarr", None, "team-a") == key("s3://scans/out.ome.zarr", None, "team-b")
    assert (
        key("/data/out.ome.zarr", None, "team-a")
        == key("/data/out.ome.zarr", None, "team-b")
        == "path:/data/out.ome.zarr"
    )


@pytest.mark.parametrize(
    "a, b, clash",
    [
        ("path:/data/a.ome.zarr", "path:/data/a.ome.zarr/sub.ome.zarr", True),
        ("path:/data/a.ome.zarr/sub.ome.zarr", "path:/data/a.ome.zarr", True),
        ("path:/", "path:/data/a.ome.zarr", True),
        ("path:/data/a.ome.zarr", "path:/data/a.ome.zarr2", False),  # a sibling sharing a prefix of the name
        ("pvc:ns/scans:/a", "pvc:ns/scans:/a/b", True),
        ("pvc:ns/scans:/a", "pvc:ns/other:/a/b", False),  # another claim
        ("pvc:ns/scans:/a", "pvc:ns2/scans:/a/b", False),  # the same claim name in another namespace
        ("pvc:ns/scans:/a", "path:/a/b", False),
        ("url:s3://bucket/run", "url:s3://bucket/run/out.ome.zarr", True),
        ("url:s3://bucket", "url:s3://bucket/run", True),
        ("url:s3://bucket/run", "url:s3://bucket/run-2", False),
        ("url:s3://bucket/run", "url:s3://other/run/x", False),
        ("url:s3://bucket/run", "url:gs://bucket/run/x", False),
    ],
)
def test_nested_outputs_overlap(a, b, clash):
    from h5ngff.operator.controller.lease import overlaps

    assert overlaps(a, b) is clash and overlaps(b, a) is clash


# --- the real operator ------------------------------------------------------------------------------


def s3_spec(path: str = "s3://scans/run-7/out.ome.zarr") -> dict:
    return {**SPEC, "output": {"path": path, "overwrite": True}, "pod": {"image": SPEC["pod"]["image"]}}


async def add_lease(c, key_: str, holder: str, ns: str = OPS) -> str:
    """A Lease as the operator writes them, held by ``holder`` ("namespace/name/uid")."""
    name = lease_name(key_)
    body = {
        "apiVersion": "coordination.k8s.io/v1",
        "kind": "Lease",
        "metadata": {
            "name": name,
            "namespace": ns,
            "annotations": {"h5ngff.dev/output": key_},
            "labels": {"app.kubernetes.io/component": "output-lease"},
        },
        "spec": {"holderIdentity": holder, "acquireTime": "2026-01-01T00:00:00.000000Z"},
    }
    resp = await c.k.post(LEASES_PATH.format(ns=ns), json=body)
    assert resp.status in (200, 201), await resp.text()
    return name


@pytest.mark.slow
@pytest.mark.asyncio
async def test_two_namespaces_writing_one_bucket_prefix_take_turns(monkeypatch):
    monkeypatch.setenv("POD_NAMESPACE", OPS)  # as the Helm chart sets it: the operator's namespace
    async with emulator() as c, operator_running(cfg := fast_config(c.url)):
        await c.apply(manifest("first", s3_spec(), namespace="team-a"))
        await wait_for(lambda: "first-runner-1" in c.jobs("team-a"), what="first runner")
        await c.apply(manifest("second", s3_spec("s3:///scans//run-7/out.ome.zarr/"), namespace="team-b"))
        await wait_for(
            lambda: c.status("second", "team-b").get("reason") == "OutputBusy" or c.jobs("team-b"),
            what="OutputBusy (or a second writer)",
        )
        await passes(cfg, "second", 5, ns="team-b")
        assert c.jobs("team-b") == {} and c.status("second", "team-b")["phase"] == "Pending"
        assert "team-a/first/uid-first" in c.status("second", "team-b")["message"]
        # One Lease, in the operator's namespace, and no ownerReference across namespaces (the
        # garbage collector would take the owner for missing and free the output at once).
        assert c.live(LEASE_RES, "team-a") == c.live(LEASE_RES, "team-b") == {}
        (lease,) = c.live(LEASE_RES, OPS).values()
        assert lease["spec"]["holderIdentity"] == "team-a/first/uid-first" and not lease["metadata"].get(
            "ownerReferences"
        )
        await c.patch_job_status("first-runner-1", COMPLETE, ns="team-a")
        await wait_for(
            lambda: "second-runner-1" in c.jobs("team-b") and c.status("second", "team-b").get("attempts") == 1,
            what="the second job started",
        )
        (lease,) = c.live(LEASE_RES, OPS).values()
        assert (
            lease["spec"]["holderIdentity"] == "team-b/second/uid-second"
            and c.status("first", "team-a")["phase"] == "Succeeded"
        )
        # Deleting the holder (its finalizer) gives the Lease back, from the other namespace.
        await c.delete_cj("second", "team-b")
        await wait_for(
            lambda: c.live(LEASE_RES, OPS) == {} and c.cj("second", "team-b") is None,
            what="Lease released by the finalizer",
        )


@pytest.mark.slow
@pytest.mark.asyncio
@pytest.mark.parametrize("outer_first", [True, False], ids=["outer-first", "inner-first"])
async def test_an_output_nested_in_a_busy_one_waits(outer_first):
    outer, inner = "/data/a.ome.zarr", "//data/a.ome.zarr/sub.ome.zarr"
    first_path, second_path = (outer, inner) if outer_first else (inner, outer)
    async with emulator() as c, operator_running(cfg := fast_config(c.url)):
        await c.apply(manifest("first", {**SPEC, "output": {"path": first_path}}))
        await wait_for(lambda: "first-runner-1" in c.jobs(), what="first runner")
        await c.apply(manifest("second", {**SPEC, "output": {"path": second_path}}))
        # Control: a sibling whose name merely starts the same is another output and starts at once.
        await c.apply(manifest("sibling", {**SPEC, "output": {"path": "/data/a.ome.zarr2"}}))
        await wait_for(lambda: "sibling-runner-1" in c.jobs(), what="the sibling started")
        await wait_for(
            lambda: c.status("second").get("reason") == "OutputBusy" or "second-runner-1" in c.jobs(),
            what="OutputBusy (or a second writer)",
        )
        await passes(cfg, "second", 5)
        assert "second-runner-1" not in c.jobs() and c.status("second")["phase"] == "Pending"
        assert "default/first/uid-first" in c.status("second")["message"]
        await c.patch_job_status("first-runner-1", COMPLETE)
        await wait_for(
            lambda: "second-runner-1" in c.jobs() and c.status("second").get("attempts") == 1,
            what="the second job started",
        )


@pytest.mark.slow
@pytest.mark.asyncio
@pytest.mark.parametrize(
    "holder, key_",
    [("gone", "url:s3://scans/run-7/out.ome.zarr"), ("recreated", "url:s3://scans/run-7/out.ome.zarr/inner")],
)
async def test_a_lease_whose_holder_is_gone_is_taken_over(holder, key_):
    """A holder deleted without its finalizer (a force-deleted namespace) leaves its Lease, on the
    same output or one nested in it: the next job takes it over once the holder is gone, or is
    another object of that name. A holder that exists keeps it (the tests above)."""
    async with emulator() as c, operator_running(fast_config(c.url)):  # Leases in "default"
        if holder == "recreated":
            await c.apply(manifest("old", s3_spec("s3://elsewhere/x"), namespace="team-a", uid="uid-new"))
        await add_lease(c, key_, "team-a/old/uid-old", ns="default")
        await c.apply(manifest("scan", s3_spec()))
        await wait_for(lambda: "scan-runner-1" in c.jobs(), what="the job started")
        holders = {
            v["metadata"]["annotations"]["h5ngff.dev/output"]: v["spec"]["holderIdentity"]
            for v in c.live(LEASE_RES).values()
        }
        assert holders.get("url:s3://scans/run-7/out.ome.zarr") == "default/scan/uid-scan"
        assert "team-a/old/uid-old" not in holders.values()  # the stale Lease is gone
        assert ("get", GROUP, "conversionjobs", "") in c.api_calls()[
            "operator"
        ]  # rbac.py's unexercised rule, exercised


@pytest.mark.slow
@pytest.mark.asyncio
async def test_a_run_started_by_a_build_with_leases_in_the_jobs_namespace_keeps_and_releases_its_lease(monkeypatch):
    """An earlier build kept the Lease in the job's namespace under a bare name in
    status.outputLease (what an operator with lease_namespace = the job's namespace writes).
    After the upgrade that Lease still keeps others off the output and is given back."""
    async with emulator() as c:
        monkeypatch.setenv("POD_NAMESPACE", "team-a")
        async with operator_running(fast_config(c.url)):
            await c.apply(manifest("first", s3_spec(), namespace="team-a"))
            await wait_for(
                lambda: "first-runner-1" in c.jobs("team-a") and c.status("first", "team-a").get("outputLease"),
                what="first runner",
            )
        (name,) = c.live(LEASE_RES, "team-a")
        assert c.status("first", "team-a")["outputLease"] == name
        monkeypatch.setenv("POD_NAMESPACE", OPS)  # upgraded
        async with operator_running(cfg := fast_config(c.url)):
            await c.apply(
                manifest("second", s3_spec("s3://scans/run-7"), namespace="team-a")
            )  # contains first's output
            await wait_for(
                lambda: (
                    c.status("second", "team-a").get("reason") == "OutputBusy"
                    or c.jobs("team-a").keys() - {"first-runner-1"}
                ),
                what="OutputBusy (or a second writer)",
            )
            await passes(cfg, "second", 3, ns="team-a")
            assert set(c.jobs("team-a")) == {"first-runner-1"} and c.live(LEASE_RES, OPS) == {}
            await c.patch_job_status("first-runner-1", COMPLETE, ns="team-a")
            await wait_for(lambda: "second-runner-1" in c.jobs("team-a"), what="the second job started")
            assert c.live(LEASE_RES, "team-a") == {}  # the old build's Lease was given back
            (lease,) = c.live(LEASE_RES, OPS).values()
            assert lease["spec"]["holderIdentity"] == "team-a/second/uid-second"


def test_the_chart_tells_the_operator_its_namespace():
    from test_helm import operator_container, render

    objs = render({})
    env = {e["name"]: e for e in operator_container(objs)["env"]}
    assert env["POD_NAMESPACE"]["valueFrom"] == {"fieldRef": {"fieldPath": "metadata.namespace"}}


def test_the_operator_flag_sets_the_lease_namespace(monkeypatch):
    import argparse

    from h5ngff.cli import build_parser

    monkeypatch.setenv("POD_NAMESPACE", "from-env")
    args = build_parser().parse_args(["operator"])
    assert isinstance(args, argparse.Namespace) and args.lease_namespace == "from-env"
    assert build_parser().parse_args(["operator", "--lease-namespace", "ops"]).lease_namespace == "ops"
