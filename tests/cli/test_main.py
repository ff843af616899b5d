"""cli/main.py: one module per command, each listed in `shardfit --help`."""

from pathlib import Path

import pytest

import shardfit.cli
from shardfit.cli.main import COMMANDS, main


def test_each_command_lives_in_its_own_module():
    here = Path(shardfit.cli.__file__).parent
    for name, command in COMMANDS.items():
        assert command.__name__ == name and command.__module__ == f"shardfit.cli.{name}", name
        assert (here / f"{name}.py").is_file()
    # the modules that are not commands: the shared option helpers, the launcher and the rank error path
    helpers = {p.stem for p in here.glob("*.py")} - set(COMMANDS)
    assert helpers == {"__init__", "args", "launch", "main", "rank_errors"}


def test_help_names_every_command(capsys):
    with pytest.raises(SystemExit) as e:  # argparse's --help
        main(["--help"])
    assert e.value.code == 0
    out = " ".join(capsys.readouterr().out.split())
    for name in COMMANDS:
        assert f"{name}: " in out, name
        assert f"shardfit {name} --help" in out or name == "recipes", name  # recipes takes no options


@pytest.mark.parametrize("args", [["recipes"], ["train", "--help"]])
def test_output_to_a_closed_pipe_ends_quietly(args):
    """`shardfit ... | head`: once the reader has gone, the command leaves as Unix tools do (SIGPIPE's exit
    status 141), with no traceback and no "Exception ignored" line, whether the output was written while running
    or flushed at the exit."""
    import os
    import subprocess
    import sys

    read, write = os.pipe()
    os.close(read)  # the reader is gone before the first line
    p = subprocess.run([sys.executable, "-m", "shardfit", *args], stdout=write, stderr=subprocess.PIPE, text=True,
                       timeout=120)
    os.close(write)
    assert (p.returncode, p.stderr) == (141, "")
