"""Anchor for LoRA fine-tuning on one GPU (issue 23): Hugging Face + PEFT as axolotl and TRL run it.

What a user writes today: transformers' LlamaForCausalLM in bf16 on the GPU, `peft.get_peft_model` with LoRA on
every linear layer of the blocks (q/k/v/o, gate/up/down), the adapters in fp32 (PEFT's autocast_adapter_dtype
default) under bf16 autocast, non-reentrant activation checkpointing (`--ac full`, the Trainer's
gradient_checkpointing) with `enable_input_require_grads`, SDPA attention, fused AdamW over the adapters only.
`--liger` applies Liger-Kernel's Llama patch first (fused RoPE, RMSNorm, SwiGLU, linear cross-entropy), as
axolotl's `liger_*` options do. Random token ids at --seq (the shape of packed SFT rows), labels = ids.

  python benchmarks/anchor_peft_lora.py --size 8b --seq 4096 --mbs 2 [--liger] [--ac none]
  python benchmarks/anchor_peft_lora.py --size tiny --device cpu --seq 128 --mbs 2 --steps 3   # CPU check

One JSON line at the end: tokens/s (median step after --warmup steps), MFU with the dense recipes' formula (6 x
non-embedding parameters + 12 x layers x hidden x seq per token: it counts base-weight gradients LoRA never
computes, so it reads as a throughput figure, not utilisation), peak allocated and reserved GiB, allocator retries,
the trainable parameter count; {"oom": true} instead after an OOM.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

SIZES = {  # Llama-3 shapes (vocab 128256, GQA 8 kv heads), and a tiny one for CPU checks
    "8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
               num_key_value_heads=8, vocab_size=128256, rope_theta=500000.0),
    "1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
               num_key_value_heads=8, vocab_size=128256, rope_theta=500000.0, tie_word_embeddings=True),
    "tiny": dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=1000),
}
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def timed_steps(model, params, opt, vocab: int, a, dev: torch.device, g: torch.Generator, autocast: bool):
    """a.warmup + a.steps training steps on random ids [a.mbs, a.seq] under bf16 autocast (clip 1.0, AdamW):
    (seconds of each step after the warm-up, the last loss). Shared with anchor_peft_qlora.py."""
    cuda = dev.type == "cuda"
    times, loss = [], None
    for step in range(a.warmup + a.steps):
        ids = torch.randint(0, vocab, (a.mbs, a.seq), generator=g, device=dev)
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=autocast):
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if cuda:
            torch.cuda.synchronize()
        if step >= a.warmup:
            times.append(time.perf_counter() - t0)
    return times, loss


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", default="8b", choices=sorted(SIZES))
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--mbs", type=int, default=2)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--alpha", type=int, default=32)
    ap.add_argument("--ac", default="full", choices=("full", "none"))
    ap.add_argument("--liger", action="store_true")
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--peak", type=float, default=989.0, help="peak bf16 TFLOP/s for the MFU figure")
    a = ap.parse_args()
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    if a.liger:
        from liger_kernel.transformers import apply_liger_kernel_to_llama

        apply_liger_kernel_to_llama()
    dev = torch.device(a.device)
    cuda = dev.type == "cuda"
    cfg = LlamaConfig(**SIZES[a.size], max_position_embeddings=max(a.seq, 8192), attn_implementation="sdpa")
    torch.manual_seed(0)
    with dev:
        model = LlamaForCausalLM(cfg).to(torch.bfloat16 if cuda else torch.float32)
    if a.ac == "full":
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.enable_input_require_grads()
    model = get_peft_model(model, LoraConfig(r=a.rank, lora_alpha=a.alpha, lora_dropout=0.0, task_type="CAUSAL_LM",
                                             target_modules=TARGETS))
    params = [p for p in model.parameters() if p.requires_grad]
    for p in params:
        p.data = p.data.float()  # fp32 adapters (PEFT's default when the base is loaded in bf16)
    model.train()
    opt = torch.optim.AdamW(params, lr=1e-4, fused=cuda)
    n_total = sum(p.numel() for p in model.parameters())
    n_embed = cfg.vocab_size * cfg.hidden_size * (1 if cfg.tie_word_embeddings else 2)
    flops_per_token = 6 * (n_total - n_embed) + 12 * cfg.num_hidden_layers * cfg.hidden_size * a.seq
    g = torch.Generator(device=dev).manual_seed(1)
    try:
        times, loss = timed_steps(model, params, opt, cfg.vocab_size, a, dev, g, autocast=cuda)
    except torch.cuda.OutOfMemoryError:
        print(json.dumps({"oom": True, "size": a.size, "mbs": a.mbs, "seq": a.seq}), flush=True)
        return
    dt = statistics.median(times)
    tok_s = a.mbs * a.seq / dt
    gib = 2**30
    stats = torch.cuda.memory_stats() if cuda else {}
    print(json.dumps({
        "anchor": "hf_peft_lora", "size": a.size, "seq": a.seq, "mbs": a.mbs, "rank": a.rank, "ac": a.ac,
        "liger": a.liger, "trainable": sum(p.numel() for p in params), "tok_s_gpu": round(tok_s),
        "mfu": round(tok_s * flops_per_token / (a.peak * 1e12), 3) if cuda else None, "step_s": round(dt, 4),
        "peak_alloc_GiB": round(torch.cuda.max_memory_allocated() / gib, 2) if cuda else 0.0,
        "peak_reserved_GiB": round(torch.cuda.max_memory_reserved() / gib, 2) if cuda else 0.0,
        "retries": stats.get("num_alloc_retries", 0), "measured_steps": len(times),
        "final_loss": round(loss.item(), 4), "torch": torch.__version__}), flush=True)


if __name__ == "__main__":
    main()
