"""A few lines from the suite's results.json: the limit and the pyramid floor, every run's time and
ratios, and the worker count h5ngff planned. ``python3 summary.py results.json`` (run.sh runs it)."""

from __future__ import annotations

import json
import sys


def _s(v) -> str:
    return "-" if v is None else f"{v:.2f}"


def main(path: str) -> int:
    with open(path) as f:
        doc = json.load(f)
    print(f"command: {doc.get('command')}\nmachine: {doc.get('machine')}")
    print("versions: " + ", ".join(f"{k} {v}" for k, v in (doc.get("versions") or {}).items()))
    for case in doc["cases"]:
        lim = case.get("limit")
        print(
            f"\n== {case['case']['name']} {case['case']['shape']} {case['case']['dtype']}  input blosc ratio "
            f"{case['input'].get('blosc_ratio')}, generated in {case['input'].get('seconds')} s"
        )
        cores = None
        if lim:
            cores = lim["cores"]
            print(
                f"limit: 1 core {_s(lim.get('total'))} s (of {', '.join(_s(t) for t in lim.get('totals') or [])}) -> /{cores} = "
                f"{_s(lim.get('seconds'))} s; measured on {cores} processes at once: {_s(lim.get('parallel'))} s; stages {lim.get('stages')}"
            )
            if lim.get("pyramid_total"):
                print(
                    f"{lim['pyramid_levels']}-level pyramid floor: 1 core {_s(lim['pyramid_total'])} s -> /{cores} = "
                    f"{_s(lim['pyramid_total'] / cores)} s; measured on {cores} processes: {_s(lim.get('pyramid_parallel'))} s"
                )
        else:
            print(f"limit: {case.get('limit_error')}")
        for r in case["runs"]:
            plan = (r.get("extra") or {}).get("plan") or {}
            workers = (
                f", plan {plan.get('workers')} workers x {plan.get('threads_per_worker')} thread(s)" if plan else ""
            )
            vs_parallel = ""
            if lim and r.get("seconds") and r.get("status") == "ok":
                floor = lim.get("parallel") if r.get("levels", 1) == 1 else lim.get("pyramid_parallel")
                if floor:
                    what = "limit" if r.get("levels", 1) == 1 else "pyramid floor"
                    vs_parallel = f", {r['seconds'] / floor:.2f}x the measured {cores}-process {what}"
            mem = r.get("memory") or {}
            load = r.get("load1")
            print(
                f"{r['id']:16s} {r.get('status', '?'):6s} {_s(r.get('seconds'))} s (rounds {', '.join(_s(t) for t in r.get('rounds') or [])}; "
                f"wall {_s(r.get('wall'))} s), x limit {_s(r.get('ratio_limit'))}{vs_parallel}; "
                f"{mem.get('n_workers')} worker processes seen, peak {(mem.get('peak_worker') or 0) / 1e9:.2f} GB/worker{workers}; "
                f"load1 {_s(load)}; {(r.get('message') or '')[:120]}"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
