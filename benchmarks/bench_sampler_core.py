"""Issue 36: the new sampler (src/shardfit/sampling) on one GPU, each of its decode paths against the decode roofline.

  python benchmarks/bench_sampler_core.py --rows 16,64,256 --prompt 512 --new 256 --out OUT.json
  python benchmarks/bench_sampler_core.py --shape tiny --device cpu --rows 2,4 --prompt 16 --new 8   # a CPU check

The model is a plain CausalLM of the shape (benchmarks/rl_worker_setup.py SHAPES: the Qwen3-8B one by default), random
weights, bf16 (fp32 on the CPU), as the Sampler takes it (no FSDP); --lora R: a LoRA bank (sampling/lora_bank.py, 4
slots of rank R on the 7 linear layers of every block, as Engine.sample builds it) with one random adapter in slot 0
that every row decodes with; --fp8-base: the blocks' linear layers stored in FP8 as an FP8-base LoRA run's
(model.quantize=fp8), their matmuls on FP8 tensor cores. Per row count, `rows` rows: rows / --samples random prompts,
--samples continuations each (1, the default: every row its own prompt, as bench_sampling.py's Engine rows; 16: an RL
group, the prompt's blocks shared by its rows), each forced to --new tokens (no stop token: random weights),
temperature 1, through each path of --paths: gather+graphs, triton+graphs (the paged decode kernel and, the Sampler's
default on CUDA, RMSNorm and RoPE through kernels/rms_norm.py and kernels/rope.py), triton+graphs+torchops (those two
as torch ops), triton+graphs+fusedall (fused_ops="all": the q/k norms and RoPE in one launch, SwiGLU in one),
triton+graphs+torchdraw (the draw as torch ops instead of kernels/gumbel_draw.py), triton+graphs+torchlora (--lora's
adapters through kernels/multi_lora.py's torch ops, not kernels/multi_lora_decode.py), triton+graphs+grouped (the
decode kernel with q|k|v and gate|up sharing one shrink: 10 launches a layer, not 14), gather+eager, flex+eager. Each
path runs once untimed (graphs captured, FlexAttention compiled), then once timed as a whole (the call's tokens/s:
prefill and all), then once more with the decode rate timed over the steps that run all `rows` rows (`steady`: after
the last prompt's prefill, until the first row ends; rows x steps over their seconds). Prompts prefill one chunk a
step, each followed by a decode step, so rows join one prompt (--prefill-chunk tokens) at a time: --new must exceed
the prefill phase's steps for such a window (256 distinct 512-token prompts: 256 steps at the default chunk; use --new
512, or a larger chunk). Session 21's first figures took the difference of two calls instead (max_tokens 256 minus 1,
then 256 minus 128): the rows' staggered starts and ends put fewer rows than `rows` into the steps timed, and one call
per half erred by up to 45%. Roofline as bench_sampling.py's, over the bytes a step of the window must read: the
weights once plus the KV cache held, each prompt's blocks once (shared by its samples) and each row's own new part (at
the window's mean position), at the measured copy bandwidth; an MoE step reads only the experts its rows route to
(below).
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

from bench_sampling import roofline_fractions, steady_window  # noqa: E402
from rl_worker_setup import SHAPES, moe_overrides  # noqa: E402

PATHS = {"gather+graphs": dict(attention="gather", cuda_graphs=True),
         "triton+graphs": dict(attention="triton", cuda_graphs=True),
         "triton+graphs+torchops": dict(attention="triton", cuda_graphs=True, fused_ops=False),
         # the q/k norms and RoPE in one launch (kernels/rope.py's qk_rope), SwiGLU in one (kernels/swiglu.py): the
         # default since session 23; +fusednorms keeps the norms' and RoPE's own kernels alone (fused_ops=True)
         "triton+graphs+fusedall": dict(attention="triton", cuda_graphs=True, fused_ops="all"),
         "triton+graphs+fusednorms": dict(attention="triton", cuda_graphs=True, fused_ops=True),
         "triton+graphs+torchdraw": dict(attention="triton", cuda_graphs=True, fused_draw=False),
         # --lora's rows through multi_lora's torch ops instead of kernels/multi_lora_decode.py
         "triton+graphs+torchlora": dict(attention="triton", cuda_graphs=True, lora_kernel=False),
         # --lora's rows through the decode kernel with q|k|v and gate|up sharing one shrink (lora_bank's groups)
         "triton+graphs+grouped": dict(attention="triton", cuda_graphs=True, lora_group=True),  # the default now
         "triton+graphs+ungrouped": dict(attention="triton", cuda_graphs=True, lora_group=False),
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


def lora_bank(model, rank: int):
    """A bank of 4 slots of rank `rank` on the 7 linear layers of every block (Engine.sample's first bank), one random
    adapter (alpha 2 x rank) in slot 0."""
    import torch

    from shardfit.sampling.lora_bank import BANK_SLOTS, LoRABank

    names = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    targets = [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and n.endswith(names)]
    w = next(model.parameters())
    bank = LoRABank(model, targets, BANK_SLOTS, rank, w.dtype, w.device)
    g = torch.Generator(device=w.device).manual_seed(2)
    mods = dict(model.named_modules())
    adapters = {n: (torch.randn(rank, mods[n].in_features, generator=g, device=w.device) * 0.01,
                    torch.randn(mods[n].out_features, rank, generator=g, device=w.device) * 0.01) for n in targets}
    bank.load(0, adapters, 2.0)
    return bank


def requests(rows: int, samples: int, prompt_len: int, new: int, vocab: int, adapter: int) -> list:
    """rows / samples random prompts (seeded: every path decodes the same), `samples` continuations of each."""
    import torch

    from shardfit.sampling import SampleRequest, SamplingParams

    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(10, vocab - 1, (max(1, rows // samples), prompt_len), generator=g).tolist()
    return [SampleRequest(p, SamplingParams(new, temperature=1.0, seed=i), num_samples=samples, adapter=adapter)
            for i, p in enumerate(prompts)]


_DEFAULTS: dict = {}  # lora_bank's module defaults, read before a path changes them


def sampler_for(model, bank, path: dict, rows: int, reqs: list, device: str):
    """The Sampler of one path; lora_kernel=False (a benchmark switch, not a Sampler option): the bank's layers take
    the torch ops at every token count (lora_bank's kernel threshold set to 0 until the next path); lora_group:
    sibling layers (q|k|v, gate|up) share one shrink or not (lora_bank.GROUP_SIBLINGS, its default where not given)."""
    from shardfit.kernels.multi_lora_decode import MAX_TOKENS
    from shardfit.sampling import Sampler, lora_bank

    path = dict(path)
    lora_bank.MAX_TOKENS = MAX_TOKENS if path.pop("lora_kernel", True) else 0
    _DEFAULTS.setdefault("group", lora_bank.GROUP_SIBLINGS)
    lora_bank.GROUP_SIBLINGS = path.pop("lora_group", _DEFAULTS["group"])
    need = sum(-(-(len(r.prompt) + r.params.max_tokens) // 16) * r.num_samples for r in reqs)
    return Sampler(model, bank=bank, kv_blocks=None if device == "cuda" else need, max_rows=rows, **path)


def chunked(path: dict, prefill_chunk: int) -> dict:
    return {**path, "prefill_chunk": prefill_chunk} if prefill_chunk else path


def steady(sampler, reqs: list, rows: int, sync) -> dict:
    """`reqs` submitted, the decode rate at `rows` rows over its steady window (bench_sampling.steady_window), the
    requests then run to their end."""
    handles = [sampler.submit(r) for r in reqs]
    out = steady_window(sampler, rows, lambda: any(h.done for h in handles), sync)
    sampler.wait(handles)
    return out


def timed(model, bank, path: dict, rows: int, reqs: list, device: str) -> dict:
    """(Decode tokens/s at `rows` rows (steady), the whole call's tokens/s, its seconds, the KV line) of `reqs`
    through one path (module docstring)."""
    import torch

    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    sampler = sampler_for(model, bank, path, rows, reqs, device)
    sampler.run(reqs)  # warm-up: graphs captured, FlexAttention compiled
    sync()
    t = time.perf_counter()
    got = sampler.run(reqs)
    sync()
    seconds = time.perf_counter() - t
    n = sum(len(s.tokens) for res in got for s in res.samples)
    out = {"tokens": n, "seconds": seconds, "call_tok_s": n / seconds, **steady(sampler, reqs, rows, sync),
           "kv_cache": sampler.describe()}
    sampler = None  # its pool and graphs freed before the next path's
    if device == "cuda":
        torch.cuda.empty_cache()
    return out


def profile(model, bank, path: dict, rows: int, reqs: list, out_dir: str, tag: str) -> dict:
    """`reqs` (one prompt's `rows` samples x --profile-new tokens: its one prefill a small share of the time; with
    --profile-distinct the timed rows' prompts, whose prefill is then in the table) under
    torch.profiler after a warm-up: the kernels' share of the wall time (where the rest goes: the host between
    replays) and the top kernels by GPU time, as a table in OUT_DIR/profile_<path><tag>_<rows>.txt."""
    import torch
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    cuda = torch.cuda.is_available()
    sampler = sampler_for(model, bank, path, rows, reqs, "cuda" if cuda else "cpu")
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    new = reqs[0].params.max_tokens
    sampler.run(reqs)
    sync()
    with torch_profile(activities=[ProfilerActivity.CPU] + [ProfilerActivity.CUDA] * cuda) as prof:
        t = time.perf_counter()
        sampler.run(reqs)
        sync()
        wall = time.perf_counter() - t
    del sampler
    events = prof.key_averages()

    def gpu(e):  # torch >= 2.4 names it device time; older cuda time
        return getattr(e, "self_device_time_total", None) or getattr(e, "self_cuda_time_total", 0)

    kernels = sorted((e for e in events if gpu(e) > 0), key=gpu, reverse=True)
    busy = sum(gpu(e) for e in kernels) / 1e6
    name = f"{out_dir}/profile_{'_'.join(f'{k}-{v}' for k, v in path.items())}{tag.replace(' ', '_')}_{rows}.txt"
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
    ap.add_argument("--samples", type=int, default=1, help="continuations of each prompt (rows / samples prompts)")
    ap.add_argument("--lora", type=int, default=0, help="R: every row through a LoRA bank's adapter of rank R")
    ap.add_argument("--fp8-base", action="store_true", help="the blocks' linear layers stored in FP8 (model.quantize="
                    "fp8: adapters/fp8_base.py), as Engine.sample decodes an FP8-base run; the roofline reads them at "
                    "1 byte a weight")
    ap.add_argument("--prefill-chunk", type=int, default=0, help="the Sampler's prefill_chunk (0: its default)")
    ap.add_argument("--paths", default=",".join(PATHS))
    ap.add_argument("--out", default="")
    ap.add_argument("--profile", default="", help="ROWS[,ROWS]: after the timings, one run of each path per ROWS "
                    "profiled (--profile-new tokens): GPU-busy share and top kernels (tables beside --out)")
    ap.add_argument("--profile-new", type=int, default=48)
    ap.add_argument("--profile-distinct", action="store_true", help="profile rows of distinct prompts (as timed: "
                    "the prefill phase in the table) instead of one prompt's samples (the decode steps alone)")
    a = ap.parse_args()
    import torch

    model = build(a.shape, a.device, a.prompt + a.new + 16)
    m = model.cfg
    if a.fp8_base:
        from shardfit.adapters.fp8_base import FP8Linear
        from shardfit.adapters.quantized import apply_quantized

        linears = [n for n, mod in model.named_modules() if type(mod) is torch.nn.Linear and ".layers." in f".{n}"
                   and not n.endswith("mlp.gate")]
        print(json.dumps({"fp8_layers": apply_quantized(model, linears, FP8Linear)}), flush=True)
    # the weights a step reads, in bf16 parameters (the roofline's 2 bytes each): an FP8 base's storage at its bytes
    params = sum(p.numel() * p.element_size() for p in model.parameters()) // 2 if a.fp8_base else \
        sum(p.numel() for p in model.parameters())
    bank = lora_bank(model, a.lora) if a.lora else None
    from shardfit.models.moe import Experts

    experts = sum(p.numel() for mod in model.modules() if isinstance(mod, Experts) for p in mod.parameters())
    bw = None
    if a.device == "cuda":
        from bench_sampling import copy_bandwidth

        bw = copy_bandwidth()
        print(json.dumps({"copy_bandwidth_TBps": bw / 1e12}), flush=True)
    tag = ((f" x{a.samples}" if a.samples > 1 else "") + (f" lora{a.lora}" if a.lora else "")
           + (" fp8base" if a.fp8_base else "")
           + (f" chunk{a.prefill_chunk}" if a.prefill_chunk else ""))
    out = []
    for rows in [int(r) for r in a.rows.split(",")]:
        reqs = requests(rows, a.samples, a.prompt, a.new, m.vocab_size, 0 if bank is not None else -1)
        for name in [p for p in a.paths.split(",") if p]:
            try:
                row = {"system": f"sampler/{name}{tag}", "rows": rows,
                       **timed(model, bank, chunked(PATHS[name], a.prefill_chunk), rows, reqs, a.device)}
            except Exception as e:  # one path failing (e.g. flex on an old torch) leaves the others measured
                out.append({"system": f"sampler/{name}{tag}", "rows": rows, "error": f"{type(e).__name__}: {e}"[:300]})
                print(json.dumps(out[-1]), flush=True)
                continue
            if bw is not None and "tok_s" in row:
                from bench_sampling import roofline

                # an MoE step reads the experts its rows route to: E (1 - (1 - k/E)^rows) of E a layer if the
                # router spreads uniformly (random weights: near enough), not every expert
                read = params - experts
                if experts:
                    read += experts * (1 - (1 - m.experts_per_token / m.n_experts) ** rows)
                # the KV a step of the window reads: each prompt's blocks once, each row's own new part
                context = (len(reqs) * a.prompt + rows * (row["context"] - a.prompt)) / rows
                roof = roofline(rows, context, bw, read, m.n_layers, m.n_kv_heads, m.head_dim or m.dim // m.n_heads)
                row.update(roofline_tok_s=roof, fraction=row["tok_s"] / roof,
                           peak_gib=torch.cuda.max_memory_allocated() / 2 ** 30)
            out.append(row)
            print(json.dumps(row), flush=True)
    summary = {"gpu": torch.cuda.get_device_name() if a.device == "cuda" else "cpu", "shape": a.shape,
               "prompt": a.prompt, "new": a.new, "samples": a.samples, "lora": a.lora,
               "decode_roofline_fraction": roofline_fractions(out)}
    profiles = []
    for rows in [int(r) for r in a.profile.split(",") if r]:
        reqs = requests(rows, a.samples if a.profile_distinct else rows, a.prompt, a.profile_new, m.vocab_size,
                        0 if bank is not None else -1)
        for name in [p for p in a.paths.split(",") if p]:
            try:
                profiles.append({"path": name, **profile(model, bank, chunked(PATHS[name], a.prefill_chunk), rows, reqs,
                                                         str(Path(a.out or "x").resolve().parent), tag)})
            except Exception as e:
                profiles.append({"path": name, "rows": rows, "error": f"{type(e).__name__}: {e}"[:300]})
            print(json.dumps(profiles[-1]), flush=True)
    if profiles:
        summary["profile"] = profiles
    if a.out:
        Path(a.out).write_text(json.dumps({"summary": summary, "rows": out}, indent=1))
    print(f"\n{'system':34} {'rows':>5} {'tok/s':>9} {'fraction':>8} {'steps':>5} {'call tok/s':>10}")
    for r in out:
        print(f"{r['system']:34} {r['rows']:5d} " + (
            f"{r['tok_s']:9,.0f} {r.get('fraction', float('nan')):8.3f} {r['window_steps']:5d} {r['call_tok_s']:10,.0f}"
            if "tok_s" in r else r["error"]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
