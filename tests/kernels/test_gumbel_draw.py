"""The fused draw (kernels/gumbel_draw.py) under Triton's interpreter against sampling/sample.py's torch ops: the same
tokens for sampled and greedy rows (the counter hash is exact in both), log-probs as log_softmax gives them, ties to
the smaller token id, a vocabulary that ends inside a chunk."""

import pytest
import torch

from shardfit.sampling.sample import choose, row_keys, token_logprobs


@pytest.fixture
def interpreted(monkeypatch):
    pytest.importorskip("triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")


def _rows(B, V, seed=0):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(B, V, generator=g) * 3
    keys = row_keys(torch.randint(0, 2 ** 62, (B,), generator=g), torch.arange(B), torch.randint(0, 4000, (B,),
                                                                                                 generator=g))
    return logits, keys


@pytest.mark.parametrize("V,block", [(1000, 256), (777, 128), (300, 512)], ids=["chunks", "ragged", "one-chunk"])
def test_tokens_and_logprobs_equal_the_torch_draw(interpreted, V, block):
    from shardfit.kernels.gumbel_draw import gumbel_draw

    logits, keys = _rows(6, V)
    temperature = torch.tensor([1.0, 0.7, 0.0, 1.3, 1.0, 0.0])  # two greedy rows among sampled ones
    tokens, logp = gumbel_draw(logits, temperature, keys, block=block)
    want = choose(logits, temperature, torch.full((6,), -1), torch.ones(6), keys, "plain")
    assert torch.equal(tokens, want)
    torch.testing.assert_close(logp, token_logprobs(logits, want)[0], atol=1e-5, rtol=0)


def test_greedy_ties_go_to_the_smaller_token(interpreted):
    from shardfit.kernels.gumbel_draw import gumbel_draw

    logits = torch.zeros(2, 600)
    logits[0, [5, 400]] = 2.0  # a tie across two chunks of 256
    logits[1, [300, 301]] = 2.0  # inside one chunk
    tokens, _ = gumbel_draw(logits, torch.zeros(2), torch.zeros(2, dtype=torch.int64), block=256)
    assert tokens.tolist() == [5, 300] == logits.argmax(-1).tolist()
