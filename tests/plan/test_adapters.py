"""The plan of LoRA and QLoRA runs (plan/adapters.py): a frozen base as stored, fp32 adapters with AdamW, what the
adapted block saves and its backward holds, and the adapter proposals. The measured LoRA peaks are rows of
test_estimate.py's MEASURED; the PPO step through the Engine is checked here."""

import dataclasses
import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from shardfit.config import load_config
from shardfit.config.schema import ModelConfig
from shardfit.plan import adapters
from shardfit.plan.activation_trace import block_activation_bytes, model_key
from shardfit.plan.estimate import GiB, _meta_model, estimate, pinned_shard_bytes
from shardfit.plan.table import plan_table

RESULTS = Path(__file__).resolve().parents[2] / "benchmarks" / "results"
N_8B, BLOCK_8B = 8_030_261_248, 218_112_000  # Llama-3-8B's parameters, one block's
# r = 16 on the 7 linear layers of each of its 32 blocks: 16 x (in + out) each
BLOCK_LORA_8B = 16 * (2 * (4096 + 4096) + 2 * (4096 + 1024) + 3 * (4096 + 14336))
BASE_8B = ["--model.name=llama3-8b", "--data.seq_len=4096", "--train.micro_batch=1", "--train.global_batch=2"]
LORA = ["--lora.rank=16", "--lora.alpha=32"]
HAS_QUANTIZE = "quantize" in {f.name for f in dataclasses.fields(ModelConfig)}


def test_a_lora_run_keeps_the_frozen_base_in_bf16_and_16_bytes_per_adapter_parameter():
    """No fp32 master, gradient or moment for the base: its bf16 bytes, plus the adapters' fp32 weights, gradients
    and two moments, each over the world; what FSDP gathers is the bf16 base (no cast copy) and the adapters cast to
    bf16, and it reduce-scatters the adapters' fp32 gradients only."""
    dense = estimate(load_config(None, BASE_8B), 2, 1)
    lora = estimate(load_config(None, [*BASE_8B, *LORA]), 2, 1)
    A = 32 * BLOCK_LORA_8B
    assert (lora.weights, lora.grads, lora.moments) == ((2 * N_8B + 4 * A) // 2, 4 * A // 2, 8 * A // 2)
    assert dense.states == 16 * N_8B // 2 and lora.states < dense.states / 7
    root = N_8B - 32 * BLOCK_8B
    # gathered: the root and two blocks (bf16); the fp32 reduce-scatter input is a backward buffer (in working)
    assert dense.fsdp == 2 * (root + 2 * BLOCK_8B)
    assert lora.fsdp == 2 * root + 2 * 2 * (BLOCK_8B + BLOCK_LORA_8B)


def test_the_adapted_block_saves_the_adapters_tensors_and_nothing_for_frozen_weights():
    """The trace runs the block with its adapters: each adapter's down-projection A x [T, r] is saved for B's
    gradient; a frozen norm weight saves nothing for its own gradient (eager: its normalised input, [T, D] per norm,
    is no longer kept; the compiled partitioner recomputed it anyway); selective checkpointing keeps every base matmul's
    output and the adapters' [T, r], but not their up-projections' [T, out] (recomputed: parallelize.keeps_output)."""
    base = ["--model.name=llama3-1b", "--data.seq_len=1024"]
    T, D, r = 1024, 2048, 16
    for compiled in (False, True):
        args = [*base, f"--compute.compile={str(compiled).lower()}"]
        dense = block_activation_bytes(load_config(None, args), 1)
        lora = block_activation_bytes(load_config(None, [*args, *LORA]), 1)
        adapter_inputs = 7 * T * r * 2
        assert lora["none"] - dense["none"] == adapter_inputs - (0 if compiled else 2 * T * D * 2)
        assert lora["selective"] - dense["selective"] == adapter_inputs
        assert lora["full"] == dense["full"] == T * D * 2


def test_the_adapted_mlp_backward_holds_three_more_ffn_wide_buffers():
    """Inductor's code for a LoRA MLP's backward (docs/memory-plan.md): down_proj's base and adapter input gradients
    summed into a new buffer, and gate/up's output gradients written with their alpha/r-scaled copies by one
    kernel: three [T, ffn] more than the dense block's two; full checkpointing recomputes the block on top, and
    compiled, three [T, ffn] more again (adapters.recompute_extra: each adapted projection's base and adapter parts
    apart). The frozen head's gathered [V, D] is freed before (estimate.released_head); FSDP's post-backward
    makes the adapters' fp32 reduce-scatter input meanwhile."""
    args = [*BASE_8B, "--compute.compile=true", "--compute.activation_checkpoint=full", "--train.micro_batch=4",
            "--train.global_batch=4"]
    cfg = load_config(None, [*args, *LORA])
    b = block_activation_bytes(cfg, 4)
    T, F, VD = 4 * 4096, 14336, 128_256 * 4096
    got = estimate(cfg, 1, 4).working
    rs = 4 * BLOCK_LORA_8B  # the adapters' fp32 reduce-scatter input
    assert got == 2 * b["block_input"] + b["ffn_grads"] + b["none"] + 3 * T * F * 2 + 3 * T * F * 2 - VD * 2 + rs
    assert b["ffn_grads"] == 2 * T * F * 2
    eager = load_config(None, [*args, *LORA, "--compute.compile=false"])  # the recompute as autograd saves it
    e = block_activation_bytes(eager, 4)
    assert estimate(eager, 1, 4).working == (2 * e["block_input"] + e["ffn_grads"] + e["none"] + 3 * T * F * 2
                                             - VD * 2 + rs)


def test_a_single_rank_gathers_one_block_and_a_frozen_untied_head_is_freed_before_the_blocks_backward():
    """FSDP2 on a shard group of one copies a group's shards when the group runs (its prefetch allocates nothing):
    one gathered block where 2 ranks hold two. The untied output head is a group of its own, resharded by its
    post-backward before any block's backward: LoRA's frozen head is not in a block's backward working set; a trained
    head (full fine-tuning, an adapter on lm_head) or a tied one is."""
    from shardfit.plan.estimate import gathered_blocks, released_head

    assert (gathered_blocks(1), gathered_blocks(2), gathered_blocks(8)) == (1, 2, 2)
    cfg = load_config(None, [*BASE_8B, *LORA])
    one, two = estimate(cfg, 1, 1), estimate(load_config(None, [*BASE_8B, *LORA, "--train.global_batch=4"]), 2, 1)
    block = 2 * BLOCK_8B + 2 * BLOCK_LORA_8B  # the frozen base as stored and the adapters cast, bf16
    assert two.fsdp - one.fsdp == block  # the root gathered whole on both
    t = SimpleNamespace(lora=adapters.counts(_meta_model(model_key(cfg.model)), adapters.lora_key(cfg), "none", 2))
    assert released_head(cfg, t, 2) == 128_256 * 4096 * 2
    head = load_config(None, [*BASE_8B, *LORA, "--lora.targets=q_proj,lm_head"])
    t_head = SimpleNamespace(lora=adapters.counts(_meta_model(model_key(head.model)), adapters.lora_key(head), "none",
                                                  2))
    tied = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, tie_embeddings=True))
    full = SimpleNamespace(lora=None)
    assert released_head(head, t_head, 2) == released_head(tied, t, 2) == released_head(cfg, full, 2) == 0


def test_a_frozen_head_keeps_no_weight_gradient_in_the_fused_loss():
    """Eager loss chunk at micro-batch 1 (the loss is the working set): full fine-tuning keeps dloss/dW [V, D] in
    bf16; a frozen head none; an adapter on lm_head that and the merged weight W + (alpha/r) B A."""
    dense, lora = (estimate(load_config(None, [*BASE_8B, *x]), 1, 1).working for x in ([], LORA))
    head = estimate(load_config(None, [*BASE_8B, *LORA, "--lora.targets=q_proj,v_proj,lm_head"]), 1, 1).working
    VD = 128_256 * 4096 * 2
    assert dense - lora == VD and head - lora == 2 * VD


def test_the_8b_ppo_step_with_lora_is_planned_within_3_percent():
    """The Engine's PPO step (datums in 17,408-token rows, LoRA r16, full AC, compiled, 1 x H100): 28.13 GiB
    measured. Its loss is the token log-probabilities', counted as the fused loss; the block's backward is the
    working set here, so the loss's difference does not reach the peak."""
    data = json.loads((RESULTS / "2026-11-25_s14_h100x1_rl_lora.json").read_text())
    lines = data["rows"][0]["lines"]
    overrides = next(x for x in lines if x.get("rlbench") == "engine")["overrides"]
    measured = next(x for x in lines if x.get("rlbench") == "ppo")["peak_alloc_GiB"]
    args = [a for a in overrides if not a.startswith(("--logging.", "--train.device"))]
    cfg = load_config(None, [*args, f"--train.global_batch={lines[0]['n']}"])  # 64 examples: accumulation
    got = estimate(cfg, 1, 1)
    assert abs(got.peak / GiB / measured - 1) < 0.03, (got.peak / GiB, measured)
    assert got.working > 2 * got.activations / cfg.model.n_layers  # the block's backward, not the loss


def test_offloaded_lora_keeps_the_bf16_base_pinned_and_no_base_gradient():
    cfg = load_config(None, [*BASE_8B, *LORA, "--parallel.offload=all"])
    e = estimate(cfg, 1, 1)
    c = adapters.counts(_meta_model(model_key(cfg.model)), adapters.lora_key(cfg), "none", 2)
    assert e.states == 0 and 2 * N_8B <= pinned_shard_bytes(model_key(cfg.model), 1, 0, 2) < 2.3 * N_8B
    assert e.host == pinned_shard_bytes(model_key(cfg.model), 1, 0, 2) + 2 * adapters.pinned_adapter_bytes(
        c, 1, 0) + 8 * c.adapters
    assert e.offload_copies == 2 * BLOCK_8B + 8 * BLOCK_LORA_8B  # one block's bf16 shard, its adapters' and grads


def _nf4(cfg):
    """cfg with model.quantize=nf4, set by hand where this shardfit's ModelConfig has no such key yet (the estimate
    reads it with getattr; the caches key on it explicitly)."""
    object.__setattr__(cfg.model, "quantize", "nf4")
    return cfg


def test_qlora_stores_the_adapted_linear_weights_in_nf4_and_dequantises_one_at_a_time():
    """NF4 as the QLoRA work stores it: groups of 16,384 weights, 4-bit codes, an int8 absmax per 64 weights, an fp32
    mean and scale per group (0.516113 B a weight); embeddings, head and norms stay bf16. One dequantised weight
    (the largest, an MLP matrix) in flight: 2 B a weight, compiled or eager (the Triton kernel writes only it)."""
    assert adapters.NF4_GROUP_BYTES == 8456 and abs(adapters.NF4_BYTES - 0.516113) < 1e-6
    assert adapters.nf4_bytes(1) == adapters.nf4_bytes(16_384) == 8456  # whole groups, the last one padded
    lora = estimate(load_config(None, [*BASE_8B, *LORA]), 1, 1)
    q = estimate(_nf4(load_config(None, [*BASE_8B, *LORA])), 1, 1)
    linear = BLOCK_8B - 2 * 4096  # the 7 adapted linear weights of a block: 13,312 whole groups
    A = 32 * BLOCK_LORA_8B
    block_nf4 = 2 * BLOCK_8B - 2 * linear + linear // 16_384 * 8456
    assert q.weights == 2 * N_8B + 32 * (block_nf4 - 2 * BLOCK_8B) + 4 * A
    # the dequantised weight lives inside a layer's forward or backward, never at the loss, this run's peak
    assert (q.grads, q.moments, q.activations, q.working) == (lora.grads, lora.moments, lora.activations, lora.working)
    assert q.fsdp - lora.fsdp == block_nf4 - 2 * BLOCK_8B  # one gathered block on one rank
    # a block's backward the peak (small loss chunks, 4 rows): the weight counts there
    full = ["--compute.activation_checkpoint=full", "--compute.loss_chunk=128", "--train.micro_batch=4",
            "--train.global_batch=4"]
    assert (estimate(_nf4(load_config(None, [*BASE_8B, *LORA, *full])), 1, 4).working
            - estimate(load_config(None, [*BASE_8B, *LORA, *full]), 1, 4).working == 2 * 14336 * 4096)
    compiled = [*BASE_8B, *LORA, "--compute.compile=true"]
    assert (estimate(_nf4(load_config(None, compiled)), 1, 1).fsdp - estimate(load_config(None, compiled), 1, 1).fsdp
            == block_nf4 - 2 * BLOCK_8B)
    # only the adapted layers are quantized
    two = estimate(_nf4(load_config(None, [*BASE_8B, *LORA, "--lora.targets=q_proj,v_proj"])), 1, 1)
    qv = 4096 * 4096 + 4096 * 1024
    assert two.weights - 4 * 32 * 16 * (8192 + 5120) == 2 * N_8B - 32 * (2 * qv - qv // 16_384 * 8456)


def test_an_fp8_base_stores_a_byte_a_weight_and_a_scale_a_row():
    """model.quantize=fp8 (adapters/fp8_base.py): the 7 adapted linear weights of a block in e4m3 (1 B a weight) with
    an fp32 scale per row; in flight, one weight's codes transposed for its input gradient (1 B a weight)."""
    lora = estimate(load_config(None, [*BASE_8B, *LORA]), 1, 1)
    q = estimate(load_config(None, [*BASE_8B, *LORA, "--model.quantize=fp8"]), 1, 1)
    linear = BLOCK_8B - 2 * 4096
    rows = 4096 + 1024 + 1024 + 4096 + 14336 + 14336 + 4096  # q, k, v, o, gate, up, down
    block_fp8 = 2 * BLOCK_8B - 2 * linear + linear + 4 * rows
    assert lora.weights - q.weights == 32 * (2 * BLOCK_8B - block_fp8)
    assert q.fsdp - lora.fsdp == block_fp8 - 2 * BLOCK_8B  # one gathered block on one rank
    full = ["--compute.activation_checkpoint=full", "--compute.loss_chunk=128", "--train.micro_batch=4",
            "--train.global_batch=4"]
    fp8 = estimate(load_config(None, [*BASE_8B, *LORA, *full, "--model.quantize=fp8"]), 1, 4)
    assert fp8.working - estimate(load_config(None, [*BASE_8B, *LORA, *full]), 1, 4).working == 14336 * 4096
    assert "LoRA (FP8 base) rank 16" in plan_table(load_config(None, [*BASE_8B, *LORA, "--model.quantize=fp8"]), 1,
                                                    79).splitlines()[0]


def test_the_nf4_bytes_are_the_qlora_storage_where_it_exists():
    nf4 = pytest.importorskip("shardfit.adapters.nf4", reason="the QLoRA work (adapters/nf4.py) is not merged yet")
    assert (adapters.NF4_GROUP, adapters.NF4_BYTES) == (nf4.GROUP, nf4.BYTES_PER_WEIGHT)
    assert "QLoRA (NF4 base) rank 16" in plan_table(_nf4(load_config(None, [*BASE_8B, *LORA])), 1, 79).splitlines()[0]


def test_an_fp8_base_computing_in_fp32_dequantises_its_weight():
    """compute.param_dtype=float32: no FP8 matmul (adapters/fp8_base.py takes bf16 inputs only); each layer's weight
    is dequantised whole in fp32 (4 B a weight: the codes widened, then scaled in place) for its forward and its
    input gradient, where the plan counted 1 B a weight (the FP8 path's transposed codes)."""
    full = ["--compute.activation_checkpoint=full", "--compute.loss_chunk=128", "--train.micro_batch=4",
            "--train.global_batch=4", "--compute.param_dtype=float32"]
    fp8 = estimate(load_config(None, [*BASE_8B, *LORA, *full, "--model.quantize=fp8"]), 1, 4)
    assert fp8.working - estimate(load_config(None, [*BASE_8B, *LORA, *full]), 1, 4).working == 14336 * 4096 * 4


def test_the_fp8_bytes_are_the_fp8_storage():
    """The plan's own arithmetic (it runs on a shardfit without adapters/fp8_base.py) against the module's: which
    weights take the format, and their storage's bytes."""
    from shardfit.adapters.fp8_base import FP8Linear

    for out_f, in_f in ((4096, 4096), (1024, 4096), (14336, 4096), (168, 64), (64, 168), (16, 16)):
        shapes = FP8Linear.storage_shapes(out_f, in_f, torch.uint8) if FP8Linear.eligible(out_f, in_f) else []
        assert adapters._quantized("fp8", out_f, in_f, 2)[0] == sum(a * b for a, b in shapes), (out_f, in_f)


@pytest.mark.skipif(not HAS_QUANTIZE, reason="model.quantize is not in this shardfit yet (the QLoRA work adds it)")
def test_qlora_from_the_config_key():
    cfg = load_config(None, [*BASE_8B, *LORA, "--model.quantize=nf4"])
    assert adapters.quantize(cfg) == "nf4"
    assert estimate(cfg, 1, 1).peak == estimate(_nf4(load_config(None, [*BASE_8B, *LORA])), 1, 1).peak


def test_lora_is_proposed_after_offload_and_before_more_gpus_only_when_full_fine_tuning_does_not_fit():
    """8B on one 80 GB GPU: offload trains what was asked (slower), LoRA changes what is trained, more GPUs need
    hardware; re-planned from its flags, LoRA fits without offload. Full fine-tuning that fits gets no LoRA
    proposal, nor does a run that already is LoRA."""
    from shardfit.plan.proposals import accepted, proposals

    props, _ = proposals(load_config(None, BASE_8B[:2]), 1, 80)
    kinds = [p.kind for p in props]
    assert kinds.index("offload_all") < kinds.index("lora") < kinds.index("more_gpus")
    lora = props[kinds.index("lora")]
    assert lora.flags[:2] == ["--lora.rank=16", "--lora.alpha=32"] and "parallel.offload" not in lora.changes
    assert "changes what is trained" in lora.note and "0.52% of 8.0B" in lora.note
    cfg = load_config(None, [*BASE_8B[:2], *lora.flags])
    assert accepted(cfg, 1) and estimate(cfg, 1, cfg.train.micro_batch) == lora.estimate
    assert "lora" not in [p.kind for p in proposals(load_config(None, BASE_8B[:2]), 8, 80)[0]]
    big = load_config(None, ["--model.name=llama3-70b", "--data.seq_len=4096", *LORA])  # 131 GiB of bf16 base
    kinds = {p.kind for p in proposals(big, 1, 80)[0]}
    assert "lora" not in kinds and ("qlora" in kinds) == HAS_QUANTIZE


def test_qlora_is_proposed_only_where_the_quantize_key_exists_and_lora_does_not_fit():
    from shardfit.plan.proposals import adapter_kinds

    def cfg(rank, **model):
        return SimpleNamespace(lora=SimpleNamespace(rank=rank), model=SimpleNamespace(**model))

    assert [k for k, _ in adapter_kinds(cfg(0))] == ["lora"]  # no quantize key: LoRA only
    assert adapter_kinds(cfg(16)) == []
    assert adapter_kinds(cfg(0, quantize="none")) == [
        ("lora", {"lora.rank": 16, "lora.alpha": 32}),
        ("fp8_base", {"model.quantize": "fp8", "lora.rank": 16, "lora.alpha": 32}),
        ("qlora", {"model.quantize": "nf4", "lora.rank": 16, "lora.alpha": 32})]
    assert adapter_kinds(cfg(8, quantize="none")) == [("fp8_base", {"model.quantize": "fp8"}),
                                                      ("qlora", {"model.quantize": "nf4"})]
    assert adapter_kinds(cfg(8, quantize="fp8")) == [("qlora", {"model.quantize": "nf4"})]  # only a coarser base
    assert adapter_kinds(cfg(8, quantize="nf4")) == []


def _kinds(args: list[str], gib: float) -> dict:
    from shardfit.plan.proposals import proposals

    return {p.kind: p for p in proposals(load_config(None, args), 1, gib)[0]}


@pytest.mark.skipif(not HAS_QUANTIZE, reason="model.quantize is not in this shardfit yet")
def test_an_fp8_base_is_proposed_before_qlora_and_qlora_only_where_it_does_not_fit():
    """70B full fine-tuning on one 141 GB GPU: LoRA's bf16 base (131 GiB) does not fit, its FP8 base (66 GiB) does,
    so no NF4 one is proposed; 8B LoRA on 16 GB: the FP8 base does not fit, QLoRA does; a run on an FP8 base that
    does not fit is proposed QLoRA; compute.fp8 goes with a quantized base (refused together). Each re-planned from
    its flags is accepted and predicts the same."""
    from shardfit.plan.proposals import accepted

    big = ["--model.name=llama3-70b", "--data.seq_len=4096"]
    kinds = _kinds(big, 141)
    assert "lora" not in kinds and "qlora" not in kinds
    fp8 = kinds["fp8_base"]
    assert fp8.flags[:3] == ["--model.quantize=fp8", "--lora.rank=16", "--lora.alpha=32"]
    assert "in FP8 (e4m3" in fp8.note and "changes what is trained" in fp8.note
    small = [*BASE_8B, *LORA]
    kinds = _kinds(small, 16)
    assert "fp8_base" not in kinds and kinds["qlora"].changes["model.quantize"] == "nf4"
    assert "fp8_base" in _kinds(small, 24) and "qlora" not in _kinds(small, 24)
    assert _kinds([*small, "--model.quantize=fp8"], 16)["qlora"].changes["model.quantize"] == "nf4"
    tensorwise = _kinds([*BASE_8B, "--compute.fp8=tensorwise"], 24)["fp8_base"]
    assert tensorwise.changes["compute.fp8"] == "none"
    for args, p in ((big, fp8), ([*BASE_8B, "--compute.fp8=tensorwise"], tensorwise)):
        cfg = load_config(None, [*args, *p.flags])
        assert accepted(cfg, 1) and estimate(cfg, 1, cfg.train.micro_batch) == p.estimate


def test_expert_adapters_are_counted_where_their_experts_sit():
    """MoE experts' adapters (adapters/expert_lora.py), Qwen3-30B-A3B's shape at 4 layers: E x r x (in + out) per
    adapted weight, fp32 states sharded like the rest; FSDP gathers a rank's n/E of them with its experts (E < W) or
    none (E = W: the computation casts them, transiently, and writes their fp32 gradients fresh); unrecomputed
    blocks with experts outside FSDP hold that cast; the trace saves their inputs (xs [T*k, H], h [T*k, I]) and
    their [T*k, r] products; the backward holds [T*k, 2I] + [T*k, I] more."""
    E, H, I, k, r, L = 128, 2048, 768, 8, 16, 4
    attention = r * (2 * (H + 4096) + 2 * (H + 512))  # q, o; k, v
    experts = E * r * ((H + 2 * I) + (I + H))  # gate_up A [E, r, H], B [E, 2I, r]; down A [E, r, I], B [E, H, r]
    base = ["--model.name=qwen3-30b-a3b", f"--model.n_layers={L}", "--data.seq_len=1024", "--train.micro_batch=1",
            "--train.global_batch=1", *LORA]
    targets = "--lora.targets=q_proj,k_proj,v_proj,o_proj"
    cfg = load_config(None, [*base, f"{targets},experts"])
    c = adapters.counts(_meta_model(model_key(cfg.model)), adapters.lora_key(cfg), "none", 2)
    assert c.block_expert_adapters == (experts,) * L and c.adapters == L * (attention + experts)
    assert c.mlp_extra_width == k * (2 * I + I)
    T = 1024 * k  # routed rows of a micro-batch
    traced = block_activation_bytes(cfg, 1)["none"] - block_activation_bytes(load_config(None, [*base, targets]), 1)[
        "none"]
    assert traced == T * (H + I + 2 * r) * 2
    for world, ep, gathered, transient, held in ((1, 1, 0, experts, experts), (2, 2, 0, experts // 2, experts // 2),
                                                 (4, 2, experts // 2, 0, 0), (2, 1, experts, 0, 0)):
        plain, adapted = (estimate(load_config(None, [*base, t, f"--parallel.expert_parallel={ep}"]), world, 1)
                          for t in (targets, f"{targets},experts"))
        ours = L * experts // world
        assert (adapted.weights - plain.weights, adapted.moments - plain.moments) == (4 * ours, 8 * ours)
        assert adapted.grads - plain.grads == (0 if transient else 4 * ours)  # E = W: written fresh in backward
        # two blocks gathered in bf16 (their fp32 reduce-scatter input is in working); E = W: the cast's bf16 copy
        assert adapted.fsdp - plain.fsdp == 2 * 2 * gathered + 2 * transient, (world, ep)
        assert adapted.activations - plain.activations == L * (traced + 2 * held)
