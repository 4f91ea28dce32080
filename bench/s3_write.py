"""Object storage (issue 14): the single-level seed case written by h5ngff to local disk, by
h5ngff to a loopback S3 endpoint (moto's server, in its own process), and by ngff-zarr to the
same endpoint, in one run, every output read back through the endpoint and compared with the
source.

    .venv/bin/python bench/s3_write.py [--scale 0.05] [--repeat 2] [--data-dir bench/data] [--latency-ms 20]

Target (issue 14): h5ngff to the endpoint within 1.3x of h5ngff to disk, and faster than
ngff-zarr to the same endpoint. Each figure is the fastest of ``--repeat`` interleaved rounds.
The control run "1 PUT at a time" (``uploads_in_flight=0``) shows what overlapping the uploads
with encoding gains; ``--latency-ms`` puts a distant store's round trip in front of the endpoint.
The endpoint is a Python process on the same cores, so the script also prints its CPU and the
least time a run to it can take on this machine (the disk run plus that CPU over the cores).
``--endpoint-core`` instead gives the endpoint a core of its own and every writer (disk runs
included) the others, as if the store were another machine: then the ratio is the writer's own.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
KEY = {
    "AWS_ACCESS_KEY_ID": "bench",
    "AWS_SECRET_ACCESS_KEY": "bench-secret",
    "AWS_DEFAULT_REGION": "us-east-1",
    "AWS_REGION": "us-east-1",
}
CODEC = "blosc:zstd:5:bitshuffle"

# ngff-zarr 0.50 writes only to local directories ("write to a local directory and upload
# afterwards for remote targets", its own error for an s3:// URL), so the peer does exactly that:
# to_ngff_zarr into a temporary directory, then an s3fs recursive upload, timed together.
NGFF_ZARR_PEER = r"""
import os, sys, shutil, tempfile, h5py, dask.array as da, ngff_zarr as nz, s3fs
from zarr.codecs import BloscCodec
src, out = sys.argv[1], sys.argv[2]
local = tempfile.mkdtemp(prefix="ngffzarr-") + "/out.ome.zarr"
with h5py.File(src, "r") as f:
    data = da.from_array(f["/volume/data"], chunks=(64, 64, 64))
    image = nz.to_ngff_image(data, dims=["z", "y", "x"])
    ms = nz.to_multiscales(image, scale_factors=[], chunks={"z": 64, "y": 64, "x": 64})
    nz.to_ngff_zarr(local, ms, version="0.5", compressors=[BloscCodec(cname="zstd", clevel=5, shuffle="bitshuffle")])
s3fs.S3FileSystem().put(local + "/", out.removeprefix("s3://") + "/", recursive=True)
shutil.rmtree(os.path.dirname(local))
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def pinned(cores: set[int] | None):
    """A preexec_fn that runs the child on ``cores`` only (None: anywhere)."""
    return None if cores is None else (lambda: os.sched_setaffinity(0, cores))


def start_moto(cores: set[int] | None = None) -> tuple[subprocess.Popen, str]:
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        preexec_fn=pinned(cores),
    )
    for _ in range(200):
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.1).close()
            return proc, f"http://127.0.0.1:{port}"
        except OSError:
            time.sleep(0.1)
    raise RuntimeError("moto did not start")


def timed(argv: list[str], env: dict[str, str], cores: set[int] | None = None) -> float:
    t = time.perf_counter()
    proc = subprocess.run(argv, env=env, capture_output=True, text=True, preexec_fn=pinned(cores))
    seconds = time.perf_counter() - t
    if proc.returncode:
        raise RuntimeError(f"{argv[:4]} failed ({proc.returncode}): {proc.stderr[-2000:]}")
    return seconds


def same_as_source(url_or_path: str, source: str, endpoint: str) -> bool:
    import h5py
    import numpy as np
    import zarr
    from zarr.storage import FsspecStore

    store = url_or_path
    if url_or_path.startswith("s3://"):
        store = FsspecStore.from_url(
            url_or_path,
            storage_options={
                "endpoint_url": endpoint,
                "key": KEY["AWS_ACCESS_KEY_ID"],
                "secret": KEY["AWS_SECRET_ACCESS_KEY"],
            },
            read_only=True,
        )
    group = zarr.open_group(store, mode="r")
    attrs = group.attrs.asdict()
    multiscales = attrs.get("ome", attrs).get("multiscales")
    level0 = group[multiscales[0]["datasets"][0]["path"]]  # ngff-zarr names its levels scale0/image
    with h5py.File(source, "r") as f:
        ds = f["/volume/data"]
        return all(np.array_equal(level0[z : z + 64], ds[z : z + 64]) for z in range(0, ds.shape[0], 64))


def _cpu_seconds(pid: int) -> float:
    import psutil

    t = psutil.Process(pid).cpu_times()
    return t.user + t.system


def start_latency_proxy(
    endpoint: str, latency_ms: float, cores: set[int] | None = None
) -> tuple[subprocess.Popen, str]:
    """bench/latency_proxy.py in front of the endpoint: every request arrives ``latency_ms`` late."""
    port = endpoint.rsplit(":", 1)[1]
    proc = subprocess.Popen(
        [sys.executable, "-m", "bench.latency_proxy", port, str(latency_ms)],
        stdout=subprocess.PIPE,
        text=True,
        cwd=ROOT,
        preexec_fn=pinned(cores),
    )
    assert proc.stdout is not None
    return proc, f"http://127.0.0.1:{proc.stdout.readline().strip()}"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--scale", type=float, default=0.05)
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--data-dir", default=str(ROOT / "bench" / "data"))
    ap.add_argument(
        "--latency-ms",
        type=float,
        default=0.0,
        help="deliver every request to the endpoint this late (bench/latency_proxy.py): a distant store's round trip; 0 = loopback",
    )
    ap.add_argument(
        "--endpoint-core",
        action="store_true",
        help="give the endpoint (and proxy) the last core and every writer the others, as if the store were another machine; "
        "by default all share every core",
    )
    ap.add_argument("--skip", default="", help="comma-separated runs to leave out: disk, s3, s3-sync, ngff-zarr")
    args = ap.parse_args()
    sys.path.insert(0, str(ROOT / "src"))
    sys.path.insert(0, str(ROOT))
    from bench.config import scaled_yx
    from h5ngff.sample import write_sample

    y, x = scaled_yx(args.scale)
    source = os.path.join(args.data_dir, f"s3-seed-{args.scale:g}.h5")
    if not os.path.exists(source):
        os.makedirs(args.data_dir, exist_ok=True)
        write_sample(source, "/volume/data", (150, y, x), "float32")
    nbytes = 150 * y * x * 4
    all_cores = sorted(os.sched_getaffinity(0))
    endpoint_cores = {all_cores[-1]} if args.endpoint_core else None
    writer_cores = set(all_cores[:-1]) if args.endpoint_core else None
    if args.endpoint_core and not writer_cores:
        ap.error("--endpoint-core needs at least 2 cores")
    moto, endpoint = start_moto(endpoint_cores)
    proxy, writers_endpoint = (
        start_latency_proxy(endpoint, args.latency_ms, endpoint_cores) if args.latency_ms else (None, endpoint)
    )
    env = {
        **os.environ,
        **KEY,
        "AWS_ENDPOINT_URL": writers_endpoint,
        "AWS_ALLOW_HTTP": "true",
        "PYTHONPATH": str(ROOT / "src"),
    }
    h5ngff = [sys.executable, "-m", "h5ngff.cli", "convert", f"{source}:/volume/data"]
    common = ["--levels", "1", "--chunks", "64,64,64", "--compressor", CODEC, "--no-progress", "--json"]
    work = tempfile.mkdtemp(prefix="h5ngff-s3-bench-")
    skip = {s.strip() for s in args.skip.split(",") if s.strip()}
    names = {
        "disk": "h5ngff -> disk",
        "s3": "h5ngff -> s3",
        "s3-sync": "h5ngff -> s3, 1 PUT at a time",
        "ngff-zarr": "ngff-zarr -> s3",
    }
    times: dict[str, list[float]] = {name: [] for key, name in names.items() if key not in skip}
    endpoint_cpu: dict[str, list[float]] = {name: [] for name in times}
    exact: dict[str, bool] = {}
    try:
        import botocore.session

        client = botocore.session.get_session().create_client(
            "s3",
            endpoint_url=endpoint,
            region_name="us-east-1",
            aws_access_key_id=KEY["AWS_ACCESS_KEY_ID"],
            aws_secret_access_key=KEY["AWS_SECRET_ACCESS_KEY"],
        )
        client.create_bucket(Bucket="bench")
        for r in range(args.repeat):
            disk = os.path.join(work, f"disk-{r}.ome.zarr")
            runs = {
                names["disk"]: (h5ngff + [disk] + common, disk),
                names["s3"]: (h5ngff + [f"s3://bench/h5ngff-{r}.ome.zarr"] + common, f"s3://bench/h5ngff-{r}.ome.zarr"),
                # The control: the same run with no PUT in flight while the next chunk is encoded.
                names["s3-sync"]: (
                    h5ngff + [f"s3://bench/sync-{r}.ome.zarr"] + common + ["--storage-option", "uploads_in_flight=0"],
                    f"s3://bench/sync-{r}.ome.zarr",
                ),
                names["ngff-zarr"]: (
                    [sys.executable, "-c", NGFF_ZARR_PEER, source, f"s3://bench/ngffzarr-{r}.ome.zarr"],
                    f"s3://bench/ngffzarr-{r}.ome.zarr",
                ),
            }
            for name, (argv, out) in runs.items():
                if name not in times:
                    continue
                before = _cpu_seconds(moto.pid) + (_cpu_seconds(proxy.pid) if proxy else 0.0)
                times[name].append(timed(argv, env, writer_cores))
                # The loopback server (and the latency proxy) are Python processes on the same
                # cores as the writer: the CPU they spend serving the run is taken from its workers.
                endpoint_cpu[name].append(_cpu_seconds(moto.pid) + (_cpu_seconds(proxy.pid) if proxy else 0.0) - before)
                exact[name] = exact.get(name, True) and same_as_source(out, source, endpoint)
                print(
                    f"round {r + 1}: {name:30s} {times[name][-1]:6.2f} s  exact={exact[name]}  endpoint CPU {endpoint_cpu[name][-1]:.1f} s",
                    flush=True,
                )
            shutil.rmtree(disk, ignore_errors=True)
    finally:
        for proc in (moto, proxy):
            if proc is not None:
                proc.terminate()
                proc.wait()
        shutil.rmtree(work, ignore_errors=True)
    best = {k: min(v) for k, v in times.items()}
    cores = len(writer_cores or all_cores)
    where = (
        f"writers on {len(writer_cores)} core(s), the endpoint on its own"
        if writer_cores
        else f"writers and endpoint sharing {cores} cores"
    )
    print(
        f"\nseed case (150, {y}, {x}) float32, {nbytes / 1e9:.3f} GB, single level, (64,64,64) chunks, {CODEC}; "
        f"endpoint latency +{args.latency_ms:g} ms; {where}; best of {args.repeat}:"
    )
    for name, secs in best.items():
        print(
            f"| {name} | {secs:.2f} s | {nbytes / secs / 1e6:.0f} MB/s | endpoint CPU {min(endpoint_cpu[name]):.1f} s | exact {exact[name]} |"
        )
    summary: dict[str, float] = {}
    disk_name, s3_name = names["disk"], names["s3"]
    if disk_name in best and s3_name in best:
        summary = {"s3_over_disk": best[s3_name] / best[disk_name]}
        print(f"h5ngff s3/disk = {summary['s3_over_disk']:.2f}x (target <= 1.3)")
        if not writer_cores:
            # The endpoint shares the writers' cores: a run to it cannot beat the disk run plus
            # the endpoint's CPU spread over every core.
            bound = best[disk_name] + min(endpoint_cpu[s3_name]) / cores
            summary.update(shared_core_bound_s=bound, s3_over_bound=best[s3_name] / bound)
            print(
                f"the endpoint's CPU on these {cores} shared cores makes {bound:.2f} s the least a run to it can take "
                f"({bound / best[disk_name]:.2f}x disk): s3 / that bound = {summary['s3_over_bound']:.2f}x"
            )
    if names["s3-sync"] in best and s3_name in best:
        summary["sync_over_overlapped"] = best[names["s3-sync"]] / best[s3_name]
        print(f"one PUT at a time / PUTs in flight = {summary['sync_over_overlapped']:.2f}x")
    if names["ngff-zarr"] in best and s3_name in best:
        summary["ngff_zarr_over_h5ngff"] = best[names["ngff-zarr"]] / best[s3_name]
        print(f"ngff-zarr s3 / h5ngff s3 = {summary['ngff_zarr_over_h5ngff']:.2f}x (target > 1)")
    print(
        json.dumps(
            {
                "best_seconds": best,
                "endpoint_cpu_seconds": {k: min(v) for k, v in endpoint_cpu.items()},
                "exact": exact,
                "shape": [150, y, x],
                "repeat": args.repeat,
                "latency_ms": args.latency_ms,
                "endpoint_core": args.endpoint_core,
                **summary,
            }
        )
    )
    return 0 if all(exact.values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
