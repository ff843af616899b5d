"""Issue 27, class 2: `model.init_from`, a new run from a shardfit checkpoint's weights (weights only: a fresh
optimizer, schedule and step 0), written by two ranks and read by one; its architecture and tokenizer come with it,
and each wrong use is one line. As a user runs it (fine-tuning from a run, through the CLI): the docs' test,
tests/cli/test_docs_checkpoints.py."""

from __future__ import annotations

import pytest
import torch

from shardfit.config import load_config
from shardfit.errors import ShardfitError
from tests._dist import run_ranks
from tests.helpers import full_state

BATCH = ["--data.seq_len=32", "--train.global_batch=4", "--train.micro_batch=2", "--train.device=cpu",
         "--logging.plot=false"]


def _started(rank, world, spec, run_dir):
    from shardfit.train import Trainer

    t = Trainer(load_config(None, [f"--model.init_from={spec}", *BATCH, "--logging.progress=none",
                                   f"--logging.run_dir={run_dir}"]))
    return {"step": t.step, "optimizer_state": len(t.optimizer.state), "notices": t.notices,
            "state": {k: v.tolist() for k, v in full_state(t.model).items()}}


def test_a_one_rank_run_starts_from_the_weights_two_ranks_saved(two_rank_run, tmp_path):
    from shardfit.generate import load_dcp

    got = run_ranks(_started, 1, str(two_rank_run), str(tmp_path / "new"))[0]
    want, _ = load_dcp(str(two_rank_run), torch.device("cpu"), torch.float32)
    assert got["step"] == 0 and got["optimizer_state"] == 0  # weights only
    for k, v in want.state_dict().items():
        torch.testing.assert_close(torch.tensor(got["state"][k]), v, rtol=0, atol=0, msg=k)
    step2 = two_rank_run / "checkpoints" / "step_00000002"
    assert any(f"weights from {step2} (step 2, model.init_from); a fresh optimizer" in n for n in got["notices"])


@pytest.mark.parametrize("args, needle", [
    (["--model.dim=32"], "model.dim: model.dim=32 conflicts with dim=64 in"),
    (["--model.path=/somewhere"], "model.init_from and model.path both name starting weights"),
    (["--lora.rank=8"], "model.init_from does not start LoRA runs yet"),
])
def test_a_contradicting_key_is_one_line(two_rank_run, args, needle):
    with pytest.raises(ShardfitError) as e:
        load_config(None, [f"--model.init_from={two_rank_run}", *args])
    assert needle in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize("where, needle", [
    ("missing", "model.init_from=MISSING: no such checkpoint or run directory"),
    ("empty", "no complete checkpoint in EMPTY"),
])
def test_a_directory_without_a_checkpoint_is_one_line(tmp_path, where, needle):
    (tmp_path / "empty").mkdir()
    spec = str(tmp_path / where)
    with pytest.raises(ShardfitError) as e:
        load_config(None, [f"--model.init_from={spec}"])
    assert needle.replace(where.upper(), spec) in str(e.value)
