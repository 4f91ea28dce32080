"""Memory cgroups: emulate a Kubernetes pod's memory limit on this machine, and read the counters
of the cgroup a process lives in (inside a real pod, or inside an emulated one).

The kernel enforces a cgroup's limit exactly as it does for a pod under kubelet: when the group
cannot reclaim below its limit, the OOM killer SIGKILLs the largest process in it and counts an
``oom_kill``. Both cgroup v1 (``memory.limit_in_bytes``) and v2 (``memory.max``) are supported.
"""

from __future__ import annotations

import logging
import os
import re
import time
import uuid
from dataclasses import dataclass

from ..errors import CgroupUnavailableError

log = logging.getLogger(__name__)

V1_ROOT = "/sys/fs/cgroup/memory"
#: The memory.stat counters a pod cannot give back under pressure (no swap, as kubelet runs pods),
#: per cgroup version. v1's ``total_*`` are hierarchical (the pod and any children). ``rss`` and
#: v2's ``anon`` already include transparent huge pages (cgroup-v1/memory.rst: "includes
#: transparent hugepages"), so ``rss_huge``/``anon_thp`` are not added again. Shared memory (tmpfs,
#: /dev/shm) is file-backed but, without swap, as pinned as anonymous memory; the kernel keeps it
#: out of ``dirty`` (shmem does no dirty accounting), so nothing is counted twice. ``unevictable``
#: (mlocked and ramfs pages) may overlap anon for mlocked anonymous pages; h5ngff locks none.
NONRECLAIMABLE_KEYS = {
    1: (
        ("total_rss", "rss"),
        ("total_shmem", "shmem"),
        ("total_dirty", "dirty"),
        ("total_writeback", "writeback"),
        ("total_unevictable", "unevictable"),
    ),
    2: (("anon",), ("shmem",), ("file_dirty",), ("file_writeback",), ("unevictable",)),
}
#: The names of the terms above, in the same order, whatever the version.
NONRECLAIMABLE_TERMS = ("anon", "shmem", "dirty", "writeback", "unevictable")


def nonreclaimable_terms(stat: dict[str, int], version: int) -> dict[str, int]:
    """The pod's non-reclaimable memory by term, from its memory.stat (bytes)."""
    out = {}
    for term, keys in zip(NONRECLAIMABLE_TERMS, NONRECLAIMABLE_KEYS[version]):
        out[term] = next((stat[k] for k in keys if k in stat), 0)
    return out


V2_ROOTS = ("/sys/fs/cgroup", "/sys/fs/cgroup/unified")


def _read(path: str) -> str:
    with open(path) as f:
        return f.read()


def _write(path: str, value: str) -> None:
    with open(path, "w") as f:
        f.write(value)


def _own_paths(proc_cgroup: str = "/proc/self/cgroup") -> tuple[str | None, str | None]:
    """(v1 memory path, v2 path) of this process, relative to their hierarchies' roots."""
    v1 = v2 = None
    try:
        for line in _read(proc_cgroup).splitlines():
            _, controllers, path = line.split(":", 2)
            if "memory" in controllers.split(","):
                v1 = path
            elif controllers == "":
                v2 = path
    except OSError:
        pass
    return v1, v2


def _unescape(field: str) -> str:
    """mountinfo escapes space, tab, newline and backslash as octal (\\040 ...)."""
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), field)


def cgroup_mounts(mountinfo: str = "/proc/self/mountinfo") -> dict[int, list[tuple[str, str]]]:
    """{1: the v1 memory hierarchy's mounts, 2: cgroup2's}, each as (the cgroup the mount shows at
    its top, the mount point). A container without a cgroup namespace (cgroup v1 under podman or
    Docker, or v2 with ``--cgroupns=host``) sees its own cgroup, say /libpod_parent/libpod-<id>,
    mounted at /sys/fs/cgroup/memory, while /proc/self/cgroup names the full path."""
    mounts: dict[int, list[tuple[str, str]]] = {1: [], 2: []}
    try:
        lines = _read(mountinfo).splitlines()
    except OSError:
        return mounts
    for line in lines:
        head, sep, tail = line.partition(" - ")
        fields, kind = head.split(), tail.split()
        if not sep or len(fields) < 5 or len(kind) < 3:
            continue
        root, point = _unescape(fields[3]), _unescape(fields[4])
        if kind[0] == "cgroup" and "memory" in kind[2].split(","):
            mounts[1].append((root, point))
        elif kind[0] == "cgroup2":
            mounts[2].append((root, point))
    return mounts


def cgroup_dir(path: str, mounts: list[tuple[str, str]]) -> list[str]:
    """The directories where cgroup ``path`` (as /proc/self/cgroup names it) can be found through
    ``mounts``: the part of the path below each mount's root, under its mount point."""
    found = []
    for root, point in mounts:
        if root == "/":
            found.append(os.path.join(point, path.lstrip("/")))
        elif path == root or path.startswith(root.rstrip("/") + "/"):
            found.append(os.path.join(point, path[len(root.rstrip("/")) :].lstrip("/")))
    return found


def _v2_root() -> str | None:
    for root in V2_ROOTS:
        if (
            os.path.exists(os.path.join(root, "cgroup.controllers"))
            and "memory" in _read(os.path.join(root, "cgroup.controllers")).split()
        ):
            return root
    return None


def _usual_mounts(version: int) -> list[tuple[str, str]]:
    """Where a host mounts each hierarchy's top, for when /proc/self/mountinfo lists none."""
    if version == 1:
        return [("/", V1_ROOT)]
    root = _v2_root()
    return [("/", root)] if root else []


def own_cgroup_dir(
    proc_cgroup: str = "/proc/self/cgroup", mountinfo: str = "/proc/self/mountinfo"
) -> tuple[int, str] | None:
    """(version, directory) of this process's memory cgroup, or None. Found through the mount
    that shows it (``cgroup_mounts``): inside a container that is often not where the path
    /proc/self/cgroup names would be, and a Dask nanny there read no OOM kill of its own
    container, so an existing cluster's report counted none (issue 43)."""
    v1, v2 = _own_paths(proc_cgroup)
    mounts = cgroup_mounts(mountinfo)
    for version, path, probe in ((1, v1, "memory.usage_in_bytes"), (2, v2, "memory.current")):
        if path is None:
            continue
        for directory in cgroup_dir(path, mounts[version] or _usual_mounts(version)):
            if os.path.exists(os.path.join(directory, probe)):
                return version, directory
    return None


@dataclass
class MemoryCgroup:
    """One memory cgroup and its counters."""

    path: str
    version: int

    def _file(self, v1: str, v2: str) -> str:
        return os.path.join(self.path, v1 if self.version == 1 else v2)

    def usage(self) -> int:
        return int(_read(self._file("memory.usage_in_bytes", "memory.current")))

    def peak(self) -> int | None:
        try:
            return int(_read(self._file("memory.max_usage_in_bytes", "memory.peak")))
        except OSError:  # memory.peak needs Linux 5.19
            return None

    def limit(self) -> int | None:
        raw = _read(self._file("memory.limit_in_bytes", "memory.max")).strip()
        if raw == "max":
            return None
        value = int(raw)
        return None if value >= 1 << 62 else value

    def oom_kills(self) -> int:
        text = _read(self._file("memory.oom_control", "memory.events"))
        for line in text.splitlines():
            key, _, value = line.partition(" ")
            if key == "oom_kill":
                return int(value)
        return 0

    def stat(self) -> dict[str, int]:
        out = {}
        for line in _read(self._file("memory.stat", "memory.stat")).splitlines():
            key, _, value = line.partition(" ")
            if value.strip().isdigit():
                out[key] = int(value)
        return out

    def nonreclaimable(self) -> dict[str, int]:
        """anon + shmem + dirty + writeback + unevictable, by term (see NONRECLAIMABLE_KEYS)."""
        return nonreclaimable_terms(self.stat(), self.version)

    def working_set(self) -> int:
        """usage - inactive_file: what kubelet compares with the limit for evictions."""
        stat = self.stat()
        inactive = stat.get("total_inactive_file", stat.get("inactive_file", 0))
        return max(0, self.usage() - inactive)

    def pids(self) -> list[int]:
        try:
            return [int(p) for p in _read(os.path.join(self.path, "cgroup.procs")).split()]
        except OSError:
            return []

    def add(self, pid: int) -> None:
        _write(os.path.join(self.path, "cgroup.procs"), str(pid))

    def remove(self, timeout: float = 5.0) -> None:
        """Delete the cgroup once its processes are gone (they must be stopped first)."""
        deadline = time.time() + timeout
        while True:
            try:
                os.rmdir(self.path)
                return
            except FileNotFoundError:
                return
            except OSError:
                if time.time() > deadline:
                    log.warning("Could not remove cgroup %s (processes still in it: %s).", self.path, self.pids())
                    return
                time.sleep(0.05)


class PeakMeter:
    """A cgroup's memory high-water mark over the whole session (``total``) and in segments
    (``take_segment``: the peak since the last call, and a new segment from now), for a batch,
    whose items each own the segments they ran in.

    cgroup v1 resets ``memory.max_usage_in_bytes`` for every reader (any value written), so the
    meter folds each segment into its own running total. v2 resets ``memory.peak`` per open file
    (Linux 6.12: "reset" written to it), so the meter keeps one file open for its segments and the
    total is the file's plain value. A kernel that cannot reset gives the peak since the cgroup's
    creation as every segment's: never less than the segment's, as the batch's other peaks."""

    def __init__(self, cgroup: MemoryCgroup):
        self.cgroup = cgroup
        self._earlier = 0  # v1: the highest segment peak before the last reset
        self._fd: int | None = None
        if cgroup.version == 2:
            try:
                self._fd = os.open(cgroup._file("memory.max_usage_in_bytes", "memory.peak"), os.O_RDWR)
            except OSError:  # no memory.peak (before Linux 5.19), or not ours to write
                self._fd = None

    @property
    def resets(self) -> bool:
        """Whether segments are the cgroup's own (else each is the peak since its creation)."""
        return self.cgroup.version == 1 or self._fd is not None

    def total(self) -> int | None:
        peak = self.cgroup.peak()
        if peak is None:  # no such file here, or the cgroup is gone: what the segments saw
            return self._earlier or None
        return max(peak, self._earlier)

    def take_segment(self) -> int | None:
        if self.cgroup.version == 1:
            peak = self.cgroup.peak()
            if peak is None:
                return None
            # Folded in before the reset: a refresh between the two still reads the whole peak.
            self._earlier = max(self._earlier, peak)
            try:
                _write(self.cgroup._file("memory.max_usage_in_bytes", "memory.peak"), "0")
            except OSError:  # not ours to reset: the peak since creation, never less than the segment's
                pass
            return peak
        if self._fd is None:  # no memory.peak (before Linux 5.19), or not writable
            return self.total()
        try:
            peak = int(os.pread(self._fd, 64, 0))
            os.write(self._fd, b"reset")
        except (OSError, ValueError):  # before Linux 6.12 "reset" is refused: the peak since creation
            return self.total()
        return peak

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def cgroups_available() -> str | None:
    """None when pod cgroups can be created here; otherwise the reason they cannot."""
    own = own_cgroup_dir()
    if own is None:
        return "no memory cgroup controller is mounted (looked for cgroup v1 at /sys/fs/cgroup/memory and v2 with the memory controller)"
    version, path = own
    probe = os.path.join(path, f"h5ngff-probe-{uuid.uuid4().hex[:8]}")
    try:
        os.mkdir(probe)
    except OSError as exc:
        return f"cannot create a child of this process's memory cgroup {path} ({exc.strerror}); run as root or delegate the cgroup"
    try:
        if version == 2 and "memory" not in _read(os.path.join(path, "cgroup.subtree_control")).split():
            return f"cgroup v2: the memory controller is not enabled for children of {path} (cgroup.subtree_control)"
    finally:
        os.rmdir(probe)
    return None


def create_pod_cgroup(name: str, limit: int) -> MemoryCgroup:
    """A child cgroup of this process's own, with ``limit`` bytes and no swap, like a pod."""
    reason = cgroups_available()
    if reason:
        raise CgroupUnavailableError(f"--enforce-pod-limits needs memory cgroups, but {reason}.")
    version, parent = own_cgroup_dir()  # type: ignore[misc]
    group = MemoryCgroup(os.path.join(parent, name), version)
    os.makedirs(group.path, exist_ok=True)
    if version == 1:
        _write(os.path.join(group.path, "memory.limit_in_bytes"), str(limit))
        swap = os.path.join(group.path, "memory.memsw.limit_in_bytes")
        if os.path.exists(swap):
            _write(swap, str(limit))  # memory+swap == memory: no swap, as kubelet configures pods
        swappiness = os.path.join(group.path, "memory.swappiness")
        if os.path.exists(swappiness):
            try:
                _write(swappiness, "0")
            except OSError:
                pass
    else:
        _write(os.path.join(group.path, "memory.max"), str(limit))
        swap = os.path.join(group.path, "memory.swap.max")
        if os.path.exists(swap):
            _write(swap, "0")
    return group


def own_cgroup() -> MemoryCgroup | None:
    own = own_cgroup_dir()
    return None if own is None else MemoryCgroup(own[1], own[0])


def own_oom_kill_count() -> int:
    """OOM kills counted in this process's memory cgroup (0 where unreadable)."""
    group = own_cgroup()
    try:
        return group.oom_kills() if group else 0
    except OSError:
        return 0


def own_memory_limit() -> int | None:
    """The memory limit of this process's cgroup (None where unlimited or unreadable): inside a
    container or pod, the limit its runtime set."""
    group = own_cgroup()
    try:
        return group.limit() if group else None
    except (OSError, ValueError):
        return None
