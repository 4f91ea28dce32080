"""Wedges (issue 41, C): what left an object looping, running for ever or reaching into another's.

* A ConversionJob and a ConversionBatch of one name in one namespace: the younger fails with
  reason NameTaken, creates nothing, holds no Lease, and deleting it touches nothing of the
  other's (the real kopf operator against KMock).
* A template field with a format spec (``{stem:>100000000}``) is refused at once, in a short
  message, by the model and by the CRD (the CRD side: tests/test_operator_batch_spec.py's rows).
* Every status message is bounded (schema/status.MAX_MESSAGE), whatever it quotes.
"""

from __future__ import annotations

import time

import pytest

from h5ngff.errors import SpecError
from h5ngff.operator.controller.batchreconcile import BatchObserved, reconcile_batch
from h5ngff.operator.controller.reconcile import Observed, reconcile
from h5ngff.operator.schema.batchspec import parse_batch_spec
from h5ngff.operator.schema.status import MAX_MESSAGE, bounded, merge
from operator_harness import (
    DASK_RES,
    LEASE_RES,
    batch_manifest,
    emulator,
    fast_config,
    manifest,
    operator_running,
    passes,
    wait_for,
)

SOURCE = {"path": "/data/in.h5", "dataset": "/volume/data"}
JOB = {"source": SOURCE, "output": {"path": "/data/job.ome.zarr"}}
BATCH = {"items": [{"source": {"path": "/data/a.h5", "dataset": "/d"}}], "output": {"path": "/data/b/{stem}.ome.zarr"}}


@pytest.mark.asyncio
@pytest.mark.integration
@pytest.mark.slow
@pytest.mark.timeout(120)
async def test_a_job_and_a_batch_of_one_name_the_younger_is_refused_and_neither_reaches_the_other():
    async with emulator() as c, operator_running(cfg := fast_config(c.url)):
        await c.apply(manifest("scan", JOB))
        await wait_for(lambda: "scan-runner-1" in c.jobs(), what="the job's runner")
        await c.k.post(
            "/apis/kubernetes.dask.org/v1/namespaces/default/daskclusters", json={"metadata": {"name": "scan-dask"}}
        )  # the job's runner made its cluster
        batch = batch_manifest("scan", BATCH)
        batch["metadata"]["uid"] = "uid-batch-scan"  # kopf keys its indexes by namespace, name and uid
        await c.apply_batch(batch)
        await wait_for(lambda: c.batch_status("scan").get("reason") == "NameTaken", what="NameTaken")
        await passes(cfg, "ConversionBatch/scan", 3)
        status = c.batch_status("scan")
        assert status["phase"] == "Failed" and "ConversionJob named 'scan'" in status["message"]
        # No loop: the batch never asked for a runner Job, and holds no Lease.
        assert c.job_create_requests() == ["scan-runner-1"]
        leases = c.live(LEASE_RES)
        assert [lease["spec"]["holderIdentity"].split("/")[2] for lease in leases.values()] == [
            c.cj("scan")["metadata"]["uid"]
        ]
        # Deleting the refused one deletes nothing of the other's.
        await c.k.delete("/apis/h5ngff.dev/v1alpha1/namespaces/default/conversionbatches/scan")
        await wait_for(lambda: not c.batch_status("scan"), what="the batch gone")
        await passes(cfg, "scan", 3)
        assert "scan-runner-1" in c.jobs() and "scan-dask" in c.live(DASK_RES)
        assert c.status("scan")["phase"] in ("Pending", "Running") and c.live(LEASE_RES) == leases


def test_a_template_field_with_a_format_spec_is_refused_at_once_in_a_short_message():
    spec = {**BATCH, "output": {"path": "/data/out/{stem:>100000000}.zarr"}}
    started = time.perf_counter()
    with pytest.raises(SpecError) as refused:
        parse_batch_spec(spec)
    assert time.perf_counter() - started < 5  # one format of the width took ~600 MiB and seconds
    assert "format spec" in str(refused.value) and len(str(refused.value)) < 1000
    parse_batch_spec(BATCH)  # control: the bare field is a template


def test_every_status_message_is_bounded():
    huge = "x" * 5_000_000
    assert len(bounded(huge) or "") == MAX_MESSAGE and bounded("short") == "short" and bounded(None) is None
    # A job that never ran, with an error quoting something huge: its status stays small.
    job = reconcile(Observed("scan", {}, 0, "", spec_error=f"output.path: Got {huge!r} instead."))
    assert job.patch["message"] and len(job.patch["message"]) <= MAX_MESSAGE
    assert all(len(c.get("message") or "") <= MAX_MESSAGE for c in job.patch["conditions"])
    batch = reconcile_batch(BatchObserved("run", {}, None, spec_error=f"items[0].output: {huge}"))
    assert len(merge({}, batch.patch)["message"]) <= MAX_MESSAGE
