"""``h5ngff convert`` with several sources or a glob: a batch through one cluster (docs/batch.md).

The CLI's input (patterns, the output template, the flags every item shares) and output (the
batch's plan, an overall bar over a bar per item, the summary table); the batch itself runs in
``batch.run``.
"""

from __future__ import annotations

import argparse
import os
import json
from collections import Counter
from contextlib import nullcontext
from typing import TYPE_CHECKING, Any, Callable, Sequence

from rich.console import Console, Group
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TaskID,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)
from rich.table import Table
from rich.text import Text

from .batch.items import GLOB_CHARS, BatchItem, batch_items, expand_sources, is_template, split_pattern
from .batch.listing import bucket_lister
from .batch.run import (
    COMPLETE,
    DEFAULT_ITEMS_IN_FLIGHT,
    DONE,
    FAILED,
    NOT_RUN,
    REFUSED,
    BatchHooks,
    BatchSummary,
    ItemResult,
    run_batch,
)
from .cliargs import (
    add_spec_flags,
    backend_from_args,
    constants_from_args,
    listing_options,
    merge,
    spec_for_source,
    spec_overrides,
    split_source,
)
from .console import make_console, print_notices, shorten_quoted
from .engine.progress import Listener, Progress as ProgressEvent
from .errors import ExitCode, SpecError
from .units import MiB

if TYPE_CHECKING:  # prometheus-client loads only where metrics are served
    from .backends.base import Backend
    from .metrics.exporter import MetricsExporter
    from .spec import ConversionSpec

OUTCOME_STYLE = {DONE: "green", COMPLETE: "green", REFUSED: "yellow", FAILED: "red", NOT_RUN: "dim"}


EPILOG_BATCH = """\
examples:
  h5ngff batch manifests/examples/conversionbatch.yaml            # the ConversionBatch you would kubectl apply
  h5ngff batch run.yaml --workers 4 --json

The same items, outputs, plans, outcomes and exit status as h5ngff convert with a glob and a
template (docs/batch.md); the items and every setting come from the manifest's spec.
"""


def add_batch_command(sub: Any, common_run_flags: Callable[[argparse.ArgumentParser, bool, bool], None]) -> None:
    b = sub.add_parser(
        "batch",
        help="Run a ConversionBatch manifest locally: many files through one planned cluster.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=EPILOG_BATCH,
        description="Run a ConversionBatch manifest (the file you would kubectl apply) on a local Dask cluster.",
    )
    b.add_argument(
        "manifest", metavar="BATCH.yaml", help="A ConversionBatch manifest (apiVersion h5ngff.dev/v1alpha1)."
    )
    common_run_flags(b, True, False)
    add_spec_flags(b)  # over every item's spec, as over a manifest's in h5ngff plan and convert
    add_batch_flags(b)
    b.set_defaults(func=cmd_batch)


def add_batch_flags(parser: argparse.ArgumentParser, prefix: str = "") -> None:
    """The flags only a batch reads, on ``convert`` (where they say so) and ``batch``."""
    parser.add_argument(
        "--fail-fast",
        action="store_true",
        help=f"{prefix}stop at the first item that fails or is refused (default: convert the others).",
    )
    parser.add_argument(
        "--items-in-flight",
        type=_positive_int,
        default=None,
        metavar="N",
        help=f"{prefix}items converted at once on the one cluster (default {DEFAULT_ITEMS_IN_FLIGHT}, or a manifest's "
        "spec.itemsInFlight: the next item's "
        "slabs fill the workers an item's last passes leave idle; 1 runs them one by one, each worker's peak "
        "then its own item's; docs/batch.md).",
    )


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a whole number of 1 or more, got {text!r}")
    return value


def cmd_batch(args: argparse.Namespace, console: Console) -> int:
    """``h5ngff batch BATCH.yaml``: the manifest's items, each with the spec one ConversionJob
    would have, under the flags given (``--overwrite``, the backend's)."""
    from .job import load_document, manifest_head, parse_spec_of
    from .jobspec import BATCH_KIND
    from .operator.schema.batchspec import parse_batch_spec
    from .spec import parse_spec

    doc = load_document(args.manifest, BATCH_KIND)
    manifest_head(doc)
    batch = parse_spec_of(doc, parse_batch_spec)
    planned = batch.planned_items()
    specs = {p.item: p.spec for p in planned}
    overrides = spec_overrides(args)

    def spec_for(item: BatchItem) -> ConversionSpec:
        return parse_spec(merge(specs[item].conversion().to_wire(), overrides))

    if args.items_in_flight is None:  # the flag over the manifest's, as for every field
        args.items_in_flight = batch.items_in_flight
    return _run(
        [p.item for p in planned],
        spec_for,
        backend_from_args(args, specs[planned[0].item].slurm if planned else None),
        args,
        console,
    )


def is_batch(sources: Sequence[str], output: str) -> bool:
    """Several sources, a glob, or an output template make ``convert`` a batch."""
    return len(sources) > 1 or is_template(output) or any(GLOB_CHARS.search(split_pattern(s)[0]) for s in sources)


def convert_batch(patterns: Sequence[str], template: str, args: argparse.Namespace, console: Console) -> int:
    """Exit 0 when every item is converted (now or by an earlier run), 1 otherwise; 2 when the
    batch itself is refused before anything starts (colliding outputs, a pattern matching nothing)."""
    if getattr(args, "memory_report", None):
        raise SpecError(
            "--memory-report",
            "Expected --memory-report with one conversion; a batch reports each item's peak against its plan in its summary.",
        )
    listing = listing_options(args, template)
    if not is_template(template) and len(sources := expand_sources(patterns, bucket_lister(listing))) > 1:
        raise SpecError("output", several_sources_one_output(sources, template))
    items = batch_items(patterns, template, bucket_lister(listing))

    def spec_for(item: BatchItem) -> ConversionSpec:
        return spec_for_source(item.source, item.output, args)

    return _run(items, spec_for, backend_from_args(args, None), args, console)


def spec_for_file_stack(sources: list[str], output: str, args: argparse.Namespace) -> ConversionSpec:
    """One image from several sources along ``--stack-axis`` (docs/formats.md, "Files stacked
    into one image"): several datasets of one file are stacked inside it (``a.h5:/ch0,/ch1``);
    files, in the order given (each pattern's matches in natural order), are ``source.paths``; a
    single glob stays a glob in ``source.path``, expanded when the source is opened."""
    from .spec import parse_spec

    split = [split_source(s) for s in sources]
    datasets = list(dict.fromkeys(d for _, d in split))
    files = list(dict.fromkeys(f for f, _ in split))
    if len(files) == 1 and len(sources) > 1:  # datasets of one file: a stack inside it
        return spec_for_source(f"{files[0]}:{','.join(datasets)}", output, args)
    if len(datasets) > 1:
        raise SpecError(
            "source",
            f"Expected one dataset for every file stacked (each file holds one image of the stack). Got "
            f"{', '.join(repr(d) for d in datasets[:3])} instead: convert them apart, or stack them one dataset at a time.",
        )
    if len(sources) == 1:
        return spec_for_source(sources[0], output, args)
    paths = [path for _, path in expand_sources(sources, bucket_lister(listing_options(args, output)))]
    base: dict[str, Any] = {"source": {"paths": paths, "dataset": datasets[0]}, "output": {"path": output}}
    if getattr(args, "overwrite", False):
        base["output"]["overwrite"] = True
    return parse_spec(merge(base, spec_overrides(args)))


def is_file_stack(sources: Sequence[str], output: str, stack_axis: str | None) -> bool:
    """``--stack-axis`` with several sources, or a glob of files, and one plain output: one image
    stacked from them (``spec_for_file_stack``), not a batch."""
    if not stack_axis or is_template(output):
        return False
    return len(sources) > 1 or bool(GLOB_CHARS.search(split_pattern(sources[0])[0]))


def several_sources_one_output(sources: Sequence[tuple[str, str]], output: str) -> str:
    """Why several sources and one plain output path are refused, with the three things the user
    may have meant: one output per source (a template), one image stacking datasets of a file, or
    one image stacking the files (--stack-axis)."""
    files = list(dict.fromkeys(path for _, path in sources))
    datasets = [split_pattern(source)[1] for source, _ in sources]
    if len(files) == 1 and all(datasets):
        stacked = f"{files[0]}:{','.join(d for d in datasets if d)}"
    else:
        stacked = f"{files[0]}:/ch0,/ch1"
    names = ", ".join(repr(source) for source, _ in sources[:3]) + (", ..." if len(sources) > 3 else "")
    return (
        f"Expected one source for the output {output!r}, or an output template. Got {len(sources)} sources ({names}) "
        f"instead, and one output cannot hold them apart. Give a template such as "
        f"'{os.path.join(os.path.dirname(output), '{stem}.ome.zarr')}' for one output per file; or stack datasets of one "
        f"file into one image with one source: {stacked!r} (--stack-axis c|t); or stack the files into one image "
        f"along a new axis with --stack-axis t, c or z."
    )


def _run(
    items: Sequence[BatchItem],
    spec_for: Callable[[BatchItem], ConversionSpec],
    backend: Backend,
    args: argparse.Namespace,
    console: Console,
) -> int:
    """The batch's run, shown: its plan, a bar per item under an overall bar, the summary (or
    ``--json``), and its metrics (``--metrics-port``). Exit 0 when every item is converted."""
    # The plan's line and the results on stdout; the bars, each item's end and why an item was
    # refused or failed on stderr (issue 42).
    notes = make_console(stderr=True)
    progress = BatchProgress(notes, len(items)) if not (args.json or args.no_progress) else None

    def on_planned(summary: BatchSummary) -> None:
        if not args.json:
            _show_plan(summary, console)
        if progress:
            progress.planned(summary)

    hooks = BatchHooks(
        on_planned=on_planned,
        listeners=(lambda result: [progress.item_listener(result)]) if progress else (lambda result: ()),
        on_item=progress.item_done if progress else (lambda result: None),
    )
    metrics = _start_metrics(items, args)  # before planning: Prometheus's first scrapes find the target up
    try:
        specs: Callable[[BatchItem], ConversionSpec] = spec_for
        if metrics is not None and metrics.batch is not None:
            hooks, specs = metrics.batch.around(hooks), metrics.batch.planning(spec_for)
        with progress if progress else nullcontext():
            summary = run_batch(
                items,
                specs,
                backend,
                constants=constants_from_args(args),
                fail_fast=args.fail_fast,
                items_in_flight=getattr(args, "items_in_flight", None) or DEFAULT_ITEMS_IN_FLIGHT,
                hooks=hooks,
                metrics=metrics,
            )
        if metrics is not None and metrics.batch is not None:
            metrics.batch.finished(summary)
        if args.json:
            print(json.dumps(summary.to_dict(), indent=1, default=str), flush=True)
        else:
            console.print(batch_renderable(summary))
            if problems := batch_problems(summary):
                notes.print(problems, soft_wrap=True)  # one line each, for grep
        if metrics is not None:
            metrics.linger(args.metrics_linger)
    finally:
        if metrics is not None:
            metrics.close()
    return 0 if summary.ok else ExitCode.FAILED


def _start_metrics(items: Sequence[BatchItem], args: argparse.Namespace) -> MetricsExporter | None:
    """``--metrics-port``: the batch's items by state and its progress, and the job and worker
    series of the item running (docs/metrics.md, "Batches")."""
    if getattr(args, "metrics_port", None) is None:
        return None
    from .metrics.exporter import MetricsExporter

    return MetricsExporter.for_batch([item.output for item in items], args.metrics_port)


def _show_plan(summary: BatchSummary, console: Console) -> None:
    sizing = summary.sizing
    if sizing is None or sizing.job is None:
        console.print(_nothing_planned(summary))
        return
    plan = sizing.job.plan
    planned = [r for r in summary.results if r.job is not None]
    complete = sum(r.job is not None and r.job.complete for r in summary.results)
    head = f"[bold]batch[/bold]: {_items(len(summary.results))}, {len(planned)} planned"
    if complete == len(planned):
        console.print(f"{head}, every one already complete: no cluster to start.")
    else:
        done = f" ({complete} already complete)" if complete else ""
        console.print(
            f"{head}{done}; one cluster of {plan.workers} worker(s) x {plan.threads_per_worker} thread(s), "
            f"pod limit {plan.memory.pod_limit / MiB:.0f} MiB each, sized by {sizing.item.source}"
        )
    print_notices(summary.notices)


def _items(n: int) -> str:
    return f"{n} item{'s' if n != 1 else ''}"


def _nothing_planned(summary: BatchSummary) -> str:
    """Why no cluster was started, in counts of what the items are: "No item of 4 could be
    planned" was untrue where --fail-fast stopped after the first refusal."""
    if not summary.results:
        return "The batch has no items: nothing to do."
    counts = Counter(r.status for r in summary.results)
    said = {REFUSED: "refused", NOT_RUN: "not tried (--fail-fast stopped the batch)"}
    parts = [f"{counts[state]} {words}" for state, words in said.items() if counts[state]]
    others = len(summary.results) - sum(counts[state] for state in said)
    parts += [f"{others} other"] if others else []
    colour = "red" if counts[REFUSED] else "green"
    return f"[{colour}]No cluster started: of {len(summary.results)} item(s), {', '.join(parts)}.[/{colour}]"


def batch_renderable(summary: BatchSummary) -> Group:
    head = Table.grid(padding=(0, 2))
    head.add_column(style="bold")
    head.add_column()
    status = "Succeeded" if summary.ok else "Failed"
    head.add_row("status", f"[{'green' if summary.ok else 'red'}]{status}[/]")
    head.add_row(
        "items",
        ", ".join(
            f"{summary.count(s)} {s.lower()}" for s in (DONE, COMPLETE, REFUSED, FAILED, NOT_RUN) if summary.count(s)
        )
        + f" of {len(summary.results)}",
    )
    head.add_row("time", f"{summary.seconds:.2f} s, {summary.cluster_starts} cluster start(s)")
    head.add_row("in flight", f"{summary.items_in_flight} item(s) at once")
    table = Table(
        title="Items: the busiest worker's peak against the item's plan, or the larger plan of an item that ran beside it",
        title_justify="left",
        show_edge=False,
    )
    for column in (
        "item",
        "output",
        "outcome",
        "GB read",
        "seconds",
        "peak MiB",
        "plan MiB",
        "beside MiB",
        "peak/plan",
    ):
        table.add_column(column, justify="left" if column in ("item", "output", "outcome") else "right")
    for r in summary.results:
        d = r.to_dict()
        ratio = f"{r.peak_rss / r.peak_bound:.2f}" if r.peak_rss and r.peak_bound else ""
        table.add_row(
            r.item.source,
            r.item.output,
            Text(r.status, style=OUTCOME_STYLE[r.status]),
            f"{d['bytes_read'] / 1e9:.3f}",
            f"{d['seconds']:.2f}",
            f"{r.peak_rss / MiB:.0f}" if r.peak_rss else "",
            f"{r.predicted_peak / MiB:.0f}" if r.job else "",
            f"{r.peak_bound / MiB:.0f}" if r.peak_bound > r.predicted_peak else "",
            ratio,
        )
    return Group(head, Text(""), table)


def batch_problems(summary: BatchSummary) -> Group | None:
    """Why each item that was refused or failed did (stderr, below the table on stdout)."""
    problems = [
        Text(f"{r.item.source}: ({r.error.reason}) {shorten_quoted(str(r.error))}", style=OUTCOME_STYLE[r.status])
        for r in summary.results
        if r.error
    ]
    return Group(*problems) if problems else None


class BatchProgress:
    """An overall bar over the items, and one bar for each item running."""

    def __init__(self, console: Console, items: int):
        self.bar = Progress(
            TextColumn("[bold]{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("{task.fields[note]}"),
            TimeElapsedColumn(),
            TextColumn("eta"),
            TimeRemainingColumn(),
            console=console,
        )
        self.overall = self.bar.add_task("items", total=items, note="")
        self.running: dict[int, TaskID] = {}  # id(ItemResult) -> its bar

    def __enter__(self) -> "BatchProgress":
        self.bar.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self.bar.__exit__(None, None, None)

    def item_listener(self, result: ItemResult) -> Listener:
        task = self.running[id(result)] = self.bar.add_task(
            result.item.output, total=max(result.job.plan.n_tasks if result.job else 1, 1), note="slabs"
        )

        def listen(p: ProgressEvent) -> None:
            self.bar.update(task, completed=p.slabs_done, total=max(p.slabs_total, 1), note=f"slabs, {p.phase}")

        return listen

    def planned(self, summary: BatchSummary) -> None:
        """Items refused while planning are done with: said, and counted on the overall bar."""
        for result in summary.results:
            if result.status == REFUSED:
                self.item_done(result)

    def item_done(self, result: ItemResult) -> None:
        task = self.running.pop(id(result), None)
        if task is not None:
            self.bar.remove_task(task)
        self.bar.console.print(
            Text(f"{result.status:8} {result.item.source} -> {result.item.output}", style=OUTCOME_STYLE[result.status])
        )
        self.bar.advance(self.overall)
