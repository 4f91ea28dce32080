"""The seed case on the SLURM backend against the local backend, in the same run.

    .venv/bin/python -m bench.slurm [--scale 0.05] [--repeat 2] [--levels 1]

Both convert the f32 case (the reference case, docs/architecture.md; bench/config.py) with 2 one-core workers through the
real CLI, timed end to end: for SLURM that includes submitting the 2 worker jobs, their start and
their cancellation (job start-up counted). Rounds are interleaved; each tool's time is its fastest
round. The outputs are compared chunk file by chunk file (they must be identical), and the SLURM
run's workers against the plan. Needs a running SLURM (scripts/slurm-local start) and SLURM_CONF.
Target: SLURM within 1.15x of local.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import time

from bench.config import build_cases
from bench.data import ensure_input

HERE = os.path.dirname(os.path.abspath(__file__))
TARGET = 1.15


def digest_tree(root: str) -> dict[str, str]:
    out = {}
    for directory, _, names in os.walk(root):
        if ".h5ngff" in directory:
            continue
        for name in names:
            if directory == root and name == "zarr.json":
                continue  # the root's attributes carry the run's own summary (times)
            path = os.path.join(directory, name)
            with open(path, "rb") as f:
                out[os.path.relpath(path, root)] = hashlib.sha256(f.read()).hexdigest()
    return out


def run(source: str, out: str, extra: list[str], levels: int) -> tuple[float, dict]:
    shutil.rmtree(out, ignore_errors=True)
    cmd = [
        sys.executable,
        "-m",
        "h5ngff.cli",
        "convert",
        source,
        out,
        "--workers",
        "2",
        "--threads",
        "1",
        "--levels",
        str(levels),
        "--json",
        "--no-progress",
        *extra,
    ]
    start = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    took = time.perf_counter() - start
    if proc.returncode:
        raise SystemExit(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    return took, json.loads(proc.stdout)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--scale", type=float, default=0.05)
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--levels", type=int, default=1)
    ap.add_argument("--work-dir", default=os.path.join(os.environ.get("TMPDIR", "/tmp"), "h5ngff-bench-slurm"))
    ap.add_argument("--data-dir", default=os.path.join(HERE, "data"))
    args = ap.parse_args(argv)
    if not os.environ.get("SLURM_CONF") and not os.path.exists("/etc/slurm/slurm.conf"):
        raise SystemExit("no SLURM: run scripts/slurm-local start and export the SLURM_CONF it prints")
    case = build_cases(args.scale)["f32"]
    path, _ = ensure_input(case, args.scale, args.data_dir)
    source = f"{path}:{case.dataset}"
    os.makedirs(args.work_dir, exist_ok=True)
    tools = {
        "local": [],
        "slurm": ["--backend", "slurm", "--slurm-log-dir", os.path.join(args.work_dir, "logs")],
    }
    times: dict[str, list[float]] = {name: [] for name in tools}
    last: dict[str, dict] = {}
    digests: dict[str, dict[str, str]] = {}
    for _ in range(args.repeat):
        for name, extra in tools.items():
            out = os.path.join(args.work_dir, f"{name}.ome.zarr")
            took, summary = run(source, out, extra, args.levels)
            times[name].append(took)
            last[name] = summary
            digests[name] = digest_tree(out)
    identical = digests["local"] == digests["slurm"]
    best = {name: min(t) for name, t in times.items()}
    ratio = best["slurm"] / best["local"]
    plan = last["slurm"]["plan"]["memory"]
    print(
        f"case f32 {case.describe()}, scale {args.scale}, {args.levels} level(s), 2 workers x 1 thread, {args.repeat} round(s)"
    )
    for name in tools:
        rounds = ", ".join(f"{t:.1f}" for t in times[name])
        print(
            f"  {name:6s} best {best[name]:6.1f} s  (rounds: {rounds}; conversion alone {last[name]['seconds']:.1f} s)"
        )
    print(f"  slurm / local = {ratio:.2f}  (target <= {TARGET})  outputs identical: {identical}")
    for w in last["slurm"]["workers"]:
        print(
            f"  slurm {w['name']}: peak RSS {w['peak_rss'] / 2**20:.1f} MiB, predicted {plan['predicted_peak'] / 2**20:.1f} MiB, "
            f"job cgroup peak {(w['cgroup_peak'] or 0) / 2**20:.1f} MiB of --mem {w['pod_limit'] / 2**20:.1f} MiB, OOM kills {w['oom_kills']}"
        )
    return 0 if identical and ratio <= TARGET else 1


if __name__ == "__main__":
    sys.exit(main())
