"""The runner contract: everything the controller tells a runner pod, as one typed value.

The controller (``operator/controller``) builds a runner Job whose container environment is
``RunnerContract.to_env()``; the runner pod's program (``operator/runner``) reads it back with
``RunnerContract.from_env(os.environ)``. Nothing else passes between the two rooms: no variable
is named outside this module, and ``tests/test_operator_contract.py`` round-trips every field.

Why the environment (and not arguments or a mounted file): the spec is what ``kubectl get job -o
yaml`` shows a reviewer, the Dask pods inherit nothing from it, and a Job's environment cannot be
changed after creation, so each attempt runs exactly the contract it was created with.

Stdlib only: both rooms import it, and the controller imports nothing that converts.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from typing import Any, Mapping

from ..errors import RunnerContractError as ContractError
from ..jobspec import BATCH_KIND, KIND
from ..k8s import JOB_NAME_ENV, JOB_NAMESPACE_ENV, SAFE_PATH_ENV

#: The wire names, one per field (``to_env``'s keys). Kept stable across releases: a runner Job
#: created by the previous operator is run by the new image after an upgrade.
ENV = {
    "kind": "H5NGFF_KIND",
    "namespace": JOB_NAMESPACE_ENV,
    "name": JOB_NAME_ENV,
    "uid": "H5NGFF_JOB_UID",
    "attempt": "H5NGFF_ATTEMPT",
    "spec": "H5NGFF_SPEC",
    "backend": "H5NGFF_BACKEND",
    "items": "H5NGFF_ITEMS",
    "resume": "H5NGFF_RESUME",
    "metrics_port": "H5NGFF_METRICS_PORT",
    "metrics_linger": "H5NGFF_METRICS_LINGER",
    "pod_limit": "H5NGFF_POD_LIMIT",
}
__all__ = ["ENV", "SAFE_PATH_ENV", "RunnerContract", "ContractError"]
KINDS = (KIND, BATCH_KIND)
#: Backends a runner pod may be told to use (backends.factory's kinds that start their own
#: workers; ``local`` and ``local-pods`` are for tests and clusters without the Dask Operator).
DEFAULT_BACKEND = "kubernetes"
#: Seconds the runner keeps its metrics endpoint up after the attempt, until Prometheus has
#: scraped the final values once: two of the Helm chart's 15 s PodMonitor intervals.
DEFAULT_METRICS_LINGER = 30.0


@dataclass(frozen=True)
class RunnerContract:
    """One attempt of a ConversionJob or ConversionBatch, as its runner pod runs it."""

    #: ConversionJob or ConversionBatch: which program the runner runs and whose status it patches.
    kind: str
    namespace: str
    name: str
    uid: str
    attempt: int
    #: The spec in its wire form (JSON object), the image resolved and, for a resumed attempt of a
    #: ConversionJob, ``output.overwrite`` off.
    spec: Mapping[str, Any]
    backend: str = DEFAULT_BACKEND
    #: A batch attempt's item ids, and those of them it resumes (overwrite off).
    items: tuple[str, ...] = ()
    resume: tuple[str, ...] = ()
    #: The runner serves the attempt's Prometheus metrics on this port (None: no metrics).
    metrics_port: int | None = None
    metrics_linger: float = DEFAULT_METRICS_LINGER
    #: Overrides the planned pod limit (``local-pods`` backend only: experiments, negative controls).
    pod_limit: str | None = None

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ContractError("", f"Expected {ENV['kind']} to be one of {list(KINDS)}. Got {self.kind!r} instead.")
        if self.attempt < 1:
            raise ContractError("", f"Expected {ENV['attempt']} to be 1 or more. Got {self.attempt} instead.")
        if not set(self.resume) <= set(self.items):
            raise ContractError("", f"Expected {ENV['resume']} to name only items of {ENV['items']}.")

    @property
    def is_batch(self) -> bool:
        return self.kind == BATCH_KIND

    def to_env(self) -> dict[str, str]:
        """The container environment: every field under its ``ENV`` name (None and empty lists
        left out), plus ``SAFE_PATH_ENV``."""
        out: dict[str, str] = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if value is None or (isinstance(value, tuple) and not value):
                continue
            out[ENV[f.name]] = _text(value)
        return {**out, **SAFE_PATH_ENV}

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> "RunnerContract":
        """The contract a runner pod was started with; ContractError names what is missing or
        malformed. ``H5NGFF_KIND`` absent is a ConversionJob (Jobs of builds before the batch)."""
        return cls(
            kind=env.get(ENV["kind"]) or KIND,
            namespace=_required(env, "namespace"),
            name=_required(env, "name"),
            uid=env.get(ENV["uid"], ""),
            attempt=_number(env, "attempt", int, 1),
            spec=_spec(env),
            backend=env.get(ENV["backend"]) or DEFAULT_BACKEND,
            items=_ids(env.get(ENV["items"])),
            resume=_ids(env.get(ENV["resume"])),
            metrics_port=_number(env, "metrics_port", int, None),
            metrics_linger=_number(env, "metrics_linger", float, DEFAULT_METRICS_LINGER),
            pod_limit=env.get(ENV["pod_limit"]) or None,
        )

    def with_identity(self, **identity: Any) -> "RunnerContract":
        """The contract with namespace, name, uid or attempt replaced (``h5ngff runner``'s flags,
        for running a runner by hand)."""
        return dataclasses.replace(self, **{k: v for k, v in identity.items() if v is not None})


def _text(value: Any) -> str:
    if isinstance(value, tuple):
        return ",".join(value)
    if isinstance(value, Mapping):
        return json.dumps(dict(value), sort_keys=True)
    return str(value)


def _required(env: Mapping[str, str], field: str) -> str:
    value = env.get(ENV[field])
    if not value:
        raise ContractError("", f"Expected ${ENV[field]} (the operator sets it). Got nothing instead.")
    return value


def _number(env: Mapping[str, str], field: str, kind: type, default: Any) -> Any:
    text = env.get(ENV[field])
    if not text:
        return default
    try:
        return kind(text)
    except ValueError:
        raise ContractError("", f"Expected ${ENV[field]} to be a {kind.__name__}. Got {text!r} instead.") from None


def _spec(env: Mapping[str, str]) -> dict[str, Any]:
    text = _required(env, "spec")
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ContractError("", f"Expected JSON in ${ENV['spec']}. Got invalid JSON instead ({exc}).") from None
    if not isinstance(data, dict):
        raise ContractError("", f"Expected a JSON object in ${ENV['spec']}. Got {type(data).__name__} instead.")
    return data


def _ids(text: str | None) -> tuple[str, ...]:
    return tuple(i for i in (text or "").split(",") if i)
