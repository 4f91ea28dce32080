"""What the suite runs: the tools, each at one level and, where the tool builds pyramids, at
three. Each entry is a script the suite starts in its own process."""

from __future__ import annotations

from dataclasses import dataclass

from .config import PYRAMID_LEVELS


@dataclass(frozen=True)
class RunSpec:
    id: str
    tool: str
    label: str
    #: after the interpreter: ("-m", "bench.peers.x") or a script path
    argv: tuple[str, ...]
    levels: int = 1
    #: passed as --method, in the tool's own words ("" = the tool's default)
    method: str = ""
    #: how pyramid levels are verified: "mean" (against NumPy) or "shape" (shape and value range)
    verify_as: str = "mean"
    #: pass the case's user slab (64, 704, X) as --slab
    user_slab: bool = False
    workers: int | None = None
    #: the h5ngff run that others with the same number of levels are compared to
    reference: bool = False
    #: the case containers this run reads (bench/containers.py); others skip it
    containers: tuple[str, ...] = ("h5",)
    #: h5ngff only: False passes --no-checksums (the cost of the crc32c codec, docs/benchmarks.md)
    checksums: bool = True

    @property
    def pyramid(self) -> bool:
        return self.levels > 1


def _peer(module: str) -> tuple[str, ...]:
    return ("-m", f"bench.peers.{module}")


L = PYRAMID_LEVELS
#: h5ngff reads the microscopy containers itself; ngff-zarr reads them through an independent reader
#: (peers/common.source_array). bioformats2raw, the tool that reads Imaris, is Java: not installable here.
ALL = ("h5", "ims", "bdv")
DEFAULT_RUNS: tuple[RunSpec, ...] = (
    RunSpec("h5ngff", "h5ngff", "h5ngff (defaults)", _peer("h5ngff_cli"), reference=True, containers=ALL),
    RunSpec("h5ngff-no-checksums", "h5ngff", "h5ngff --no-checksums", _peer("h5ngff_cli"), checksums=False),
    RunSpec(
        "h5ngff-user-slab",
        "h5ngff",
        "h5ngff --workers 8 --slab 64,704,X",
        _peer("h5ngff_cli"),
        user_slab=True,
        workers=8,
    ),
    RunSpec(
        "h5ngff-pyramid",
        "h5ngff",
        f"h5ngff --levels {L} --downsample mean",
        _peer("h5ngff_cli"),
        levels=L,
        method="mean",
        reference=True,
    ),
    RunSpec(
        "delayed-slab",
        "delayed-slab (zarr 3)",
        "ad-hoc delayed-slab script, zarr 3",
        _peer("delayed_slab"),
        user_slab=True,
    ),
    RunSpec("dask-rechunk", "dask rechunk", "da.from_array(h5).rechunk().to_zarr()", _peer("dask_rechunk")),
    RunSpec("ngff-zarr", "ngff-zarr", "ngff-zarr (threaded dask)", _peer("ngffzarr"), containers=ALL),
    RunSpec(
        "ngff-zarr-pyramid-binshrink",
        "ngff-zarr",
        f"ngff-zarr {L} levels ITKWASM_BIN_SHRINK",
        _peer("ngffzarr"),
        levels=L,
        method="ITKWASM_BIN_SHRINK",
    ),
    RunSpec(
        "ngff-zarr-pyramid-default",
        "ngff-zarr",
        f"ngff-zarr {L} levels default (gaussian)",
        _peer("ngffzarr"),
        levels=L,
        verify_as="shape",
    ),
    RunSpec("ome-zarr-py", "ome-zarr-py", "ome-zarr-py write_image", _peer("omezarr")),
    RunSpec(
        "ome-zarr-py-pyramid",
        "ome-zarr-py",
        f"ome-zarr-py write_image {L} levels local_mean",
        _peer("omezarr"),
        levels=L,
        method="LOCAL_MEAN",
    ),
    RunSpec("tensorstore", "tensorstore", "tensorstore slab copy", _peer("tensorstore_copy"), user_slab=True),
)


def select(runs: tuple[RunSpec, ...], only: list[str] | None, skip: list[str] | None) -> list[RunSpec]:
    known = {r.id for r in runs}
    unknown = sorted((set(only or []) | set(skip or [])) - known)
    if unknown:
        raise SystemExit(f"unknown run id(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}")
    return [r for r in runs if (not only or r.id in only) and r.id not in (skip or [])]
