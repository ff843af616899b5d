"""Engine.sample with logprobs="trainer" (rl/trainer_logprobs.py): the sampled tokens' log-probs (and the prompt's)
are Engine.forward's over the datums an RL loop builds from the samples (prompt + completion[:-1], targets shifted),
torch.equal, for a LoRA model's live weights and a frozen version after optimizer steps (in one call), and for a
full-parameter model's live weights and a frozen version; on 1 rank and on 2 gloo ranks. The tokens and top-k are
decode's (the same call with logprobs="decode"), whose log-probs agree within fp32 rounding (CPU); the slot's model is
the one before the call. A prompt whose sample cannot be one datum of the trainer's row, and an unknown setting,
are one line each. (logprobs="decode" against Engine.forward: tests/engine/test_engine_sample.py.)
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests._dist import run_ranks
from tests.helpers import SMALL, random_datums

ARGS = [*SMALL, "--train.device=cpu", "--train.micro_batch_tokens=32", "--logging.run_dir="]
LORA = ["--lora.rank=4", "--lora.targets=all-linear"]
PROMPTS = [[5, 17, 99, 3], [200, 1, 1, 40, 77, 12, 8], [9], [31, 64, 2, 250, 18], [7, 7, 7]]
KV = {"kv_blocks": 64, "block_size": 8}  # CPU: no free-memory query, the pool given


def _train(engine, seeds, lr=5e-2):
    from shardfit.rl import AdamParams

    for s in seeds:
        engine.forward_backward(random_datums(s), "cross_entropy", model="default")
        engine.optim_step(AdamParams(learning_rate=lr), model="default")


def _scored_as_a_loop_scores_them(engine, prompts, results, name) -> tuple[list, list]:
    """Engine.forward (model=name) over the cookbook's datums of these samples, built here: per sample the log-probs
    of its completion, per prompt those of its prompt from its first sample."""
    from shardfit.rl import make_datum

    datums, shape = [], []
    for p, r in zip(prompts, results):
        for s in r.samples:
            seq = p + s.tokens
            datums.append(make_datum(seq[:-1], target_tokens=seq[1:]))
            shape.append(len(p))
    out = [o["logprobs"] for o in engine.forward(datums, "cross_entropy", model=name).outputs]
    samples = [torch.from_numpy(lp[P - 1:]) for lp, P in zip(out, shape)]
    firsts, k = [], 0
    for p, r in zip(prompts, results):
        firsts.append(torch.from_numpy(out[k][:len(p) - 1]))
        k += len(r.samples)
    return samples, firsts


def _equal_to_forward(engine, prompts, results, name) -> bool:
    want_s, want_p = _scored_as_a_loop_scores_them(engine, prompts, results, name)
    got_s = [torch.tensor(s.logprobs, dtype=torch.float32) for r in results for s in r.samples]
    got_p = [torch.tensor(r.prompt_logprobs[1:], dtype=torch.float32) for r in results]
    return all(torch.equal(a, b) for a, b in zip(got_s + got_p, want_s + want_p)) and len(got_s) == len(want_s)


def _flat(results) -> dict:
    return {"tokens": [[s.tokens for s in r.samples] for r in results],
            "logprobs": [x for r in results for s in r.samples for x in s.logprobs],
            "topk": [s.topk for r in results for s in r.samples]}


def _scenario(rank, world):
    """Per engine (LoRA, full-parameter): whether the trainer's log-probs are Engine.forward's bit for bit, the
    decode call's tokens, top-k and log-probs beside them, and the slot's model after the call."""
    from shardfit.config import load_config
    from shardfit.rl import DatumEngine
    from shardfit.sampling.params import SamplingParams

    params = SamplingParams(max_tokens=6, temperature=1.0, seed=3)
    kw = dict(num_samples=2, prompt_logprobs=True, topk_sample_logprobs=2, **KV)
    out = {}
    for kind, extra in (("lora", LORA), ("full", [])):
        e = DatumEngine.start(load_config(None, [*ARGS, *extra]))
        _train(e, [1])
        v = e.freeze()
        _train(e, [2])  # the version is a step behind the live weights
        if kind == "lora":  # both in one call: one forward each
            calls = [("mixed", [v, None, v, None, None], [None, "default", None, "default", None])]
        else:  # a full-parameter engine samples one weights a call
            calls = [("version", [v] * 5, [None] * 5), ("live", [None] * 5, [None] * 5)]
        for tag, versions, models in calls:
            trainer = e.sample(PROMPTS, params, version=versions, model=models, logprobs="trainer", **kw)
            assert e.models.current == "default"  # the scoring's swaps undone
            decode = e.sample(PROMPTS, params, version=versions, model=models, logprobs="decode", **kw)
            equal = []
            for name in dict.fromkeys(versions):  # per weights, its prompts in call order
                idx = [i for i, x in enumerate(versions) if x == name]
                equal.append(_equal_to_forward(e, [PROMPTS[i] for i in idx], [trainer[i] for i in idx],
                                               name or "default"))
            e.using("default")  # the test's forward of a version left it in the slot
            out[f"{kind}:{tag}"] = {"equal": equal, "trainer": _flat(trainer), "decode": _flat(decode)}
        _train(e, [3])  # the live model trains on (a version left in the slot would be refused)
    return out


@pytest.fixture(scope="module")
def one_rank():
    return run_ranks(_scenario, 1)[0]


def test_trainer_logprobs_are_engine_forwards_bit_for_bit_and_the_rest_is_decodes(one_rank):
    assert set(one_rank) == {"lora:mixed", "full:version", "full:live"}
    for tag, r in one_rank.items():
        assert r["equal"] and all(r["equal"]), tag
        t, d = r["trainer"], r["decode"]
        assert t["tokens"] == d["tokens"] and t["topk"] == d["topk"], tag  # the Sampler's tokens, its top-k
        assert t["logprobs"] != d["logprobs"], tag  # computed by another path...
        np.testing.assert_allclose(t["logprobs"], d["logprobs"], rtol=0, atol=2e-5)  # ...which agrees in fp32
    assert one_rank["full:version"]["trainer"]["tokens"] != one_rank["full:live"]["trainer"]["tokens"]


def test_two_ranks_score_bit_for_bit_and_return_what_one_returns(one_rank):
    two = run_ranks(_scenario, 2)
    assert two[0] == two[1]  # every rank has every result
    for tag, r in two[0].items():
        assert r["equal"] and all(r["equal"]), tag
        assert r["trainer"]["tokens"] == one_rank[tag]["trainer"]["tokens"], tag
        np.testing.assert_allclose(r["trainer"]["logprobs"], one_rank[tag]["trainer"]["logprobs"], rtol=0, atol=2e-5)


def test_a_sample_longer_than_the_trainers_row_and_an_unknown_setting_are_one_line():
    from shardfit.config import load_config
    from shardfit.errors import ShardfitError
    from shardfit.rl import DatumEngine
    from shardfit.sampling.params import SamplingParams

    with pytest.raises(ShardfitError, match="sampling.logprobs") as err:
        load_config(None, [*ARGS, "--sampling.logprobs=exact"])
    assert "decode" in str(err.value) and "\n" not in str(err.value)
    e = DatumEngine.start(load_config(None, [*ARGS, *LORA, "--sampling.logprobs=trainer"]))
    with pytest.raises(ShardfitError, match="logprobs='exact' is not known") as err:
        e.sample(PROMPTS, SamplingParams(max_tokens=4), logprobs="exact", **KV)
    assert err.value.where == "sampling.logprobs"
    params = [SamplingParams(max_tokens=4, temperature=1.0, seed=1), SamplingParams(max_tokens=20, seed=2),
              SamplingParams(max_tokens=4, temperature=1.0, seed=3)]
    prompts = [PROMPTS[0], [3] * 20, PROMPTS[1]]  # 20 + 20 - 1 tokens: more than the row of 32
    with pytest.raises(ShardfitError, match="more than the trainer's micro-batch of 32") as err:
        e.sample(prompts, params, **KV)  # the config's setting: trainer
    assert err.value.where == "sampling_params.max_tokens" and "train.micro_batch_tokens to at least 39" in str(
        err.value) and "\n" not in str(err.value)
    got = e.sample(prompts, params, refused="return", **KV)
    assert isinstance(got[1], ShardfitError) and got[1].where == "sampling_params.max_tokens"
    for i in (0, 2):  # the others get what they get alone
        [alone] = e.sample([prompts[i]], params[i], **KV)
        assert [s.tokens for s in got[i].samples] == [s.tokens for s in alone.samples]
        np.testing.assert_allclose([x for s in got[i].samples for x in s.logprobs],  # scored in another row
                                   [x for s in alone.samples for x in s.logprobs], rtol=0, atol=1e-5)
    assert e.sample(prompts[1:2], params[1], logprobs="decode", **KV)[0].samples  # decode's: no row to fit
