"""A multi-channel Imaris conversion stays under its plan with every worker in a memory cgroup at
the planned pod limit. Its slabs span both channels (two HDF5 datasets per slab, each opened with
its share of the planned chunk cache and closed after the read) and decompress gzip blocks."""

from __future__ import annotations

import numpy as np
import pytest
import zarr

from conftest import requires_cgroups, smooth, spec_for
from formats_fixtures import write_ims
from h5ngff.backends.local import LocalBackend, LocalPodsBackend
from h5ngff.errors import OOMKilledError
from h5ngff.runner import plan_job, run_job

pytestmark = [requires_cgroups, pytest.mark.cgroup, pytest.mark.integration]


@pytest.fixture(scope="module")
def ims(tmp_path_factory):
    data = smooth((1, 2, 48, 768, 500), "uint16", seed=2)  # 2 channels x 35 MiB; x padded to 512
    path = write_ims(tmp_path_factory.mktemp("ims-pod") / "big.ims", data, block=(16, 128, 128), levels=1)
    return path, data


def ims_spec(path, out, **resources):
    return spec_for(
        path,
        out,
        dataset="/",
        output={"chunks": [1, 8, 64, 64]},
        pyramid={"levels": 1},
        resources={"workers": 2, "slab": [2, 8, 768, 500], **resources},
    )


@pytest.mark.slow
def test_multichannel_imaris_stays_under_the_plan_in_pod_limits(ims, tmp_path):
    path, data = ims
    out = str(tmp_path / "out.ome.zarr")
    backend = LocalPodsBackend()
    job = plan_job(ims_spec(path, out), backend)
    assert job.plan.passes[0].slab[0] == 2  # every slab reads both channels' datasets
    summary = run_job(job, backend)
    assert summary.status == "Succeeded" and len(summary.workers) == 2
    for w in summary.workers:
        assert w.oom_kills == 0 and w.memory_terminations == 0, w
        assert 0 < w.peak_rss <= job.plan.memory.predicted_peak, (
            f"{w.name}: measured {w.peak_rss} > predicted {job.plan.memory.predicted_peak}"
        )
        assert w.cgroup_peak is not None and w.cgroup_peak <= job.plan.memory.pod_limit
    np.testing.assert_array_equal(zarr.open_array(out + "/0", mode="r")[...], data[0])


@pytest.mark.slow
def test_negative_control_the_kernel_kills_below_the_plan(ims, tmp_path):
    path, _ = ims
    out = str(tmp_path / "out.ome.zarr")
    spec = ims_spec(path, out, workers=1, slab=[2, 48, 768, 500])  # one 70 MiB slab dominates the plan
    plan = plan_job(spec, LocalBackend()).plan
    slab_bytes = 2 * 48 * 768 * 500 * 2
    # Below the predicted peak by half a slab: the worker cannot hold the slab it must read.
    limit = plan.memory.predicted_peak - slab_bytes // 2
    assert limit < plan.memory.pod_limit
    backend = LocalPodsBackend(pod_limit=limit)
    with pytest.raises(OOMKilledError) as caught:
        run_job(plan_job(spec, backend), backend)
    assert caught.value.oom_kills >= 1
