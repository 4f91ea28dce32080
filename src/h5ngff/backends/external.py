"""An existing Dask cluster (``--scheduler tcp://…``): h5ngff plans for the workers it finds.

The cluster's own memory_limit and thresholds stay as they are; the plan must fit inside them,
and the summary shows the measured peaks against the plan as everywhere else.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

from distributed import Client

from ..errors import ClusterError
from ..planner.model import Capacity, Plan
from .base import Session
from .diagnostics import register_plugins


class ExternalBackend:
    name = "external"

    def __init__(self, address: str, timeout: float = 30):
        self.address = address
        self.timeout = timeout
        self._client: Client | None = None

    def _connect(self) -> Client:
        if self._client is None:
            try:
                self._client = Client(self.address, timeout=self.timeout, set_as_default=False)
            except OSError as exc:
                raise ClusterError(f"--scheduler: cannot reach the Dask scheduler at {self.address!r} ({exc}). Is it running, and is the address right?") from None
        return self._client

    def workers(self) -> dict:
        return self._connect().scheduler_info(n_workers=-1)["workers"]

    def capacity(self) -> Capacity:
        workers = self.workers()
        if not workers:
            raise ClusterError(f"--scheduler: the cluster at {self.address!r} has no workers. Start some workers first.")
        threads = sum(w.get("nthreads", 1) for w in workers.values())
        memory = sum(w.get("memory_limit") or 0 for w in workers.values())
        return Capacity(cores=threads, memory_bytes=memory, default_workers=len(workers))

    def memory_limit(self) -> int | None:
        limits = [w.get("memory_limit") for w in self.workers().values() if w.get("memory_limit")]
        return min(limits) if limits else None

    @contextmanager
    def session(self, plan: Plan) -> Iterator[Session]:
        client = self._connect()
        register_plugins(client)
        try:
            yield Session(client, "external")
        finally:
            client.close()
            self._client = None
