"""Anchor for LoRA on the Qwen3-30B-A3B shape on one GPU (issue 23): Hugging Face transformers + PEFT, as axolotl and
TRL run it.

transformers' Qwen3MoeForCausalLM at the 30B-A3B config (48 layers, 128 experts, 8 routed, vocab 151936), random
weights, built as from_pretrained(dtype=torch.bfloat16) leaves it: on the meta device, then every parameter
materialised on the GPU in bf16 (57 GiB; N(0, initializer_range) for matrices, ones for norms; the rotary table
computed again where the model lives). Its defaults, which is what a user gets: SDPA attention (flash-attn is not on
the device; the hub's kernels need the network) and experts_implementation "grouped_mm", transformers 5's default,
one torch grouped GEMM per projection over the tokens sorted by expert (`--experts-impl`: "eager" loops over the
experts that received tokens, ~10x slower in the MoE anchor's measurement; "batched_mm" gathers a weight per routed
token, 412 GB at 8,192 tokens x 8 routes; "deepgemm" and "sonicmoe" are custom kernels from the hub). Then:
  --targets attn          LoRA r=16 alpha 32 on q/k/v/o_proj (`target_modules`, what users pass for an MoE model)
  --targets attn+experts  the same plus PEFT 0.21's `target_parameters` on every layer's fused expert tensors
                          (mlp.experts.gate_up_proj [128, 1536, 2048], mlp.experts.down_proj [128, 2048, 768]):
                          one A and one B per expert (r x 128 rows), the same 629M adapter parameters as shardfit's
                          grouped expert adapters. How PEFT applies them: a parametrization that folds the low-rank
                          update into a new bf16 copy of the whole expert stack on every forward (torch.baddbmm,
                          1.2 GB a layer, again in the checkpointed recompute), so that backward computes the full
                          gradient of that copy (the expert weight-gradient GEMMs full fine-tuning would run, 1.2 GB
                          a layer) and only then the factors'. Practical (memory stays per layer), not cheap.
fp32 adapters (PEFT's autocast_adapter_dtype default, which axolotl and TRL keep for a bf16, non-quantised base; TRL
casts adapters to bf16 for 4-bit bases only) under bf16 autocast, non-reentrant gradient checkpointing of every
decoder layer with enable_input_require_grads (`--ac full`, the Trainer's gradient_checkpointing), no router
auxiliary loss (output_router_logits off: the checkpoint's config), clipping at 1.0, fused AdamW over the adapters.
Random token ids at --seq, labels = ids. The timed loop is anchor_peft_lora.timed_steps, the dense anchor's.

Memory (H100 80 GB: 79.2 GiB): base 56.9 GiB; the loss upcasts the logits to fp32 ([mbs x seq, 151936]: 4.6 GiB at
8,192 tokens) and cross-entropy keeps an fp32 log-softmax, so the head's backward holds ~3 such tensors (13.9 GiB at
mbs 2); checkpointed layer inputs 1.5 GiB. Attention adapters (13.4M parameters, 0.2 GiB with AdamW): ~73 GiB at
mbs 2, fits. Expert adapters add 7.0 GiB of fp32 parameters and AdamW states (and 2.3 of gradients by the end of
backward): ~80 GiB in the head's backward at mbs 2 from the second step on, which does not fit an H100
(bench_suites.py then runs mbs 1: ~72 GiB).

  python benchmarks/anchor_peft_lora_moe.py --size 30b-a3b --targets attn --seq 4096 --mbs 2
  python benchmarks/anchor_peft_lora_moe.py --size tiny --device cpu --seq 64 --mbs 2 --steps 2 --warmup 1 \
      --targets attn+experts [--dtype bf16]          # CPU check (fp32 by default on the CPU, as the dense anchor)

One JSON line at the end, the dense anchor's keys: tokens/s (median step after --warmup steps; the build is not
timed), MFU on active parameters (shardfit's and the MoE anchor's formula: 6 x the weights a token multiplies by,
router and top-k experts, + 12 x layers x heads x head_dim x seq), peak allocated and reserved GiB over the steps
(reset after the build), allocator retries, trainable parameters, the build's seconds and GiB; {"oom": true} after
an OOM.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import statistics
import time

import torch
from anchor_peft_lora import timed_steps  # the dense LoRA anchor's timed loop

SIZES = {  # Qwen3-30B-A3B's config.json, and a tiny one (2 layers, 4 experts) for CPU checks
    "30b-a3b": dict(vocab_size=151936, hidden_size=2048, intermediate_size=6144, num_hidden_layers=48,
                    num_attention_heads=32, num_key_value_heads=4, head_dim=128, num_experts=128,
                    num_experts_per_tok=8, moe_intermediate_size=768, norm_topk_prob=True, rms_norm_eps=1e-6,
                    rope_parameters={"rope_type": "default", "rope_theta": 1e6}, tie_word_embeddings=False,
                    max_position_embeddings=40960),
    "tiny": dict(vocab_size=1000, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=32, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64,
                 norm_topk_prob=True, rope_parameters={"rope_type": "default", "rope_theta": 1e6},
                 tie_word_embeddings=False, max_position_embeddings=4096),
}
ATTN = ["q_proj", "k_proj", "v_proj", "o_proj"]
EXPERTS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]  # PEFT target_parameters (3-D, fused per layer)


@torch.no_grad()
def build(cfg, dev: torch.device, dtype: torch.dtype):
    """The model from_pretrained(dtype=dtype) would give, with random weights: built on meta, materialised on dev."""
    from transformers import Qwen3MoeForCausalLM

    with torch.device("meta"):
        model = Qwen3MoeForCausalLM(cfg).to(dtype)
    model.to_empty(device=dev)
    for name, p in model.named_parameters():
        if "norm" in name:
            p.fill_(1.0)
        else:
            p.normal_(0.0, cfg.initializer_range)
    rotary = model.model.rotary_emb  # inv_freq was computed on meta (and to_empty left it unset): again, on dev
    with torch.device(dev):
        model.model.rotary_emb = type(rotary)(cfg)
    left = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.device.type == "meta"]
    assert not left, left
    return model


def prepare(model, targets: str, ac: str, rank: int, alpha: int):
    """Checkpointing, then the PEFT model, then fp32 adapters (a no-op: PEFT's autocast_adapter_dtype made them so)."""
    from peft import LoraConfig, get_peft_model

    if ac == "full":
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    lcfg = LoraConfig(r=rank, lora_alpha=alpha, lora_dropout=0.0, task_type="CAUSAL_LM", target_modules=ATTN,
                      target_parameters=EXPERTS if targets == "attn+experts" else None)
    model = get_peft_model(model, lcfg)
    if ac == "full":
        model.enable_input_require_grads()  # TRL and the Trainer do it for PEFT with checkpointing
    params = [p for p in model.parameters() if p.requires_grad]
    for p in params:
        p.data = p.data.float()
    return model, params


def flops_per_token(cfg, seq: int) -> int:
    """shardfit's train/metrics.flops_per_token for an MoE model (the MoE anchor's mfu_active)."""
    h, d = cfg.hidden_size, cfg.num_attention_heads * cfg.head_dim
    kv = cfg.num_key_value_heads * cfg.head_dim
    layer = 2 * h * d + 2 * h * kv + h * cfg.num_experts + cfg.num_experts_per_tok * 3 * h * cfg.moe_intermediate_size
    active = cfg.num_hidden_layers * layer + cfg.vocab_size * h
    return 6 * active + 12 * cfg.num_hidden_layers * d * seq


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", default="30b-a3b", choices=sorted(SIZES))
    ap.add_argument("--targets", default="attn", choices=("attn", "attn+experts"))
    ap.add_argument("--experts-impl", default="grouped_mm", choices=("grouped_mm", "eager", "batched_mm"),
                    help="transformers' experts_implementation (grouped_mm: its default)")
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--mbs", type=int, default=2)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--alpha", type=int, default=32)
    ap.add_argument("--ac", default="full", choices=("full", "none"))
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="auto", choices=("auto", "bf16", "fp32"),
                    help="the base's dtype (auto: bf16 on CUDA, fp32 on the CPU); bf16 runs under bf16 autocast")
    ap.add_argument("--peak", type=float, default=989.0, help="peak bf16 TFLOP/s for the MFU figure")
    a = ap.parse_args()
    from transformers import Qwen3MoeConfig

    dev = torch.device(a.device)
    cuda = dev.type == "cuda"
    bf16 = a.dtype == "bf16" or (a.dtype == "auto" and cuda)
    cfg = Qwen3MoeConfig(**SIZES[a.size], use_cache=False, output_router_logits=False, attn_implementation="sdpa")
    cfg._experts_implementation = a.experts_impl  # as .anchors/hf_fsdp2_qwen3moe.py sets it
    torch.manual_seed(0)
    gib = 2**30
    built_gib = 0.0
    try:
        t0 = time.perf_counter()
        model = build(cfg, dev, torch.bfloat16 if bf16 else torch.float32)
        model, params = prepare(model, a.targets, a.ac, a.rank, a.alpha)
        model.train()
        opt = torch.optim.AdamW(params, lr=1e-4, fused=cuda)
        if cuda:
            torch.cuda.synchronize()
            built_gib = torch.cuda.memory_allocated() / gib
            torch.cuda.reset_peak_memory_stats()
        build_s = time.perf_counter() - t0
        impl = model.get_base_model().config._experts_implementation
        g = torch.Generator(device=dev).manual_seed(1)
        times, loss = timed_steps(model, params, opt, cfg.vocab_size, a, dev, g, autocast=bf16)
    except torch.cuda.OutOfMemoryError:
        print(json.dumps({"oom": True, "size": a.size, "targets": a.targets, "mbs": a.mbs, "seq": a.seq,
                          "built_GiB": round(built_gib, 2)}), flush=True)
        return
    dt = statistics.median(times)
    tok_s = a.mbs * a.seq / dt
    stats = torch.cuda.memory_stats() if cuda else {}
    print(json.dumps({
        "anchor": "hf_peft_lora_moe", "size": a.size, "targets": a.targets, "experts_impl": impl, "seq": a.seq,
        "mbs": a.mbs, "rank": a.rank, "ac": a.ac, "adapter_dtype": sorted({str(p.dtype)[6:] for p in params}),
        "trainable": sum(p.numel() for p in params), "tok_s_gpu": round(tok_s),
        "mfu": round(tok_s * flops_per_token(cfg, a.seq) / (a.peak * 1e12), 3) if cuda else None,
        "step_s": round(dt, 4),
        "peak_alloc_GiB": round(torch.cuda.max_memory_allocated() / gib, 2) if cuda else 0.0,
        "peak_reserved_GiB": round(torch.cuda.max_memory_reserved() / gib, 2) if cuda else 0.0,
        "built_GiB": round(built_gib, 2), "build_s": round(build_s, 1),
        "retries": stats.get("num_alloc_retries", 0), "measured_steps": len(times),
        "final_loss": round(loss.item(), 4), "torch": torch.__version__,
        **{k: importlib.metadata.version(k) for k in ("transformers", "peft")}}), flush=True)


if __name__ == "__main__":
    main()
