"""Command-line flags as ConversionSpec fields: one table, so ``plan`` and ``convert`` share them
and every flag lands in exactly one spec field."""

from __future__ import annotations

import argparse
import difflib
import os
import re
from typing import TYPE_CHECKING, Any, Callable

from .errors import SpecError
from .patches import deep_merge
from .codecs_table import BLOSC_CNAMES, CODECS

if TYPE_CHECKING:
    from .backends.base import Backend
    from .backends.factory import BackendOptions
    from .spec import ConversionSpec, SlurmSpec

#: The codecs the CLI names on their own (plain-zstd, gzip, none), by their CLI name.
_BY_CLI_NAME = {c.cli_name: c for c in CODECS.values() if c.cli_name is not None}
COMPRESSOR_HELP = (
    f"CODEC[:LEVEL[:SHUFFLE]]. Blosc with an inner codec: {', '.join(BLOSC_CNAMES)} "
    "(e.g. zstd:5:bitshuffle, the default; lz4:3:shuffle; optionally prefixed blosc:); "
    + "; ".join(name if c.levels is None else f"{name}:LEVEL" for name, c in _BY_CLI_NAME.items())
    + "."
)


class SuggestingParser(argparse.ArgumentParser):
    """Unknown flags are reported by the subcommand they were given to, with its usage and the
    closest flag it knows. Plain argparse reports them from the top-level parser, whose usage
    shows none of the subcommand's flags, and suggests nothing."""

    def parse_args(self, args=None, namespace=None):  # type: ignore[override]
        parsed, extras = self.parse_known_args(args, namespace)
        if extras:
            parser = self._chosen_subcommand(parsed) or self
            parser.error(unrecognized_message(extras, parser))
        return parsed

    def parse_known_args(self, args=None, namespace=None):  # type: ignore[override]
        import sys

        return super().parse_known_args(join_negative_lists(sys.argv[1:] if args is None else list(args)), namespace)

    def error(self, message: str):  # type: ignore[override]
        """A mistyped command gets the closest command, and the listing names only the commands
        ``--help`` shows (not the hidden ``runner``)."""
        match = re.match(r"argument (\S+): invalid choice: '([^']*)'", message)
        subparsers = self._subparsers_action()
        if match and subparsers is not None and match.group(1) in (subparsers.metavar, subparsers.dest):
            visible = [action.dest for action in subparsers._choices_actions]
            close = difflib.get_close_matches(match.group(2), visible, n=1, cutoff=0.5)
            hint = f"; did you mean {close[0]}?" if close else ""
            message = f"argument {match.group(1)}: invalid choice: {match.group(2)!r} (choose from {', '.join(visible)}){hint}"
        super().error(message)

    def _subparsers_action(self) -> argparse._SubParsersAction | None:
        for action in self._actions:
            if isinstance(action, argparse._SubParsersAction):
                return action
        return None

    def _chosen_subcommand(self, parsed: argparse.Namespace) -> argparse.ArgumentParser | None:
        for action in self._actions:
            if isinstance(action, argparse._SubParsersAction):
                chosen = getattr(parsed, action.dest, None)
                return None if chosen is None else action.choices.get(chosen)
        return None


#: Flags whose value is a comma-separated list of numbers: a value starting with '-' (-1,64,64)
#: is theirs, not an option, so the spec can refuse it with its own message. argparse takes
#: only a lone negative number (-1) for a value, and answers "expected one argument" otherwise.
NUMBER_LIST_FLAGS = frozenset({"--chunks", "--shards", "--slab", "--scale", "--shape", "--hdf5-chunks"})
_NEGATIVE_LIST = re.compile(r"^-[0-9.]")


def join_negative_lists(argv: list[str]) -> list[str]:
    """``--chunks -1,64,64`` -> ``--chunks=-1,64,64`` for the NUMBER_LIST_FLAGS (not after ``--``)."""
    out: list[str] = []
    i = 0
    while i < len(argv):
        arg = argv[i]
        if arg == "--":
            return out + argv[i:]
        if arg in NUMBER_LIST_FLAGS and i + 1 < len(argv) and _NEGATIVE_LIST.match(argv[i + 1]):
            out.append(f"{arg}={argv[i + 1]}")
            i += 2
            continue
        out.append(arg)
        i += 1
    return out


def unrecognized_message(extras: list[str], parser: argparse.ArgumentParser) -> str:
    """argparse's message, plus the closest known flag for each unknown one (difflib)."""
    known = [s for action in parser._actions for s in action.option_strings if s.startswith("--")]
    hints = []
    for arg in extras:
        if arg.startswith("-"):
            close = difflib.get_close_matches(arg.split("=", 1)[0], known, n=1, cutoff=0.6)
            hints += [f"did you mean {close[0]}?"] if close else []
    return f"unrecognized arguments: {' '.join(extras)}" + (f" ({'; '.join(hints)})" if hints else "")


def split_source(text: str) -> tuple[str, str]:
    """``in.h5:/volume/data`` -> (file, dataset). The dataset is after the last ':' that starts a path;
    a file alone (``scan.ims``, ``dataset.xml``) is ``/``, the whole container. A URL's own
    ``scheme://`` is never that ':' (``s3://bucket/scan.h5:/data``)."""
    from .spec import url_scheme

    scheme = len(text.partition("://")[0]) + 3 if url_scheme(text) else 0
    head, sep, tail = text[scheme:].rpartition(":")
    head = text[:scheme] + head if sep else head
    if _whole_container(text):
        # A whole container (file.ims, dataset.xml): its reader finds the image (docs/formats.md).
        return text, "/"
    # "in.h5:" or "in.h5:/" would name the root group, which is never an image.
    if not sep or not head or not tail.strip("/"):
        raise SpecError("source", f"Expected FILE.h5:/dataset, e.g. in.h5:/volume/data. Got {text!r} instead.")
    return head, tail if tail.startswith("/") else "/" + tail


def _whole_container(text: str) -> bool:
    """An Imaris file, a BigDataViewer XML, or a BigDataViewer HDF5 file with its XML beside it."""
    lower = text.lower()
    if lower.endswith((".ims", ".xml")):
        return True
    from .spec import url_scheme

    # In a bucket, a BigDataViewer pair is named by its XML (nothing is listed to find it).
    local = url_scheme(text) is None
    return local and lower.endswith((".h5", ".hdf5")) and os.path.exists(os.path.splitext(text)[0] + ".xml")


def _ints(text: str, field: str) -> list[int]:
    try:
        return [int(v) for v in text.replace("x", ",").split(",") if v.strip()]
    except ValueError:
        raise SpecError(field, f"Expected comma-separated integers, e.g. 64,64,64. Got {text!r} instead.") from None


def _floats(text: str, field: str) -> list[float]:
    try:
        return [float(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise SpecError(field, f"Expected comma-separated numbers, e.g. 2.0,0.5,0.5. Got {text!r} instead.") from None


def _int_or_auto(text: str, field: str) -> int | str:
    if text == "auto":
        return text
    try:
        return int(text)
    except ValueError:
        raise SpecError(field, f"Expected an integer or 'auto'. Got {text!r} instead.") from None


def parse_compressor(text: str) -> dict[str, Any]:
    """``zstd:5:bitshuffle`` -> the output.compressor fields; ``blosc:`` may prefix a Blosc codec."""
    parts = text.strip().lower().split(":")
    explicit_blosc = parts[0] == "blosc" and len(parts) > 1
    name, rest = (parts[1], parts[2:]) if explicit_blosc else (parts[0], parts[1:])
    try:
        level = int(rest[0]) if rest and rest[0] else None
    except ValueError:
        raise SpecError(
            "output.compressor", f"Expected {COMPRESSOR_HELP} Got {text!r} instead (the level must be an integer)."
        ) from None
    own = None if explicit_blosc else _BY_CLI_NAME.get(name)
    if own is not None:
        if own.levels is None and not rest:
            return {"codec": own.name}
        if own.levels is not None and len(rest) <= 1:
            return {"codec": own.name, "clevel": level}
    if name in BLOSC_CNAMES and len(rest) <= 2:
        spec: dict[str, Any] = {"codec": "blosc", "cname": name, "clevel": level}
        if len(rest) == 2 and rest[1]:
            spec["shuffle"] = rest[1]
        return spec
    raise SpecError("output.compressor", f"Expected {COMPRESSOR_HELP} Got {text!r} instead.")


def _units(text: str, axes: str | None) -> list[str]:
    values = [v.strip() for v in text.split(",")]
    if len(values) == 1 and axes:
        # One unit names the spatial axes' unit; time and channel axes get none.
        return [values[0] if a in "zyx" else "" for a in axes]
    return values


def add_spec_flags(parser: argparse.ArgumentParser) -> None:
    """Flags shared by ``plan`` and ``convert``; each maps to one ConversionSpec field."""
    out = parser.add_argument_group("output")
    out.add_argument(
        "--chunks",
        metavar="Z,Y,X",
        help="Chunk shape, one entry per axis (default 64 per spatial axis in 3-D, 256 in 2-D, 1 for t/c).",
    )
    out.add_argument(
        "--shards", metavar="Z,Y,X", help="Shard shape, a multiple of --chunks (NGFF 0.5 only): fewer, larger files."
    )
    out.add_argument("--compressor", metavar="SPEC", help=COMPRESSOR_HELP)
    out.add_argument(
        "--ngff-version", choices=["0.4", "0.5"], help="0.5 = Zarr v3 (default); 0.4 = Zarr v2 for older viewers."
    )
    add_storage_option_flag(out)
    add_source_storage_option_flag(out)
    out.add_argument(
        "--no-checksums",
        dest="checksums",
        action="store_const",
        const=False,
        help="Write no CRC32C per chunk (default: the Zarr v3 crc32c codec for 0.5, a sidecar for 0.4; verify checks them).",
    )
    img = parser.add_argument_group("image metadata")
    img.add_argument(
        "--axes", help="Axis names, e.g. tczyx. Default: from HDF5 dimension labels, else by number of dimensions."
    )
    img.add_argument(
        "--scale", metavar="S,S,S", help="Voxel size per axis. Default: element_size_um attribute, else 1."
    )
    img.add_argument(
        "--units", metavar="UNIT[,UNIT…]", help="Unit per axis, or one unit for all spatial axes (e.g. micrometer)."
    )
    img.add_argument("--name", help="Image name in the multiscales metadata.")
    pyr = parser.add_argument_group("pyramid")
    pyr.add_argument(
        "--levels",
        metavar="N|auto",
        help="Resolution levels including full resolution (default auto: halve until one chunk holds the smallest).",
    )
    pyr.add_argument(
        "--downsample", choices=["mean", "nearest", "max"], help="Downsampling method (default mean, exact)."
    )
    pyr.add_argument(
        "--downsample-axes",
        metavar="AXES",
        help="Axes to downsample at every level, e.g. yx (default: the spatial axes, each level halving those finer than the coarsest voxel size, all of them once equal).",
    )
    fmt = parser.add_argument_group("source formats (docs/formats.md)")
    fmt.add_argument(
        "--stack-axis",
        metavar="c|t|tc|z",
        help="New axes for several stacked datasets of one file (FILE:/ch{0..2}, a list or a glob; default c), or "
        "the one new axis (t, c or z) of one image stacked from several files: 'run/t*.h5:/data' or a list, with a "
        "plain output path (docs/formats.md).",
    )
    fmt.add_argument(
        "--tile", type=int, metavar="N", help="BigDataViewer: convert this tile (when the file holds several)."
    )
    fmt.add_argument(
        "--angle", type=int, metavar="N", help="BigDataViewer: convert this angle (when the file holds several)."
    )
    fmt.add_argument(
        "--illumination",
        type=int,
        metavar="N",
        help="BigDataViewer: convert this illumination (when the file holds several).",
    )
    res = parser.add_argument_group("resources")
    res.add_argument("--workers", metavar="N|auto", help="Dask worker processes (default auto: one per core).")
    res.add_argument("--threads", type=int, metavar="N", help="Threads per worker (default 1); each runs one slab.")
    res.add_argument(
        "--memory-per-worker",
        metavar="SIZE",
        help="Memory budget per worker, e.g. 1GiB: the planner sizes the slabs to fit it and sets each worker's pod "
        "limit to what the plan needs, at most this (so 1GiB may well give a 250Mi pod; h5ngff plan shows it).",
    )
    res.add_argument(
        "--memory-total", metavar="SIZE", help="Memory for all workers together; the planner picks the worker count."
    )
    res.add_argument(
        "--slab", metavar="Z,Y,X", help="Read slab shape (re-aligned to the chunk grid with a notice if needed)."
    )
    res.add_argument(
        "--allocator",
        choices=["auto", "jemalloc", "glibc"],
        help="Worker malloc (default auto: jemalloc where installed).",
    )


def _same(text: str, field: str) -> str:
    return text


def _compressor(text: str, field: str) -> dict[str, Any]:
    return {k: v for k, v in parse_compressor(text).items() if v is not None}


#: Each flag (argparse dest) and the one spec field it sets, with its parser.
FLAG_FIELDS: tuple[tuple[str, str, Any], ...] = (
    ("stack_axis", "source.stack", _same),
    ("tile", "source.tile", None),
    ("angle", "source.angle", None),
    ("illumination", "source.illumination", None),
    ("chunks", "output.chunks", _ints),
    ("shards", "output.shards", _ints),
    ("compressor", "output.compressor", _compressor),
    ("ngff_version", "output.ngffVersion", _same),
    ("checksums", "output.checksums", None),
    ("axes", "image.axes", _same),
    ("scale", "image.scale", _floats),
    ("units", "image.units", None),  # needs --axes too: see spec_overrides
    ("name", "image.name", _same),
    ("levels", "pyramid.levels", _int_or_auto),
    ("downsample", "pyramid.method", _same),
    ("downsample_axes", "pyramid.axes", _same),
    ("workers", "resources.workers", _int_or_auto),
    ("threads", "resources.threadsPerWorker", None),
    ("memory_per_worker", "resources.memoryPerWorker", _same),
    ("memory_total", "resources.memoryTotal", _same),
    ("slab", "resources.slab", _ints),
    ("allocator", "resources.allocator", _same),
)


def add_storage_option_flag(group) -> None:
    group.add_argument(
        "--storage-option",
        action="append",
        metavar="KEY=VALUE",
        dest="storage_option",
        help="Object store option for an s3:// output, repeatable: endpoint=http://host:9000, region=eu-west-1, allow_http=true. "
        "Credentials come from the AWS environment (AWS_ACCESS_KEY_ID, ...).",
    )


def add_source_storage_option_flag(group) -> None:
    group.add_argument(
        "--source-storage-option",
        action="append",
        metavar="KEY=VALUE",
        dest="source_storage_option",
        help="Object store option for an s3:// source, repeatable, as --storage-option takes them. Default: an s3:// "
        "output's --storage-option values (one endpoint for both); none for a local output.",
    )


def parse_storage_options(
    items: list[str] | None, field: str = "output.storageOptions", flag: str = "--storage-option"
) -> dict[str, str]:
    """``["endpoint=http://h:9000", "allow_http=true"]`` -> a dict; refuses an item without '='."""
    out: dict[str, str] = {}
    for item in items or ():
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise SpecError(
                field,
                f"Expected {flag} KEY=VALUE, e.g. endpoint=http://127.0.0.1:9000. Got {item!r} instead.",
            )
        out[key.strip()] = value.strip()
    return out


def parse_source_storage_options(items: list[str] | None) -> dict[str, str]:
    return parse_storage_options(items, "source.storageOptions", "--source-storage-option")


def listing_options(args: argparse.Namespace, output: str | None) -> dict[str, str]:
    """The options a glob in a bucket is listed with: ``--source-storage-option``, else an
    s3:// output's ``--storage-option`` (as each item's spec reads its source)."""
    from .spec import source_options_from_output

    given = getattr(args, "source_storage_option", None)
    if given:
        return parse_source_storage_options(given)
    return source_options_from_output(output or "", parse_storage_options(getattr(args, "storage_option", None)))


def spec_for_source(source: str, output: str | None, args: argparse.Namespace) -> ConversionSpec:
    """The spec of converting ``source`` (FILE.h5:/dataset, or a whole container) to ``output``
    (default: beside the file) under the flags given."""
    from .spec import parse_spec

    path, dataset = split_source(source)
    base: dict[str, Any] = {
        "source": {"path": path, "dataset": dataset},
        "output": {"path": output or os.path.splitext(path)[0] + ".ome.zarr"},
    }
    if getattr(args, "overwrite", False):
        base["output"]["overwrite"] = True
    return parse_spec(merge(base, spec_overrides(args)))


def spec_overrides(args: argparse.Namespace) -> dict[str, Any]:
    """The nested spec dict the flags given on the command line describe (unset flags omitted)."""
    spec: dict[str, dict[str, Any]] = {}
    if getattr(args, "storage_option", None):
        spec["output"] = {"storageOptions": parse_storage_options(args.storage_option)}
    if getattr(args, "source_storage_option", None):
        spec["source"] = {"storageOptions": parse_source_storage_options(args.source_storage_option)}
    for dest, field, parse in FLAG_FIELDS:
        value = getattr(args, dest, None)
        if value is None or value == "":
            continue
        if dest == "units":
            value = _units(value, args.axes)
        elif parse is not None:
            value = parse(value, field)
        section, name = field.split(".")
        spec.setdefault(section, {})[name] = value
    return spec


#: Flags over a spec read from a file: flags win.
merge = deep_merge


def constants_from_args(args: argparse.Namespace) -> Any:
    """The memory model's constants: ``--calibration FILE`` over the measured defaults."""
    from .planner import DEFAULT_CONSTANTS, MemoryConstants

    return MemoryConstants.from_file(args.calibration) if getattr(args, "calibration", None) else DEFAULT_CONSTANTS


def backend_from_args(args: argparse.Namespace, slurm: SlurmSpec | None = None) -> Backend:
    """The backend the flags ask for (``BACKEND_FLAGS``), built by the one backend factory
    (backends/factory.py). ``slurm`` is a manifest's slurm: block; the --slurm-* flags override its fields."""
    from .backends.factory import make_backend

    kind, options = next((kind, options) for kind, given, options in BACKEND_FLAGS if given(args))
    return make_backend(kind, options(args, slurm))


def _slurm_options(args: argparse.Namespace, slurm: SlurmSpec | None) -> BackendOptions:
    from .backends.factory import BackendOptions
    from .spec import SlurmSpec, parse_model
    from .units import parse_bytes

    settings = parse_model(SlurmSpec, merge(slurm.to_wire() if slurm is not None else {}, slurm_overrides(args)))
    return BackendOptions(
        slurm=settings, job_mem=parse_bytes(args.slurm_job_mem) if getattr(args, "slurm_job_mem", None) else None
    )


def _pod_options(args: argparse.Namespace, slurm: SlurmSpec | None) -> BackendOptions:
    from .backends.factory import BackendOptions
    from .units import parse_bytes

    return BackendOptions(pod_limit=parse_bytes(args.pod_limit) if getattr(args, "pod_limit", None) else None)


def _scheduler_options(args: argparse.Namespace, slurm: SlurmSpec | None) -> BackendOptions:
    from .backends.factory import BackendOptions

    return BackendOptions(scheduler=args.scheduler)


def _no_options(args: argparse.Namespace, slurm: SlurmSpec | None) -> BackendOptions:
    from .backends.factory import BackendOptions

    return BackendOptions()


#: Which flags pick which backend (a kind of backends/factory.py), and the options each takes from
#: them; the first row whose flags are given wins.
BACKEND_FLAGS: tuple[
    tuple[str, Callable[[argparse.Namespace], bool], Callable[[argparse.Namespace, SlurmSpec | None], BackendOptions]],
    ...,
] = (
    ("slurm", lambda a: getattr(a, "backend", None) == "slurm", _slurm_options),
    (
        "kubernetes",
        lambda a: bool(getattr(a, "kubernetes", False)),
        _no_options,
    ),  # planning as the operator would; no cluster starts
    ("external", lambda a: bool(getattr(a, "scheduler", None)), _scheduler_options),
    ("local-pods", lambda a: bool(getattr(a, "enforce_pod_limits", False)), _pod_options),
    ("local", lambda a: True, _no_options),
)


# --- SLURM (docs/slurm.md) -------------------------------------------------------------------

#: Each --slurm-* flag (argparse dest) and the slurm: spec field it sets.
SLURM_FLAGS: tuple[tuple[str, str], ...] = (
    ("slurm_partition", "partition"),
    ("slurm_account", "account"),
    ("slurm_qos", "qos"),
    ("slurm_walltime", "walltime"),
    ("slurm_directive", "directives"),
    ("slurm_scratch", "scratch"),
    ("slurm_python", "python"),
    ("slurm_prologue", "prologue"),
    ("slurm_log_dir", "logDirectory"),
    ("slurm_pending_timeout", "pendingTimeout"),
)


def add_backend_flags(parser: argparse.ArgumentParser) -> None:
    """``--backend`` and the ``slurm:`` block's flags (plan, convert and run share them)."""
    parser.add_argument(
        "--backend",
        choices=["local", "slurm"],
        help="Where the workers run: local (default) or slurm (one SLURM job per worker, sized by the plan; docs/slurm.md).",
    )
    g = parser.add_argument_group("SLURM (with --backend slurm; the slurm: block of a manifest)")
    g.add_argument("--slurm-partition", metavar="NAME", help="Partition of the worker jobs (#SBATCH -p).")
    g.add_argument("--slurm-account", metavar="NAME", help="Account charged (#SBATCH -A).")
    g.add_argument("--slurm-qos", metavar="NAME", help="Quality of service (#SBATCH --qos).")
    g.add_argument("--slurm-walltime", metavar="TIME", help="Time limit of each worker job (default 01:00:00).")
    g.add_argument(
        "--slurm-directive",
        action="append",
        metavar="OPTION",
        help="Extra #SBATCH option, e.g. --constraint=skylake (repeatable); not --mem or --cpus-per-task.",
    )
    g.add_argument(
        "--slurm-scratch", metavar="DIR", help="Job-local scratch directory for the worker (default ${TMPDIR:-/tmp})."
    )
    g.add_argument(
        "--slurm-python", metavar="PATH", help="Python interpreter on the nodes (default: the one running h5ngff)."
    )
    g.add_argument(
        "--slurm-prologue",
        action="append",
        metavar="LINE",
        help="Shell line run before the worker, e.g. 'module load hdf5' (repeatable).",
    )
    g.add_argument("--slurm-log-dir", metavar="DIR", help="Where the jobs' .out/.err go (default ./h5ngff-slurm-logs).")
    g.add_argument(
        "--slurm-pending-timeout",
        type=int,
        metavar="SECONDS",
        help="Fail with WorkersPending after this long (default 600).",
    )
    g.add_argument(
        "--slurm-job-mem",
        metavar="SIZE",
        help="Override the planned job --mem (experiments and negative controls: below the plan the job's cgroup kills the worker).",
    )


def slurm_overrides(args: argparse.Namespace) -> dict[str, Any]:
    """The slurm: fields the --slurm-* flags set (unset flags omitted)."""
    out = {}
    for dest, field in SLURM_FLAGS:
        value = getattr(args, dest, None)
        if value is not None:
            out[field] = value
    return out
