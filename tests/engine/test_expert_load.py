"""Expert load per step (max / mean rows per expert, summed over micro-batches and ranks) and the
auxiliary-loss-free balancing bias (train/metrics.py ExpertLoad, models/moe.py)."""

import json

import torch

from shardfit.models.moe import MoE, update_balance_bias
from shardfit.train import Trainer
from tests._dist import run_ranks
from tests.helpers import small_config

MOE = ["--model.n_experts=8", "--model.experts_per_token=2", "--model.moe_ffn_dim=32", "--train.micro_batch=1",
       "--train.steps=3"]


def _counted(rank, world, extra, run_dir):
    """Train while counting each MoE layer's routing with a hook (checkpointing off: one forward per micro-batch)."""
    trainer = Trainer(small_config(*MOE, *extra, run_dir=run_dir))
    blocks = [b for b in trainer.model.model.layers if isinstance(b.mlp, MoE)]
    moes = [b.mlp for b in blocks]
    counts = torch.zeros(len(moes), 8, dtype=torch.float64)
    def count(block, args, out, i):
        counts[i] += block.mlp.load.double().cpu()  # returns None: the hook leaves the output alone

    for i, b in enumerate(blocks):  # the block calls MoE's phases (models/decoder.py): hook the block
        b.register_forward_hook(lambda mod, args, out, i=i: count(mod, args, out, i))
    rec = trainer.train_step()
    return {"mine": counts.tolist(), "moe": rec.moe,
            "bias": [m.balance_bias.tolist() for m in moes if m.balance_bias is not None]}


def test_load_is_the_global_count_and_the_bias_moves_towards_even_load(tmp_path):
    """2 ranks x 2 micro-batches: every rank reports the load of all four forwards together, and with
    model.router_bias_rate each layer's bias moved by rate x sign(mean - load), the same on both ranks."""
    rate = 0.01
    res = run_ranks(_counted, 2, [f"--model.router_bias_rate={rate}"], str(tmp_path))
    load = torch.tensor(res[0]["mine"]) + torch.tensor(res[1]["mine"])  # [L, E]
    assert res[0]["moe"] == res[1]["moe"]
    want = (load.max(1).values / load.mean(1)).tolist()
    torch.testing.assert_close(torch.tensor(res[0]["moe"]["moe_load_per_layer"]), torch.tensor(want), atol=1e-3,
                               rtol=0)
    assert abs(res[0]["moe"]["moe_load_max_over_mean"] - max(want)) < 1e-9 and max(want) > 1.0
    expected_bias = rate * torch.sign(load.mean(1, keepdim=True) - load)
    for r in res:
        torch.testing.assert_close(torch.tensor(r["bias"]), expected_bias.float())


def test_bias_changes_the_choice_of_experts_not_their_weights():
    torch.manual_seed(0)
    moe = MoE(16, 4, 2, 8, norm_topk_prob=False, balance_bias=True)
    h = torch.randn(10, 16)
    w0, ids0 = moe.route(h)
    moe.balance_bias[3] = 10.0  # expert 3 wins every token's first slot
    w1, ids1 = moe.route(h)
    assert (ids1[:, 0] == 3).all() and not (ids0[:, 0] == 3).all()
    probs = torch.softmax(moe.gate(h), -1)
    torch.testing.assert_close(w1, probs.gather(-1, ids1))  # the weights stay the router's probabilities


def test_bias_updates_even_out_a_skewed_router():
    """DeepSeek-V3's rule on a router that sends most tokens to expert 0 (fixed inputs, no training): the bias
    alone brings the load close to even."""
    torch.manual_seed(0)
    moe = MoE(16, 8, 2, 8, norm_topk_prob=True, balance_bias=True)
    h = torch.randn(2048, 16) + 0.5
    with torch.no_grad():
        moe.gate.weight.normal_(0, 0.3)
        moe.gate.weight[0] += 0.4  # expert 0 first for most tokens: 3.3x the mean load

    def ratio():
        moe(h[None])
        return (moe.load.max() / moe.load.float().mean()).item(), moe.load[None].double()

    start, load = ratio()
    for _ in range(300):
        update_balance_bias([moe], load, 0.003)
        now, load = ratio()
    assert start > 3.0 and now < 1.25, (start, now)


def test_expert_load_is_in_the_log_line_and_metrics(tmp_path, capsys):
    trainer = Trainer(small_config(*MOE, "--logging.log_every=1", "--logging.progress=lines",
                                   run_dir=str(tmp_path)))
    trainer.fit()
    recs = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert all(r["moe_load_max_over_mean"] >= 1.0 and len(r["moe_load_per_layer"]) == 2 for r in recs if "loss" in r)
    assert "expert load max/mean" in capsys.readouterr().out


def test_balancing_biases_are_saved_and_resumed(tmp_path):
    """The biases are model state (persistent buffers): a resumed run repeats the uninterrupted one bit for bit."""
    from tests.train.test_checkpoint_resume import _uninterrupted_then_resumed

    extra = ["--model.n_experts=8", "--model.experts_per_token=2", "--model.moe_ffn_dim=32",
             "--model.router_bias_rate=0.01"]
    r = run_ranks(_uninterrupted_then_resumed, 2, str(tmp_path), extra)[0]
    assert r["b"] == r["a"][3:] and r["same_params"]
