"""An existing Dask cluster (``--scheduler tcp://…``): h5ngff plans for the workers it finds.

The cluster's own memory_limit and thresholds stay as they are; the plan must fit inside them,
and the summary shows the measured peaks against the plan as everywhere else.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Iterator

from distributed import Client
from distributed.comm.addressing import parse_address, parse_host_port
from distributed.comm.registry import get_backend

from ..errors import ClusterError, SpecError
from ..planner.model import Capacity, Plan
from ..spec import ConversionSpec
from .base import Description, Session, connect
from .diagnostics import register_plugins


def check_address(address: str) -> str:
    """Refuse an address no Dask scheduler can have, before anything starts: Dask's client fails
    on one only inside its connection attempt, with a traceback, and then waits out its timeout."""
    try:
        scheme, location = parse_address(address)  # Dask's own parsers (tcp:// when no scheme is given)
        get_backend(scheme)  # built in, or a transport a package registers (distributed-ucxx's ucxx://)
        if scheme in ("tcp", "tls", "ws", "wss"):
            parse_host_port(location)
    except ValueError as exc:
        raise SpecError(
            "--scheduler",
            f"{address!r} is not a Dask scheduler address ({exc}). Expected tcp://HOST:PORT, e.g. tcp://10.0.0.5:8786.",
        ) from None
    return address


class ExternalBackend:
    name = "external"

    def __init__(self, address: str, timeout: float = 30):
        self.address = check_address(address)
        self.timeout = timeout

    def _connect(self) -> Client:
        try:
            return connect(self.address, timeout=self.timeout)
        except OSError as exc:
            raise ClusterError(
                f"--scheduler: cannot reach the Dask scheduler at {self.address!r} ({exc}). Is it running, and is the address right?"
            ) from None

    def workers(self) -> dict[str, dict[str, Any]]:
        # A client of its own, closed at once: planning (``h5ngff plan --scheduler``) may never
        # open a session, and a client left open would try to reconnect once the cluster is gone.
        with self._connect() as client:
            workers: dict[str, dict[str, Any]] = client.scheduler_info(n_workers=-1)["workers"]
            return workers

    def capacity(self) -> Capacity:
        workers = self.workers()
        if not workers:
            raise ClusterError(
                f"--scheduler: the cluster at {self.address!r} has no workers. Start some workers first."
            )
        threads = sum(w.get("nthreads", 1) for w in workers.values())
        memory = sum(w.get("memory_limit") or 0 for w in workers.values())
        return Capacity(cores=threads, memory_bytes=memory, default_workers=len(workers))

    def memory_limit(self) -> int | None:
        limits = [int(w["memory_limit"]) for w in self.workers().values() if w.get("memory_limit")]
        return min(limits) if limits else None

    def fit(self, spec: ConversionSpec) -> ConversionSpec:
        """On an existing cluster the workers are what they are: plan for their count, threads
        and (unless the spec sets a memory budget) their smallest memory limit."""
        capacity = self.capacity()
        workers = capacity.default_workers or 1
        resources = spec.resources.model_copy(
            update={"workers": workers, "threads_per_worker": max(1, capacity.cores // workers)}
        )
        limit = self.memory_limit()
        if limit and spec.resources.memory_per_worker is None and spec.resources.memory_total is None:
            resources = resources.model_copy(update={"memory_per_worker": limit})
        return spec.model_copy(update={"resources": resources})

    def describe(self, spec: ConversionSpec, plan: Plan) -> Description:
        return Description()  # the plan was fitted to the workers there are: nothing to add

    @contextmanager
    def session(self, plan: Plan) -> Iterator[Session]:
        with self._connect() as client:
            register_plugins(client)
            yield Session(client, self.name, limits_from_workers=True, workers_outlive_the_run=True)
