"""Runtime checks that typing the boundaries added (issue 29, item 4), each with its control."""

from __future__ import annotations

import asyncio
import pickle

import kopf
import pytest

from h5ngff.errors import H5ngffError, OOMKilledError, WorkerFailedError
from h5ngff.operator.controller import handlers
from h5ngff.operator.kube import Kube, KubeError


class _Answering(Kube):
    """A Kube whose API answers ``answer`` to every call."""

    def __init__(self, answer: object) -> None:
        super().__init__(api=None)  # type: ignore[arg-type]
        self.answer = answer

    async def _call(self, *args: object, **kwargs: object) -> object:
        return self.answer


@pytest.mark.parametrize("answer", [{"metadata": {"name": "x"}}, None])
def test_a_json_object_or_a_404_is_what_get_create_and_patch_return(answer):
    kube = _Answering(answer)
    for call in (kube.get("/p"), kube.create("/p", {}), kube.patch_merge("/p", {})):
        assert asyncio.run(call) == answer


def test_negative_control_an_answer_that_is_no_json_object_is_a_kube_error():
    kube = _Answering(["not", "an", "object"])
    with pytest.raises(KubeError, match="GET /p: expected a JSON object. Got list instead."):
        asyncio.run(kube.get("/p"))


def test_handlers_refuse_an_object_without_a_namespace():
    assert handlers._namespace("ns") == "ns"
    with pytest.raises(kopf.PermanentError, match="namespaced"):
        handlers._namespace(None)


def test_worker_failures_declare_the_diagnosis_counts_and_keep_them_through_pickling():
    """backends/diagnostics.py sets them on any WorkerFailedError; the client gets them back from
    a worker through H5ngffError.__reduce__."""
    err = OOMKilledError("killed", worker="w1")
    assert (err.oom_kills, err.memory_terminations) == (0, 0)
    err.oom_kills, err.memory_terminations = 2, 1
    back = pickle.loads(pickle.dumps(err))
    assert type(back) is OOMKilledError and (back.oom_kills, back.memory_terminations, back.worker) == (2, 1, "w1")
    assert isinstance(back, WorkerFailedError) and str(back) == "killed"


def test_the_run_figures_a_failed_slab_carries_default_to_none():
    err = H5ngffError("x")
    assert err.totals is None and err.store_retries == 0 and err.summary is None
    err.store_retries = 3
    assert pickle.loads(pickle.dumps(err)).store_retries == 3
