"""``h5ngff``: plan and run HDF5 -> OME-Zarr conversions with predictable memory."""

from __future__ import annotations

import argparse
import errno
import json
import logging
import os
import sys
from typing import TYPE_CHECKING

from rich.console import Console
from rich.markup import escape

from . import __version__
from .backends.interrupts import interrupted_exit, terminate_like_ctrl_c
from .cliargs import (
    SuggestingParser,
    add_backend_flags,
    add_spec_flags,
    backend_from_args,
    constants_from_args,
    merge,
    spec_for_source,
    spec_overrides,
)
from .clibatch import (
    add_batch_command,
    add_batch_flags,
    convert_batch,
    is_batch,
    is_file_stack,
    spec_for_file_stack,
)
from .clijob import add_job_commands
from .console import make_console, print_notices, print_warning, shorten_quoted
from .cliverify import add_verify_command
from .errors import ExitCode, H5ngffError, OutputConflictError, OutputError, exit_code_table
from .spec import ConversionSpec, SlurmSpec, parse_spec

if TYPE_CHECKING:
    from .engine.progress import Listener
    from .metrics.exporter import MetricsExporter
    from .runner import RunSummary

log = logging.getLogger("h5ngff")

DESCRIPTION = """\
Convert HDF5 datasets to OME-Zarr (NGFF 0.4/0.5) on Dask, with every worker's memory planned
before the run and measured after it.

  h5ngff plan in.h5:/volume/data                 show the plan: slabs, workers, memory per term
  h5ngff convert in.h5:/volume/data out.ome.zarr plan, convert on a local Dask cluster, report
  h5ngff run job.yaml                            run a ConversionJob manifest locally
  h5ngff verify out.ome.zarr                     check metadata and every chunk
  h5ngff sample sample.h5                        write a sample volume to try it on
  h5ngff demo                                    sample + plan + convert + memory report
"""

EPILOG_MAIN = f"""\
exit status (every command):
{exit_code_table()}
"""

EPILOG_PLAN = """\
examples:
  h5ngff plan scan.h5:/entry/data
  h5ngff plan scan.h5:/entry/data --memory-per-worker 1GiB --workers 4 --json
  h5ngff plan scan.h5:/data --chunks 64,64,64 --shards 256,256,256 --levels 3
  h5ngff plan job.yaml --kubernetes          # a ConversionJob manifest, planned as the operator would
  h5ngff plan 'runs/*/*.h5:/data' 'out/{parent}/{stem}.ome.zarr'   # every item of a batch, one cluster
"""

EPILOG_CONVERT = """\
examples:
  h5ngff convert scan.h5:/entry/data scan.ome.zarr
  h5ngff convert scan.h5:/data out.ome.zarr --chunks 64,64,64 --levels 3 --memory-per-worker 2GiB
  h5ngff convert scan.h5:/data out.ome.zarr --ngff-version 0.4 --compressor lz4:5:shuffle
  h5ngff convert scan.h5:/data out.ome.zarr --scheduler tcp://10.0.0.5:8786

Re-running the same command after a crash resumes: finished slabs are skipped and the result is
bit-identical. --overwrite starts fresh. One run writes an output at a time: a second run on the
same path fails OutputBusy, and --overwrite never deletes an output another run is writing.
Exit status: see h5ngff --help.
"""


def build_parser() -> argparse.ArgumentParser:
    parser = SuggestingParser(
        prog="h5ngff", description=DESCRIPTION, epilog=EPILOG_MAIN, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--version", action="version", version=f"h5ngff {__version__}")
    parser.add_argument("-v", "--verbose", action="count", default=0, help="More log output (-vv for debug).")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True

    p = sub.add_parser(
        "plan",
        help="Show the plan for a conversion (reads HDF5 metadata only).",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Plan a conversion and explain every MiB a worker needs. Reads only HDF5 metadata.",
        epilog=EPILOG_PLAN,
    )
    p.add_argument(
        "source",
        metavar="SOURCE",
        help="FILE.h5:/dataset, a ConversionJob YAML file, or a quoted glob ('runs/*/*.h5:/data'): every file's plan "
        "and the one cluster a batch would start (docs/batch.md).",
    )
    p.add_argument(
        "output",
        metavar="OUTPUT",
        nargs="?",
        help="Output path (only needed to show it; default beside the source), or a batch's template "
        "(out/{stem}.ome.zarr).",
    )
    _common_run_flags(p, convert=False)
    add_spec_flags(p)
    p.set_defaults(func=cmd_plan)

    c = sub.add_parser(
        "convert",
        help="Convert an HDF5 dataset to OME-Zarr.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Plan, start a Dask cluster sized by the plan, convert, and report time and memory.",
        epilog=EPILOG_CONVERT,
    )
    c.add_argument(
        "sources",
        nargs="+",
        metavar="SOURCE",
        help="FILE.h5:/dataset (e.g. in.h5:/volume/data), several to stack (in.h5:/ch{0..2}), an Imaris FILE.ims, or a BigDataViewer dataset.xml (docs/formats.md). Several, or a quoted glob ('runs/*/*.h5:/data'), make a batch (docs/batch.md).",
    )
    c.add_argument(
        "output",
        metavar="OUTPUT",
        help="Output directory, e.g. out.ome.zarr; for a batch a template: out/{stem}.ome.zarr ({stem}, {name}, {parent}).",
    )
    _common_run_flags(c, convert=True)
    add_batch_flags(c, "Batch: ")
    add_spec_flags(c)
    c.set_defaults(func=cmd_convert)

    s = sub.add_parser(
        "sample",
        help="Write a sample HDF5 volume that compresses like real data.",
        description="Write a sample HDF5 volume to try h5ngff on: smooth structure plus quantised sensor noise, so "
        "blosc and zstd compress it a few to one as they do real microscopy. Leading t and c axes repeat the volume "
        "with an offset. Refused (exit 2, nothing written) when a plane would not fit in memory or the file on the "
        "disk; the file is written under a temporary name and renamed when whole.",
        epilog="examples:\n  h5ngff sample in.h5\n  h5ngff sample in.h5 --shape 2,3,64,512,512 --dtype float32 "
        "--hdf5-chunks 1,1,32,128,128 --gzip",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    s.add_argument("path", help="HDF5 file to write.")
    s.add_argument("--dataset", default="/volume/data", help="Dataset path inside the file (default /volume/data).")
    s.add_argument("--shape", default="96,768,512", help="Comma-separated shape (2 to 5 dimensions).")
    s.add_argument(
        "--dtype", default="uint16", help="numpy dtype name: an integer, float or bool type, e.g. uint16, float32."
    )
    s.add_argument("--hdf5-chunks", metavar="SHAPE", help="Store chunked with this chunk shape (default contiguous).")
    s.add_argument(
        "--gzip",
        action="store_true",
        help="gzip-compress the dataset (chunked by --hdf5-chunks, else as h5py chooses).",
    )
    s.add_argument("--force", action="store_true", help="Replace an existing file at PATH (refused without it).")
    s.set_defaults(func=cmd_sample)

    d = sub.add_parser(
        "demo",
        help="Generate a sample, show its plan, convert it locally and write a memory report.",
        description="The main job end to end on this machine: write a sample HDF5 volume, print its memory plan, "
        "convert it on a local Dask cluster sized by the plan with a progress bar, print each worker's measured peak "
        "against the plan, and draw it in DIRECTORY/memory-report.png. Re-running it reuses the sample and converts "
        "it afresh.",
    )
    d.add_argument(
        "directory",
        nargs="?",
        default="h5ngff-demo",
        help="Where the sample, output and report go (default ./h5ngff-demo).",
    )
    d.add_argument(
        "--shape",
        default="96,1024,1024",
        help="Sample shape, 2 to 5 dimensions (default 96,1024,1024 uint16, 192 MiB).",
    )
    d.set_defaults(func=cmd_demo)
    add_job_commands(sub, _common_run_flags)
    add_batch_command(sub, _common_run_flags)
    add_verify_command(sub)
    p.add_argument(
        "--kubernetes",
        action="store_true",
        help="Plan as the operator would: workers auto = 4, no machine-memory budget.",
    )
    return parser


def _common_run_flags(p: argparse.ArgumentParser, convert: bool, memory_report: bool = True) -> None:
    p.add_argument("--json", action="store_true", help="Print one JSON object instead of tables.")
    add_backend_flags(p)
    p.add_argument("--calibration", metavar="FILE", help="JSON file overriding the memory model's measured constants.")
    if convert:
        p.add_argument(
            "--overwrite",
            action="store_true",
            help="Replace an existing h5ngff or Zarr output instead of resuming it (never one another run is writing).",
        )
        p.add_argument(
            "--scheduler",
            metavar="ADDRESS",
            help="Use an existing Dask cluster (tcp://host:8786) instead of starting one.",
        )
        p.add_argument(
            "--enforce-pod-limits",
            action="store_true",
            help="Run each worker in its own memory cgroup limited to the planned pod limit, as on Kubernetes.",
        )
        p.add_argument(
            "--pod-limit",
            metavar="SIZE",
            help="Override the planned pod limit (with --enforce-pod-limits; for experiments).",
        )
        if memory_report:  # one conversion's timeline: a batch reports each item against its plan instead
            p.add_argument(
                "--memory-report",
                metavar="FILE",
                help="Write a per-worker memory timeline with the planned limits drawn in: an interactive .html page, "
                "or an image (.png, .svg, .pdf, .jpg, .webp, .tif, .eps).",
            )
        p.add_argument(
            "--metrics-port",
            type=int,
            metavar="PORT",
            help="Serve Prometheus metrics on this port during the run (docs/metrics.md).",
        )
        p.add_argument(
            "--metrics-linger",
            type=float,
            default=0.0,
            metavar="SECONDS",
            help="With --metrics-port: keep serving the final values this long after the run, so Prometheus scrapes them.",
        )
        p.add_argument("--no-progress", action="store_true", help="No progress bar (logs only).")


def _source(args: argparse.Namespace) -> str:
    """The one SOURCE (``convert`` takes several, which make a batch, see ``cmd_convert``)."""
    sources = getattr(args, "sources", None)
    return sources[0] if sources else args.source


def spec_from_args(args: argparse.Namespace) -> ConversionSpec:
    from .job import is_manifest_path, load_job

    source = _source(args)
    if is_manifest_path(source):  # a ConversionJob manifest: its spec, under the flags
        base = load_job(source).spec.conversion().to_wire()
        if args.output:
            base["output"]["path"] = args.output
        return parse_spec(merge(base, spec_overrides(args)))
    return spec_for_source(source, args.output, args)


def cmd_plan(args: argparse.Namespace, console: Console) -> int:
    from .clibatchplan import cmd_plan_batch, is_batch_plan
    from .report import plan_renderable
    from .runner import plan_job

    if is_batch_plan(args.source, args.output, args.stack_axis):  # a glob or a template: every item's plan
        return cmd_plan_batch(args, console)
    spec = spec_from_args(args)
    backend = backend_from_args(args, _manifest_slurm(args))
    job = plan_job(spec, backend, constants_from_args(args))
    description = backend.describe(job.spec, job.plan)
    job.notices.extend(description.notices)
    script = description.job_script
    if args.json:
        document = {"plan": job.plan.to_dict(), "notices": job.notices, "spec": job.spec.to_wire()}
        if script is not None:
            from .report import slurm_job_dict

            document["slurm"] = slurm_job_dict(script)
        print(json.dumps(document, indent=1))
    else:
        console.print(plan_renderable(job, notices=False))
        if script is not None:
            from .report import slurm_job_renderable

            console.print(slurm_job_renderable(job.plan, script))
        print_notices(job.notices)
    return 0


def _manifest_slurm(args: argparse.Namespace) -> SlurmSpec | None:
    """The slurm: block of a ConversionJob manifest given as SOURCE, if any."""
    from .job import is_manifest_path, load_job

    source = _source(args)
    return load_job(source).spec.slurm if is_manifest_path(source) else None


def cmd_convert(args: argparse.Namespace, console: Console) -> int:
    if getattr(args, "memory_report", None):
        from .metrics.timeline import check_report_path

        check_report_path(args.memory_report)
    if is_file_stack(args.sources, args.output, args.stack_axis):  # one image from many files
        return convert_spec(spec_for_file_stack(args.sources, args.output, args), args, console)
    if is_batch(args.sources, args.output):
        return convert_batch(args.sources, args.output, args, console)
    spec = spec_from_args(args)
    return convert_spec(spec, args, console)


def _start_metrics(spec: ConversionSpec, args: argparse.Namespace) -> MetricsExporter | None:
    if getattr(args, "metrics_port", None) is None:
        return None
    from .metrics.exporter import MetricsExporter

    return MetricsExporter.for_spec(spec, args.metrics_port)


def convert_spec(spec: ConversionSpec, args: argparse.Namespace, console: Console) -> int:
    """``h5ngff convert``'s input and output around the run sequence (``runner.execute``)."""
    from .report import ProgressBar, plan_renderable, plan_summary_renderable, summary_renderable
    from .runner import Linger, PlannedJob, execute

    backend = backend_from_args(args, _manifest_slurm(args))
    constants = constants_from_args(args)
    metrics = _start_metrics(spec, args)  # before planning: Prometheus's first scrapes find the target up
    # The plan and the results on stdout, the bar on stderr (issue 42). The plan in two lines, or
    # every term with -v (and in the demo, whose point it is).
    notes = make_console(stderr=True)

    def show_plan(job: PlannedJob) -> None:
        if args.json:
            return
        if args.verbose or getattr(args, "full_plan", False):
            console.print(plan_renderable(job, notices=False))
        else:
            console.print(plan_summary_renderable(job, _source(args)), highlight=False, soft_wrap=True)
        print_notices(job.notices)

    bar: list[Listener] = [] if args.json or args.no_progress else [ProgressBar(notes)]
    try:
        summary = execute(
            spec, backend, bar, metrics, constants=constants, on_plan=show_plan, linger=Linger(args.metrics_linger)
        )
    except H5ngffError as exc:
        # A failed run's memory timeline is the one a user most needs to see.
        if args.memory_report and exc.summary is not None and exc.summary.timeline:
            _write_memory_report(exc.summary, args.memory_report, console)
        raise
    reported = _write_memory_report(summary, args.memory_report) if args.memory_report else False
    if args.json:
        print(json.dumps(summary.to_dict(), indent=1, default=str))
    else:
        console.print(summary_renderable(summary))
        if reported:
            console.print(f"memory report: {args.memory_report}")
    return 0


def _write_memory_report(summary: RunSummary, path: str, console: Console | None = None) -> bool:
    """Write the report, or warn (``timeline.report_failure``); whether it was written."""
    from .metrics.timeline import report_failure

    failure = report_failure(summary, path)
    if failure is not None:
        print_warning(failure)
        return False
    if console is not None:
        console.print(f"memory report of the failed run: {path}")
    return True


def cmd_sample(args: argparse.Namespace, console: Console) -> int:
    from .sample import check_chunks, check_dtype, parse_shape, write_sample

    # Checked before anything is written (exit 2); write_sample renames a whole file into place.
    shape = parse_shape(args.shape)
    check_dtype(args.dtype)
    chunks = parse_shape(args.hdf5_chunks, "--hdf5-chunks") if args.hdf5_chunks else None
    check_chunks(chunks, shape)
    if os.path.isdir(args.path):
        raise OutputConflictError(f"{args.path!r} is a directory. Name the HDF5 file to write.")
    if os.path.lexists(args.path) and not args.force:
        raise OutputConflictError(f"{args.path!r} exists. Pass --force to replace it, or choose another path.")
    write_sample(args.path, args.dataset, shape, args.dtype, chunks=chunks, compression="gzip" if args.gzip else None)
    console.print(f"wrote {args.path}:{args.dataset} shape {shape} {args.dtype}")
    return 0


def cmd_demo(args: argparse.Namespace, console: Console) -> int:
    from .sample import parse_shape, write_sample

    shape = parse_shape(args.shape)  # before the directory is made: a refused shape writes nothing
    try:
        os.makedirs(args.directory, exist_ok=True)
        if not os.access(args.directory, os.W_OK | os.X_OK):
            raise PermissionError(errno.EACCES, "permission denied")
    except OSError as exc:
        raise OutputError(
            f"demo: cannot use {args.directory!r} as the demo's directory ({exc.strerror or exc}). Choose a writable directory."
        ) from None
    source = os.path.join(args.directory, "sample.h5")
    if not os.path.exists(source):
        console.print(f"[bold]1. sample[/bold]: writing {source} {shape} uint16")
        # Voxel sizes for the spatial axes only (z, y, x): leading t and c axes have none.
        write_sample(
            source,
            "/volume/data",
            shape,
            "uint16",
            element_size_um=(2.0, 0.5, 0.5)[-min(len(shape), 3) :] if len(shape) <= 3 else None,
        )
    parser = build_parser()
    output = os.path.join(args.directory, "sample.ome.zarr")
    report = os.path.join(args.directory, "memory-report.png")
    console.print(
        f"[bold]2. plan and convert[/bold]: h5ngff convert {source}:/volume/data {output} --overwrite --memory-report {report}"
    )
    convert_args = parser.parse_args(
        ["convert", f"{source}:/volume/data", output, "--overwrite", "--memory-report", report]
    )
    convert_args.full_plan = True  # the demo is there to show the plan, term by term
    return cmd_convert(convert_args, console)


class IgnoredBroadcastFailures(logging.Filter):
    """Drops the scheduler's "broadcast to ADDR failed" errors. h5ngff's own calls on every
    worker (the memory poll every 0.5 s, the final figures) ask Dask to ignore a worker that is
    gone, and Dask logs each one as an ERROR all the same: on a run the kernel kills, those lines
    came before the one that says what happened. ``-v`` shows them."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("broadcast to ")


def quiet_dask_logs(verbose: int) -> None:
    """Dask's logs at the CLI's verbosity: errors only by default, warnings with -v, info with -vv."""
    logging.getLogger("distributed").setLevel([logging.ERROR, logging.WARNING, logging.INFO][min(verbose, 2)])
    scheduler = logging.getLogger("distributed.scheduler")
    for old in [f for f in scheduler.filters if isinstance(f, IgnoredBroadcastFailures)]:
        scheduler.removeFilter(old)
    if not verbose:
        scheduler.addFilter(IgnoredBroadcastFailures())


def main(argv: list[str] | None = None) -> int:
    try:
        terminate_like_ctrl_c()  # first: a SIGTERM during the imports and the planning is a clean exit too
        args = build_parser().parse_args(argv)
        logging.basicConfig(
            level=[logging.WARNING, logging.INFO, logging.DEBUG][min(args.verbose, 2)],
            format="%(levelname)s %(name)s: %(message)s",
        )
        # Dask logs every worker start and stop at INFO; the progress bar says what matters. Import
        # distributed first: importing it installs its own logging config, which would undo ours.
        import distributed  # noqa: F401

        quiet_dask_logs(args.verbose)
        code = _dispatch(args)
        sys.stdout.flush()  # inside the try: a reader that went away (| head) is seen here
        return code
    except BrokenPipeError:
        return _stdout_closed()
    except KeyboardInterrupt as exc:
        what, code = interrupted_exit(exc)
        Console(stderr=True).print(f"[yellow]{what}[/yellow]: re-run the same command to resume.")
        return code


def _dispatch(args: argparse.Namespace) -> int:
    as_json = bool(getattr(args, "json", False))
    # Tables go to stdout (stderr with --json, whose stdout is one JSON document); errors and the
    # interrupt notice always go to stderr, so pipes and 2>/dev/null see only the output.
    console = make_console(stderr=as_json)
    errors = Console(stderr=True)
    try:
        return args.func(args, console)
    except H5ngffError as exc:
        code = _exit_code(exc)
        if not as_json:
            # soft_wrap: one line per message, so grep and logs see it whole. Escaped: a message
            # quoting "[profile x]" or a list must not be read as rich markup and vanish.
            message = shorten_quoted(str(exc))
            errors.print(f"[red]error[/red] ({exc.reason}): {escape(message)}", highlight=False, soft_wrap=True)
        elif exc.summary is not None:
            # The failed run's figures (per-worker peaks, cgroup peaks, OOM kills, restarts) too.
            print(json.dumps(exc.summary.to_dict(), indent=1, default=str))
        else:
            print(json.dumps({"status": "Failed", "reason": exc.reason, "message": str(exc)}))
        return code
    except (KeyboardInterrupt, BrokenPipeError, SystemExit):
        raise
    except Exception as exc:  # noqa: BLE001 - a bug of ours: one clear line and exit 1, not a traceback
        return _internal_error(exc, as_json, errors, bool(getattr(args, "verbose", 0)))


def _internal_error(exc: Exception, as_json: bool, errors: Console, verbose: bool) -> int:
    """An exception h5ngff did not expect (a bug, not bad input): say so in one line with what to
    do, keep the traceback for -v, and exit 1 like any failed run (--json still gets its document).
    An output it was writing is left as a partial output that the same command resumes."""
    what = f"{type(exc).__name__}: {exc}"
    message = (
        f"h5ngff stopped on an unexpected error, a bug in h5ngff rather than in your input ({what}). "
        f"Re-run with -v for the traceback and report it with the command that failed; an output it was "
        f"writing is kept, and the same command resumes it once fixed."
    )
    if verbose:
        import traceback

        traceback.print_exception(exc, file=sys.stderr)
    if as_json:
        print(json.dumps({"status": "Failed", "reason": "InternalError", "message": message}))
    else:
        errors.print(f"[red]error[/red] (InternalError): {escape(message)}", highlight=False, soft_wrap=True)
    return int(ExitCode.FAILED)


def _exit_code(exc: H5ngffError) -> int:
    """The error's exit status, except that 2 and 3 promise that nothing was written (changed):
    an error of those kinds raised after the run had begun writing the output (a source chunk
    that proves corrupt mid-run, an output that stops being writable) is a failed run, exit 1,
    whose partial output a re-run resumes."""
    summary = exc.summary
    if (
        exc.exit_code in (ExitCode.BAD_INPUT, ExitCode.OUTPUT_REFUSED)
        and summary is not None
        and summary.totals is not None
    ):
        return ExitCode.FAILED
    return exc.exit_code


def _stdout_closed() -> int:
    """The reader of stdout went away (``| head``): stop quietly, as Unix tools do. Point stdout
    at /dev/null so the interpreter's final flush does not raise again."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    return ExitCode.BROKEN_PIPE


if __name__ == "__main__":
    sys.exit(main())
