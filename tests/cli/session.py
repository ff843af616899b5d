"""Several `shardfit` commands as a user types them, in one subprocess: each through the CLI's own entry point
(`shardfit.cli.main.main`, which the console script calls), its exit code, stdout and stderr kept apart, the
interpreter and torch started once instead of once per command (the suite's time budget)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

_DRIVER = r"""
import contextlib, io, json, os, sys
from shardfit.cli.main import main
results = []
for argv, cwd in json.loads(sys.argv[1]):
    if cwd is not None:
        os.chdir(cwd)
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(argv)
    results.append([code, out.getvalue(), err.getvalue()])
    with open(sys.argv[2], "w") as f:  # after each command: a crash still leaves the ones before it
        json.dump(results, f)
"""


def run_commands(commands: list[list[str]], cwd: Path, timeout: float = 300,
                 cwds: list[Path] | None = None) -> list[subprocess.CompletedProcess]:
    """commands: argv lists after `shardfit`; the results in order (a driver that died fails the test here). cwds:
    each command's own working directory (the driver changes to it before the command), else cwd for all."""
    each = [str(d) for d in cwds] if cwds is not None else [None] * len(commands)
    assert len(each) == len(commands)
    with tempfile.TemporaryDirectory() as tmp:
        results = Path(tmp) / "results.json"
        p = subprocess.run([sys.executable, "-c", _DRIVER, json.dumps(list(zip(commands, each))), str(results)],
                           cwd=cwd,
                           capture_output=True, text=True, timeout=timeout, env={**os.environ, "OMP_NUM_THREADS": "1"})
        done = json.loads(results.read_text()) if results.is_file() else []
        assert p.returncode == 0 and len(done) == len(commands), (p.returncode, p.stderr[-3000:])
    return [subprocess.CompletedProcess(["shardfit", *c], code, out, err) for c, (code, out, err) in
            zip(commands, done)]
