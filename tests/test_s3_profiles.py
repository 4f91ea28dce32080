"""The standard AWS configuration chain for s3:// outputs (engine/stores/awsconfig.py): a profile
in real AWS config and credentials files (botocore reads them; nothing of it is mocked) points at
the real moto endpoint, with every AWS_* variable scrubbed, and ``h5ngff convert`` writes through
it, chosen by AWS_PROFILE or by ``--storage-option profile=``; the Dask workers resolve the
profile themselves. Negative controls: the same run without the profile fails before anything is
written with the clear error (no credentials), a missing profile is refused naming the profile and
the files searched, and an http:// endpoint without allow_http is refused up front."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import zarr

from conftest import smooth, write_h5
from h5ngff.engine.stores.awsconfig import resolve_chain
from h5ngff.errors import CredentialsError, ExitCode, SpecError
from s3_server import CREDENTIALS

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[1]
CLI = [sys.executable, "-m", "h5ngff.cli"]
SHAPE = (16, 64, 48)


@pytest.fixture(scope="module")
def aws_files(s3, tmp_path_factory):
    """A config file whose profile 'moto' gets its endpoint from a services section and its keys
    from the credentials file; profile 'elsewhere' has a region and an endpoint of its own."""
    d = tmp_path_factory.mktemp("aws")
    (d / "config").write_text(
        f"[profile moto]\nregion = eu-central-1\nservices = local-s3\n\n"
        f"[services local-s3]\ns3 =\n  endpoint_url = {s3.url}\n\n"
        "[profile elsewhere]\nregion = ap-south-1\nendpoint_url = http://127.0.0.1:9\n"
    )
    (d / "credentials").write_text(
        f"[moto]\naws_access_key_id = {CREDENTIALS['access_key_id']}\n"
        f"aws_secret_access_key = {CREDENTIALS['secret_access_key']}\n\n"
        "[elsewhere]\naws_access_key_id = other-key\naws_secret_access_key = other-secret\n"
    )
    return d


def scrubbed_env(aws_files: Path, **extra: str) -> dict[str, str]:
    """The process environment without any AWS_* variable and with a HOME of no ~/.aws: only the
    files (and ``extra``) configure AWS. Instance metadata off, so 'no credentials' is quick."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    env.update(
        HOME=str(aws_files),
        AWS_CONFIG_FILE=str(aws_files / "config"),
        AWS_SHARED_CREDENTIALS_FILE=str(aws_files / "credentials"),
        AWS_EC2_METADATA_DISABLED="true",
        PYTHONPATH=str(ROOT / "src") + os.pathsep + os.environ.get("PYTHONPATH", ""),
        **extra,
    )
    return env


@pytest.fixture
def aws_env(aws_files, monkeypatch):
    """This process's environment scrubbed the same way (for the in-process chain checks)."""
    for key in [k for k in os.environ if k.startswith("AWS_")]:
        monkeypatch.delenv(key)
    for key, value in scrubbed_env(aws_files).items():
        if key.startswith("AWS_") or key == "HOME":
            monkeypatch.setenv(key, value)
    return monkeypatch


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    data = smooth(SHAPE, "uint16", seed=14)
    return write_h5(tmp_path_factory.mktemp("src") / "in.h5", data), data


def convert(h5: str, url: str, env: dict[str, str], *flags: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        CLI + ["convert", f"{h5}:/volume/data", url, "--no-progress", "--workers", "1", *flags],
        capture_output=True,
        text=True,
        env=env,
        timeout=180,
    )


def read_back(s3, url: str) -> np.ndarray:
    from zarr.storage import FsspecStore

    store = FsspecStore.from_url(
        url,
        storage_options={
            "endpoint_url": s3.url,
            "key": CREDENTIALS["access_key_id"],
            "secret": CREDENTIALS["secret_access_key"],
        },
        read_only=True,
    )
    return zarr.open_group(store, mode="r")["0"][...]


@pytest.mark.slow
@pytest.mark.parametrize("how", ["AWS_PROFILE", "storage option"])
def test_a_profile_in_the_aws_files_writes_through_its_endpoint(source, s3, aws_files, how):
    h5, data = source
    bucket = s3.new_bucket()
    url = f"s3://{bucket}/by-profile.ome.zarr"
    if how == "AWS_PROFILE":
        env, flags = scrubbed_env(aws_files, AWS_PROFILE="moto", AWS_ALLOW_HTTP="true"), []
    else:
        env, flags = (
            scrubbed_env(aws_files),
            ["--storage-option", "profile=moto", "--storage-option", "allow_http=true"],
        )
    proc = convert(h5, url, env, *flags)
    assert proc.returncode == 0, proc.stderr
    np.testing.assert_array_equal(read_back(s3, url), data)
    verify = subprocess.run(
        CLI + ["verify", url, "--source", f"{h5}:/volume/data", *flags],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert verify.returncode == 0, verify.stdout + verify.stderr
    assert "h5ngff-test-secret" not in proc.stdout + proc.stderr + verify.stdout + verify.stderr


@pytest.mark.slow
def test_without_the_profile_the_same_run_has_no_credentials_and_writes_nothing(source, s3, aws_files):
    """Negative control of the test above: the files alone name no credentials for 'default'."""
    h5, _ = source
    bucket = s3.new_bucket()
    proc = convert(
        h5,
        f"s3://{bucket}/x.ome.zarr",
        scrubbed_env(aws_files, AWS_ALLOW_HTTP="true"),
        "--storage-option",
        f"endpoint={s3.url}",
    )
    assert proc.returncode == ExitCode.OUTPUT_REFUSED, proc.stderr
    assert (
        "no AWS credentials" in proc.stderr
        and "'default'" in proc.stderr
        and str(aws_files / "credentials") in proc.stderr
    )
    assert "predicted peak RSS" not in proc.stdout and s3.keys(bucket) == {}


@pytest.mark.slow
@pytest.mark.parametrize("how", ["AWS_PROFILE", "storage option"])
def test_a_missing_profile_is_refused_before_anything_is_written(source, s3, aws_files, how):
    h5, _ = source
    bucket = s3.new_bucket()
    url = f"s3://{bucket}/x.ome.zarr"
    if how == "AWS_PROFILE":
        proc = convert(h5, url, scrubbed_env(aws_files, AWS_PROFILE="nope", AWS_ALLOW_HTTP="true"))
    else:
        proc = convert(h5, url, scrubbed_env(aws_files), "--storage-option", "profile=nope")
    assert proc.returncode == ExitCode.OUTPUT_REFUSED, proc.stderr
    message = " ".join(proc.stderr.split())
    assert (
        "AWS profile 'nope'" in message
        and str(aws_files / "config") in message
        and str(aws_files / "credentials") in message
    )
    assert "profiles there: elsewhere, moto" in message and "OutputUnwritable" in message
    assert "add [profile nope] to the config file" in message  # printed as text, not eaten as rich markup
    assert "predicted peak RSS" not in proc.stdout and s3.keys(bucket) == {}


def test_precedence_is_options_then_environment_then_profile(s3, aws_env):
    """The AWS order, read by botocore from the real files: AWS_PROFILE's keys lose to the keys
    in the environment, an explicit profile (the storage option, like the CLI's --profile) wins
    over them; AWS_REGION and AWS_ENDPOINT_URL win over the profile's; explicit options win over
    all (they are never replaced)."""
    aws_env.setenv("AWS_PROFILE", "moto")
    chain = resolve_chain("s3://b/x", {}, None)
    assert (chain.region, chain.endpoint) == ("eu-central-1", s3.url)  # the services section
    assert (
        chain.credentials()["access_key_id"] == CREDENTIALS["access_key_id"]
        and chain.credentials()["expires_at"] is None
    )
    explicit = resolve_chain("s3://b/x", {}, "elsewhere")
    assert (explicit.region, explicit.endpoint, explicit.credentials()["access_key_id"]) == (
        "ap-south-1",
        "http://127.0.0.1:9",
        "other-key",
    )
    aws_env.setenv("AWS_ACCESS_KEY_ID", "env-key")
    aws_env.setenv("AWS_SECRET_ACCESS_KEY", "env-secret")
    aws_env.setenv("AWS_REGION", "us-west-2")
    aws_env.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:8")
    chain = resolve_chain("s3://b/x", {}, None)
    assert (chain.region, chain.credentials()["access_key_id"]) == ("us-west-2", "env-key")
    assert chain.endpoint == "http://127.0.0.1:8"
    assert resolve_chain("s3://b/x", {}, "elsewhere").credentials()["access_key_id"] == "other-key"
    assert (
        resolve_chain("s3://b/x", {"access_key_id": "opt-key"}, "elsewhere").credentials is None
    )  # explicit keys: nothing to resolve
    assert "other-secret" not in repr(resolve_chain("s3://b/x", {}, "elsewhere"))


@pytest.mark.slow
def test_the_store_takes_region_and_endpoint_from_the_profile_unless_given(s3, aws_env):
    from h5ngff.engine.stores.s3 import S3Store

    aws_env.setenv("AWS_ALLOW_HTTP", "true")
    store = S3Store(s3.new_bucket(), "p", {"profile": "moto"})
    assert store._store.config["endpoint"] == s3.url and store._store.config["region"] == "eu-central-1"
    store.put("a", b"1")
    assert store.get("a") == b"1"
    given = S3Store("b", "p", {"profile": "moto", "region": "us-east-1", "endpoint": "http://127.0.0.1:7"})
    assert given._store.config["endpoint"] == "http://127.0.0.1:7" and given._store.config["region"] == "us-east-1"


def test_a_broken_profile_and_a_plain_http_endpoint_are_refused_up_front(s3, aws_env, aws_files):
    from h5ngff.engine.stores.s3 import S3Store

    with pytest.raises(SpecError, match="allow_http"):  # the profile's endpoint is http://, AWS_ALLOW_HTTP is unset
        S3Store("b", "p", {"profile": "moto"})
    (aws_files / "broken").write_text("[profile broken]\nservices = absent\n")
    aws_env.setenv("AWS_CONFIG_FILE", str(aws_files / "broken"))
    with pytest.raises(CredentialsError, match="profile 'broken'.*services"):
        S3Store("b", "p", {"profile": "broken", "allow_http": "true"})
