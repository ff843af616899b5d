"""Memory sizes on the command line (`shardfit plan --gpu-memory/--host-memory`, `shardfit doctor --gpu-memory`):
what users write (80, 80GiB, 80GB, 81559MiB, 2TB) means what it says; anything else is one line naming the option."""

import pytest

from shardfit.cli.args import gib
from shardfit.errors import ShardfitError


@pytest.mark.parametrize("text, expected", [
    ("80", 80.0), ("80GiB", 80.0), ("80 GiB", 80.0), ("80g", 80.0), ("80GB", 80e9 / 2**30),
    ("81559MiB", 81559 / 1024), ("1.5TiB", 1536.0), ("2TB", 2e12 / 2**30), ("512gb", 512e9 / 2**30),
])
def test_units_are_read_as_written(text, expected):
    assert gib(text, "--gpu-memory", "fix") == pytest.approx(expected)


@pytest.mark.parametrize("text, needle", [("80XB", "unknown unit 'XB'"), ("GB", "is not a number"),
                                          ("0GB", "out of range"), ("-5", "out of range"), ("nan", "finite"),
                                          ("nanGiB", "is not a number"),
                                          ("1e40TB", "out of range")])
def test_bad_sizes_are_one_line_naming_the_option(text, needle):
    with pytest.raises(ShardfitError) as e:
        gib(text, "--gpu-memory", "give one GPU's memory")
    assert needle in str(e.value) and "--gpu-memory" in str(e.value)


def test_plan_header_shows_the_size_in_gib(capsys):
    from shardfit.cli.main import main

    assert main(["plan", "--model.name=llama3-1b", "--nproc", "1", "--gpu-memory", "80GB"]) == 0
    assert "1 GPU of 74.51 GiB" in capsys.readouterr().out
