# ruff: noqa -- Copied unchanged from ../shared/anchors/hf_fsdp2_qwen3moe.py (the issue-15 anchor) so that device calls carry it.
# Anchor: the recipe RL frameworks (SkyRL, verl) use for MoE: Hugging Face Qwen3MoeForCausalLM under FSDP2,
# fully_shard per decoder layer then the root, bf16 params / fp32 reduction, activation checkpointing per layer,
# random init, random tokens. --experts picks transformers' experts implementation (eager loops over the experts
# that received tokens; grouped_mm / batched_mm run all experts in one call). Prints one JSON line.
import os, json, time, argparse
import torch, torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard, MixedPrecisionPolicy
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

def main():
    p = argparse.ArgumentParser()
    p.add_argument("--layers", type=int, default=12); p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--mbs", type=int, default=1); p.add_argument("--steps", type=int, default=10)
    p.add_argument("--ac", default="full"); p.add_argument("--experts", default="grouped_mm")
    p.add_argument("--peak", type=float, default=989e12)
    a = p.parse_args()
    dist.init_process_group("nccl"); rank = dist.get_rank(); ws = dist.get_world_size()
    torch.cuda.set_device(rank % torch.cuda.device_count())
    mesh = init_device_mesh("cuda", (ws,))
    cfg = Qwen3MoeConfig(vocab_size=151936, hidden_size=2048, intermediate_size=6144, num_hidden_layers=a.layers,
                         num_attention_heads=32, num_key_value_heads=4, head_dim=128, num_experts=128,
                         num_experts_per_tok=8, moe_intermediate_size=768, norm_topk_prob=True,
                         max_position_embeddings=max(a.seq, 4096), rms_norm_eps=1e-6, rope_theta=1e6,
                         tie_word_embeddings=False, output_router_logits=False)
    cfg._attn_implementation = "sdpa"
    cfg._experts_implementation = a.experts
    t0 = time.time()
    with torch.device("meta"):
        model = Qwen3MoeForCausalLM(cfg)
    layers = model.model.layers
    if a.ac == "full":
        for i, l in enumerate(layers): layers[i] = checkpoint_wrapper(l)
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for i, l in enumerate(layers): fully_shard(l, mesh=mesh, mp_policy=mp, reshard_after_forward=i < len(layers) - 1)
    fully_shard(model, mesh=mesh, mp_policy=mp)
    model.to_empty(device="cuda")
    with torch.no_grad():
        for prm in model.parameters(): prm.normal_(0, 0.02)
    rot = model.model.rotary_emb
    inv = 1.0 / (1e6 ** (torch.arange(0, 128, 2, device="cuda", dtype=torch.float32) / 128))
    rot.inv_freq = inv
    if hasattr(rot, "original_inv_freq"): rot.original_inv_freq = inv
    init_s = time.time() - t0
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    total = sum(p.numel() for p in model.parameters())
    H, E, k, I, L = 2048, 128, 8, 768, a.layers
    attn = H * 32 * 128 + 2 * H * 4 * 128 + 32 * 128 * H  # q, k, v, o
    active = L * (attn + H * E + k * 3 * H * I) + cfg.vocab_size * H  # blocks (router + k experts) + output head
    flop_per_tok = 6 * active + 12 * L * 32 * 128 * a.seq
    times = []
    torch.cuda.reset_peak_memory_stats()
    try:
        for step in range(a.steps):
            torch.cuda.synchronize(); s = time.perf_counter()
            x = torch.randint(0, cfg.vocab_size, (a.mbs, a.seq), device="cuda")
            out = model(input_ids=x, labels=x)
            out.loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step(); opt.zero_grad(set_to_none=True)
            torch.cuda.synchronize(); times.append(time.perf_counter() - s)
    except torch.OutOfMemoryError:
        if rank == 0: print(json.dumps(dict(system="hf_fsdp2_qwen3moe", layers=L, mbs=a.mbs, oom=True, experts=a.experts)), flush=True)
        os._exit(0)
    st = torch.cuda.memory_stats()
    dt = sorted(times[3:])[len(times[3:]) // 2]
    tps = a.mbs * a.seq / dt
    if rank == 0:
        print(json.dumps(dict(system="hf_fsdp2_qwen3moe", experts=a.experts, ac=a.ac, ws=ws, layers=L, seq=a.seq,
              mbs=a.mbs, params_B=round(total / 1e9, 3), active_flop_per_tok=flop_per_tok, init_s=round(init_s, 1),
              step_s=round(dt, 3), tok_s_gpu=round(tps), mfu_active=round(tps * flop_per_tok / a.peak, 3),
              peak_alloc_GiB=round(torch.cuda.max_memory_allocated() / 2**30, 2),
              peak_reserved_GiB=round(torch.cuda.max_memory_reserved() / 2**30, 2), retries=st["num_alloc_retries"])), flush=True)
    dist.destroy_process_group()

if __name__ == "__main__":
    main()
