"""Engine.sample (engine/sampling.py): rollouts from the trainer's own weights, no weight sync.

- at temperature 0 its tokens are the old serve sampler's greedy tokens (sampling/fsdp_reference.sample through the FSDP
  model) for the live model and for a frozen version, before and after 3 optimizer steps (the version keeps its
  tokens, the live model's change); rows of several versions in one call each get what they get alone;
- its log-probs (sampled tokens and prompt) are Engine.forward's on the same tokens (CPU fp32: the train/sample
  gap is 0 up to fp32 rounding);
- 2 gloo ranks (each decoding its share of the prompts) return what 1 returns;
- a full-parameter engine samples its live weights after each optim_step; an MoE model with LoRA on its experts
  samples each version's tokens; refusals are one line;
- refused="return" (serve's batches): a prompt refused by the Engine (a freed version) or the Sampler (too long)
  comes back as its one-line error and the others of the call get what they get alone;
- the Sampler is kept between sample calls (one built), dropped before a forward_backward (rl/step.py) and kept
  across it with sampling.keep_kv; the samples are the same either way.
"""

from __future__ import annotations

import weakref

import numpy as np
import pytest
import torch

from tests._dist import run_ranks
from tests.helpers import SMALL, random_datums

ARGS = [*SMALL, "--train.device=cpu", "--train.micro_batch_tokens=32", "--logging.run_dir=", "--lora.rank=4",
        "--lora.targets=all-linear"]
PROMPTS = [[5, 17, 99, 3], [200, 1, 1, 40, 77, 12, 8], [9], [31, 64, 2, 250, 18]]
KV = {"kv_blocks": 64, "block_size": 8}  # CPU: no free-memory query, the pool given


def _data(seed, n=3):
    return random_datums(seed, n)


def _train(engine, seeds, lr=5e-2):
    from shardfit.rl import AdamParams

    for s in seeds:
        engine.forward_backward(_data(s), "cross_entropy", model="default")
        engine.optim_step(AdamParams(learning_rate=lr), model="default")


def _greedy(max_tokens=8):
    from shardfit.sampling.params import SamplingParams

    return SamplingParams(max_tokens=max_tokens, temperature=0.0)


def _tokens(results):
    return [[s.tokens for s in r.samples] for r in results]


def _serve_greedy(engine, model, max_tokens=8):
    """The old sampler's greedy tokens: sampling/fsdp_reference.sample through the FSDP model, `model` in the
    slot."""
    from shardfit.sampling.fsdp_reference import SampleArgs, sample

    engine.using(model)
    out = []
    for p in PROMPTS:
        got, _ = sample(engine.model, SampleArgs(p, max_tokens=max_tokens, temperature=0.0), torch.float32,
                        engine.device)
        out.append([got[0].tokens])
    engine.finish()
    return out


@pytest.fixture(scope="module")
def lora():
    from shardfit.config import load_config
    from shardfit.rl import DatumEngine

    e = DatumEngine.start(load_config(None, ARGS))
    _train(e, [1])
    return e


def test_greedy_tokens_are_the_serve_samplers_for_the_live_model_and_a_frozen_version(lora):
    from shardfit.engine.registry import BASE

    e = lora
    v = e.freeze()
    before = _serve_greedy(e, v)
    assert _tokens(e.sample(PROMPTS, _greedy(), version=v, **KV)) == before
    assert _tokens(e.sample(PROMPTS, _greedy(), model="default", **KV)) == before  # live = v, before training
    _train(e, [2, 3, 4])
    live = _serve_greedy(e, "default")
    assert live != before  # the live model moved (else the rest proves nothing)
    assert _tokens(e.sample(PROMPTS, _greedy(), version=v, **KV)) == before  # the version keeps its tokens
    assert _tokens(e.sample(PROMPTS, _greedy(), model="default", **KV)) == live
    base = _serve_greedy(e, BASE)  # leaves the base in the registry's slot
    # one call, a different weight version per prompt: each row decodes with its own
    v2 = e.freeze("default")  # live's weights, new to the bank: loaded through the registry's slot
    mixed = e.sample(PROMPTS, _greedy(), version=[v, None, BASE, v2], model=[None, "default", None, None], **KV)
    assert _tokens(mixed) == [before[0], live[1], base[2], live[3]]
    assert e.models.current == BASE  # the slot is back where it was


def test_more_versions_than_the_banks_slots_grow_it_and_each_keeps_its_tokens(lora):
    """Six versions, each sampled alone (the bank of 4 slots refilled as they come), then all in one call (a bank
    of 8 on the same decode model): each prompt gets its version's tokens either way."""
    e = lora
    versions = []
    for seed in range(6):
        _train(e, [10 + seed])
        versions.append(e.freeze("default"))
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(6)]
    alone = [_tokens(e.sample([p], _greedy(), version=v, **KV))[0] for p, v in zip(prompts, versions)]
    assert len({str(t) for t in alone}) > 2  # the versions differ
    assert _tokens(e.sample(prompts, _greedy(), version=versions, **KV)) == alone
    assert e._sampling.capacity == 8
    assert _tokens(e.sample(prompts[:1], _greedy(), version=versions[0], **KV)) == alone[:1]  # still held


def test_logprobs_are_engine_forwards_on_the_same_tokens(lora):
    from shardfit.rl import make_datum
    from shardfit.sampling.params import SamplingParams

    e = lora
    res = e.sample(PROMPTS, SamplingParams(max_tokens=6, temperature=1.0, seed=7), num_samples=2,
                   prompt_logprobs=True, model="default", **KV)
    datums, sampled, prompt = [], [], []
    for p, r in zip(PROMPTS, res):
        for s in r.samples:
            seq = p + s.tokens
            datums.append(make_datum(np.array(seq[:-1]), target_tokens=np.array(seq[1:]),
                                     weights=np.ones(len(seq) - 1)))
            sampled.append(s.logprobs)
            prompt.append(r.prompt_logprobs[1:])
        assert r.prompt_logprobs[0] is None
    fwd = e.forward(datums, "cross_entropy", model="default")
    for out, lp_s, lp_p in zip(fwd.outputs, sampled, prompt):
        lp = out["logprobs"].tolist()
        P = len(lp) + 1 - len(lp_s)
        np.testing.assert_allclose(lp[P - 1:], lp_s, rtol=0, atol=2e-5)  # the sampled tokens'
        np.testing.assert_allclose(lp[:P - 1], lp_p, rtol=0, atol=2e-5)  # the prompt's


def test_a_full_parameter_engine_samples_its_weights_after_each_step():
    from shardfit.config import load_config
    from shardfit.rl import DatumEngine

    e = DatumEngine.start(load_config(None, [a for a in ARGS if not a.startswith("--lora")]))
    first = _tokens(e.sample(PROMPTS, _greedy(), **KV))
    assert first == _serve_greedy(e, None)
    _train(e, [1, 2], lr=2e-2)
    after = _serve_greedy(e, None)
    assert after != first
    assert _tokens(e.sample(PROMPTS, _greedy(), **KV)) == after
    with pytest.raises(Exception, match="--lora.rank"):
        e.sample(PROMPTS, _greedy(), model="other", **KV)
    # a frozen version samples its own weights, and the live ones are back in the model for the next step
    v = e.freeze()
    _train(e, [3], lr=2e-2)
    live = _serve_greedy(e, None)
    assert _tokens(e.sample(PROMPTS, _greedy(), version=v, **KV)) == after != live
    assert e.models.current == "default" and _tokens(e.sample(PROMPTS, _greedy(), **KV)) == live
    _train(e, [4], lr=2e-2)  # trains the live weights (a version in the slot would be refused)


def test_an_moe_model_with_lora_on_its_experts_samples_the_serve_samplers_tokens():
    from shardfit.config import load_config
    from shardfit.rl import DatumEngine

    moe = ["--model.n_experts=4", "--model.experts_per_token=2", "--model.moe_ffn_dim=32"]
    e = DatumEngine.start(load_config(None, [*ARGS[:-1], "--lora.targets=q_proj,v_proj,experts", *moe]))
    _train(e, [1, 2])
    v = e.freeze()
    _train(e, [3])
    want_v, want_live = _serve_greedy(e, v), _serve_greedy(e, "default")
    assert want_v != want_live
    got = e.sample(PROMPTS * 2, _greedy(), version=[v] * 4 + [None] * 4, model=[None] * 4 + ["default"] * 4, **KV)
    assert _tokens(got) == want_v + want_live


def test_refusals_are_one_line(lora):
    from shardfit.errors import ShardfitError

    e = lora
    with pytest.raises(ShardfitError, match="no model or version 'nope'"):
        e.sample(PROMPTS, _greedy(), model="nope", **KV)
    with pytest.raises(ShardfitError, match="not held") as err:
        e.sample(PROMPTS, _greedy(), version="default@999", **KV)
    assert "\n" not in str(err.value)
    with pytest.raises(ShardfitError, match="3 entries for 4 prompts"):
        e.sample(PROMPTS, _greedy(), version=[None] * 3, **KV)
    with pytest.raises(ShardfitError, match="max_seq_len=64") as err:
        e.sample([*PROMPTS, [1] * 64], _greedy(), **KV)
    assert err.value.where == "prompt"
    assert _tokens(e.sample(PROMPTS[:1], _greedy(), **KV)) == _serve_greedy(e, "default")[:1]  # nothing left over


def test_a_refused_prompt_fails_alone_and_the_others_get_what_they_get_alone(lora):
    from shardfit.errors import ShardfitError
    from shardfit.sampling.params import SamplingParams

    e = lora
    v = e.freeze("default")
    gone = e.freeze("default")
    e.models.release(gone)
    prompts = [PROMPTS[0], [1] * 64, PROMPTS[1], PROMPTS[2], PROMPTS[3]]
    params = [SamplingParams(max_tokens=3 + i, temperature=1.0, seed=20 + i) for i in range(5)]
    versions, models = [v, None, gone, None, v], [None, "default", None, "default", None]
    counts = [2, 1, 1, 3, 1]
    got = e.sample(prompts, params, version=versions, model=models, num_samples=counts, prompt_logprobs=[
        True, False, False, False, True], refused="return", **KV)
    assert isinstance(got[1], ShardfitError) and got[1].where == "prompt" and "max_seq_len=64" in str(got[1])
    assert isinstance(got[2], ShardfitError) and "not held" in str(got[2]) and "\n" not in str(got[2])
    for i in (0, 3, 4):
        [alone] = e.sample([prompts[i]], params[i], version=versions[i], model=models[i], num_samples=counts[i],
                           prompt_logprobs=i != 3, **KV)
        assert _tokens([got[i]]) == _tokens([alone]) and len(got[i].samples) == counts[i]
        np.testing.assert_allclose([x for s in got[i].samples for x in s.logprobs],
                                   [x for s in alone.samples for x in s.logprobs], rtol=0, atol=1e-5)
    with pytest.raises(ShardfitError, match="not held"):  # the default: a refusal raised (what is named, first)
        e.sample(prompts, params, version=versions, model=models, **KV)


def test_the_sampler_is_kept_between_calls_and_dropped_before_training(lora, monkeypatch):
    from shardfit.sampling import runner
    from shardfit.sampling.params import SamplingParams

    built, refs = [], []  # built: per new Sampler, how many earlier ones were still alive as it sized its pool
    init = runner.Sampler.__init__

    def spy(self, *a, **k):
        built.append(sum(r() is not None for r in refs))
        refs.append(weakref.ref(self))
        init(self, *a, **k)

    monkeypatch.setattr(runner.Sampler, "__init__", spy)
    e = lora
    p = SamplingParams(max_tokens=6, temperature=1.0, seed=5)
    e.release_sampler()
    first = e.sample(PROMPTS, p, model="default", num_samples=2, **KV)
    assert e.sample(PROMPTS, p, model="default", num_samples=2, **KV) == first and len(built) == 1  # one Sampler
    e.forward_backward(_data(7), "cross_entropy", model="default")  # no optim_step: the same weights
    assert e._sampling_sampler is None  # dropped: the pass's memory
    assert e.sample(PROMPTS, p, model="default", num_samples=2, **KV) == first and len(built) == 2
    monkeypatch.setattr(e.cfg.sampling, "keep_kv", True)
    e.forward_backward(_data(8), "cross_entropy", model="default")
    assert e._sampling_sampler is not None  # kept across training
    assert e.sample(PROMPTS, p, model="default", num_samples=2, **KV) == first and len(built) == 2
    e.sample(PROMPTS, p, model="default", kv_blocks=32, block_size=8)  # other options: another Sampler
    assert built == [0, 0, 0]  # the old one freed before the new one sized its pool from the free memory
    e.optim_step(model="default")  # the gradients applied: the fixture's engine steps on as the other tests do


def _ranks(rank, world):
    from shardfit.config import load_config
    from shardfit.rl import DatumEngine
    from shardfit.sampling.params import SamplingParams

    e = DatumEngine.start(load_config(None, ARGS))
    _train(e, [1])
    v = e.freeze()
    _train(e, [2])
    prompts = PROMPTS + [[7, 7, 7], [100, 2]]
    res = e.sample(prompts, SamplingParams(max_tokens=5, temperature=1.0, seed=3), num_samples=2,
                   prompt_logprobs=True, topk_prompt_logprobs=2, topk_sample_logprobs=2,
                   version=[v, None, v, None, None, v], model=[None, "default", None, "default", "default", None], **KV)
    try:  # refused on every rank (it would decode on rank 1), none left waiting in a collective
        e.sample([[1, 2], [3] * 60], SamplingParams(max_tokens=10), **KV)
        refused = ""
    except Exception as err:  # noqa: BLE001  the message is the assertion
        refused = str(err)
    each = e.sample([[1, 2], [3] * 60, [4, 5]], SamplingParams(max_tokens=10, temperature=1.0, seed=1),
                    refused="return", **KV)  # the long one alone refused on every rank, the others decoded
    refused_alone = [str(r) if isinstance(r, Exception) else [s.tokens for s in r.samples] for r in each]
    return [{"refused": refused, "refused_alone": refused_alone}] + [
        {"tokens": [s.tokens for s in r.samples], "logprobs": [s.logprobs for s in r.samples],
         "stop": [s.stop_reason for s in r.samples], "topk": [s.topk for s in r.samples],
         "prompt": r.prompt_logprobs, "topk_prompt": r.topk_prompt_logprobs} for r in res]


def test_two_ranks_return_what_one_returns():
    one = run_ranks(_ranks, 1)[0]
    two = run_ranks(_ranks, 2)
    assert two[0] == two[1]  # every rank has every prompt's results, and the same refusal
    assert "sampling_params.max_tokens" in one[0]["refused"] and two[0][0]["refused"] == one[0]["refused"]
    assert two[0][0]["refused_alone"] == one[0]["refused_alone"]
    assert "sampling_params.max_tokens" in one[0]["refused_alone"][1] and len(one[0]["refused_alone"][0][0]) == 10
    for a, b in zip(one[1:], two[0][1:]):
        assert a["tokens"] == b["tokens"] and a["stop"] == b["stop"]
        np.testing.assert_allclose(np.concatenate(a["logprobs"]), np.concatenate(b["logprobs"]), atol=2e-5)
        assert [[[t for t, _ in pos] for pos in s] for s in a["topk"]] == \
               [[[t for t, _ in pos] for pos in s] for s in b["topk"]]
        np.testing.assert_allclose(np.array(a["prompt"][1:]), np.array(b["prompt"][1:]), atol=2e-5)
        assert a["topk_prompt"][0] is None and b["topk_prompt"][0] is None
        assert [[t for t, _ in pos] for pos in a["topk_prompt"][1:]] == \
               [[t for t, _ in pos] for pos in b["topk_prompt"][1:]]


def test_results_packed_for_the_ranks_exchange_come_back_whole():
    """What rank w sends (engine/sample_results.py: a fixed-length float64 vector, sized from the request alone)
    unpacks to the very results: a sample stopped early, top-k per token, the prompt's None first position."""
    from shardfit.engine.sample_results import pack, size, unpack
    from shardfit.sampling.params import Sampled, SampleRequest, SampleResult, SamplingParams

    req = SampleRequest([4, 5, 6], SamplingParams(max_tokens=4, stop_tokens=(9,)), num_samples=2,
                        prompt_logprobs=True, topk_prompt_logprobs=1, topk_sample_logprobs=2)
    res = SampleResult([Sampled([1, 9], [-0.5, -1.25], "stop", [[(1, -0.5), (3, -2.0)], [(9, -1.25), (2, -3.5)]]),
                        Sampled([7, 7, 8, 2], [-1.0, -2.0, -3.0, -4.0], "length",
                                [[(7, -1.0), (0, -5.0)]] * 4)],
                       [None, -2.5, -0.75], [None, [(5, -2.5)], [(6, -0.75)]])
    vec = pack(req, res)
    assert len(vec) == size(req)  # every rank knows each rank's length without asking
    assert unpack(req, vec) == res


def test_sampling_prefill_chunk_reaches_the_sampler_and_changes_no_token(lora, monkeypatch):
    """sampling.prefill_chunk is the kept Sampler's: prompts prefilled 3 tokens a forward sample what one forward
    each samples (the log-probs within fp32 rounding of the chunking)."""
    from shardfit.sampling.params import SamplingParams

    e = lora
    p = SamplingParams(max_tokens=5, temperature=1.0, seed=9)
    e.release_sampler()
    whole = e.sample(PROMPTS, p, model="default", num_samples=2, **KV)
    assert e._sampling_sampler[0].prefill_chunk == e.cfg.sampling.prefill_chunk == 2048
    monkeypatch.setattr(e.cfg.sampling, "prefill_chunk", 3)
    e.release_sampler()
    chunked = e.sample(PROMPTS, p, model="default", num_samples=2, **KV)
    assert e._sampling_sampler[0].prefill_chunk == 3
    assert _tokens(chunked) == _tokens(whole)
    np.testing.assert_allclose([x for r in chunked for s in r.samples for x in s.logprobs],
                               [x for r in whole for s in r.samples for x in s.logprobs], rtol=0, atol=1e-5)
