"""A process finds its own memory cgroup through the mount that shows it (issue 43).

Inside a container without a cgroup namespace (cgroup v1 under podman or Docker), /proc/self/cgroup
names the host's path, /libpod_parent/libpod-<id>, while the container sees that very cgroup
mounted at /sys/fs/cgroup/memory. Looked up at the named path, a Dask nanny found no cgroup, read
0 OOM kills, and an existing cluster's report said none happened. The mountinfo and cgroup lines
below are the ones read inside a podman container on this machine kind; tests/test_image.py
checks the same in the built image, where the kernel really kills.
"""

from __future__ import annotations

import os

from h5ngff.backends.base import Session
from h5ngff.backends.cgroups import cgroup_dir, cgroup_mounts, own_cgroup_dir
from h5ngff.backends.diagnostics import ClusterEvents

CONTAINER = "/libpod_parent/libpod-2edb0ab55a08"
PROC_CGROUP = f"4:memory:{CONTAINER}\n0::/\n"
CONTAINER_MOUNTINFO = (
    "97 92 0:30 / /sys/fs/cgroup ro,nosuid,nodev,noexec - tmpfs tmpfs rw,mode=755\n"
    f"101 97 0:32 {CONTAINER} /sys/fs/cgroup/memory ro,nosuid,nodev,noexec,relatime - cgroup cgroup rw,memory\n"
    f"102 97 0:33 {CONTAINER} /sys/fs/cgroup/cpu ro,nosuid,nodev,noexec,relatime - cgroup cgroup rw,cpu\n"
)
HOST_MOUNTINFO = (
    "35 31 0:32 / /sys/fs/cgroup/memory rw,relatime - cgroup cgroup rw,memory\n"
    "41 31 0:38 / /sys/fs/cgroup/unified rw,relatime - cgroup2 cgroup2 rw\n"
)


def test_a_container_sees_its_cgroup_at_the_mount_point(tmp_path):
    mountinfo = tmp_path / "mountinfo"
    mountinfo.write_text(CONTAINER_MOUNTINFO)
    assert cgroup_mounts(str(mountinfo)) == {1: [(CONTAINER, "/sys/fs/cgroup/memory")], 2: []}
    assert cgroup_dir(CONTAINER, [(CONTAINER, "/sys/fs/cgroup/memory")]) == ["/sys/fs/cgroup/memory/"]
    # a child of the container's cgroup (a pod emulated inside it) is below the mount point
    assert cgroup_dir(CONTAINER + "/pod-1", [(CONTAINER, "/m")]) == ["/m/pod-1"]
    # a cgroup outside what the mount shows is not there at all (not a prefix of a longer name)
    assert cgroup_dir(CONTAINER + "x/pod", [(CONTAINER, "/m")]) == []


def test_the_host_layout_is_unchanged(tmp_path):
    mountinfo = tmp_path / "mountinfo"
    mountinfo.write_text(HOST_MOUNTINFO)
    mounts = cgroup_mounts(str(mountinfo))
    assert mounts == {1: [("/", "/sys/fs/cgroup/memory")], 2: [("/", "/sys/fs/cgroup/unified")]}
    assert cgroup_dir("/process_api/abc", mounts[1]) == ["/sys/fs/cgroup/memory/process_api/abc"]


def test_mountinfo_escapes_are_undone(tmp_path):
    mountinfo = tmp_path / "mountinfo"
    mountinfo.write_text("1 0 0:1 /a\\040b /sys/fs/cgroup/mem\\040ory rw - cgroup cgroup rw,memory\n")
    assert cgroup_mounts(str(mountinfo))[1] == [("/a b", "/sys/fs/cgroup/mem ory")]


def test_this_process_finds_its_own_cgroup_as_before():
    """On the machine the suite runs on, with the real files: where the old lookup (the named
    path under the usual mount point) found a cgroup, the new one finds the same."""
    found = own_cgroup_dir()
    old = own_cgroup_dir(mountinfo="/nonexistent")  # no mounts listed: the usual mount points
    assert found == old
    if found is not None:
        assert os.path.isdir(found[1])


def _exit(name: str, kills: int, limit: int | None) -> dict:
    return {"name": name, "nanny": f"tcp://{name}", "exitcode": -9, "oom_kills": kills, "cgroup_limit": limit}


def test_an_existing_clusters_report_quotes_the_limit_its_workers_ran_under():
    """The nannies' exit reports carry their cgroup's limit; an existing cluster's session
    (limits_from_workers) reports it, where the plan's pod limit would be a guess. Negative
    control: a session of our own pods keeps the plan's figure."""
    from test_helm import _plan

    plan = _plan()
    limit = 125 << 20
    events = ClusterEvents(exits=[_exit("w0", 1, limit), _exit("w0", 2, limit), _exit("w1", 1, limit)])
    existing = Session(client=None, backend="external", limits_from_workers=True)  # type: ignore[arg-type]
    reports = existing.worker_reports(plan, {"w0": 90 << 20, "w1": 80 << 20}, events)
    assert [(r.name, r.oom_kills, r.pod_limit) for r in reports] == [("w0", 2, limit), ("w1", 1, limit)]
    error = existing.diagnose(RuntimeError("KilledWorker"), events, plan, reports)
    assert error.reason == "OOMKilled" and "(pod limit 125 MiB)" in str(error), str(error)
    assert error.oom_kills == 3

    ours = Session(client=None, backend="kubernetes")  # type: ignore[arg-type]
    reports = ours.worker_reports(plan, {"w0": 90 << 20, "w1": 80 << 20}, events)
    assert {r.pod_limit for r in reports} == {plan.memory.pod_limit}
    assert f"(pod limit {plan.memory.pod_limit >> 20} MiB)" in str(ours.diagnose(RuntimeError(), events, plan, reports))
