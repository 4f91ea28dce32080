"""SIGTERM raises ``Terminated`` (a KeyboardInterrupt) in the main thread, and is held, not lost,
inside ``hold_termination`` (the cluster's start). The command-line run is in test_cli_front.py."""

from __future__ import annotations

import os
import signal
import time

import pytest

from h5ngff.backends.interrupts import Terminated, hold_termination, terminate_like_ctrl_c


@pytest.fixture
def sigterm_handler():
    before = signal.getsignal(signal.SIGTERM)
    terminate_like_ctrl_c()
    yield
    signal.signal(signal.SIGTERM, before)


def _deliver_sigterm() -> None:
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(0.05)  # the handler runs at the next bytecode boundary of the main thread


def test_sigterm_is_a_keyboard_interrupt_at_once(sigterm_handler):
    with pytest.raises(Terminated):
        _deliver_sigterm()
    assert issubclass(Terminated, KeyboardInterrupt)


def test_sigterm_inside_the_held_block_is_raised_when_it_ends(sigterm_handler):
    reached_the_end = False
    with pytest.raises(Terminated):
        with hold_termination():
            _deliver_sigterm()
            with hold_termination():  # nested holds raise once, at the outermost end
                pass
            reached_the_end = True
    assert reached_the_end
    with hold_termination():  # nothing pending afterwards
        pass
