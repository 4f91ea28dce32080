"""The pure ConversionBatch reconcile: the GitOps rules, each with its negative control.

A small driver plays the operator's handlers: it applies each decision's status patch, answers
"leases" from a table of outputs someone else holds, and "job" from the runner Job's state."""

from __future__ import annotations

import dataclasses

from h5ngff.operator.controller.batchreconcile import BatchObserved, DesiredItem, LeaseAnswer, reconcile_batch
from h5ngff.operator.schema.batchspec import parse_batch_spec
from h5ngff.operator.controller.diagnose import JobSummary
from h5ngff.operator.schema.status import merge, progress_status

BASE = {"output": {"path": "/data/out/{stem}.ome.zarr"}, "backoffLimit": 1}


def src(name: str) -> dict:
    return {"source": {"path": f"/data/{name}.h5", "dataset": "/d"}}


def desired(spec: dict) -> tuple[DesiredItem, ...]:
    batch = parse_batch_spec(spec)
    return tuple(
        DesiredItem(p.id, p.item.source, p.output, p.conversion_hash(), f"lease-{p.id}") for p in batch.planned_items()
    )


class Driver:
    """The operator's side of one batch: status, the runner Job's state, busy outputs."""

    def __init__(self, spec: dict):
        self._spec = spec
        self.generation = 1
        self.status: dict = {}
        self.job_state: dict[str, str] = {}  # runner Job name -> state
        self.busy: set[str] = set()  # outputs someone else holds
        self.leases: set[str] = set()  # Leases this batch holds
        self.created: list[int] = []
        self.denial: str | None = None
        self.pods: tuple = ()

    @property
    def spec(self) -> dict:
        return self._spec

    @spec.setter
    def spec(self, spec: dict) -> None:
        """An edit: the API server moves metadata.generation when the spec changes."""
        self.generation += spec != self._spec
        self._spec = spec

    def observed(self) -> BatchObserved:
        jobs = tuple(JobSummary(n, 0, s, uid=f"uid-{n}") for n, s in self.job_state.items())
        return BatchObserved(
            "run",
            self.status,
            desired(self.spec),
            backoff_limit=self.spec.get("backoffLimit", 2),
            jobs=jobs,
            now="t",
            generation=self.generation,
            policy_denial=self.denial,
        )

    def step(self):
        o = self.observed()
        d = reconcile_batch(o)
        while d.needs:
            if "leases" in d.needs:
                answers = {}
                for item in o.items or ():
                    if item.id in d.acquire:
                        held = item.output not in self.busy
                        answers[item.id] = LeaseAnswer(item.lease_name, held, "" if held else "default/other/uid-other")
                        if held:
                            self.leases.add(item.lease_name)
                o = dataclasses.replace(o, leases=answers)
            if "job" in d.needs:
                o = dataclasses.replace(o, job_checked=True)
            if "pods" in d.needs:
                o = dataclasses.replace(o, pods=self.pods, pods_checked=True)
            d = reconcile_batch(o)
        self.leases -= set(d.release_leases)
        self.status = merge(self.status, d.patch)
        if d.ensure_attempt:
            self.created.append(d.ensure_attempt)
            self.job_state.setdefault(self.status["runnerJob"], "active")
        return d

    def report(self, outcomes: dict[str, tuple[str, str | None]]):
        """The runner: item output -> (outcome, reason), for the current attempt."""
        by_output = {i["output"]: i["id"] for i in self.status["items"]}
        reports = {
            by_output[out]: {"attempt": self.status["attempts"], "outcome": o, "reason": r, "message": r and f"{r}!"}
            for out, (o, r) in outcomes.items()
        }
        self.status = merge(self.status, {"itemReports": reports})

    def end_job(self, state: str = "succeeded"):
        self.job_state[self.status["runnerJob"]] = state

    def phases(self) -> dict[str, str]:
        return {i["output"].rsplit("/", 1)[-1]: i["phase"] for i in self.status.get("items", ())}


def run_to_end(dr: Driver, outcomes: dict[str, tuple[str, str | None]] | None = None):
    dr.step()
    running = [i["output"] for i in dr.status["items"] if i["phase"] == "Running"]
    dr.report(outcomes or {o: ("Succeeded", None) for o in running})
    dr.end_job()
    dr.step()


A, B, C = "/data/out/a.ome.zarr", "/data/out/b.ome.zarr", "/data/out/c.ome.zarr"


def test_a_batch_runs_its_items_in_one_attempt_and_succeeds():
    dr = Driver({**BASE, "items": [src("a"), src("b")]})
    d = dr.step()
    assert d.ensure_attempt == 1 and dr.created == [1]
    assert dr.status["runningItems"] == [i["id"] for i in dr.status["items"]] and dr.status["phase"] == "Running"
    assert dr.status["running"] == 2 and dr.status["total"] == 2 and len(dr.leases) == 2
    dr.report({A: ("Succeeded", None), B: ("Succeeded", None)})
    dr.end_job()
    dr.step()
    assert dr.phases() == {"a.ome.zarr": "Succeeded", "b.ome.zarr": "Succeeded"}
    assert dr.status["phase"] == "Succeeded" and dr.status["succeeded"] == 2 and "runningItems" not in dr.status
    assert dr.leases == set()  # every item's Lease went back with its end


def test_a_running_items_progress_reaches_its_status_and_stays_with_its_outcome():
    dr = Driver({**BASE, "items": [src("a"), src("b")]})
    dr.step()
    ids = {i["output"]: i["id"] for i in dr.status["items"]}
    half = progress_status(2, 4)
    running = {"attempt": 1, "outcome": "Running", "progress": half}
    dr.status = merge(dr.status, {"itemReports": {ids[A]: running, ids[B]: {"attempt": 1, "outcome": "Running"}}})
    dr.step()
    items = {i["output"]: i for i in dr.status["items"]}
    assert items[A]["phase"] == "Running" and items[A]["progress"] == half
    assert "progress" not in items[B]  # negative control: no progress reported, none shown
    done = progress_status(4, 4)
    dr.status = merge(dr.status, {"itemReports": {ids[A]: {"attempt": 1, "outcome": "Succeeded", "progress": done}}})
    dr.step()
    assert {i["output"]: i for i in dr.status["items"]}[A]["progress"] == done


def test_finished_items_never_run_again_across_restarts():
    dr = Driver({**BASE, "items": [src("a"), src("b")]})
    run_to_end(dr)
    for _ in range(3):  # a restarted (or upgraded) operator sees the same status and spec
        assert reconcile_batch(dr.observed()).patch == {} and reconcile_batch(dr.observed()).ensure_attempt is None
    assert dr.created == [1]
    # Negative control: a status that lost its record of success would run them again.
    forgot = {**dr.status, "items": [{**i, "phase": "Pending"} for i in dr.status["items"]]}
    dr.status = forgot
    dr.step()
    assert dr.created == [1, 2]


def test_an_item_added_after_success_runs_alone():
    dr = Driver({**BASE, "items": [src("a"), src("b")]})
    run_to_end(dr)
    dr.spec = {**dr.spec, "items": [src("a"), src("b"), src("c")]}
    dr.step()
    assert dr.created == [1, 2] and dr.phases() == {
        "a.ome.zarr": "Succeeded",
        "b.ome.zarr": "Succeeded",
        "c.ome.zarr": "Running",
    }
    (only,) = dr.status["runningItems"]
    assert next(i for i in dr.status["items"] if i["id"] == only)["output"] == C and dr.status["phase"] == "Running"
    dr.report({C: ("Succeeded", None)})
    dr.end_job()
    dr.step()
    assert dr.status["phase"] == "Succeeded" and dr.status["succeeded"] == 3


def test_an_item_added_while_running_waits_for_the_next_attempt():
    dr = Driver({**BASE, "items": [src("a")]})
    dr.step()
    dr.spec = {**dr.spec, "items": [src("a"), src("b")]}
    dr.step()
    assert dr.created == [1] and dr.phases() == {"a.ome.zarr": "Running", "b.ome.zarr": "Pending"}
    dr.report({A: ("Succeeded", None)})
    dr.end_job()
    dr.step()
    assert dr.created == [1, 2] and dr.phases() == {"a.ome.zarr": "Succeeded", "b.ome.zarr": "Running"}


def test_a_removed_item_is_dropped_and_its_output_left_alone():
    dr = Driver({**BASE, "items": [src("a"), src("b")]})
    run_to_end(dr)
    dr.spec = {**dr.spec, "items": [src("a")]}
    d = dr.step()
    assert dr.phases() == {"a.ome.zarr": "Succeeded"} and dr.status["total"] == 1
    assert d.delete_job is None and not d.ensure_attempt and dr.created == [1]  # nothing deleted, nothing run
    # Removed while its attempt runs: kept until the attempt ends, then dropped.
    dr.spec = {**dr.spec, "items": [src("a"), src("c")]}
    dr.step()
    dr.spec = {**dr.spec, "items": [src("a")]}
    dr.step()
    assert dr.phases()["c.ome.zarr"] == "Running" and dr.leases
    dr.report({C: ("Succeeded", None)})
    dr.end_job()
    dr.step()
    assert dr.phases() == {"a.ome.zarr": "Succeeded"} and dr.leases == set()


def test_an_edit_of_one_items_conversion_reruns_that_item_only():
    dr = Driver({**BASE, "items": [src("a"), src("b")]})
    run_to_end(dr)
    edited = src("b")
    edited["source"]["dataset"] = "/other"
    dr.spec = {**dr.spec, "items": [src("a"), edited]}
    dr.step()
    assert dr.phases() == {"a.ome.zarr": "Succeeded", "b.ome.zarr": "Running"} and dr.created == [1, 2]
    # Negative control: an edit of how the pods run (not the conversion) re-runs nothing.
    dr.report({B: ("Succeeded", None)})
    dr.end_job()
    dr.step()
    dr.spec = {**dr.spec, "pod": {"image": "registry.example/h5ngff:2"}, "backoffLimit": 3}
    dr.step()
    assert dr.created == [1, 2] and set(dr.phases().values()) == {"Succeeded"}
    # An edit of a conversion field of the batch changes every item's conversion.
    dr.spec = {**dr.spec, "output": {**dr.spec["output"], "chunks": [32, 32, 32]}}
    dr.step()
    assert dr.created == [1, 2, 3] and set(dr.phases().values()) == {"Running"}


def test_an_item_whose_output_another_holds_waits_and_is_not_started():
    dr = Driver({**BASE, "items": [src("a"), src("b")]})
    dr.busy = {B}
    dr.step()
    assert dr.phases() == {"a.ome.zarr": "Running", "b.ome.zarr": "Pending"}
    b = next(i for i in dr.status["items"] if i["output"] == B)
    assert b["reason"] == "OutputBusy" and "default/other" in b["message"] and "outputLease" not in b
    assert len(dr.status["runningItems"]) == 1
    dr.report({A: ("Succeeded", None)})
    dr.end_job()
    dr.step()
    assert dr.phases()["b.ome.zarr"] == "Pending" and dr.created == [1]  # still busy: no attempt for it
    dr.busy = set()
    dr.step()
    assert dr.phases()["b.ome.zarr"] == "Running" and dr.created == [1, 2]


def test_failures_retry_up_to_the_backoff_limit_and_permanent_ones_do_not():
    dr = Driver({**BASE, "items": [src("a"), src("b")]})  # backoffLimit 1: two attempts per item
    dr.step()
    dr.report({A: ("Failed", "OOMKilled"), B: ("Failed", "SourceUnreadable")})
    dr.end_job("failed")
    d = dr.step()  # the attempt's end, and the retry of what may succeed, in one pass
    assert dr.phases() == {"a.ome.zarr": "Running", "b.ome.zarr": "Failed"}
    assert d.ensure_attempt == 2 and d.resume == tuple(dr.status["runningItems"])  # the retry resumes, never overwrites
    dr.end_job("failed")  # and its runner dies without a report
    dr.step()
    a = next(i for i in dr.status["items"] if i["output"] == A)
    assert a["phase"] == "Failed" and a["reason"] == "RunnerFailed" and a["attempts"] == 2
    assert dr.status["phase"] == "Failed" and dr.status["reason"] == "ItemsFailed" and dr.status["failed"] == 2
    assert dr.step().ensure_attempt is None and dr.created == [1, 2]


def test_a_policy_denied_batch_starts_nothing_and_stops_a_running_attempt():
    dr = Driver({**BASE, "items": [src("a")]})
    dr.denial = "spec.pod.image 'evil' is not allowed"
    d = dr.step()
    assert (
        dr.status["phase"] == "Failed"
        and dr.status["reason"] == "PolicyDenied"
        and d.ensure_attempt is None
        and not dr.created
    )
    assert reconcile_batch(dr.observed()).patch == {}
    # Negative control: the same batch, allowed, runs; denied while running, it is stopped.
    dr = Driver({**BASE, "items": [src("a")]})
    dr.step()
    dr.denial = "tightened"
    d = dr.step()
    assert (
        d.delete_job == "run-runner-1"
        and d.delete_cluster
        and dr.leases == set()
        and dr.status["reason"] == "PolicyDenied"
    )


def test_an_invalid_spec_starts_nothing():
    o = BatchObserved("run", {}, None, now="t", spec_error="items[0].source.path: bad")
    d = reconcile_batch(o)
    assert d.patch["phase"] == "Failed" and d.patch["reason"] == "InvalidSpec" and d.ensure_attempt is None
    assert reconcile_batch(dataclasses.replace(o, status=merge({}, d.patch))).patch == {}


def test_a_new_attempt_waits_for_the_previous_attempts_pods():
    dr = Driver({**BASE, "items": [src("a")]})
    run_to_end(dr)
    dr.spec = {**dr.spec, "items": [src("a"), src("b")]}
    dr.pods = ({"metadata": {"name": "run-runner-1-abcde"}, "status": {"phase": "Running"}},)
    d = dr.step()
    assert (
        d.ensure_attempt is None
        and d.delete_cluster
        and "run-runner-1-abcde" in dr.status["message"]
        and dr.created == [1]
    )
    dr.pods = (
        {"metadata": {"name": "run-runner-1-abcde"}, "status": {"phase": "Succeeded"}},
    )  # exited: the attempt starts
    assert dr.step().ensure_attempt == 2
