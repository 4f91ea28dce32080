"""The worker processes' malloc: jemalloc where installed, glibc tuned to give memory back otherwise.

Chosen by measurement on the long run in docs/memory-model.md ("Allocator"). The environment must
be in place when the worker process starts (LD_PRELOAD and glibc's MALLOC_* variables are read
once, at start), so it goes into Dask's ``distributed.nanny.pre-spawn-environ`` locally, into the
pod spec on Kubernetes, and into the Dockerfile.
"""

from __future__ import annotations

import os
import platform

#: Where Debian/Ubuntu's libjemalloc2 puts the library, per architecture.
JEMALLOC_PATHS = (
    "/usr/lib/x86_64-linux-gnu/libjemalloc.so.2",
    "/usr/lib/aarch64-linux-gnu/libjemalloc.so.2",
    "/usr/lib64/libjemalloc.so.2",
    "/usr/lib/libjemalloc.so.2",
)

#: jemalloc: return freed pages to the OS after 1 s (dirty) and at once (muzzy), from a background
#: thread, so RSS follows the slabs down between tasks instead of keeping the high-water mark;
#: few arenas, because a worker runs one or two threads and every arena keeps its own free pages.
JEMALLOC_CONF = "background_thread:true,dirty_decay_ms:1000,muzzy_decay_ms:0,narenas:2,abort_conf:true"

#: glibc: buffers of 16 MiB and more (slabs, pyramid levels) come straight from mmap and go
#: straight back on free. A fixed threshold also stops glibc's dynamic threshold from drifting up
#: to 32 MiB, which would keep freed slabs in the heap. Chunk-sized buffers stay below it on
#: purpose: with a 1 MiB threshold every 64^3 float32 chunk copy and every blosc output buffer
#: was a fresh mmap, page-faulted and unmapped, and encoding ran 2.2x slower (bench: a worker
#: encoding 64^3 chunks took 11.9 ms each instead of 5.3 ms). Two arenas bound per-thread heap growth.
GLIBC_ENV = {
    "MALLOC_MMAP_THRESHOLD_": str(16 << 20),
    "MALLOC_TRIM_THRESHOLD_": str(16 << 20),
    "MALLOC_ARENA_MAX": "2",
    # The image preloads jemalloc for every process; a job that asks for glibc must undo that.
    "LD_PRELOAD": "",
}


def jemalloc_path() -> str | None:
    override = os.environ.get("H5NGFF_JEMALLOC")
    if override:
        return override if os.path.exists(override) else None
    for path in JEMALLOC_PATHS:
        if os.path.exists(path):
            return path
    return None


def resolve_allocator(requested: str) -> str:
    """``auto`` and ``jemalloc`` become jemalloc where the library exists, else glibc (the runner
    tells the user when an explicit ``jemalloc`` could not be honoured)."""
    if requested == "glibc" or platform.system() != "Linux":
        return "glibc"
    return "jemalloc" if jemalloc_path() else "glibc"


def allocator_env(allocator: str, library: str | None = None) -> dict[str, str]:
    """Environment variables for a worker process using ``allocator``."""
    if allocator == "jemalloc":
        path = library or jemalloc_path()
        if path:
            return {"LD_PRELOAD": path, "MALLOC_CONF": JEMALLOC_CONF}
    return dict(GLIBC_ENV)
