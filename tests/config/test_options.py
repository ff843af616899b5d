"""config/options.py: the one `--name value | --name=value` reader, under the loader's overrides and the commands'
launch options alike."""

import pytest

from shardfit.cli.args import take_options
from shardfit.config.options import parse_overrides, read_options
from shardfit.errors import ShardfitError


def test_both_spellings_read_alike_and_others_pass_through_in_order():
    argv = ["--config", "a.toml", "--model.dim=64", "--nproc=2", "--train.lr", "--weird", "x"]
    got = list(read_options(argv, {"--config", "--nproc"}.__contains__))
    assert got == [("--config", "a.toml"), (None, "--model.dim=64"), ("--nproc", "2"), (None, "--train.lr"),
                   (None, "--weird"), (None, "x")]
    # a value is taken as given, even one that looks like an option
    assert list(read_options(["--train.lr", "--x=1"], lambda n: n == "--train.lr")) == [("--train.lr", "--x=1")]
    assert list(read_options(["--a.b=x=y"], lambda n: True)) == [("--a.b", "x=y")]


def test_launch_options_leave_the_overrides_for_the_loader():
    opts, rest = take_options(["--model.dim", "64", "--config", "r.toml", "--nproc=1", "--nproc", "4",
                               "--train.lr=1e-4"], ("--config", "--nproc"))
    assert opts == {"--config": "r.toml", "--nproc": "4"}  # the last of a repeated option wins
    assert parse_overrides(rest) == [("model", "dim", "64"), ("train", "lr", "1e-4")]
    assert parse_overrides(["--model.n-layers", "3"]) == [("model", "n_layers", "3")]


@pytest.mark.parametrize("argv, names, needle", [
    (["--nproc"], ("--nproc",), "command line: --nproc needs a value; fix: write --nproc=VALUE"),
    (["--model.dim=1", "--train.lr"], None, "command line: --train.lr needs a value; fix: write --train.lr=VALUE"),
    (["--model.dim=1", "train.lr=1"], None, "cannot read argument 'train.lr=1'"),
    (["--verbose", "--train.lr"], None, "cannot read argument '--verbose'"),  # the first mistake, in order
])
def test_the_same_mistake_is_the_same_line_for_both_callers(argv, names, needle):
    with pytest.raises(ShardfitError) as e:
        take_options(argv, names) if names else parse_overrides(argv)
    assert str(e.value).startswith("command line: ") and needle in str(e.value) and "\n" not in str(e.value)
