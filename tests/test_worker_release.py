"""What a worker lets go of when one of a batch's items ends while another still runs
(engine.buffers, engine.sources.base): the ended item's buffers and HDF5 files, never the
running one's."""

from __future__ import annotations

import threading

import numpy as np

from conftest import smooth, write_h5
from h5ngff.engine import buffers
from h5ngff.engine.sources import base as sources


def _in_thread(work) -> None:
    thread = threading.Thread(target=work)
    thread.start()
    thread.join()


def test_an_ended_conversions_buffers_go_and_a_running_ones_stay():
    buffers.release_all()
    held: dict[str, int] = {}

    # Two threads alive at once (a finished thread's id may be given to the next one).
    both = threading.Barrier(2)

    def slab_of(conversion: str, nbytes: int) -> None:
        buffers.working_for(conversion)
        buffers.slab_buffer((nbytes,), np.uint8)
        held[conversion] = threading.get_ident()
        both.wait()

    threads = [threading.Thread(target=slab_of, args=job) for job in (("big", 1 << 20), ("small", 1 << 10))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert {buffers._allocated_for[t, 0] for t in held.values()} == {"big", "small"}
    buffers.release_conversion("big")
    assert 0 not in buffers._by_thread[held["big"]] and (held["big"], 0) not in buffers._allocated_for
    assert buffers._by_thread[held["small"]][0].nbytes == 1 << 10  # the running item keeps its buffer
    # Negative control: releasing a conversion that allocated nothing drops nothing.
    buffers.release_conversion("neither")
    assert 0 in buffers._by_thread[held["small"]]
    buffers.release_all()


def test_a_thread_moving_between_two_items_reuses_its_buffer_until_the_one_that_allocated_it_ends():
    """Two items in flight: a thread alternating between them keeps one slab buffer (no free and
    allocate at every move), and it goes when the item it was allocated for ends."""
    buffers.release_all()
    seen: list[tuple[int, str]] = []
    ident: list[int] = []

    def slab(conversion: str, nbytes: int) -> None:
        buffers.working_for(conversion)
        buf = buffers.slab_buffer((nbytes,), np.uint8)
        seen.append((buf.base.nbytes if buf.base is not None else buf.nbytes, buffers._allocated_for[ident[0], 0]))

    def work() -> None:
        ident.append(threading.get_ident())
        slab("big", 1 << 20)
        slab("small", 1 << 10)  # reuses big's buffer: no new allocation
        slab("big", 1 << 20)
        buffers.release_conversion("big")  # big ended: its buffer goes from this thread too
        slab("small", 1 << 10)  # small allocates its own, small one

    _in_thread(work)
    assert seen == [(1 << 20, "big"), (1 << 20, "big"), (1 << 20, "big"), (1 << 10, "small")]
    buffers.release_all()


def test_an_idle_threads_slab_buffer_stays_for_the_next_item_only_where_every_item_left_counts_it():
    """A batch's item ends: an idle thread's slab buffer stays as a spare when it holds no more
    than ``keep`` (the smallest slab any item still to run counts), and the next item's slab takes
    it instead of new pages; two slabs a few KiB apart share one allocation (whole MiB)."""
    buffers.release_all()
    f32, u16 = 5_013_184, 5_000_000  # a float32 slab and a uint16 one of the same 5 MB item size
    assert buffers.capacity(f32) == buffers.capacity(u16) == 5 << 20
    seen: dict[str, object] = {}

    def work() -> None:
        ident = threading.get_ident()
        buffers.working_for("a")
        a = buffers.slab_buffer((f32,), np.uint8)
        buffers.done_serving()
        buffers.release_conversion("a", keep=buffers.capacity(u16))
        seen["spare"] = buffers._allocated_for.get((ident, 0))
        buffers.working_for("b")
        b = buffers.slab_buffer((u16,), np.uint8)
        seen["shared"] = np.shares_memory(a, b)
        seen["owner"] = buffers._allocated_for.get((ident, 0))
        buffers.done_serving()
        del a, b
        # Negative control 1: an item still to run counts a smaller slab: the buffer goes.
        buffers.release_conversion("b", keep=buffers.capacity(1 << 20))
        seen["after small keep"] = 0 in buffers._by_thread.get(ident, {})
        # Negative control 2: a thread inside a slab when its item ends keeps nothing of it.
        buffers.working_for("c")
        buffers.slab_buffer((u16,), np.uint8)
        buffers.release_conversion("c", keep=5 << 20)
        seen["while serving"] = 0 in buffers._by_thread.get(ident, {})
        # A spare goes too once a later item's end says a smaller slab is left to run.
        buffers.working_for("d")
        buffers.slab_buffer((u16,), np.uint8)
        buffers.done_serving()
        buffers.release_conversion("d", keep=5 << 20)
        seen["spare kept"] = 0 in buffers._by_thread.get(ident, {})
        buffers.release_conversion("e", keep=0)
        seen["at the last item"] = 0 in buffers._by_thread.get(ident, {})

    _in_thread(work)
    assert seen["spare"] == buffers.SPARE and seen["shared"] and seen["owner"] == "b", seen
    assert seen["after small keep"] is False and seen["while serving"] is False, seen
    assert seen["spare kept"] is True and seen["at the last item"] is False, seen
    buffers.release_all()


def test_a_file_two_conversions_read_stays_open_until_both_have_ended(tmp_path):
    sources.close_files()
    shared = write_h5(tmp_path / "shared.h5", smooth((8, 16, 16), "uint16"))
    alone = write_h5(tmp_path / "alone.h5", smooth((8, 16, 16), "uint16", seed=1))
    region = (slice(0, 4), slice(0, 16), slice(0, 16))

    def read(conversion: str, path: str):
        def work() -> None:
            buffers.working_for(conversion)
            sources.read_plain(path, "/volume/data", 1 << 20, region)

        return work

    for conversion, path in (("a", shared), ("b", shared), ("a", alone)):
        _in_thread(read(conversion, path))
    assert set(sources._files) == {shared, alone}
    sources.close_files_of("a")
    assert set(sources._files) == {shared}  # b still reads it; a's own file is closed
    assert sources._files[shared].id.valid and all(k[0] == shared for k in sources._datasets)
    _in_thread(read("b", shared))  # b goes on reading it
    sources.close_files_of("b")
    assert sources._files == {} and sources._datasets == {} and sources._readers == {}
    buffers.release_all()


def test_an_ended_conversions_stores_are_forgotten_and_the_others_kept(tmp_path):
    """A worker caches one store per array it writes (engine.stores.open_store); an item that ends
    drops its own, so hundreds of items do not leave hundreds of stores behind."""
    from h5ngff.engine import stores
    from h5ngff.engine.write.tasks import end_of_conversion

    ended, running = str(tmp_path / "a.ome.zarr"), str(tmp_path / "ab.ome.zarr")
    for root in (ended, running):
        for level in ("0", "1"):
            stores.open_store(f"{root}/{level}")
    mine = {k for k in stores._open if k[0].startswith(str(tmp_path))}
    assert len(mine) == 4  # the negative control: cached until told
    end_of_conversion(ended)
    left = {k[0] for k in stores._open if k[0].startswith(str(tmp_path))}
    assert left == {f"{running}/0", f"{running}/1"}  # a path that merely starts alike stays
    stores.forget_stores(running + "/")
    assert not any(k[0].startswith(str(tmp_path)) for k in stores._open)
