"""serve/ordering.py's Scheduler: a model's commands released in seq_id order, and a seq_id that never arrives (its
client numbered it and failed to send it) skipped after serve.seq_gap_s with one log line, where the commands after
it would otherwise wait for ever; one arriving after that is refused as reused."""

from __future__ import annotations

import time

import pytest

from shardfit.errors import ShardfitError
from shardfit.serve.ordering import Scheduler


def test_commands_wait_for_an_earlier_seq_id_and_run_in_order():
    s = Scheduler()
    s.add_model("m")
    s.submit("third", "m", 3)
    s.submit("second", "m", 2)
    assert s.next(0.05) is None  # 1 has not arrived: nothing is ready (no gap_s: waits for ever)
    s.submit("first", "m", 1)
    assert [s.next(0.05).command for _ in range(3)] == ["first", "second", "third"]


def test_a_seq_id_that_never_arrives_is_skipped_after_gap_s():
    lines = []
    s = Scheduler(gap_s=0.2, log=lines.append)
    s.add_model("m")
    s.add_model("other")
    s.submit("third", "m", 3)
    s.submit("fourth", "m", 4)
    s.submit("its own", "other", 1)  # another model's commands do not wait for m's gap
    assert s.next(0.05).command == "its own"
    assert s.next(0.05) is None and not lines
    t = time.monotonic()
    assert s.next(2.0).command == "third"  # woken by the gap's expiry, not by the timeout
    assert time.monotonic() - t < 1.0
    assert s.next(0.05).command == "fourth"
    assert len(lines) == 1 and "model 'm': seq_id 1..2 never arrived in 0.2 s" in lines[0]
    with pytest.raises(ShardfitError, match="seq_id 1 of model 'm' was already used"):
        s.check_seq("m", 1, "/forward_backward")  # arriving late: refused, not run out of order
    s.check_seq("m", 5, "/forward_backward")  # the next number is taken as usual
