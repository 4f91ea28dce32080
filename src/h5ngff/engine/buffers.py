"""Reusable buffers per worker thread: one for the slab, one per pyramid level it builds.

A fresh slab array every task would be new pages from the kernel every time (the allocator
returns freed memory between tasks): page faults and zeroing for hundreds of MiB per slab, paid
in system time on the cores that encode. The plan already reserves a slab buffer per thread for
the whole run, so keeping it costs no memory beyond the plan.
"""

from __future__ import annotations

import math
import threading

import numpy as np
import numpy.typing as npt

#: Each thread's buffers, by thread: a thread uses only its own. Another thread drops them only
#: while their thread runs no slab of theirs (``release_conversion``), under ``_lock``.
_by_thread: dict[int, dict[int, np.ndarray]] = {}
#: The conversion each thread's buffers were sized for (``working_for``): a batch runs two items
#: at once on one worker, and a thread moves between them.
_conversion_of: dict[int, str] = {}
_lock = threading.Lock()


def _mine() -> dict[int, np.ndarray]:
    return _by_thread.setdefault(threading.get_ident(), {})


def working_for(conversion: str) -> None:
    """Called as a slab starts: this thread's buffers serve ``conversion`` from now on. A thread
    whose last slab was another conversion's drops that one's buffers first, so it never holds
    a larger item's buffers beside its own (it runs no slab now: dropping them is safe)."""
    ident = threading.get_ident()
    with _lock:
        if _conversion_of.get(ident) != conversion:
            _by_thread.pop(ident, None)
            _conversion_of[ident] = conversion


def current_conversion() -> str:
    """The conversion this thread's slab serves ("" outside a slab task)."""
    return _conversion_of.get(threading.get_ident(), "")


def release_conversion(conversion: str) -> None:
    """Free the buffers of every thread whose last slab was ``conversion``'s, once none of its
    slabs runs (a batch's item has ended): the items still running keep theirs."""
    with _lock:
        for ident in [i for i, c in _conversion_of.items() if c == conversion]:
            _by_thread.pop(ident, None)
            del _conversion_of[ident]


def _buffer(slot: int, shape: tuple[int, ...], dtype: npt.DTypeLike) -> np.ndarray:
    dt = np.dtype(dtype)
    need = math.prod(shape) * dt.itemsize
    buffers = _mine()
    buf = buffers.get(slot)
    if buf is None or buf.nbytes < need:
        buffers.pop(slot, None)  # drop the old one before allocating a larger one
        buf = buffers[slot] = np.empty(need, dtype=np.uint8)
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
    buffers = _mine()
    for slot in [s for s in buffers if s > depth]:
        del buffers[slot]


def release() -> None:
    """Free this thread's buffers."""
    _by_thread.pop(threading.get_ident(), None)


def release_all() -> None:
    """Free every thread's buffers, while no slab runs (tests that measure a fresh worker). An
    array a caller still holds keeps its memory until dropped (it references the buffer)."""
    with _lock:
        _by_thread.clear()
        _conversion_of.clear()
