"""The draw on the device (sampling/sample.py): top-p and top-k keep the tokens transformers keeps, the counter-based
noise is a function of (seed, sample, position, token) alone, and Gumbel-max draws follow softmax(logits / T)."""

import pytest
import torch

from shardfit.sampling.sample import (
    _mul32,
    choose,
    gumbel_noise,
    row_keys,
    token_logprobs,
    top_k_filter,
    top_p_filter,
)

transformers = pytest.importorskip("transformers")


@pytest.mark.parametrize("top_p", [0.05, 0.5, 0.9, 0.99])
def test_top_p_keeps_the_tokens_transformers_keeps(top_p):
    from transformers.generation.logits_process import TopPLogitsWarper

    logits = torch.randn(1, 300, generator=torch.Generator().manual_seed(int(top_p * 100))) * 3
    theirs = TopPLogitsWarper(top_p)(None, logits.clone())[0]
    ours = top_p_filter(logits[0], top_p)
    assert torch.equal(torch.isinf(ours), torch.isinf(theirs))
    assert 0 < int(torch.isfinite(ours).sum()) < 300 or top_p > 0.95
    # per row, as the sampler filters a batch: each row its own top_p (1: every token kept)
    rows = torch.cat([logits, logits])
    both = top_p_filter(rows, torch.tensor([top_p, 1.0]))
    assert torch.equal(both[0], ours) and torch.isfinite(both[1]).all()


@pytest.mark.parametrize("k", [1, 5, 50])
def test_top_k_keeps_the_tokens_transformers_keeps(k):
    from transformers.generation.logits_process import TopKLogitsWarper

    logits = torch.randn(2, 300, generator=torch.Generator().manual_seed(k))
    theirs = TopKLogitsWarper(k)(None, logits.clone())
    ours = top_k_filter(logits, torch.tensor([k, -1]))
    assert torch.equal(torch.isinf(ours[0]), torch.isinf(theirs[0])) and int(torch.isfinite(ours[0]).sum()) == k
    assert torch.isfinite(ours[1]).all()  # -1: every token


def test_mul32_is_the_low_32_bits_of_the_product():
    x = torch.tensor([0, 1, 2 ** 32 - 1, 123456789, 2 ** 31 + 7])
    for m in (0x85EBCA6B, 0xC2B2AE35, 0x9E3779B9):
        assert _mul32(x, m).tolist() == [(int(v) * m) % 2 ** 32 for v in x]


def test_noise_depends_on_seed_sample_position_and_token_only():
    seed = torch.tensor([7, 7, 7, 8, 2 ** 40 + 7])
    sample = torch.tensor([0, 1, 0, 0, 0])
    pos = torch.tensor([5, 5, 6, 5, 5])
    keys = row_keys(seed, sample, pos)
    assert len(set(keys.tolist())) == 5  # each coordinate (the seed's high bits too) changes the key
    g = gumbel_noise(keys, 1000)
    order = torch.tensor([4, 2, 0, 3, 1])  # the rows in another order: each row's noise moves with it
    assert torch.equal(gumbel_noise(row_keys(seed[order], sample[order], pos[order]), 1000), g[order])
    assert torch.isfinite(g).all() and abs(float(g.mean()) - 0.5772) < 0.05  # Gumbel's mean: Euler's constant


def test_gumbel_max_draws_follow_the_softmax_and_greedy_at_temperature_zero():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    n = 20000
    keys = row_keys(torch.full((n,), 3), torch.arange(n), torch.zeros(n, dtype=torch.int64))
    tokens = choose(logits.expand(n, -1), torch.full((n,), 0.5), torch.full((n,), -1), torch.ones(n), keys)
    freq = torch.bincount(tokens, minlength=4).float() / n
    torch.testing.assert_close(freq, torch.softmax(logits[0] / 0.5, -1), atol=0.015, rtol=0)
    greedy = choose(logits.expand(3, -1), torch.zeros(3), torch.full((3,), -1), torch.ones(3), keys[:3])
    assert greedy.tolist() == [0, 0, 0]
    # top-k 2 and top-p: only the tokens kept are drawn
    kept = choose(logits.expand(n, -1), torch.ones(n), torch.full((n,), 2), torch.ones(n), keys)
    assert set(kept.tolist()) == {0, 1}


def test_logprobs_are_the_fp32_log_softmax_and_its_top_k():
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(0)).bfloat16()
    tokens = torch.tensor([4, 9, 49])
    lp, (vals, ids) = token_logprobs(logits, tokens, 3)
    full = torch.log_softmax(logits.float(), -1)
    assert torch.equal(lp, full.gather(-1, tokens[:, None])[:, 0])
    assert torch.equal(vals, full.topk(3, -1).values) and torch.equal(ids, full.topk(3, -1).indices)


def test_the_cheaper_draws_are_the_full_ones_where_they_apply():
    """A batch with no top-k/top-p skips the filters, an all-greedy one the noise: the same tokens either way."""
    from shardfit.sampling.params import SamplingParams
    from shardfit.sampling.sample import draw_kind

    assert draw_kind([SamplingParams(4, temperature=0.0, top_k=5)]) == "greedy"
    assert draw_kind([SamplingParams(4, temperature=0.0, top_k=5), SamplingParams(4)]) == "plain"
    assert draw_kind([SamplingParams(4), SamplingParams(4, top_p=0.9)]) == "filtered"
    n = 64
    logits = torch.randn(n, 100, generator=torch.Generator().manual_seed(1)) * 3
    keys = row_keys(torch.full((n,), 5), torch.arange(n), torch.full((n,), 9))
    temp, top_k, top_p = torch.rand(n, generator=torch.Generator().manual_seed(2)) + 0.2, torch.full((n,), -1), \
        torch.ones(n)
    assert torch.equal(choose(logits, temp, top_k, top_p, keys, "plain"),
                       choose(logits, temp, top_k, top_p, keys, "filtered"))
    assert torch.equal(choose(logits, torch.zeros(n), top_k, top_p, keys, "greedy"), logits.argmax(-1))
