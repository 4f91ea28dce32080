"""``h5ngff plan`` of a glob or with an output template: every item's plan, as ``convert`` would
make them, and the one cluster the largest plan sizes; nothing is started (docs/batch.md).

    h5ngff plan 'runs/*/*.h5:/data'                           # each file's plan, outputs beside them
    h5ngff plan 'runs/*/*.h5:/data' 'out/{parent}/{stem}.ome.zarr'
"""

from __future__ import annotations

import argparse
import json
import os

from rich.console import Console, Group
from rich.table import Table
from rich.text import Text

from .batch.items import GLOB_CHARS, BatchItem, batch_items, expand_sources, is_template, split_pattern
from .batch.listing import bucket_lister
from .batch.run import DEFAULT_ITEMS_IN_FLIGHT, REFUSED, BatchSummary, plan_batch
from .cliargs import backend_from_args, constants_from_args, listing_options, spec_for_source
from .console import make_console, print_notices, shorten_quoted
from .errors import ExitCode
from .spec import ConversionSpec
from .units import MiB

#: An item of a batch plan that was planned (``batch.run`` calls it NotRun: it has not run yet).
PLANNED = "Planned"


def is_batch_plan(source: str, output: str | None, stack_axis: str | None = None) -> bool:
    """A glob in the source's file part, or an output template, makes ``plan`` a batch's; with
    ``--stack-axis`` and no template a glob is one image stacked from its files."""
    if output is not None and is_template(output):
        return True
    return not stack_axis and bool(GLOB_CHARS.search(split_pattern(source)[0]))


def plan_items(source: str, output: str | None, listing: dict[str, str] | None = None) -> list[BatchItem]:
    """The items ``convert SOURCE OUTPUT`` would make; without OUTPUT each output goes beside its
    file, as a single plan's default does. A glob in a bucket is listed with ``listing``."""
    if output is not None:
        return batch_items([source], output, bucket_lister(listing))
    return [
        BatchItem(s, path, os.path.splitext(path)[0] + ".ome.zarr")
        for s, path in expand_sources([source], bucket_lister(listing))
    ]


def cmd_plan_batch(args: argparse.Namespace, console: Console) -> int:
    """Exit 0 when every item can be converted, 1 when one is refused (as ``convert`` would)."""
    items = plan_items(args.source, args.output, listing_options(args, args.output))

    def spec_for(item: BatchItem) -> ConversionSpec:
        return spec_for_source(item.source, item.output, args)

    summary = plan_batch(
        items,
        spec_for,
        backend_from_args(args, None),
        constants=constants_from_args(args),
        items_in_flight=getattr(args, "items_in_flight", None) or DEFAULT_ITEMS_IN_FLIGHT,
    )
    refused = summary.count(REFUSED)
    if args.json:
        print(json.dumps(_document(summary), indent=1, default=str))
    else:
        console.print(_renderable(summary))
        problems = [
            Text(f"{r.item.source}: ({r.error.reason}) {shorten_quoted(str(r.error))}", style="red")
            for r in summary.results
            if r.error
        ]
        if problems:
            make_console(stderr=True).print(Group(*problems), soft_wrap=True)
        print_notices(summary.notices)
    return ExitCode.FAILED if refused else 0


def _status(result) -> str:
    if result.status == REFUSED:
        return REFUSED
    return "Complete" if result.job is not None and result.job.complete else PLANNED


def _document(summary: BatchSummary) -> dict:
    cluster = summary.cluster_dict()
    return {
        "items": [
            {
                "source": r.item.source,
                "output": r.item.output,
                "status": _status(r),
                "reason": r.error.reason if r.error else None,
                "message": str(r.error) if r.error else None,
                "plan": r.job.plan.to_dict() if r.job else None,
            }
            for r in summary.results
        ],
        "cluster": None if cluster is None else {**cluster, "items_in_flight": summary.items_in_flight},
        "notices": summary.notices,
    }


def _renderable(summary: BatchSummary) -> Group:
    n = len(summary.results)
    sizing = summary.sizing.job.plan if summary.sizing and summary.sizing.job else None
    head = f"[bold]batch plan[/bold]: {n} item{'s' if n != 1 else ''}, {summary.count(REFUSED)} refused"
    if sizing is not None and summary.sizing is not None:
        head += (
            f"; one cluster of {sizing.workers} worker(s) x {sizing.threads_per_worker} thread(s), pod limit "
            f"{sizing.memory.pod_limit / MiB:.0f} MiB each, sized by {summary.sizing.item.source}; "
            f"{summary.items_in_flight} item(s) in flight"
        )
    table = Table(show_edge=False)
    for column in ("item", "output", "plan", "shape", "slabs", "peak MiB", "pod MiB"):
        table.add_column(column, justify="right" if column in ("slabs", "peak MiB", "pod MiB") else "left")
    for r in summary.results:
        plan = r.job.plan if r.job else None
        status = _status(r)
        table.add_row(
            r.item.source,
            r.item.output,
            Text(status, style="red" if status == REFUSED else "green"),
            f"{plan.dataset.shape} {plan.dtype}" if plan else "",
            f"{plan.n_tasks:,}" if plan else "",
            f"{plan.memory.predicted_peak / MiB:.0f}" if plan else "",
            f"{plan.memory.pod_limit / MiB:.0f}" if plan else "",
        )
    return Group(Text.from_markup(head), table)
