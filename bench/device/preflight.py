"""Checks before the benchmark (run.sh runs it from the bundle's h5ngff/ with the suite's
PYTHONPATH): every module the selected runs import, every requirement of every installed package
(carried or provided) and of h5ngff itself, the allocator h5ngff's workers will get and the worker
count its planner will pick. Exit 1 when an import fails (nothing useful would come of the run);
unmet version requirements only warn.

    python preflight.py [--only h5ngff,h5ngff-pyramid,tensorstore] [--site SITE]"""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata as md
import os
import platform
import re
import sys
import traceback

sys.path.insert(0, os.getcwd())  # the folder that holds bench/

#: Imported whatever runs are selected: the suite, the limit, the verifier, the report and h5ngff's
#: local conversion path.
MODULES = (
    "numpy",
    "h5py",
    "hdf5plugin",
    "numcodecs.blosc",
    "zarr",
    "google_crc32c",
    "deflate",
    "pydantic",
    "dask.array",
    "distributed",
    "psutil",
    "yaml",
    "rich",
    "prometheus_client",
    "matplotlib.pyplot",
    "h5ngff.cli",
    "h5ngff.runner",
    "h5ngff.backends.local",
    "h5ngff.engine.write.tasks",
    "h5ngff.engine.sources.inflate",
    "bench.cli",
    "bench.suite",
    "bench.limit",
    "bench.verify",
    "bench.report",
    "bench.data",
)


def _csv(text: str) -> list[str]:
    return [v.strip() for v in text.split(",") if v.strip()]


def _requirements(site: str | None) -> tuple[list[str], int]:
    """Lines for every unmet requirement of the packages in ``site`` and of h5ngff's pyproject."""
    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    def have(name: str) -> str | None:
        try:
            return md.version(name)
        except md.PackageNotFoundError:
            return None

    wanted: list[tuple[str, str]] = []  # (who, requirement)
    if site and os.path.isdir(site):
        for dist in md.distributions(path=[site]):
            wanted += [(f"{dist.metadata['Name']} {dist.version}", r) for r in dist.requires or []]
    pyproject = os.path.join(os.getcwd(), "pyproject.toml")
    if os.path.exists(pyproject):
        import tomllib

        with open(pyproject, "rb") as f:
            wanted += [("h5ngff", r) for r in tomllib.load(f)["project"]["dependencies"]]
    lines, problems, seen = [], 0, set()
    for who, text in wanted:
        req = Requirement(text)
        if req.marker and not req.marker.evaluate({"extra": ""}):
            continue
        key = (who, canonicalize_name(req.name), str(req.specifier))
        if key in seen:
            continue
        seen.add(key)
        got = have(req.name)
        # A pre-release or local version (the stub's 0+stub) satisfies nothing; only a real miss counts.
        if got is None:
            lines.append(f"  {who} needs {req}: MISSING")
            problems += 1
        elif req.specifier and not req.specifier.contains(re.sub(r"\+.*", "", got), prereleases=True):
            if "stub" in got:
                continue
            lines.append(f"  {who} needs {req}: have {got}   <-- WARNING")
            problems += 1
    return lines, problems


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--only", type=_csv, default=["h5ngff", "h5ngff-pyramid", "tensorstore"], help="The run ids the suite will run."
    )
    p.add_argument("--site", help="The folder the carried wheels were installed into.")
    args = p.parse_args(argv)
    print(f"python {platform.python_version()} at {sys.executable}; {platform.platform()}")
    failed = []
    modules = list(MODULES)
    try:
        from bench.runs import DEFAULT_RUNS, select

        for spec in select(DEFAULT_RUNS, args.only, None):
            if spec.argv[0] == "-m":
                modules.append(spec.argv[1])
    except Exception:
        failed.append("bench.runs")
        print(f"IMPORT FAILED: bench.runs\n{traceback.format_exc()}")
    for module in modules:
        try:
            importlib.import_module(module)
        except Exception:
            failed.append(module)
            print(f"IMPORT FAILED: {module}\n{traceback.format_exc()}")
    versions = []
    for name in (
        "h5ngff",
        "numpy",
        "h5py",
        "hdf5plugin",
        "tensorstore",
        "dask",
        "distributed",
        "zarr",
        "numcodecs",
        "pydantic",
        "matplotlib",
    ):
        try:
            versions.append(f"{name} {md.version(name)}")
        except md.PackageNotFoundError:
            versions.append(f"{name} (no metadata)")
    print("versions: " + ", ".join(versions))
    for module in ("numpy", "h5py", "hdf5plugin", "tensorstore", "dask", "zarr", "h5ngff", "bench"):
        mod = sys.modules.get(module)
        print(
            f"  {module:12s} from {os.path.dirname(getattr(mod, '__file__', None) or '?') if mod else '(not imported)'}"
        )
    try:
        lines, problems = _requirements(args.site)
        print(
            f"requirements of the installed packages and of h5ngff: {'all met' if not problems else f'{problems} unmet'}"
        )
        if lines:
            print("\n".join(lines))
    except Exception:
        print(f"requirement check skipped:\n{traceback.format_exc()}")
    if "h5ngff.backends.local" not in failed:
        from h5ngff.backends.allocator import jemalloc_path, resolve_allocator
        from h5ngff.backends.base import machine_capacity

        cap = machine_capacity()
        print(
            f"h5ngff allocator for workers: {resolve_allocator('auto')} ({jemalloc_path() or 'no libjemalloc found'})"
        )
        print(
            f"h5ngff capacity: {cap.cores} cores usable (sched_getaffinity) -> the planner's default is {cap.cores} workers; "
            f"memory {cap.memory_bytes / 2**30:.1f} GiB (cgroup-capped)"
        )
        want = int(os.environ.get("BENCH_CORES", "0") or 0)
        if want and cap.cores != want:
            print(f"WARNING: h5ngff will plan {cap.cores} workers but the limit is divided by --cores {want}")
    if failed:
        print(f"preflight FAILED: {len(failed)} import(s) failed: {', '.join(failed)}")
        return 1
    print("preflight ok")
    return 0


if __name__ == "__main__":
    sys.exit(main())
