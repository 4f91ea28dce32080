"""Memory under enforced pod limits on the reference case: predicted vs measured per worker, RSS
over time per worker (PNG), jemalloc vs glibc side by side.

    .venv/bin/python -m bench.pod_memory [--scale 1] [--out bench/results/pod-memory]

Each run is ``h5ngff convert --enforce-pod-limits --json --memory-report`` on the reference case's (docs/architecture.md)
float32 volume: every worker (with its nanny) in its own memory cgroup at the planned pod limit.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

from .config import BENCH_DIR, build_cases
from .data import ensure_input

MiB = 1 << 20

RUNS = {
    "user slab, 8 workers": ["--workers", "8", "--slab", "USER_SLAB"],
    "planner's choice": [],
}


def run(source: str, out_dir: str, name: str, flags: list[str], allocator: str) -> dict:
    tag = f"{name.split(',')[0].replace(' ', '-').replace(chr(39), '')}-{allocator}"
    output = os.path.join(out_dir, "out.ome.zarr")
    report = os.path.join(out_dir, f"memory-{tag}.png")
    cmd = [
        sys.executable,
        "-m",
        "h5ngff.cli",
        "convert",
        f"{source}:/volume/data",
        output,
        "--overwrite",
        "--json",
        "--enforce-pod-limits",
        "--levels",
        "1",
        "--allocator",
        allocator,
        "--memory-report",
        report,
    ] + flags
    started = time.time()
    proc = subprocess.run(cmd, capture_output=True, text=True)
    try:
        summary = json.loads(proc.stdout)
    except ValueError:
        summary = {"status": "error", "message": proc.stderr[-500:]}
    summary.update(
        {"run": name, "allocator": allocator, "report": os.path.basename(report), "wall": time.time() - started}
    )
    return summary


def table(rows: list[dict]) -> str:
    lines = [
        "| run | allocator | seconds | workers | predicted MiB | measured peak RSS MiB (min-max over workers) | predicted / max measured | cgroup peak MiB (max) | pod limit MiB | OOM kills | restarts | timeline |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if r.get("status") != "Succeeded":
            lines.append(
                f"| {r['run']} | {r['allocator']} | FAILED: {r.get('reason') or r.get('status')} {str(r.get('message'))[:80]} |||||||||"
            )
            continue
        peaks = [w["peak_rss"] for w in r["workers"]]
        cgroups = [w["cgroup_peak"] or 0 for w in r["workers"]]
        predicted = r["predicted_peak_per_worker"]
        lines.append(
            f"| {r['run']} | {r['allocator']} | {r['seconds']:.1f} | {len(r['workers'])} | {predicted / MiB:.1f} | "
            f"{min(peaks) / MiB:.1f}-{max(peaks) / MiB:.1f} | {predicted / max(peaks):.3f} | {max(cgroups) / MiB:.1f} | "
            f"{r['pod_limit_per_worker'] / MiB:.1f} | {sum(w['oom_kills'] for w in r['workers'])} | "
            f"{sum(w['nanny_restarts'] for w in r['workers'])} | {r['report']} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--scale", type=float, default=1.0)
    parser.add_argument("--data-dir", default=os.path.join(BENCH_DIR, "data"))
    parser.add_argument("--out", default=os.path.join(BENCH_DIR, "results", "pod-memory"))
    args = parser.parse_args(argv)
    case = build_cases(args.scale)["f32"]
    source, _ = ensure_input(case, args.scale, args.data_dir)
    os.makedirs(args.out, exist_ok=True)
    slab = ",".join(map(str, case.user_slab))
    rows = []
    for name, flags in RUNS.items():
        for allocator in ("jemalloc", "glibc"):
            r = run(source, args.out, name, [slab if f == "USER_SLAB" else f for f in flags], allocator)
            rows.append(r)
            print(json.dumps({k: r.get(k) for k in ("run", "allocator", "status", "seconds", "reason")}), flush=True)
    text = f"Case: {case.describe()}\n\n" + table(rows)
    with open(os.path.join(args.out, "pod-memory.md"), "w") as f:
        f.write(f"<!-- .venv/bin/python -m bench.pod_memory --scale {args.scale} -->\n{text}\n")
    with open(os.path.join(args.out, "pod-memory.json"), "w") as f:
        json.dump([{k: v for k, v in r.items() if k != "plan"} for r in rows], f, indent=1, default=str)
    print(text)
    return 0 if all(r.get("status") == "Succeeded" for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
