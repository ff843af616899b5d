"""A rank killed mid-run under torchrun --max-restarts=1: the job resumes and ends where an uninterrupted run ends."""

import json
import os
import subprocess
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file

from tests.cli.test_cli import TINY

ARGS = [*TINY, "--train.steps=6", "--checkpoint.every=2", "--checkpoint.export_dtype=float32"]


def _torchrun(entry: list[str], run_dir: Path, *extra: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", *extra, *entry,
           *ARGS, f"--logging.run_dir={run_dir}", f"--checkpoint.export_hf={run_dir}/export"]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "OMP_NUM_THREADS": "1"}, cwd=Path(__file__).parents[2])


def test_sigkilled_rank_resumes_to_the_same_parameters(tmp_path):
    clean = _torchrun(["-m", "shardfit", "train"], tmp_path / "clean")
    assert clean.returncode == 0, "\n".join(x for x in clean.stderr.splitlines() if not x.startswith("W1121"))[-3000:]
    killed = _torchrun(["tests/train/kill_once.py"], tmp_path / "killed", "--max-restarts=1")
    assert killed.returncode == 0, "\n".join(x for x in killed.stderr.splitlines() if not x.startswith("W1121"))[-3000:]
    assert "resumed from" in killed.stdout and "step_00000004" in killed.stdout
    steps = [json.loads(x)["step"] for x in (tmp_path / "killed" / "metrics.jsonl").read_text().splitlines()]
    assert steps[-2:] == [5, 6] and 5 not in steps[:-2]  # step 5 ran only after the restart
    a = load_file(tmp_path / "clean/export/model.safetensors")
    b = load_file(tmp_path / "killed/export/model.safetensors")
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k
