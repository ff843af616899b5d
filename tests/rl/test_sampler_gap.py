"""The train/sample mismatch metrics (issue 24 item 3) catch a broken weight sync.

Two gloo ranks hold the FSDP-sharded Engine; after a few supervised steps (so that its distributions are peaked,
as a policy's are) `engine.weights()` streams the full tensors into an unsharded copy of the model, the way an
inference engine's load_weights receives them, and that copy samples rollouts with the server's own sampler
(temperature 1, per-token log-probs). The rollouts go back as Tinker-shaped RL datums (the prompt's positions hold
log-prob 0 and advantage 0). With a faithful copy, sampler_logprob_gap:mean and sampler_kl:mean are ~0; when one
layer's weight is corrupted in the sync (scaled, FSDP's two dim-0 shards concatenated in the wrong order, or noised)
both jump by orders of magnitude, though the sampler still produces fluent-looking tokens.
"""

from __future__ import annotations

import torch

from tests._dist import run_ranks
from tests.helpers import SMALL

ARGS = [*SMALL, "--train.device=cpu", "--train.micro_batch_tokens=128", "--logging.run_dir="]
TEXT = b"the quick brown fox jumps over the lazy dog. "
PROMPTS = [TEXT[i:i + 8] for i in (0, 10, 20, 30)]


def _corrupt(kind: str, name: str, t: torch.Tensor) -> torch.Tensor:
    """One layer's weight as a broken sync would deliver it; every other tensor untouched."""
    if kind == "scaled" and name == "model.layers.1.mlp.down_proj.weight":
        return t * 2.0  # e.g. a scale applied twice
    if kind == "shards_swapped" and name == "model.layers.0.self_attn.o_proj.weight":
        half = t.shape[0] // 2  # 2 ranks' dim-0 shards put together in the wrong order
        return torch.cat([t[half:], t[:half]])
    if kind == "noised" and name == "model.layers.1.self_attn.v_proj.weight":
        g = torch.Generator().manual_seed(0)
        return t + torch.randn(t.shape, generator=g) * 2 * t.std()
    return t


def _sampler_copy(engine, kind: str):
    """An unsharded model loaded bucket by bucket from engine.weights() (every rank iterates: collectives)."""
    from shardfit.models import build_model

    model = build_model(engine.cfg.model)
    params = dict(model.named_parameters())
    loaded = set()
    with torch.no_grad():
        for bucket in engine.weights(torch.float32, bucket_bytes=1 << 16):
            for name, t in bucket:  # what an inference engine's load_weights does with the pairs
                params[name].copy_(_corrupt(kind, name, t))
                loaded.add(name)
    assert loaded == set(params), set(params) ^ loaded
    return model.eval()


def _rollout_datums(model) -> list:
    """4 samples of 12 tokens per prompt from `model` (deterministic seeds: every rank builds the same datums)."""
    from shardfit.rl import make_datum
    from shardfit.sampling.fsdp_reference import SampleArgs, sample

    datums = []
    for i, prompt in enumerate(PROMPTS):
        p = list(prompt)
        seqs, _ = sample(model, SampleArgs(prompt=p, num_samples=4, max_tokens=12, temperature=1.0, seed=i),
                         torch.float32, torch.device("cpu"))
        for j, s in enumerate(seqs):
            tokens = p + s.tokens
            n = len(p) - 1
            datums.append(make_datum(tokens[:-1], target_tokens=tokens[1:], logprobs=[0.0] * n + s.logprobs,
                                     advantages=[0.0] * n + [1.0 if j % 2 else -1.0] * len(s.tokens)))
    return datums


def _gaps(rank, world):
    from shardfit.config import load_config
    from shardfit.rl import AdamParams, make_datum
    from shardfit.rl import DatumEngine as Engine  # the Engine through datums (rl/step.py)

    engine = Engine.start(load_config(None, ARGS))
    text = list(TEXT * 2)
    sft = [make_datum(text[i:i + 40], target_tokens=text[i + 1:i + 41]) for i in range(0, 40, 5)]
    for _ in range(15):  # peaked distributions: the policy has learnt something
        engine.forward_backward(sft, "cross_entropy", {"normalize": "token_mean"})
        engine.optim_step(AdamParams(learning_rate=3e-3))
    out = {}
    for kind in ("clean", "scaled", "shards_swapped", "noised"):
        datums = _rollout_datums(_sampler_copy(engine, kind))
        m = engine.forward_backward(datums, "importance_sampling").metrics  # as an RL step sees them
        for p in engine.params:
            p.grad = None  # no step is taken: the next pass starts from no gradient
        out[kind] = {k: m[k] for k in ("sampler_logprob_gap:mean", "sampler_logprob_gap:max", "sampler_kl:mean")}
        out[kind]["tokens"] = [d.tokens.tolist() for d in datums]
    return out


def test_gap_is_zero_for_a_faithful_sync_and_jumps_when_one_layer_is_corrupted():
    ranks = run_ranks(_gaps, 2)
    assert ranks[0] == ranks[1]  # the same datums and metrics on both ranks
    r = ranks[0]
    clean = r["clean"]
    # the sampled tokens are the sampler's: its log-probs are the trainer's up to fp32 rounding of two code paths
    # (packed, document-masked and sharded vs one sequence, unsharded); the prompt's 0 placeholders are not counted
    assert clean["sampler_logprob_gap:mean"] < 1e-4, clean
    assert clean["sampler_logprob_gap:max"] < 1e-3, clean
    assert abs(clean["sampler_kl:mean"]) < 1e-7, clean
    for kind in ("scaled", "shards_swapped", "noised"):
        bad = r[kind]
        assert bad["sampler_logprob_gap:mean"] > 0.02, (kind, bad)
        assert bad["sampler_logprob_gap:mean"] > 1000 * clean["sampler_logprob_gap:mean"], (kind, bad, clean)
        assert bad["sampler_kl:mean"] > 1e-3, (kind, bad)
        assert bad["sampler_kl:mean"] > 1e4 * max(clean["sampler_kl:mean"], 1e-12), (kind, bad, clean)
    print({k: (f"{v['sampler_logprob_gap:mean']:.2g}", f"{v['sampler_kl:mean']:.2g}") for k, v in r.items()})
