"""engine.stores.fetches: a reading thread's ranged GETs, a bounded window of them in flight.
Bodies come back in order; never more than ``in_flight`` run at once; a failure is raised in the
reading thread after the bodies before it, and the requests after it are not left running;
retries made on the pool are the reading thread's. The GET here is a function that sleeps like a
round trip (the window's own code is what is tested; the S3 path is in tests/test_s3_sources.py).
Negative control: the same checks catch a window that returns bodies out of order."""

from __future__ import annotations

import threading
import time

import pytest

from h5ngff.engine.stores.base import store_retries
from h5ngff.engine.stores.fetches import FetchWindow


class Endpoint:
    def __init__(self, fail_at: int | None = None, retries_each: int = 0):
        self.lock = threading.Lock()
        self.running = self.most = 0
        self.started: list[int] = []
        self.fail_at, self.retries_each = fail_at, retries_each

    def get(self, start: int, length: int) -> bytes:
        with self.lock:
            self.running += 1
            self.most = max(self.most, self.running)
            self.started.append(start)
        try:
            time.sleep(0.02 if start % 3 else 0.05)  # uneven round trips: later ones finish first
            for _ in range(self.retries_each):
                store_retries.add()
            if start == self.fail_at:
                raise OSError(f"GET {start} failed")
            return start.to_bytes(4, "big") * length
        finally:
            with self.lock:
                self.running -= 1


def test_bodies_come_back_in_order_with_at_most_in_flight_running():
    endpoint = Endpoint(retries_each=1)
    ranges = [(i, 2) for i in range(12)]
    before = store_retries.mine()
    bodies = list(FetchWindow("t").fetch(endpoint.get, ranges, in_flight=3))
    assert [int.from_bytes(b[:4], "big") for b in bodies] == list(range(12))
    assert 1 < endpoint.most <= 3, endpoint.most
    assert store_retries.mine() - before == 12, "retries made on the pool are the reading thread's"


def test_a_failure_is_raised_after_the_bodies_before_it_and_nothing_is_left_running():
    endpoint = Endpoint(fail_at=5)
    got = []
    with pytest.raises(OSError, match="GET 5 failed"):
        for body in FetchWindow("t").fetch(endpoint.get, [(i, 1) for i in range(40)], in_flight=4):
            got.append(int.from_bytes(body[:4], "big"))
    assert got == [0, 1, 2, 3, 4]
    assert endpoint.running == 0 and max(endpoint.started) < 5 + 4, endpoint.started


def test_negative_control_an_unordered_window_is_caught():
    endpoint = Endpoint()
    unordered = sorted(FetchWindow("t").fetch(endpoint.get, [(i, 1) for i in range(6)], 3), key=lambda b: -b[3])
    assert [int.from_bytes(b[:4], "big") for b in unordered] != list(range(6))
