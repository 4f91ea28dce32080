"""Storage options and messages of an s3:// output: bad values are exit 2 with 'Expected ... Got
... instead.', a hung endpoint fails within a bounded time with a notice per retry, and the
messages say what to do (no credentials, no bucket, the s3 extra missing)."""

from __future__ import annotations

import logging
import socket
import subprocess
import sys
import threading
import time

import pytest

from h5ngff.engine.stores import open_store
from h5ngff.engine.stores.base import RetryPolicy
from h5ngff.engine.stores.options import ATTEMPTS, RETRY_DEADLINE_S, TIMEOUT_S, worst_case_seconds
from h5ngff.errors import CredentialsError, ExitCode, OutputError, SpecError
from s3_server import CREDENTIALS, FaultProxy

CLI = [sys.executable, "-m", "h5ngff.cli"]


@pytest.mark.parametrize(
    "option, value, expected",
    [
        ("retries", "0", "Expected retries to be a whole number of at least 1. Got '0' instead."),
        ("retries", "-1", "Expected retries to be a whole number of at least 1. Got '-1' instead."),
        ("lock_ttl", "abc", "Expected lock_ttl to be seconds between 1 and 3600. Got 'abc' instead."),
        ("lock", "flase", "Expected lock to be true or false. Got 'flase' instead."),
        ("timeout", "soon", "Expected timeout to be a positive duration"),
        ("endpiont", "http://x", "Got 'endpiont' instead. Did you mean endpoint?"),
    ],
)
def test_a_bad_storage_option_is_bad_input_with_what_is_expected(option, value, expected):
    with pytest.raises(SpecError) as err:
        open_store(f"s3://some-bucket/{option}", {option: value})
    assert err.value.exit_code == ExitCode.BAD_INPUT and expected in str(err.value)
    assert "Debug" not in str(err.value) and "UnknownConfigurationKey" not in str(err.value)


@pytest.mark.slow
@pytest.mark.integration
def test_the_cli_refuses_retries_0_and_a_missing_bucket_with_exit_2(tmp_path):
    from conftest import smooth, write_h5

    h5 = write_h5(tmp_path / "in.h5", smooth((8, 16, 16), "uint16"))
    for url, flags in (("s3://b/x.ome.zarr", ["--storage-option", "retries=0"]), ("s3://", [])):
        proc = subprocess.run(
            CLI + ["convert", f"{h5}:/volume/data", url, "--no-progress", *flags],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert proc.returncode == ExitCode.BAD_INPUT, proc.stderr
        assert "Traceback" not in proc.stderr and "Expected" in proc.stderr and "instead" in proc.stderr


def test_the_default_bound_on_a_request_is_under_two_minutes():
    """Computed from the defaults (not waited for): the last retry starts before the deadline and
    runs at most one request timeout."""
    assert RetryPolicy().deadline == RETRY_DEADLINE_S and RetryPolicy().attempts == ATTEMPTS
    assert worst_case_seconds() == RETRY_DEADLINE_S + TIMEOUT_S < 120
    assert worst_case_seconds({"timeout": "5s"}) == RETRY_DEADLINE_S + 5


class _Silent:
    """A TCP server on loopback that accepts every connection and never answers."""

    def __enter__(self):
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.held: list[socket.socket] = []
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        threading.Thread(target=self._accept, daemon=True).start()
        return self

    def _accept(self):
        while True:
            try:
                self.held.append(self.sock.accept()[0])
            except OSError:
                return

    def __exit__(self, *exc):
        self.sock.close()
        for conn in self.held:
            conn.close()


@pytest.mark.slow
def test_an_endpoint_that_never_answers_fails_in_bounded_time_with_a_notice_per_retry(caplog):
    from h5ngff.engine.stores.s3 import S3Store

    with _Silent() as silent, caplog.at_level(logging.INFO, "h5ngff.engine.stores.base"):
        store = S3Store(
            "bucket",
            "out",
            {"endpoint": silent.url, "allow_http": "true", **CREDENTIALS, "timeout": "1s", "retries": "3"},
        )
        t = time.monotonic()
        with pytest.raises(OutputError, match="still failing after 3 attempts"):
            store.put("a", b"data")
        assert time.monotonic() - t < 3 * 1 + 3  # three 1 s timeouts and their backoff
    notices = [r for r in caplog.records if r.levelno == logging.WARNING and "retry" in r.getMessage()]
    assert len(notices) == 2, [r.getMessage() for r in caplog.records]


@pytest.mark.slow
@pytest.mark.integration
def test_the_cli_says_so_on_stderr_while_an_endpoint_hangs(tmp_path):
    from conftest import smooth, write_h5

    h5 = write_h5(tmp_path / "in.h5", smooth((8, 16, 16), "uint16"))
    with _Silent() as silent:
        flags = [
            f
            for kv in ("allow_http=true", f"endpoint={silent.url}", "timeout=1s", "retries=2", "lock=false")
            for f in ("--storage-option", kv)
        ]
        t = time.monotonic()
        proc = subprocess.run(
            CLI + ["convert", f"{h5}:/volume/data", "s3://bucket/x.ome.zarr", "--no-progress", *flags],
            capture_output=True,
            text=True,
            timeout=120,
            env={
                "AWS_ACCESS_KEY_ID": "a",
                "AWS_SECRET_ACCESS_KEY": "b",
                "AWS_REGION": "us-east-1",
                "PATH": "/usr/bin:/bin",
                **_env_base(),
            },
        )
    assert proc.returncode == ExitCode.OUTPUT_REFUSED, proc.stderr
    assert "retry 1 of 1" in proc.stderr and "still failing after 2 attempts" in proc.stderr
    assert time.monotonic() - t < 60


def _env_base() -> dict[str, str]:
    import os

    return {k: v for k, v in os.environ.items() if k in ("PYTHONPATH", "HOME", "VIRTUAL_ENV", "LANG")}


@pytest.mark.integration
def test_no_credentials_says_where_they_are_looked_for(s3, monkeypatch, tmp_path):
    from h5ngff.engine.stores.s3 import S3Store

    for name in (
        "AWS_ACCESS_KEY_ID",
        "AWS_SECRET_ACCESS_KEY",
        "AWS_SESSION_TOKEN",
        "AWS_PROFILE",
        "AWS_WEB_IDENTITY_TOKEN_FILE",
    ):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_METADATA_SERVICE_TIMEOUT", "1")
    store = S3Store(
        s3.new_bucket(),
        "x",
        {"endpoint": s3.url, "allow_http": "true", "region": "us-east-1", "timeout": "2s", "retries": "1"},
    )
    with pytest.raises(CredentialsError) as err:
        store.put("a", b"data")
    message = str(err.value)
    assert (
        "no AWS credentials were found" in message
        and "AWS_ACCESS_KEY_ID" in message
        and "~/.aws/credentials" in message
    )
    assert "s3:PutObject" not in message


def test_without_the_s3_extra_the_error_names_it(monkeypatch):
    from h5ngff.engine import stores

    monkeypatch.setitem(sys.modules, "obstore", None)  # import obstore -> ModuleNotFoundError
    monkeypatch.delitem(sys.modules, "h5ngff.engine.stores.s3", raising=False)
    monkeypatch.setattr(stores, "_open", {})
    with pytest.raises(SpecError, match=r"pip install 'h5ngff\[s3\]'") as err:
        open_store("s3://bucket/no-extra", {})
    assert err.value.exit_code == ExitCode.BAD_INPUT


@pytest.mark.slow
@pytest.mark.integration
def test_a_store_that_stays_unavailable_advises_what_any_command_can_do(s3):
    from h5ngff.engine.stores.s3 import S3Store

    with FaultProxy(s3.url) as proxy:
        proxy.faults.add("503", 100, "GET")
        store = S3Store(s3.new_bucket(), "x", {**s3.options(proxy.url), "retries": "2"})
        with pytest.raises(OutputError) as err:
            store.get("zarr.json")
    assert "re-run the same command to resume" not in str(err.value) and "a verify checks the output afresh" in str(
        err.value
    )
