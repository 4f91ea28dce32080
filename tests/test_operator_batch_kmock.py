"""ConversionBatches with the real kopf operator against KMock.

The first test runs the batch end to end: the operator creates the runner Job, the test executes
its container command as a local process (``H5NGFF_BACKEND=local``, as tests/test_operator_e2e.py
does for a ConversionJob) on real HDF5 files, and plays the Job controller. The others feed the
runner's reports through the real ``StatusReporter``, as tests/test_operator_kmock.py does.
"""

from __future__ import annotations

import asyncio
import json
import os

import numpy as np
import pytest
import zarr

from conftest import smooth, write_h5
from h5ngff.operator.schema.batchspec import parse_batch_spec
from h5ngff.operator.kube import KubeConfig
from h5ngff.operator.schema.rbac import OPERATOR_RULES, RUNNER_BATCH_RULES, RUNNER_RULES, calls
from h5ngff.operator.runner.reporter import StatusReporter
from operator_harness import (
    CB_PATH,
    LEASE_RES,
    batch_manifest,
    emulator,
    fast_config,
    manifest,
    operator_running,
    passes,
    wait_for,
)
from test_operator_e2e import free_port, run_container, scrape_until, scrape_until_exit
from test_operator_kmock import env_of

pytestmark = [pytest.mark.asyncio, pytest.mark.timeout(240), pytest.mark.integration]

SHAPE = (24, 48, 40)
IMAGE = "registry.example/h5ngff:1"


def ids_of(job: dict) -> list[str]:
    return [i for i in env_of(job)["H5NGFF_ITEMS"].split(",") if i]


def by_output(status: dict) -> dict[str, dict]:
    return {os.path.basename(i["output"]): i for i in status.get("items", ())}


async def finish(c, job_name: str, code: int) -> None:
    """The Job controller: the runner's container exited with ``code``."""
    done = (
        {"type": "Complete", "status": "True"}
        if code == 0
        else {"type": "Failed", "status": "True", "reason": "BackoffLimitExceeded"}
    )
    await c.patch_job_status(job_name, {"active": 0, "succeeded" if code == 0 else "failed": 1, "conditions": [done]})


async def batch_passes(cfg, name: str, n: int = 3) -> None:
    await passes(cfg, f"ConversionBatch/{name}", n)


@pytest.mark.slow
async def test_a_batch_converts_its_items_then_only_an_added_one_and_leaves_a_removed_ones_output(tmp_path):
    data = {n: smooth(SHAPE, "uint16", seed=i) for i, n in enumerate("abc")}
    sources = {n: write_h5(tmp_path / f"{n}.h5", d) for n, d in data.items()}
    out = tmp_path / "out"

    def spec(names: str) -> dict:
        return {
            "items": [{"source": {"path": sources[n], "dataset": "/volume/data"}} for n in names],
            "output": {"path": str(out / "{stem}.ome.zarr"), "chunks": [8, 16, 16]},
            "pyramid": {"levels": 2},
            "resources": {"workers": 1},
            "pod": {"image": IMAGE},
        }

    async with emulator() as c, operator_running(cfg := fast_config(c.url)):
        await c.apply_batch(batch_manifest("run", spec("ab")))
        await wait_for(lambda: "run-runner-1" in c.jobs(), what="runner Job 1")
        job = c.jobs()["run-runner-1"]
        assert len(ids_of(job)) == 2 and env_of(job)["H5NGFF_KIND"] == "ConversionBatch"
        assert job["metadata"]["ownerReferences"][0]["kind"] == "ConversionBatch"
        assert len(c.live(LEASE_RES)) == 2  # one writer per item's output
        await c.patch_job_status("run-runner-1", {"active": 1})
        port = free_port()
        runner = asyncio.create_task(
            run_container(job, c.url, str(tmp_path), H5NGFF_METRICS_PORT=str(port), H5NGFF_METRICS_LINGER="60")
        )
        # Prometheus' part: the runner pod serves the batch's series, and lingers for one final scrape.
        final = await asyncio.to_thread(scrape_until, port, _all_done(2), runner, parse=_by_name)
        await asyncio.to_thread(scrape_until_exit, port, runner)
        code, log = await runner
        assert code == 0, (log, c.batch_status("run").get("itemReports"))
        labels = {"conversion_job": "run", "conversion_job_namespace": "default"}
        assert {s.labels["state"]: s.value for s in final["h5ngff_batch_items"] if s.value} == {"Done": 2}
        assert all({k: s.labels[k] for k in labels} == labels for s in final["h5ngff_batch_items"])
        (done_slabs,) = final["h5ngff_batch_slabs_done_total"]
        (planned_slabs,) = final["h5ngff_batch_planned_slabs"]
        assert done_slabs.value == planned_slabs.value > 0
        assert final["h5ngff_worker_rss_bytes"] and all(s.value > 0 for s in final["h5ngff_worker_rss_bytes"])
        await finish(c, "run-runner-1", code)
        await wait_for(lambda: c.batch_status("run").get("phase") == "Succeeded", what="Succeeded")
        status = c.batch_status("run")
        assert (status["total"], status["succeeded"], status["failed"], status["running"]) == (2, 2, 0, 0)
        items = by_output(status)
        assert {k: v["phase"] for k, v in items.items()} == {"a.ome.zarr": "Succeeded", "b.ome.zarr": "Succeeded"}
        assert all(v["result"]["bytesWritten"] > 0 and v["peakRssBytes"] > 0 for v in items.values())
        # Each item's slabs as its runner last reported them: all of them, once it succeeded.
        assert all(v["progress"]["slabsDone"] == v["progress"]["slabsTotal"] > 0 for v in items.values()), items
        await wait_for(lambda: not c.live(LEASE_RES), what="Leases given back")
        for n in "ab":
            np.testing.assert_array_equal(zarr.open_group(str(out / f"{n}.ome.zarr"), mode="r")["0"][...], data[n])
        written = {n: os.path.getmtime(out / f"{n}.ome.zarr" / "zarr.json") for n in "ab"}

        # An item added after the batch succeeded: a second attempt runs it alone.
        await c.edit_batch("run", {"spec": {"items": spec("abc")["items"]}})
        await wait_for(lambda: "run-runner-2" in c.jobs(), what="runner Job 2")
        job2 = c.jobs()["run-runner-2"]
        (only,) = ids_of(job2)
        assert only == by_output(c.batch_status("run"))["c.ome.zarr"]["id"]
        await c.patch_job_status("run-runner-2", {"active": 1})
        code, log = await run_container(job2, c.url, str(tmp_path))
        assert code == 0, log
        await finish(c, "run-runner-2", code)
        await wait_for(
            lambda: c.batch_status("run").get("succeeded") == 3 and c.batch_status("run").get("phase") == "Succeeded",
            what="3 Succeeded",
        )
        np.testing.assert_array_equal(zarr.open_group(str(out / "c.ome.zarr"), mode="r")["0"][...], data["c"])
        assert {n: os.path.getmtime(out / f"{n}.ome.zarr" / "zarr.json") for n in "ab"} == written  # not run again

        # An item removed: dropped from the status, its output left alone, nothing runs.
        await c.edit_batch("run", {"spec": {"items": spec("bc")["items"]}})
        await wait_for(lambda: c.batch_status("run").get("total") == 2, what="the removal")
        await batch_passes(cfg, "run", 5)
        assert (
            set(by_output(c.batch_status("run"))) == {"b.ome.zarr", "c.ome.zarr"}
            and c.batch_status("run")["phase"] == "Succeeded"
        )
        np.testing.assert_array_equal(zarr.open_group(str(out / "a.ome.zarr"), mode="r")["0"][...], data["a"])
        assert c.job_creations() == ["run-runner-1", "run-runner-2"]
        calls_made = c.api_calls()

    assert calls_made["runner"] and calls_made["runner"] <= calls(RUNNER_RULES + RUNNER_BATCH_RULES)
    assert calls_made["operator"] <= calls(OPERATOR_RULES, exercised_only=False)
    assert ("patch", "h5ngff.dev", "conversionbatches", "status") in calls_made["operator"]


def _by_name(text: str) -> dict[str, list]:
    """A scrape's samples (with their labels) by name."""
    from prometheus_client.parser import text_string_to_metric_families

    samples: dict[str, list] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples.setdefault(sample.name, []).append(sample)
    return samples


def _all_done(items: int):
    def done(samples: dict[str, list]) -> bool:
        return any(s.labels.get("state") == "Done" and s.value == items for s in samples.get("h5ngff_batch_items", []))

    return done


def _item(path: str, output: str | None = None) -> dict:
    return {"source": {"path": path, "dataset": "/d"}, **({"output": output} if output else {})}


async def _report(reporter: StatusReporter, patch: dict) -> None:
    try:
        await asyncio.to_thread(reporter, patch, True)
    finally:
        await asyncio.to_thread(reporter.close)


@pytest.mark.slow
async def test_two_batches_naming_one_output_the_second_waits_until_the_first_is_done():
    shared = "/data/out/shared.ome.zarr"
    first = {
        "items": [_item("/data/x.h5", shared)],
        "output": {"path": "/data/out/{stem}.ome.zarr"},
        "pod": {"image": IMAGE},
    }
    second = {
        "items": [_item("/data/y.h5", shared), _item("/data/z.h5")],
        "output": {"path": "/data/out/{stem}.ome.zarr"},
        "pod": {"image": IMAGE},
    }
    async with emulator() as c, operator_running(cfg := fast_config(c.url)):
        await c.apply_batch(batch_manifest("one", first))
        await wait_for(lambda: "one-runner-1" in c.jobs(), what="first runner")
        await c.apply_batch(batch_manifest("two", second))
        await wait_for(lambda: "two-runner-1" in c.jobs(), what="second runner")
        items = by_output(c.batch_status("two"))
        assert items["shared.ome.zarr"]["phase"] == "Pending" and items["shared.ome.zarr"]["reason"] == "OutputBusy"
        assert "default/one/" in items["shared.ome.zarr"]["message"]
        assert ids_of(c.jobs()["two-runner-1"]) == [items["z.ome.zarr"]["id"]]  # the busy item is not started
        # A ConversionJob on the batch's output waits too: a batch's Lease is not taken for abandoned.
        await c.apply(
            manifest(
                "single",
                {
                    "source": {"path": "/data/w.h5", "dataset": "/d"},
                    "output": {"path": shared},
                    "pod": {"image": IMAGE},
                },
            )
        )
        await wait_for(lambda: "OutputBusy" in str(c.status("single")), what="the job waits")
        assert "single-runner-1" not in c.jobs()

        # The first batch finishes: the second runs its waiting item in its next attempt.
        one = by_output(c.batch_status("one"))["shared.ome.zarr"]["id"]
        await _report(
            StatusReporter("default", "one", KubeConfig(c.url), plural="conversionbatches"),
            {"itemReports": {one: {"attempt": 1, "outcome": "Succeeded"}}},
        )
        await finish(c, "one-runner-1", 0)
        two_z = by_output(c.batch_status("two"))["z.ome.zarr"]["id"]
        await _report(
            StatusReporter("default", "two", KubeConfig(c.url), plural="conversionbatches"),
            {"itemReports": {two_z: {"attempt": 1, "outcome": "Succeeded"}}},
        )
        await c.delete_cj("single")  # else it might take the output first: either order is one writer at a time
        await finish(c, "two-runner-1", 0)
        await wait_for(lambda: "two-runner-2" in c.jobs(), timeout=20, what="the waiting item's attempt")
        assert ids_of(c.jobs()["two-runner-2"]) == [by_output(c.batch_status("two"))["shared.ome.zarr"]["id"]]
        await batch_passes(cfg, "two", 3)
        assert c.batch_status("one")["phase"] == "Succeeded"


@pytest.mark.slow
async def test_a_policy_violating_batch_is_refused_with_policy_denied():
    spec = {
        "items": [_item("/data/x.h5")],
        "output": {"path": "/data/out/{stem}.ome.zarr"},
        "pod": {"image": "evil.example/miner:1"},
    }
    async with emulator() as c, operator_running(cfg := fast_config(c.url)):
        await c.apply_batch(batch_manifest("bad", spec))
        await wait_for(lambda: c.batch_status("bad").get("reason") == "PolicyDenied", what="PolicyDenied")
        await batch_passes(cfg, "bad", 3)
        status = c.batch_status("bad")
        assert status["phase"] == "Failed" and "spec.pod.image" in status["message"]
        assert not c.jobs() and not c.live(LEASE_RES)  # nothing created for it
        assert any(e["reason"] == "PolicyDenied" for e in c.events())
        # Negative control: the same batch with an allowed image runs.
        await c.apply_batch(batch_manifest("good", {**spec, "pod": {"image": IMAGE}}))
        await wait_for(lambda: "good-runner-1" in c.jobs(), what="runner of the allowed batch")


async def test_the_runner_jobs_spec_is_the_batch_with_the_image_resolved():
    """The runner gets the batch's spec (every item: ids stay the operator's) and parses it back."""
    from h5ngff.operator.controller.manifests import Owner, build_runner_job

    spec = parse_batch_spec({"items": [_item("/data/x.h5")], "output": {"path": "/data/out/{stem}.ome.zarr"}})
    job = build_runner_job(Owner("default", "b", "uid-b", 1, "ConversionBatch"), spec, 1, "h5ngff:test", items=["x"])
    again = parse_batch_spec(json.loads(env_of(job)["H5NGFF_SPEC"]))
    assert [p.id for p in again.planned_items()] == [
        p.id for p in spec.planned_items()
    ] and again.pod.image == "h5ngff:test"
    assert job["metadata"]["ownerReferences"][0]["kind"] == "ConversionBatch"


@pytest.mark.slow
async def test_deleting_a_running_batch_removes_its_runner_and_gives_its_leases_back():
    spec = {
        "items": [_item("/data/x.h5"), _item("/data/y.h5")],
        "output": {"path": "/data/out/{stem}.ome.zarr"},
        "pod": {"image": IMAGE},
    }
    async with emulator() as c, operator_running(fast_config(c.url)):
        await c.apply_batch(batch_manifest("gone", spec))
        await wait_for(lambda: "gone-runner-1" in c.jobs() and len(c.live(LEASE_RES)) == 2, what="runner and Leases")
        # Negative control first: a ConversionJob on one of its outputs waits while the batch lives.
        await c.apply(
            manifest(
                "next",
                {
                    "source": {"path": "/data/w.h5", "dataset": "/d"},
                    "output": {"path": "/data/out/x.ome.zarr"},
                    "pod": {"image": IMAGE},
                },
            )
        )
        await wait_for(lambda: "OutputBusy" in str(c.status("next")), what="the job waits")
        resp = await c.k.delete(f"{CB_PATH.format(ns='default')}/gone")
        assert resp.status == 200, await resp.text()
        await wait_for(lambda: "gone-runner-1" not in c.jobs(), what="runner Job deleted")
        await wait_for(lambda: "next-runner-1" in c.jobs(), what="the job takes the freed output")
        holders = {lease["spec"]["holderIdentity"].split("/")[1] for lease in c.live(LEASE_RES).values()}
        assert holders == {"next"}


async def test_a_batchs_lease_is_looked_up_as_a_batch_not_taken_for_an_abandoned_jobs():
    """The holder's kind on the Lease decides where the operator looks for the holder: a live batch
    holds its outputs. Negative control: looked up as a ConversionJob (what a Lease without the
    kind means), the same holder counts as gone, and its output would be taken over."""
    from h5ngff.operator.kube import Kube
    from h5ngff.operator.controller.lease import _holder_gone

    async with emulator() as c:
        await c.apply_batch(
            batch_manifest("live", {"items": [_item("/data/x.h5")], "output": {"path": "/data/out/{stem}.ome.zarr"}})
        )
        kube = await Kube.connect(KubeConfig(c.url))
        try:
            assert await _holder_gone(kube, "default/live/uid-live", "ConversionBatch") is False
            assert await _holder_gone(kube, "default/live/uid-live", "ConversionJob") is True  # the control
            assert (
                await _holder_gone(kube, "default/live/other-uid", "ConversionBatch") is True
            )  # a new object of that name
        finally:
            await kube.close()
