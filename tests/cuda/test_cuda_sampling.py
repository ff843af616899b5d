"""The Sampler on a GPU: the decode step captured as CUDA graphs gives the tokens the eager step gives (greedy, and
the same seeded samples), FlexAttention the gather path's, and greedy tokens are transformers' on the same GPU."""

import pytest
import torch

from shardfit.sampling import Sampler, SampleRequest, SamplingParams
from tests.sampling.tiny import tiny_model

pytestmark = pytest.mark.cuda


def _requests():
    reqs = []
    for i in range(12):
        prompt = torch.randint(0, 300, (3 + 5 * i % 17,), generator=torch.Generator().manual_seed(i)).tolist()
        reqs.append(SampleRequest(prompt, SamplingParams(6 + 3 * i % 20, temperature=0.0 if i % 3 == 0 else 1.0,
                                                         top_p=0.9 if i % 4 == 1 else 1.0, seed=i),
                                  num_samples=1 + i % 3, topk_sample_logprobs=2 if i == 5 else 0))
    return reqs


def _run(model, **kw):
    sampler = Sampler(model, kv_blocks=256, block_size=16, **kw)
    return [[s.tokens for s in r.samples] for r in sampler.run(_requests())]


def test_graphs_on_and_off_and_flex_give_the_same_tokens():
    model = tiny_model().cuda()
    eager = _run(model, cuda_graphs=False)
    graphs = Sampler(model, kv_blocks=256, block_size=16, cuda_graphs=True)
    assert graphs.graphs.enabled
    assert [[s.tokens for s in r.samples] for r in graphs.run(_requests())] == eager
    assert graphs.graphs.graphs  # captured buckets, replayed
    # FlexAttention compiles per shape: one request of 4 samples (few shapes), against the gather path's tokens
    one = [SampleRequest(_requests()[4].prompt, SamplingParams(40, temperature=1.0, seed=2), num_samples=4)]
    flex = Sampler(model, kv_blocks=64, attention="flex", cuda_graphs=False).run(one)[0]
    gather = Sampler(model, kv_blocks=64, cuda_graphs=False).run(one)[0]
    assert [s.tokens for s in flex.samples] == [s.tokens for s in gather.samples]


def test_greedy_tokens_on_cuda_match_transformers(tmp_path):
    pytest.importorskip("transformers")
    from shardfit.weights.local import load_hf
    from tests.cli.test_generate import _save

    path, hf = _save("qwen3", tmp_path)
    cuda = torch.device("cuda")
    model, _ = load_hf(str(path), cuda, torch.float32)
    prompts = [torch.randint(0, 300, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (5, 12, 9)]
    results = Sampler(model, kv_blocks=64).run([SampleRequest(p, SamplingParams(30, temperature=0.0))
                                                for p in prompts])
    hf = hf.to(cuda)
    for p, r in zip(prompts, results):
        theirs = hf.generate(torch.tensor([p], device=cuda), max_new_tokens=30, do_sample=False, eos_token_id=None,
                             pad_token_id=0)[0, len(p):].tolist()
        assert r.samples[0].tokens == theirs


def test_the_fused_draw_gives_the_torch_draws_tokens_and_logprobs():
    """kernels/gumbel_draw.py in the captured step against sample.py's torch ops (fused_draw=False), on the GPU."""
    pytest.importorskip("triton")
    model = tiny_model().cuda()
    fused = Sampler(model, kv_blocks=256, block_size=16)
    assert fused.st.fused_draw
    got = fused.run(_requests())
    want = Sampler(model, kv_blocks=256, block_size=16, fused_draw=False).run(_requests())
    for g, w in zip(got, want):
        assert [s.tokens for s in g.samples] == [s.tokens for s in w.samples]
        for gs, ws in zip(g.samples, w.samples):
            torch.testing.assert_close(torch.tensor(gs.logprobs), torch.tensor(ws.logprobs), atol=1e-4, rtol=0)


@pytest.mark.parametrize("fused", [True, "all"])
def test_the_fused_ops_give_the_torch_ops_tokens_and_leave_training_alone(fused):
    """kernels/rms_norm.py and kernels/rope.py in the decode model (fused_ops=True; "all": the q/k norms and RoPE
    in one launch, qk_rope) against their torch ops; with grad enabled the same module runs autograd's ops (a
    backward through it works)."""
    pytest.importorskip("triton")
    model = tiny_model().cuda()
    got = Sampler(model, kv_blocks=256, block_size=16, fused_ops=fused).run(_requests())
    assert "forward" in model.model.norm.__dict__  # patched on the instance
    want = Sampler(model, kv_blocks=256, block_size=16, fused_ops=False).run(_requests())
    assert "forward" not in model.model.norm.__dict__
    for g, w in zip(got, want):
        assert [s.tokens for s in g.samples] == [s.tokens for s in w.samples]
    Sampler(model, kv_blocks=16, block_size=16, fused_ops=fused)
    x = torch.randn(2, 3, model.cfg.dim, device="cuda", requires_grad=True)
    model.model.norm(x).sum().backward()
    assert x.grad is not None
