"""Reusable buffers per worker thread: one for the slab, one per pyramid level it builds.

A fresh slab array every task would be new pages from the kernel every time (the allocator
returns freed memory between tasks): page faults and zeroing for hundreds of MiB per slab, paid
in system time on the cores that encode. The plan already reserves a slab buffer per thread for
the whole run, so keeping it costs no memory beyond the plan.
"""

from __future__ import annotations

import ctypes
import math
import threading

import numpy as np
import numpy.typing as npt

#: Each thread's buffers, by thread and slot (0 the slab, k the k-th level): a thread uses only
#: its own; another drops them only under ``_lock`` (``release_conversion``).
_by_thread: dict[int, dict[int, np.ndarray]] = {}
#: The conversion each buffer was allocated for, by (thread, slot). A batch runs two items at once
#: on one worker and a thread moves between them: it reuses a buffer whichever item allocated it
#: (alternating items would otherwise free and allocate a slab's worth at every move), and the
#: buffers an item allocated go when it ends, wherever they are.
_allocated_for: dict[tuple[int, int], str] = {}
#: The conversion each thread's current slab serves, from ``working_for`` to ``done_serving``: a
#: thread not in it runs no slab.
_serving: dict[int, str] = {}
_lock = threading.Lock()
#: The owner of a spare buffer: a batch's ended item left it to the next slab on its thread
#: (``release_conversion``'s ``keep``), and that slab's conversion takes it.
SPARE = "\x00spare"  # never a conversion's name (an output path) nor "" (outside a slab)
#: Buffers this large are allocated in whole MiB, so that two items whose slabs differ by a few
#: KiB (50,000,000 and 50,013,184 bytes) can reuse one buffer. The tail is never touched: a fresh
#: buffer holds no more than before, and a transparent huge page is 2 MiB anyway.
_ROUND_FROM = 4 << 20
_ROUND_TO = 1 << 20


def _mine() -> dict[int, np.ndarray]:
    return _by_thread.setdefault(threading.get_ident(), {})


def working_for(conversion: str) -> None:
    """Called as a slab starts: the buffers this thread allocates from now on are ``conversion``'s."""
    with _lock:
        _serving[threading.get_ident()] = conversion


def done_serving() -> None:
    """Called as a slab ends: this thread runs no slab until the next ``working_for``."""
    with _lock:
        _serving.pop(threading.get_ident(), None)


def capacity(nbytes: int) -> int:
    """The bytes a buffer for ``nbytes`` is allocated with (``_ROUND_TO`` granules from
    ``_ROUND_FROM``); a batch keeps a spare buffer only up to this of the slab an item counts."""
    if nbytes < _ROUND_FROM:
        return nbytes
    return -(-nbytes // _ROUND_TO) * _ROUND_TO


def current_conversion() -> str:
    """The conversion this thread's slab serves ("" outside a slab task)."""
    return _serving.get(threading.get_ident(), "")


def release_conversion(conversion: str, keep: int = 0) -> None:
    """Free every buffer allocated for ``conversion``, on every thread, once none of its slabs
    runs (a batch's item has ended). A slab of another item that reuses one of them keeps it
    until that slab ends (it holds a reference); that item ran beside this one, so its plan's
    bound counts it (batch.run). The items still running keep the buffers they allocated.

    ``keep``: the slab buffer of a thread that runs no slab now stays as a spare for the thread's
    next slab, if it holds at most ``keep`` bytes. The batch passes the smallest slab buffer that
    any item still to run counts per thread (``capacity`` of it), so whichever item runs on that
    worker next, its own plan already counts the spare; the next slab takes it instead of new
    pages from the kernel (a 50 MB item's buffer was faulted in and zeroed afresh every time).
    Spares left by earlier items that are now larger than ``keep`` go too (0 at the batch's last
    item: none stays)."""
    with _lock:
        for ident, slot in [key for key, owner in _allocated_for.items() if owner == conversion]:
            buf = _by_thread.get(ident, {}).get(slot)
            if slot == 0 and ident not in _serving and buf is not None and buf.nbytes <= keep:
                _allocated_for[ident, slot] = SPARE
            else:
                _drop(ident, slot)
        for ident, slot in [key for key, owner in _allocated_for.items() if owner == SPARE]:
            buf = _by_thread.get(ident, {}).get(slot)
            if buf is None or buf.nbytes > keep:
                _drop(ident, slot)
        for ident in [i for i, serving in _serving.items() if serving == conversion]:
            del _serving[ident]


def _drop(ident: int, slot: int) -> None:
    """Under ``_lock``: forget a thread's buffer (freed once no slab holds a reference to it)."""
    del _allocated_for[ident, slot]
    _by_thread.get(ident, {}).pop(slot, None)


def give_back_freed_memory() -> None:
    """Return the pages freed so far to the kernel now, not after the allocator's decay time
    (jemalloc keeps dirty pages 1 s, docs/memory-model.md): when a batch's item ends, its freed
    buffers must not stay resident beside the next item's. jemalloc (preloaded on the workers):
    purge every arena; glibc: ``malloc_trim``. A few milliseconds."""
    libc = ctypes.CDLL(None)
    mallctl = getattr(libc, "mallctl", None)
    if mallctl is not None:  # MALLCTL_ARENAS_ALL is 4096
        mallctl(b"arena.4096.purge", None, None, None, ctypes.c_size_t(0))
    elif (trim := getattr(libc, "malloc_trim", None)) is not None:
        trim(0)


def _buffer(slot: int, shape: tuple[int, ...], dtype: npt.DTypeLike) -> np.ndarray:
    dt = np.dtype(dtype)
    need = math.prod(shape) * dt.itemsize
    ident = threading.get_ident()
    buffers = _mine()
    buf = buffers.get(slot)
    if buf is None or buf.nbytes < need or _allocated_for.get((ident, slot)) == SPARE:
        with _lock:  # a batch's release may drop or hand over this thread's spare meanwhile
            buf = buffers.get(slot)
            spare = _allocated_for.get((ident, slot)) == SPARE
            if buf is not None and buf.nbytes >= need:
                _allocated_for[ident, slot] = current_conversion()  # a spare: this slab's now
            else:
                buf = None  # the last reference: the pop below frees it
                buffers.pop(slot, None)  # drop the old one before allocating a larger one
                if spare:  # its pages must not stay resident beside the new buffer
                    give_back_freed_memory()
                buf = buffers[slot] = np.empty(capacity(need), dtype=np.uint8)
                _allocated_for[ident, slot] = current_conversion()
    return buf[:need].view(dt).reshape(shape)


def slab_buffer(shape: tuple[int, ...], dtype: npt.DTypeLike) -> np.ndarray:
    """An uninitialised C-contiguous array of ``shape``, backed by this thread's slab buffer."""
    return _buffer(0, shape, dtype)


def level_buffer(depth: int, shape: tuple[int, ...], dtype: npt.DTypeLike) -> np.ndarray:
    """The same for the ``depth``-th level a slab builds (1 = the first downsampled level)."""
    return _buffer(depth, shape, dtype)


def keep_levels(depth: int) -> None:
    """Drop level buffers deeper than ``depth``: a later pass that builds fewer levels than the
    first must not keep the first pass's deeper buffers on top of its own."""
    ident = threading.get_ident()
    buffers = _mine()
    with _lock:
        for slot in [s for s in buffers if s > depth]:
            del buffers[slot]
            _allocated_for.pop((ident, slot), None)


def release() -> None:
    """Free this thread's buffers."""
    ident = threading.get_ident()
    with _lock:
        _by_thread.pop(ident, None)
        for key in [k for k in _allocated_for if k[0] == ident]:
            del _allocated_for[key]


def release_all() -> None:
    """Free every thread's buffers, while no slab runs (tests that measure a fresh worker). An
    array a caller still holds keeps its memory until dropped (it references the buffer)."""
    with _lock:
        _by_thread.clear()
        _allocated_for.clear()
        _serving.clear()
