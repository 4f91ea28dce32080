"""``ConversionBatchSpec``: the ``.spec`` of a ConversionBatch = a ConversionJob's spec whose
source is a list of items and whose output path is a template (docs/operator.md, ConversionBatch).

Everything a ConversionJob says about how to convert and where to run (output format, image
metadata, pyramid, resources, pod settings, retries, deadline) is inherited from
:class:`~h5ngff.jobspec.ConversionJobSpec` unchanged, so the two resources never drift apart.
What differs: ``items`` lists the sources (explicitly, as a GitOps repository lists them), and
``output.path`` is a template (``{stem}``, ``{name}``, ``{parent}``; h5ngff.batch.items) that an
item may override with its own ``output``.

Each item becomes the ConversionJobSpec one ConversionJob would have (``item_specs``), so the
admission rules, the tenant policy, the output lease key and the conversion hash are the job's.
"""

from __future__ import annotations

import hashlib
import posixpath
from dataclasses import dataclass
from typing import Any

from pydantic import Field, model_validator

from ...batch.items import BatchItem, output_key, refuse_collisions, render_output, template_fix
from ...errors import SpecError
from ...jobspec import BATCH_KIND, BATCH_PLURAL, ConversionJobSpec, RetryPolicy, parse_job_spec
from ...spec import SourceSpec, _FieldError, _Model, parse_model, url_scheme

__all__ = ["BATCH_KIND", "BATCH_PLURAL", "ConversionBatchSpec", "PlannedItem", "item_id", "parse_batch_spec"]
#: At most this many items: a status entry per item must fit in one etcd object (1.5 MiB), and
#: the CRD's CEL cost is bounded by the list's length.
MAX_ITEMS = 1000


class BatchItemSpec(_Model):
    """One conversion of the batch: its source, and where it goes unless the template says."""

    source: SourceSpec
    output: str | None = Field(
        None,
        min_length=1,
        max_length=4096,
        description="This item's output path (or s3:// URL); default: spec.output.path with this source's {stem}, {name} and {parent}.",
    )


@dataclass(frozen=True)
class PlannedItem:
    """An item as the operator and the runner see it: its id (stable while its output stays),
    the ConversionJobSpec one ConversionJob would have, and the batch.items view of it."""

    id: str
    spec: ConversionJobSpec
    item: BatchItem

    @property
    def output(self) -> str:
        return self.spec.output.path

    def conversion_hash(self) -> str:
        return self.spec.conversion_hash()


class ConversionBatchSpec(ConversionJobSpec):
    """Many conversions with one set of settings, run by one runner on one Dask cluster."""

    # A batch's sources are its items'; pydantic lets a subclass narrow a field to "absent".
    source: None = Field(None, description="Not used by a ConversionBatch: each of spec.items names its source.")  # type: ignore[assignment]
    items: list[BatchItemSpec] = Field(
        max_length=MAX_ITEMS,
        description="The conversions: each a source, and optionally its own output path. "
        "An item added is converted; one removed is not deleted; a finished one never runs again unless its conversion changes.",
    )
    items_in_flight: int = Field(
        2,
        ge=1,
        le=64,
        description="Items converted at once on the batch's one Dask cluster (default 2): the next items' slabs fill the "
        "workers an item's last single-slab passes leave idle. More suits many workers and small items (docs/batch.md).",
    )

    @model_validator(mode="after")
    def _no_job_only_fields(self) -> "ConversionBatchSpec":
        # A ConversionJob's deadline and retry backoff are the job reconciler's; the batch's
        # reconciler has neither yet, and a field accepted and then ignored would be a lie. Their
        # defaults pass: the runner gets the spec in its wire form, defaults written out.
        for given, field in (
            (self.active_deadline_seconds is not None, "activeDeadlineSeconds"),
            (self.retry != RetryPolicy(), "retry"),
        ):
            if given:
                raise _FieldError(
                    field,
                    f"Expected no {field} on a ConversionBatch: a batch does not support it yet (each item is retried "
                    "at once, up to backoffLimit times). Remove it, or convert the items as ConversionJobs.",
                )
        return self

    @model_validator(mode="after")
    def _no_collisions(self) -> "ConversionBatchSpec":
        try:
            self.planned_items()
        except SpecError as exc:  # named by field, as the job's model-level checks are
            raise _FieldError(exc.field, _message(exc)) from None
        return self

    def item_source_path(self, item: BatchItemSpec) -> str:
        """The source file as the pods see it (relative paths resolve against workingDir; an
        object in a bucket is its URL)."""
        path = item.source.path
        if url_scheme(path) is None and not posixpath.isabs(path) and self.pod.working_dir:
            path = posixpath.join(self.pod.working_dir, path)
        return path

    def planned_items(self) -> list[PlannedItem]:
        """Every item with its own ConversionJobSpec (what the user wrote for the batch, the
        item's source and its rendered output), checked for two items on one output, one output
        inside another, or an output over its source, before anything starts."""
        written = self.model_dump(
            by_alias=True,
            exclude_unset=True,
            exclude_none=True,
            mode="json",
            exclude={"items", "source", "items_in_flight"},
        )
        out = []
        for n, item in enumerate(self.items):
            path = self.item_source_path(item)
            try:
                output = render_output(item.output or self.output.path, path)
                data: dict[str, Any] = {
                    **written,
                    "source": item.source.model_dump(by_alias=True, exclude_unset=True, exclude_none=True, mode="json"),
                    "output": {**written.get("output", {}), "path": output},
                }
                spec = parse_job_spec(data)
            except SpecError as exc:
                where = "output" if item.output else "output.path"
                field = exc.field if exc.field.startswith(("source", "output.path")) else where
                raise SpecError(
                    f"items[{n}].{field}" if field != "output.path" or item.output else field, _message(exc)
                ) from None
            where = self.output_where(output)
            out.append(PlannedItem(item_id(where), spec, BatchItem(_source_text(item.source, path), path, where)))
        refuse_collisions(
            (p.item for p in out),
            "give each of them an output of its own (items[].output), or "
            + template_fix().replace("the template", "output.path's template"),
        )
        return out

    def output_where(self, output: str) -> str:
        """An output as the pods see it: a URL as is, a relative path under workingDir."""
        if url_scheme(output) is None and not posixpath.isabs(output) and self.pod.working_dir:
            return posixpath.join(self.pod.working_dir, output)
        return output


def item_id(output: str) -> str:
    """An item's id: a hash of its output's one spelling (h5ngff.batch.items.output_key), short
    enough to be a status map key. Items are told apart by output: two items of one batch never
    share one (refuse_collisions), and an edit of an item's source keeps its id (a re-run)."""
    return hashlib.sha256(output_key(output).encode()).hexdigest()[:12]


def _source_text(source: SourceSpec, path: str) -> str:
    """The source as ``h5ngff convert`` names it (FILE:/dataset), for reports."""
    return f"{path}:{source.dataset}" if source.dataset else path


def _message(exc: SpecError) -> str:
    return str(exc).removeprefix(f"{exc.field}: ")


def parse_batch_spec(data: Any) -> ConversionBatchSpec:
    """Validate a ConversionBatch ``.spec`` (a dict), or raise SpecError naming the field."""
    return parse_model(ConversionBatchSpec, data)
