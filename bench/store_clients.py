"""Which S3 client should the object store use? Time whole-object PUTs of chunk-sized objects
(the engine's only write) through obstore, s3fs and plain botocore against one loopback moto
server, in one run, with the same thread count as a worker's slab threads.

    .venv/bin/python bench/store_clients.py [--objects 96] [--size-mib 1] [--threads 2]
    .venv/bin/python bench/store_clients.py --memory   # RSS of h5ngff's S3 store (obstore) per process
    .venv/bin/python bench/store_clients.py --memory --profile   # the same, configured by an AWS profile (+ botocore)

Prints one line per client: seconds, MiB/s and peak RSS growth. moto is a Python server on the
same 2 cores, so absolute figures are moto's; the ratio between clients is what decides.
"""

from __future__ import annotations

import argparse
import os
import resource
import socket
import time
from concurrent.futures import ThreadPoolExecutor

os.environ.setdefault("AWS_ACCESS_KEY_ID", "bench")
os.environ.setdefault("AWS_SECRET_ACCESS_KEY", "bench")
os.environ.setdefault("AWS_DEFAULT_REGION", "us-east-1")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def obstore_put(endpoint, bucket):
    import obstore
    from obstore.store import S3Store

    store = S3Store(bucket, endpoint=endpoint, region="us-east-1", client_options={"allow_http": True})
    return lambda key, data: obstore.put(store, key, data, use_multipart=False)


def s3fs_put(endpoint, bucket):
    import s3fs

    fs = s3fs.S3FileSystem(endpoint_url=endpoint, skip_instance_cache=True)
    return lambda key, data: fs.pipe_file(f"{bucket}/{key}", data)


def botocore_put(endpoint, bucket):
    import botocore.session
    from botocore.config import Config

    client = botocore.session.get_session().create_client(
        "s3", endpoint_url=endpoint, config=Config(max_pool_connections=16)
    )
    return lambda key, data: client.put_object(Bucket=bucket, Key=key, Body=data)


def run(name, put, objects, data, threads) -> None:
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    put(f"{name}/warm", data)
    t = time.perf_counter()
    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(lambda i: put(f"{name}/c/{i}", data), range(objects)))
    s = time.perf_counter() - t
    grow = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024
    print(
        f"{name:9s} {objects} x {len(data) / 2**20:.1f} MiB, {threads} threads: {s:6.2f} s  {objects * len(data) / 2**20 / s:7.1f} MiB/s  peak RSS +{grow:.0f} MiB",
        flush=True,
    )


def rss_mib() -> float:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS")) / 1024


def memory(endpoint: str, threads: int, profile: bool = False) -> None:
    """RSS that h5ngff's S3 store adds to a process that already has a worker's imports; with
    ``profile``, configured by an AWS profile in shared files (botocore reads them)."""
    import tempfile
    import threading

    import dask  # noqa: F401 - the worker's own imports come first, they are not the client's
    import distributed  # noqa: F401
    import h5py  # noqa: F401
    import numpy  # noqa: F401
    import zarr  # noqa: F401

    before = rss_mib()
    from h5ngff.engine.stores import open_store

    options = {"endpoint": endpoint, "allow_http": "true", "region": "us-east-1"}
    if profile:  # the endpoint, region and keys from a profile: botocore is imported and read
        d = tempfile.mkdtemp()
        with open(os.path.join(d, "config"), "w") as f:
            f.write(f"[profile bench]\nregion = us-east-1\nendpoint_url = {endpoint}\n")
        with open(os.path.join(d, "credentials"), "w") as f:
            f.write("[bench]\naws_access_key_id = bench\naws_secret_access_key = bench\n")
        os.environ.update(
            AWS_CONFIG_FILE=os.path.join(d, "config"), AWS_SHARED_CREDENTIALS_FILE=os.path.join(d, "credentials")
        )
        options = {"profile": "bench", "allow_http": "true"}
    store = open_store("s3://bench/memory", options)
    opened = rss_mib()
    data = os.urandom(2**20)
    workers = [
        threading.Thread(target=lambda i=i: [store.put(f"{threads}/{i}/{k}", data) for k in range(40)])
        for i in range(threads)
    ]
    for t in workers:
        t.start()
    for t in workers:
        t.join()
    print(
        f"{'profile, ' if profile else ''}{threads} writer thread(s): import + client {opened - before:.1f} MiB, after 40 x 1 MiB PUTs each {rss_mib() - before:.1f} MiB, "
        f"OS threads {len(os.listdir('/proc/self/task'))}",
        flush=True,
    )


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument(
        "--memory",
        action="store_true",
        help="Measure the RSS of h5ngff's S3 store instead (1, 2 and 4 writer threads).",
    )
    ap.add_argument(
        "--profile",
        action="store_true",
        help="With --memory: configure the store by an AWS profile in shared files (botocore).",
    )
    ap.add_argument("--memory-child", nargs=3, help=argparse.SUPPRESS)
    ap.add_argument("--objects", type=int, default=96)
    ap.add_argument("--size-mib", type=float, default=1.0)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    if args.memory_child:
        return memory(args.memory_child[0], int(args.memory_child[1]), args.memory_child[2] == "profile")
    import subprocess
    import sys

    import botocore.session

    # moto in its own process: it keeps every object in memory, which must not count as the client's.
    port = free_port()
    server = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    endpoint = f"http://127.0.0.1:{port}"
    try:
        for _ in range(100):
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.1).close()
                break
            except OSError:
                time.sleep(0.1)
        botocore.session.get_session().create_client("s3", endpoint_url=endpoint).create_bucket(Bucket="bench")
        if args.memory:
            src = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "src")
            for threads in (1, 2, 4):  # a fresh process each: RSS only grows
                subprocess.run(
                    [
                        sys.executable,
                        __file__,
                        "--memory-child",
                        endpoint,
                        str(threads),
                        "profile" if args.profile else "env",
                    ],
                    check=True,
                    env={**os.environ, "PYTHONPATH": src},
                )
            return
        data = os.urandom(int(args.size_mib * 2**20))
        clients = {"obstore": obstore_put, "s3fs": s3fs_put, "botocore": botocore_put}
        for _round in range(args.rounds):  # interleaved rounds: moto's growing state hits every client alike
            for name, make in clients.items():
                run(f"{name}", make(endpoint, "bench"), args.objects, data, args.threads)
    finally:
        server.terminate()
        server.wait()


if __name__ == "__main__":
    main()
