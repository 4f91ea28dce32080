"""The operator's decisions (pure ``reconcile``) and the status it and the runner write."""

from __future__ import annotations

import pytest

from h5ngff.engine.progress import Progress
from h5ngff.operator.controller.lease import LeaseState
from h5ngff.operator.controller.reconcile import JobSummary, Observed, failure_cause, job_summary, reconcile
from h5ngff.operator.schema.status import (
    ConversionJobStatus,
    combine,
    failure_record,
    merge,
    read_status,
    set_condition,
)
from h5ngff.operator.runner.reports import progress_patch

T0, T1 = "2026-01-01T00:00:00Z", "2026-01-01T00:01:00Z"
#: A plan as the runner writes it (the operator reads the status as the model: a partial plan is
#: left out of its view, as any field this build cannot read).
PLAN = {
    "shape": [64, 512, 512],
    "dtype": "uint16",
    "chunks": [16, 128, 128],
    "slab": [16, 512, 512],
    "levels": 3,
    "passes": 1,
    "tasks": 40,
    "workers": 4,
    "threadsPerWorker": 1,
    "memoryLimit": "1Gi",
    "podLimit": "1536Mi",
    "memoryLimitBytes": 1 << 30,
    "podLimitBytes": 1536 << 20,
    "predictedPeakBytes": 700 << 20,
    "allocator": "jemalloc",
}


def observe(status=None, jobs=(), pods=(), backoff=2, checked=False, now=T1):
    return Observed(
        "scan",
        dict(status or {}),
        backoff,
        "/data/out.ome.zarr",
        tuple(jobs),
        tuple(pods),
        checked,
        now,
        conversion="c1",
        lease_name="lease-x",
        lease=LeaseState("lease-x", True),
    )


def apply(status, decision):
    return merge(status, decision.patch)


def oom_pod(attempt=1, limit="1Gi"):
    return {
        "metadata": {
            "name": f"scan-runner-{attempt}-x7k2p",
            "labels": {"h5ngff.dev/attempt": str(attempt), "app.kubernetes.io/component": "runner"},
        },
        "spec": {"containers": [{"name": "runner", "resources": {"limits": {"memory": limit}}}]},
        "status": {
            "phase": "Failed",
            "containerStatuses": [
                {"name": "runner", "state": {"terminated": {"reason": "OOMKilled", "exitCode": 137}}}
            ],
        },
    }


def failed(attempt):
    return JobSummary(
        f"scan-runner-{attempt}",
        attempt,
        "failed",
        "BackoffLimitExceeded",
        "Job has reached the specified backoff limit",
    )


def test_a_new_job_gets_its_first_runner_and_pending():
    d = reconcile(observe())
    assert d.ensure_attempt == 1 and not d.resume
    s = apply({}, d)
    assert s["phase"] == "Pending" and s["attempts"] == 1 and s["runnerJob"] == "scan-runner-1"
    assert s["startTime"] == T1 and s["output"] == "/data/out.ome.zarr"
    assert d.event[0:2] == ("Normal", "RunnerCreated")


def test_a_missing_runner_of_the_current_attempt_is_ensured_not_a_new_attempt():
    s = {"phase": "Pending", "attempts": 2, "startTime": T0}
    assert reconcile(observe(s)).needs == {"pods"}  # an earlier attempt's pods must be gone first
    d = reconcile(observe(s, checked=True))
    assert d.ensure_attempt == 2 and d.resume and d.event is None
    assert "attempts" not in d.patch


def test_runner_progress_becomes_conditions_and_success_completes():
    s = {
        "phase": "Running",
        "attempts": 1,
        "plan": PLAN,
        "progress": {"slabsDone": 12, "slabsTotal": 40, "percent": 30, "summary": "12/40 (30%)"},
    }
    d = reconcile(observe(s, [JobSummary("scan-runner-1", 1, "active")]))
    types = {c["type"]: c["status"] for c in d.patch["conditions"]}
    assert types == {"Planned": "True", "Running": "True"} and d.ensure_attempt is None
    s = apply(s, d)
    assert (
        reconcile(observe(s, [JobSummary("scan-runner-1", 1, "active")])).patch == {}
    )  # idempotent: nothing new to write
    done = apply(s, reconcile(observe(s, [JobSummary("scan-runner-1", 1, "succeeded")])))
    assert done["phase"] == "Succeeded" and done["completionTime"] == T1
    assert done["progress"]["slabsDone"] == 40 and done["progress"]["percent"] == 100
    assert {c["type"]: c["status"] for c in done["conditions"]}["Complete"] == "True"


def test_a_failed_runner_without_a_report_needs_its_pods_looked_at():
    s = {"phase": "Pending", "attempts": 1}
    d = reconcile(observe(s, [failed(1)]))
    assert d.needs_pods and not d.patch and d.ensure_attempt is None


def test_an_oomkilled_runner_pod_is_retried_with_resume_until_the_backoff_limit():
    s = {"phase": "Running", "attempts": 1, "startTime": T0}
    d = reconcile(observe(s, [failed(1)], [oom_pod(1, "1Gi")], backoff=1, checked=True))
    assert d.ensure_attempt is None and d.delete_cluster  # the next pass starts it, once the backoff passed
    assert d.event[:2] == ("Warning", "Retrying")
    s = apply(s, d)
    assert s["phase"] == "Pending" and s["attempts"] == 2 and s["reason"] == "OOMKilled" and s["nextRetryTime"] == T1
    d = reconcile(observe(s, [failed(1)], [oom_pod(1, "1Gi")], backoff=1, checked=True))
    assert d.ensure_attempt == 2 and d.resume
    assert s["failures"][0]["reason"] == "OOMKilled" and "1Gi" in s["failures"][0]["message"]
    # attempt 2 fails the same way: backoffLimit 1 allows no third attempt
    d = reconcile(observe(s, [failed(1), failed(2)], [oom_pod(2)], backoff=1, checked=True))
    s = apply(s, d)
    assert d.ensure_attempt is None and s["phase"] == "Failed" and s["reason"] == "BackoffLimitExceeded"
    assert "2 attempt(s) failed" in s["message"] and "OOMKilled" in s["message"]
    assert [f["attempt"] for f in s["failures"]] == [1, 2]


def test_backoff_limit_zero_means_no_retry():
    d = reconcile(observe({"phase": "Running", "attempts": 1}, [failed(1)], [oom_pod()], backoff=0, checked=True))
    assert d.ensure_attempt is None and d.patch["reason"] == "BackoffLimitExceeded"


@pytest.mark.parametrize("reason", ["OOMKilled", "NannyTerminated", "WorkerFailed", "ClusterUnavailable"])
def test_worker_failures_the_runner_reports_are_retried(reason):
    s = {
        "phase": "Running",
        "attempts": 1,
        "runner": {"attempt": 1, "outcome": "Failed", "reason": reason, "message": "pod limit 286 MiB"},
    }
    d = reconcile(observe(s, [failed(1)]))
    assert not d.needs_pods  # the runner said why; no pod listing needed
    assert apply(s, d)["attempts"] == 2 and apply(s, d)["failures"][-1]["reason"] == reason
    assert "runner" not in apply(s, d)  # the next attempt reports afresh


@pytest.mark.parametrize("reason", ["InvalidSpec", "SourceUnreadable", "OutputConflict", "BudgetTooSmall"])
def test_input_failures_are_final_at_once(reason):
    s = {
        "phase": "Planned",
        "attempts": 1,
        "runner": {"attempt": 1, "outcome": "Failed", "reason": reason, "message": "m"},
    }
    d = reconcile(observe(s, [failed(1)], backoff=5))
    out = apply(s, d)
    assert d.ensure_attempt is None and out["phase"] == "Failed" and out["reason"] == reason
    assert {c["type"]: c["reason"] for c in out["conditions"]}["Failed"] == reason


def test_a_report_from_an_older_attempt_is_not_this_attempts_reason():
    s = {"phase": "Pending", "attempts": 2, "runner": {"attempt": 1, "outcome": "Failed", "reason": "SourceUnreadable"}}
    s = read_status(ConversionJobStatus, s)
    reason, _ = failure_cause(s, 2, failed(2), (oom_pod(2),))
    assert reason == "OOMKilled"
    reason, message = failure_cause(s, 2, failed(2), ())
    assert reason == "RunnerFailed" and "BackoffLimitExceeded" in message


def test_a_runner_that_exited_without_reporting_says_so():
    pod = oom_pod()
    pod["status"]["containerStatuses"][0]["state"]["terminated"] = {"reason": "Error", "exitCode": 3}
    reason, message = failure_cause(ConversionJobStatus(), 1, failed(1), (pod,))
    assert reason == "RunnerFailed" and "code 3" in message and "kubectl logs" in message


def test_finished_jobs_are_left_alone():
    for phase in ("Succeeded", "Failed"):
        d = reconcile(
            observe({"phase": phase, "attempts": 1, "conversionHash": "c1", "observedGeneration": 1}, [failed(1)])
        )
        assert d == type(d)()


def test_job_summary_reads_the_job_controllers_words():
    job = {
        "metadata": {
            "name": "scan-runner-3",
            "labels": {"h5ngff.dev/attempt": "3"},
            "ownerReferences": [{"uid": "u1", "controller": True}],
        },
        "status": {
            "failed": 1,
            "conditions": [{"type": "Failed", "status": "True", "reason": "DeadlineExceeded", "message": "too long"}],
        },
    }
    s = job_summary(job)
    assert (s.attempt, s.state, s.reason, s.owner_uid) == (3, "failed", "DeadlineExceeded", "u1")
    assert job_summary({"metadata": {"name": "x"}, "status": {"active": 1}}).state == "active"
    assert job_summary({"metadata": {"name": "x"}, "status": {"succeeded": 1}}).state == "succeeded"
    assert job_summary({"metadata": {"name": "x"}}).state == "pending"


def test_conditions_keep_their_transition_time_while_unchanged():
    c = set_condition(None, "Running", "True", "Writing", None, T0)
    c = set_condition(c, "Running", "True", "Writing", "more", T1)
    assert c[0]["lastTransitionTime"] == T0 and c[0]["message"] == "more"
    c = set_condition(c, "Running", "False", "Finished", None, T1)
    assert c[0]["lastTransitionTime"] == T1


def test_failure_records_are_idempotent_per_attempt():
    r = failure_record(1, "OOMKilled", "a", T0, None)
    assert failure_record(1, "OOMKilled", "a", T1, r) == [
        {"attempt": 1, "reason": "OOMKilled", "message": "a", "time": T1}
    ]
    many = None
    for attempt in range(1, 15):
        many = failure_record(attempt, "OOMKilled", "", T0, many)
    assert len(many) == 10 and many[-1]["attempt"] == 14


def test_merge_patches_combine_like_applying_both():
    a = {"progress": {"slabsDone": 1, "slabsTotal": 4}, "runner": {"reason": "x"}}
    b = {"progress": {"slabsDone": 2}, "runner": None}
    base = {"phase": "Running", "runner": {"reason": "old"}, "progress": {"slabsTotal": 4, "bytesRead": 5}}
    assert merge(merge(base, a), b) == merge(base, combine(a, b))


def test_every_status_we_build_fits_the_status_schema():
    s = {}
    s = apply(s, reconcile(observe(s)))
    p = Progress(phase="Writing", slabs_done=3, slabs_total=7, bytes_read=10, bytes_written=5)
    s = merge(s, progress_patch(p, T1))
    s = merge(s, {"runner": {"attempt": 1, "outcome": "Failed", "reason": "OOMKilled", "message": "m", "time": T1}})
    s = apply(s, reconcile(observe(s, [failed(1)], backoff=0)))
    ConversionJobStatus.model_validate(s)  # extra="forbid": an unknown or misspelt field fails here
    with pytest.raises(ValueError):
        ConversionJobStatus.model_validate({**s, "phse": "Failed"})
