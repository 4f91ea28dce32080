"""The memory report: every worker's RSS over time, with the planned limits drawn as lines, so a
user can see that the plan held (``h5ngff convert --memory-report FILE``)."""

from __future__ import annotations

import base64
import html
import importlib.util
import io
import os
from typing import Any

from ..units import MiB

#: Worker lines never take a colour of the limit lines (green, orange, red, black).
WORKER_COLOURS = ("tab:blue", "tab:purple", "tab:brown", "tab:pink", "tab:cyan", "tab:olive", "tab:gray")


def _figure(summary: Any) -> Any:
    # ``summary`` is the runner's RunSummary, a layer above metrics: read by attribute.
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    plan = summary.job.plan
    fig, ax = plt.subplots(figsize=(10, 5), dpi=110)
    pod_timeline = list(getattr(summary, "pod_timeline", ()))
    start = min((t for t, _, _ in summary.timeline + pod_timeline), default=0.0)
    series: dict[str, list[tuple[float, int]]] = {}
    for t, name, rss in summary.timeline:
        series.setdefault(name, []).append((t - start, rss))
    pods: dict[str, list[tuple[float, int]]] = {}
    for t, name, held in pod_timeline:
        pods.setdefault(name, []).append((t - start, held))
    palette = WORKER_COLOURS
    colors = {name: palette[i % len(palette)] for i, name in enumerate(sorted(set(series) | set(pods), key=_natural))}
    for name, points in sorted(series.items()):
        ax.plot(
            [p[0] for p in points],
            [p[1] / MiB for p in points],
            label=f"worker {name} RSS",
            linewidth=1.2,
            color=colors[name],
        )
    # The pod's non-reclaimable memory (anon + dirty + writeback + ...), in the worker's colour.
    for name, points in sorted(pods.items()):
        ax.plot(
            [p[0] for p in points],
            [p[1] / MiB for p in points],
            label=f"pod {name} non-reclaimable",
            linewidth=1.0,
            linestyle="--",
            color=colors[name],
        )
    enforced = [w.pod_limit for w in summary.workers if w.pod_limit]  # --pod-limit overrides the plan
    pod_limit = max(enforced) if enforced else plan.memory.pod_limit
    enforced_cgroup = any(w.cgroup_peak is not None for w in summary.workers)
    lines = [
        (plan.memory.predicted_peak, "predicted peak", "tab:green", ":"),
        (plan.memory.memory_limit * plan.memory.thresholds.terminate, "Dask terminate", "tab:orange", "-."),
        (plan.memory.memory_limit, "Dask memory_limit", "tab:red", "--"),
        (
            pod_limit,
            "pod limit (cgroup)" if enforced_cgroup else "pod limit (planned, not enforced here)",
            "black",
            "-",
        ),
    ]
    for value, label, color, style in lines:
        ax.axhline(value / MiB, color=color, linestyle=style, linewidth=1.4, label=f"{label} {value / MiB:,.0f} MiB")
    # The samples stop when the workers do; the axis spans the whole run.
    last = max((t - start for t, _, _ in summary.timeline + pod_timeline), default=0.0)
    ax.set_xlim(0, max(summary.seconds, last, 1e-3))
    ax.set_xlabel("seconds since start")
    ax.set_ylabel("MiB")
    ax.set_ylim(0, pod_limit / MiB * 1.08)
    source = summary.job.spec.source
    ax.set_title(
        f"h5ngff memory per worker: {os.path.basename(source.path)}:{source.dataset} ({summary.seconds:.1f} s)"
    )
    ax.legend(loc="lower right", fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    return fig


def _natural(name: str) -> tuple:
    digits = "".join(ch for ch in name if ch.isdigit())
    return (name.rstrip("0123456789"), int(digits) if digits else -1)


#: What ``write_memory_report`` writes, by the path's suffix: an HTML page, or the figure in any
#: format matplotlib writes without extra packages (.png is the documented one).
REPORT_SUFFIXES = (".png", ".html", ".htm", ".svg", ".pdf", ".jpg", ".jpeg", ".webp", ".tif", ".tiff", ".eps", ".ps")


def check_report_path(path: str) -> None:
    """Refuse a memory-report path that could not be written, before the conversion starts: the
    report is written after it, and a conversion that finished must not be reported failed."""
    from ..errors import SpecError

    if os.path.isdir(path):
        raise SpecError("--memory-report", f"Expected a file name. Got {path!r}, which is a directory.")
    if not path.lower().endswith(REPORT_SUFFIXES):
        raise SpecError(
            "--memory-report",
            f"Expected an .html page or an image file name ({', '.join(s for s in REPORT_SUFFIXES if s not in ('.html', '.htm'))}). "
            f"Got {path!r} instead.",
        )
    if importlib.util.find_spec("matplotlib") is None:
        # A plots extra, not a dependency: the container image leaves matplotlib out (no pod draws).
        raise SpecError(
            "--memory-report",
            "needs matplotlib, which this installation lacks (the container image leaves it out). "
            "Install h5ngff[plots], or run without --memory-report.",
        )
    parent = os.path.dirname(os.path.abspath(path))
    while not os.path.exists(parent):
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent) or not os.access(parent, os.W_OK | os.X_OK):
        why = "a file, not a directory" if not os.path.isdir(parent) else "not writable"
        raise SpecError("--memory-report", f"cannot write {path!r}: {parent!r} is {why}. Choose another path.")


def report_failure(summary, path: str) -> str | None:
    """Write the report; None, or why it was not written. A report is never a run's outcome: its
    path was checked before the run (``check_report_path``), so only a change meanwhile or a full
    disk gets here, and a conversion that finished must not be reported failed for it."""
    try:
        write_memory_report(summary, path)
    except (OSError, ValueError) as exc:
        return f"the memory report {path!r} was not written: {exc}"
    return None


def write_memory_report(summary, path: str) -> str:
    """Write a PNG, or an HTML page (with the PNG and a per-worker table) for ``.html``."""
    fig = _figure(summary)
    os.makedirs(os.path.dirname(os.path.abspath(path)) or ".", exist_ok=True)
    if path.lower().endswith((".html", ".htm")):
        buf = io.BytesIO()
        fig.savefig(buf, format="png")
        image = base64.b64encode(buf.getvalue()).decode()
        rows = "".join(
            f"<tr><td>{html.escape(w.name)}</td><td>{w.peak_rss / MiB:,.1f}</td><td>{w.predicted_peak / MiB:,.1f}</td>"
            f"<td>{w.memory_limit / MiB:,.1f}</td><td>{w.pod_limit / MiB:,.1f}</td>"
            f"<td>{'' if w.pod_nonreclaimable_peak is None else f'{w.pod_nonreclaimable_peak / MiB:,.1f}'}</td>"
            f"<td>{'' if w.cgroup_peak is None else f'{w.cgroup_peak / MiB:,.1f}'}</td><td>{w.oom_kills}</td><td>{w.nanny_restarts}</td></tr>"
            for w in summary.workers
        )
        page = (
            "<!doctype html><meta charset=utf-8><title>h5ngff memory report</title>"
            "<style>body{font-family:sans-serif;margin:2em}td,th{padding:.2em .8em;text-align:right}</style>"
            f"<h1>Memory per worker</h1><p>{html.escape(summary.job.spec.output.path)}: {summary.status} in {summary.seconds:.2f} s</p>"
            f"<img src='data:image/png;base64,{image}' alt='memory timeline'>"
            "<table><tr><th>worker</th><th>peak RSS MiB</th><th>predicted MiB</th><th>memory_limit MiB</th><th>pod limit MiB</th>"
            f"<th>pod non-reclaimable peak MiB</th><th>cgroup peak MiB</th><th>OOM kills</th><th>restarts</th></tr>{rows}</table>"
        )
        with open(path, "w") as f:
            f.write(page)
    else:
        fig.savefig(path)
    import matplotlib.pyplot as plt

    plt.close(fig)
    return path
