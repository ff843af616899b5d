"""Anchor for fine-tuning on variable-length data: what a user writes today, with padding.

transformers' LlamaForCausalLM built on meta, fully_shard per decoder layer then the root, bf16 params with fp32
reduction, fused AdamW, activation checkpointing per layer (--ac full|none), Liger-Kernel's fused RoPE, RMSNorm,
SwiGLU and linear cross-entropy with --liger (the recipe in ../shared/anchors/plain_fsdp2_llama.py, fed real
examples instead of random tokens). Examples come from a prompt/completion JSON-lines file, tokenized as shardfit's
byte tokenizer does (UTF-8 bytes, EOS 257 after the completion, pad 258; loss on completion + EOS), shuffled with a
seed, rank r taking micro-batch rows r*mbs.. of each round:
  --pad max      every row padded to --seq (the fixed-shape padded path)
  --pad longest  rows padded to the longest row of the micro-batch (Hugging Face's dynamic padding: a new shape
                 almost every step)

  torchrun --standalone --nproc_per_node=2 benchmarks/anchor_sft_hf.py --size 8b --data sft.jsonl --seq 4096 \
      --mbs 2 --liger --ac none --pad max [--steps 300 --per-step]

Prints one JSON line (median step after 3 warm-up steps): loss-bearing and real tokens per second per GPU, row
capacity per second, peak allocated/reserved, allocator retries; with --per-step one line per step too
(reserved/allocated peaks of that step and the cumulative retries), for the memory-flatness table.
"""

import argparse
import json
import os
import time

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from transformers import LlamaConfig, LlamaForCausalLM

SIZES = {
    "1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
               num_key_value_heads=8),
    "3b": dict(hidden_size=3072, intermediate_size=8192, num_hidden_layers=28, num_attention_heads=24,
               num_key_value_heads=8),
    "8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
               num_key_value_heads=8),
}
EOS, PAD = 257, 258


def load_examples(path: str, seq: int) -> list[tuple[np.ndarray, np.ndarray]]:
    out = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            ex = json.loads(line)
            p, c = list(ex["prompt"].encode()), list(ex["completion"].encode()) + [EOS]
            ids = np.array(p + c, dtype=np.int64)
            labels = np.array([-100] * len(p) + c, dtype=np.int64)
            out.append((ids[:seq], labels[:seq]))  # HF shifts labels inside the model
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--size", default="8b", choices=sorted(SIZES))
    ap.add_argument("--data", required=True)
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--mbs", type=int, default=2)
    ap.add_argument("--steps", type=int, default=14)
    ap.add_argument("--ac", default="none", choices=("none", "full"))
    ap.add_argument("--pad", default="max", choices=("max", "longest"))
    ap.add_argument("--liger", action="store_true")
    ap.add_argument("--per-step", action="store_true")
    ap.add_argument("--seed", type=int, default=1234)
    a = ap.parse_args()
    dist.init_process_group("nccl")
    rank, ws = dist.get_rank(), dist.get_world_size()
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    mesh = init_device_mesh("cuda", (ws,))
    cfg = LlamaConfig(vocab_size=128256, max_position_embeddings=a.seq, rope_theta=500000.0,
                      tie_word_embeddings=a.size != "8b", **SIZES[a.size])  # Llama 3.2 1B/3B tie, 8B not
    cfg._attn_implementation = "sdpa"
    if a.liger:
        from liger_kernel.transformers import apply_liger_kernel_to_llama

        apply_liger_kernel_to_llama(rope=True, rms_norm=True, swiglu=True, cross_entropy=False,
                                    fused_linear_cross_entropy=True)
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg)
    layers = model.model.layers
    if a.ac == "full":
        for i, layer in enumerate(layers):
            layers[i] = checkpoint_wrapper(layer)
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for i, layer in enumerate(layers):
        fully_shard(layer, mesh=mesh, mp_policy=mp, reshard_after_forward=i < len(layers) - 1)
    fully_shard(model, mesh=mesh, mp_policy=mp)
    model.to_empty(device="cuda")
    with torch.no_grad():
        for prm in model.parameters():
            prm.normal_(0, 0.02)
    d = cfg.hidden_size // cfg.num_attention_heads
    inv = 1.0 / (500000.0 ** (torch.arange(0, d, 2, device="cuda", dtype=torch.float32) / d))
    model.model.rotary_emb.inv_freq = inv
    if hasattr(model.model.rotary_emb, "original_inv_freq"):
        model.model.rotary_emb.original_inv_freq = inv
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=True)

    examples = load_examples(a.data, a.seq)
    order = np.random.default_rng(a.seed).permutation(len(examples))
    times, loss_tok, real_tok, cap_tok, per_step = [], [], [], [], []
    torch.cuda.reset_peak_memory_stats()
    for step in range(a.steps):
        first = step * ws * a.mbs + rank * a.mbs
        rows = [examples[order[(first + j) % len(examples)]] for j in range(a.mbs)]
        width = a.seq if a.pad == "max" else max(len(r[0]) for r in rows)
        ids = torch.full((a.mbs, width), PAD, dtype=torch.long)
        labels = torch.full((a.mbs, width), -100, dtype=torch.long)
        for j, (x, y) in enumerate(rows):
            ids[j, :len(x)], labels[j, :len(y)] = torch.from_numpy(x), torch.from_numpy(y)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = model(input_ids=ids.cuda(), labels=labels.cuda())
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
        loss_tok.append(int((labels[:, 1:] != -100).sum()))
        real_tok.append(sum(len(r[0]) for r in rows))
        cap_tok.append(a.mbs * width)
        if a.per_step:
            st = torch.cuda.memory_stats()
            per_step.append(dict(step=step + 1, peak_alloc_GiB=torch.cuda.max_memory_allocated() / 2**30,
                                 peak_reserved_GiB=torch.cuda.max_memory_reserved() / 2**30,
                                 retries=st["num_alloc_retries"], width=width))
            torch.cuda.reset_peak_memory_stats()
    st = torch.cuda.memory_stats()
    # Tokens per second per GPU over the measured steps (sums, not a median: lengths vary from step to step).
    w = slice(3, None)
    secs = sum(times[w])
    res = dict(size=a.size, ws=ws, seq=a.seq, mbs=a.mbs, ac=a.ac, pad=a.pad, liger=a.liger,
               loss_tok_s_gpu=round(sum(loss_tok[w]) / secs), real_tok_s_gpu=round(sum(real_tok[w]) / secs),
               tok_s_gpu=round(sum(cap_tok[w]) / secs), step_s=round(float(np.median(times[w])), 3),
               peak_alloc_GiB=round(torch.cuda.max_memory_allocated() / 2**30, 2),
               peak_reserved_GiB=round(torch.cuda.max_memory_reserved() / 2**30, 2),
               retries=st["num_alloc_retries"])
    if rank == 0:
        for rec in per_step:
            print(json.dumps({"per_step": True, **rec}), flush=True)
        print(json.dumps(res), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
