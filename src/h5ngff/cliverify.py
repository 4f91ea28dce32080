"""``h5ngff verify OUTPUT [--source SOURCE]``: SOURCE as convert names it (docs/formats.md)."""

from __future__ import annotations

import argparse
import glob
import json
import os

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TaskProgressColumn, TextColumn, TimeRemainingColumn
from rich.table import Table

from .batch.items import GLOB_CHARS, is_template
from .cliargs import (
    add_source_storage_option_flag,
    add_storage_option_flag,
    parse_source_storage_options,
    parse_storage_options,
    split_source,
)
from .console import make_console
from .spec import parse_output_path, url_scheme
from .errors import OutputNotFoundError, SpecError

EPILOG = """\
Checks that the OME-NGFF metadata is present, that the completion marker is set, that every chunk
(or shard) of every level decodes and matches its CRC32C (NGFF 0.5: the crc32c codec; 0.4: the
0/.h5ngff-checksums sidecar; both unless converted with --no-checksums), all read through
zarr-python rather than h5ngff's writer, and with --source that EVERY level equals the pyramid
computed from the HDF5 dataset (same downsampling, rounding and edge rule as the writer), one chunk
at a time: memory stays bounded (docs/engine.md). Exit status 0: all good; 1: problems found (each
bad chunk is named with its level, chunk index and voxel ranges); 2: the output does not exist, or
the source cannot be read as convert would read it.
"""


def add_verify_command(sub) -> None:
    v = sub.add_parser(
        "verify",
        help="Check an output's metadata, completion marker and every chunk.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    v.add_argument(
        "output",
        metavar="OUTPUT",
        help="An OME-Zarr written by h5ngff; a quoted glob of them ('out/*.ome.zarr'); or, with --source 'runs/*.h5:/data', "
        "the template convert wrote them with ('out/{stem}.ome.zarr'), each compared with its own source.",
    )
    v.add_argument(
        "--source",
        metavar="SOURCE",
        help="Also compare every level with the pyramid computed from this source, named as for convert: "
        "FILE.h5:/dataset, FILE.h5:/ch{0..2} (stacked), cells.ims (Imaris) or dataset.xml (BigDataViewer).",
    )
    v.add_argument("--json", action="store_true", help="Print the report as one JSON object.")
    add_storage_option_flag(v)
    add_source_storage_option_flag(v)
    v.set_defaults(func=cmd_verify)


def cmd_verify(args: argparse.Namespace, console: Console) -> int:
    from .engine.verify.check import verify_output  # zarr and h5py load only when needed

    options = parse_storage_options(args.storage_option)
    # A bucket source's options: its own flag's, else (in verify_output) an s3:// output's.
    given = getattr(args, "source_storage_option", None)
    source_options = parse_source_storage_options(given) if given else None
    if is_template(args.output) or (url_scheme(args.output) is None and GLOB_CHARS.search(args.output)):
        return _verify_many(args, console, options, source_options)
    source = _checked_inputs(args.output, args.source, options, source_options)
    if args.json:
        report = verify_output(args.output, source, storage_options=options, source_options=source_options)
        print(json.dumps(report.to_dict(), indent=1))
        return 0 if report.ok else 1
    # On stderr, and gone when done: the report is the result, and an output found broken before
    # its first chunk (not a Zarr group) left a half-drawn bar above it.
    with Progress(
        TextColumn("verify"),
        BarColumn(),
        TaskProgressColumn(),
        TimeRemainingColumn(),
        console=make_console(stderr=True),
        transient=True,
    ) as bar:
        task = bar.add_task("verify", total=None)
        report = verify_output(
            args.output,
            source,
            on_unit=lambda: bar.advance(task),
            on_total=lambda n: bar.update(task, total=n),
            storage_options=options,
            source_options=source_options,
        )
    checked = f"{report.units_checked} chunk/shard files in {report.levels} level(s), checksums: {report.checksums}"
    if report.ok:
        equal = (
            f", all {report.levels_compared} level(s) equal to the pyramid computed from the source"
            if report.compared_with_source
            else ""
        )
        console.print(f"[green]ok[/green]: {args.output}: {checked}, complete{equal}.")
        return 0
    console.print(f"[red]problems[/red] in {args.output} ({checked}):")
    for problem in report.problems[:50]:
        console.print(f"  - {problem}", highlight=False)
    if len(report.problems) > 50:
        console.print(f"  … and {len(report.problems) - 50} more (use --json for all).")
    return 1


def _many(output: str, source: str | None, source_options: dict[str, str] | None) -> list[tuple[str, str | None]]:
    """(output, source) pairs: a template's outputs with the sources ``--source`` matches, as
    ``convert SOURCE TEMPLATE`` wrote them; or the outputs a glob matches, without sources."""
    from .batch.items import batch_items
    from .batch.listing import bucket_lister

    if is_template(output):
        if source is None:
            raise SpecError(
                "--source",
                f"Expected --source with the pattern the template {output!r} was filled from (e.g. "
                f"--source 'runs/*.h5:/data'), or a glob of outputs (out/*.ome.zarr) to check without sources.",
            )
        return [(item.output, item.source) for item in batch_items([source], output, bucket_lister(source_options))]
    if source is not None:
        raise SpecError(
            "OUTPUT",
            f"Expected the output template that wrote the outputs (e.g. 'out/{{stem}}.ome.zarr') with --source, so each "
            f"output is compared with its own source. Got the glob {output!r} instead.",
        )
    outputs = sorted(glob.glob(output, recursive=True))
    if not outputs:
        raise OutputNotFoundError(
            f"{output!r} matches no output (from {os.getcwd()!r}). Check the pattern and its quoting."
        )
    return [(path, None) for path in outputs]


def _verify_many(
    args: argparse.Namespace, console: Console, options: dict[str, str], source_options: dict[str, str] | None
) -> int:
    """Every output of a template or a glob, one after the other; exit 0 when all are good."""
    from .engine.verify.check import verify_output

    pairs = _many(args.output, args.source, source_options)
    rows: list[dict] = []
    with Progress(
        TextColumn("verify"), BarColumn(), MofNCompleteColumn(), console=make_console(stderr=True), transient=True
    ) as bar:
        task = bar.add_task("verify", total=len(pairs))
        for output, source in pairs:
            if not os.path.exists(output) and url_scheme(output) is None:
                rows.append({"path": output, "source": source, "ok": False, "problems": ["does not exist"]})
            else:
                split = split_source(source) if source else None
                report = verify_output(output, split, storage_options=options, source_options=source_options)
                rows.append({**report.to_dict(), "source": source})
            bar.advance(task)
    ok = all(row["ok"] for row in rows)
    if args.json:
        print(json.dumps({"ok": ok, "outputs": rows}, indent=1))
        return 0 if ok else 1
    table = Table(show_edge=False)
    for column in ("output", "source", "result"):
        table.add_column(column)
    for row in rows:
        table.add_row(row["path"], row["source"] or "", "[green]ok[/green]" if row["ok"] else "[red]problems[/red]")
    console.print(table)
    for row in rows:
        for problem in row["problems"][:10]:
            console.print(f"  - {row['path']}: {problem}", highlight=False, soft_wrap=True)
    bad = sum(not row["ok"] for row in rows)
    console.print(f"{len(rows) - bad} of {len(rows)} output(s) ok" + (f", {bad} with problems." if bad else "."))
    return 0 if ok else 1


def _checked_inputs(
    output: str,
    source_text: str | None,
    options: dict[str, str] | None = None,
    source_options: dict[str, str] | None = None,
) -> tuple[str, str] | None:
    """Refuse a missing output or an unreadable source up front, with convert's own source
    errors (not a traceback from deep inside the comparison)."""
    if url_scheme(output) is not None:
        _check_object_output(output, options or {})
    elif not os.path.exists(output):
        raise OutputNotFoundError(f"{output!r} does not exist. Expected the path of an OME-Zarr that h5ngff wrote.")
    if source_text is None:
        return None
    from .engine.sources import verify_source
    from .engine.stores import open_object_reader
    from .spec import source_options_from_output

    path, dataset = split_source(source_text)
    if source_options is None:
        source_options = source_options_from_output(output, options)
    # Metadata only, through the sources layer convert uses: a plain dataset, a stacked selection,
    # an Imaris file or a BigDataViewer XML/HDF5 pair; the output's recorded choices (stack axes,
    # BDV tile) apply as verify_output applies them.
    verify_source(path, dataset, _recorded_source(output, options or {}), open_object_reader, source_options)
    return path, dataset


def _recorded_source(output: str, options: dict[str, str]) -> dict | None:
    """The source spec the output records (``h5ngff.source``), or None where there is none to
    read: verify_output reports an unreadable output itself."""
    try:
        import zarr

        from .engine.verify.check import zarr_root

        attrs = dict(zarr.open_group(zarr_root(output, options), mode="r").attrs)
    except Exception:  # not a Zarr group, or unreadable: verify_output names the problem
        return None
    marker = attrs.get("h5ngff")
    recorded = marker.get("source") if isinstance(marker, dict) else None
    return recorded if isinstance(recorded, dict) else None


def _check_object_output(url: str, options: dict[str, str]) -> None:
    """An s3:// output must have a scheme we know and hold at least one object."""
    from .engine.stores import open_store
    from .errors import SpecError

    try:
        parse_output_path(url)
    except ValueError as exc:
        raise SpecError("OUTPUT", str(exc)) from None
    if not open_store(url, options).list(""):
        raise OutputNotFoundError(f"{url!r} holds no objects. Expected the URL of an OME-Zarr that h5ngff wrote.")
