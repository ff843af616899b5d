"""Time loading a Hugging Face checkpoint into a sharded model, against the broadcast anchor.

  python benchmarks/bench_load.py write --shape qwen3-30b-a3b --layers 12 --out /tmp/ckpt
  torchrun --standalone --nproc_per_node N benchmarks/bench_load.py load --path /tmp/ckpt

`write` creates a checkpoint of the given shape with arbitrary values (per-expert tensors, 5 GB shards); the files
are then in the page cache, as the issue's target counts. `load` builds the model on meta, shards it over the GPUs,
and times shardfit's loader (each rank reads only its rows/experts from the safetensors files), reporting seconds,
GB/s, GPU memory after the load per rank (balance) and peak host RSS.
"""

from __future__ import annotations

import argparse
import json
import resource
import time
from pathlib import Path

import torch

SHAPES = {
    "qwen3-30b-a3b": dict(model_type="qwen3_moe", vocab_size=151936, hidden_size=2048, intermediate_size=6144,
                          num_attention_heads=32, num_key_value_heads=4, head_dim=128, num_experts=128,
                          num_experts_per_tok=8, moe_intermediate_size=768, norm_topk_prob=True,
                          max_position_embeddings=40960, rms_norm_eps=1e-6, rope_theta=1e6, tie_word_embeddings=False),
    "llama3-8b": dict(model_type="llama", vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                      num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=8192, rms_norm_eps=1e-5,
                      rope_theta=500000.0, tie_word_embeddings=False),
}


def pattern(shape) -> torch.Tensor:
    """Row r holds (r % 251) / 256 (exact in bf16): a row or chunk loaded into the wrong place is caught."""
    rows = torch.arange(shape[0] if len(shape) else 1, dtype=torch.float32).remainder_(251).div_(256)
    return rows.view(-1, *([1] * (len(shape) - 1))).expand(shape).to(torch.bfloat16).reshape(shape)


def normal(shape, name: str) -> torch.Tensor:
    """Trainable values: norms at 1, everything else N(0, 0.02) (for the load-train-export run)."""
    if name.endswith("norm.weight"):
        return torch.ones(shape, dtype=torch.bfloat16)
    return (torch.randn(shape) * 0.02).to(torch.bfloat16)


def write(shape: str, layers: int, out: Path, init: str = "pattern") -> None:
    from safetensors.torch import save_file

    from shardfit.config import load_config
    from shardfit.models import build_model
    from shardfit.weights.hf_load import STACKED, expert_key

    hf = {**SHAPES[shape], "num_hidden_layers": layers}
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(hf))
    cfg = load_config(None, [f"--model.path={out}", "--data.seq_len=128"])
    with torch.device("meta"):
        model = build_model(cfg.model)
    tensors = []
    for name, p in model.named_parameters():
        if STACKED.match(name):
            tensors += [(expert_key(name, e), p.shape[1:]) for e in range(p.shape[0])]
        else:
            tensors.append((name, p.shape))
    shards, cur, size, weight_map = [], {}, 0, {}
    for name, shape_ in tensors:
        t = pattern(shape_) if init == "pattern" else normal(shape_, name)
        if cur and size + t.nbytes > 5e9:
            shards.append(cur)
            cur, size = {}, 0
        cur[name] = t
        size += t.nbytes
    shards.append(cur)
    total = 0
    for i, shard in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(out / fname), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(shard, fname))
        total += sum(t.nbytes for t in shard.values())
    (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": total},
                                                                  "weight_map": weight_map}))
    print(json.dumps({"written": str(out), "tensors": len(tensors), "bytes_GB": round(total / 1e9, 1)}))


def load(path: Path) -> None:
    import torch.distributed as dist

    from shardfit.config import load_config
    from shardfit.models import build_model
    from shardfit.parallel import init_distributed, parallelize
    from shardfit.parallel.layout import ParallelLayout
    from shardfit.weights.hf_load import load_hf_checkpoint

    info = init_distributed("cuda")
    cfg = load_config(None, [f"--model.path={path}", "--data.seq_len=128"])
    with torch.device("meta"):
        model = build_model(cfg.model).to(torch.bfloat16)
    layout = ParallelLayout.from_config(cfg, info.world_size, info.rank)
    parallelize(model, layout, parallel=cfg.parallel, compute=cfg.compute, lora=cfg.lora, quantize=cfg.model.quantize,
                device=info.device, seed=0, init=False)
    dist.barrier()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    res = load_hf_checkpoint(model, path)
    torch.cuda.synchronize()
    dist.barrier()
    dt = time.perf_counter() - t0
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    ok = True
    for p in model.parameters():
        local = p.to_local()
        if not local.numel():
            continue
        row0 = compute_local_shape_and_global_offset(p.shape, p.device_mesh, p.placements)[1][0]
        if local.dim() == 3:  # stacked experts: each expert tensor restarts its row count
            want = pattern(local.shape[1:]).to(local.device).expand_as(local)
        else:
            want = pattern((row0 + local.shape[0], *local.shape[1:]))[row0:].to(local.device)
        ok &= bool(torch.equal(local, want))
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    stats = torch.tensor([res.bytes, torch.cuda.memory_allocated(), rss, ok], dtype=torch.float64, device=info.device)
    rows = [torch.zeros_like(stats) for _ in range(info.world_size)]
    dist.all_gather(rows, stats)
    if info.rank == 0:
        total = sum(r[0].item() for r in rows)
        alloc = [r[1].item() / 2**30 for r in rows]
        print(json.dumps({"system": "shardfit load", "ws": info.world_size, "load_s": round(dt, 2),
                          "bytes_GB": round(total / 1e9, 1), "GBps": round(total / 1e9 / dt, 2),
                          "gpu_alloc_GiB_per_rank": [round(a, 2) for a in alloc],
                          "imbalance": round(max(alloc) / min(alloc) - 1, 4),
                          "values_correct": all(r[3].item() == 1 for r in rows),
                          "peak_host_rss_GiB_per_rank": [round(r[2].item() / 2**20, 1) for r in rows],
                          "rank0": {"tensors": res.tensors, "reads": res.reads, "threads": res.threads,
                                    "plan_s": round(res.plan_s, 3), "read_s": round(res.read_s, 3)},
                          "torch": torch.__version__}), flush=True)
    dist.destroy_process_group()


def probe(path: Path, threads: int) -> None:
    """Where loading time goes, without the model: this rank's 1/world of every shard file read with preadv into
    pinned buffers by `threads` threads (page-cache copy rate), then a pinned host-to-device copy rate."""
    import os
    from concurrent.futures import ThreadPoolExecutor

    import torch.distributed as dist

    from shardfit.parallel import init_distributed

    info = init_distributed("cuda")
    files = sorted(path.glob("*.safetensors"))
    chunk = 32 << 20
    jobs = []
    for f in files:
        size = f.stat().st_size
        lo, hi = size * info.rank // info.world_size, size * (info.rank + 1) // info.world_size
        jobs += [(f, o, min(chunk, hi - o)) for o in range(lo, hi, chunk)]
    t0 = time.perf_counter()
    bufs = [torch.empty(chunk, dtype=torch.uint8, pin_memory=True) for _ in range(threads)]
    pin_s = time.perf_counter() - t0

    def work(i):
        fds, n = {}, 0
        for f, off, ln in jobs[i::threads]:
            fd = fds.get(f) or fds.setdefault(f, os.open(f, os.O_RDONLY))
            n += os.preadv(fd, [memoryview(bufs[i][:ln].numpy())], off)
        for fd in fds.values():
            os.close(fd)
        return n

    dist.barrier()
    t0 = time.perf_counter()
    with ThreadPoolExecutor(threads) as pool:
        nread = sum(pool.map(work, range(threads)))
    read_s = time.perf_counter() - t0
    big = torch.empty(1 << 30, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty_like(big, device=info.device)
    dev.copy_(big, non_blocking=True)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(4):
        dev.copy_(big, non_blocking=True)
    torch.cuda.synchronize()
    h2d = 4 * big.numel() / (time.perf_counter() - t0) / 1e9
    print(json.dumps({"probe": "read", "rank": info.rank, "threads": threads, "GB": round(nread / 1e9, 2),
                      "read_GBps": round(nread / 1e9 / read_s, 2), "pin_alloc_s": round(pin_s, 3),
                      "h2d_GBps": round(h2d, 1)}), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("what", choices=["write", "load", "probe"])
    ap.add_argument("--init", default="pattern", choices=["pattern", "normal"])
    ap.add_argument("--threads", type=int, default=8)
    ap.add_argument("--shape", default="qwen3-30b-a3b", choices=sorted(SHAPES))
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--out", "--path", dest="path", default="/tmp/ckpt")
    a = ap.parse_args()
    if a.what == "write":
        write(a.shape, a.layers, Path(a.path), a.init)
    elif a.what == "probe":
        probe(Path(a.path), a.threads)
    else:
        load(Path(a.path))
