"""Sources in a bucket (issue 44): the same conversion from local disk and from a loopback S3
endpoint, in one run, and the peers' ways of reading HDF5 over HTTP side by side.

    .venv/bin/python bench/s3_read.py [--scale 0.25] [--repeat 2] [--data-dir bench/data] [--stock-moto]

Cases (``--cases``): ``f32`` is the project's seed volume (bench/config.py: (150, Y, X) float32,
contiguous); ``u16-gzip`` the same volume as uint16 in (32, 128, 128) chunks, gzip 4 (the
libdeflate path); ``u16-blosc`` as blosc zstd bitshuffle (HDF5's own pipeline via hdf5plugin).
Each conversion writes one level to local disk ((64,64,64) chunks, blosc zstd 5 bitshuffle):
only where the source is read from differs. Target (issue 44): the bucket run at most 1.3x the
disk run, round by round.

The peers read the whole dataset, slab by slab, into memory (no conversion), each timed alone:
h5ngff's reader (the workers' code, one thread, the same slabs), h5py over an s3fs file object
(fsspec's readahead cache, 5 MiB blocks), h5py's ``ros3`` driver where h5py was built with it
(``h5py.registered_drivers()``), and h5py on the local file.

The endpoint is moto's server in its own process. moto reads a whole object for every ranged
GET (bench/moto_ranged.py says why), so by default it runs with that fixed; ``--stock-moto``
runs moto as it is, to show what that costs. The endpoint's own CPU is printed: it shares the
cores with the readers.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
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
CASES = {
    "f32": dict(dtype="float32", chunks=None, compression=None),
    "u16-gzip": dict(dtype="uint16", chunks=(32, 128, 128), compression="gzip"),
    "u16-blosc": dict(dtype="uint16", chunks=(32, 128, 128), compression="blosc"),
}


def make_source(path: Path, case: str, shape: tuple[int, ...]) -> None:
    import h5py
    import hdf5plugin
    from h5ngff.sample import write_sample

    spec = CASES[case]
    if spec["compression"] != "blosc":
        write_sample(str(path), "/volume/data", shape, spec["dtype"], spec["chunks"], spec["compression"])
        return
    plain = path.with_suffix(".plain.h5")
    write_sample(str(plain), "/volume/data", shape, spec["dtype"], spec["chunks"], None)
    with h5py.File(plain, "r") as src, h5py.File(path, "w") as dst:
        blosc = hdf5plugin.Blosc(cname="zstd", clevel=5, shuffle=hdf5plugin.Blosc.BITSHUFFLE)
        out = dst.create_dataset("/volume/data", shape=shape, dtype=spec["dtype"], chunks=spec["chunks"], **blosc)
        for z in range(0, shape[0], 32):
            out[z : z + 32] = src["/volume/data"][z : z + 32]
    plain.unlink()


def start_endpoint(stock: bool) -> tuple[subprocess.Popen, str]:
    sys.path.insert(0, str(ROOT))
    from bench.s3_write import free_port

    port = free_port()
    module = "moto.server" if stock else "bench.moto_ranged"
    proc = subprocess.Popen(
        [sys.executable, "-m", module, "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        cwd=ROOT,
    )
    import socket

    for _ in range(200):
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.1).close()
            return proc, f"http://127.0.0.1:{port}"
        except OSError:
            time.sleep(0.1)
    raise RuntimeError("the endpoint did not start")


def cpu(pid: int) -> float:
    import psutil

    t = psutil.Process(pid).cpu_times()
    return t.user + t.system


def convert(source: str, out: str, env: dict[str, str], extra: list[str]) -> tuple[float, dict]:
    argv = [sys.executable, "-m", "h5ngff.cli", "convert", source, out, "--levels", "1", "--chunks", "64,64,64"]
    argv += ["--compressor", CODEC, "--no-progress", "--json", *extra]
    t = time.perf_counter()
    proc = subprocess.run(argv, env=env, capture_output=True, text=True)
    seconds = time.perf_counter() - t
    if proc.returncode:
        raise RuntimeError(f"{argv[3:5]} failed ({proc.returncode}): {proc.stderr[-2000:]}")
    return seconds, json.loads(proc.stdout)


def same(a: str, b: str) -> bool:
    import numpy as np
    import zarr

    x, y = zarr.open_group(a, mode="r")["0"], zarr.open_group(b, mode="r")["0"]
    return all(np.array_equal(x[z : z + 64], y[z : z + 64]) for z in range(0, x.shape[0], 64))


PEER_READ = r"""
import sys, time, json, h5py, hdf5plugin, numpy as np
how, where, endpoint, slab = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
t = time.perf_counter()
if how == "h5ngff":
    from h5ngff.engine.sources import open_source
    from h5ngff.engine.stores import open_object_reader
    from h5ngff.spec import parse_spec
    opts = {"endpoint": endpoint, "allow_http": "true", "access_key_id": "bench", "secret_access_key": "bench-secret", "region": "us-east-1"}
    reader = open_source(parse_spec({"source": {"path": where, "dataset": "/volume/data", "storageOptions": opts}, "output": {"path": "x"}}), objects=open_object_reader).reader
    shape = reader.shape
    for z in range(0, shape[0], slab):
        region = (slice(z, min(z + slab, shape[0])),) + tuple(slice(0, n) for n in shape[1:])
        reader.for_region(region).read(region)
else:
    if how == "fsspec":
        import s3fs
        fs = s3fs.S3FileSystem(key="bench", secret="bench-secret", client_kwargs={"endpoint_url": endpoint})
        f = h5py.File(fs.open(where.removeprefix("s3://"), "rb", block_size=5 * 2**20, cache_type="readahead"), "r")
    elif how == "ros3":
        f = h5py.File(endpoint + "/" + where.removeprefix("s3://"), "r", driver="ros3", aws_region=b"us-east-1", secret_id=b"bench", secret_key=b"bench-secret")
    else:
        f = h5py.File(where, "r")
    ds = f["/volume/data"]
    out = np.empty((slab,) + ds.shape[1:], ds.dtype)
    for z in range(0, ds.shape[0], slab):
        n = min(slab, ds.shape[0] - z)
        ds.read_direct(out, np.s_[z : z + n], np.s_[0:n])
print(json.dumps({"seconds": time.perf_counter() - t}))
"""


def peer_read(how: str, where: str, endpoint: str, env: dict[str, str]) -> float | str:
    import h5py

    if how == "ros3" and "ros3" not in h5py.registered_drivers():
        return "absent (this h5py is built without ros3)"
    proc = subprocess.run(
        [sys.executable, "-c", PEER_READ, how, where, endpoint, "32"], env=env, capture_output=True, text=True
    )
    if proc.returncode:
        return f"failed: {proc.stderr.strip().splitlines()[-1][:120]}"
    return json.loads(proc.stdout)["seconds"]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--scale", type=float, default=0.25)
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--cases", default="f32,u16-gzip")
    ap.add_argument("--data-dir", default=str(ROOT / "bench" / "data"))
    ap.add_argument("--stock-moto", action="store_true", help="moto as it is: every ranged GET reads the whole object")
    ap.add_argument("--no-peers", action="store_true", help="only the two conversions")
    args = ap.parse_args()
    sys.path.insert(0, str(ROOT / "src"))
    sys.path.insert(0, str(ROOT))
    from bench.config import scaled_yx

    y, x = scaled_yx(args.scale)
    shape = (150, y, x)
    moto, endpoint = start_endpoint(args.stock_moto)
    env = {**os.environ, **KEY, "AWS_ENDPOINT_URL": endpoint, "AWS_ALLOW_HTTP": "true", "PYTHONPATH": str(ROOT / "src")}
    work = tempfile.mkdtemp(prefix="h5ngff-s3-read-")
    results: dict[str, dict] = {}
    try:
        import boto3

        client = boto3.client(
            "s3", endpoint_url=endpoint, region_name="us-east-1",
            aws_access_key_id=KEY["AWS_ACCESS_KEY_ID"], aws_secret_access_key=KEY["AWS_SECRET_ACCESS_KEY"],
        )  # fmt: skip
        client.create_bucket(Bucket="bench")
        for case in [c.strip() for c in args.cases.split(",") if c.strip()]:
            local = Path(args.data_dir) / f"s3-read-{case}-{args.scale:g}.h5"
            if not local.exists():
                local.parent.mkdir(parents=True, exist_ok=True)
                make_source(local, case, shape)
            client.upload_file(str(local), "bench", f"{case}.h5")
            url = f"s3://bench/{case}.h5"
            row: dict = {"bytes": local.stat().st_size, "disk": [], "bucket": [], "endpoint_cpu": [], "peaks": []}
            for r in range(args.repeat):
                disk_out, bucket_out = f"{work}/{case}-disk-{r}.ome.zarr", f"{work}/{case}-bucket-{r}.ome.zarr"
                seconds, _ = convert(f"{local}:/volume/data", disk_out, env, [])
                row["disk"].append(seconds)
                before = cpu(moto.pid)
                seconds, summary = convert(f"{url}:/volume/data", bucket_out, env, [])
                row["bucket"].append(seconds)
                row["endpoint_cpu"].append(cpu(moto.pid) - before)
                row["peaks"] += [(w["peak_rss"], summary["predicted_peak_per_worker"]) for w in summary["workers"]]
                row["exact"] = row.get("exact", True) and same(disk_out, bucket_out)
                print(f"{case} round {r + 1}: disk {row['disk'][-1]:.2f} s, bucket {seconds:.2f} s "
                      f"({seconds / row['disk'][-1]:.2f}x), endpoint CPU {row['endpoint_cpu'][-1]:.1f} s, exact {row['exact']}", flush=True)  # fmt: skip
                shutil.rmtree(disk_out, ignore_errors=True)
                shutil.rmtree(bucket_out, ignore_errors=True)
            if not args.no_peers:
                row["peers"] = {
                    "h5ngff reader (bucket)": peer_read("h5ngff", url, endpoint, env),
                    "h5py + s3fs file object (bucket)": peer_read("fsspec", url, endpoint, env),
                    "h5py ros3 driver (bucket)": peer_read("ros3", url, endpoint, env),
                    "h5py (local file)": peer_read("local", str(local), endpoint, env),
                }
                for name, value in row["peers"].items():
                    print(
                        f"{case} read whole: {name:36s} {value if isinstance(value, str) else f'{value:.2f} s'}",
                        flush=True,
                    )
            results[case] = row
    finally:
        moto.terminate()
        moto.wait()
        shutil.rmtree(work, ignore_errors=True)
    print(
        f"\nshape {shape}, one level, (64,64,64) chunks, {CODEC}; endpoint: {'stock moto' if args.stock_moto else 'moto, ranged GETs fixed (bench/moto_ranged.py)'}"
    )
    for case, row in results.items():
        ratios = [b / d for b, d in zip(row["bucket"], row["disk"])]
        print(f"| {case} | {row['bytes'] / 1e6:.0f} MB | disk {min(row['disk']):.2f} s | bucket {min(row['bucket']):.2f} s | "
              f"best/best {min(row['bucket']) / min(row['disk']):.2f}x | rounds {', '.join(f'{r:.2f}x' for r in ratios)} | "
              f"endpoint CPU {min(row['endpoint_cpu']):.1f} s | exact {row['exact']} | peak/plan "
              f"{max(p / q for p, q in row['peaks']):.2f} |")  # fmt: skip
    print(json.dumps(results, default=str))
    return 0 if all(r["exact"] for r in results.values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
