"""FLOPs per token: the anchors' formula for dense models (tied and untied heads counted alike) and the MoE anchor's
active-parameter formula for MoE models, with the parameter counts checked against the built modules."""

import ast
from pathlib import Path

import pytest
import torch

from shardfit.config import load_config
from shardfit.models import build_model, count_params
from shardfit.train.metrics import active_params, flops_per_token

ANCHOR = Path(__file__).resolve().parents[3] / "shared" / "anchors" / "hf_fsdp2_qwen3moe.py"


def _meta(argv):
    cfg = load_config(None, argv).model
    with torch.device("meta"):
        model = build_model(cfg)
    return cfg, model


def _norm_params(model) -> int:
    return sum(p.numel() for name, p in model.named_parameters() if "norm" in name)


def test_tied_and_untied_models_do_the_same_work():
    out = {}
    for tied in (True, False):
        cfg, model = _meta(["--model.name=llama3-1b", f"--model.tie_embeddings={tied}"])
        out[tied] = flops_per_token(cfg, count_params(model), 4096)
    assert out[True] == out[False]
    # the untied Llama-3.2-1B shape: 6 x (1.498e9 - 0.263e9 embedding) + 12 x 16 x 2048 x 4096
    assert abs(out[False] - (6 * (1_498_482_688 - 128256 * 2048) + 12 * 16 * 2048 * 4096)) < 1


def test_dense_active_params_are_the_non_embedding_matrices():
    """For a dense model the two counts differ by exactly the norm weights: active_params counts each matrix."""
    cfg, model = _meta(["--model.name=llama3-1b", "--model.n_layers=2", "--model.tie_embeddings=false"])
    embedding = cfg.vocab_size * cfg.dim
    assert active_params(cfg) == count_params(model) - embedding - _norm_params(model)


def _anchor_flops(layers: int, seq: int) -> int:
    """The MoE anchor's own lines (H, E, k, I, L = ...; attn = ...; active = ...; flop_per_tok = ...), evaluated."""
    if not ANCHOR.is_file():
        pytest.skip(f"anchor script not found at {ANCHOR}")
    lines = [ln.strip() for ln in ANCHOR.read_text().splitlines()]
    wanted = [ln for ln in lines if ln.startswith(("H, E, k, I, L =", "attn =", "active =", "flop_per_tok ="))]
    assert len(wanted) == 4, wanted
    env = {"a": type("A", (), {"layers": layers, "seq": seq}),
           "cfg": type("C", (), {"vocab_size": 151936})}  # the anchor's Qwen3MoeConfig(vocab_size=151936, ...)
    for ln in wanted:
        exec(compile(ast.parse(ln.split("#")[0]), str(ANCHOR), "exec"), env)
    return env["flop_per_tok"]


@pytest.mark.parametrize("layers, seq", [(12, 4096), (48, 8192)])
def test_moe_matches_the_anchor_and_counts_active_experts_only(layers, seq):
    cfg, model = _meta(["--model.name=qwen3-30b-a3b", f"--model.n_layers={layers}"])
    n = count_params(model)
    got = flops_per_token(cfg, n, seq)
    assert got == _anchor_flops(layers, seq)
    # active parameters are every parameter but the embedding, the norms and the experts a token is not routed to
    experts = sum(p.numel() for name, p in model.named_parameters() if ".experts." in name)
    idle = experts * (cfg.n_experts - cfg.experts_per_token) // cfg.n_experts
    assert active_params(cfg) == n - cfg.vocab_size * cfg.dim - _norm_params(model) - idle
    # the formula that printed mfu 1.178: every expert's parameters and hidden size for the attention width
    old = 6 * (n - cfg.vocab_size * cfg.dim) + 12 * cfg.n_layers * cfg.dim * seq
    assert old / got > 5


def test_dense_layers_of_an_moe_model_count_their_mlp():
    cfg, model = _meta(["--model.name=qwen3-30b-a3b", "--model.n_layers=4", "--model.dense_layers=0,2"])
    experts = sum(p.numel() for name, p in model.named_parameters() if ".experts." in name)
    idle = experts * (cfg.n_experts - cfg.experts_per_token) // cfg.n_experts
    assert active_params(cfg) == count_params(model) - cfg.vocab_size * cfg.dim - _norm_params(model) - idle


def test_log_window_counts_the_loops_wall_time_but_not_evaluation():
    """tokens/s is over wall time from the previous window's last step: the loop's own work between steps counts
    (the step's time_s alone left out work after the optimizer's launch: +8% on a one-GPU MoE step); evaluation and
    checkpoints, after restart(), do not."""
    import time
    from types import SimpleNamespace

    from shardfit.train.metrics import LogWindow

    rec = SimpleNamespace(time_s=0.001, capacity=100, loss_tokens=90, real_tokens=95, phases={})
    w = LogWindow()
    time.sleep(0.05)  # a step and the loop's work around it
    w.add(rec)
    assert w.seconds >= 0.05 and w.steps == 1
    time.sleep(0.05)  # evaluation
    w.restart()
    w.add(rec)
    assert w.seconds < 0.09  # the evaluation's 0.05 s left out
    nxt = LogWindow(since=w.mark)
    time.sleep(0.02)  # the log line itself
    nxt.add(rec)
    assert nxt.seconds >= 0.02
