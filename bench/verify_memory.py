"""Peak RSS of ``h5ngff verify --source`` against its documented bound (docs/engine.md).

    python -m bench.verify_memory --shape 128,1024,1024 --dtype float32 [--shards 128,512,512]

Writes a synthetic HDF5 source, converts it (3 levels, 64^3 chunks), then runs the real CLI's
verify in a fresh process and reads its peak RSS (ru_maxrss of the child). The interpreter's own
baseline (imports, no data) is measured the same way and printed beside it.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time

import numpy as np

CLI = [sys.executable, "-m", "h5ngff.cli"]


def _peak_of(cmd: list[str]) -> tuple[int, float, int]:
    """(return code, seconds, peak RSS bytes) of one child process."""
    start = time.perf_counter()
    pid = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL).pid
    _, status, usage = os.wait4(pid, 0)
    return os.waitstatus_to_exitcode(status), time.perf_counter() - start, usage.ru_maxrss * 1024


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--shape", default="128,1024,1024")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--shards", default=None)
    p.add_argument("--levels", type=int, default=3)
    p.add_argument("--dir", default=None)
    a = p.parse_args()
    shape = tuple(int(v) for v in a.shape.split(","))
    work = a.dir or tempfile.mkdtemp(prefix="verify-mem-")
    h5, out = os.path.join(work, "in.h5"), os.path.join(work, "out.ome.zarr")
    subprocess.run(
        CLI + ["sample", h5, "--shape", a.shape, "--dtype", a.dtype, "--force"], check=True, capture_output=True
    )
    flags = ["--chunks", "64,64,64", "--levels", str(a.levels), "--workers", "2", "--no-progress", "--overwrite"]
    if a.shards:
        flags += ["--shards", a.shards]
    subprocess.run(CLI + ["convert", f"{h5}:/volume/data", out] + flags, check=True, capture_output=True)
    level0 = int(np.prod(shape)) * np.dtype(a.dtype).itemsize
    baseline = _peak_of([sys.executable, "-c", "import h5ngff.cliverify, h5ngff.engine.verify.check, h5py, zarr"])[2]
    code, seconds, peak = _peak_of(CLI + ["verify", out, "--source", f"{h5}:/volume/data", "--json"])
    from h5ngff.engine.verify.levelcheck import PyramidRule, memory_bound

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))
    from existing_layout import level_layout  # a test helper: the writer's layout of an existing level

    fmt = 3
    layouts = [level_layout(out, str(k), fmt, k) for k in range(a.levels)]
    bound = memory_bound(layouts, PyramidRule("mean", (True,) * len(shape)))
    mib = 1 << 20
    print(
        f"shape {shape} {a.dtype} shards {a.shards}: level 0 {level0 / mib:.0f} MiB; verify exit {code} in {seconds:.1f} s; "
        f"peak RSS {peak / mib:.1f} MiB = interpreter {baseline / mib:.1f} MiB + {(peak - baseline) / mib:.1f} MiB; "
        f"documented bound {bound / mib:.1f} MiB above the interpreter"
    )


if __name__ == "__main__":
    main()
