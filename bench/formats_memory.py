"""Memory of a multi-channel Imaris conversion under enforced pod limits: predicted vs measured.

    PYTHONPATH=src .venv/bin/python -m bench.formats_memory

The source is a 2-channel Imaris file (48, 768, 500) uint16 per channel, gzip blocks
(16, 128, 128) padded to 512 in x, written by tests/formats_fixtures.write_ims (the Imaris 5.5
format). Slabs span both channels. Each worker and its nanny run in a memory cgroup at the
planned pod limit. Results are recorded in docs/formats.md.
"""

from __future__ import annotations

import os
import sys
import tempfile

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))

from conftest import smooth, spec_for  # noqa: E402
from formats_fixtures import write_ims  # noqa: E402

from h5ngff.backends.local import LocalPodsBackend  # noqa: E402
from h5ngff.runner import plan_job, run_job  # noqa: E402

MiB = 1 << 20


def main() -> None:
    d = tempfile.mkdtemp(prefix="h5ngff-formats-")
    data = smooth((1, 2, 48, 768, 500), "uint16", seed=2)
    path = write_ims(os.path.join(d, "big.ims"), data, block=(16, 128, 128), levels=1)
    spec = spec_for(
        path,
        os.path.join(d, "out.ome.zarr"),
        dataset="/",
        output={"chunks": [1, 8, 64, 64]},
        pyramid={"levels": 1},
        resources={"workers": 2, "slab": [2, 8, 768, 500]},
    )
    backend = LocalPodsBackend()
    job = plan_job(spec, backend)
    summary = run_job(job, backend)
    memory = job.plan.memory
    print(
        f"slab {job.plan.passes[0].slab}  predicted peak {memory.predicted_peak / MiB:.1f} MiB  pod limit {memory.pod_limit / MiB:.0f} MiB"
    )
    for w in summary.workers:
        print(
            f"{w.name}: peak RSS {w.peak_rss / MiB:.1f} MiB ({w.peak_rss / memory.predicted_peak:.2f} of plan)  "
            f"cgroup peak {(w.cgroup_peak or 0) / MiB:.1f} MiB  OOM kills {w.oom_kills}"
        )
    print(f"{summary.seconds:.1f} s")


if __name__ == "__main__":
    main()
