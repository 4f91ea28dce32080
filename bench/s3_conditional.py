"""Does an S3 endpoint support the conditional requests the one-writer lease needs
(engine/stores/s3lease.py)? Each through the client h5ngff uses (obstore), and DELETE through botocore
because obstore 0.12 has no conditional DELETE.

    .venv/bin/python bench/s3_conditional.py                      # a moto server on loopback
    .venv/bin/python bench/s3_conditional.py --endpoint http://minio.lab:9000 --bucket scratch

Prints one line per request with what the store answered; "as required" when it refused what
it must refuse. A store that answers 501, or accepts a second If-None-Match create, cannot hold
the lease: set the storage option lock=false only if nothing else writes the prefix.
"""

from __future__ import annotations

import argparse
import os
import sys
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _outcome(call) -> str:
    try:
        result = call()
    except Exception as exc:  # noqa: BLE001 - the answer is what we report
        return f"refused: {type(exc).__name__}: {str(exc).splitlines()[0][-120:]}"
    return f"accepted: {result}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--endpoint", help="an S3 endpoint (default: start moto's server on loopback)")
    parser.add_argument(
        "--bucket", help="an existing bucket to probe under a random prefix (default: a new one on moto)"
    )
    args = parser.parse_args()
    sys.path[:0] = [str(ROOT / "src"), str(ROOT / "tests")]
    import botocore.session
    import obstore

    from h5ngff.engine.stores.s3 import S3Store

    server = None
    if args.endpoint is None:
        from s3_server import start_moto

        server = start_moto()
        endpoint, options, bucket = server.url, server.options(), server.new_bucket()
    else:
        endpoint, bucket = args.endpoint, args.bucket
        options = {"endpoint": endpoint, "allow_http": "true"}
    prefix = f"h5ngff-probe-{uuid.uuid4().hex[:8]}"
    store = S3Store(bucket, prefix, options)._store
    first = obstore.put(store, "lock", b"one", mode="create")
    lines = [
        ("PUT If-None-Match: * (absent)", f"accepted: {first}"),
        (
            "PUT If-None-Match: * (exists)  must refuse",
            _outcome(lambda: obstore.put(store, "lock", b"two", mode="create")),
        ),
        (
            "PUT If-Match: wrong ETag       must refuse",
            _outcome(lambda: obstore.put(store, "lock", b"three", mode={"e_tag": '"' + "0" * 32 + '"'})),
        ),
    ]
    second = obstore.put(store, "lock", b"four", mode={"e_tag": first["e_tag"]})
    lines += [
        ("PUT If-Match: current ETag", f"accepted: {second}"),
        (
            "PUT If-Match: replaced ETag    must refuse",
            _outcome(lambda: obstore.put(store, "lock", b"five", mode={"e_tag": first["e_tag"]})),
        ),
        (
            "PUT If-Match: absent object    must refuse",
            _outcome(lambda: obstore.put(store, "nolock", b"x", mode={"e_tag": first["e_tag"]})),
        ),
    ]
    s3 = botocore.session.get_session().create_client(
        "s3",
        endpoint_url=endpoint,
        region_name=os.environ.get("AWS_REGION", "us-east-1"),
        **(
            {"aws_access_key_id": options["access_key_id"], "aws_secret_access_key": options["secret_access_key"]}
            if server
            else {}
        ),
    )
    key = f"{prefix}/lock"
    lines += [
        (
            "DELETE If-Match: wrong ETag    must refuse",
            _outcome(
                lambda: s3.delete_object(Bucket=bucket, Key=key, IfMatch='"' + "0" * 32 + '"')["ResponseMetadata"][
                    "HTTPStatusCode"
                ]
            ),
        ),
        (
            "DELETE If-Match: current ETag",
            _outcome(
                lambda: s3.delete_object(Bucket=bucket, Key=key, IfMatch=second["e_tag"])["ResponseMetadata"][
                    "HTTPStatusCode"
                ]
            ),
        ),
    ]
    obstore.delete(store, ["lock", "nolock"])
    for what, outcome in lines:
        print(f"{what:45s} {outcome}")
    if server is not None:
        server.server.stop()


if __name__ == "__main__":
    main()
