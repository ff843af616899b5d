"""The Engine's RL API (issue 24): forward's log-probs equal per-sequence ones, each loss's gradient equals a
hand-written reference, 2 gloo ranks equal 1 with skewed datums, optim_step applies Tinker's AdamParams, state
round-trips exactly, weights() streams the model under its Hugging Face names, and bad input is one clear error."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from tests._dist import run_ranks
from tests.helpers import SMALL

ARGS = [*SMALL, "--train.device=cpu", "--train.micro_batch_tokens=32", "--logging.run_dir="]


def _engine(*extra):
    from shardfit.config import load_config
    from shardfit.rl import DatumEngine as Engine  # the Engine through datums (rl/step.py)

    return Engine.start(load_config(None, [*ARGS, *extra]))


def _reference_model(engine):
    from shardfit.models import build_model

    model = build_model(engine.cfg.model, loss_chunk=engine.cfg.compute.loss_chunk)
    model.init_weights(engine.cfg.train.seed)
    return model


def _ref_logprobs(model, tokens, targets):
    """Each datum alone, full logits: log_softmax gathered at the targets, and the entropies."""
    ls = torch.log_softmax(model(torch.as_tensor(tokens)[None]).float()[0], -1)
    return ls.gather(1, torch.as_tensor(targets)[:, None]).squeeze(1), -(ls.exp() * ls).sum(-1)


def _datums(model, lengths, seed=0):
    from shardfit.rl import make_datum

    rng = np.random.default_rng(seed)
    out = []
    for L in lengths:
        seq = rng.integers(0, 256, L + 1)
        with torch.no_grad():
            lp, _ = _ref_logprobs(model, seq[:-1], seq[1:])
        mask = np.ones(L)
        mask[:min(3, L - 1)] = 0  # a prompt
        out.append(make_datum(seq[:-1], target_tokens=seq[1:], weights=rng.integers(0, 2, L) * 1.0, mask=mask,
                              logprobs=lp.numpy() + rng.normal(0, 0.3, L), advantages=rng.normal(0, 1, L),
                              ref_logprobs=lp.numpy() + rng.normal(0, 0.2, L)))
    return out


def _grads(engine) -> dict[str, torch.Tensor]:
    out = {}
    for name, p in engine.model.named_parameters():
        g = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
        out[name] = g.detach().clone()
    for p in engine.params:
        p.grad = None
    return out


def _hand_written(case, logp, ent, d):
    """One datum's summed loss, before normalisation, written from the definitions (not rl/losses.py)."""
    x = {k: torch.as_tensor(v, dtype=torch.float32) for k, v in d.inputs.items()}
    m = x["mask"]
    if case == "cross_entropy":
        return (-x["weights"] * logp * m).sum(), m.sum()  # the mask input multiplies every loss
    r = torch.exp(logp - x["logprobs"])
    if case == "importance_sampling":
        return (-(r * x["advantages"]) * m).sum(), m.sum()
    if case == "ppo":
        A = x["advantages"]
        t = -torch.minimum(r * A, r.clamp(0.9, 1.1) * A)
        t = torch.where(A < 0, torch.minimum(t, -3.0 * A), t)
        dk = x["ref_logprobs"] - logp
        t = t + 0.1 * (torch.exp(dk) - dk - 1) - 0.01 * ent
        return (t * m).sum(), m.sum()
    return (((logp - x["advantages"]) ** 2) * m).sum(), m.sum()


CASES = {
    "cross_entropy": ("cross_entropy", {}),
    "importance_sampling": ("importance_sampling", {"normalize": "token_mean"}),
    "ppo": ("ppo", {"normalize": "sequence_mean", "clip_low_threshold": 0.9, "clip_high_threshold": 1.1,
                    "dual_clip": 3.0, "kl_coef": 0.1, "entropy_coef": 0.01}),
    "custom": ("custom", {"normalize": "constant", "normalize_constant": 4.0}),
}


def _losses_vs_reference(rank, world):
    engine = _engine()
    model = _reference_model(engine)
    datums = _datums(model, [9, 25, 4, 17, 30])
    report = {}
    # forward: packed log-probs equal each datum's own
    fwd = engine.forward(datums)
    ref = [_ref_logprobs(model, d.tokens, d.inputs["target_tokens"])[0].detach().numpy() for d in datums]
    report["forward"] = max(float(np.abs(o["logprobs"] - r).max()) for o, r in zip(fwd.outputs, ref))
    expected = sum(float(-(d.inputs["weights"] * d.inputs["mask"] * r).sum()) for d, r in zip(datums, ref))
    report["forward_loss"] = abs(fwd.metrics["loss:sum"] - expected)
    for case, (loss_fn, cfg) in CASES.items():
        if case == "custom":
            # mask applied by the engine (m_t): the callable returns the bare per-token loss
            def loss_fn(logp, x, _cfg):
                return (logp - x["advantages"]) ** 2
        res = engine.forward_backward(datums, loss_fn, cfg)
        got = _grads(engine)
        model.zero_grad(set_to_none=True)
        parts = []
        for d in datums:
            lp, ent = _ref_logprobs(model, d.tokens, d.inputs["target_tokens"])
            parts.append(_hand_written(case, lp, ent, d))
        if case == "cross_entropy":
            total = sum(p[0] for p in parts)
        elif case == "importance_sampling":
            total = sum(p[0] for p in parts) / sum(p[1] for p in parts)
        elif case == "ppo":
            total = sum(p[0] / p[1] for p in parts) / len(parts)
        else:
            total = sum(p[0] for p in parts) / 4.0
        total.backward()
        report[case] = max(float((got[n] - p.grad).abs().max() / (p.grad.abs().max() + 1e-12))
                           for n, p in model.named_parameters())
        report[case + "_loss"] = abs(res.metrics["loss:sum"] - total.item()) / abs(total.item())
        report[case + "_logprobs"] = max(float(np.abs(o["logprobs"] - r).max()) for o, r in zip(res.outputs, ref))
    return report


@pytest.mark.slow
def test_forward_and_each_loss_equal_hand_written_references():
    report = run_ranks(_losses_vs_reference, 1)[0]
    assert report["forward"] < 1e-5 and report["forward_loss"] < 1e-3
    for case in CASES:
        assert report[case] < 1e-4, (case, report[case])
        assert report[case + "_loss"] < 1e-5, (case, report)
        assert report[case + "_logprobs"] < 1e-5, (case, report)


def _train(rank, world, lengths_per_step):
    from shardfit.rl import AdamParams

    engine = _engine()
    model = _reference_model(engine)
    out = []
    for i, lengths in enumerate(lengths_per_step):
        datums = _datums(model, lengths, seed=i)
        res = engine.forward_backward(datums, "ppo", {"normalize": "token_mean", "kl_coef": 0.05})
        opt = engine.optim_step(AdamParams(learning_rate=1e-2, grad_clip_norm=1.0, weight_decay=0.1))
        out.append({"loss": res.metrics["loss:sum"], "gap": res.metrics["sampler_logprob_gap:mean"],
                    "clip": res.metrics["clip_fraction:mean"], "norm": opt["grad_norm:mean"],
                    "logprobs": [o["logprobs"].tolist() for o in res.outputs]})
    final = engine.forward(_datums(model, [20, 7], seed=99))
    return {"steps": out, "final": [o["logprobs"].tolist() for o in final.outputs]}


# skewed: one datum much longer than the rest, a step with fewer datums than ranks, a step with many short ones
SKEWED = [[30, 3, 4, 2], [31], [5] * 9 + [28]]


@pytest.mark.slow
def test_two_gloo_ranks_equal_one_with_skewed_datums():
    one = run_ranks(_train, 1, SKEWED)[0]
    two = run_ranks(_train, 2, SKEWED)
    assert two[0] == two[1]  # every rank returns every datum's outputs
    for a, b in zip(one["steps"], two[0]["steps"]):
        for key in ("loss", "gap", "clip", "norm"):
            assert math.isclose(a[key], b[key], rel_tol=1e-4, abs_tol=1e-6), (key, a[key], b[key])
        for x, y in zip(a["logprobs"], b["logprobs"]):
            np.testing.assert_allclose(x, y, atol=1e-5)
    for x, y in zip(one["final"], two[0]["final"]):
        np.testing.assert_allclose(x, y, atol=1e-4)  # the same updates were applied
    assert one["final"] != _train_nothing()  # and they did change the model


def _train_nothing():
    return run_ranks(_train, 1, [])[0]["final"]


def _state_round_trip(rank, world, root):
    from pathlib import Path

    from shardfit.rl import AdamParams

    def step(engine, model, i):
        engine.forward_backward(_datums(model, [12, 20], seed=i), "cross_entropy")
        engine.optim_step(AdamParams(learning_rate=5e-3))

    engine = _engine()
    model = _reference_model(engine)
    for i in range(2):
        step(engine, model, i)
    saved = engine.save_state(Path(root))
    step(engine, model, 2)
    probe = _datums(model, [15], seed=7)
    uninterrupted = engine.forward(probe).outputs[0]["logprobs"]
    weights = {n: t.float().clone() for bucket in engine.weights(torch.float32, bucket_bytes=20_000) for n, t in bucket}
    buckets = [[sum(t.nbytes for _, t in b), len(b)] for b in engine.weights(torch.float32, bucket_bytes=20_000)]
    state = {n: p.full_tensor() if hasattr(p, "full_tensor") else p for n, p in engine.model.named_parameters()}
    same = sorted(weights) == sorted(state) and all(torch.equal(weights[n], state[n].float()) for n in weights)
    engine.load_state(saved)  # weights and optimizer of step 2
    step(engine, model, 2)
    resumed = engine.forward(probe).outputs[0]["logprobs"]
    return {"diff": float(np.abs(uninterrupted - resumed).max()), "same": same, "buckets": buckets,
            "step": engine.step}


@pytest.mark.slow
def test_state_round_trip_is_exact_and_weights_stream_in_buckets(tmp_path):
    r = run_ranks(_state_round_trip, 2, str(tmp_path))[0]
    assert r["diff"] == 0.0  # resumed from save_state == uninterrupted, bit for bit
    assert r["same"]  # dense model: the Hugging Face names are the parameter names, the tensors the full ones
    assert len(r["buckets"]) > 2 and all(size <= 20_000 or n == 1 for size, n in r["buckets"])  # one tensor over
    assert r["step"] == 3


def _bad_input(rank, world):
    from shardfit.errors import ShardfitError
    from shardfit.rl import AdamParams, make_datum

    engine = _engine()
    good = [make_datum([1, 2, 3], target_tokens=[2, 3, 4])]
    cases = {
        "empty": ([], "cross_entropy", {}),
        "beyond vocabulary": ([make_datum([1, 99999], target_tokens=[2, 3])], "cross_entropy", {}),
        "target beyond vocabulary": ([make_datum([1, 2], target_tokens=[2, 10**6])], "cross_entropy", {}),
        "negative id": ([make_datum([1, -2], target_tokens=[2, 3])], "cross_entropy", {}),
        "ragged": ([make_datum([1, 2, 3], target_tokens=[2, 3])], "cross_entropy", {}),
        "missing input": (good, "ppo", {}),
        "unknown loss": (good, "wasserstein", {}),
        "unknown option": (good, "ppo", {"clip": 0.2}),
        "bad normalize": (good, "cross_entropy", {"normalize": "mean"}),
        "too long": ([make_datum(list(range(40)), target_tokens=list(range(40)))], "cross_entropy", {}),
        "nan": ([make_datum([1, 2], target_tokens=[2, 3], weights=[1.0, float("nan")])], "cross_entropy", {}),
    }
    seen = {}
    for name, (data, loss, cfg) in cases.items():
        try:
            engine.forward_backward(data, loss, cfg)
            seen[name] = "accepted"
        except ShardfitError as e:
            seen[name] = str(e)
    try:
        engine.optim_step(AdamParams(learning_rate=float("inf")))
    except ShardfitError as e:
        seen["adam"] = str(e)
    seen["after"] = engine.forward_backward(good).metrics["loss:sum"]  # the engine still works
    return seen


def test_bad_input_is_one_clear_error_and_the_engine_goes_on():
    seen = run_ranks(_bad_input, 1)[0]
    expect = {"empty": "no data", "beyond vocabulary": "99999", "target beyond vocabulary": "1000000",
              "negative id": "-2", "ragged": "shape", "missing input": "'logprobs'", "unknown loss": "wasserstein",
              "unknown option": "clip", "bad normalize": "normalize", "too long": "40 tokens", "nan": "non-finite",
              "adam": "learning_rate"}
    for name, needle in expect.items():
        assert needle in seen[name], (name, seen[name])
        assert "\n" not in seen[name]
    assert math.isfinite(seen["after"]) and seen["after"] > 0


def _forward_from_hf(rank, world, path):
    from shardfit.config import load_config
    from shardfit.rl import DatumEngine as Engine  # the Engine through datums (rl/step.py)
    from shardfit.rl import make_datum

    engine = Engine.start(load_config(None, [f"--model.path={path}", "--data.seq_len=32", "--train.device=cpu",
                                             "--train.micro_batch_tokens=64", "--logging.run_dir="]))
    rng = np.random.default_rng(3)
    seqs = [rng.integers(0, 300, n + 1) for n in (40, 9, 63, 22)]
    res = engine.forward([make_datum(s[:-1], target_tokens=s[1:]) for s in seqs])
    return {"seqs": [s.tolist() for s in seqs], "logprobs": [o["logprobs"].tolist() for o in res.outputs]}


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["qwen3", "qwen3_moe"])
def test_forward_equals_transformers_on_an_hf_checkpoint(tmp_path, kind):
    """Packed into token-budget rows on 2 ranks, each datum's log-probs are those transformers computes for it
    alone."""
    from tests.weights.test_hf_checkpoints import _save

    path, hf = _save(kind, tmp_path)
    got = run_ranks(_forward_from_hf, 2, str(path))
    assert got[0] == got[1]
    for seq, lp in zip(got[0]["seqs"], got[0]["logprobs"]):
        with torch.no_grad():
            ls = torch.log_softmax(hf(torch.tensor(seq[:-1])[None]).logits[0].double(), -1)
        ref = ls.gather(1, torch.tensor(seq[1:])[:, None]).squeeze(1).numpy()
        np.testing.assert_allclose(lp, ref, atol=2e-4)


def _gathered_passes(rank, world):
    import torch.distributed.fsdp._fully_shard._fsdp_param_group as pg

    from shardfit.parallel.gathered import fsdp_groups
    from shardfit.rl import AdamParams

    engine = _engine()
    model = _reference_model(engine)
    datums = _datums(model, [30, 20, 25, 9])  # 84 tokens: three micro-batches of 32
    gathers = []
    unshard = pg.FSDPParamGroup.unshard

    def counted(self, *args, **kwargs):
        if not self.is_unsharded:
            gathers.append(self)
        return unshard(self, *args, **kwargs)

    out: dict = {"groups": len(fsdp_groups(engine.model))}
    pg.FSDPParamGroup.unshard = counted
    try:
        for once in (False, True, False):
            engine.gather_once = once
            engine.finish()  # nothing gathered before the pass (the last block stays gathered after one without)
            gathers.clear()
            res = engine.forward(datums)
            out.setdefault(str(once), []).append([o["logprobs"].tolist() for o in res.outputs])
            out[f"gathers {once}"] = len(gathers)
            out[f"left gathered {once}"] = sum(g.is_unsharded for g in fsdp_groups(engine.model))
    finally:
        pg.FSDPParamGroup.unshard = unshard
    # A no-grad pass leaves the groups built without resharding after forward gathered (gather_once off: FSDP's own
    # behaviour); the optimizer step must not leave the next pass those copies from before it.
    engine.gather_once = False
    engine.forward_backward(datums[:2], "cross_entropy")
    engine.forward(datums[2:])
    engine.optim_step(AdamParams(learning_rate=1e-2))
    after = engine.forward(datums[:1]).outputs[0]["logprobs"]
    engine.finish()  # every parameter its shard: the current weights
    fresh = _reference_model(engine)
    fresh.load_state_dict({n: p.full_tensor() for n, p in engine.model.named_parameters()}, strict=False)
    with torch.no_grad():
        ref = _ref_logprobs(fresh, datums[0].tokens, datums[0].inputs["target_tokens"])[0].numpy()
        before = _ref_logprobs(model, datums[0].tokens, datums[0].inputs["target_tokens"])[0].numpy()
    out["stale"] = float(np.abs(after - ref).max())
    out["moved"] = float(np.abs(ref - before).max())
    return out


def test_forward_gathers_once_per_call_and_no_pass_reads_weights_from_before_a_step():
    """On one rank Engine.forward gathers each FSDP group once per call (not once per micro-batch), with log-probs bit
    for bit those of FSDP's own per-micro-batch gathers, and leaves nothing gathered; a gathered copy a no-grad pass
    leaves (FSDP's groups without resharding after forward) is dropped by the optimizer step, not read after it."""
    r = run_ranks(_gathered_passes, 1)[0]
    assert r["False"][0] == r["True"][0] == r["False"][1]  # bit for bit (JSON floats round-trip exactly)
    assert r["gathers True"] == r["groups"] == 3  # root (embedding, tied head, norm), two blocks
    assert r["gathers False"] > r["gathers True"] and r["gathers False"] >= 2 * 3  # three micro-batches
    assert r["left gathered True"] == 0
    assert r["left gathered False"] >= 1  # the last block, as fully_shard(reshard_after_forward=False) leaves it
    assert r["moved"] > 1e-3  # the step changed the model
    assert r["stale"] < 1e-5, r


def _moe_cast_passes(rank, world):
    from shardfit.parallel import expert
    from shardfit.parallel.expert import outside_fsdp_experts

    engine = _engine("--model.n_experts=4", "--model.experts_per_token=2", "--model.moe_ffn_dim=32",
                     "--compute.param_dtype=bfloat16")
    rng = np.random.default_rng(1)
    from shardfit.rl import make_datum

    datums = [make_datum(s[:-1], target_tokens=s[1:]) for s in (rng.integers(0, 256, n + 1) for n in (30, 20, 25, 9))]
    casts = []
    apply = expert._ComputeCast.apply

    def counted(*args):
        casts.append(args[1])
        return apply(*args)

    expert._ComputeCast.apply = counted
    out = {"experts": len(outside_fsdp_experts(engine.model))}
    try:
        for once in (False, True):
            engine.gather_once = once
            casts.clear()
            res = engine.forward(datums)
            out[str(once)] = [o["logprobs"].tolist() for o in res.outputs]
            out[f"casts {once}"] = len(casts)
            out[f"dtypes {once}"] = sorted({str(d) for d in casts})
            out[f"left {once}"] = sum(m.pass_cast is not None for m in outside_fsdp_experts(engine.model))
    finally:
        expert._ComputeCast.apply = apply
    return out


def test_forward_casts_the_experts_out_of_fsdp_once_per_call():
    """One rank keeps the MoE experts out of FSDP and casts their fp32 masters at each forward (parallel/expert.py):
    in Engine.forward's gathered pass they are cast once for the call (their first micro-batch) and freed at its
    end, with log-probs bit for bit those of a cast per micro-batch (bf16 compute)."""
    r = run_ranks(_moe_cast_passes, 1)[0]
    assert r["experts"] == 2  # one MoE layer a block
    assert r["casts False"] == 3 * 2 * 3 and r["dtypes False"] == ["torch.bfloat16"]  # micro-batches x layers x 3
    assert r["casts True"] == 0  # cast by the pass, outside the autograd function
    assert r["True"] == r["False"] and r["left True"] == 0 and r["left False"] == 0


def _expert_cast_bytes(rank, world):
    from shardfit.parallel import gathered

    out = {}
    for name, extra in (("full", []), ("lora", ["--lora.rank=4", "--lora.alpha=8"])):
        engine = _engine("--model.n_experts=4", "--model.experts_per_token=2", "--model.moe_ffn_dim=32",
                         "--compute.param_dtype=bfloat16", *extra)
        counted = gathered.gathered_bytes(engine.model)
        experts, gathered.outside_fsdp_experts = gathered.outside_fsdp_experts, lambda model: []
        try:
            out[name] = (len(experts(engine.model)), counted - gathered.gathered_bytes(engine.model))
        finally:
            gathered.outside_fsdp_experts = experts
    return out


def test_gathered_bytes_counts_only_expert_casts_that_copy():
    """fits_gathered's bytes for the experts kept out of FSDP are their pass's casts: fp32 masters cast to bf16
    (full fine-tuning) are counted; a LoRA run's frozen experts, stored in the compute dtype, cast to themselves
    and are not (counted, the 30B experts' 57 GB would turn gathering off for the whole model on one GPU)."""
    r = run_ranks(_expert_cast_bytes, 1)[0]
    assert r["full"][0] == r["lora"][0] == 2 and r["full"][1] > 0
    assert r["lora"][1] == 0


def _forward_by_kernel(rank, world):
    """Engine.forward's log-probs with the dense reference, then with cudnn_docs forced for the pass without
    gradients (the CPU would pick sdpa), and which kernels the masks were built for."""
    from shardfit.models import attention

    engine = _engine()
    datums = _datums(_reference_model(engine), [9, 20, 5, 14, 3, 11])
    built, build = [], attention.DocumentMask.build

    def spy(position_ids, kernel, device, branch=None):
        mask = build(position_ids, kernel, device, branch)
        built.append(kernel if mask is not None else None)  # None: every row one document, no mask
        return mask

    attention.DocumentMask.build = staticmethod(spy)
    engine.doc_kernel = lambda budget, grad: "sdpa"
    ref = engine.forward(datums)
    engine.doc_kernel = lambda budget, grad: "sdpa" if grad else "cudnn_docs"
    got = engine.forward(datums)
    return {"kernels": built, "diff": max(float(np.abs(a["logprobs"] - b["logprobs"]).max())
                                          for a, b in zip(ref.outputs, got.outputs)),
            "loss": abs(ref.metrics["loss:sum"] - got.metrics["loss:sum"])}


def test_forward_with_cudnn_docs_equals_the_dense_reference():
    report = run_ranks(_forward_by_kernel, 1)[0]
    n = len(report["kernels"]) // 2
    assert "cudnn_docs" in report["kernels"] and report["kernels"][n:] == [
        None if k is None else "cudnn_docs" for k in report["kernels"][:n]], report
    assert report["diff"] < 1e-5 and report["loss"] < 1e-4, report
