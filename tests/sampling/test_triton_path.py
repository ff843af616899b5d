"""The Sampler's attention="triton" path (decoding through kernels/paged_attention.py, prefill through the gather
path) under Triton's interpreter: the tokens and log-probs of the gather path, for rows of different lengths that
cross blocks; and the path refused in one line where it cannot run."""

import pytest
import torch

from shardfit.errors import ShardfitError
from shardfit.sampling import Sampler, SampleRequest, SamplingParams


def _prompt(n: int, seed: int) -> list[int]:
    return torch.randint(0, 300, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_triton_decoding_samples_what_the_gather_path_samples(model, monkeypatch):
    pytest.importorskip("triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    reqs = [SampleRequest(_prompt(n, n), SamplingParams(9, temperature=1.0, seed=n), num_samples=2)
            for n in (3, 7, 12)]
    kernel = Sampler(model, kv_blocks=64, block_size=4, attention="triton").run(reqs)
    gather = Sampler(model, kv_blocks=64, block_size=4).run(reqs)
    for a, b in zip(kernel, gather):
        assert [s.tokens for s in a.samples] == [s.tokens for s in b.samples]
        for x, y in zip(a.samples, b.samples):
            torch.testing.assert_close(torch.tensor(x.logprobs), torch.tensor(y.logprobs), rtol=0, atol=1e-4)


def test_triton_path_refused_where_it_cannot_run(model, monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ShardfitError, match="attention=triton needs CUDA and Triton"):
        Sampler(model, kv_blocks=8, block_size=4, attention="triton")
