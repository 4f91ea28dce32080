"""``ConversionJobSpec``: the ``.spec`` of a ConversionJob = a ConversionSpec plus where it runs.

The conversion fields are inherited unchanged from :class:`~h5ngff.spec.ConversionSpec`, so the
CLI, ``h5ngff run job.yaml`` and the CRD schema share one model. The Kubernetes fields (``pod``,
``backoffLimit``, ``ttlSecondsAfterFinished``, ``retry``, ``activeDeadlineSeconds``) are used only by the operator, for the runner Job
and the Dask pods; ``h5ngff run`` ignores them. They live in their own ``pod`` section because the
conversion already has an ``image`` section (axes, scale, units), which a flat ``image: repo:tag``
would collide with.
Kubernetes objects that Kubernetes itself validates (volumes, tolerations) stay free-form dicts:
copying their schemas into our CRD would pin us to one Kubernetes version for no gain.
"""

from __future__ import annotations

import hashlib
import json
import posixpath
import re
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from .spec import ConversionSpec, SlurmSpec, _Model, parse_model

#: The ConversionJob resource, named once for the CRD, the operator's manifests, the Kubernetes
#: backend's owner references and ``h5ngff run``'s manifest check.
GROUP = "h5ngff.dev"
VERSION = "v1alpha1"
KIND = "ConversionJob"
PLURAL = "conversionjobs"
API_VERSION = f"{GROUP}/{VERSION}"
#: The ConversionBatch resource (operator/schema/batchspec.py), named here beside its twin so the
#: controller, the runner contract and the CLI agree on it without importing each other.
BATCH_KIND = "ConversionBatch"
BATCH_PLURAL = "conversionbatches"


@dataclass(frozen=True)
class Owner:
    """The ConversionJob that owns a run's children (runner Job, RBAC, Dask cluster): its identity
    as the API reports it, and which attempt the children belong to."""

    namespace: str
    name: str
    uid: str
    attempt: int = 1
    #: ConversionJob, or ConversionBatch (operator/schema/batchspec.py): the kind ownerReferences name.
    kind: str = KIND


#: Kubernetes Job defaults, chosen for memory-planned batch work: a run that failed twice for the
#: same reason (usually memory) will fail a third time, so retry twice, not Kubernetes' six.
DEFAULT_BACKOFF_LIMIT = 2
#: Retry backoff defaults (seconds), as the Spark operator's ``onFailureRetryInterval`` but
#: doubling: a lost node or a full volume is rarely fixed in less than ten seconds.
DEFAULT_RETRY_INTERVAL = 10
DEFAULT_MAX_RETRY_INTERVAL = 300

FreeForm = dict[str, Any]
#: At most this many volumes and volume mounts: bounds the CRD's CEL cost (operator/schema/admission.py).
MAX_VOLUMES = 64
#: Kubernetes' limit for volume names (a DNS label); also bounds the CRD's CEL cost.
MAX_VOLUME_NAME = 63
#: The emptyDir every runner and Dask pod gets at /tmp (k8s.with_scratch): no user volume may
#: take its name, or Kubernetes refuses the pod (duplicate volume names).
SCRATCH_VOLUME = "h5ngff-scratch"
#: A volumeMount's mountPath in normal form: absolute, no empty, ``.`` or ``..`` component and no
#: trailing slash. Kubernetes compares mountPaths as written, so ``/a`` and ``/a/`` pass its
#: uniqueness check and collide in the container; the CRD (a pattern) and the model (the same
#: pattern) refuse the second spelling alike, since CEL cannot normalise a path (issue 41).
MOUNT_PATH_PATTERN = r"^/$|^(/([^/.][^/]*|\.[^/.][^/]*|\.\.[^/]+))+$"


class PodSettings(_Model):
    """How the runner and worker pods run: image, storage, placement. PodSpec names and meanings."""

    image: str | None = Field(
        None, description="Container image of the runner, scheduler and worker pods (default: the operator's --image)."
    )
    image_pull_policy: Literal["Always", "IfNotPresent", "Never"] | None = Field(
        None, description="imagePullPolicy of every container."
    )
    working_dir: str | None = Field(
        None,
        description="Working directory of the runner and worker containers; relative source and output paths resolve against it.",
    )
    volumes: list[FreeForm] | None = Field(
        None,
        description="Pod volumes (e.g. PVCs holding the input and output), added to the runner and every worker pod.",
    )
    volume_mounts: list[FreeForm] | None = Field(
        None, description="Container volumeMounts for those volumes, in the runner and every worker container."
    )
    service_account_name: str | None = Field(
        None,
        description="Service account of the runner pod (workers get no API access); it must be allowed to manage DaskClusters and patch conversionjobs/status.",
    )
    node_selector: dict[str, str] | None = Field(None, description="nodeSelector of the runner and worker pods.")
    tolerations: list[FreeForm] | None = Field(
        None,
        description="Tolerations of the runner and worker pods; each taint key must be allowed by the operator's policy.allowedTolerationKeys.",
    )
    credentials_secret: str | None = Field(
        None,
        max_length=253,
        pattern=r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$",
        description="Name of a Secret in the job's own namespace whose AWS credential keys (AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, "
        "AWS_SESSION_TOKEN, AWS_REGION, AWS_DEFAULT_REGION, AWS_ENDPOINT_URL, AWS_ENDPOINT_URL_S3, AWS_ALLOW_HTTP; no others) "
        "become environment variables of the runner and every worker: credentials for an s3:// output.",
    )

    @field_validator("volumes", "volume_mounts")
    @classmethod
    def _named(cls, v: list[FreeForm] | None) -> list[FreeForm] | None:
        if v is not None and len(v) > MAX_VOLUMES:
            raise ValueError(f"Expected at most {MAX_VOLUMES} entries. Got {len(v)} instead.")
        for item in v or ():
            if not isinstance(item.get("name"), str) or not item["name"]:
                raise ValueError(f"Expected every entry to have a name. Got {item!r} instead.")
            if len(item["name"]) > MAX_VOLUME_NAME:
                raise ValueError(
                    f"Expected names of at most {MAX_VOLUME_NAME} characters, as Kubernetes requires. Got {item['name']!r} instead."
                )
        return v

    @model_validator(mode="after")
    def _mounts_name_volumes(self) -> "PodSettings":
        volumes = {v["name"] for v in self.volumes or ()}
        for mount in self.volume_mounts or ():
            if mount["name"] not in volumes:
                raise ValueError(
                    f"Expected every volumeMount to name one of the volumes {sorted(volumes)}. Got a mount of {mount['name']!r} instead."
                )
        return self

    @model_validator(mode="after")
    def _kubernetes_accepts(self) -> "PodSettings":
        """Shapes Kubernetes refuses in a Job (HTTP 422), or that collide with what the operator
        adds: refused here, so the job fails InvalidSpec at once instead of at create."""
        names = [v["name"] for v in self.volumes or ()]
        _no_repeats("spec.pod.volumes names", names)
        if SCRATCH_VOLUME in names:
            raise ValueError(
                f"Expected no volume named {SCRATCH_VOLUME!r}: the operator adds its scratch volume under that name. Rename it."
            )
        paths: list[str] = []
        for mount in self.volume_mounts or ():
            path = mount.get("mountPath")
            if not isinstance(path, str) or not re.fullmatch(MOUNT_PATH_PATTERN, path):
                normal = posixpath.normpath("/" + path.lstrip("/")) if isinstance(path, str) else None
                hint = (
                    f" (write {normal!r})"
                    if normal and normal.startswith("/") and ".." not in normal.split("/")
                    else ""
                )
                raise ValueError(
                    f"Expected every volumeMount's mountPath to be an absolute path in normal form: no trailing '/', "
                    f"no '//', '.' or '..' component{hint}. Got {path!r} instead."
                )
            paths.append(path)
        _no_repeats("spec.pod.volumeMounts mountPaths", paths)
        if self.image is not None and not self.image.strip():
            raise ValueError(
                "Expected spec.pod.image to name an image, or to be left out for the operator's. Got an empty string instead."
            )
        return self


def _no_repeats(what: str, values: list[Any]) -> None:
    repeated = sorted({v for v in values if values.count(v) > 1})
    if repeated:
        raise ValueError(
            f"Expected {what} to be unique, as Kubernetes requires. Got {repeated} more than once instead."
        )


class RetryPolicy(_Model):
    """How long the operator waits before each retry: ``intervalSeconds`` before the first,
    doubling per failed attempt of the run, at most ``maxIntervalSeconds``."""

    interval_seconds: int = Field(
        DEFAULT_RETRY_INTERVAL,
        ge=0,
        le=86400,
        description="Seconds before the first retry (default 10); doubled for each further one.",
    )
    max_interval_seconds: int = Field(
        DEFAULT_MAX_RETRY_INTERVAL, ge=0, le=86400, description="Longest wait between attempts (default 300)."
    )

    @model_validator(mode="after")
    def _ordered(self) -> "RetryPolicy":
        if self.max_interval_seconds < self.interval_seconds:
            raise ValueError(
                f"Expected maxIntervalSeconds (default {DEFAULT_MAX_RETRY_INTERVAL}) >= intervalSeconds ({self.interval_seconds}). "
                f"Got {self.max_interval_seconds} instead: raise retry.maxIntervalSeconds or lower retry.intervalSeconds."
            )
        return self

    def delay(self, failures: int) -> int:
        """Seconds to wait after the ``failures``-th failed attempt of a run (1, 2, ...)."""
        if failures < 1 or self.interval_seconds == 0:
            return 0
        return min(self.max_interval_seconds, self.interval_seconds * 2 ** min(failures - 1, 30))


class ConversionJobSpec(ConversionSpec):
    """A conversion, the pods that run it, and how often to retry."""

    pod: PodSettings = Field(default_factory=PodSettings)
    backoff_limit: int = Field(
        DEFAULT_BACKOFF_LIMIT,
        ge=0,
        le=20,
        description="Retries after a failed attempt (each resumes from the manifest); 0 = no retry. Default 2.",
    )
    ttl_seconds_after_finished: int | None = Field(
        None,
        ge=0,
        description="Delete finished runner Jobs (not the ConversionJob) this many seconds after they finish.",
    )
    retry: RetryPolicy = Field(
        default_factory=RetryPolicy,
        description="Backoff between attempts: exponential from intervalSeconds, capped at maxIntervalSeconds.",
    )
    active_deadline_seconds: int | None = Field(
        None,
        ge=1,
        description="End a run (all its attempts and waits) that takes longer than this many seconds, with reason DeadlineExceeded.",
    )
    slurm: SlurmSpec | None = Field(
        None,
        description="Worker jobs on a SLURM cluster, for `h5ngff run JOB.yaml --backend slurm` (docs/slurm.md); the operator ignores it.",
    )

    def conversion(self) -> ConversionSpec:
        """Only the conversion fields: what the runner plans and converts."""
        return ConversionSpec(**{name: getattr(self, name) for name in ConversionSpec.model_fields})

    def conversion_hash(self) -> str:
        """What the operator compares across edits: the normalised conversion fields and where the
        data is (volumes, mounts, working directory). Normalised: every field equal to its default
        is left out, so writing a default out, removing one, or a later build adding a field with
        a default hashes the same conversion the same way (none of these may re-run a finished
        conversion, least of all with overwrite). ``output.overwrite`` (what to do with an
        existing output) and how the pods run (image, placement, retries, deadline) are left out
        too, so editing them never re-runs a finished conversion."""
        return self._conversion_hash(exclude_defaults=True)

    def written_conversion_hash(self) -> str:
        """The hash as builds up to issue 41 computed it: the conversion fields *as written*, a
        default written out included. Only compared with a status such a build wrote."""
        return self._conversion_hash(exclude_defaults=False)

    def _conversion_hash(self, exclude_defaults: bool) -> str:
        written = self.model_dump(
            by_alias=True, exclude_unset=True, exclude_defaults=exclude_defaults, exclude_none=True, mode="json"
        )
        fields = {f.alias or name for name, f in ConversionSpec.model_fields.items()}
        wire = {k: v for k, v in written.items() if k in fields}
        return _hash(wire, written.get("pod") or {})

    def legacy_conversion_hash(self) -> str:
        """The hash as h5ngff up to 0.x computed it: every conversion field, defaults included.
        Only compared with a status such a build wrote; never recorded."""
        return _hash(self.conversion().to_wire(), self.pod.to_wire())


def _hash(conversion: dict[str, Any], pod: dict[str, Any]) -> str:
    wire = {**conversion, "output": {k: v for k, v in (conversion.get("output") or {}).items() if k != "overwrite"}}
    wire["where"] = {k: pod[k] for k in ("volumes", "volumeMounts", "workingDir") if k in pod}
    return hashlib.sha256(json.dumps(wire, sort_keys=True).encode()).hexdigest()[:16]


def parse_job_spec(data: Any) -> ConversionJobSpec:
    """Validate a ConversionJob ``.spec`` (a dict) into a ConversionJobSpec, or raise SpecError."""
    return parse_model(ConversionJobSpec, data)
