"""Calibrate the memory model: real conversions under emulated pod limits, predicted vs measured.

    bench/calibrate [--quick] [--out docs/calibration.md] [--cases NAME,NAME]

Every case runs through the real CLI (``h5ngff convert --enforce-pod-limits --json``): each worker
is a nanny+worker pair in its own memory cgroup at the planned pod limit. Measured: the peak RSS of
every worker process (kernel high-water mark, VmHWM) and the cgroup's peak usage (page cache
included). The model is safe when predicted >= measured and tight when predicted <= 1.15 x
measured; the table says which cases miss and by how much.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass, field

from h5ngff.sample import write_sample

HERE = os.path.dirname(os.path.abspath(__file__))
DATA = os.path.join(HERE, "data", "calibrate")
MiB = 1 << 20
TIGHT = 1.15


@dataclass
class Case:
    name: str
    dtype: str = "uint16"
    shape: tuple[int, ...] = (128, 1024, 1024)
    layout: str = "contiguous"  # or "gzip" (chunked 64^3, gzip level 1)
    chunks: str = "64,64,64"
    compressor: str = "zstd:5:bitshuffle"
    levels: int = 1
    flags: list[str] = field(default_factory=list)


def matrix(quick: bool) -> list[Case]:
    base = Case("base u16 64^3 zstd")
    cases = [
        base,
        Case("uint8", dtype="uint8"),
        Case("float32", dtype="float32"),
        Case("float64", dtype="float64", shape=(96, 1024, 1024)),
        Case("chunks 32^3", chunks="32,32,32"),
        Case("chunks 128^3", chunks="128,128,128"),
        Case("chunks 1x256x256", chunks="1,256,256"),
        Case("lz4", compressor="lz4:5:shuffle"),
        Case("no compression", compressor="none"),
        Case("pyramid 3 mean", levels=3),
        Case("pyramid 3 float32", dtype="float32", levels=3),
        Case("pyramid 3 max", levels=3, flags=["--downsample", "max"]),
        Case("chunked gzip source", layout="gzip"),
        Case("chunked gzip pyramid 3", layout="gzip", levels=3),
        Case("small slab", flags=["--slab", "64,64,1024"]),
        Case("budget 400Mi", flags=["--memory-per-worker", "400Mi"]),
        Case("budget 1Gi float32", dtype="float32", flags=["--memory-per-worker", "1Gi"]),
        Case("budget-filling 2 threads", flags=["--threads", "2", "--workers", "1", "--memory-per-worker", "1500Mi"]),
        Case("user slab 64x704x1024 f32", dtype="float32", flags=["--slab", "64,704,1024"]),
        Case("shards 128^3 of 64^3", flags=["--shards", "128,128,128"]),
        Case("big slab 384 MiB f32", dtype="float32", flags=["--slab", "128,768,1024", "--workers", "1"]),
        Case("big slab f32 pyramid 3", dtype="float32", levels=3, flags=["--slab", "128,512,1024", "--workers", "1"]),
        Case("big slab u16 glibc-sized budget", flags=["--memory-per-worker", "900Mi", "--slab", "128,1024,1024", "--workers", "1"]),
    ]
    return cases[:6] if quick else cases


def source_for(case: Case) -> str:
    os.makedirs(DATA, exist_ok=True)
    name = f"{case.dtype}-{'x'.join(map(str, case.shape))}-{case.layout}.h5"
    path = os.path.join(DATA, name)
    if not os.path.exists(path):
        chunks = (64, 64, 64) if case.layout == "gzip" else None
        write_sample(path, "/volume/data", case.shape, case.dtype, chunks=chunks, compression="gzip" if case.layout == "gzip" else None)
    return path


def run_case(case: Case, workers: int, allocator: str, calibration: str | None = None) -> dict:
    source = source_for(case)
    out = os.path.join(DATA, "out.ome.zarr")
    cmd = [
        sys.executable, "-m", "h5ngff.cli", "convert", f"{source}:/volume/data", out, "--overwrite", "--json",
        "--enforce-pod-limits", "--chunks", case.chunks, "--compressor", case.compressor, "--levels", str(case.levels),
        "--allocator", allocator,
    ]
    if "--workers" not in case.flags:
        cmd += ["--workers", str(workers)]
    cmd += case.flags
    if calibration:
        cmd += ["--calibration", calibration]
    started = time.time()
    proc = subprocess.run(cmd, capture_output=True, text=True)
    try:
        summary = json.loads(proc.stdout)
    except ValueError:
        return {"case": case.name, "status": "error", "message": (proc.stderr or proc.stdout)[-400:]}
    summary["case"] = case.name
    summary["wall"] = time.time() - started
    return summary


def row(summary: dict) -> dict:
    if summary.get("status") != "Succeeded":
        return {"case": summary["case"], "status": summary.get("reason") or summary.get("status"), "message": summary.get("message", "")}
    workers = summary["workers"]
    measured = max(w["peak_rss"] for w in workers)
    cgroup = max((w["cgroup_peak"] or 0) for w in workers)
    predicted = summary["predicted_peak_per_worker"]
    plan = summary["plan"]
    # The pass that needs most; what the worker measured beyond its planned buffers is the
    # baseline this case implies (the figure to fit interpreter_baseline to).
    peak_pass = max(plan["passes"], key=lambda p: p["predicted_peak"])
    planned_baseline = next(t["bytes"] for t in peak_pass["terms"] if t["name"] == "interpreter")
    return {
        "case": summary["case"],
        "status": "ok",
        "slab": "x".join(map(str, plan["passes"][0]["slab"])),
        "passes": len(plan["passes"]),
        "predicted": predicted,
        "measured": measured,
        "ratio": predicted / measured,
        "implied_baseline": measured - (predicted - planned_baseline),
        "cgroup": cgroup,
        "pod_limit": summary["pod_limit_per_worker"],
        "oom_kills": sum(w["oom_kills"] for w in workers),
        "restarts": sum(w["nanny_restarts"] for w in workers),
    }


def table(rows: list[dict], allocator: str) -> str:
    lines = [
        f"| case ({allocator}) | slab | passes | predicted MiB | measured peak RSS MiB | predicted / measured | implied baseline MiB | cgroup peak MiB | pod limit MiB | OOM kills | verdict |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if r["status"] != "ok":
            lines.append(f"| {r['case']} | | | | | | | | | | FAILED: {r['status']} {r['message'][:80]} |")
            continue
        verdict = "safe, tight" if 1.0 <= r["ratio"] <= TIGHT else ("UNSAFE" if r["ratio"] < 1.0 else "safe, loose")
        lines.append(
            f"| {r['case']} | {r['slab']} | {r['passes']} | {r['predicted'] / MiB:.1f} | {r['measured'] / MiB:.1f} | {r['ratio']:.3f} | {r['implied_baseline'] / MiB:.1f} | "
            f"{r['cgroup'] / MiB:.1f} | {r['pod_limit'] / MiB:.1f} | {r['oom_kills']} | {verdict} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="Only the first few cases.")
    parser.add_argument("--cases", help="Comma-separated case names to run.")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--allocator", default="jemalloc", choices=["jemalloc", "glibc"])
    parser.add_argument("--out", help="Also write the Markdown table to this file.")
    parser.add_argument("--calibration", metavar="FILE",
                        help="Constants to plan with (h5ngff convert --calibration). To re-fit the baseline after a "
                             "library upgrade, plan with a generous interpreter_baseline: the implied-baseline column "
                             "(measured minus the planned buffers) is the figure to fit.")
    args = parser.parse_args(argv)
    cases = matrix(args.quick)
    if args.cases:
        wanted = set(args.cases.split(","))
        cases = [c for c in cases if c.name in wanted]
    rows = []
    for case in cases:
        r = row(run_case(case, args.workers, args.allocator, args.calibration))
        rows.append(r)
        print(json.dumps({k: (round(v / MiB, 1) if k in ("predicted", "measured", "cgroup", "pod_limit", "implied_baseline") else v) for k, v in r.items()}), flush=True)
    text = table(rows, args.allocator)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(f"<!-- {' '.join(['bench/calibrate'] + (argv if argv is not None else sys.argv[1:]))} -->\n{text}\n")
    bad = [r for r in rows if r["status"] != "ok" or not 1.0 <= r["ratio"] <= TIGHT]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
