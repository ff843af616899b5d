"""Variable-length training: packed fine-tuning's gradient is that of the examples one by one, token-budget training
on 2 ranks equals single-process training with skewed lengths, resume is exact, and the validation loss is the
mean over the validation tokens."""

import json

import numpy as np
import torch
import torch.nn.functional as F

from shardfit.config import load_config
from shardfit.data.build import build_datasets
from shardfit.data.dataset import stack_rows
from shardfit.data.sft import example_tokens
from shardfit.models import build_model
from shardfit.models.attention import DocumentMask
from shardfit.train import Trainer
from tests._dist import run_ranks
from tests.helpers import SMALL, full_state, reference_train
from tests.train.test_checkpoint_resume import _uninterrupted_then_resumed


def _write_sft(path, n=64, seed=0):
    """Skewed lengths: most examples short, a few near the 32-token rows (and some longer: truncated)."""
    rng = np.random.default_rng(seed)
    with open(path, "w") as f:
        for i in range(n):
            total = int(min(40, rng.lognormal(np.log(8), 0.9) + 2))
            p = int(rng.integers(1, total))
            f.write(json.dumps({"prompt": f"{i % 10}" + "q" * p, "completion": "a" * (total - p)}) + "\n")
    return str(path)


def test_packed_gradient_equals_examples_one_by_one(tmp_path):
    cfg = load_config(None, [*SMALL, f"--data.path={_write_sft(tmp_path / 'd.jsonl')}"])
    ds, _, _ = build_datasets(cfg.data, cfg.model.vocab_size)
    model = build_model(cfg.model)
    model.init_weights(1)
    mb = stack_rows([ds.row(k) for k in range(4)])
    n = int((mb.labels != -100).sum())
    mask = DocumentMask.build(mb.position_ids, "sdpa", torch.device("cpu"))
    (model(mb.input_ids, mb.labels, mb.position_ids, mask) / n).backward()
    packed = {k: p.grad.clone() for k, p in model.named_parameters()}
    model.zero_grad()
    for k in range(4):
        for i in ds._locate(k):  # each example of those rows, alone, unpadded (truncated to seq_len as in a row)
            ids, labels, _ = example_tokens(*ds.examples[i], cfg.data.seq_len)
            x, y = torch.from_numpy(ids[None].astype(np.int64)), torch.from_numpy(labels[None].astype(np.int64))
            logits = model(x)
            (F.cross_entropy(logits.flatten(0, 1), y.flatten(), ignore_index=-100, reduction="sum") / n).backward()
    for k, p in model.named_parameters():
        torch.testing.assert_close(packed[k], p.grad, rtol=1e-5, atol=1e-6, msg=k)


def _train(rank, world, args, run_dir):
    t = Trainer(load_config(None, [*args, f"--logging.run_dir={run_dir}"]))
    passes = []
    step = t.batches.step
    t.batches.step = lambda s: passes.append(len(out := step(s))) or out  # micro-batches run per step
    losses = [h["loss"] for h in t.fit()]
    evals = []
    if rank == 0:
        with open(f"{run_dir}/metrics.jsonl") as f:
            evals = [json.loads(line) for line in f if '"eval"' in line]
    state = full_state(t.model)
    return {"losses": losses, "passes": passes, "evals": evals,
            "state": {k: v.tolist() for k, v in state.items()} if rank == 0 else None}


def test_token_budget_two_ranks_equal_one_process_with_skewed_lengths(tmp_path):
    data = _write_sft(tmp_path / "d.jsonl", 96)
    args = [*SMALL, f"--data.path={data}", "--train.micro_batch_tokens=64", "--train.global_batch=12",
            "--data.pack=false", "--compute.activation_checkpoint=full"]
    res = run_ranks(_train, 2, args, str(tmp_path / "run"))
    assert res[0]["passes"] == res[1]["passes"]  # the same number of forward/backward passes on both ranks
    assert len(set(res[0]["passes"])) > 1  # ...which the lengths made vary from step to step
    ref_model, ref_losses = reference_train(load_config(None, args))  # the same examples, one padded row each
    torch.testing.assert_close(torch.tensor(res[0]["losses"]), torch.tensor(ref_losses), rtol=1e-5, atol=1e-5)
    ref = ref_model.state_dict()
    for k, v in res[0]["state"].items():
        torch.testing.assert_close(torch.tensor(v), ref[k], rtol=1e-4, atol=1e-4, msg=k)


def test_packed_sft_two_ranks_equal_one_process_and_validation_is_the_token_mean(tmp_path):
    data = _write_sft(tmp_path / "d.jsonl", 80)
    args = [*SMALL, f"--data.path={data}", "--data.val_fraction=0.2", "--train.eval_every=2",
            "--train.micro_batch=2"]
    res = run_ranks(_train, 2, args, str(tmp_path / "run"))
    cfg = load_config(None, args)
    ref_model, ref_losses = reference_train(cfg)
    torch.testing.assert_close(torch.tensor(res[0]["losses"]), torch.tensor(ref_losses), rtol=1e-5, atol=1e-5)
    # The last evaluation (after step 4) is the mean cross-entropy over every validation token of the trained model.
    _, val, _ = build_datasets(cfg.data, cfg.model.vocab_size)
    mb = stack_rows([val.row(k) for k in range(val.num_windows)])
    mask = DocumentMask.build(mb.position_ids, "sdpa", torch.device("cpu"))
    with torch.no_grad():
        logits = ref_model(mb.input_ids, position_ids=mb.position_ids if mask else None, mask=mask)
        want = F.cross_entropy(logits.flatten(0, 1), mb.labels.flatten(), ignore_index=-100).item()
    evals = res[0]["evals"]
    assert [e["step"] for e in evals] == [2, 4]
    assert evals[-1]["val_tokens"] == int((mb.labels != -100).sum())
    assert abs(evals[-1]["val_loss"] - want) < 1e-4 * want


def test_packed_sft_and_token_budget_resume_exactly(tmp_path):
    data = _write_sft(tmp_path / "d.jsonl", 80)
    for i, extra in enumerate(([f"--data.path={data}"],
                               [f"--data.path={data}", "--train.micro_batch_tokens=64", "--train.global_batch=12"])):
        r = run_ranks(_uninterrupted_then_resumed, 2, str(tmp_path / str(i)), extra)[0]
        assert r["b"] == r["a"][3:] and r["same_params"]


def test_token_budget_rows_are_masked_even_without_data_document_mask(tmp_path):
    """Examples laid end to end in a [1, T] row are unrelated: their mask and restarting positions do not depend on
    data.document_mask (which governs packed pretraining windows)."""
    from shardfit.train.batches import BatchSource

    data = _write_sft(tmp_path / "sft.jsonl")
    cfg = load_config(None, [*SMALL, f"--data.path={data}", "--data.seq_len=32", "--train.micro_batch_tokens=64",
                             "--train.global_batch=8", "--data.document_mask=false", "--train.device=cpu"])
    train, val, _ = build_datasets(cfg.data, cfg.model.vocab_size, token_budget=True)
    batches = BatchSource(cfg, train, val, 0, 1, 0, 1, torch.device("cpu")).step(0)
    assert batches and all(b.mask is not None and b.position_ids is not None for b in batches)
    assert all(int((b.position_ids == 0).sum()) > 1 for b in batches)  # several examples a row, each from 0
