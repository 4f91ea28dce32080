"""The lifecycle table of docs/operator.md, row by row, on the pure ``reconcile``.

Each test drives ``reconcile`` through the passes the operator would make (applying each
decision's patch to the status, as the API server would) and checks what it decides. The same
rows run against the real kopf operator in tests/test_operator_lifecycle.py.
"""

from __future__ import annotations

import pytest

from h5ngff.jobspec import RetryPolicy, parse_job_spec
from h5ngff.operator.controller.lease import LeaseState, lease_name, output_key
from h5ngff.operator.controller.reconcile import JobSummary, Observed, reconcile
from h5ngff.operator.schema.status import ConversionJobStatus, merge

T0, T1, T2 = "2026-01-01T00:00:00Z", "2026-01-01T00:01:00Z", "2026-01-01T02:00:00Z"
HELD = LeaseState("lease-a", True)


def obs(
    status,
    jobs=(),
    pods=None,
    events=None,
    lease=HELD,
    generation=1,
    conversion="c1",
    error=None,
    now=T1,
    backoff=2,
    delays=(0, 0, 0),
    deadline=None,
    output="/data/out.ome.zarr",
    job_checked=True,
):
    return Observed(
        "scan",
        dict(status),
        backoff,
        output,
        tuple(jobs),
        tuple(pods or ()),
        pods is not None,
        now,
        generation=generation,
        conversion=conversion,
        spec_error=error,
        retry_delays=delays,
        deadline_seconds=deadline,
        lease_name="lease-a",
        lease=lease,
        events=tuple(events or ()),
        events_checked=events is not None,
        job_checked=job_checked,
    )


def job(attempt, state="active", uid=None):
    return JobSummary(f"scan-runner-{attempt}", attempt, state, uid=uid or f"job-uid-{attempt}")


def pod(attempt, phase="Running", **status):
    return {
        "metadata": {
            "name": f"scan-runner-{attempt}-abcde",
            "labels": {"h5ngff.dev/attempt": str(attempt), "app.kubernetes.io/component": "runner"},
        },
        "status": {"phase": phase, **status},
    }


def run(status, o_kwargs=None, **kw):
    """One pass: the decision and the status after its patch."""
    d = reconcile(obs(status, **{**(o_kwargs or {}), **kw}))
    return d, merge(status, d.patch)


def started(attempt=1, phase="Running", conversion="c1", **extra):
    """The status of a run that started attempt ``attempt`` (its first) and whose Job was seen."""
    return {
        "phase": phase,
        "attempts": attempt,
        "firstAttempt": attempt,
        "runnerJob": f"scan-runner-{attempt}",
        "startTime": T0,
        "conversionHash": conversion,
        "observedGeneration": 1,
        "outputLease": "lease-a",
        "runnerJobUid": f"job-uid-{attempt}",
        "output": "/data/out.ome.zarr",
        **extra,
    }


def succeeded():
    _, s = run(started(), jobs=[job(1, "succeeded")])
    assert s["phase"] == "Succeeded"
    return settle(s)


def settle(s):
    """The pass after a run ended that finds none of its pods running: its Lease goes back."""
    d, s = run(s, pods=[])
    assert d.release_lease == "lease-a" and "outputLease" not in s, d
    return s


# -- the recorded outcome is final --------------------------------------------------------------


@pytest.mark.parametrize("phase", ["Succeeded", "Failed"])
def test_a_finished_run_never_runs_again_when_its_children_vanish(phase):
    s = succeeded() if phase == "Succeeded" else {**started(), "phase": "Failed", "reason": "BackoffLimitExceeded"}
    s.pop("outputLease", None)
    for jobs in ([], [job(1, "succeeded")]):  # the Job's TTL, a manual delete: nothing to do either way
        d = reconcile(obs(s, jobs, pods=[]))
        assert d.patch == {} and d.ensure_attempt is None and not d.needs and d.event is None


def test_a_runner_that_reported_success_and_vanished_before_the_operator_saw_it_is_succeeded():
    # Operator down longer than ttlSecondsAfterFinished: the Job is gone, the runner's report stays.
    s = started(runner={"attempt": 1, "outcome": "Succeeded"})
    d, s = run(s)
    assert s["phase"] == "Succeeded" and d.ensure_attempt is None and s["outputLease"] == "lease-a"
    settle(s)


# -- a deleted runner is a failed attempt -------------------------------------------------------


def test_a_runner_job_deleted_while_running_is_a_failed_attempt_that_resumes():
    s = started()
    d, _ = run(s, job_checked=False)
    assert d.needs == {"job"}  # missing from the watch: the API is asked before it counts as deleted
    d, _ = run(s, jobs=[job(1)], job_checked=True)  # the watch lagged (a replica that just took over): it is there
    assert d.ensure_attempt is None and "attempts" not in d.patch and d.event is None
    d, _ = run(s)
    assert d.needs == {"pods"}  # no report: what did the kubelet say about its pod?
    d, s = run(s, pods=[])
    assert d.ensure_attempt is None and d.delete_cluster
    assert d.event[:2] == ("Warning", "RunnerDeleted")
    assert s["attempts"] == 2 and s["failures"][-1]["reason"] == "RunnerDeleted" and s["phase"] == "Pending"
    d, s = run(s, pods=[])
    assert d.ensure_attempt == 2 and d.resume  # attempt 2 resumes: overwrite off


def test_the_next_attempt_waits_for_the_deleted_runners_pod_to_exit():
    s = merge(started(), run(started(), pods=[])[0].patch)
    d, _ = run(s, pods=[pod(1)])  # the Job is gone, its pod still terminating
    assert d.ensure_attempt is None and "waits for 1 pod" in d.patch["message"]
    d, _ = run(s, pods=[pod(1, "Failed")])
    assert d.ensure_attempt == 2


def test_a_runner_pod_deleted_under_its_job_is_a_failed_attempt():
    # backoffLimit 0 on the Job: the Job controller fails the Job when its only pod is deleted.
    d, s = run(
        started(),
        jobs=[
            JobSummary(
                "scan-runner-1",
                1,
                "failed",
                "BackoffLimitExceeded",
                "Job has reached the specified backoff limit",
                uid="job-uid-1",
            )
        ],
        pods=[],
    )
    assert (
        s["attempts"] == 2
        and s["failures"][-1]["reason"] == "RunnerFailed"
        and "pod is gone" in s["failures"][-1]["message"]
    )


# -- retries back off ---------------------------------------------------------------------------


def test_retry_delays_double_up_to_the_cap():
    policy = RetryPolicy(interval_seconds=10, max_interval_seconds=60)
    assert [policy.delay(n) for n in range(1, 7)] == [10, 20, 40, 60, 60, 60]
    assert RetryPolicy(interval_seconds=0, max_interval_seconds=0).delay(3) == 0
    with pytest.raises(ValueError):
        RetryPolicy(interval_seconds=30, max_interval_seconds=10)


def test_a_retry_starts_only_after_its_backoff():
    s = started()
    failed = [JobSummary("scan-runner-1", 1, "failed", uid="job-uid-1")]
    _, s = run(s, jobs=failed, pods=[], delays=(30, 60))
    assert s["nextRetryTime"] == "2026-01-01T00:01:30Z" and "in 30 s" in s["message"]
    d, _ = run(s, jobs=failed, pods=[], now="2026-01-01T00:01:29Z")
    assert d.ensure_attempt is None and not d.needs
    d, s = run(s, jobs=failed, pods=[], now="2026-01-01T00:01:30Z")
    assert d.ensure_attempt == 2 and "nextRetryTime" not in s


# -- deadline and pods that do not start --------------------------------------------------------


def test_active_deadline_ends_the_run_and_stops_its_runner():
    d, s = run(started(phase="Pending"), jobs=[job(1, "pending")], deadline=3600, now=T2)
    assert s["phase"] == "Failed" and s["reason"] == "DeadlineExceeded" and "3600 s" in s["message"]
    assert d.delete_job == "scan-runner-1" and d.delete_cluster and d.release_lease is None
    settle(s)
    d, _ = run(started(phase="Pending"), jobs=[job(1, "pending")], deadline=3600, now=T1, pods=[], events=[])
    assert d.delete_job is None


@pytest.mark.parametrize(
    "pod_status, reason, words",
    [
        (
            {
                "conditions": [
                    {
                        "type": "PodScheduled",
                        "status": "False",
                        "reason": "Unschedulable",
                        "message": "0/3 nodes are available: 3 Insufficient memory.",
                    }
                ]
            },
            "Unschedulable",
            "3 Insufficient memory",
        ),
        (
            {
                "containerStatuses": [
                    {
                        "name": "runner",
                        "state": {
                            "waiting": {"reason": "ImagePullBackOff", "message": 'Back-off pulling image "nope:1"'}
                        },
                    }
                ]
            },
            "ImagePullBackOff",
            "nope:1",
        ),
    ],
)
def test_a_runner_pod_that_cannot_start_says_why(pod_status, reason, words):
    s = started(phase="Pending")
    d, _ = run(s, jobs=[job(1, "pending")])
    assert d.needs == {"pods", "events"}
    d, s2 = run(s, jobs=[job(1, "pending")], pods=[pod(1, "Pending", **pod_status)], events=[])
    assert s2["reason"] == reason and words in s2["message"] and s2["phase"] == "Pending"
    assert d.event[:2] == ("Warning", reason)
    d, _ = run(s2, jobs=[job(1, "pending")], pods=[pod(1, "Pending", **pod_status)], events=[])
    assert d.patch == {} and d.event is None  # said once
    d, s3 = run(s2, jobs=[job(1, "active")], pods=[pod(1)], events=[])
    assert "reason" not in s3  # scheduled after all


def test_a_job_whose_pods_admission_rejects_says_failed_create():
    event = {
        "reason": "FailedCreate",
        "involvedObject": {"kind": "Job", "name": "scan-runner-1"},
        "message": 'pods "scan-runner-1-x" is forbidden: violates PodSecurity "restricted:latest": runAsNonRoot != true',
    }
    _, s = run(started(phase="Pending"), jobs=[job(1, "pending")], pods=[], events=[event])
    assert s["reason"] == "FailedCreate" and "violates PodSecurity" in s["message"]


# -- spec edits ---------------------------------------------------------------------------------


def test_an_edit_that_keeps_the_conversion_only_moves_observed_generation():
    s = succeeded()
    d, s2 = run(s, generation=2)
    assert d.ensure_attempt is None and d.event is None and not d.needs
    assert s2["observedGeneration"] == 2 and {c["observedGeneration"] for c in s2["conditions"]} == {2}
    assert s2["phase"] == "Succeeded"
    assert reconcile(obs(s2, generation=2)).patch == {}  # and then nothing more


def test_an_edit_of_the_conversion_after_success_starts_a_new_run():
    s = succeeded()
    d, _ = run(s, generation=2, conversion="c2", lease=None)
    assert d.needs == {"pods"}
    d, _ = run(s, generation=2, conversion="c2", lease=None, pods=[])
    assert d.needs == {"lease"}
    d, s2 = run(s, generation=2, conversion="c2", pods=[])
    assert d.ensure_attempt == 2 and not d.resume  # attempt 1 of the new run: the spec's overwrite holds
    assert s2["phase"] == "Pending" and s2["attempts"] == s2["firstAttempt"] == 2 and s2["conversionHash"] == "c2"
    assert s2["observedGeneration"] == 2 and "result" not in s2 and "completionTime" not in s2
    assert {c["type"] for c in s2["conditions"]} == {"Validated", "OutputLease"}
    ConversionJobStatus.model_validate(s2)


def test_an_edit_of_the_conversion_while_running_stops_the_attempt_then_starts_the_new_run():
    s = started()
    d, s = run(s, jobs=[job(1)], generation=2, conversion="c2")
    assert d.delete_job == "scan-runner-1" and d.delete_cluster and d.ensure_attempt is None
    assert s["phase"] == "Pending" and s["reason"] == "SpecChanged" and s["observedGeneration"] == 2
    d, _ = run(s, generation=2, conversion="c2", pods=[pod(1)])  # Job gone, pod still exiting
    assert d.ensure_attempt is None and "Waiting for 1 pod" in d.patch["message"]
    d, s = run(s, generation=2, conversion="c2", pods=[])
    assert d.ensure_attempt == 2 and s["firstAttempt"] == 2
    # the new run's retries count from its own first attempt
    d, s = run(
        s, jobs=[JobSummary("scan-runner-2", 2, "failed", uid="u2")], generation=2, conversion="c2", pods=[], backoff=1
    )
    assert s["attempts"] == 3 and s["phase"] == "Pending"


def test_an_output_another_job_holds_makes_this_one_wait():
    busy = LeaseState("lease-a", False, "default/first/uid-1", "2026-01-01T00:00:00.000000Z")
    d, s = run({}, lease=busy)
    assert (
        d.ensure_attempt is None
        and s["phase"] == "Pending"
        and s["reason"] == "OutputBusy"
        and "default/first" in s["message"]
    )
    assert d.event[:2] == ("Normal", "OutputBusy")
    d, s2 = run(s, lease=busy)
    assert d.patch == {} and d.event is None  # no churn while it waits
    d, s3 = run(s, lease=HELD)
    assert d.ensure_attempt == 1 and s3["outputLease"] == "lease-a" and "reason" not in s3


def test_a_run_ending_gives_back_its_lease_once_its_pods_are_gone():
    for jobs, phase in (
        ([job(1, "succeeded")], "Succeeded"),
        ([JobSummary("scan-runner-1", 1, "failed", uid="job-uid-1")], "Failed"),
    ):
        d, s = run(
            started(runner={"attempt": 1, "outcome": "Failed", "reason": "SourceUnreadable", "message": "m"}), jobs=jobs
        )
        assert s["phase"] == phase and d.release_lease is None and s["outputLease"] == "lease-a"
        worker = {"metadata": {"name": "scan-dask-default-worker-0"}, "status": {"phase": "Running"}}
        d, s = run(s, jobs=jobs, pods=[worker])  # a Dask worker of the run still runs: it may write
        assert d.release_lease is None and d.delete_cluster and s["outputLease"] == "lease-a"
        lease = next(c for c in s["conditions"] if c["type"] == "OutputLease")
        assert lease["reason"] == "Draining" and "scan-dask-default-worker-0" in lease["message"]
        settle(s)


# -- invalid edits ------------------------------------------------------------------------------


def test_an_invalid_edit_while_running_lets_the_run_finish_without_flapping():
    s = started()
    err = "resources.workers: Expected 'auto' or an integer from 1 to 4096. Got 0 instead."
    d, s = run(s, jobs=[job(1)], generation=2, conversion="", error=err)
    assert s["phase"] == "Running" and d.event[:2] == ("Warning", "InvalidSpec") and d.delete_job is None
    validated = next(c for c in s["conditions"] if c["type"] == "Validated")
    assert validated["status"] == "False" and validated["observedGeneration"] == 2
    d, s = run(s, jobs=[job(1)], generation=2, conversion="", error=err)
    assert d.event is None and s["phase"] == "Running"
    _, done = run(s, jobs=[job(1, "succeeded")], generation=2, conversion="", error=err)
    assert done["phase"] == "Succeeded"
    # a failure now is final: the invalid spec cannot make a retry
    _, failed = run(
        s,
        jobs=[JobSummary("scan-runner-1", 1, "failed", uid="job-uid-1")],
        generation=2,
        conversion="",
        error=err,
        pods=[],
    )
    assert failed["phase"] == "Failed" and "not retried" in failed["message"] and failed["attempts"] == 1


def test_reverting_an_invalid_edit_restores_validated_without_a_rerun():
    err = "pyramid.levels: bad"
    _, s = run(succeeded(), generation=2, conversion="", error=err)
    assert s["phase"] == "Succeeded"  # the recorded outcome stands
    d, s = run(s, generation=3, conversion="c1")
    assert d.ensure_attempt is None and next(c for c in s["conditions"] if c["type"] == "Validated")["status"] == "True"


def test_a_job_that_never_ran_fails_with_invalid_spec_once():
    d, s = run({}, conversion="", error="resources.workers: bad")
    assert s["phase"] == "Failed" and s["reason"] == "InvalidSpec" and d.ensure_attempt is None
    assert reconcile(obs(s, conversion="", error="resources.workers: bad")).patch == {}


# -- what counts as the conversion, and the Lease key --------------------------------------------


BASE = {
    "source": {"path": "/data/in.h5", "dataset": "/d"},
    "output": {"path": "/data/out.ome.zarr"},
    "pod": {
        "volumes": [{"name": "data", "persistentVolumeClaim": {"claimName": "scans"}}],
        "volumeMounts": [{"name": "data", "mountPath": "/data"}],
    },
}


def _with(**changes):
    spec = {k: dict(v) if isinstance(v, dict) else v for k, v in BASE.items()}
    for dotted, value in changes.items():
        head, _, tail = dotted.partition("__")
        if tail:
            spec[head] = {**spec.get(head, {}), tail: value}
        else:
            spec[head] = value
    return parse_job_spec(spec)


@pytest.mark.parametrize(
    "change, reruns",
    [
        ({"output__chunks": [32, 32, 32]}, True),
        ({"output__path": "/data/other.ome.zarr"}, True),
        ({"resources": {"workers": 3}}, True),
        ({"pyramid": {"levels": 2}}, True),
        ({"output__overwrite": True}, False),
        ({"backoffLimit": 5}, False),
        ({"ttlSecondsAfterFinished": 60}, False),
        ({"retry": {"intervalSeconds": 1}}, False),
        ({"activeDeadlineSeconds": 3600}, False),
        ({"pod__image": "registry.example/h5ngff:2"}, False),
        ({"pod__nodeSelector": {"disk": "ssd"}}, False),
    ],
)
def test_which_edits_change_the_conversion(change, reruns):
    assert (_with(**change).conversion_hash() != _with().conversion_hash()) is reruns


def test_the_lease_key_is_the_claim_and_the_path_inside_it():
    assert output_key(_with()) == "pvc:scans:/out.ome.zarr"
    moved = _with(
        pod={"volumes": BASE["pod"]["volumes"], "volumeMounts": [{"name": "data", "mountPath": "/mnt/x"}]},
        output__path="/mnt/x/./sub/../out.ome.zarr",
    )
    assert output_key(moved) == "pvc:scans:/out.ome.zarr"  # same claim, another mount point: the same output
    other = _with(
        pod={
            "volumes": [{"name": "data", "persistentVolumeClaim": {"claimName": "other"}}],
            "volumeMounts": BASE["pod"]["volumeMounts"],
        }
    )
    assert output_key(other) != output_key(_with())
    plain = parse_job_spec(
        {"source": BASE["source"], "output": {"path": "out.ome.zarr"}, "pod": {"workingDir": "/work"}}
    )
    assert output_key(plain) == "path:/work/out.ome.zarr"
    name = lease_name(output_key(_with()))
    assert name.startswith("h5ngff-output-") and len(name) <= 63 and name == lease_name("pvc:scans:/out.ome.zarr")


def test_an_attempt_starts_only_under_the_lease_it_takes_again_first():
    """A retry (or a first attempt created again) takes the run's Lease again before its runner
    Job: a pass that gave the Lease back may have died before its status write said so (issue
    41, found by the state machine for batches). Someone else holding it now: the run waits."""
    s = started(phase="Pending", attempt=2, runnerJobUid=None)
    s["firstAttempt"] = 1
    d, _ = run(s, pods=[], lease=None)
    assert d.needs == frozenset({"lease"}) and d.ensure_attempt is None
    busy = LeaseState("lease-a", False, "team/other/uid-9")
    d, s2 = run(s, pods=[], lease=busy)
    assert d.ensure_attempt is None and s2["reason"] == "OutputBusy" and "outputLease" not in s2
    d, _ = run(s2, pods=[], lease=busy)  # and it waits as a new run would, starting nothing
    assert d.ensure_attempt is None
    d, _ = run(s, pods=[], lease=HELD)  # control: held, the attempt starts
    assert d.ensure_attempt == 2
