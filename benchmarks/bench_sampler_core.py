"""Issue 36: the new sampler (src/shardfit/sampling) on one GPU, each of its decode paths against the decode roofline.

  python benchmarks/bench_sampler_core.py --rows 16,64,256 --prompt 512 --new 256 --out OUT.json
  python benchmarks/bench_sampler_core.py --shape tiny --device cpu --rows 2,4 --prompt 16 --new 8   # a CPU check

The model is a plain CausalLM of the shape (benchmarks/rl_worker_setup.py SHAPES: the Qwen3-8B one by default),
random weights, bf16 (fp32 on the CPU), as the Sampler takes it (no FSDP, no LoRA). Per row count, one request of
`rows` samples of one random prompt, each forced to --new tokens (no stop token: random weights), temperature 1,
through each path of --paths: gather+graphs, triton+graphs (the paged decode kernel: the Sampler's default on CUDA),
triton+graphs+torchdraw (the draw as torch ops instead of kernels/gumbel_draw.py), triton+graphs+fusedops (RMSNorm
and RoPE through kernels/rms_norm.py and kernels/rope.py), gather+eager, flex+eager. Each path runs the request
twice and times the second (the first captures its graphs and compiles FlexAttention). tokens/s counts the new
tokens over the whole call (the prompt's one prefill included). Roofline as bench_sampling.py's: the weights read
once a step plus the KV cache held (mean context prompt + new / 2), at the measured copy bandwidth.
Prints one JSON line a run and a table; --out: one JSON with `decode_roofline_fraction` per path and row count.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "src"))

from bench_sampling import roofline_fractions  # noqa: E402
from rl_worker_setup import SHAPES, moe_overrides  # noqa: E402

PATHS = {"gather+graphs": dict(attention="gather", cuda_graphs=True),
         "triton+graphs": dict(attention="triton", cuda_graphs=True),
         "triton+graphs+torchdraw": dict(attention="triton", cuda_graphs=True, fused_draw=False),
         "triton+graphs+fusedops": dict(attention="triton", cuda_graphs=True, fused_ops=True),
         "gather+eager": dict(attention="gather", cuda_graphs=False),
         "flex+eager": dict(attention="flex", cuda_graphs=False)}


def build(shape: str, device: str, max_len: int):
    import torch

    from shardfit.config import load_config
    from shardfit.models import build_model

    over = moe_overrides(6, False) if shape == "moe6" else SHAPES[shape]  # moe6: Qwen3-30B-A3B, 6 of 48 layers
    cfg = load_config(None, [*over, f"--model.max_seq_len={max_len}", f"--data.seq_len={max_len}"]).model
    with torch.device(device):
        model = build_model(cfg)
    model.init_weights(0)
    model.to(torch.bfloat16 if device == "cuda" else torch.float32).eval()
    model.init_buffers_fp32()
    return model


def timed(model, path: dict, rows: int, prompt: list[int], new: int, device: str) -> tuple[float, int, str]:
    import torch

    from shardfit.sampling import Sampler, SampleRequest, SamplingParams

    kv = None if device == "cuda" else -(-(len(prompt) + new) // 16) * rows
    sampler = Sampler(model, kv_blocks=kv, max_rows=rows, **path)
    req = SampleRequest(prompt, SamplingParams(new, temperature=1.0, seed=0), num_samples=rows)
    sampler.run([req])  # warm-up: graphs captured, FlexAttention compiled
    if device == "cuda":
        torch.cuda.synchronize()
    t = time.perf_counter()
    [res] = sampler.run([req])
    if device == "cuda":
        torch.cuda.synchronize()
    dt = time.perf_counter() - t
    line = sampler.describe()
    del sampler
    if device == "cuda":
        torch.cuda.empty_cache()
    return dt, sum(len(s.tokens) for s in res.samples), line


def profile(model, path: dict, rows: int, prompt: list[int], new: int, out_dir: str) -> dict:
    """One request of `rows` samples x `new` tokens under torch.profiler after a warm-up: the kernels' share of the
    wall time (where the rest goes: the host between replays) and the top kernels by GPU time, as a table in
    OUT_DIR/profile_<path>_<rows>.txt."""
    import torch
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    from shardfit.sampling import Sampler, SampleRequest, SamplingParams

    kv = None if torch.cuda.is_available() else -(-(len(prompt) + new) // 16) * rows
    sampler = Sampler(model, kv_blocks=kv, max_rows=rows, **path)
    req = SampleRequest(prompt, SamplingParams(new, temperature=1.0, seed=0), num_samples=rows)
    cuda = torch.cuda.is_available()
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    sampler.run([req])
    sync()
    with torch_profile(activities=[ProfilerActivity.CPU] + [ProfilerActivity.CUDA] * cuda) as prof:
        t = time.perf_counter()
        sampler.run([req])
        sync()
        wall = time.perf_counter() - t
    del sampler
    events = prof.key_averages()

    def gpu(e):  # torch >= 2.4 names it device time; older cuda time
        return getattr(e, "self_device_time_total", None) or getattr(e, "self_cuda_time_total", 0)

    kernels = sorted((e for e in events if gpu(e) > 0), key=gpu, reverse=True)
    busy = sum(gpu(e) for e in kernels) / 1e6
    name = f"{out_dir}/profile_{'_'.join(f'{k}-{v}' for k, v in path.items())}_{rows}.txt"
    Path(name).write_text(events.table(sort_by="self_cuda_time_total", row_limit=25, max_name_column_width=60))
    return {"rows": rows, "new": new, "wall_s": wall, "kernel_s": busy, "gpu_busy": busy / wall,
            "ms_per_step": 1e3 * wall / new,
            "top": [(e.key[:60], round(gpu(e) / 1e3, 2), e.count) for e in kernels[:8]]}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="8b", choices=sorted(SHAPES) + ["moe6"])
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    ap.add_argument("--rows", default="16,64,256")
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--new", type=int, default=256)
    ap.add_argument("--paths", default=",".join(PATHS))
    ap.add_argument("--out", default="")
    ap.add_argument("--profile", default="", help="ROWS[,ROWS]: after the timings, one run of each path per ROWS "
                    "profiled (--profile-new tokens): GPU-busy share and top kernels (tables beside --out)")
    ap.add_argument("--profile-new", type=int, default=48)
    a = ap.parse_args()
    import torch

    model = build(a.shape, a.device, a.prompt + a.new + 16)
    m = model.cfg
    params = sum(p.numel() for p in model.parameters())
    from shardfit.models.moe import Experts

    experts = sum(p.numel() for mod in model.modules() if isinstance(mod, Experts) for p in mod.parameters())
    bw = None
    if a.device == "cuda":
        from bench_sampling import copy_bandwidth

        bw = copy_bandwidth()
        print(json.dumps({"copy_bandwidth_TBps": bw / 1e12}), flush=True)
    prompt = torch.randint(10, m.vocab_size - 1, (a.prompt,), generator=torch.Generator().manual_seed(0)).tolist()
    out = []
    for rows in [int(r) for r in a.rows.split(",")]:
        for name in [p for p in a.paths.split(",") if p]:
            try:
                dt, n, line = timed(model, PATHS[name], rows, prompt, a.new, a.device)
            except Exception as e:  # one path failing (e.g. flex on an old torch) leaves the others measured
                out.append({"system": f"sampler/{name}", "rows": rows, "error": f"{type(e).__name__}: {e}"[:300]})
                print(json.dumps(out[-1]), flush=True)
                continue
            row = {"system": f"sampler/{name}", "rows": rows, "tokens": n, "seconds": dt, "tok_s": n / dt,
                   "kv_cache": line}
            if bw is not None:
                from bench_sampling import roofline

                # an MoE step reads the experts its rows route to: E (1 - (1 - k/E)^rows) of E a layer if the
                # router spreads uniformly (random weights: near enough), not every expert
                read = params - experts
                if experts:
                    read += experts * (1 - (1 - m.experts_per_token / m.n_experts) ** rows)
                roof = roofline(rows, a.prompt + a.new / 2, bw, read, m.n_layers, m.n_kv_heads,
                                m.head_dim or m.dim // m.n_heads)
                row.update(roofline_tok_s=roof, fraction=n / dt / roof,
                           peak_gib=torch.cuda.max_memory_allocated() / 2 ** 30)
            out.append(row)
            print(json.dumps(row), flush=True)
    summary = {"gpu": torch.cuda.get_device_name() if a.device == "cuda" else "cpu", "shape": a.shape,
               "prompt": a.prompt, "new": a.new,
               "decode_roofline_fraction": roofline_fractions(out)}
    profiles = []
    for rows in [int(r) for r in a.profile.split(",") if r]:
        for name in [p for p in a.paths.split(",") if p]:
            try:
                profiles.append({"path": name, **profile(model, PATHS[name], rows, prompt, a.profile_new,
                                                         str(Path(a.out or "x").resolve().parent))})
            except Exception as e:
                profiles.append({"path": name, "rows": rows, "error": f"{type(e).__name__}: {e}"[:300]})
            print(json.dumps(profiles[-1]), flush=True)
    if profiles:
        summary["profile"] = profiles
    if a.out:
        Path(a.out).write_text(json.dumps({"summary": summary, "rows": out}, indent=1))
    print(f"\n{'system':24} {'rows':>5} {'tok/s':>9} {'fraction':>8}")
    for r in out:
        print(f"{r['system']:24} {r['rows']:5d} " + (f"{r['tok_s']:9,.0f} {r.get('fraction', float('nan')):8.3f}"
                                                      if "tok_s" in r else r["error"]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
