"""Shared fixtures: real HDF5 files, real Dask clusters, real Zarr stores. Nothing here is mocked."""

from __future__ import annotations

import logging
import os
import signal
from typing import Any

import h5py
import numpy as np
import pytest

from h5ngff.backends.cgroups import cgroups_available
from h5ngff.backends.external import ExternalBackend
from h5ngff.backends.local import LocalBackend
from h5ngff.runner import plan_job, run_job
from h5ngff.spec import parse_spec


# The commands the tests start write to a pipe, and their tables are as wide as a pipe's (100
# columns) unless COLUMNS says otherwise: a COLUMNS exported by the developer's shell or set by a
# test runner (pytest-xdist's workers) narrowed them and cut the words the tests look for. A test
# that wants a width sets it in the command's environment.
os.environ.pop("COLUMNS", None)
os.environ.pop("LINES", None)


logging.getLogger("distributed").setLevel(logging.ERROR)


# A shell without job control starts a background command (`scripts/test &`, a CI step run in the
# background) with SIGINT ignored, and every process the tests start inherits that: the Ctrl-C
# tests' conversions would then never see their SIGINT. The tests start from Python's default.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)


def write_h5(path, data: np.ndarray, dataset: str = "/volume/data", **create_kwargs) -> str:
    """A real HDF5 file holding ``data`` (create_kwargs go to h5py's create_dataset)."""
    with h5py.File(path, "w") as f:
        f.create_dataset(dataset, data=data, **create_kwargs)
    return str(path)


def smooth(shape, dtype="uint16", seed=0) -> np.ndarray:
    """Compressible test data with every value distinct enough to catch misplaced chunks."""
    rng = np.random.default_rng(seed)
    grids = np.meshgrid(*[np.arange(n) for n in shape], indexing="ij")
    base = sum((i + 1) * g for i, g in enumerate(grids)).astype(np.float64)
    dt = np.dtype(dtype)
    if dt.kind == "b":
        return (base.astype(np.int64) % 3) == 0
    if dt.kind in "iu":
        info = np.iinfo(dt)
        span = float(info.max) - float(info.min)
        values = info.min + (base * 7919 + rng.integers(0, 97, size=shape)) % max(2.0, min(span, 2.0**52))
        return values.astype(dt)
    return (base / 7.0 + rng.standard_normal(shape)).astype(dt)


def spec_for(h5: str, out: str, dataset: str = "/volume/data", **sections: Any):
    data = {"source": {"path": h5, "dataset": dataset}, "output": {"path": out}}
    for key, value in sections.items():
        data.setdefault(key, {}).update(value)
    return parse_spec(data)


@pytest.fixture(scope="session")
def shared_cluster():
    """One real LocalCluster (2 worker processes) reused by tests that convert many small files."""
    from distributed import LocalCluster

    cluster = LocalCluster(
        n_workers=2,
        threads_per_worker=1,
        memory_limit="2GiB",
        processes=True,
        dashboard_address=None,
        silence_logs=logging.ERROR,
    )
    yield cluster
    cluster.close()


@pytest.fixture
def convert(shared_cluster):
    """Run the real runner (spec -> plan -> backend -> engine) against the shared cluster."""

    def run(spec, backend=None, listeners=None):
        backend = backend or ExternalBackend(shared_cluster.scheduler_address)
        job = plan_job(spec, backend)
        return run_job(job, backend, listeners)

    return run


@pytest.fixture
def local_backend():
    return LocalBackend()


requires_cgroups = pytest.mark.skipif(
    cgroups_available() is not None, reason=f"memory cgroups unavailable: {cgroups_available()}"
)


def pytest_configure(config):
    """One seed for every hypothesis test of the run, drawn here unless --hypothesis-seed gives it,
    and printed in the header: a failure in CI is repeated with ``--hypothesis-seed=N``."""
    from hypothesis import core

    given = config.getoption("--hypothesis-seed", default=None)
    seed = int(given) if given is not None else int.from_bytes(os.urandom(4), "little")
    core.global_force_seed = seed
    config._h5ngff_hypothesis_seed = seed


def pytest_report_header(config):
    from properties import PROFILE

    reason = cgroups_available()
    seed = getattr(config, "_h5ngff_hypothesis_seed", None)
    return [
        f"h5ngff: memory cgroups {'available' if reason is None else 'unavailable: ' + reason}",
        f"cpus: {os.cpu_count()}",
        f"property tests: profile {PROFILE!r} (H5NGFF_PROPERTY_PROFILE), hypothesis seed {seed} "
        f"(repeat with --hypothesis-seed={seed})",
    ]


@pytest.fixture(scope="session")
def s3():
    """A real S3 endpoint on 127.0.0.1 (moto server mode), once per session (tests/s3_server.py)."""
    # No skip: moto[server] is a test dependency, and a skip here once hid a missing install step
    # (a clean clone ran every object-store test as skipped).
    from s3_server import start_moto

    endpoint = start_moto()
    yield endpoint
    endpoint.server.stop()
