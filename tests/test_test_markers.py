"""The markers that sort the suite (README, "Development"): a test that asks for a fixture which
starts real parts outside the test's process carries ``integration``, so ``-m "not integration"``
runs pure code only.

The check reads the tests collected with it: in CI (the whole suite) and in the inner loop
(``-m "not slow"``) that is every module; run alone it sees only this file. Tests that start a
subprocess or the operator without such a fixture are marked by hand (module ``pytestmark``)."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

#: conftest.py's and slurm_local.py's fixtures that start a Dask cluster, an S3 server or SLURM.
INTEGRATION_FIXTURES = frozenset({"shared_cluster", "convert", "s3", "slurm_cluster"})


def unmarked(items) -> list[str]:
    """The node ids of items that use an integration fixture without the ``integration`` marker."""
    return [
        item.nodeid
        for item in items
        if INTEGRATION_FIXTURES & set(getattr(item, "fixturenames", ()))
        and item.get_closest_marker("integration") is None
    ]


def test_every_test_using_an_integration_fixture_is_marked_integration(request):
    missing = unmarked(request.session.items)
    assert not missing, f"add pytest.mark.integration (module pytestmark or a decorator) to: {missing}"


@dataclass
class FakeItem:
    nodeid: str
    fixturenames: list[str]
    markers: set[str] = field(default_factory=set)

    def get_closest_marker(self, name: str):
        return pytest.mark.integration if name in self.markers else None


def test_negative_control_an_unmarked_cluster_test_is_named():
    items = [
        FakeItem("t.py::uses_cluster", ["tmp_path", "convert"]),
        FakeItem("t.py::marked", ["s3"], {"integration"}),
        FakeItem("t.py::pure", ["tmp_path"]),
    ]
    assert unmarked(items) == ["t.py::uses_cluster"]
