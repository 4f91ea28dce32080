"""``python -m bench``: generate the inputs, measure the physical limit and every tool, verify,
and write the table and plot."""

from __future__ import annotations

import argparse
import logging
import os
import shlex
import sys
import time

from .config import BENCH_DIR, available_cores, build_cases, default_timeout, scale_tag
from .data import case_dir
from .report import markdown, plot, write_json
from .runs import DEFAULT_RUNS, select
from .suite import SuiteConfig, run_suite

EPILOG = """\
examples:
  bench/run --scale 0.05                      smoke check (~230 MB per case)
  bench/run                                   full size (4.54 GB per case; needs a quiet machine)
  bench/run --scale 0.05 --cases f32 --only h5ngff,tensorstore
  bench/run --list
"""


def _csv(text: str) -> list[str]:
    return [v.strip() for v in text.split(",") if v.strip()]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m bench", description=__doc__, epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--scale",
        type=float,
        default=1.0,
        help="Fraction of the full-size volume's bytes; above 1, a larger volume (y and x scale by its square root; z stays 150). Default 1.",
    )
    p.add_argument("--cases", type=_csv, default=["f32", "u16-4d"], help="Comma-separated cases (default f32,u16-4d).")
    p.add_argument("--only", type=_csv, help="Only these run ids (see --list).")
    p.add_argument("--skip", type=_csv, help="Skip these run ids.")
    p.add_argument(
        "--data-dir",
        default=os.path.join(BENCH_DIR, "data"),
        help="Cache of generated inputs, per scale (default bench/data).",
    )
    p.add_argument(
        "--results-dir",
        default=os.path.join(BENCH_DIR, "results"),
        help="Where each run's folder goes (default bench/results).",
    )
    p.add_argument(
        "--work-dir", help="Where outputs are written (default DATA_DIR/scale-S/out); deleted after verification."
    )
    p.add_argument(
        "--cores",
        type=int,
        default=available_cores(),
        help="Cores the limit is divided by (default: the cores available here).",
    )
    p.add_argument("--timeout", type=float, help="Seconds per run before it is killed (default 120 + 1500 x scale).")
    p.add_argument("--interval", type=float, default=0.05, help="Memory sampling interval, seconds (default 0.05).")
    p.add_argument(
        "--keep-outputs", action="store_true", help="Keep every output instead of deleting it after verification."
    )
    p.add_argument(
        "--profile",
        type=_csv,
        default=[],
        help="Run these ids once more under py-spy (untimed) and keep a flamegraph of where the time goes.",
    )
    p.add_argument(
        "--repeat",
        type=int,
        default=1,
        help="Rounds of every run, interleaved; each tool's time is its fastest round "
        "and its memory the highest (default 1). Use 2 or more on a shared machine.",
    )
    p.add_argument("--list", action="store_true", help="List the cases and run ids and exit.")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    cases = build_cases(args.scale)
    if args.list:
        for case in cases.values():
            print(f"case {case.name}: {case.describe()}")
        for spec in DEFAULT_RUNS:
            print(f"run  {spec.id:30s} {spec.label}")
        return 0
    unknown = [c for c in args.cases if c not in cases]
    if unknown:
        raise SystemExit(f"unknown case(s) {unknown}; known: {list(cases)}")
    started = time.strftime("%Y%m%d-%H%M%S")
    out_dir = os.path.join(args.results_dir, f"{started}-scale{scale_tag(args.scale)}")
    cfg = SuiteConfig(
        scale=args.scale,
        cases=args.cases,
        runs=select(DEFAULT_RUNS, args.only, args.skip),
        data_dir=args.data_dir,
        work_dir=args.work_dir or os.path.join(case_dir(args.data_dir, args.scale), "out"),
        results_dir=out_dir,
        cores=args.cores,
        timeout=args.timeout or default_timeout(args.scale),
        keep_outputs=args.keep_outputs,
        interval=args.interval,
        profile=args.profile,
        repeat=max(1, args.repeat),
    )
    return run_and_report(
        cfg,
        command="bench/run " + " ".join(shlex.quote(a) for a in (sys.argv[1:] if argv is None else argv)),
        started=started,
    )


def run_and_report(cfg: SuiteConfig, command: str, started: str) -> int:
    """Run the suite and write results.md, results.json and plot.png into ``cfg.results_dir``."""
    os.makedirs(cfg.results_dir, exist_ok=True)
    results = run_suite(cfg, logs=os.path.join(cfg.results_dir, "logs"))
    text = markdown(results, command, started, cfg.scale, cfg.cores, cfg.repeat)
    with open(os.path.join(cfg.results_dir, "results.md"), "w") as f:
        f.write(text)
    write_json(results, os.path.join(cfg.results_dir, "results.json"), command, cfg.scale)
    plot(results, os.path.join(cfg.results_dir, "plot.png"))
    print(text)
    print(f"results: {cfg.results_dir}", file=sys.stderr)
    return 0
