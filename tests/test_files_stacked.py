"""One image from many files (issue 45): ``h5ngff convert 'run/t*.h5:/data' out.ome.zarr
--stack-axis t`` stacks the matched files, in natural order, into one image; an explicit list
gives an explicit order; a ConversionJob says the same with ``source.paths`` or a glob.

Real HDF5 and Imaris files, real conversions (the session's shared Dask cluster through
``--scheduler``, and a real SIGKILL for the resume), read back by zarr-python and the independent
OME-Zarr clients, checked against numpy stacking of the sources. On cb6367c every one of these
failed: several files and one output converted only the first, silently.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import h5py
import numpy as np
import pytest
import yaml
import zarr

from conftest import smooth
from formats_fixtures import read_by_independent_clients, write_ims
from h5ngff.errors import ExitCode
from reference import reference_level

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[1]
CLI = [sys.executable, "-m", "h5ngff.cli"]
ENV = {**os.environ, "PYTHONPATH": str(ROOT / "src") + os.pathsep + os.environ.get("PYTHONPATH", "")}
FLAGS = ["--chunks", "1,8,16,16", "--levels", "2", "--no-progress"]


def h5ngff(*argv, cwd=None, env=None, scheduler=None) -> subprocess.CompletedProcess:
    extra = ["--scheduler", scheduler] if scheduler else []
    return subprocess.run(
        [*CLI, *map(str, argv), *extra], capture_output=True, text=True, timeout=180, cwd=cwd, env=env or ENV
    )


def one_error_line(proc: subprocess.CompletedProcess) -> str:
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error ("), proc.stderr
    return lines[0]


def write_series(directory: Path, n: int, shape=(8, 32, 32), dtype="uint16", voxel=(2.0, 0.5, 0.5)) -> list[Path]:
    """t0.h5 ... t{n-1}.h5, each one time point: /data with its voxel size."""
    directory.mkdir(parents=True, exist_ok=True)
    files = []
    for t in range(n):
        path = directory / f"t{t}.h5"
        with h5py.File(path, "w") as f:
            d = f.create_dataset("data", data=smooth(shape, dtype, seed=t), chunks=(4, 16, 16), compression="gzip")
            d.attrs["element_size_um"] = voxel
        files.append(path)
    return files


def stacked(files: list[Path], dataset: str = "data") -> np.ndarray:
    return np.stack([h5py.File(f, "r")[dataset][...] for f in files])


@pytest.fixture
def series(tmp_path):
    return write_series(tmp_path / "run", 12)  # t10, t11 sort after t9 in natural order


@pytest.mark.slow
def test_a_glob_of_files_stacks_in_natural_order_exactly_at_every_level(tmp_path, series, shared_cluster):
    out = tmp_path / "out.ome.zarr"
    proc = h5ngff(
        "convert", f"{tmp_path}/run/t*.h5:/data", out, "--stack-axis", "t", *FLAGS,
        scheduler=shared_cluster.scheduler_address,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    data = stacked(series)  # t0, t1, ..., t9, t10, t11: natural order
    group = zarr.open_group(str(out), mode="r")
    np.testing.assert_array_equal(group["0"][...], data)
    # z (2.0) is coarser than y and x (0.5): level 1 halves y and x only (the anisotropy rule).
    np.testing.assert_array_equal(group["1"][...], reference_level(data, (False, False, True, True), "mean"))
    read_by_independent_clients(str(out), data)  # ome-zarr-models, ome-zarr-py and ngff-zarr
    ome = group.attrs["ome"]["multiscales"][0]
    assert [a["name"] for a in ome["axes"]] == ["t", "z", "y", "x"]
    assert ome["datasets"][0]["coordinateTransformations"][0]["scale"] == [1.0, 2.0, 0.5, 0.5]
    check = h5ngff("verify", out, "--source", f"{tmp_path}/run/t*.h5:/data")
    assert check.returncode == 0, check.stdout + check.stderr


@pytest.mark.slow
def test_an_explicit_list_gives_an_explicit_order_and_2d_planes_stack_along_z(tmp_path, shared_cluster):
    planes = []
    for name, seed in (("b", 1), ("a", 2), ("c", 3)):
        path = tmp_path / f"{name}.h5"
        with h5py.File(path, "w") as f:
            f["img"] = smooth((40, 24), "float32", seed=seed)
        planes.append(path)
    out = tmp_path / "z.ome.zarr"
    proc = h5ngff(
        "convert", *(f"{p}:/img" for p in planes), out, "--stack-axis", "z", "--chunks", "2,16,16", "--levels", "1",
        "--no-progress", scheduler=shared_cluster.scheduler_address,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    group = zarr.open_group(str(out), mode="r")
    np.testing.assert_array_equal(group["0"][...], stacked(planes, "img"))  # b, a, c: as given
    assert [a["name"] for a in group.attrs["ome"]["multiscales"][0]["axes"]] == ["z", "y", "x"]


@pytest.mark.slow
def test_imaris_files_stack_along_t_and_single_channel_files_along_c_with_their_names(tmp_path, shared_cluster):
    rng = np.random.default_rng(0)
    per_time = [rng.integers(0, 4000, (1, 2, 6, 16, 16), dtype=np.uint16) for _ in range(3)]
    for t, data in enumerate(per_time):
        write_ims(tmp_path / f"tp{t}.ims", data, names=["GFP", "RFP"], colors=[(0, 1, 0), (1, 0, 0)])
    out = tmp_path / "t.ome.zarr"
    proc = h5ngff(
        "convert", f"{tmp_path}/tp*.ims", out, "--stack-axis", "t", "--chunks", "1,1,6,16,16", "--levels", "1",
        "--no-progress", scheduler=shared_cluster.scheduler_address,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    group = zarr.open_group(str(out), mode="r")
    np.testing.assert_array_equal(group["0"][...], np.concatenate(per_time, axis=0))
    assert [c["label"] for c in group.attrs["ome"]["omero"]["channels"]] == ["GFP", "RFP"]
    single = [rng.integers(0, 4000, (1, 1, 6, 16, 16), dtype=np.uint16) for _ in range(2)]
    for name, data, color in (("dapi", single[0], (0, 0, 1)), ("actin", single[1], (1, 0, 1))):
        write_ims(tmp_path / f"{name}.ims", data, names=[name.upper()], colors=[color])
    out = tmp_path / "c.ome.zarr"
    proc = h5ngff(
        "convert", tmp_path / "dapi.ims", tmp_path / "actin.ims", out, "--stack-axis", "c",
        "--chunks", "1,6,16,16", "--levels", "1", "--no-progress", scheduler=shared_cluster.scheduler_address,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    group = zarr.open_group(str(out), mode="r")
    np.testing.assert_array_equal(group["0"][...], np.concatenate(single, axis=1)[0])
    channels = group.attrs["ome"]["omero"]["channels"]
    assert [c["label"] for c in channels] == ["DAPI", "ACTIN"] and [c["color"] for c in channels] == [
        "0000FF",
        "FF00FF",
    ]


@pytest.mark.slow
@pytest.mark.parametrize(
    "odd, how",
    [
        ({"shape": (8, 32, 30)}, "shape (8, 32, 30)"),
        ({"dtype": "uint8"}, "dtype |u1"),
        ({"voxel": (2.0, 0.5, 0.25)}, "voxel size"),
    ],
    ids=["shape", "dtype", "voxel-size"],
)
def test_a_file_that_differs_is_refused_before_anything_is_written_naming_it(tmp_path, series, odd, how):
    write_series(tmp_path / "odd", 1, **odd)
    os.replace(tmp_path / "odd" / "t0.h5", tmp_path / "run" / "t5.h5")
    out = tmp_path / "out.ome.zarr"
    proc = h5ngff("convert", f"{tmp_path}/run/t*.h5:/data", out, "--stack-axis", "t", *FLAGS)
    assert proc.returncode == ExitCode.BAD_INPUT
    line = one_error_line(proc)
    assert "t5.h5" in line and how in line and "t0.h5" in line, line
    assert not out.exists()


@pytest.mark.slow
def test_several_files_and_one_output_without_a_stack_axis_name_all_three_choices(tmp_path, series):
    proc = h5ngff("convert", f"{series[0]}:/data", f"{series[1]}:/data", tmp_path / "out.ome.zarr")
    assert proc.returncode == ExitCode.BAD_INPUT
    line = one_error_line(proc)
    assert "{stem}.ome.zarr" in line and ":/ch0,/ch1" in line and "--stack-axis t, c or z" in line


@pytest.mark.slow
def test_a_killed_stack_resumes_byte_identical_and_a_changed_added_or_removed_file_is_refused(tmp_path, series):
    source = f"{tmp_path}/run/t*.h5:/data"
    flags = ["--stack-axis", "t", "--chunks", "1,8,16,16", "--levels", "2", "--no-progress", "--workers", "1"]
    whole = tmp_path / "whole.ome.zarr"
    assert h5ngff("convert", source, whole, *flags).returncode == 0
    out = tmp_path / "out.ome.zarr"
    killed = h5ngff("convert", source, out, *flags, env={**ENV, "H5NGFF_FAULTS": "crash_at=slab"})
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    resumed = h5ngff("convert", source, out, *flags)
    assert resumed.returncode == 0, resumed.stderr

    def files(root: Path) -> dict[str, bytes]:
        return {
            str(p.relative_to(root)): p.read_bytes() for p in root.rglob("*") if p.is_file() and ".h5ngff" not in str(p)
        }

    assert files(out) == files(whole)
    # A file that changed, one added, one removed: each refused (exit 3), naming the file.
    recorded = json.loads((out / "zarr.json").read_text())["attributes"]["h5ngff"]["content"]["source"]["files"]
    assert [Path(f[0]).name for f in recorded] == [p.name for p in series]
    stat = os.stat(series[3])
    os.utime(series[3], ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))
    changed = h5ngff("convert", source, out, *flags)
    assert changed.returncode == ExitCode.OUTPUT_REFUSED and "t3.h5 changed" in one_error_line(changed)
    os.utime(series[3], ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert h5ngff("convert", source, out, *flags).returncode == 0  # as it was again: complete
    write_series(tmp_path / "extra", 1)
    os.replace(tmp_path / "extra" / "t0.h5", tmp_path / "run" / "t12.h5")
    added = h5ngff("convert", source, out, *flags)
    assert added.returncode == ExitCode.OUTPUT_REFUSED and "t12.h5 added" in one_error_line(added)
    (tmp_path / "run" / "t12.h5").unlink()
    series[7].unlink()
    removed = h5ngff("convert", source, out, *flags)
    assert removed.returncode == ExitCode.OUTPUT_REFUSED and "t7.h5 removed" in one_error_line(removed)


@pytest.mark.slow
def test_a_conversion_job_with_source_paths_runs_and_renders(tmp_path, series):
    job = {
        "apiVersion": "h5ngff.dev/v1alpha1",
        "kind": "ConversionJob",
        "metadata": {"name": "stack", "namespace": "lab"},
        "spec": {
            "source": {"paths": [str(p) for p in series[:4]], "dataset": "/data", "stack": "t"},
            "output": {"path": str(tmp_path / "job.ome.zarr"), "chunks": [1, 8, 16, 16]},
            "pyramid": {"levels": 1},
            "resources": {"workers": 1},
        },
    }
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(job))
    run = h5ngff("run", path, "--no-progress")
    assert run.returncode == 0, run.stderr
    np.testing.assert_array_equal(
        zarr.open_group(str(tmp_path / "job.ome.zarr"), mode="r")["0"][...], stacked(series[:4])
    )
    rendered = h5ngff("operator", "render", path)
    assert rendered.returncode == 0, rendered.stderr
    text = rendered.stdout
    assert all(str(p) in text for p in series[:4]) and "stack" in text
    glob_job = {
        **job,
        "spec": {**job["spec"], "source": {"path": f"{tmp_path}/run/t*.h5", "dataset": "/data", "stack": "t"}},
    }
    path.write_text(yaml.safe_dump(glob_job))
    assert h5ngff("operator", "render", path).returncode == 0
    no_stack = {**job, "spec": {**job["spec"], "source": {"path": f"{tmp_path}/run/t*.h5", "dataset": "/data"}}}
    path.write_text(yaml.safe_dump(no_stack))
    refused = h5ngff("run", path)
    assert refused.returncode == ExitCode.BAD_INPUT and "ConversionBatch" in one_error_line(refused)


@pytest.mark.slow
def test_the_plan_prices_one_open_file_per_thread(tmp_path, series):
    proc = h5ngff(
        "plan", f"{tmp_path}/run/t*.h5:/data", "--stack-axis", "t", "--threads", "2", "--workers", "1", "--json"
    )
    assert proc.returncode == 0, proc.stderr
    terms = {t["name"]: t for t in json.loads(proc.stdout)["plan"]["memory"]["terms"]}
    assert "2 open files (one per thread)" in terms["hdf5 cache and decompression"]["why"]


@pytest.mark.slow
def test_bigdataviewer_files_stack_along_t(tmp_path, shared_cluster):
    """One BigDataViewer XML/HDF5 pair per time point (npy2bdv, an independent writer), stacked
    by their XMLs; npy2bdv's own reads of each are the truth (its uint16 stored as int16 too)."""
    from test_formats_bdv import read_npy2bdv, write_npy2bdv

    (tmp_path / "bdv").mkdir()
    planes = []
    for t in range(3):
        data = smooth((1, 1, 1, 6, 32, 24), "uint16", seed=30 + t)
        xml = write_npy2bdv(tmp_path / "bdv" / f"t{t}.h5", data, labels=("488",))
        planes.append(read_npy2bdv(xml, 1, 1)[0, 0])
    out = tmp_path / "bdv.ome.zarr"
    proc = h5ngff(
        "convert", f"{tmp_path}/bdv/t*.xml", out, "--stack-axis", "t", "--chunks", "1,6,16,16", "--levels", "1",
        "--no-progress", scheduler=shared_cluster.scheduler_address,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    np.testing.assert_array_equal(zarr.open_group(str(out), mode="r")["0"][...], np.stack(planes))
