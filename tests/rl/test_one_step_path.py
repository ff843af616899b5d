"""The RL API and the Tinker server take the trainer's step path (engine/engine.py, rl/step.py):

- SFT data sent as Tinker datums through the official SDK to `shardfit serve` is `shardfit train` on the same data,
  step for step: the losses and the weights bit for bit on the CPU;
- an MoE step through the Engine's RL API with a per-token loss applies the router's load-balancing term and moves
  the auxiliary-loss-free bias exactly as `shardfit train`'s cross-entropy does (same gradients, same biases).
"""

from __future__ import annotations

import json
import os
import threading

import numpy as np
import pytest
import torch

from tests._dist import run_ranks
from tests.helpers import SMALL

tinker = pytest.importorskip("tinker")

STEPS, BATCH, BUDGET = 3, 6, 64


def _records(path) -> None:
    rng = np.random.default_rng(0)
    words = ["red", "green", "blue", "cat", "dog", "sun", "moon", "tree", "river", "stone"]
    with open(path, "w") as f:
        for _ in range(40):
            p = " ".join(rng.choice(words, rng.integers(2, 6)))
            c = " ".join(rng.choice(words, rng.integers(1, 5)))
            f.write(json.dumps({"prompt": f"{p}?", "completion": f" {c}."}) + "\n")


def _args(data, run_dir, *extra):
    return [*SMALL, "--model.vocab_size=264", "--train.device=cpu", f"--data.path={data}",
            f"--train.micro_batch_tokens={BUDGET}", f"--train.global_batch={BATCH}", f"--train.steps={STEPS}",
            "--train.warmup_steps=1", "--train.lr=3e-3", "--train.weight_decay=0.1", f"--logging.run_dir={run_dir}",
            *extra]


def _full(model) -> dict[str, torch.Tensor]:
    return {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
            for n, p in model.named_parameters()}


def _sdk_equals_train(rank, world, data, root):
    os.environ["TINKER_TELEMETRY"] = "0"
    from tinker import types

    from shardfit.config import load_config
    from shardfit.engine import Engine
    from shardfit.engine.optim import lr_at
    from shardfit.serve.server import start_rank0
    from shardfit.train import Trainer

    trainer = Trainer(load_config(None, _args(data, f"{root}/train")))
    ds, cfg = trainer.dataset, trainer.cfg
    steps, train_losses = [], []
    for step in range(STEPS):  # the examples of each step, in the loader's order, as datums
        items = [ds.item(k) for k in range(step * BATCH, (step + 1) * BATCH)]
        steps.append([types.Datum(model_input=types.ModelInput.from_ints(inp.tolist()),
                                  loss_fn_inputs={"target_tokens": np.where(lab >= 0, lab, 0).astype(np.int64),
                                                  "weights": (lab >= 0).astype(np.float32)})
                      for inp, lab, _ in items])
        train_losses.append(trainer.train_step().loss)
    trainer.finish_step()
    want = _full(trainer.model)

    scfg = load_config(None, _args(data, f"{root}/serve"))
    engine = Engine.start(scfg)
    serving = start_rank0(scfg, engine, port=0, api_key="tml-test")
    loop = threading.Thread(target=serving.loop.run, daemon=True)
    loop.start()
    sdk_losses = []
    try:
        with tinker.ServiceClient(base_url=serving.url, api_key="tml-test") as sc:
            tc = sc.create_lora_training_client(base_model="tiny", rank=0).result()
            for step, datums in enumerate(steps):
                fb = tc.forward_backward(datums, "cross_entropy", loss_fn_config={"normalize": "token_mean"})
                tc.optim_step(types.AdamParams(learning_rate=lr_at(step, cfg.train), beta1=cfg.train.beta1,
                                               beta2=cfg.train.beta2, eps=cfg.train.eps,
                                               weight_decay=cfg.train.weight_decay,
                                               grad_clip_norm=cfg.train.grad_clip)).result()
                sdk_losses.append(fb.result().metrics["loss:sum"])
    finally:
        serving.state.scheduler.close()
        loop.join(30)
        serving.stop()
    engine.finish()
    got = _full(engine.model)
    return {"train": train_losses, "sdk": sdk_losses,
            "weights_equal": all(torch.equal(want[n], got[n]) for n in want),
            "moved": max(float((want[n] - got[n]).abs().max()) for n in want)}


def test_sft_through_the_sdk_is_shardfit_train_bit_for_bit(tmp_path):
    data = tmp_path / "sft.jsonl"
    _records(data)
    r = run_ranks(_sdk_equals_train, 1, str(data), str(tmp_path), timeout=300)[0]
    assert r["train"] == r["sdk"], r  # bit for bit (JSON floats round-trip exactly)
    assert r["train"][0] > r["train"][-1]  # it trained
    assert r["weights_equal"], r["moved"]


MOE = ["--model.n_experts=8", "--model.experts_per_token=2", "--model.moe_ffn_dim=32", "--model.router_aux_coef=0.05",
       "--model.router_bias_rate=0.01", "--train.micro_batch_tokens=32", "--logging.run_dir="]


def _moe_steps(rank, world):
    return {aux: _moe_step(aux) for aux in (0.05, 0.0)}


def _moe_step(aux):
    """The same tokens through (a) the trainer's cross-entropy (engine CrossEntropy) and (b) the RL API with a
    per-token loss -logp normalised over the global batch's tokens: the same objective, MoE term included."""
    from shardfit.config import load_config
    from shardfit.engine import AdamParams, CrossEntropy, Engine
    from shardfit.rl import DatumEngine, make_datum
    from shardfit.rl.pack import datum_batches, plan_datums

    args = [*SMALL, "--train.device=cpu", *MOE, f"--model.router_aux_coef={aux}"]
    rng = np.random.default_rng(1)
    seqs = [rng.integers(0, 256, n + 1) for n in (30, 12, 25, 9, 17)]
    datums = [make_datum(s[:-1], target_tokens=s[1:], weights=np.ones(len(s) - 1)) for s in seqs]
    out = {}
    for how in ("train", "rl"):
        engine = Engine.start(load_config(None, args))
        if how == "train":  # the trainer's path: packed batches and its cross-entropy
            plan = plan_datums(datums, engine.datum_budget(), 1, 1)
            batches = datum_batches(plan, datums, None, None, 0, 0, engine.doc_kernel(plan.budget, True),
                                    engine.device)
            engine.forward_backward(batches, CrossEntropy())
        else:  # a per-token loss of the RL API (a callable: never routed to the fused cross-entropy)
            DatumEngine(engine).forward_backward(datums, lambda logp, x, cfg: -logp, {"normalize": "token_mean"})
        rec = engine.optim_step(AdamParams(learning_rate=1e-2))
        moes = [b.mlp for b in engine.model.model.layers if hasattr(b.mlp, "balance_bias")]
        out[how] = {"weights": {n: t.tolist() for n, t in _full(engine.model).items() if "gate.weight" in n},
                    "bias": [m.balance_bias.tolist() for m in moes], "moe": rec.moe, "loss": rec.loss}
    return out


def test_an_moe_rl_step_balances_experts_as_shardfit_train_does():
    r = run_ranks(_moe_steps, 1)[0]
    with_aux, without = r["0.05"], r["0.0"]
    for r in (with_aux, without):
        assert r["train"]["bias"] == r["rl"]["bias"] and any(any(b) for b in r["rl"]["bias"])  # the bias moved alike
        assert r["train"]["moe"] == r["rl"]["moe"]
        for n, w in r["train"]["weights"].items():  # the routers after the step: the same gradients
            np.testing.assert_allclose(r["rl"]["weights"][n], w, rtol=1e-5, atol=1e-6)
    # the load-balancing term reached the routers through the RL API (it changes them)
    n = next(iter(with_aux["rl"]["weights"]))
    assert not np.allclose(with_aux["rl"]["weights"][n], without["rl"]["weights"][n], atol=1e-7)


def _different_data(rank, world):
    """Rank 1 is given other datums (a loop that sampled on one rank): both ranks refuse, in one line, in the same
    call; the same datums afterwards train as usual."""
    from shardfit.config import load_config
    from shardfit.rl import AdamParams, DatumEngine, make_datum

    e = DatumEngine.start(load_config(None, [*SMALL, "--train.device=cpu", "--train.micro_batch_tokens=32",
                                             "--logging.run_dir="]))
    rng = np.random.default_rng(rank)  # different on each rank
    mine = [make_datum(s[:-1], target_tokens=s[1:]) for s in (rng.integers(0, 256, 12), rng.integers(0, 256, 9))]
    out = {}
    try:
        e.forward_backward(mine, "cross_entropy")
    except Exception as err:  # noqa: BLE001  the message is the assertion
        out["error"] = str(err)
    out["pending"] = e.engine.pending
    same = [make_datum(np.arange(12), target_tokens=np.arange(1, 13))]
    out["loss"] = e.forward_backward(same, "cross_entropy").metrics["loss:sum"]
    out["grad_norm"] = e.optim_step(AdamParams(learning_rate=1e-3))["grad_norm:mean"]
    return out


def test_ranks_given_different_datums_are_refused_on_every_rank():
    r = run_ranks(_different_data, 2)
    for x in r:
        assert "ranks were given different data: rank(s) 1 differ from rank 0" in x["error"], x
        assert "\n" not in x["error"] and not x["pending"]
    assert r[0]["loss"] == r[1]["loss"] and r[0]["grad_norm"] == r[1]["grad_norm"] > 0


def _mean_ce_outputs(rank, world):
    from shardfit.config import load_config
    from shardfit.rl import DatumEngine, make_datum

    e = DatumEngine.start(load_config(None, [*SMALL, "--train.device=cpu", "--train.micro_batch_tokens=32",
                                             "--logging.run_dir="]))
    rng = np.random.default_rng(3)
    data = []
    for n in (14, 9, 20):
        s = rng.integers(0, 256, n + 1)
        w = np.ones(n)
        w[:4] = 0  # a prompt
        data.append(make_datum(s[:-1], target_tokens=s[1:], weights=w))
    ref = e.forward(data, "cross_entropy")  # the per-token head: every target's log-prob
    got = e.forward_backward(data, "cross_entropy", {"normalize": "token_mean"})  # the trainer's fused head
    return [[a["logprobs"].tolist(), b["logprobs"].tolist()] for a, b in zip(ref.outputs, got.outputs)]


def test_the_trainers_cross_entropy_reports_every_targets_logprob():
    """Routed to the fused cross-entropy, a token_mean forward_backward still returns the log-prob of every target,
    the weight-0 (prompt) tokens' included, as Tinker's loss_fn_outputs carry them."""
    for ref, got in run_ranks(_mean_ce_outputs, 1)[0]:
        np.testing.assert_allclose(got, ref, rtol=0, atol=1e-5)
        assert all(v < 0 for v in got[:4])  # the prompt's log-probs are there, not zeros
