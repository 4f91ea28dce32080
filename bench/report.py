"""The results as a Markdown table (with the issue's targets checked), a JSON file, and a plot
of time against peak memory per tool."""

from __future__ import annotations

import importlib.metadata
import json
import platform

import psutil

from .config import CODEC_TEXT
from .measure import __doc__ as MEASURE_DOC
from .suite import CaseResult, LimitResult, RunResult

PACKAGES = (
    "h5ngff",
    "numpy",
    "h5py",
    "hdf5plugin",
    "numcodecs",
    "zarr",
    "dask",
    "distributed",
    "ngff-zarr",
    "ome-zarr",
    "tensorstore",
)
#: Issue 8's targets.
SINGLE_TARGET, PYRAMID_TARGET = 1.25, 1.4


def versions() -> dict[str, str]:
    out = {}
    for name in PACKAGES:
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            out[name] = "missing"
    return out


def machine() -> str:
    return f"{psutil.cpu_count()} cores, {psutil.virtual_memory().total / 2**30:.1f} GiB, {platform.platform()}, Python {platform.python_version()}"


def _gb(n: float | None) -> str:
    return "" if not n else f"{n / 1e9:.2f}"


def _x(v: float | None) -> str:
    return "" if v is None else f"{v:.2f}x"


def limit_table(limit: LimitResult) -> list[str]:
    s = limit.stages
    ratio = limit.bytes_in / max(1, limit.bytes_out)
    return [
        "| read | extract | encode | write | total, 1 core | limit on %d cores | blosc ratio | verified |"
        % limit.cores,
        "|---|---|---|---|---|---|---|---|",
        f"| {s['read']:.2f} s | {s['extract']:.2f} s | {s['encode']:.2f} s | {s['write']:.2f} s | {limit.total:.2f} s | "
        f"**{limit.seconds:.2f} s** | {ratio:.2f} | {'ok' if limit.ok else 'FAILED'}: {limit.verified} |",
        "",
        *(
            [
                f"Measured with the work split over {limit.cores} processes running at once: **{limit.parallel:.2f} s**, "
                f"{limit.parallel / limit.seconds:.2f}x the ideal one-core total / {limit.cores}. That is what these cores really do "
                f"together (shared caches and memory bandwidth); every tool pays the same.",
                "",
            ]
            if limit.parallel
            else []
        ),
        *(
            [
                f"The floor of the {limit.pyramid_levels}-level mean pyramid (the same work, plus halving every level and encoding "
                f"its chunks; `bench.limit --levels {limit.pyramid_levels}`): **{limit.pyramid_seconds:.2f} s** on {limit.cores} cores "
                f"({limit.pyramid_total:.2f} s on 1 core, the faster of {', '.join(f'{t:.2f}' for t in limit.pyramid_totals)}; "
                f"{limit.pyramid_total / limit.total:.2f}x the single level's; "
                f"{_stages(limit.pyramid_stages)})"
                + (
                    f"; measured on {limit.cores} processes at once, each a band of rows: **{limit.pyramid_parallel:.2f} s**"
                    if limit.pyramid_parallel
                    else ""
                )
                + ".",
                "",
            ]
            if limit.pyramid_total
            else []
        ),
        "Measured before and after the tools (one-core totals: "
        + ", ".join(f"{t:.2f} s" for t in limit.totals)
        + "); the faster is kept, since other work on the machine can only slow it down.",
    ]


def _verdict(r: RunResult) -> str:
    if r.status == "ok":
        return f"ok: {r.message}"
    if r.status == "FAILED":
        return f"**FAILED**: {r.message}"
    return f"{r.status}: {r.message}".replace("|", "/")


def runs_table(runs: list[RunResult]) -> list[str]:
    lines = [
        "| run | levels | time s | wall s | GB/s | x limit | x h5ngff | peak RSS largest process GB | worker processes seen | peak RSS all processes GB | verified |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in runs:
        m = r.memory
        counted = r.ok
        time_s = (
            f"{r.seconds:.2f}" if r.seconds is not None and counted else ("~~%.2f~~" % r.seconds if r.seconds else "")
        )
        lines.append(
            f"| {r.label} | {r.levels} | {time_s} | {r.wall:.1f} | {'%.2f' % r.gb_per_s if counted and r.gb_per_s else ''} | "
            f"{_x(r.ratio_limit)} | {_x(r.ratio_h5ngff)} | {_gb(m.get('peak_largest'))} | {m.get('n_workers') or 1} | "
            f"{_gb(m.get('tree_peak'))} | {_verdict(r)} |"
        )
    return lines


def _find(runs: list[RunResult], run_id: str) -> RunResult | None:
    return next((r for r in runs if r.id == run_id), None)


def targets(result: CaseResult) -> list[str]:
    """Issue 8's targets, each met or missed with the numbers."""
    runs, limit = result.runs, result.limit
    single, pyramid = _find(runs, "h5ngff"), _find(runs, "h5ngff-pyramid")
    out = []

    def line(ok: bool, text: str) -> None:
        out.append(f"- {'met' if ok else '**missed**'}: {text}")

    if single and single.ok and single.ratio_limit:
        line(
            single.ratio_limit <= SINGLE_TARGET,
            f"single level {single.seconds:.2f} s = {single.ratio_limit:.2f}x the limit (target <= {SINGLE_TARGET}x)",
        )
        peers = [r for r in runs if r.ok and r.tool != "h5ngff" and r.levels == 1]
        if peers:
            best = min(peers, key=lambda r: r.seconds)
            line(
                single.seconds < best.seconds,
                f"faster than every peer at one level: best peer {best.label} {best.seconds:.2f} s ({best.seconds / single.seconds:.2f}x h5ngff)",
            )
    if pyramid and pyramid.ok and pyramid.ratio_limit:
        line(
            pyramid.ratio_limit <= PYRAMID_TARGET,
            f"{pyramid.levels}-level pyramid {pyramid.seconds:.2f} s = {pyramid.ratio_limit:.2f}x the single-level limit (target <= {PYRAMID_TARGET}x)",
        )
    for r in (x for x in runs if x.tool == "h5ngff" and x.ok):
        planned = r.extra.get("predicted_peak_per_worker")
        worker = r.memory.get("peak_worker")
        if planned and worker:
            line(
                worker <= planned,
                f"{r.id}: peak RSS per worker {_gb(worker)} GB vs plan {_gb(planned)} GB ({worker / planned:.2f} of plan)",
            )
    if single and single.ok:
        others = [r for r in runs if r.ok and r.tool != "h5ngff"]
        if others:
            lowest = min(others, key=lambda r: r.memory.get("peak_largest", 0))
            ours = single.memory.get("peak_worker", 0)
            line(
                ours < lowest.memory.get("peak_largest", 0),
                f"h5ngff peak per worker {_gb(ours)} GB below every peer's per-process peak (lowest: {lowest.label} {_gb(lowest.memory.get('peak_largest'))} GB)",
            )
    out += [
        f"- where the time goes, {r.id} (h5ngff's stage timer, summed over tasks): "
        + _stages(r.extra.get("stage_seconds") or {})
        for r in (single, pyramid)
        if r and r.ok and r.extra.get("stage_seconds")
    ]
    if limit and limit.parallel:
        for r in (single, pyramid):
            if r and r.ok:
                out.append(
                    f"- against the measured {limit.cores}-core limit ({limit.parallel:.2f} s): {r.id} {r.seconds:.2f} s = {r.seconds / limit.parallel:.2f}x"
                )
    if limit and limit.pyramid_seconds:
        for r in runs:
            if r.ok and r.tool == "h5ngff" and r.levels == limit.pyramid_levels:
                out.append(
                    f"- against the {r.levels}-level pyramid's floor ({limit.pyramid_seconds:.2f} s on {limit.cores} cores): "
                    f"{r.id} {r.seconds:.2f} s = {r.seconds / limit.pyramid_seconds:.2f}x"
                )
                if limit.pyramid_parallel:
                    out.append(
                        f"- against the {r.levels}-level pyramid's floor measured on {limit.cores} cores ({limit.pyramid_parallel:.2f} s): "
                        f"{r.id} {r.seconds:.2f} s = {r.seconds / limit.pyramid_parallel:.2f}x"
                    )
    if limit:
        out.append("- the limit's stages on one core: " + _stages(limit.stages))
    return out or ["- not evaluated (h5ngff or the limit did not run)"]


def _stages(stages: dict) -> str:
    return ", ".join(f"{k} {v:.2f} s" for k, v in stages.items())


def _load_note(runs: list[RunResult], cores: int) -> str:
    loads = [r.load1 for r in runs] or [0.0]
    note = f"Load average (1 min) at the end of each run: {min(loads):.1f} to {max(loads):.1f} on {cores} cores."
    if max(loads) > 1.5 * cores:
        note += " **The machine was busy with other work: these times are not comparable with a quiet run.**"
    return note


def markdown(results: list[CaseResult], command: str, started: str, scale: float, cores: int, repeat: int = 1) -> str:
    lines = [
        f"# h5ngff benchmark, scale {scale:g} ({started})",
        "",
        f"Command: `{command}`",
        "",
        f"Machine: {machine()}",
        "",
        "Versions: " + ", ".join(f"{k} {v}" for k, v in versions().items()),
        "",
        f"Output for every tool: chunks of 64 per spatial axis, {CODEC_TEXT}. Time = the tool's own work after its "
        "imports (cluster start and stop included); wall = the whole process. Ratios use time. A run that fails "
        "verification, errors or times out gets no ratios and its time is struck through.",
        "",
    ]
    if repeat > 1:
        lines += [
            f"Every tool ran {repeat} times, the rounds interleaved (every tool once, then again). Time is the fastest "
            "round and memory the highest; a round that failed verification fails the tool. Every round's time is in "
            "results.json.",
            "",
        ]
    for res in results:
        lines += [
            f"## {res.case.name}: {res.case.title}",
            "",
            f"Input: {res.case.describe()}; generated data, blosc ratio "
            f"{res.input_meta.get('blosc_ratio')} on sampled chunks.",
            "",
            "### Physical limit",
            "",
        ]
        lines += limit_table(res.limit) if res.limit else [f"not measured: {res.limit_error}"]
        lines += ["", _load_note(res.runs, cores)]
        lines += ["", "### Runs", ""] + runs_table(res.runs) + ["", "### Targets (issue 8)", ""] + targets(res) + [""]
        lines += [f"- py-spy profile of {run_id}: {where}" for run_id, where in res.profiles.items()] + (
            [""] if res.profiles else []
        )
    lines += ["## How memory is measured", "", MEASURE_DOC.strip(), ""]
    return "\n".join(lines)


def write_json(results: list[CaseResult], path: str, command: str, scale: float) -> None:
    with open(path, "w") as f:
        json.dump(
            {
                "command": command,
                "scale": scale,
                "machine": machine(),
                "versions": versions(),
                "cases": [r.to_dict() for r in results],
            },
            f,
            indent=1,
            default=str,
        )


def plot(results: list[CaseResult], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(results), figsize=(9 * len(results), 5.5), squeeze=False)
    tools = sorted({r.tool for res in results for r in res.runs})
    colors = {t: plt.cm.tab10(i % 10) for i, t in enumerate(tools)}
    for ax, res in zip(axes[0], results):
        _plot_case(ax, res, colors)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _plot_case(ax, res: CaseResult, colors: dict) -> None:
    # Alternate label offsets so neighbouring points stay readable.
    offsets = [(5, 4), (5, -10), (-10, 8)]
    top = 0.0
    for i, r in enumerate(res.runs):
        secs = r.seconds if r.seconds is not None else r.wall
        peak = r.memory.get("peak_largest", 0) / 1e9
        top = max(top, peak)
        if r.ok:
            ax.scatter(secs, peak, color=colors[r.tool], marker="s" if r.levels > 1 else "o", s=60, label=r.tool)
            ax.annotate(r.id, (secs, peak), textcoords="offset points", xytext=offsets[i % 3], fontsize=7)
        else:
            ax.scatter(secs, peak, color="red", marker="x", s=60)
            ax.annotate(
                f"{r.id} ({r.status})",
                (secs, peak),
                textcoords="offset points",
                xytext=offsets[i % 3],
                fontsize=7,
                color="red",
            )
    if res.limit:
        ax.axvline(res.limit.seconds, color="grey", linestyle="--", linewidth=1)
        ax.text(
            res.limit.seconds,
            0.02,
            " physical limit",
            transform=ax.get_xaxis_transform(),
            fontsize=7,
            color="grey",
            rotation=90,
            va="bottom",
        )
    handles, labels = ax.get_legend_handles_labels()
    unique = dict(zip(labels, handles))
    ax.legend(unique.values(), unique.keys(), fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    ax.set_xscale("log")
    ax.set_ylim(0, max(0.1, top * 1.15))
    ax.set_xlabel("time, s (log; circles: one level, squares: pyramid, x: not counted)")
    ax.set_ylabel("peak RSS of the largest process, GB")
    ax.set_title(f"{res.case.name}: {res.case.shape} {res.case.dtype}", fontsize=9)
    ax.grid(True, which="both", alpha=0.3)
