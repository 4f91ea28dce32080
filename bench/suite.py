"""Run the physical limit and every tool on each case, measure, verify, and collect results."""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
from dataclasses import asdict, dataclass, field

from .config import REPO_DIR, Case, build_cases
from .data import ensure_input, warm_page_cache
from .measure import Measured, run_measured
from .runs import RunSpec
from .verify import verify

log = logging.getLogger(__name__)


@dataclass
class SuiteConfig:
    scale: float
    cases: list[str]
    runs: list[RunSpec]
    data_dir: str
    work_dir: str
    results_dir: str
    cores: int
    timeout: float
    keep_outputs: bool = False
    interval: float = 0.05
    #: run ids to run once more under py-spy (not timed) for a flamegraph of where the time goes
    profile: list[str] = field(default_factory=list)
    #: rounds of every run, interleaved (round 1 runs every tool, then round 2...): the machine's
    #: background load drifts over minutes and would otherwise favour whoever ran at a quiet moment
    repeat: int = 1


@dataclass
class RunResult:
    case: str
    id: str
    tool: str
    label: str
    levels: int
    status: str  # ok | FAILED | error | timeout
    message: str
    seconds: float | None = None
    wall: float = 0.0
    gb_per_s: float | None = None
    ratio_limit: float | None = None
    ratio_h5ngff: float | None = None
    memory: dict = field(default_factory=dict)
    extra: dict = field(default_factory=dict)
    #: the machine's 1-minute load average when the run ended (this run's own load included)
    load1: float = 0.0
    #: time of every round (with --repeat); ``seconds`` is the fastest of them
    rounds: list[float | None] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.status == "ok"


@dataclass
class LimitResult:
    stages: dict
    total: float
    cores: int
    bytes_in: int
    bytes_out: int
    verified: str
    ok: bool
    memory: dict = field(default_factory=dict)
    #: one-core totals of every measurement (before and after the tools); the fastest is kept
    totals: list[float] = field(default_factory=list)
    #: The same work split over ``cores`` processes running at once: what the cores really do
    #: together (shared caches, memory bandwidth, the host), not the ideal total / cores.
    parallel: float | None = None
    #: The floor of the N-level mean pyramid the run asked for (bench.limit --levels): one core's
    #: total and stages, and N. A pyramid pays for more than one level's limit: halving every
    #: level and encoding 1/7 more chunks, which no converter can skip.
    pyramid_total: float | None = None
    pyramid_stages: dict = field(default_factory=dict)
    pyramid_levels: int = 1
    pyramid_totals: list[float] = field(default_factory=list)
    #: The pyramid's floor measured on ``cores`` processes at once (each a band of rows).
    pyramid_parallel: float | None = None

    @property
    def pyramid_seconds(self) -> float | None:
        return self.pyramid_total / self.cores if self.pyramid_total else None

    @property
    def seconds(self) -> float:
        """The limit on ``cores`` cores: one core's total, divided."""
        return self.total / self.cores


@dataclass
class CaseResult:
    case: Case
    source: str
    input_meta: dict
    limit: LimitResult | None
    limit_error: str
    runs: list[RunResult]
    profiles: dict[str, str] = field(default_factory=dict)

    def to_dict(self) -> dict:
        return {
            "case": asdict(self.case),
            "source": self.source,
            "input": self.input_meta,
            "limit_error": self.limit_error,
            "limit": asdict(self.limit) | {"seconds": self.limit.seconds} if self.limit else None,
            "runs": [asdict(r) for r in self.runs],
            "profiles": self.profiles,
        }


def _env() -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = REPO_DIR + os.pathsep + env.get("PYTHONPATH", "")
    env["PYTHONUNBUFFERED"] = "1"
    return env


def _failure_line(log_path: str) -> str:
    """The last line of a traceback (or the last line) of a failed tool's log."""
    try:
        with open(log_path, errors="replace") as f:
            lines = [ln.strip() for ln in f if ln.strip()]
    except OSError:
        return "no log"
    for line in reversed(lines):
        head = line.split(":", 1)[0]
        if head.endswith(("Error", "Exception", "Exit", "Interrupt")) or head.startswith("h5ngff convert exited"):
            return line[:300]
    return lines[-1][:300] if lines else "no output"


def _prepare(path: str) -> None:
    if os.path.exists(path):
        shutil.rmtree(path)
    # Dirty pages of the previous tool's output must not be flushed during this tool's run.
    os.sync()


def best_limit(
    first: tuple[LimitResult | None, str], second: tuple[LimitResult | None, str]
) -> tuple[LimitResult | None, str]:
    """The faster of two measurements: other work on the machine only ever slows the limit down,
    so the minimum is the better estimate of what the hardware can do."""
    measured = [m for m, _ in (first, second) if m is not None]
    if not measured:
        return None, first[1] or second[1]
    best = min(measured, key=lambda m: m.total)
    best.totals = [m.total for m in measured]
    return best, ""


def run_limit(
    cfg: SuiteConfig, case: Case, source: str, logs: str, tag: str = "limit", levels: int = 1
) -> tuple[LimitResult | None, str]:
    out = os.path.join(cfg.work_dir, f"{case.name}-{tag}.zarr")
    result_path = os.path.join(logs, f"{case.name}-{tag}.json")
    _prepare(out)
    warm_page_cache(source)
    argv = [
        sys.executable,
        "-m",
        "bench.limit",
        "--source",
        source,
        "--dataset",
        case.dataset,
        "--out",
        out,
        "--chunks",
        ",".join(map(str, case.chunks)),
        "--result",
        result_path,
        "--levels",
        str(levels),
    ]
    log_path = os.path.join(logs, f"{case.name}-{tag}.log")
    try:
        measured = run_measured(
            argv, timeout=cfg.timeout, log_path=log_path, cwd=REPO_DIR, env=_env(), interval=cfg.interval
        )
        if measured.timed_out or measured.returncode != 0:
            return None, "timeout" if measured.timed_out else f"error: {_failure_line(log_path)}"
        with open(result_path) as f:
            r = json.load(f)
        verdict = verify(out, source, case, levels, "mean")
        return LimitResult(
            r["stages"],
            r["total"],
            cfg.cores,
            r["bytes_in"],
            r["bytes_out"],
            verdict.message,
            verdict.ok,
            measured.to_dict(),
        ), ""
    finally:
        _cleanup(cfg, out)


def run_parallel_limit(cfg: SuiteConfig, case: Case, source: str, logs: str, levels: int = 1) -> float | None:
    """The limit's work split over ``cfg.cores`` processes started together; the slowest part's
    time. Verified like any output, so it cannot be fast by being wrong.

    A pyramid (``levels`` > 1) is split in bands of whole deepest-level chunks, which rarely
    divide evenly (f32: 7 and 8 bands of 256 rows); its figure is the parts' mean, what an even
    split would take, so it stays a lower bound."""
    tag = "limit-parallel" if levels == 1 else "limit-pyramid-parallel"
    out = os.path.join(cfg.work_dir, f"{case.name}-{tag}.zarr")
    _prepare(out)
    warm_page_cache(source)
    procs, results = [], []
    for i in range(cfg.cores):
        result_path = os.path.join(logs, f"{case.name}-{tag}-{i}.json")
        results.append(result_path)
        argv = [
            sys.executable,
            "-m",
            "bench.limit",
            "--source",
            source,
            "--dataset",
            case.dataset,
            "--out",
            out,
            "--chunks",
            ",".join(map(str, case.chunks)),
            "--result",
            result_path,
            "--part",
            f"{i}/{cfg.cores}",
            "--levels",
            str(levels),
        ]
        with open(os.path.join(logs, f"{case.name}-{tag}-{i}.log"), "w") as log:
            procs.append(subprocess.Popen(argv, cwd=REPO_DIR, env=_env(), stdout=log, stderr=subprocess.STDOUT))
    what = "limit" if levels == 1 else f"{levels}-level pyramid limit"
    try:
        if any(p.wait(timeout=cfg.timeout) != 0 for p in procs):
            return None
        totals = []
        for path in results:
            with open(path) as f:
                totals.append(json.load(f)["total"])
        verdict = verify(out, source, case, levels, "mean")
        if not verdict.ok:
            _say(f"[{case.name}] parallel {what} FAILED verification: {verdict.message}")
            return None
        measured = max(totals) if levels == 1 else sum(totals) / len(totals)
        _say(
            f"[{case.name}] {what} on {cfg.cores} cores in parallel, measured: {measured:.2f} s (parts {', '.join(f'{t:.2f}' for t in totals)})"
        )
        return measured
    except subprocess.TimeoutExpired:
        for p in procs:
            p.kill()
        return None
    finally:
        _cleanup(cfg, out)


def _cleanup(cfg: SuiteConfig, out: str) -> None:
    if not cfg.keep_outputs and os.path.exists(out):
        shutil.rmtree(out)


def peer_argv(spec: RunSpec, case: Case, source: str, out: str, result_path: str) -> list[str]:
    argv = [
        sys.executable,
        *spec.argv,
        "--source",
        source,
        "--dataset",
        case.dataset,
        "--out",
        out,
        "--result",
        result_path,
        "--axes",
        case.axes,
        "--chunks",
        ",".join(map(str, case.chunks)),
        "--levels",
        str(spec.levels),
    ]
    if spec.method:
        argv += ["--method", spec.method]
    if spec.user_slab:
        argv += ["--slab", ",".join(map(str, case.user_slab))]
    if spec.workers:
        argv += ["--workers", str(spec.workers)]
    if not spec.checksums:
        argv += ["--no-checksums"]
    return argv


def run_one(cfg: SuiteConfig, spec: RunSpec, case: Case, source: str, logs: str, round_tag: str = "") -> RunResult:
    out = os.path.join(cfg.work_dir, f"{case.name}-{spec.id}.zarr")
    result_path = os.path.join(logs, f"{case.name}-{spec.id}{round_tag}.json")
    log_path = os.path.join(logs, f"{case.name}-{spec.id}{round_tag}.log")
    _prepare(out)
    warm_page_cache(source)
    measured: Measured = run_measured(
        peer_argv(spec, case, source, out, result_path),
        timeout=cfg.timeout,
        log_path=log_path,
        cwd=REPO_DIR,
        env=_env(),
        interval=cfg.interval,
    )
    result = RunResult(
        case.name,
        spec.id,
        spec.tool,
        spec.label,
        spec.levels,
        "ok",
        "",
        wall=measured.wall,
        memory=measured.to_dict(),
        load1=os.getloadavg()[0],
    )
    try:
        if measured.timed_out:
            result.status, result.message = "timeout", f"timeout after {cfg.timeout:.0f} s"
        elif measured.returncode != 0 or not os.path.exists(result_path):
            result.status, result.message = "error", _failure_line(log_path)
        else:
            with open(result_path) as f:
                reported = json.load(f)
            result.seconds, result.extra = reported["seconds"], reported.get("extra", {})
            result.gb_per_s = case.nbytes / result.seconds / 1e9
            verdict = verify(out, source, case, spec.levels, spec.verify_as)
            result.status, result.message = ("ok" if verdict.ok else "FAILED"), verdict.message
    finally:
        _cleanup(cfg, out)
    return result


def combine_rounds(rounds: list[RunResult]) -> RunResult:
    """One result from a tool's rounds: a round that failed, errored or timed out decides (a fast
    wrong result never counts); otherwise the fastest round's time, as for the limit (other work on
    the machine only ever slows a run down), with the highest memory peak seen in any round."""
    failed = next((r for r in rounds if not r.ok), None)
    best = failed or min(rounds, key=lambda r: r.seconds)
    best.rounds = [r.seconds for r in rounds]
    if failed is None:
        best.memory = max((r.memory for r in rounds), key=lambda m: m.get("peak_largest", 0))
    return best


def add_ratios(runs: list[RunResult], specs: list[RunSpec], limit: LimitResult | None) -> None:
    refs = {}
    for spec in specs:
        if spec.reference:
            ref = next((r for r in runs if r.id == spec.id and r.ok), None)
            if ref:
                refs[spec.levels] = ref.seconds
    for r in runs:
        if not r.ok:
            continue
        if limit and limit.ok:
            r.ratio_limit = r.seconds / limit.seconds
        if r.levels in refs:
            r.ratio_h5ngff = r.seconds / refs[r.levels]


def run_case(cfg: SuiteConfig, case: Case, logs: str) -> CaseResult:
    source, meta = ensure_input(case, cfg.scale, cfg.data_dir)
    _say(f"[{case.name}] {case.describe()}, blosc ratio {meta.get('blosc_ratio')}")
    specs = [spec for spec in cfg.runs if case.container in spec.containers]
    if case.container != "h5":
        # bench.limit reads one HDF5 dataset; a container case is compared tool against tool.
        return _container_case(cfg, case, source, meta, specs, logs)
    levels = max(spec.levels for spec in specs)
    first = _limit_said(case, run_limit(cfg, case, source, logs, "limit"))
    pyramid_first = run_limit(cfg, case, source, logs, "limit-pyramid", levels) if levels > 1 else (None, "")
    runs = _run_rounds(cfg, case, source, specs, logs)
    # Measured again after the tools, so a busy moment at the start does not flatter them.
    limit, limit_error = best_limit(first, _limit_said(case, run_limit(cfg, case, source, logs, "limit-again")))
    if limit is not None and cfg.cores > 1:
        limit.parallel = run_parallel_limit(cfg, case, source, logs)
    if limit is not None and levels > 1:
        _pyramid_limit(cfg, case, source, logs, levels, limit, pyramid_first)
    add_ratios(runs, specs, limit)
    profiles = {spec.id: profile_run(cfg, spec, case, source, logs) for spec in specs if spec.id in cfg.profile}
    return CaseResult(case, source, meta, limit, limit_error, runs, profiles)


def _pyramid_limit(
    cfg: SuiteConfig,
    case: Case,
    source: str,
    logs: str,
    levels: int,
    limit: LimitResult,
    first: tuple[LimitResult | None, str],
) -> None:
    """The floor of the pyramid the runs built (bench.limit --levels), verified like the limit and,
    like it, measured before and after the tools with the faster kept."""
    measured = (first, run_limit(cfg, case, source, logs, "limit-pyramid-again", levels))
    for m, _ in measured:
        if m is not None and not m.ok:
            _say(f"[{case.name}] {levels}-level pyramid limit FAILED verification: {m.verified}")
            return
    pyramid, error = best_limit(*measured)
    if pyramid is None:
        _say(f"[{case.name}] {levels}-level pyramid limit: {error}")
        return
    limit.pyramid_total, limit.pyramid_stages, limit.pyramid_levels = pyramid.total, pyramid.stages, levels
    limit.pyramid_totals = pyramid.totals
    if cfg.cores > 1:
        limit.pyramid_parallel = run_parallel_limit(cfg, case, source, logs, levels)
    _say(
        f"[{case.name}] {levels}-level pyramid limit: {pyramid.total:.2f} s on 1 core (of {', '.join(f'{t:.2f}' for t in pyramid.totals)}) -> "
        f"{limit.pyramid_seconds:.2f} s on {limit.cores} ({pyramid.total / limit.total:.2f}x the single level's; {pyramid.verified})"
    )


def _container_case(
    cfg: SuiteConfig, case: Case, source: str, meta: dict, specs: list[RunSpec], logs: str
) -> CaseResult:
    runs = _run_rounds(cfg, case, source, specs, logs)
    add_ratios(runs, specs, None)
    profiles = {spec.id: profile_run(cfg, spec, case, source, logs) for spec in specs if spec.id in cfg.profile}
    return CaseResult(
        case,
        source,
        meta,
        None,
        "not applicable: the limit reads one HDF5 dataset, this case is a container",
        runs,
        profiles,
    )


def _run_rounds(cfg: SuiteConfig, case: Case, source: str, specs: list[RunSpec], logs: str) -> list[RunResult]:
    rounds: dict[str, list[RunResult]] = {spec.id: [] for spec in specs}
    for number in range(cfg.repeat):
        for spec in specs:
            r = run_one(cfg, spec, case, source, logs, f"-round{number + 1}" if number else "")
            took = f"{r.seconds:.2f} s" if r.seconds is not None else f"wall {r.wall:.1f} s"
            tag = f" (round {number + 1})" if cfg.repeat > 1 else ""
            _say(
                f"[{case.name}] {spec.id}{tag}: {r.status} {took}, peak {r.memory.get('peak_largest', 0) / 1e9:.2f} GB/proc; {r.message}"
            )
            rounds[spec.id].append(r)
    return [combine_rounds(rounds[spec.id]) for spec in specs]


def _limit_said(case: Case, measured: tuple[LimitResult | None, str]) -> tuple[LimitResult | None, str]:
    limit, error = measured
    if limit:
        _say(
            f"[{case.name}] physical limit: {limit.total:.2f} s on 1 core -> {limit.seconds:.2f} s on {limit.cores} ({limit.verified})"
        )
    else:
        _say(f"[{case.name}] physical limit: {error}")
    return measured


def profile_run(cfg: SuiteConfig, spec: RunSpec, case: Case, source: str, logs: str) -> str:
    """Run once more under ``py-spy record --subprocesses`` (Dask workers included); untimed.
    Returns the flamegraph's path, or why there is none."""
    out = os.path.join(cfg.work_dir, f"{case.name}-{spec.id}-profile.zarr")
    svg = os.path.join(cfg.results_dir, f"{case.name}-{spec.id}.pyspy.svg")
    result_path = os.path.join(logs, f"{case.name}-{spec.id}-profile.json")
    spy = shutil.which("py-spy", path=os.path.dirname(sys.executable)) or shutil.which("py-spy")
    if not spy:
        return "py-spy not installed (pip install -e '.[bench]')"
    _prepare(out)
    warm_page_cache(source)
    argv = [spy, "record", "--subprocesses", "--rate", "100", "--format", "flamegraph", "-o", svg, "--"] + peer_argv(
        spec, case, source, out, result_path
    )
    try:
        measured = run_measured(
            argv,
            timeout=cfg.timeout * 2,
            log_path=os.path.join(logs, f"{case.name}-{spec.id}-profile.log"),
            cwd=REPO_DIR,
            env=_env(),
        )
    finally:
        _cleanup(cfg, out)
    _say(f"[{case.name}] {spec.id}: py-spy flamegraph {svg} (exit {measured.returncode})")
    return svg if os.path.exists(svg) else f"py-spy failed (exit {measured.returncode})"


def run_suite(cfg: SuiteConfig, logs: str) -> list[CaseResult]:
    os.makedirs(cfg.work_dir, exist_ok=True)
    os.makedirs(logs, exist_ok=True)
    cases = build_cases(cfg.scale)
    return [run_case(cfg, cases[name], logs) for name in cfg.cases]


def _say(text: str) -> None:
    print(text, file=sys.stderr, flush=True)
