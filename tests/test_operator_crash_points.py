"""A finished conversion never runs again, and overwrite never follows from the operator not
knowing: every crash point of the start sequence, an operator upgrade, and a runner Job that
Kubernetes refuses (docs/operator.md, "Lifecycle", the rows marked ‡).

The start sequence is: take the Lease, write the status that announces attempt N, create the
Role, RoleBinding and runner Job, record the Job's uid. A crash between two of these calls
leaves a status the next pass must read right. The pure tests put ``reconcile`` in each of those
states; the KMock tests bring the real kopf operator to them (an operator stopped and started
again, a status as the crash left it, an API answer scripted in KMock). "Nothing happened" is
checked after counted reconcile passes, never after a sleep.

Every test here fails on the operator as it was at 9bb18a8 (run there once): it created attempt 1
again with ``overwrite: true``, re-ran every finished job after an upgrade that added a
defaulted field, and retried a refused runner Job for ever while holding the output's Lease.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import json

import kmock
import pytest

from h5ngff.jobspec import parse_job_spec
from h5ngff.operator.kube import KubeConfig
from h5ngff.operator.controller.reconcile import reconcile
from h5ngff.operator.runner.reporter import StatusReporter
from h5ngff.operator.schema.status import merge
from operator_harness import (
    CJ_PATH,
    CJ_RES,
    JOB_RES,
    LEASE_RES,
    emulator,
    fast_config,
    manifest,
    operator_running,
    passes,
    wait_for,
)
from test_operator_kmock import SPEC, env_of, report
from test_operator_reconcile import T1, job, obs, run

pytestmark = pytest.mark.integration

COMPLETE = {"active": 0, "succeeded": 1, "conditions": [{"type": "Complete", "status": "True"}]}


def announced(attempt: int = 1, **extra):
    """The status right after the write that announces the run's first attempt, before its
    runner Job's uid is recorded: what a crash between those calls leaves."""
    return {
        "phase": "Pending",
        "attempts": attempt,
        "firstAttempt": attempt,
        "runnerJob": f"scan-runner-{attempt}",
        "startTime": T1,
        "conversionHash": "c1",
        "conversionGeneration": 1,
        "observedGeneration": 1,
        "outputLease": "lease-a",
        "output": "/data/out.ome.zarr",
        **extra,
    }


# -- the pure decisions, one per crash point ------------------------------------------------------


def test_a_missing_first_attempt_job_is_looked_up_before_anything_is_decided():
    d = reconcile(obs(announced(), job_checked=False))
    assert d.needs == frozenset({"job"}) and d.ensure_attempt is None


def test_a_first_attempt_job_that_may_have_run_is_created_again_with_overwrite_off():
    """Crash after the Job's create and before its uid was recorded, then the Job was deleted
    (or the create got no answer): the operator cannot know whether it ran."""
    d = reconcile(obs(announced(), pods=[]))
    assert d.ensure_attempt == 1 and d.resume is True
    assert d.event is not None and d.event[:2] == ("Warning", "RunnerRecreated")


def test_a_first_attempt_job_known_never_created_keeps_the_specs_overwrite():
    """This process was told no (a definite API answer): creating it as first intended is safe."""
    d = reconcile(dataclasses.replace(obs(announced(), pods=[]), known_uncreated=True))
    assert d.ensure_attempt == 1 and d.resume is False and d.event is None


def test_a_report_of_success_stands_although_the_job_was_never_recorded():
    d, s = run(announced(runner={"attempt": 1, "outcome": "Succeeded"}))
    assert s["phase"] == "Succeeded" and d.ensure_attempt is None


def test_a_job_deleted_mid_run_before_its_uid_was_recorded_is_a_failed_attempt():
    d, s = run(announced(phase="Running", runner={"attempt": 1, "phase": "Writing"}), pods=[])
    assert s["attempts"] == 2 and s["failures"][-1]["reason"] == "RunnerDeleted" and d.event[1] == "RunnerDeleted"
    d, s = run(s, pods=[])
    assert d.ensure_attempt == 2 and d.resume is True


def test_a_refused_runner_job_fails_the_run_with_the_apis_message_and_gives_the_lease_back():
    d = reconcile(
        dataclasses.replace(
            obs(announced(), pods=[]),
            create_rejected='Job.batch "scan-runner-1" is invalid: volumes[1].name: Duplicate value',
        )
    )
    s = merge(announced(), d.patch)
    assert s["phase"] == "Failed" and s["reason"] == "Rejected" and "Duplicate value" in s["message"]
    assert d.release_lease == "lease-a" and "outputLease" not in s and d.event[:2] == ("Warning", "Rejected")


def test_a_hash_from_another_build_at_the_same_generation_starts_nothing_and_is_adopted():
    s = {**announced(phase="Succeeded", runnerJobUid="job-uid-1"), "conversionHash": "from-an-older-build"}
    s.pop("conversionGeneration")
    s.pop("outputLease")
    d, s2 = run(s, jobs=[job(1, "succeeded")])
    assert (
        d.ensure_attempt is None
        and s2["phase"] == "Succeeded"
        and s2["conversionHash"] == "c1"
        and s2["conversionGeneration"] == 1
    )
    # After adoption, an edit that keeps the conversion starts nothing; one that changes it does.
    d, _ = run(s2, jobs=[job(1, "succeeded")], generation=2)
    assert d.ensure_attempt is None
    d, _ = run(s2, jobs=[job(1, "succeeded")], generation=2, conversion="c2", pods=[])
    assert d.ensure_attempt == 2


def test_a_stopping_run_of_an_older_build_still_starts_its_new_run():
    """Negative control of the same-generation rule: an older build stopping a run for a changed
    spec (reason SpecChanged) had stamped the new generation but not compared it."""
    s = {**announced(phase="Pending", reason="SpecChanged", observedGeneration=2, runnerJobUid="job-uid-1")}
    s.pop("conversionGeneration")
    d = reconcile(obs(s, generation=2, conversion="c2", pods=[]))
    assert d.ensure_attempt == 2


def test_the_conversion_hash_is_of_the_normalised_conversion_not_of_what_was_written():
    spec = parse_job_spec(SPEC)
    explicit = parse_job_spec({**SPEC, "output": {**SPEC["output"], "checksums": True}})
    # A default written out (or removed, or added by an upgrade) is the same conversion (issue 41).
    assert spec.conversion_hash() == explicit.conversion_hash()
    assert spec.legacy_conversion_hash() == explicit.legacy_conversion_hash()
    # What builds before issue 41 recorded differs: a status of theirs is compared with this one.
    assert spec.written_conversion_hash() != explicit.written_conversion_hash()
    # Negative control: a value other than the default is another conversion.
    off = parse_job_spec({**SPEC, "output": {**SPEC["output"], "checksums": False}})
    assert off.conversion_hash() != spec.conversion_hash()
    assert parse_job_spec(json.loads(json.dumps(SPEC))).conversion_hash() == spec.conversion_hash()


# -- the real operator --------------------------------------------------------------------------


async def _set_status(c, patch: dict) -> None:
    """Leave the status as a crash (or an older build) would have left it."""
    resp = await c.k.patch(
        f"{CJ_PATH.format(ns='default')}/scan/status",
        json={"status": patch},
        headers={"Content-Type": "application/merge-patch+json"},
    )
    assert resp.status == 200, await resp.text()


async def _started_then_stopped(c) -> None:
    async with operator_running(cfg := fast_config(c.url)):
        await c.apply(manifest("scan", SPEC))
        await wait_for(lambda: "scan-runner-1" in c.jobs(), what="runner Job")
        await passes(cfg, "scan", 2)
    await _set_status(c, {"runnerJobUid": None})  # the crash came before the uid was recorded


def _overwrite(c, job_name: str) -> bool:
    return json.loads(env_of(c.jobs()[job_name])["H5NGFF_SPEC"])["output"]["overwrite"]


@pytest.mark.slow
@pytest.mark.asyncio
@pytest.mark.timeout(120)
async def test_a_finished_runner_gone_before_its_uid_was_recorded_never_runs_again():
    """The runner reported success, then the TTL removed its Job, all before the operator
    recorded the Job's uid (it had stopped): the outcome comes from the report."""
    async with emulator() as c:
        await _started_then_stopped(c)
        reporter = StatusReporter("default", "scan", KubeConfig(c.url))
        await report(reporter, {"phase": "Running", "runner": {"attempt": 1, "outcome": "Succeeded"}}, final=True)
        await asyncio.to_thread(reporter.close)
        await c.patch_job_status("scan-runner-1", COMPLETE)
        assert (await c.k.delete("/apis/batch/v1/namespaces/default/jobs/scan-runner-1")).status == 200
        async with operator_running(cfg := fast_config(c.url)):
            await wait_for(
                lambda: c.status("scan").get("phase") == "Succeeded" or len(c.job_create_requests()) > 1,
                what="Succeeded (or a re-run)",
            )
            await passes(cfg, "scan", 3)
        assert c.job_create_requests() == ["scan-runner-1"] and c.status("scan")["phase"] == "Succeeded"


@pytest.mark.slow
@pytest.mark.asyncio
@pytest.mark.timeout(120)
async def test_a_runner_deleted_mid_run_before_its_uid_was_recorded_is_a_failed_attempt_that_resumes():
    async with emulator() as c:
        await _started_then_stopped(c)
        reporter = StatusReporter("default", "scan", KubeConfig(c.url))
        await report(reporter, {"phase": "Running", "runner": {"attempt": 1, "phase": "Writing"}}, final=True)
        await asyncio.to_thread(reporter.close)
        assert (await c.k.delete("/apis/batch/v1/namespaces/default/jobs/scan-runner-1")).status == 200
        async with operator_running(fast_config(c.url)):
            await wait_for(lambda: len(c.job_create_requests()) > 1, what="the next attempt (or a re-creation)")
            await wait_for(lambda: c.status("scan").get("attempts") == 2, what="attempt 2 recorded")
            assert c.job_create_requests() == ["scan-runner-1", "scan-runner-2"]
            assert (
                c.status("scan")["failures"][-1]["reason"] == "RunnerDeleted"
                and _overwrite(c, "scan-runner-2") is False
            )
            await wait_for(lambda: any(e["reason"] == "RunnerDeleted" for e in c.events()), what="RunnerDeleted event")


@pytest.mark.slow
@pytest.mark.asyncio
@pytest.mark.timeout(120)
async def test_a_first_attempt_that_may_have_run_is_created_again_with_overwrite_off():
    """No uid, no report, no Job: it may have run and been deleted before its runner reported."""
    async with emulator() as c:
        await _started_then_stopped(c)
        assert _overwrite(c, "scan-runner-1") is True  # the spec asks for overwrite: attempt 1 had it
        assert (await c.k.delete("/apis/batch/v1/namespaces/default/jobs/scan-runner-1")).status == 200
        async with operator_running(cfg := fast_config(c.url)):
            await wait_for(lambda: "scan-runner-1" in c.jobs(), what="attempt 1 created again")
            await passes(cfg, "scan", 2)
            assert _overwrite(c, "scan-runner-1") is False and c.status("scan")["attempts"] == 1
            await wait_for(
                lambda: any(e["reason"] == "RunnerRecreated" for e in c.events()), what="RunnerRecreated event"
            )


@pytest.mark.slow
@pytest.mark.asyncio
@pytest.mark.timeout(120)
async def test_the_status_is_written_before_the_runner_job_exists():
    """Record before acting: when the Job create is sent, the status already announces it."""
    async with emulator() as c, operator_running(cfg := fast_config(c.url)):
        await c.apply(manifest("scan", SPEC))
        await wait_for(
            lambda: "scan-runner-1" in c.jobs() and c.status("scan").get("runnerJobUid"), what="runner Job recorded"
        )
        await passes(cfg, "scan", 1)
        cjs, jobs = kmock.resource(CJ_RES), kmock.resource(JOB_RES)
        order = [
            ("status" if r.resource == cjs else "job")
            for r in c.k
            if (
                r.resource == cjs
                and r.subresource == "status"
                and r.action == kmock.action.UPDATE
                and "attempts" in ((r.data or {}).get("status") or {})
            )
            or (r.resource == jobs and r.action == kmock.action.CREATE)
        ]
        assert order[:2] == ["status", "job"]
        assert c.status("scan")["runnerJobUid"] == c.jobs()["scan-runner-1"]["metadata"]["uid"]


@pytest.mark.slow
@pytest.mark.asyncio
@pytest.mark.timeout(120)
async def test_an_operator_upgrade_reruns_no_finished_job():
    """A status written by a build whose hash had no ``output.checksums`` (added later with a
    default): at the same generation nothing runs; a later edit is compared with today's hash."""
    spec = parse_job_spec(SPEC)
    older = spec.conversion().to_wire()
    older["output"] = {k: v for k, v in older["output"].items() if k not in ("overwrite", "checksums")}
    older["where"] = {k: v for k, v in spec.pod.to_wire().items() if k in ("volumes", "volumeMounts", "workingDir")}
    older_hash = hashlib.sha256(json.dumps(older, sort_keys=True).encode()).hexdigest()[:16]
    async with emulator() as c:
        async with operator_running(cfg := fast_config(c.url)):
            await c.apply(manifest("scan", SPEC))
            await wait_for(lambda: "scan-runner-1" in c.jobs(), what="runner Job")
            await c.patch_job_status("scan-runner-1", COMPLETE)
            await wait_for(lambda: c.status("scan").get("phase") == "Succeeded", what="Succeeded")
            await passes(cfg, "scan", 2)
        await _set_status(c, {"conversionHash": older_hash, "conversionGeneration": None})  # as the older build left it
        async with operator_running(cfg := fast_config(c.url)):
            await passes(cfg, "scan", 4)
            assert c.job_create_requests() == ["scan-runner-1"] and c.status("scan")["phase"] == "Succeeded"
            assert c.status("scan")["conversionHash"] == spec.conversion_hash()  # adopted
            await c.edit("scan", {"spec": {"backoffLimit": 3}})  # keeps the conversion
            await wait_for(lambda: c.status("scan").get("observedGeneration") == 2, what="generation 2 observed")
            await passes(cfg, "scan", 3)
            assert c.job_create_requests() == ["scan-runner-1"]
            await c.edit("scan", {"spec": {"output": {"path": "/data/v2.ome.zarr"}}})  # control: a real edit runs
            await wait_for(lambda: "scan-runner-2" in c.jobs(), what="the edited conversion's runner")


@pytest.mark.slow
@pytest.mark.asyncio
@pytest.mark.timeout(120)
async def test_a_runner_job_kubernetes_refuses_fails_rejected_and_frees_the_output():
    async with emulator() as c:
        refusal = {
            "kind": "Status",
            "code": 422,
            "reason": "Invalid",
            "message": 'Job.batch "scan-runner-1" is invalid: spec.template.spec.volumes[1].name: Duplicate value: "data"',
        }
        (
            c.k[
                "post",
                kmock.resource(JOB_RES),
                lambda r: (r.data or {}).get("metadata", {}).get("name") == "scan-runner-1",
            ]
            << 422
            << refusal
        )
        async with operator_running(cfg := fast_config(c.url)):
            await c.apply(manifest("scan", SPEC))
            await wait_for(lambda: c.status("scan").get("phase") == "Failed", what="Failed")
            status = c.status("scan")
            assert status["reason"] == "Rejected" and "Duplicate value" in status["message"]
            await wait_for(lambda: "outputLease" not in c.status("scan"), what="the Lease back (no pod ever ran)")
            assert not c.live(LEASE_RES)
            await wait_for(lambda: any(e["reason"] == "Rejected" for e in c.events()), what="Rejected event")
            await c.apply(manifest("other", SPEC))  # the same output: it is free, so the next job runs
            await wait_for(lambda: "other-runner-1" in c.jobs(), what="the next job's runner")
            await passes(cfg, "scan", 3)
            assert c.status("scan")["phase"] == "Failed"


# -- shapes Kubernetes refuses are refused at validation ------------------------------------------


@pytest.mark.parametrize(
    "pod, says",
    [
        ({"volumes": [{"name": "h5ngff-scratch", "emptyDir": {}}]}, "scratch volume"),
        ({"volumes": [{"name": "a", "emptyDir": {}}, {"name": "a", "emptyDir": {}}]}, "volumes names to be unique"),
        (
            {
                "volumes": [{"name": "a", "emptyDir": {}}],
                "volumeMounts": [{"name": "a", "mountPath": "/x"}, {"name": "a", "mountPath": "/x"}],
            },
            "mountPaths to be unique",
        ),
        (  # Kubernetes' own check compares strings: /x and /x/ would pass it and collide
            {
                "volumes": [{"name": "a", "emptyDir": {}}],
                "volumeMounts": [{"name": "a", "mountPath": "/x"}, {"name": "a", "mountPath": "/x/"}],
            },
            "normal form",
        ),
        (
            {"volumes": [{"name": "a", "emptyDir": {}}], "volumeMounts": [{"name": "a", "mountPath": "x"}]},
            "absolute path",
        ),
        ({"image": ""}, "empty string"),
    ],
)
def test_pod_shapes_kubernetes_refuses_are_invalid_specs(pod, says):
    from h5ngff.errors import SpecError

    with pytest.raises(SpecError, match=says):
        parse_job_spec({**SPEC, "pod": pod})
    # control: the same pod without the collision is accepted
    parse_job_spec(
        {
            **SPEC,
            "pod": {"volumes": [{"name": "a", "emptyDir": {}}], "volumeMounts": [{"name": "a", "mountPath": "/x"}]},
        }
    )
