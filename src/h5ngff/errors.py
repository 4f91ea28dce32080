"""One error hierarchy for everything a user can act on.

Each class also inherits the matching stdlib exception (as zarr's errors do), so callers that
catch ``ValueError`` or ``OSError`` keep working. ``reason`` is the short CamelCase word that the
operator writes into a ConversionJob's status and the CLI prints in ``--json`` output; messages
quote the real numbers and say what to change.
"""

from __future__ import annotations

from enum import IntEnum
from typing import Any


class ExitCode(IntEnum):
    """The ``h5ngff`` exit status: one table, printed by ``h5ngff --help`` and in the README."""

    #: What the status means, in the words of the table.
    meaning: str

    def __new__(cls, value: int, meaning: str) -> "ExitCode":
        member = int.__new__(cls, value)
        member._value_ = value
        member.meaning = meaning
        return member

    OK = 0, "done (verify: everything checked out)"
    FAILED = 1, "the run failed (a worker was killed, the disk filled, the cluster was lost); verify found problems"
    BAD_INPUT = 2, "bad input: usage, flags, spec, manifest or source; nothing was written"
    OUTPUT_REFUSED = 3, "the output exists and cannot be resumed, or cannot be written; nothing was changed"
    INTERRUPTED = 130, "interrupted (Ctrl-C); re-run the same command to resume"
    BROKEN_PIPE = 141, "stdout was closed early (e.g. | head); like any Unix tool"
    TERMINATED = 143, "terminated (SIGTERM: kill, a deleted pod, scancel); re-run the same command to resume"


def exit_code_table() -> str:
    return "\n".join(f"{int(code):>3}  {code.meaning}" for code in ExitCode)


class H5ngffError(Exception):
    """Base class of every error h5ngff raises on purpose."""

    reason = "Error"
    #: The CLI's exit code for this family (the table is ExitCode above).
    exit_code: int = ExitCode.FAILED
    #: The runner's summary of the failed run (figures per worker), where it got that far: a
    #: ``runner.RunSummary``, which lives layers above this module (so it cannot be named here).
    summary: Any = None
    #: A failed run's totals so far (``engine.write.driver.RunTotals``, a layer above), set by the driver.
    totals: Any = None
    #: Object store requests a failed slab retried before it failed, set by the slab task.
    store_retries: int = 0

    def __reduce__(self) -> tuple[Any, ...]:
        # Errors raised in a Dask worker are pickled back to the client; subclasses with richer
        # constructors must survive that round trip with their message and attributes intact.
        # A client-side run summary stays behind: it is no part of the error's identity.
        state = {k: v for k, v in self.__dict__.items() if k != "summary"}
        return (_rebuild, (type(self), str(self), state))


def _rebuild(cls: type[H5ngffError], message: str, state: dict[str, Any]) -> H5ngffError:
    err = cls.__new__(cls)
    Exception.__init__(err, message)
    err.__dict__.update(state)
    return err


class SpecError(H5ngffError, ValueError):
    """A ConversionSpec field has a value that is not allowed."""

    reason = "InvalidSpec"
    exit_code = ExitCode.BAD_INPUT

    def __init__(self, field: str, message: str):
        self.field = field
        super().__init__(f"{field}: {message}" if field else message)


class PolicyDeniedError(SpecError):
    """A ConversionJob asks for more than the cluster admin's tenant policy allows."""

    reason = "PolicyDenied"


class RunnerContractError(SpecError):
    """A runner pod's environment is not a runner contract this build can run (a hand-made Job,
    or an operator of another release); operator/contract.py."""


class PlanError(H5ngffError, ValueError):
    """The spec is valid but no plan can satisfy it."""

    reason = "InvalidSpec"
    exit_code = ExitCode.BAD_INPUT


class BudgetTooSmallError(PlanError):
    """No slab fits the memory budget; the message names the smallest budget that works."""

    reason = "BudgetTooSmall"

    def __init__(self, message: str, minimum_bytes: int):
        self.minimum_bytes = minimum_bytes
        super().__init__(message)


class SourceError(H5ngffError, OSError):
    """The HDF5 input cannot be read as a convertible dataset."""

    reason = "SourceUnreadable"
    exit_code = ExitCode.BAD_INPUT


class SourceNotFoundError(SourceError, FileNotFoundError):
    pass


class DatasetNotFoundError(SourceError, LookupError):
    pass


class SourceUnavailableError(SourceError):
    """A source in an object store stopped answering (throttled, 5xx, timeouts) after every retry,
    or changed while it was read: the run failed and resumes once the store answers again."""

    reason = "SourceUnavailable"
    exit_code = ExitCode.FAILED


class UnsupportedDatasetError(SourceError, TypeError):
    pass


class OutputError(H5ngffError, OSError):
    """The output location cannot be written."""

    reason = "OutputUnwritable"
    exit_code = ExitCode.OUTPUT_REFUSED


class StoreRefusedError(OutputError):
    """An object store refused a request for good (403 AccessDenied, no such bucket, a bad key):
    ``code`` is S3's word for it, ``detail`` the store's own first line. The source readers turn it
    into their own message (engine.sources.objects); an output's message is this one's."""

    def __init__(self, message: str, code: str = "", detail: str = ""):
        self.code = code
        self.detail = detail
        super().__init__(message)


class StoreUnavailableError(OutputError):
    """An object store request still failed after its retries (throttling, 5xx, timeouts)."""


class StoreObjectChangedError(OutputError):
    """A ranged read pinned to an object's ETag (If-Match) found another object there (412)."""


class CredentialsError(OutputError):
    """An object-store output's AWS configuration names a profile that does not exist, is broken,
    or yields no credentials: refused before anything is read or written (engine/stores/awsconfig)."""


class OutputConflictError(OutputError, FileExistsError):
    """The output exists and is not a resumable h5ngff output of the same spec."""

    reason = "OutputConflict"


class OutputBusyError(OutputConflictError):
    """Another run holds the output's lock (engine.write.lock); the message names it. Transient: the
    output is free again once that run ends, so the operator may retry it."""

    reason = "OutputBusy"


class DiskFullError(OutputError):
    """The output's device filled up during the run: a failed run, resumable once space is freed."""

    reason = "DiskFull"
    exit_code = ExitCode.FAILED


class WorkerFailedError(H5ngffError, RuntimeError):
    """A Dask worker died while running a slab; subclasses say who killed it."""

    reason = "WorkerFailed"
    oom_kills = memory_terminations = 0  #: the run's counts, set by backends.diagnostics.classify_failure

    def __init__(self, message: str, worker: str | None = None, slab: str | None = None):
        self.worker = worker
        self.slab = slab
        #: What the run's diagnosis counted (backends/diagnostics.py): workers the kernel
        #: OOM-killed, and workers Dask's nanny terminated at its memory threshold.
        self.oom_kills = 0
        self.memory_terminations = 0
        super().__init__(message)


class OOMKilledError(WorkerFailedError):
    """The kernel killed a worker at its pod (cgroup) memory limit."""

    reason = "OOMKilled"


class NannyTerminatedError(WorkerFailedError):
    """Dask's nanny terminated a worker at its ``terminate`` memory threshold."""

    reason = "NannyTerminated"


class WorkersLostError(WorkerFailedError):
    """Every worker of the cluster is gone and none came back."""

    reason = "WorkersLost"


class CgroupUnavailableError(H5ngffError, OSError):
    """Pod limits were asked for but no memory cgroup can be created here."""

    reason = "CgroupUnavailable"
    exit_code = ExitCode.BAD_INPUT


class UnalignedWriteError(H5ngffError, RuntimeError):
    """A block does not cover whole chunks or shards: writing it would give a unit two writers."""

    reason = "UnalignedWrite"


class VerificationError(H5ngffError, ValueError):
    """``h5ngff verify`` found bad metadata or chunks."""

    reason = "VerificationFailed"


class OutputNotFoundError(H5ngffError, FileNotFoundError):
    """``h5ngff verify`` was given an output path that does not exist."""

    reason = "OutputNotFound"
    exit_code = ExitCode.BAD_INPUT


class ClusterError(H5ngffError, RuntimeError):
    """The Dask cluster could not be started or reached."""

    reason = "ClusterUnavailable"


class WorkersPendingError(ClusterError):
    """The cluster's scheduler (SLURM) kept the worker jobs pending past the run's timeout; the
    message quotes its pending reason (Resources, Priority, QOSMaxMemoryPerJob, ...)."""

    reason = "WorkersPending"

    def __init__(self, message: str, reasons: str = ""):
        self.pending_reasons = reasons
        super().__init__(message)
