"""ShardfitError: one line naming where (a key, a file, file:line), what, and the fix."""

from pathlib import Path

import pytest

from shardfit.errors import ShardfitError


@pytest.mark.parametrize("kwargs, line", [
    ({}, "bad"),
    ({"where": "train.lr"}, "train.lr: bad"),
    ({"where": "train.lr", "fix": "use 3e-4"}, "train.lr: bad; fix: use 3e-4"),
    ({"fix": "use 3e-4"}, "bad; fix: use 3e-4"),
    ({"where": Path("/d/c.toml"), "line": 7}, "/d/c.toml:7: bad"),  # a path object, with a line number
    ({"where": "data.txt", "line": 0, "fix": "re-encode"}, "data.txt:0: bad; fix: re-encode"),
    ({"line": 3}, "<input>:3: bad"),  # a line without a file still says it is one
    ({"where": ""}, "bad"),  # an empty where is no where
])
def test_error_formats_one_line(kwargs, line):
    e = ShardfitError("bad", **kwargs)
    assert str(e) == line
    assert e.cli_line() == f"shardfit: error: {line}"
    assert e.exit_code == 2


def test_parts_stay_readable_and_exit_code_can_be_given():
    e = ShardfitError("rank 1 was killed", where="rank 1", fix="check dmesg", exit_code=1)
    assert (e.what, e.where, e.fix, e.exit_code) == ("rank 1 was killed", "rank 1", "check dmesg", 1)
    assert ShardfitError("x").exit_code == 2  # the instance's code did not leak into the class

    class Halted(ShardfitError):
        exit_code = 3

    assert Halted("stop", where="train.max_skipped_steps").exit_code == 3  # a subclass's code is kept
    assert Halted("stop", exit_code=5).exit_code == 5


@pytest.mark.parametrize("message", ["two\nlines", "trailing newline\n", "a\n\nb", "tab\tand\nnewline", "cr\r",
                                     "crlf\r\n", "form\x0cfeed", "unicode\u2028separator", "nel\x85"])
def test_a_multi_line_message_is_still_one_line(message):
    e = ShardfitError(message, where="f.jsonl", line=2, fix="see\nabove")
    assert len(str(e).splitlines()) == 1 and str(e).startswith("f.jsonl:2: ")
    assert e.cli_line().count("shardfit: error:") == 1
