"""Anchor for fine-tuning on variable-length data: the hand-written FSDP2 recipe fed padded examples (issue 12).

What a user writes today, adapted from shared/anchors/plain_fsdp2_llama.py (the same model, sharding and optimizer;
real examples instead of random tokens): transformers' LlamaForCausalLM built on meta, `fully_shard` per decoder
layer then the root, bf16 parameters with fp32 gradient reduction, fused AdamW, activation checkpointing per layer
(`--ac full|none`), SDPA attention, and with `--liger` Liger-Kernel's fused RoPE, RMSNorm, SwiGLU and linear
cross-entropy, applied exactly as the original applies them. Untied embedding and output head like the original
(`--tie` ties them, as Llama 3.2 1B/3B do).

Data: a prompt/completion JSON-lines file (benchmarks/gen_sft_data.py), tokenized the way shardfit's byte tokenizer
does (src/shardfit/data/tokenizer.py, re-implemented here so the anchor imports nothing from shardfit): token ids
are the UTF-8 bytes 0-255, EOS 257 after the completion, PAD 258. labels = the ids on the completion and its EOS,
-100 on the prompt and on padding (transformers shifts them inside the model: loss on exactly the completion + EOS
tokens). Examples longer than --seq are truncated. The order is a permutation seeded by --seed (a new one each
epoch); step s gives rank r the rows s*world*mbs + r*mbs ... + mbs - 1. Batching:
  --pad max      every row padded to --seq: the fixed-shape padded path (issue 12's "padded path");
  --pad longest  rows padded to the longest row of the micro-batch (rounded up to --pad-multiple): Hugging Face's
                 dynamic padding, a new shape almost every step ("plain variable-shape batches").
Right padding needs no attention mask: attention is causal and the padding comes after every real token, so real
tokens never see it, and padding carries no loss. `--attn-mask` passes the mask anyway, as HF collators do (SDPA then
gets a dense mask and leaves the flash kernel; slower).

  torchrun --standalone --nproc_per_node=2 benchmarks/anchor_sft.py --size 8b --data sft.jsonl --seq 4096 \
      --mbs 2 --liger --ac none --pad max [--steps 300 --per-step-json]
  torchrun --standalone --nproc_per_node=2 benchmarks/anchor_sft.py --size tiny --device cpu \
      --data /tmp/sft.jsonl --seq 512 --mbs 2 --steps 3                 # CPU check (gloo, fp32)

Rank 0 prints one JSON line at the end (after --warmup steps, 3 by default): tokens per second per GPU as sums over
the measured steps (lengths vary from step to step, so a median step would not do) counting loss-bearing tokens
(loss_tok_s_gpu), real (non-padding) tokens (real_tok_s_gpu) and row capacity (tok_s_gpu, padding included: the
original's figure); MFU on row capacity with the original's formula (6 x non-embedding parameters + 12 x layers x
hidden x row width per token, --peak 989 TFLOP/s) at each step's width; the median step time; peak allocated and
reserved (GiB, all steps, largest over ranks) and allocator retries; {"oom": true} instead after an OOM. With
--per-step-json it also prints one line per step as the step ends: that step's peak reserved and allocated (GiB,
largest over ranks; peaks are reset after each step), the cumulative retries (largest over ranks), the row width
and the step's loss-bearing tokens (all ranks).
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
    "tiny": dict(hidden_size=64, intermediate_size=176, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=264),  # CPU checks only; shardfit's tiny vocabulary
    "1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
               num_key_value_heads=8),
    "3b": dict(hidden_size=3072, intermediate_size=8192, num_hidden_layers=28, num_attention_heads=24,
               num_key_value_heads=8),
    "8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
               num_key_value_heads=8),
}
EOS, PAD, IGNORE = 257, 258, -100  # shardfit's ByteTokenizer: bytes 0-255, BOS 256, EOS 257, PAD 258


def load_examples(path: str, seq: int) -> list[tuple[np.ndarray, np.ndarray]]:
    """(ids, labels) per example, truncated to seq tokens: prompt bytes + completion bytes + EOS; labels -100 on
    the prompt (the model shifts labels: position t's logits are scored against labels[t + 1])."""
    out = []
    with open(path, "rb") as f:
        for line in f:
            if not line.strip():
                continue
            ex = json.loads(line)
            p = np.frombuffer(ex["prompt"].encode("utf-8"), dtype=np.uint8).astype(np.int64)
            c = np.frombuffer(ex["completion"].encode("utf-8"), dtype=np.uint8).astype(np.int64)
            ids = np.concatenate([p, c, [EOS]])
            labels = ids.copy()
            labels[:len(p)] = IGNORE
            out.append((ids[:seq], labels[:seq]))
    return out


def make_batch(rows, seq: int, pad: str, multiple: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-padded [mbs, width] ids, labels and attention mask."""
    width = seq if pad == "max" else min(seq, -(-max(len(r[0]) for r in rows) // multiple) * multiple)
    ids = torch.full((len(rows), width), PAD, dtype=torch.long)
    labels = torch.full((len(rows), width), IGNORE, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for j, (x, y) in enumerate(rows):
        ids[j, :len(x)], labels[j, :len(y)], mask[j, :len(x)] = torch.from_numpy(x), torch.from_numpy(y), 1
    return ids, labels, mask


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--size", default="8b", choices=sorted(SIZES))
    ap.add_argument("--data", required=True, help="prompt/completion JSON lines (benchmarks/gen_sft_data.py)")
    ap.add_argument("--seq", type=int, default=4096, help="row length (--pad max) and truncation length")
    ap.add_argument("--mbs", type=int, default=2, help="rows per rank per step (no accumulation, like the original)")
    ap.add_argument("--steps", type=int, default=14)
    ap.add_argument("--warmup", type=int, default=3, help="steps left out of the throughput figures")
    ap.add_argument("--ac", default="none", choices=("none", "full"))
    ap.add_argument("--pad", default="max", choices=("max", "longest"))
    ap.add_argument("--pad-multiple", type=int, default=1, help="--pad longest: round the width up to this")
    ap.add_argument("--attn-mask", action="store_true", help="pass the padding mask as HF collators do")
    ap.add_argument("--liger", action="store_true")
    ap.add_argument("--tie", action="store_true", help="tie the embedding and the output head")
    ap.add_argument("--per-step-json", action="store_true")
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--lr", type=float, default=1e-5)
    ap.add_argument("--peak", type=float, default=989e12)
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    a = ap.parse_args()
    if a.attn_mask and a.ac == "full":  # transformers 5.23's mask does not survive checkpoint_wrapper's recompute
        ap.error("--attn-mask with --ac full fails in the recomputation (mask size mismatch); use one of them")
    cuda = a.device == "cuda"
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, ws = dist.get_rank(), dist.get_world_size()
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank % torch.cuda.device_count())))
    dev = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    mesh = init_device_mesh(a.device, (ws,))
    sizes = dict(SIZES[a.size])
    vocab = sizes.pop("vocab_size", 128256)
    cfg = LlamaConfig(vocab_size=vocab, max_position_embeddings=a.seq, rope_theta=500000.0,
                      tie_word_embeddings=a.tie, **sizes)
    cfg._attn_implementation = "sdpa"
    if a.liger:  # what a user would add today: Liger-Kernel's fused RoPE/RMSNorm/SwiGLU and fused linear CE
        from liger_kernel.transformers import apply_liger_kernel_to_llama

        apply_liger_kernel_to_llama(rope=True, rms_norm=True, swiglu=True, cross_entropy=False,
                                    fused_linear_cross_entropy=True)
    t0 = time.time()
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg)
    layers = model.model.layers
    if a.ac == "full":
        for i, layer in enumerate(layers):
            layers[i] = checkpoint_wrapper(layer)
    # bf16 compute on CUDA as the original; fp32 on the CPU check (gloo, CPU matmuls)
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16 if cuda else torch.float32, reduce_dtype=torch.float32)
    for i, layer in enumerate(layers):
        fully_shard(layer, mesh=mesh, mp_policy=mp, reshard_after_forward=i < len(layers) - 1)
    fully_shard(model, mesh=mesh, mp_policy=mp)
    model.to_empty(device=dev)
    with torch.no_grad():
        for prm in model.parameters():
            prm.normal_(0, 0.02)
    rot = model.model.rotary_emb  # non-persistent buffer: recompute after to_empty
    d = cfg.hidden_size // cfg.num_attention_heads
    inv = 1.0 / (500000.0 ** (torch.arange(0, d, 2, device=dev, dtype=torch.float32) / d))
    rot.inv_freq = inv
    if hasattr(rot, "original_inv_freq"):
        rot.original_inv_freq = inv
    init_s = time.time() - t0
    opt = torch.optim.AdamW(model.parameters(), lr=a.lr, fused=True)
    total = sum(p.numel() for p in model.parameters())  # DTensor numel is the global count
    emb = cfg.vocab_size * cfg.hidden_size
    L, H = cfg.num_hidden_layers, cfg.hidden_size

    examples = load_examples(a.data, a.seq)
    n = len(examples)
    perms: dict[int, np.ndarray] = {}

    def example(k: int):
        e = k // n
        if e not in perms:
            perms[e] = np.random.default_rng([a.seed, e]).permutation(n)
        return examples[perms[e][k % n]]

    def sync():
        if cuda:
            torch.cuda.synchronize()

    times, loss_tok, real_tok, cap_tok, flops = [], [], [], [], []
    peak_alloc = peak_resv = 0.0
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    try:
        for step in range(a.steps):
            first = step * ws * a.mbs + rank * a.mbs
            rows = [example(first + j) for j in range(a.mbs)]
            ids, labels, mask = make_batch(rows, a.seq, a.pad, a.pad_multiple)
            width = ids.shape[1]
            sync()
            t = time.perf_counter()
            kw = {"attention_mask": mask.to(dev, non_blocking=True)} if a.attn_mask else {}
            out = model(input_ids=ids.to(dev, non_blocking=True), labels=labels.to(dev, non_blocking=True), **kw)
            out.loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
            sync()
            times.append(time.perf_counter() - t)
            loss_tok.append(int((labels[:, 1:] != IGNORE).sum()))
            real_tok.append(int(mask.sum()))
            cap_tok.append(ids.numel())
            flops.append(ids.numel() * (6 * (total - emb) + 12 * L * H * width))
            resv = alloc = retries = 0.0
            if cuda:
                resv, alloc = torch.cuda.max_memory_reserved() / 2**30, torch.cuda.max_memory_allocated() / 2**30
                retries = float(torch.cuda.memory_stats().get("num_alloc_retries", 0))
            peak_alloc, peak_resv = max(peak_alloc, alloc), max(peak_resv, resv)
            if a.per_step_json:  # this step's peaks over the ranks, then a fresh peak for the next step
                m = torch.tensor([resv, alloc, retries, loss_tok[-1]], dtype=torch.float64, device=dev)
                s = m[3:].clone()
                dist.all_reduce(m, op=dist.ReduceOp.MAX)
                dist.all_reduce(s)
                if rank == 0:  # printed as it goes: a run cut short still leaves its steps
                    print(json.dumps(dict(per_step=True, step=step + 1, peak_reserved_GiB=round(float(m[0]), 4),
                                          peak_alloc_GiB=round(float(m[1]), 4), retries=int(m[2]), width=width,
                                          loss_tokens=int(s[0]), step_s=round(times[-1], 4))), flush=True)
                if cuda:
                    torch.cuda.reset_peak_memory_stats()
    except torch.OutOfMemoryError:  # as the original: one line saying so, and out
        if rank == 0:
            print(json.dumps(dict(size=a.size, ws=ws, seq=a.seq, mbs=a.mbs, pad=a.pad, liger=a.liger, oom=True,
                                  steps_done=len(times))), flush=True)
        os._exit(0)
    retries = float(torch.cuda.memory_stats().get("num_alloc_retries", 0)) if cuda else 0.0
    # Ranks' throughput: their own sums over the measured steps; reported: the mean over ranks of the token rates
    # (each rank's tokens over its own time; every rank waits for the slowest in each step's collectives) and the
    # largest memory figures.
    w = slice(min(a.warmup, a.steps - 1), None)
    secs = sum(times[w])
    mine = torch.tensor([sum(loss_tok[w]) / secs, sum(real_tok[w]) / secs, sum(cap_tok[w]) / secs,
                         sum(flops[w]) / secs], dtype=torch.float64, device=dev)
    big = torch.tensor([peak_alloc, peak_resv, retries], dtype=torch.float64, device=dev)
    dist.all_reduce(mine)
    dist.all_reduce(big, op=dist.ReduceOp.MAX)
    mine /= ws
    res = dict(size=a.size, ws=ws, seq=a.seq, mbs=a.mbs, ac=a.ac, pad=a.pad, liger=a.liger, tie=a.tie,
               attn_mask=a.attn_mask, device=a.device, params=total, init_s=round(init_s, 1),
               steps=a.steps, measured_steps=len(times[w]), step_s=round(float(np.median(times[w])), 4),
               loss_tok_s_gpu=round(float(mine[0])), real_tok_s_gpu=round(float(mine[1])),
               tok_s_gpu=round(float(mine[2])), mfu=round(float(mine[3]) / a.peak, 4),
               fill=round(float(mine[1] / mine[2]), 4), loss_share=round(float(mine[0] / mine[2]), 4),
               peak_alloc_GiB=round(float(big[0]), 2), peak_reserved_GiB=round(float(big[1]), 2),
               retries=int(big[2]), final_loss=round(float(out.loss.detach()), 4), examples=n,
               alloc_conf=os.environ.get("PYTORCH_CUDA_ALLOC_CONF", ""))
    if rank == 0:
        print(json.dumps(res), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
