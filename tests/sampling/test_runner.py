"""The Sampler (sampling/runner.py) on the CPU: greedy tokens of the reference decode and of transformers, log-probs
of the model's full forward, seeded draws that do not depend on what shares the batch, continuous batching and
preemption that change no request's result, a prompt's blocks shared by its samples, and bad input refused alone."""

import pytest
import torch

from shardfit.data.tokenizer import build_tokenizer
from shardfit.errors import ShardfitError
from shardfit.sampling import Sampler, SampleRequest, SamplingParams
from shardfit.sampling.reference import reference_decode

transformers = pytest.importorskip("transformers")
SIZES = dict(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, max_position_embeddings=128, rms_norm_eps=1e-6)


def _prompt(n: int, seed: int) -> list[int]:
    return torch.randint(0, 300, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_greedy_tokens_are_the_reference_decodes_and_transformers(tmp_path, family):
    """Prompts of 3 to 13 tokens decoded together (blocks of 4, prompts prefilled in chunks of 5, several per
    forward): each row's greedy tokens are the dense-cache loop's and transformers' generate's."""
    from shardfit.weights.local import load_hf

    torch.manual_seed(0)
    make = {"llama": (transformers.LlamaForCausalLM, transformers.LlamaConfig),
            "qwen3": (transformers.Qwen3ForCausalLM, transformers.Qwen3Config)}[family]
    hf = make[0](make[1](**SIZES)).eval()
    hf.save_pretrained(tmp_path / family)
    model, _ = load_hf(str(tmp_path / family), torch.device("cpu"), torch.float32)
    prompts = [_prompt(n, n) for n in (3, 8, 13, 5)]
    results = Sampler(model, kv_blocks=64, block_size=4, prefill_chunk=5).run(
        [SampleRequest(p, SamplingParams(20, temperature=0.0)) for p in prompts])
    for p, r in zip(prompts, results):
        theirs = hf.generate(torch.tensor([p]), max_new_tokens=20, do_sample=False, eos_token_id=None,
                             pad_token_id=0)[0, len(p):].tolist()
        assert r.samples[0].tokens == reference_decode(model, p, 20) == theirs
        assert r.samples[0].stop_reason == "length"
    assert len({t for r in results for t in r.samples[0].tokens}) > 4  # real sequences


def test_logprobs_are_the_full_forwards(model):
    """Sampled at temperature 0.7 with top-k and top-p: each token's log-prob, the prompt's, and the top-k of both
    are those of log_softmax over the model's full forward on prompt + tokens (temperature 1, no filtering)."""
    prompt = _prompt(9, 1)
    req = SampleRequest(prompt, SamplingParams(12, temperature=0.7, top_k=20, top_p=0.9, seed=5), num_samples=2,
                        prompt_logprobs=True, topk_prompt_logprobs=3, topk_sample_logprobs=2)
    [res] = Sampler(model, kv_blocks=32, block_size=4, prefill_chunk=4).run([req])
    for s in res.samples:
        ids = torch.tensor([prompt + s.tokens])
        with torch.no_grad():
            full = torch.log_softmax(model(ids)[0].float(), -1)  # [L, V]
        want = full[:-1].gather(-1, ids[0, 1:, None])[:, 0]
        torch.testing.assert_close(torch.tensor(s.logprobs), want[len(prompt) - 1:], rtol=0, atol=2e-5)
        torch.testing.assert_close(torch.tensor(res.prompt_logprobs[1:]), want[:len(prompt) - 1], rtol=0, atol=2e-5)
        top = full[len(prompt) - 1:-1].topk(2, -1)
        assert [[i for i, _ in pos] for pos in s.topk] == top.indices.tolist()
        torch.testing.assert_close(torch.tensor([[v for _, v in pos] for pos in s.topk]), top.values, atol=2e-5,
                                   rtol=0)
    assert res.prompt_logprobs[0] is None and res.topk_prompt_logprobs[0] is None
    ptop = full[:len(prompt) - 1].topk(3, -1)
    assert [[i for i, _ in pos] for pos in res.topk_prompt_logprobs[1:]] == ptop.indices.tolist()
    assert res.samples[0].tokens != res.samples[1].tokens  # two samples, two draws


@pytest.mark.parametrize("chunk,head_rows", [(4, None), (16, 3)], ids=["chunks-of-4", "one-chunk-scored-by-3"])
def test_scoring_a_prompt_alone(model, monkeypatch, chunk, head_rows):
    """max_tokens=0 with prompt_logprobs (Tinker's compute_logprobs): the prompt's log-probs, no sample; a prefill
    chunk longer than HEAD_ROWS is scored HEAD_ROWS positions a head call (its logits' memory bounded), the same."""
    import shardfit.sampling.runner as runner

    if head_rows:
        monkeypatch.setattr(runner, "HEAD_ROWS", head_rows)
    prompt = _prompt(11, 2)
    [res] = Sampler(model, kv_blocks=16, block_size=4, prefill_chunk=chunk).run(
        [SampleRequest(prompt, SamplingParams(0), prompt_logprobs=True)])
    with torch.no_grad():
        full = torch.log_softmax(model(torch.tensor([prompt]))[0].float(), -1)
    want = full[:-1].gather(-1, torch.tensor(prompt[1:])[:, None])[:, 0]
    assert res.samples == [] and res.prompt_logprobs[0] is None
    torch.testing.assert_close(torch.tensor(res.prompt_logprobs[1:]), want, rtol=0, atol=2e-5)


def _tokens(results):
    return [[s.tokens for s in r.samples] for r in results]


def test_seeded_sampling_is_the_same_whatever_shares_the_batch(model):
    params = SamplingParams(16, temperature=1.0, seed=1234)
    mine = SampleRequest(_prompt(7, 3), params, num_samples=2)
    others = [SampleRequest(_prompt(4 + i, 10 + i), SamplingParams(5 + 3 * i, temperature=0.9, seed=i),
                            num_samples=1 + i % 3) for i in range(5)]
    alone = Sampler(model, block_size=4).run([mine])[0]
    crowd = Sampler(model, block_size=4).run([*others[:3], mine, *others[3:]])[3]
    reordered = Sampler(model, block_size=4).run([mine, *others[::-1]])[0]
    assert _tokens([alone]) == _tokens([crowd]) == _tokens([reordered])
    for a, b in zip(alone.samples, crowd.samples):
        torch.testing.assert_close(a.logprobs, b.logprobs, rtol=0, atol=1e-5)
    assert alone.samples[0].tokens != alone.samples[1].tokens
    other_seed = Sampler(model, block_size=4).run([SampleRequest(mine.prompt, SamplingParams(16, seed=1235),
                                                                 num_samples=2)])[0]
    assert _tokens([other_seed]) != _tokens([alone])


def _thirty(tok, model):
    """30 requests of mixed prompt lengths, max_tokens, temperatures, stop tokens and strings and sample counts;
    stop strings taken from what the request decodes without them, so that they do stop it."""
    reqs = []
    for i in range(30):
        prompt = _prompt(2 + (i * 7) % 23, 100 + i)
        params = SamplingParams(1 + (i * 5) % 19, temperature=0.0 if i % 4 == 0 else 1.0, seed=i,
                                top_k=-1 if i % 3 else 50, stop_tokens=tuple(range(7, 13)) if i % 5 == 1 else ())
        reqs.append(SampleRequest(prompt, params, num_samples=1 + i % 4))
    firsts = Sampler(model, block_size=4, tokenizer=tok).run(reqs)
    for i in range(0, 30, 3):  # every third request stops at a string from its first sample's middle
        text = tok.decode(firsts[i].samples[0].tokens)
        if len(text) >= 4:
            p = reqs[i].params
            reqs[i] = SampleRequest(reqs[i].prompt, SamplingParams(p.max_tokens, p.temperature, p.top_k, p.top_p,
                                                                   p.seed, p.stop_tokens, (text[2:4],)),
                                    num_samples=reqs[i].num_samples)
    return reqs


def _interleaved(sampler, reqs):
    """Submitted a few at a time between steps, while the others decode."""
    handles, pending = [], list(reqs)
    while pending or not all(h.done for h in handles):
        for _ in range(3):
            if pending:
                handles.append(sampler.submit(pending.pop(0)))
        sampler.step()
    return [h.result for h in handles]


def test_continuous_batching_gives_each_request_what_it_gets_alone(model):
    tok = build_tokenizer("byte")
    reqs = _thirty(tok, model)
    alone = [Sampler(model, block_size=4, tokenizer=tok).run([r])[0] for r in reqs]
    roomy = Sampler(model, block_size=4, tokenizer=tok, max_rows=16, check_every=3)
    together = _interleaved(roomy, reqs)
    assert _tokens(together) == _tokens(alone)
    assert [[s.stop_reason for s in r.samples] for r in together] == [[s.stop_reason for s in r.samples]
                                                                      for r in alone]
    stopped = [s for r, q in zip(alone, reqs) if q.params.stop_strings for s in r.samples if s.stop_reason == "stop"]
    assert len(stopped) >= 5
    assert any(s.stop_reason == "stop" and s.tokens[-1] in q.params.stop_tokens  # a stop token, of six
               for r, q in zip(alone, reqs) for s in r.samples)
    for r, q in zip(alone, reqs):  # a stop string ends its sample at the token that completes it
        for s in r.samples:
            if q.params.stop_strings and s.stop_reason == "stop" and s.tokens[-1] not in q.params.stop_tokens:
                assert q.params.stop_strings[0] in tok.decode(s.tokens)
                assert q.params.stop_strings[0] not in tok.decode(s.tokens[:-1])
    # a pool of 14 blocks (56 tokens: the longest row alone fits) finishes them all, preempting, with the same
    tight = Sampler(model, kv_blocks=14, block_size=4, tokenizer=tok, max_rows=16, check_every=3)
    assert _tokens(_interleaved(tight, reqs)) == _tokens(alone)
    assert tight.preemptions > 0
    for s in (roomy, tight):  # no block leaks
        assert s.kv.allocator.n_free == s.kv.n_blocks and not any(s.kv.allocator.refs)
        assert sorted(s.sched.free_slots) == list(range(16))


def test_samples_of_a_prompt_share_its_blocks(model):
    """num_samples=4 on a 10-token prompt in blocks of 4: its 2 full blocks held once by all four rows, its partial
    block copied per row (copy-on-write) when they write; sample i is what a request of i + 1 samples draws as its
    last."""
    prompt = _prompt(10, 4)
    params = SamplingParams(6, temperature=1.0, seed=99)
    s = Sampler(model, kv_blocks=20, block_size=4)
    h = s.submit(SampleRequest(prompt, params, num_samples=4))
    s.step()  # the prefill, the first draws, and one decode step (each row's first write)
    a = s.kv.allocator
    full = s.sched.active[0].blocks[:2]
    assert all(r.blocks[:2] == full for r in s.sched.active) and [a.refs[b] for b in full] == [4, 4]
    assert len({r.blocks[2] for r in s.sched.active}) == 4 and a.n_blocks - a.n_free == 2 + 4
    while not h.done:
        s.step()
    assert a.n_free == a.n_blocks
    for i, sample in enumerate(h.result.samples):
        [alone] = Sampler(model, kv_blocks=20, block_size=4).run([SampleRequest(prompt, params, num_samples=i + 1)])
        assert alone.samples[i].tokens == sample.tokens


BAD = [
    (dict(prompt=[1] * 128), "prompt: the prompt has 128 tokens and the model's context is max_seq_len=128"),
    (dict(prompt=[1] * 100, max_tokens=40), "sampling_params.max_tokens: prompt (100 tokens) + 40 new tokens "
                                            "exceed the model's max_seq_len=128; fix: ask for at most 28 new tokens"),
    (dict(num_samples=10 ** 6), "num_samples: num_samples=1000000 is out of range"),
    (dict(temperature=-0.5), "sampling_params.temperature: temperature=-0.5 is negative"),
    (dict(top_p=0.0), "sampling_params.top_p: top_p=0.0 is outside (0, 1]"),
    (dict(top_p=1.5), "sampling_params.top_p: top_p=1.5 is outside (0, 1]"),
    (dict(top_k=0), "sampling_params.top_k: top_k=0 keeps no token"),
    (dict(prompt=[]), "prompt: the prompt is empty"),
    (dict(prompt=[5, 300]), "prompt: token 300 is not in the model's vocabulary of 300"),
    (dict(max_tokens=0), "sampling_params.max_tokens: max_tokens=0 samples nothing"),
    (dict(adapter=3), "adapter: adapter slot 3 is not served here (no LoRA bank)"),
    (dict(stop_strings=("x",)), "sampling_params.stop_strings: stop strings need a tokenizer"),
]


def test_bad_input_is_one_line_and_the_running_batch_goes_on(model):
    good = SampleRequest(_prompt(6, 5), SamplingParams(10, temperature=1.0, seed=3), num_samples=3)
    want = Sampler(model, block_size=4).run([good])[0]
    s = Sampler(model, block_size=4)
    h = s.submit(good)
    s.step()
    s.step()
    for change, line in BAD:
        fields = dict(prompt=_prompt(4, 6), max_tokens=5, num_samples=1, adapter=-1)
        fields.update(change)
        params = {k: v for k, v in fields.items() if k not in ("prompt", "num_samples", "adapter")}
        with pytest.raises(ShardfitError) as e:
            s.submit(SampleRequest(fields["prompt"], SamplingParams(**params), num_samples=fields["num_samples"],
                                   adapter=fields["adapter"]))
        assert str(e.value).startswith(line), str(e.value)
        assert "\n" not in str(e.value) and "fix: " in str(e.value)
    while not h.done:
        s.step()
    assert _tokens([h.result]) == _tokens([want])
    small = Sampler(model, kv_blocks=4, block_size=4)  # 16 tokens of KV cache
    with pytest.raises(ShardfitError) as e:
        small.submit(SampleRequest(_prompt(10, 7), SamplingParams(8)))
    assert str(e.value).startswith("sampling_params.max_tokens: prompt (10 tokens) + 8 new tokens exceed the KV "
                                   "cache's 16 tokens")


@pytest.mark.slow  # FlexAttention compiles per shape (~20 s on 2 idle cores)
def test_flex_attention_samples_what_the_gather_path_samples(model):
    one = [SampleRequest(_prompt(11, 8), SamplingParams(12, temperature=1.0, seed=2), num_samples=3)]
    flex = Sampler(model, kv_blocks=64, block_size=4, attention="flex").run(one)[0]
    gather = Sampler(model, kv_blocks=64, block_size=4).run(one)[0]
    assert _tokens([flex]) == _tokens([gather])
    for a, b in zip(flex.samples, gather.samples):
        torch.testing.assert_close(a.logprobs, b.logprobs, rtol=0, atol=1e-5)


def test_dropping_a_sampler_frees_its_kv_pool_at_once(model):
    """No reference cycle holds a Sampler: Engine.release_sampler's `= None` gives its pool (and on CUDA its graphs'
    memory) back at once, not at the next garbage collection."""
    import gc
    import weakref

    gc.disable()
    try:
        sampler = Sampler(model, kv_blocks=32)
        sampler.run([SampleRequest([1, 2, 3], SamplingParams(4, temperature=1.0, seed=0), num_samples=2)])
        pool, whole = weakref.ref(sampler.kv.k[0]), weakref.ref(sampler)
        del sampler
        assert whole() is None and pool() is None
    finally:
        gc.enable()


@pytest.mark.parametrize("on", [True, "all"])
def test_decode_kernels_are_set_on_the_instances_and_undone(model, on):
    """step.set_decode_kernels patches the model's RMSNorm and attention instances (not the classes) and takes the
    patch back; "all" puts the q/k norms and RoPE in one kernel (qk_rope) in the attention's norm_rope and the
    MLP's SwiGLU in one (kernels/swiglu.py); where the
    kernels do not run (the CPU, or grad enabled) a patched module is the torch ops, bit for bit. A fused_ops the
    Sampler does not know is refused in one line."""
    from shardfit.errors import ShardfitError
    from shardfit.models.decoder import MLP, Attention, RMSNorm, norm_rope
    from shardfit.sampling import Sampler
    from shardfit.sampling.step import _decode_norm_rope, _decode_qk_rope, set_decode_kernels

    norms = [m for m in model.modules() if isinstance(m, RMSNorm)]
    attns = [m for m in model.modules() if isinstance(m, Attention)]
    mlps = [m for m in model.modules() if isinstance(m, MLP)]
    assert mlps
    x = torch.randn(2, 3, norms[-1].weight.shape[0])
    want = norms[-1](x)
    set_decode_kernels(model, on)
    try:
        assert all("forward" in m.__dict__ for m in norms) and "forward" not in RMSNorm(4, 1e-6).__dict__
        assert all(a.norm_rope is (_decode_qk_rope if on == "all" else _decode_norm_rope) for a in attns)
        assert all(("forward" in m.__dict__) == (on == "all") for m in mlps)  # SwiGLU's kernel: "all" only
        with torch.no_grad():
            assert torch.equal(norms[-1](x), want)
            ids = torch.tensor([[1, 2, 3]])
            patched = model(ids)
    finally:
        set_decode_kernels(model, False)
    assert not any("forward" in m.__dict__ for m in norms + mlps) and all(a.norm_rope is norm_rope for a in attns)
    with torch.no_grad():
        assert torch.equal(patched, model(ids))  # the CPU: the patched modules ran the torch ops
    with pytest.raises(ShardfitError, match="fused_ops='some'"):
        Sampler(model, kv_blocks=8, fused_ops="some")
