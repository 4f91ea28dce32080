"""What a run whose workers died says (backends/diagnostics.classify_failure): the reason a user
can act on, and a message that reads after the CLI's ``error (REASON):`` prefix."""

from __future__ import annotations

from distributed.scheduler import KilledWorker

from h5ngff.backends.diagnostics import ClusterEvents, classify_failure
from h5ngff.errors import NannyTerminatedError, OOMKilledError
from h5ngff.units import MiB


def _died() -> KilledWorker:
    return KilledWorker("slab-(0, 0, 0)", "tcp://127.0.0.1:1", allowed_failures=2)


def test_a_nanny_termination_is_named_once_with_its_figures():
    events = ClusterEvents(memory_restarts=[{"rss": 300 * MiB}, {"rss": 310 * MiB}])
    err = classify_failure(_died(), events, pod_limit=400 * MiB, memory_limit=320 * MiB)
    assert isinstance(err, NannyTerminatedError) and err.memory_terminations == 2
    # The CLI prints "error (NannyTerminated): <message>": the message must not say it again.
    assert str(err).startswith("Dask's nanny terminated a worker at 310.0 MiB"), str(err)
    assert "NannyTerminated" not in str(err)


def test_a_kernel_kill_comes_first_even_with_terminations_beside_it():
    events = ClusterEvents(memory_restarts=[{"rss": 300 * MiB}])
    err = classify_failure(_died(), events, pod_limit=400 * MiB, memory_limit=320 * MiB, oom_kills=3)
    assert isinstance(err, OOMKilledError) and err.oom_kills == 3 and err.memory_terminations == 1
    assert str(err).startswith("OOMKilled by the kernel (pod limit 400 MiB)"), str(err)
