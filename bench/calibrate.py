"""Calibrate the memory model: real conversions under emulated pod limits, predicted vs measured.

    bench/calibrate [--quick] [--out docs/calibration.md] [--cases NAME,NAME] [--matrix base|issue18|all] [--backend pods|slurm]

Every case runs through the real CLI (``h5ngff convert --enforce-pod-limits --json``): each worker
is a nanny+worker pair in its own memory cgroup at the planned pod limit. Measured: the peak RSS of
every worker process (kernel high-water mark, VmHWM) and the cgroup's peak usage (page cache
included). The model is safe when predicted >= measured and tight when predicted <= 1.15 x
measured; the table says which cases miss and by how much. Where the run's JSON reports each pod's
non-reclaimable peak (``pod_nonreclaimable_peak``: anon + dirty + writeback), the pod ratio (pod
limit / that peak) is printed beside the worker ratio.

The ``issue18`` matrix (issue 18) adds shards at 1, 2 and 3 levels, float64, several threads per
worker, 4-D and 5-D images, planner-chosen slabs under --memory-per-worker and --memory-total,
gzip-chunked HDF5 whose chunks are misaligned with the output chunks, and the big sharded case of
the issue on incompressible data (where holding whole shards broke the plan).

``--backend slurm`` runs the same cases as SLURM jobs (``--backend slurm``): each worker's job
cgroup is limited to the planned ``--mem`` by SLURM's task/cgroup, and the cgroup column is the
job cgroup's peak, read by the worker from inside its job.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import time
from dataclasses import dataclass, field

import h5py
import numpy as np

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
    layout: str = "contiguous"  # or "gzip" (chunked, gzip level 1)
    #: HDF5 chunks of a "gzip" source (default 64 per spatial axis, 1 for c and t).
    hdf5_chunks: tuple[int, ...] | None = None
    #: "sample" (compresses like microscopy) or "random" (incompressible: the worst case for encode buffers).
    data: str = "sample"
    chunks: str = "64,64,64"
    compressor: str = "zstd:5:bitshuffle"
    levels: int = 1
    flags: list[str] = field(default_factory=list)
    #: Extra environment of the run (e.g. H5NGFF_NO_LIBDEFLATE=1: gzip read through HDF5's filter).
    env: dict[str, str] = field(default_factory=dict)


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
        Case(
            "big slab u16 glibc-sized budget",
            flags=["--memory-per-worker", "900Mi", "--slab", "128,1024,1024", "--workers", "1"],
        ),
    ]
    return cases[:6] if quick else cases


def issue18_matrix() -> list[Case]:
    """The cases issue 18 asked for, sized to a few hundred MB each, plus the issue's own big case."""
    big = (128, 2048, 2048)
    return [
        Case("shards 1 level u16", flags=["--shards", "128,256,256"]),
        Case("shards 2 levels u16", levels=2, flags=["--shards", "128,256,256"]),
        Case("shards 3 levels u16", levels=3, flags=["--shards", "128,256,256"]),
        Case("shards 2 levels f32 random", dtype="float32", data="random", levels=2, flags=["--shards", "128,256,256"]),
        Case("float64 3 threads", dtype="float64", shape=(64, 1024, 1024), flags=["--threads", "3", "--workers", "1"]),
        Case(
            "shards float64 2 threads 2 levels",
            dtype="float64",
            shape=(64, 512, 1024),
            levels=2,
            flags=["--shards", "64,256,256", "--threads", "2", "--workers", "1"],
        ),
        Case(
            "4-D czyx u16 shards 2 levels",
            shape=(2, 64, 512, 1024),
            chunks="1,64,64,64",
            levels=2,
            flags=["--shards", "1,64,256,256"],
        ),
        Case("5-D tczyx u16 2 levels", shape=(2, 2, 32, 512, 512), chunks="1,1,32,64,64", levels=2),
        Case(
            "memory-per-worker 400Mi shards",
            levels=2,
            flags=["--shards", "128,256,256", "--memory-per-worker", "400Mi"],
        ),
        Case("memory-total 700Mi workers auto", levels=2, flags=["--memory-total", "700Mi", "--workers", "auto"]),
        Case("gzip misaligned 50x100x100", layout="gzip", hdf5_chunks=(50, 100, 100), levels=2),
        Case(
            "gzip misaligned shards",
            layout="gzip",
            hdf5_chunks=(50, 100, 100),
            levels=2,
            flags=["--shards", "128,128,128"],
        ),
        Case(
            "issue 18 f32 2048^2 shards 1 level random",
            dtype="float32",
            shape=big,
            data="random",
            flags=["--shards", "128,512,512"],
        ),
        Case(
            "issue 18 f32 2048^2 shards 2 levels random",
            dtype="float32",
            shape=big,
            data="random",
            levels=2,
            flags=["--shards", "128,512,512"],
        ),
    ]


def round3_matrix() -> list[Case]:
    """The cases of "Sources and memory, round three": the gzip source read chunk by chunk with
    libdeflate (no HDF5 chunk cache) and the same through HDF5's filter, and a small uint8 plan."""

    def gzip4d(name: str, env: dict[str, str]) -> Case:
        return Case(
            name,
            shape=(4, 64, 1024, 1024),
            layout="gzip",
            hdf5_chunks=(1, 24, 100, 100),
            chunks="1,64,64,64",
            levels=3,
            env=env,
        )

    return [
        gzip4d("gzip 4-D 1x24x100x100 3 levels", {}),
        gzip4d("gzip 4-D 1x24x100x100 3 levels, HDF5 filter", {"H5NGFF_NO_LIBDEFLATE": "1"}),
        Case("uint8 128^3 chunks", dtype="uint8", chunks="128,128,128"),
    ]


def source_for(case: Case) -> str:
    os.makedirs(DATA, exist_ok=True)
    chunks = None
    if case.layout == "gzip":
        chunks = case.hdf5_chunks or tuple(1 for _ in case.shape[:-3]) + (64, 64, 64)
    tag = case.layout if chunks is None else f"{case.layout}{'x'.join(map(str, chunks))}"
    name = f"{case.dtype}-{'x'.join(map(str, case.shape))}-{tag}{'-random' if case.data == 'random' else ''}.h5"
    path = os.path.join(DATA, name)
    if not os.path.exists(path):
        tmp = path + ".tmp"
        if case.data == "random":
            _write_random(tmp, case.shape, case.dtype, chunks, "gzip" if case.layout == "gzip" else None)
        else:
            write_sample(
                tmp,
                "/volume/data",
                case.shape,
                case.dtype,
                chunks=chunks,
                compression="gzip" if case.layout == "gzip" else None,
            )
        os.replace(tmp, path)
    return path


def _write_random(path: str, shape, dtype: str, chunks, compression) -> None:
    """Uniform random values: nothing for a codec to find, so every encoded chunk is full size."""
    rng = np.random.default_rng(0)
    with h5py.File(path, "w") as f:
        ds = f.create_dataset("/volume/data", shape=shape, dtype=dtype, chunks=chunks, compression=compression)
        for z in range(0, shape[0], 8):
            part = (min(8, shape[0] - z),) + tuple(shape[1:])
            ds[z : z + part[0]] = (
                rng.random(part, dtype=np.dtype(dtype))
                if np.dtype(dtype).kind == "f"
                else rng.integers(0, 2**15, part).astype(dtype)
            )


#: (endpoint URL, uploaded keys) where ``--from-bucket`` reads every source from a loopback S3
#: endpoint (bench/moto_ranged.py): the bucket read path's terms (issue 44, docs/memory-model.md).
BUCKET: dict[str, object] = {}


def in_bucket(path: str) -> str:
    """The source's object in the calibration bucket, uploaded once."""
    import boto3

    uploaded: set = BUCKET.setdefault("uploaded", set())  # type: ignore[assignment]
    key = os.path.basename(path)
    if key not in uploaded:
        client = boto3.client("s3", endpoint_url=str(BUCKET["endpoint"]), region_name="us-east-1")
        client.upload_file(path, "calibrate", key)
        uploaded.add(key)
    return f"s3://calibrate/{key}"


def start_bucket() -> None:
    from bench.s3_read import KEY, start_endpoint

    proc, endpoint = start_endpoint(stock=False)
    os.environ.update({**KEY, "AWS_ENDPOINT_URL": endpoint, "AWS_ALLOW_HTTP": "true"})
    import boto3

    boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1").create_bucket(Bucket="calibrate")
    BUCKET.update(endpoint=endpoint, proc=proc)


def run_case(case: Case, workers: int, allocator: str, calibration: str | None = None, backend: str = "pods") -> dict:
    source = source_for(case)
    if BUCKET:
        source = in_bucket(source)
    out = os.path.join(
        DATA, f"out-{allocator}-{backend}.ome.zarr"
    )  # one per allocator and backend: matrices may run side by side
    # pods: emulated pod limits here; slurm: one SLURM job per worker, its cgroup at the planned --mem
    enforce = (
        ["--enforce-pod-limits"]
        if backend == "pods"
        else ["--backend", "slurm", "--slurm-log-dir", os.path.join(DATA, "slurm-logs")]
    )
    cmd = [
        sys.executable,
        "-m",
        "h5ngff.cli",
        "convert",
        f"{source}:/volume/data",
        out,
        "--overwrite",
        "--json",
        *enforce,
        "--chunks",
        case.chunks,
        "--compressor",
        case.compressor,
        "--levels",
        str(case.levels),
        "--allocator",
        allocator,
    ]
    if "--workers" not in case.flags:
        cmd += ["--workers", str(workers)]
    cmd += case.flags
    if calibration:
        cmd += ["--calibration", calibration]
    started = time.time()
    subprocess.run(["sync"])  # start each run without the previous one's dirty pages in flight
    proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, **case.env})
    shown = (
        "".join(f"{k}={v} " for k, v in case.env.items())
        + "h5ngff "
        + shlex.join([os.path.relpath(a) if a.startswith(HERE) else a for a in cmd[3:]])
    )
    try:
        summary = json.loads(proc.stdout)
    except ValueError:
        return {"case": case.name, "status": "error", "message": (proc.stderr or proc.stdout)[-400:], "command": shown}
    summary["case"] = case.name
    summary["command"] = shown
    summary["wall"] = time.time() - started
    return summary


def row(summary: dict) -> dict:
    if summary.get("status") != "Succeeded":
        return {
            "case": summary["case"],
            "status": summary.get("reason") or summary.get("status"),
            "message": summary.get("message") or "",
            "command": summary.get("command", ""),
        }
    workers = summary["workers"]
    measured = max(w["peak_rss"] for w in workers)
    cgroup = max((w["cgroup_peak"] or 0) for w in workers)
    predicted = summary["predicted_peak_per_worker"]
    plan = summary["plan"]
    # The pass that needs most; what the worker measured beyond its planned buffers is the
    # baseline this case implies (the figure to fit interpreter_baseline to).
    peak_pass = max(plan["passes"], key=lambda p: p["predicted_peak"])
    planned_baseline = next(t["bytes"] for t in peak_pass["terms"] if t["name"] == "interpreter")
    # The pod's own need (mem-pod's measurement), where this version of h5ngff reports it.
    pod_peaks = [w.get("pod_nonreclaimable_peak") for w in workers]
    pod_peak = max(pod_peaks) if all(p for p in pod_peaks) else None
    pinned_peaks = [w.get("pod_pinned_peak") for w in workers]
    pinned = max(pinned_peaks) if all(p for p in pinned_peaks) else None
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
        "pod_peak": pod_peak,
        "pod_ratio": summary["pod_limit_per_worker"] / pod_peak if pod_peak else None,
        "pinned": pinned,
        "pinned_ratio": summary["pod_limit_per_worker"] / pinned if pinned else None,
        "oom_kills": sum(w["oom_kills"] for w in workers),
        "restarts": sum(w["nanny_restarts"] for w in workers),
        "terminations": sum(w.get("memory_terminations", 0) for w in workers),
        "workers": len(workers),
        "wall": summary.get("wall"),
        "command": summary.get("command", ""),
    }


#: The pod limit against the pod's measured pinned peak (anon + shmem + unevictable): at most this
#: much for plans whose pod limit is at least 1 GiB, and POD_SMALL below (docs/memory-model.md).
POD_LARGE, POD_SMALL = 1.3, 1.6


def pod_bound(r: dict) -> float:
    return POD_LARGE if r["pod_limit"] >= 1 << 30 else POD_SMALL


def verdict(r: dict) -> str:
    if r["status"] != "ok":
        return f"FAILED: {r['status']} {r['message'][:80]}"
    if r["oom_kills"] or r["restarts"] or r["terminations"]:
        return "UNSAFE (killed or restarted)"
    worker = "safe, tight" if 1.0 <= r["ratio"] <= TIGHT else ("UNSAFE" if r["ratio"] < 1.0 else "safe, loose")
    if r.get("pinned_ratio") and r["pinned_ratio"] > pod_bound(r):
        worker += f", pod loose (> {pod_bound(r)}x pinned)"
    return worker


def table(rows: list[dict], allocator: str) -> str:
    lines = [
        f"| case ({allocator}) | slab | passes | predicted MiB | measured peak RSS MiB | predicted / measured | implied baseline MiB | cgroup peak MiB | pod limit MiB | OOM kills | verdict |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if r["status"] != "ok":
            lines.append(f"| {r['case']} | | | | | | | | | | {verdict(r)} |")
            continue
        lines.append(
            f"| {r['case']} | {r['slab']} | {r['passes']} | {r['predicted'] / MiB:.1f} | {r['measured'] / MiB:.1f} | {r['ratio']:.3f} | {r['implied_baseline'] / MiB:.1f} | "
            f"{r['cgroup'] / MiB:.1f} | {r['pod_limit'] / MiB:.1f} | {r['oom_kills']} | {verdict(r)} |"
        )
    return "\n".join(lines)


def pod_table(rows: list[dict], allocator: str) -> str:
    """Worker ratio and pod ratio side by side, with kills/restarts and the command of each case."""
    unmeasured = "not reported"  # a run without pod cgroups has no pod figures
    lines = [
        f"| case ({allocator}) | slab | passes | workers | predicted MiB | busiest worker MiB | ratio | pod limit MiB | pod non-reclaimable peak MiB | pod ratio | pinned peak MiB | pod limit / pinned | kills / restarts / terminations | verdict | command |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if r["status"] != "ok":
            lines.append(f"| {r['case']} | | | | | | | | | | | | | {verdict(r)} | `{r.get('command', '')}` |")
            continue
        pod_peak = f"{r['pod_peak'] / MiB:.1f}" if r["pod_peak"] else unmeasured
        pod_ratio = f"{r['pod_ratio']:.2f}" if r["pod_ratio"] else unmeasured
        pinned = f"{r['pinned'] / MiB:.1f}" if r.get("pinned") else unmeasured
        pinned_ratio = f"{r['pinned_ratio']:.2f}" if r.get("pinned_ratio") else unmeasured
        lines.append(
            f"| {r['case']} | {r['slab']} | {r['passes']} | {r['workers']} | {r['predicted'] / MiB:.1f} | {r['measured'] / MiB:.1f} | {r['ratio']:.3f} | "
            f"{r['pod_limit'] / MiB:.0f} | {pod_peak} | {pod_ratio} | {pinned} | {pinned_ratio} | {r['oom_kills']} / {r['restarts']} / {r['terminations']} | {verdict(r)} | `{r['command']}` |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="Only the first few cases.")
    parser.add_argument(
        "--matrix",
        default="base",
        choices=["base", "issue18", "round3", "all"],
        help="base: the original matrix; issue18: shards at every level count, float64, threads, 4-D/5-D, "
        "budgets, misaligned gzip chunks and the issue's big sharded case; round3: the 4-D gzip source "
        "read with libdeflate and through HDF5's filter, and uint8 with 128^3 chunks; all: every case.",
    )
    parser.add_argument(
        "--pod-table",
        action="store_true",
        help="Print the pod columns (pod limit against the pod's non-reclaimable and pinned peaks) for any matrix.",
    )
    parser.add_argument("--cases", help="Comma-separated case names to run.")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--allocator", default="jemalloc", choices=["jemalloc", "glibc"])
    parser.add_argument(
        "--backend",
        default="pods",
        choices=["pods", "slurm"],
        help="pods: emulated pod limits on this machine (default); slurm: under SLURM's job cgroups "
        "(needs a running SLURM: scripts/slurm-local start, and its SLURM_CONF).",
    )
    parser.add_argument("--out", help="Also write the Markdown table to this file.")
    parser.add_argument(
        "--from-bucket",
        action="store_true",
        help="Read every source from a loopback S3 endpoint (moto, bench/moto_ranged.py): the sources-in-a-bucket "
        "path and its memory terms (issue 44).",
    )
    parser.add_argument(
        "--calibration",
        metavar="FILE",
        help="Constants to plan with (h5ngff convert --calibration). To re-fit the baseline after a "
        "library upgrade, plan with a generous interpreter_baseline: the implied-baseline column "
        "(measured minus the planned buffers) is the figure to fit.",
    )
    args = parser.parse_args(argv)
    cases = (
        (matrix(args.quick) if args.matrix in ("base", "all") else [])
        + (issue18_matrix() if args.matrix in ("issue18", "all") else [])
        + (round3_matrix() if args.matrix in ("round3", "all") else [])
    )
    if args.cases:
        wanted = set(args.cases.split(","))
        cases = [c for c in cases if c.name in wanted]
    if args.from_bucket:
        start_bucket()
    rows = []
    for case in cases:
        r = row(run_case(case, args.workers, args.allocator, args.calibration, args.backend))
        rows.append(r)
        print(
            json.dumps(
                {
                    k: (
                        round(v / MiB, 1)
                        if k
                        in ("predicted", "measured", "cgroup", "pod_limit", "implied_baseline", "pod_peak", "pinned")
                        and v
                        else v
                    )
                    for k, v in r.items()
                }
            ),
            flush=True,
        )
    text = (pod_table if args.matrix != "base" or args.pod_table else table)(rows, args.allocator)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(
                f"<!-- {' '.join(['bench/calibrate'] + (argv if argv is not None else sys.argv[1:]))} -->\n{text}\n"
            )
    if BUCKET:
        BUCKET["proc"].terminate()  # type: ignore[attr-defined]
    bad = [r for r in rows if verdict(r) != "safe, tight"]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
