"""The failures the state machine of tests/test_operator_invariants.py found, each pinned as a
replay of its steps through the same machine (both invariants checked after every step, as
hypothesis does). Each one failed on cb6367c (run there once) or on this branch before its fix;
docs/operator.md's lifecycle tables name them.
"""

from __future__ import annotations

from typing import Any

from test_operator_invariants import LEASES, OUTPUTS, OperatorWorld

from h5ngff.jobspec import BATCH_KIND, KIND


class Draws:
    """Plays hypothesis' ``data`` for a replayed step: the values it drew, in order."""

    def __init__(self, *values: Any):
        self.values = list(values)

    def draw(self, strategy: Any) -> Any:
        return self.values.pop(0)


def replay(world: OperatorWorld, *steps: tuple[str, dict[str, Any]]) -> OperatorWorld:
    """Run ``steps`` (rule name, arguments) on ``world``, checking both invariants after each,
    as hypothesis does."""
    for name, kwargs in steps:
        draws = kwargs.pop("draws", None)
        args = {"data": Draws(*draws)} if draws is not None else {}
        getattr(world, name)(**args, **kwargs)
        world.at_most_one_attempt_writes_each_output_and_holds_its_lease()
        world.no_finished_conversion_runs_again_unless_it_changed()
    return world


B1, J1 = (BATCH_KIND, "b1"), (KIND, "j1")
BATCH_A = {"name": "b1", "stems": ("a",), "dataset": "/d", "default_written": False, "image": None}
JOB_A = {"name": "j1", "output": OUTPUTS[0], "dataset": "/d", "default_written": False, "overwrite": True}


def _status(world: OperatorWorld, key: tuple[str, str]) -> dict[str, Any]:
    return world._objects()[key].get("status") or {}


def test_regression_a_retried_batch_item_keeps_its_lease():
    """cb6367c: the Lease of an item that failed with OOMKilled went into the releases of the pass
    that retried it and was recorded again in the next: runner-2 ran without it, and a
    ConversionJob with overwrite on that output started beside it."""
    world = replay(
        OperatorWorld(),
        ("apply_batch", BATCH_A),
        ("reconcile", {"draws": [B1]}),
        ("a_runner_pod_starts", {"draws": ["b1-runner-1"]}),
        ("a_runner_reports", {"draws": ["b1-runner-1"], "outcome": "OOMKilled"}),
        ("a_runner_exits", {"draws": ["b1-runner-1"], "code": 1, "cleans_up": True}),
        ("reconcile", {"draws": [B1]}),
        ("a_runner_pod_starts", {"draws": ["b1-runner-2"]}),
        ("apply_job", {**JOB_A, "image": None}),
        ("reconcile", {"draws": [J1]}),
    )
    assert "b1-runner-2" in world._runner_jobs() and "j1-runner-1" not in world._runner_jobs()
    assert _status(world, J1)["reason"] == "OutputBusy"


def test_regression_a_batch_item_keeps_its_lease_until_its_attempt_s_pods_are_gone():
    """cb6367c gave an item's Lease back on the runner's report, while the runner (and its Dask
    workers) still ran."""
    world = replay(
        OperatorWorld(),
        ("apply_batch", BATCH_A),
        ("reconcile", {"draws": [B1]}),
        ("a_runner_pod_starts", {"draws": ["b1-runner-1"]}),
        ("a_runner_makes_its_dask_cluster", {"draws": ["b1-runner-1"]}),
        ("a_runner_reports", {"draws": ["b1-runner-1"], "outcome": "Succeeded"}),
        ("reconcile", {"draws": [B1]}),
        ("a_runner_exits", {"draws": ["b1-runner-1"], "code": 0, "cleans_up": False}),
        ("reconcile", {"draws": [B1]}),
    )
    item = _status(world, B1)["items"][0]
    assert item["phase"] == "Succeeded" and item["outputLease"]  # the workers may still write
    replay(world, *[("a_terminating_pod_exits", {"draws": [p]}) for p in world._terminating()])
    replay(world, ("reconcile", {"draws": [B1]}))
    assert "outputLease" not in _status(world, B1)["items"][0] and not world.api.of(
        "coordination.k8s.io/v1", LEASES, "leases"
    )


def test_regression_writing_a_default_out_never_reruns_a_finished_batch_item():
    """cb6367c re-ran every item of a finished batch (with overwrite) when ``output.checksums:
    true``, the default, was written out."""
    world = replay(
        OperatorWorld(),
        ("apply_batch", BATCH_A),
        ("reconcile", {"draws": [B1]}),
        ("a_runner_pod_starts", {"draws": ["b1-runner-1"]}),
        ("write_the_default_out_or_remove_it", {"draws": [B1]}),
        ("a_runner_reports", {"draws": ["b1-runner-1"], "outcome": "Succeeded"}),
        ("a_runner_exits", {"draws": ["b1-runner-1"], "code": 0, "cleans_up": True}),
        ("reconcile", {"draws": [B1]}),
        ("reconcile", {"draws": [B1]}),
    )
    assert sorted(world._runner_jobs()) == ["b1-runner-1"] and _status(world, B1)["phase"] == "Succeeded"


def test_regression_writing_a_default_out_never_reruns_a_finished_job():
    world = replay(
        OperatorWorld(),
        ("apply_job", {**JOB_A, "image": None}),
        ("reconcile", {"draws": [J1]}),
        ("a_runner_pod_starts", {"draws": ["j1-runner-1"]}),
        ("a_runner_reports", {"draws": ["j1-runner-1"], "outcome": "Succeeded"}),
        ("a_runner_exits", {"draws": ["j1-runner-1"], "code": 0, "cleans_up": True}),
        ("reconcile", {"draws": [J1]}),
        ("write_the_default_out_or_remove_it", {"draws": [J1]}),
        ("reconcile", {"draws": [J1]}),
        ("write_the_default_out_or_remove_it", {"draws": [J1]}),
        ("reconcile", {"draws": [J1]}),
    )
    assert sorted(world._runner_jobs()) == ["j1-runner-1"] and _status(world, J1)["phase"] == "Succeeded"


def test_regression_a_policy_denied_edit_keeps_the_lease_until_the_stopped_runner_pod_is_gone():
    """cb6367c gave the Lease back in the pass that stopped the run, while its runner pod was
    still terminating: a waiting job's runner could start beside it."""
    world = replay(
        OperatorWorld(),
        ("apply_job", {**JOB_A, "image": None}),
        ("reconcile", {"draws": [J1]}),
        ("a_runner_pod_starts", {"draws": ["j1-runner-1"]}),
        ("apply_job", {**JOB_A, "image": "evil.example/miner:1"}),
        ("reconcile", {"draws": [J1]}),
        ("apply_batch", BATCH_A),
        ("reconcile", {"draws": [B1]}),
    )
    assert _status(world, J1)["reason"] == "PolicyDenied" and _status(world, J1)["outputLease"]
    assert not any(j.startswith("b1") for j in world._runner_jobs())  # the batch waits for the output
    replay(world, ("a_terminating_pod_exits", {"draws": ["j1-runner-1-pod"]}), ("reconcile", {"draws": [J1]}))
    replay(world, ("reconcile", {"draws": [B1]}))
    assert "b1-runner-1" in world._runner_jobs()  # and runs once the stopped runner is gone


def test_regression_a_batch_runner_gone_before_its_uid_was_recorded_never_runs_again():
    """cb6367c: the operator stopped before it recorded the runner Job's uid, every item reported
    Succeeded, and the Job's TTL removed it; after a restart runner-1 was created again."""
    world = OperatorWorld()
    world.api.job_create_fault = "lost-created"  # created, and nobody heard: its uid is never recorded
    replay(
        world,
        ("apply_batch", BATCH_A),
        ("reconcile", {"draws": [B1]}),
        ("a_runner_pod_starts", {"draws": ["b1-runner-1"]}),
        ("a_runner_reports", {"draws": ["b1-runner-1"], "outcome": "Succeeded"}),
        ("a_runner_exits", {"draws": ["b1-runner-1"], "code": 0, "cleans_up": True}),
        ("a_finished_runner_job_s_ttl_runs_out", {"draws": ["b1-runner-1"]}),
        ("restart_the_operator", {}),
        ("reconcile", {"draws": [B1]}),
        ("reconcile", {"draws": [B1]}),
    )
    assert world._runner_jobs() == {} and _status(world, B1)["phase"] == "Succeeded"


def test_regression_a_runner_that_reported_success_and_then_failed_is_not_run_again():
    """Found by the machine on this branch and on cb6367c: the runner's report of success is its
    last act (after the output's completion marker); its pod dying after it (OOMKilled while the
    metrics linger, evicted) failed the Job, and the job was retried: a finished conversion ran
    again."""
    world = replay(
        OperatorWorld(),
        ("apply_job", {**JOB_A, "image": None}),
        ("reconcile", {"draws": [J1]}),
        ("a_runner_pod_starts", {"draws": ["j1-runner-1"]}),
        ("a_runner_reports", {"draws": ["j1-runner-1"], "outcome": "Succeeded"}),
        ("a_runner_exits", {"draws": ["j1-runner-1"], "code": 1, "cleans_up": False}),
        ("reconcile", {"draws": [J1]}),
        ("reconcile", {"draws": [J1]}),
    )
    assert sorted(world._runner_jobs()) == ["j1-runner-1"] and _status(world, J1)["phase"] == "Succeeded"


def test_regression_an_edit_undone_while_it_waited_for_the_output_takes_no_old_attempt_up():
    """Found by the long profile on this branch (and failing on cb6367c): a job whose run had
    ended, edited while another object held its output, waited OutputBusy as Pending; the edit
    undone, the job took the ended run's attempt up again and created a runner Job without the
    Lease, beside the holder's runner."""
    job_d = {**JOB_A, "image": None, "overwrite": False}
    world = replay(
        OperatorWorld(),
        ("apply_job", job_d),
        ("reconcile", {"draws": [J1]}),
        ("a_runner_pod_starts", {"draws": ["j1-runner-1"]}),
        ("apply_job", {**job_d, "image": "evil.example/miner:1"}),
        ("reconcile", {"draws": [J1]}),
        ("a_terminating_pod_exits", {"draws": ["j1-runner-1-pod"]}),
        ("reconcile", {"draws": [J1]}),
        ("apply_batch", BATCH_A),
        ("reconcile", {"draws": [B1]}),
        ("apply_job", {**job_d, "dataset": "/e"}),
        ("reconcile", {"draws": [J1]}),
        ("apply_job", job_d),
        ("reconcile", {"draws": [J1]}),
        ("reconcile", {"draws": [J1]}),
    )
    assert not [j for j in world._runner_jobs() if j.startswith("j1")]
    assert _status(world, J1)["reason"] == "OutputBusy"  # a new run of it waits for the output


def test_regression_a_batch_item_edited_and_undone_while_it_ran_runs_nothing_more():
    """Found by the long profile on this branch: an item's conversion edited while its attempt
    ran and edited back before the next: its output holds that conversion, so nothing runs."""
    world = replay(
        OperatorWorld(),
        ("apply_batch", {**BATCH_A, "dataset": "/e"}),
        ("reconcile", {"draws": [B1]}),
        ("a_runner_pod_starts", {"draws": ["b1-runner-1"]}),
        ("apply_batch", BATCH_A),
        ("a_runner_reports", {"draws": ["b1-runner-1"], "outcome": "Succeeded"}),
        ("reconcile", {"draws": [B1]}),
        ("a_runner_exits", {"draws": ["b1-runner-1"], "code": 0, "cleans_up": True}),
        ("apply_batch", {**BATCH_A, "dataset": "/e"}),
        ("reconcile", {"draws": [B1]}),
        ("reconcile", {"draws": [B1]}),
    )
    assert sorted(world._runner_jobs()) == ["b1-runner-1"] and _status(world, B1)["phase"] == "Succeeded"


def test_regression_a_denied_batch_whose_lease_went_back_before_a_crash_recreates_no_runner():
    """Found by the CI profile on this branch: a pass released the Lease of a stopped (denied)
    batch and died before its status write; the next pass found the attempt's runner Job missing
    and created it again, without the Lease, beside the job that had taken the output."""
    world = replay(
        OperatorWorld(),
        ("a_job_and_a_batch_share_an_output", {"job_output": OUTPUTS[0], "stems": ("a",), "batch_first": False}),
        ("the_next_runner_job_create_fails", {"fault": "refused"}),
        ("reconcile", {"draws": [B1]}),
        ("the_operator_dies_mid_pass", {"calls": 6, "draws": [B1]}),
        ("apply_batch", {**BATCH_A, "image": "evil.example/miner:1"}),
        ("the_operator_dies_mid_pass", {"calls": 6, "draws": [B1]}),
        ("reconcile", {"draws": [J1]}),
        ("a_runner_pod_starts", {"draws": ["j1-runner-1"]}),
        ("reconcile", {"draws": [B1]}),
    )
    assert "b1-runner-1" not in world._runner_jobs()  # its pod would start beside j1's (it did)
    replay(world, ("reconcile", {"draws": [B1]}))
    assert _status(world, B1)["reason"] == "PolicyDenied" and "outputLease" not in _status(world, B1)["items"][0]


def test_regression_a_success_the_operator_had_not_seen_before_an_edit_is_not_run_again():
    """Found by the long profile on this branch: a runner reported success, the spec was edited
    (another output) before the operator saw the run end, that run was refused by Kubernetes, and
    the edit undone: the first conversion ran again, though its output held it complete."""
    j2 = {"name": "j2", "dataset": "/e", "default_written": False, "image": None, "overwrite": False}
    world = replay(
        OperatorWorld(),
        ("apply_job", {**j2, "output": OUTPUTS[1]}),
        ("reconcile", {"draws": [(KIND, "j2")]}),
        ("a_runner_pod_starts", {"draws": ["j2-runner-1"]}),
        ("a_runner_reports", {"outcome": "Succeeded", "draws": ["j2-runner-1"]}),
        ("the_next_runner_job_create_fails", {"fault": "refused"}),
        ("a_runner_exits", {"cleans_up": True, "code": 0, "draws": ["j2-runner-1"]}),
        ("apply_job", {**j2, "dataset": "/d", "output": OUTPUTS[0]}),
        ("a_finished_runner_job_s_ttl_runs_out", {"draws": ["j2-runner-1"]}),
        ("reconcile", {"draws": [(KIND, "j2")]}),
        ("apply_job", {**j2, "output": OUTPUTS[1]}),
        ("reconcile", {"draws": [(KIND, "j2")]}),
        ("reconcile", {"draws": [(KIND, "j2")]}),
    )
    assert world._runner_jobs() == {} and _status(world, (KIND, "j2"))["phase"] == "Succeeded"
