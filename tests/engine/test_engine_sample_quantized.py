"""Engine.sample on a quantised base (model.quantize=nf4 and fp8; sampling/source.py): the decode model's layers are
of the base's format over its storage (views, not copies, never cast), so sampling from QLoRA or an FP8 base gives the
serve sampler's greedy tokens through the FSDP model (live and a frozen version, before and after training), its
log-probs are Engine.forward's on the same tokens, and 2 gloo ranks (the storage gathered uncast) return what 1 does."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests._dist import run_ranks
from tests.engine.test_engine_sample import ARGS, KV, PROMPTS, _greedy, _serve_greedy, _tokens, _train


def _engine(fmt: str):
    from shardfit.config import load_config
    from shardfit.rl import DatumEngine

    return DatumEngine.start(load_config(None, [*ARGS, f"--model.quantize={fmt}"]))


@pytest.mark.parametrize("fmt", ["nf4", "fp8"])
def test_greedy_tokens_are_the_serve_samplers_through_the_quantised_model(fmt):
    from shardfit.adapters.quantized import quantized_modules

    e = _engine(fmt)
    assert quantized_modules(e.model)  # the base really is stored quantised
    _train(e, [1])
    v = e.freeze()
    before = _serve_greedy(e, v)
    assert _tokens(e.sample(PROMPTS, _greedy(), version=v, **KV)) == before
    _train(e, [2, 3])
    live = _serve_greedy(e, "default")
    assert live != before
    got = e.sample(PROMPTS * 2, _greedy(), version=[v] * 4 + [None] * 4, model=[None] * 4 + ["default"] * 4, **KV)
    assert _tokens(got) == before + live
    plain = e._sampling.model  # the decode model: the base's format over the Engine's own storage, no copy
    decode = dict(plain.named_parameters())
    shared = [n for n, p in e.model.named_parameters() if n in decode and n.endswith(("weight_nf4", "weight_fp8"))]
    assert shared and all(decode[n].data_ptr() == p.to_local().data_ptr() if hasattr(p, "to_local") else True
                          for n, p in e.model.named_parameters() if n in shared)


@pytest.mark.parametrize("fmt", ["nf4", "fp8"])
def test_logprobs_are_engine_forwards_on_the_same_tokens(fmt):
    from shardfit.rl import make_datum
    from shardfit.sampling.params import SamplingParams

    e = _engine(fmt)
    _train(e, [1])
    res = e.sample(PROMPTS, SamplingParams(max_tokens=6, temperature=1.0, seed=7), prompt_logprobs=True,
                   model="default", **KV)
    datums, sampled = [], []
    for p, r in zip(PROMPTS, res):
        seq = p + r.samples[0].tokens
        datums.append(make_datum(np.array(seq[:-1]), target_tokens=np.array(seq[1:]), weights=np.ones(len(seq) - 1)))
        sampled.append(r.prompt_logprobs[1:] + r.samples[0].logprobs)
    fwd = e.forward(datums, "cross_entropy", model="default")
    for out, lp in zip(fwd.outputs, sampled):
        # FP8 rounds each token's activations to e4m3 alone: the same codes in decode as in the forward, but for a
        # value within fp32 rounding of a rounding boundary
        np.testing.assert_allclose(out["logprobs"].tolist(), lp, rtol=0, atol=2e-5 if fmt == "nf4" else 2e-4)


def _sampled(rank, world, fmt):
    torch.manual_seed(0)
    e = _engine(fmt)
    _train(e, [1])
    return _tokens(e.sample(PROMPTS, _greedy(), model="default", **KV))


def test_two_ranks_return_what_one_returns():
    one = run_ranks(_sampled, 1, "fp8")[0]
    two = run_ranks(_sampled, 2, "fp8")
    assert two[0] == two[1] == one
