"""h5ngff through its own command line (``h5ngff convert … --json``), in this process so the
timer starts after the imports, as for every other peer."""

from __future__ import annotations

import contextlib
import io
import json

import distributed  # noqa: F401  (imported before the clock starts, like every peer's libraries)

from h5ngff import cli
from h5ngff.backends import local  # noqa: F401
from h5ngff import runner  # noqa: F401

from .common import peer_main

KEEP = (
    "seconds",
    "gb_per_s",
    "bytes_written",
    "stage_seconds",
    "predicted_peak_per_worker",
    "memory_limit_per_worker",
    "pod_limit_per_worker",
)


def build_argv(args) -> list[str]:
    # A container (Imaris, BDV XML) is named alone: h5ngff finds its datasets (docs/formats.md).
    source = args.source if args.source.endswith((".ims", ".xml")) else f"{args.source}:{args.dataset}"
    argv = [
        "convert",
        source,
        args.out,
        "--json",
        "--no-progress",
        "--chunks",
        ",".join(map(str, args.chunks)),
        "--compressor",
        "zstd:5:bitshuffle",
        "--axes",
        args.axes,
        "--levels",
        str(args.levels),
    ]
    if args.levels > 1:
        argv += ["--downsample", args.method or "mean"]
    if args.workers:
        argv += ["--workers", str(args.workers)]
    if args.slab:
        argv += ["--slab", ",".join(map(str, args.slab))]
    if args.no_checksums:
        argv += ["--no-checksums"]
    return argv


def convert(args) -> dict:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = cli.main(build_argv(args))
    summary = json.loads(out.getvalue())
    if code != 0:
        raise SystemExit(f"h5ngff convert exited {code}: {summary.get('reason')}: {summary.get('message')}")
    plan = summary.get("plan", {})
    extra = {k: summary.get(k) for k in KEEP}
    extra["workers"] = [{"name": w["name"], "peak_rss": w["peak_rss"]} for w in summary.get("workers", [])]
    extra["plan"] = {
        "workers": plan.get("workers"),
        "threads_per_worker": plan.get("threads_per_worker"),
        "slabs": [p.get("slab") for p in plan.get("passes", [])],
        "inflight_per_worker": plan.get("inflight_per_worker"),
    }
    return extra


if __name__ == "__main__":
    raise SystemExit(peer_main(convert))
