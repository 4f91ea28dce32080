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

    def slab_of(conversion: str, nbytes: int):
        def work() -> None:
            buffers.working_for(conversion)
            buffers.slab_buffer((nbytes,), np.uint8)
            held[conversion] = threading.get_ident()

        return work

    _in_thread(slab_of("big", 1 << 20))
    _in_thread(slab_of("small", 1 << 10))
    assert {buffers._conversion_of[t] for t in held.values()} == {"big", "small"}
    buffers.release_conversion("big")
    assert held["big"] not in buffers._by_thread and held["big"] not in buffers._conversion_of
    assert buffers._by_thread[held["small"]][0].nbytes == 1 << 10  # the running item keeps its buffer
    # Negative control: releasing a conversion no thread served drops nothing.
    buffers.release_conversion("neither")
    assert held["small"] in buffers._by_thread
    buffers.release_all()


def test_a_thread_moving_to_another_conversion_drops_the_first_ones_buffers():
    buffers.release_all()
    sizes: list[int] = []

    def work() -> None:
        buffers.working_for("big")
        buffers.slab_buffer((1 << 20,), np.uint8)
        buffers.working_for("big")  # the same conversion's next slab: the buffer is reused
        sizes.append(buffers._mine()[0].nbytes)
        buffers.working_for("small")
        sizes.append(len(buffers._mine()))
        buffers.slab_buffer((1 << 10,), np.uint8)
        sizes.append(buffers._mine()[0].nbytes)

    _in_thread(work)
    assert sizes == [1 << 20, 0, 1 << 10]
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
