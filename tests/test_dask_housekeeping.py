"""Dask's housekeeping in the embedded cluster: every server (scheduler, nannies, workers) times
its event loop every ``TICK_INTERVAL``, not Dask's 20 ms (backends/base.py, docs/benchmarks.md
"Dask's housekeeping"), and the Kubernetes pods are told the same."""

from __future__ import annotations

import h5py
import numpy as np
import pytest
from dask.utils import parse_timedelta
from distributed import Client, LocalCluster

from h5ngff.backends.base import TICK_INTERVAL, dask_env, dask_memory_config
from h5ngff.backends.local import LocalBackend
from h5ngff.runner import plan_job
from h5ngff.spec import parse_spec


pytestmark = pytest.mark.integration

TICK_MS = parse_timedelta(TICK_INTERVAL) * 1000


def _tick_ms(dask_worker=None, dask_scheduler=None):
    server = dask_worker if dask_worker is not None else dask_scheduler
    return server.periodic_callbacks["tick"].callback_time


def _ticks(client: Client) -> list[float]:
    """The tick period, in ms, of the scheduler, every nanny and every worker."""
    return [
        client.run_on_scheduler(_tick_ms),
        *client.run(_tick_ms, nanny=True).values(),
        *client.run(_tick_ms).values(),
    ]


@pytest.mark.slow
def test_the_scheduler_nannies_and_workers_tick_at_the_planned_interval(tmp_path):
    with h5py.File(tmp_path / "in.h5", "w") as f:
        f.create_dataset("/volume/data", data=np.zeros((16, 64, 64), np.uint16))
    spec = parse_spec(
        {
            "source": {"path": str(tmp_path / "in.h5"), "dataset": "/volume/data"},
            "output": {"path": str(tmp_path / "out.ome.zarr")},
            "resources": {"workers": 2},
        }
    )
    plan = plan_job(spec, LocalBackend()).plan
    with LocalBackend().session(plan) as session:
        ticks = _ticks(session.client)
    assert len(ticks) == 5 and ticks == [TICK_MS] * 5, ticks
    # The pods and SLURM jobs get it through the same config, as an environment variable.
    assert dask_env(dask_memory_config(plan))["DASK_DISTRIBUTED__ADMIN__TICK__INTERVAL"] == TICK_INTERVAL
    # Negative control: a stock cluster on this machine ticks at Dask's 20 ms, so the figures
    # above are h5ngff's setting, not a default.
    with LocalCluster(n_workers=1, threads_per_worker=1, dashboard_address=":0") as cluster, Client(cluster) as client:
        assert set(_ticks(client)) == {20}, _ticks(client)
