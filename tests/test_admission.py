"""The CRD refuses at admission what the model refuses, and accepts what it accepts.

Each row of the table is a ConversionJob ``.spec``; it goes through the pydantic model
(``parse_job_spec``, what the operator and ``h5ngff run`` use) and through the CRD as the API
server would check it (OpenAPI schema with a real JSON-schema validator, then every CEL rule
with cel-python; tests/crd_admission.py). The verdicts must be equal. Negative controls: the
CRD without its CEL rules, or without the added OpenAPI keys, disagrees on named rows; and
every single rule is needed by some row (drop it and a row that must be refused is admitted).
"""

from __future__ import annotations

import copy
from pathlib import Path

import pytest

from crd_admission import admission_errors, cel_errors, cel_failures, openapi_errors, program
from h5ngff.errors import SpecError
from h5ngff.jobspec import parse_job_spec
from h5ngff.operator.schema import admission
from h5ngff.operator.schema.crd import build_crd
from h5ngff.spec import MIN_WORKER_MEMORY
from h5ngff.units import MiB

ROOT = Path(__file__).resolve().parents[1]
BASE = {
    "source": {"path": "/data/in.h5", "dataset": "/volume/data"},
    "output": {"path": "/data/out.ome.zarr", "ngffVersion": "0.5", "chunks": [64, 64, 64]},
    "image": {"axes": "zyx", "scale": [2.0, 0.5, 0.5], "units": ["micrometer", "micrometer", "micrometer"]},
    "pyramid": {"levels": 3, "method": "mean"},
    "resources": {"workers": 2, "memoryPerWorker": "1Gi"},
    "pod": {
        "volumes": [{"name": "data", "persistentVolumeClaim": {"claimName": "c"}}],
        "volumeMounts": [{"name": "data", "mountPath": "/data"}],
    },
}


def spec_schema(cel: bool = True, schema_rules: bool = True, drop: object = None) -> dict:
    saved = admission.CEL_RULES, admission.SCHEMA_RULES
    admission.CEL_RULES = tuple(r for r in saved[0] if cel and r is not drop)
    admission.SCHEMA_RULES = tuple(r for r in saved[1] if schema_rules and r is not drop)
    try:
        return build_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
    finally:
        admission.CEL_RULES, admission.SCHEMA_RULES = saved


def edit(path: str, value=..., delete: str | None = None, base: dict = BASE) -> dict:
    """BASE with ``path`` (dotted) set to ``value``, or ``delete`` removed."""
    doc = copy.deepcopy(base)
    if delete:
        *parents, last = delete.split(".")
        node = doc
        for p in parents:
            node = node[p]
        node.pop(last)
    if value is not ...:
        *parents, last = path.split(".")
        node = doc
        for p in parents:
            node = node.setdefault(p, {})
        node[last] = value
    return doc


def no_axes(**sections) -> dict:
    doc = edit("", delete="image")
    for key, value in sections.items():
        doc[key] = {**doc.get(key, {}), **value}
    return doc


VALID = {
    "base": BASE,
    "minimal": {"source": {"path": "a.h5", "dataset": "d"}, "output": {"path": "o"}},
    "workers auto": edit("resources.workers", "auto"),
    "files stacked": edit("source", {"paths": ["/d/a.h5", "/d/b.h5"], "dataset": "/data", "stack": "t"}),
    "a glob of files stacked": edit("source", {"path": "/d/t*.h5", "dataset": "/data", "stack": "t"}),
    "planes along z": edit("source", {"paths": ["/d/a.h5"], "dataset": "/data", "stack": "z"}),
    "path beside paths": edit(
        "source", {"path": "/d/a.h5", "paths": ["/d/a.h5", "/d/b.h5"], "dataset": "/data", "stack": "c"}
    ),
    "workers 4096": edit("resources.workers", 4096),
    "levels auto": edit("pyramid.levels", "auto"),
    "levels 1": edit("pyramid.levels", 1),
    "levels 16": edit("pyramid.levels", 16),
    "memory int": edit("resources.memoryPerWorker", MIN_WORKER_MEMORY),
    "memory at the floor": edit("resources.memoryPerWorker", f"{MIN_WORKER_MEMORY // MiB}Mi"),
    "memory 8e18": edit("resources.memoryPerWorker", "8e18"),
    "memory 512MiB": edit("resources.memoryPerWorker", "512MiB"),
    "memory 2e9": edit("resources.memoryPerWorker", "2e9"),
    "memory 0.5 Gi": edit("resources.memoryPerWorker", "0.5 Gi"),
    "memory 1.5gb": edit("resources.memoryPerWorker", "1.5gb"),
    "memory 1T": edit("resources.memoryPerWorker", "1T"),
    "memory floor as a byte string": edit("resources.memoryPerWorker", str(MIN_WORKER_MEMORY)),
    "memoryTotal": edit("resources.memoryTotal", "8Gi", delete="resources.memoryPerWorker"),
    "shards multiple": edit("output.shards", [128, 256, 64]),
    "shards 0.5 explicit": edit("output.shards", [64, 64, 64]),
    "shards without chunks": edit("output.shards", [100, 100, 100], delete="output.chunks"),
    "ngff 0.4 no shards": edit("output.ngffVersion", "0.4"),
    "tczyx": edit(
        "image",
        {"axes": "tczyx", "scale": [1, 1, 1, 1, 1], "units": ["second", "", "micrometer", "micrometer", "micrometer"]},
        base=edit("output.chunks", [1, 1, 64, 64, 64]),
    ),
    "upper-case axes": edit("image.axes", "ZYX"),
    "yx 2-D": edit("image", {"axes": "yx"}, base=edit("output.chunks", [256, 256])),
    "one space unit": edit("image.units", ["nanometer"]),
    "empty units": edit("image.units", []),
    "empty unit strings": edit("image.units", ["", "", ""]),
    "pyramid axes yx": edit("pyramid.axes", "yx"),
    "no image axes, any lengths": no_axes(output={"chunks": [1, 64, 64, 64]}),
    "blosc options": edit("output.compressor", {"codec": "blosc", "cname": "lz4", "clevel": 0, "shuffle": "noshuffle"}),
    "default codec with options": edit("output.compressor", {"cname": "zlib", "clevel": 9}),
    "zstd 22": edit("output.compressor", {"codec": "zstd", "clevel": 22}),
    "gzip 1": edit("output.compressor", {"codec": "gzip", "clevel": 1}),
    "codec none": edit("output.compressor", {"codec": "none"}),
    "slab": edit("resources.slab", [64, 704, 2008]),
    "threads 64": edit("resources.threadsPerWorker", 64),
    "volume without type": edit("pod.volumes", [{"name": "data"}]),
    "no mounts": edit("pod.volumeMounts", []),
    "mountPath of a dot-directory": edit("pod.volumeMounts", [{"name": "data", "mountPath": "/data/.cache"}]),
    "mountPath /": edit("pod.volumeMounts", [{"name": "data", "mountPath": "/"}]),
    "backoff 0": edit("backoffLimit", 0),
    # --- output and source paths (issue 14) ---
    "output s3": edit("output.path", "s3://bucket/prefix/out.ome.zarr"),
    # --- sources in a bucket (issue 44) ---
    "source s3": edit("source.path", "s3://bucket/in.h5"),
    "source S3 in capitals": edit("source.path", "S3://bucket/run/in.h5"),
    "source s3 with storage options": edit(
        "source", {"path": "s3://b/in.h5", "dataset": "/data", "storageOptions": {"endpoint": "http://minio:9000"}}
    ),
    "source s3 with empty storage options": edit(
        "source", {"path": "s3://b/in.h5", "dataset": "/data", "storageOptions": {}}
    ),
    "files in a bucket": edit(
        "source", {"paths": ["s3://b/t0.h5", "s3://b/t1.h5"], "dataset": "/data", "stack": "t", "storageOptions": {}}
    ),
    "a glob of files in a bucket": edit("source", {"path": "s3://b/run/t*.h5", "dataset": "/data", "stack": "t"}),
    "output S3 upper-case": edit("output.path", "S3://bucket/out.ome.zarr"),
    "output relative path": edit("output.path", "out.ome.zarr"),
    "output local name with a colon": edit("output.path", "./out:1.ome.zarr"),
    "output path with a colon inside": edit("output.path", "/data/a:b"),
    "output Windows drive": edit("output.path", "C:/data/out.ome.zarr"),
    "output path with :// inside": edit("output.path", "/data/a://b"),
    "output s3 with storage options": edit(
        "output", {"path": "s3://b/x", "storageOptions": {"profile": "lab", "endpoint": "http://minio:9000"}}
    ),
    "output local, empty storage options": edit("output.storageOptions", {}),
    "output s3, one PUT at a time": edit("output", {"path": "s3://b/x", "storageOptions": {"uploads_in_flight": "0"}}),
    "output s3, 32 PUTs in flight": edit("output", {"path": "s3://b/x", "storageOptions": {"uploads_in_flight": "32"}}),
    "output s3 ngff 0.4 without checksums": edit("output", {"path": "s3://b/x", "ngffVersion": "0.4"}),
    "output s3 ngff 0.4 checksums false": edit(
        "output", {"path": "s3://b/x", "ngffVersion": "0.4", "checksums": False}
    ),
    "output local ngff 0.4 checksums": edit("output", {"path": "/data/o", "ngffVersion": "0.4", "checksums": True}),
    "source relative path": edit("source.path", "data/in.h5"),
    "source path 4096": edit("source.path", "/" + "a" * 4095),
    "source local name with a colon": edit("source.path", "./s3:odd.h5"),
    "source path with a space inside": edit("source.path", "/data/my file.h5"),
    # --- cross-field and per-field checks the CRD lacked (issue: admission limits) ---
    "retry interval 300": edit("retry", {"intervalSeconds": 300}),
    "retry interval 400, max 400": edit("retry", {"intervalSeconds": 400, "maxIntervalSeconds": 400}),
    "retry max 10 (interval default)": edit("retry", {"maxIntervalSeconds": 10}),
    "stack tc": edit("source.stack", "tc"),
    "slurm": edit(
        "slurm",
        {
            "partition": "gpu",
            "prologue": ["module load hdf5"],
            "directives": [
                "--constraint=skylake",
                "#SBATCH --mem-bind=local",
                "  -C x",
                "--nodelist=n1",
                "-Jc2",
                "--ntasks-per-node=1",
                "--cpu-freq=high",
            ],
        },
    ),
}

INVALID = {
    "workers 0": edit("resources.workers", 0),
    "workers 4097": edit("resources.workers", 4097),
    "workers many": edit("resources.workers", "many"),
    "levels -1": edit("pyramid.levels", -1),
    "levels 0": edit("pyramid.levels", 0),
    "levels 17": edit("pyramid.levels", 17),
    "levels max": edit("pyramid.levels", "max"),
    "memory malformed": edit("resources.memoryPerWorker", "1 gig"),
    "memory unit only": edit("resources.memoryPerWorker", "Gi"),
    "memory PiB": edit("resources.memoryPerWorker", "1Pi"),
    "memory negative": edit("resources.memoryPerWorker", "-1Gi"),
    "memory too small string": edit("resources.memoryPerWorker", "63Mi"),
    "memory 64Mi": edit("resources.memoryPerWorker", "64Mi"),
    "memory 1Mi below the floor": edit("resources.memoryPerWorker", f"{MIN_WORKER_MEMORY // MiB - 1}Mi"),
    "memory 1 byte below the floor": edit("resources.memoryPerWorker", MIN_WORKER_MEMORY - 1),
    "memory 1e300Gi": edit("resources.memoryPerWorker", "1e300Gi"),
    "memory 1e400": edit("resources.memoryPerWorker", "1e400"),
    "memory 2**63": edit("resources.memoryPerWorker", "9.3e18"),
    "memory too long, padded": edit("resources.memoryPerWorker", "1" + " " * 64 + "Gi"),
    "memoryTotal 1e300Gi": edit("resources.memoryTotal", "1e300Gi", delete="resources.memoryPerWorker"),
    "memory too small decimal": edit("resources.memoryPerWorker", "0.06Gi"),
    "memory too small int": edit("resources.memoryPerWorker", 1 << 20),
    "memory too small 64M": edit("resources.memoryPerWorker", "64M"),
    "memory too long": edit("resources.memoryPerWorker", "1" * 60 + "    Gi"),
    "memoryTotal malformed": edit("resources.memoryTotal", "lots", delete="resources.memoryPerWorker"),
    "memoryTotal too long": edit("resources.memoryTotal", "8" + " " * 64 + "Gi", delete="resources.memoryPerWorker"),
    "both budgets": edit("resources.memoryTotal", "8Gi"),
    "threads 0": edit("resources.threadsPerWorker", 0),
    "threads 65": edit("resources.threadsPerWorker", 65),
    "chunks empty": no_axes(output={"chunks": []}),
    "chunks zero": edit("output.chunks", [64, 0, 64]),
    "chunks six": no_axes(output={"chunks": [1] * 6}),
    "chunks vs axes": edit("output.chunks", [64, 64]),
    "shards vs axes": no_axes(output={"chunks": [64, 64], "shards": [64, 64, 64]}),
    "shards vs axes without chunks": edit("output.shards", [64, 64], delete="output.chunks"),
    "shards not multiple": edit("output.shards", [64, 100, 64]),
    "shards with 0.4": edit("output.ngffVersion", "0.4", base=edit("output.shards", [64, 64, 64])),
    "shards zero": edit("output.shards", [0, 64, 64]),
    "slab vs axes": edit("resources.slab", [64, 64]),
    "slab zero": edit("resources.slab", [0, 64, 64]),
    "scale vs axes": edit("image.scale", [1.0, 1.0]),
    "scale zero": edit("image.scale", [0, 1, 1]),
    "scale negative": edit("image.scale", [-1.0, 1.0, 1.0]),
    "scale empty": no_axes(image={"scale": []}),
    "scale six": no_axes(image={"scale": [1.0] * 6}),
    "units unknown": edit("image.units", ["micron", "micron", "micron"]),
    "units vs axes": edit("image.units", ["micrometer", "micrometer"]),
    "one time unit": edit("image.units", ["second"]),
    "time unit on z": edit("image.units", ["second", "micrometer", "micrometer"]),
    "space unit on t": edit(
        "image",
        {"axes": "tzyx", "units": ["micrometer", "micrometer", "micrometer", "micrometer"]},
        base=edit("output.chunks", [1, 64, 64, 64]),
    ),
    "unit on c": edit(
        "image",
        {"axes": "czyx", "units": ["micrometer", "micrometer", "micrometer", "micrometer"]},
        base=edit("output.chunks", [1, 64, 64, 64]),
    ),
    "units six": no_axes(image={"units": [""] * 6}),
    "axes unknown letter": edit("image.axes", "zyq"),
    "axes repeated": edit("image.axes", "zzx"),
    "axes order": edit("image.axes", "zyxc"),
    "axes one spatial": edit("image", {"axes": "cx"}),
    "axes with space": edit("image.axes", " zyx"),
    "pyramid axes not in image": edit(
        "image", {"axes": "yx"}, base=edit("pyramid.axes", "zyx", base=edit("output.chunks", [64, 64]))
    ),
    "pyramid axes letter": edit("pyramid.axes", "t"),
    "pyramid axes repeated": edit("pyramid.axes", "yy"),
    "pyramid axes empty": edit("pyramid.axes", ""),
    "method median": edit("pyramid.method", "median"),
    "codec lzma": edit("output.compressor", {"codec": "lzma"}),
    "cname with zstd": edit("output.compressor", {"codec": "zstd", "cname": "lz4"}),
    "shuffle with gzip": edit("output.compressor", {"codec": "gzip", "shuffle": "shuffle"}),
    "clevel with none": edit("output.compressor", {"codec": "none", "clevel": 1}),
    "blosc clevel 10": edit("output.compressor", {"clevel": 10}),
    "zstd clevel 0": edit("output.compressor", {"codec": "zstd", "clevel": 0}),
    "zstd clevel 23": edit("output.compressor", {"codec": "zstd", "clevel": 23}),
    "gzip clevel 10": edit("output.compressor", {"codec": "gzip", "clevel": 10}),
    "blosc clevel -1": edit("output.compressor", {"clevel": -1}),
    "ngff 0.6": edit("output.ngffVersion", "0.6"),
    "allocator tcmalloc": edit("resources.allocator", "tcmalloc"),
    "pull policy": edit("pod.imagePullPolicy", "Sometimes"),
    "volume without name": edit("pod.volumes", [{"emptyDir": {}}], base=edit("pod.volumeMounts", [])),
    "volume empty name": edit("pod.volumes", [{"name": "", "emptyDir": {}}], base=edit("pod.volumeMounts", [])),
    "mount of no volume": edit("pod.volumeMounts", [{"name": "scratch", "mountPath": "/s"}]),
    "two volumes, one name": edit("pod.volumes", [{"name": "data", "emptyDir": {}}, {"name": "data", "emptyDir": {}}]),
    "the scratch volume's name": edit(
        "pod.volumes", [{"name": "h5ngff-scratch", "emptyDir": {}}], base=edit("pod.volumeMounts", [])
    ),
    "two mounts, one path": edit(
        "pod.volumeMounts", [{"name": "data", "mountPath": "/d"}, {"name": "data", "mountPath": "/d"}]
    ),
    "relative mountPath": edit("pod.volumeMounts", [{"name": "data", "mountPath": "data"}]),
    # Issue 41: Kubernetes compares mountPaths as written; both refuse all but the normal form.
    "mounts /a and /a/": edit(
        "pod.volumeMounts", [{"name": "data", "mountPath": "/a"}, {"name": "data", "mountPath": "/a/"}]
    ),
    "mountPath with a trailing slash": edit("pod.volumeMounts", [{"name": "data", "mountPath": "/data/"}]),
    "mountPath //data": edit("pod.volumeMounts", [{"name": "data", "mountPath": "//data"}]),
    "mountPath /data/./x": edit("pod.volumeMounts", [{"name": "data", "mountPath": "/data/./x"}]),
    "mountPath /data/../etc": edit("pod.volumeMounts", [{"name": "data", "mountPath": "/data/../etc"}]),
    # Issue 41: "3" was refused by the CRD and read as 3 by the model.
    "levels as string": edit("pyramid.levels", "3"),
    "workers as string": edit("resources.workers", "2"),
    "mount without a path": edit("pod.volumeMounts", [{"name": "data"}]),
    "empty image": edit("pod.image", ""),
    "blank image": edit("pod.image", "  "),
    "mount without volumes": edit("pod", {"volumeMounts": [{"name": "data", "mountPath": "/d"}]}),
    "65 volumes": edit("pod", {"volumes": [{"name": f"v{i}"} for i in range(65)]}),
    "volume name too long": edit("pod", {"volumes": [{"name": "v" * 64}]}),
    "65 mounts": edit("pod.volumeMounts", [{"name": "data", "mountPath": f"/d{i}"} for i in range(65)]),
    "backoff 21": edit("backoffLimit", 21),
    "backoff -1": edit("backoffLimit", -1),
    "ttl -1": edit("ttlSecondsAfterFinished", -1),
    "typo": edit("resources.memoryPerWorkr", "1Gi"),
    "no source": edit("", delete="source"),
    "empty source path": edit("source.path", ""),
    "empty output path": edit("output.path", ""),
    "overwrite number": edit("output.overwrite", 2),
    "units unknown, no axes": no_axes(image={"units": ["micron"]}),
    "workers bool": edit("resources.workers", True),
    # --- output and source paths (issue 14) ---
    "output gs": edit("output.path", "gs://bucket/out.ome.zarr"),
    "output http": edit("output.path", "http://minio:9000/bucket/out.ome.zarr"),
    "output https": edit("output.path", "https://bucket.s3.amazonaws.com/out.ome.zarr"),
    "output file": edit("output.path", "file:///data/out.ome.zarr"),
    "output s3a": edit("output.path", "s3a://bucket/out.ome.zarr"),
    "output path too long": edit("output.path", "/" + "a" * 4096),
    "output storage options with a local path": edit("output.storageOptions", {"profile": "lab"}),
    "output s3, 33 PUTs in flight": edit("output", {"path": "s3://b/x", "storageOptions": {"uploads_in_flight": "33"}}),
    "output s3, PUTs in flight not a number": edit(
        "output", {"path": "s3://b/x", "storageOptions": {"uploads_in_flight": "many"}}
    ),
    "output s3, negative PUTs in flight": edit(
        "output", {"path": "s3://b/x", "storageOptions": {"uploads_in_flight": "-1"}}
    ),
    "output s3, PUTs in flight in capitals": edit(
        "output", {"path": "s3://b/x", "storageOptions": {"UPLOADS_IN_FLIGHT": "99"}}
    ),
    "output s3 ngff 0.4 with checksums": edit("output", {"path": "s3://b/x", "ngffVersion": "0.4", "checksums": True}),
    "source https": edit("source.path", "https://example.org/in.h5"),
    "source s3 without a bucket": edit("source.path", "s3:///in.h5"),
    "source storage options with a local path": edit("source.storageOptions", {"profile": "lab"}),
    "source file": edit("source.path", "file:///data/in.h5"),
    "source path too long": edit("source.path", "/" + "a" * 4096),
    # --- one image from many files (issue 45) ---
    "source with neither path nor paths": edit("source", {"dataset": "/data", "stack": "t"}),
    "files without a stack axis": edit("source", {"paths": ["/d/a.h5", "/d/b.h5"], "dataset": "/data"}),
    "a glob of files without a stack axis": edit("source", {"path": "/d/t*.h5", "dataset": "/data"}),
    "files with two stack axes": edit("source", {"paths": ["/d/a.h5"], "dataset": "/data", "stack": "tc"}),
    "stack z within one file": edit("source", {"path": "/d/a.h5", "dataset": "/ch{0..2}", "stack": "z"}),
    "path not the first of paths": edit(
        "source", {"path": "/d/b.h5", "paths": ["/d/a.h5", "/d/b.h5"], "dataset": "/data", "stack": "t"}
    ),
    "paths mixing files and URLs": edit(
        "source", {"paths": ["/d/a.h5", "s3://b/t1.h5"], "dataset": "/data", "stack": "t"}
    ),
    "paths holding a gs URL": edit(
        "source", {"paths": ["gs://b/t0.h5", "gs://b/t1.h5"], "dataset": "/data", "stack": "t"}
    ),
    "paths holding a padded path": edit("source", {"paths": ["/d/a.h5 "], "dataset": "/data", "stack": "t"}),
    # --- URL-like prefixes and padding (issue: admission limits) ---
    "output path with a colon": edit("output.path", "out:1.ome.zarr"),
    "output s3:/ one slash": edit("output.path", "s3:/bucket/x.ome.zarr"),
    "output S3:/ one slash": edit("output.path", "S3:/bucket/x.ome.zarr"),
    "output gs:/ one slash": edit("output.path", "gs:/bucket/x.ome.zarr"),
    "output s3: no slash": edit("output.path", "s3:bucket/x.ome.zarr"),
    "output leading space": edit("output.path", " /data/out.ome.zarr"),
    "output trailing space": edit("output.path", "/data/out.ome.zarr "),
    "output trailing newline": edit("output.path", "/data/out.ome.zarr\n"),
    "output s3 with leading tab": edit("output.path", "\ts3://bucket/x"),
    "source s3:/ one slash": edit("source.path", "s3:/bucket/in.h5"),
    "source leading space": edit("source.path", " /data/in.h5"),
    "source trailing space": edit("source.path", "/data/in.h5 "),
    # --- cross-field and per-field checks the CRD lacked (issue: admission limits) ---
    "retry interval 400 (max default 300)": edit("retry", {"intervalSeconds": 400}),
    "retry max below interval": edit("retry", {"intervalSeconds": 20, "maxIntervalSeconds": 10}),
    "retry max 5 (interval default 10)": edit("retry", {"maxIntervalSeconds": 5}),
    "stack x": edit("source.stack", "x"),
    "stack cc": edit("source.stack", "cc"),
    "stack empty": edit("source.stack", ""),
    **{
        f"slurm {name} two lines": edit("slurm", {name: "a\nb"})
        for name in ("partition", "account", "qos", "scratch", "python", "logDirectory")
    },
    "slurm prologue two lines": edit("slurm", {"prologue": ["module load hdf5\nrm -rf /"]}),
    "slurm directive --mem": edit("slurm", {"directives": ["--mem=1G"]}),
    "slurm directive #SBATCH -c 4": edit("slurm", {"directives": ["#SBATCH -c 4"]}),
    "slurm directive -N tab": edit("slurm", {"directives": ["-N\t2"]}),
    "slurm directive -c2 (value attached)": edit("slurm", {"directives": ["-c2"]}),
    "slurm directive -n2": edit("slurm", {"directives": ["#SBATCH -n2"]}),
    "slurm directive -vc2 (after a flag)": edit("slurm", {"directives": ["-vc2"]}),
    "slurm directive --cpus-per-t=2 (a prefix)": edit("slurm", {"directives": ["--cpus-per-t=2"]}),
    "slurm directive --mem 1G (a space)": edit("slurm", {"directives": ["--mem 1G"]}),
    "slurm directive -N2 as a second word": edit("slurm", {"directives": ["--comment=x -N2"]}),
    "slurm directive not an option": edit("slurm", {"directives": ["constraint=skylake"]}),
    "slurm directive empty": edit("slurm", {"directives": [""]}),
    "slurm directive #SBATCH alone": edit("slurm", {"directives": ["#SBATCH"]}),
    "slurm directive too long": edit("slurm", {"directives": ["--comment=" + "x" * 1100]}),
    "slurm 65 directives": edit("slurm", {"directives": ["-C x"] * 65}),
}

#: Where the model is laxer than the API server, on purpose: it reads YAML files for `h5ngff
#: run`, where an unquoted 0.5 is a float and "64" a string. The CRD's types refuse them, which
#: is right for the API (kubectl prints the type error). Pinned so the list stays this short.
COERCED = {
    "chunk as string": edit("output.chunks", ["64", 64, 64]),
    "scale as string": edit("image.scale", ["2", 0.5, 0.5]),
    "overwrite as string": edit("output.overwrite", "yes"),
}


def model_accepts(spec: dict) -> bool:
    try:
        parse_job_spec(spec)
    except SpecError:
        return False
    return True


@pytest.fixture(scope="module")
def schema() -> dict:
    return spec_schema()


@pytest.mark.parametrize("name", VALID)
def test_valid_specs_pass_the_model_and_the_crd(schema, name):
    assert model_accepts(VALID[name])
    assert admission_errors(schema, VALID[name]) == []


@pytest.mark.parametrize("name", INVALID)
def test_invalid_specs_fail_the_model_and_the_crd(schema, name):
    assert not model_accepts(INVALID[name])
    assert admission_errors(schema, INVALID[name]) != []


@pytest.mark.parametrize("name", COERCED)
def test_the_only_disagreements_are_yaml_type_coercions(schema, name):
    assert model_accepts(COERCED[name]) and admission_errors(schema, COERCED[name]) != []


def test_an_unquoted_ngff_version_is_refused_by_the_model_as_by_the_api_server(schema):
    """It was the one YAML coercion the model accepted (issue 17, item 9): now both refuse it."""
    unquoted = edit("output.ngffVersion", 0.5)
    assert not model_accepts(unquoted) and admission_errors(schema, unquoted) != []


def test_the_issues_examples_are_refused_with_a_message_naming_the_field(schema):
    assert cel_errors(schema, INVALID["workers 0"]) == [
        "spec.resources.workers: resources.workers must be 'auto' or an integer from 1 to 4096"
    ]
    assert cel_errors(schema, INVALID["levels -1"]) == [
        "spec.pyramid.levels: pyramid.levels must be 'auto' or an integer from 1 to 16"
    ]
    (error,) = admission_errors(schema, INVALID["memory malformed"])
    assert error.startswith("resources.memoryPerWorker: '1 gig' does not match")


# --- negative controls --------------------------------------------------------------------------


ROWS = {**VALID, **INVALID}


@pytest.fixture(scope="module")
def model_verdicts() -> dict[str, bool]:
    return {name: model_accepts(spec) for name, spec in ROWS.items()}


@pytest.fixture(scope="module")
def failures(schema) -> dict[str, list]:
    """Each row's CEL failures under the full CRD (the variants below differ only in which
    rules exist, so a dropped rule's failures are simply left out)."""
    return {name: cel_failures(schema, spec) for name, spec in ROWS.items()}


def disagreements(model_verdicts, failures, schema: dict, dropped_cel: set[str] | None = None) -> set[str]:
    """Rows where the CRD (``schema``'s OpenAPI part, CEL rules less ``dropped_cel``; None = all
    dropped) and the model disagree."""
    out = set()
    for name, spec in ROWS.items():
        cel = [f for f in failures[name] if dropped_cel is not None and f[1] not in dropped_cel]
        admitted = not openapi_errors(schema, spec) and not cel
        if admitted != model_verdicts[name]:
            out.add(name)
    return out


@pytest.mark.slow
def test_without_cel_the_crd_admits_what_the_model_refuses(model_verdicts, failures, schema):
    found = disagreements(model_verdicts, failures, schema, dropped_cel=None)
    assert {
        "workers 0",
        "levels -1",
        "memory too small string",
        "both budgets",
        "shards not multiple",
        "chunks vs axes",
        "mount of no volume",
        "clevel with none",
        "output gs",
        "output http",
        "output file",
        "source https",
        "output storage options with a local path",
        "output s3 ngff 0.4 with checksums",
    } <= found


def test_without_the_added_openapi_keys_the_crd_admits_what_the_model_refuses(model_verdicts, failures):
    found = disagreements(model_verdicts, failures, spec_schema(schema_rules=False), dropped_cel=set())
    assert {"chunks six", "units unknown, no axes", "axes repeated", "scale zero", "volume without name"} <= found


def test_the_full_crd_agrees_with_the_model_on_every_row(model_verdicts, failures, schema):
    assert disagreements(model_verdicts, failures, schema, dropped_cel=set()) == set()


@pytest.mark.parametrize("rule", admission.CEL_RULES, ids=lambda r: f"{r.path or 'spec'}: {r.message[:50]}")
def test_every_cel_rule_is_needed_by_some_row(model_verdicts, failures, schema, rule):
    """Drop one rule: some row the model refuses is admitted. No rule is dead weight, and the
    table covers every rule."""
    assert disagreements(model_verdicts, failures, schema, dropped_cel={rule.rule}), f"no row needs {rule}"


@pytest.mark.parametrize("rule", admission.SCHEMA_RULES, ids=lambda r: r.path)
def test_every_openapi_rule_is_needed_by_some_row(model_verdicts, failures, rule):
    assert disagreements(model_verdicts, failures, spec_schema(drop=rule), dropped_cel=set()), f"no row needs {rule}"


def test_every_cel_rule_compiles_and_stays_small():
    for rule in admission.CEL_RULES:
        program(rule.rule)
        assert len(rule.rule) < 4000 and rule.message


def test_lists_and_strings_cel_iterates_are_bounded(schema):
    """The API server estimates a rule's cost from maxItems/maxLength; unbounded inputs make a
    CRD with list-iterating rules refused at install."""
    pod = schema["properties"]["pod"]["properties"]
    assert pod["volumes"]["maxItems"] == pod["volumeMounts"]["maxItems"] == admission.MAX_VOLUMES
    for path in ("output.chunks", "output.shards", "resources.slab", "image.scale", "image.units"):
        assert admission.node_at(schema, path)["maxItems"] == admission.MAX_AXES, path
    for path in ("image.axes", "pyramid.axes", "resources.memoryPerWorker", "resources.memoryTotal"):
        assert admission.node_at(schema, path)["maxLength"] <= 64, path
    for path in ("source.path", "output.path"):  # matched by the URL-scheme rules
        assert admission.node_at(schema, path)["maxLength"] == 4096, path
    assert admission.node_at(schema, "image.units")["items"]["maxLength"] <= 16
    assert (
        pod["volumes"]["items"]["properties"]["name"]["maxLength"]
        == pod["volumeMounts"]["items"]["properties"]["name"]["maxLength"]
        == 63
    )


def test_docs_list_every_rule():
    docs = (ROOT / "docs/operator.md").read_text()
    for rule in admission.CEL_RULES:
        assert rule.message in docs, rule.message
    for rule in admission.SCHEMA_RULES:
        assert f"`{rule.path}`" in docs, rule.path


# ConversionJob examples; the ConversionBatch example passes its own CRD (tests/test_operator_batch_spec.py).
@pytest.mark.parametrize(
    "path",
    sorted(p for p in (ROOT / "manifests/examples").glob("*.yaml") if "kind: ConversionBatch" not in p.read_text()),
    ids=lambda p: p.name,
)
def test_the_example_manifests_pass_admission(schema, path):
    import yaml

    doc = yaml.safe_load(path.read_text())
    assert model_accepts(doc["spec"]) and admission_errors(schema, doc["spec"]) == []
