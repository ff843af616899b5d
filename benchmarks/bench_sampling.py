"""Issue 36: the new sampler and today's, against the decode roofline and transformers. One GPU, Qwen3-8B shape,
random weights, bf16.

  python benchmarks/bench_sampling.py --new-rows 16,64,256 --rows 16,64 --prompt 512 --new 256 --out OUT.json \
      [--new-variants attention=gather+cuda_graphs=1,attention=flex+cuda_graphs=1] [--hf hf,hf-static,hf-cb]

new: `Engine.sample` (sampling/: the decode model over the Engine's weights with the live adapter in its bank, a
paged KV cache, continuous batching, the decode step as CUDA graphs), `rows` distinct prompts of one sample each;
its decode rate is (max_tokens=new call) - (max_tokens=1 call), so that the prefill and the set-up are out of it.

shardfit: `shardfit serve`'s sampler as it runs today (sampling/fsdp_reference.py `sample` on the Engine's sharded model
inside `engine.gathered_pass()`, as the executor calls it): one request of `rows` samples of one prompt, each forced to
`--new` tokens (no stop token: random weights), temperature 1. The Engine is the RL server's: LoRA r=16 on every
linear layer of a frozen bf16 base (`serve --lora.rank=16`).
Anchors in the same call: transformers' `generate` (dynamic cache), with the static cache (compiled decode) and
`generate_batch` (its continuous batching), through the shared anchor script (--anchor, hf_sampling.py), the same
rows, prompt length and new tokens.
Roofline: a decode step reads every weight once (bf16) plus the KV cache held; at the card's measured copy bandwidth
(a 4 GiB device-to-device copy timed here) that bounds tokens/s at rows / ((2 x params + KV bytes) / bandwidth), KV
counted at the mean context prompt + new / 2. Prints a table last; one JSON with every row.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from rl_worker_setup import SHAPES, lora_overrides  # noqa: E402


def copy_bandwidth() -> float:
    """Bytes/s of a device-to-device copy (read + write counted), the best of 5 over 4 GiB."""
    import torch

    n = 1 << 31  # 2 GiB each way: 4 GiB moved a copy
    a, b = torch.empty(n, dtype=torch.uint8, device="cuda"), torch.empty(n, dtype=torch.uint8, device="cuda")
    best = float("inf")
    for _ in range(5):
        torch.cuda.synchronize()
        t = time.perf_counter()
        b.copy_(a)
        torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t)
    del a, b
    torch.cuda.empty_cache()
    return 2 * n / best


def roofline(rows: int, context: float, bandwidth: float, params: int, layers: int, kv_heads: int,
             head_dim: int) -> float:
    kv = rows * context * layers * 2 * kv_heads * head_dim * 2  # K and V, bf16
    return rows / ((2 * params + kv) / bandwidth)


def start_engine(a):
    from shardfit.engine import Engine

    ov = [*SHAPES["8b"], "--train.device=cuda", "--logging.run_dir=", "--logging.progress=none",
          f"--model.max_seq_len={a.prompt + a.new + 64}", f"--data.seq_len={a.prompt + a.new}",
          *lora_overrides(16)]
    return Engine.start(overrides=ov)


def steady_window(sampler, rows: int, answered, sync) -> dict:
    """The decode rate at `rows` rows of a Sampler whose requests are submitted: stepped until every row decodes
    (every prompt prefilled, none waiting), then timed over the decode steps that run all `rows` rows (until the
    first row ends): rows x steps over their seconds, with their mean context (the rows' mean position over the
    window). The Sampler's own steps (its flushes included); the prefill phase, where rows join a prompt a step, and
    the tail, where they leave, are outside the window. A window needs more new tokens than the prefill phase has
    steps; `answered()` (any request answered already) or an idle sampler before it: {"error": ...}."""
    sched = sampler.sched
    while len(sched.active) < rows or sched.waiting or sched.prefilling:
        if answered() or sched.idle:
            return {"error": f"no step ran all {rows} rows: a row ended during the prefill phase (more new tokens, "
                             "or a larger prefill_chunk)"}
        sampler.step()
    sync()
    t0, s0 = time.perf_counter(), sched.step
    c0 = sum(len(r.request.req.prompt) + r.n_gen - 1 + (s0 - r.join_step) for r in sched.active) / rows
    while len(sched.active) == rows:
        sampler.step()
    sync()
    dt, steps = time.perf_counter() - t0, sched.step - s0
    return {"tok_s": rows * steps / dt, "window_steps": steps, "window_s": dt, "context": c0 + (steps - 1) / 2}


def roofline_fractions(rows: list[dict]) -> dict[str, float]:
    """The JSON summary's decode_roofline_fraction: {"system@rows": fraction} of every measured row."""
    return {f"{r['system']}@{r['rows']}": round(r["fraction"], 4) for r in rows if "fraction" in r}


def new_rows(a, engine, rows_list: list[int], bandwidth: float, variant: str) -> list[dict]:
    """The new sampler (Engine.sample: the decode model over the Engine's weights, the live LoRA adapter in its bank,
    paged KV, continuous batching, CUDA graphs): `rows` distinct prompts, one sample each, `--new` tokens forced.
    The whole call timed (prefill and all: the rate a caller sees), then the same prompts through Engine.sample_run
    (the same Sampler, kept) with the decode rate over its steady window (steady_window: the steps that run all
    `rows` rows)."""
    import torch

    from shardfit.sampling.params import SamplingParams

    opts = dict(x.split("=", 1) for x in variant.split("+") if "=" in x)
    opts = {k: (v == "1" if k == "cuda_graphs" else int(v) if v.isdigit() else v) for k, v in opts.items()}
    m = engine.cfg.model
    params = sum(p.numel() for n, p in engine.model.named_parameters() if "lora_" not in n)
    g = torch.Generator().manual_seed(1)
    out = []
    for rows in rows_list:
        prompts = torch.randint(10, m.vocab_size - 1, (rows, a.prompt), generator=g).tolist()
        sp = SamplingParams(max_tokens=a.new, temperature=1.0, seed=0)
        engine.sample([p[:64] for p in prompts], SamplingParams(max_tokens=4, temperature=1.0, seed=0), **opts)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        t = time.perf_counter()
        got = engine.sample(prompts, sp, **opts)
        torch.cuda.synchronize()
        seconds = time.perf_counter() - t
        n = sum(len(s.tokens) for r in got for s in r.samples)
        run = engine.sample_run(**opts)
        run.submit(prompts, sp)
        window = steady_window(run.sampler, rows, lambda run=run: bool(run.collect()), torch.cuda.synchronize)
        while run.busy:
            run.step()
            run.collect()
        run.close()
        row = {"system": f"shardfit-new {variant}", "rows": rows, "tokens": n, "seconds": seconds,
               "call_tok_s": n / seconds, **window, "peak_gib": torch.cuda.max_memory_allocated() / 2**30}
        if "tok_s" in window:
            roof = roofline(rows, window["context"], bandwidth, params, m.n_layers, m.n_kv_heads, m.head_dim or
                            m.dim // m.n_heads)
            row.update(roofline_tok_s=roof, fraction=window["tok_s"] / roof)
        out.append(row)
        print(json.dumps(out[-1]), flush=True)
    return out


def shardfit_rows(a, engine, rows_list: list[int], bandwidth: float) -> list[dict]:
    import torch

    from shardfit.sampling.fsdp_reference import SampleArgs, sample

    m = engine.cfg.model
    params = sum(p.numel() for n, p in engine.model.named_parameters() if "lora_" not in n)
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(10, m.vocab_size - 1, (a.prompt,), generator=g).tolist()
    out = []
    for rows in rows_list:
        args = SampleArgs(prompt, num_samples=rows, max_tokens=a.new, temperature=1.0, seed=0)
        warm = SampleArgs(prompt[:64], num_samples=rows, max_tokens=4, temperature=1.0)
        with engine.gathered_pass():
            sample(engine.model, warm, torch.bfloat16, engine.device)
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            t = time.perf_counter()
            got, _ = sample(engine.model, args, torch.bfloat16, engine.device)
            torch.cuda.synchronize()
            dt = time.perf_counter() - t
        n = sum(len(s.tokens) for s in got)
        roof = roofline(rows, a.prompt + a.new / 2, bandwidth, params, m.n_layers, m.n_kv_heads, m.head_dim or
                        m.dim // m.n_heads)
        out.append({"system": "shardfit-serve-today", "rows": rows, "tokens": n, "seconds": dt, "tok_s": n / dt,
                    "roofline_tok_s": roof, "fraction": n / dt / roof,
                    "peak_gib": torch.cuda.max_memory_allocated() / 2**30})
        print(json.dumps(out[-1]), flush=True)
    return out


def hf_rows(a, rows_list: list[int], bandwidth: float) -> list[dict]:
    out = []
    for system in [s for s in a.hf.split(",") if s]:
        for rows in rows_list:
            cmd = [sys.executable, a.anchor, "--shape", "8b", "--system", system, "--prompt", str(a.prompt),
                   "--samples", str(rows), "--requests", "1", "--new", str(a.new), "--bandwidth", str(bandwidth)]
            try:
                p = subprocess.run(cmd, capture_output=True, text=True, timeout=a.hf_timeout)
                line = [x for x in p.stdout.splitlines() if x.startswith("{")]
                row = json.loads(line[-1]) if line else {"system": system, "rows": rows,
                                                         "error": p.stderr.strip().splitlines()[-1:]}
            except subprocess.TimeoutExpired:
                row = {"system": system, "rows": rows, "error": f"over {a.hf_timeout} s"}
            out.append(row)
            print(json.dumps(row), flush=True)
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="16,64")
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--new", type=int, default=256)
    ap.add_argument("--today", type=int, default=1, help="1: today's serve sampler at --rows too")
    ap.add_argument("--new-rows", default="16,64,256", help="the new sampler's row counts")
    ap.add_argument("--new-variants", default="attention=gather+cuda_graphs=1",
                    help="the new sampler's option sets, comma-separated (Sampler options joined by +)")
    ap.add_argument("--hf", default="hf,hf-static,hf-cb")
    ap.add_argument("--hf-rows", default="64", help="the anchors' row counts (a subset: each builds the model anew)")
    ap.add_argument("--hf-timeout", type=int, default=150)
    ap.add_argument("--anchor", default=str(HERE.parent / ".anchors" / "hf_sampling.py"))
    ap.add_argument("--out", default="")
    a = ap.parse_args()
    os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    rows_list = [int(r) for r in a.rows.split(",")]
    bw = copy_bandwidth()
    print(json.dumps({"copy_bandwidth_TBps": bw / 1e12}), flush=True)
    engine = start_engine(a)
    rows = []
    for variant in [v for v in a.new_variants.split(",") if v]:
        rows += new_rows(a, engine, [int(r) for r in a.new_rows.split(",")], bw, variant)
    if a.today:
        rows += shardfit_rows(a, engine, rows_list, bw)
    import torch

    del engine

    gpu = torch.cuda.get_device_name()
    torch.cuda.empty_cache()
    rows += hf_rows(a, [int(r) for r in a.hf_rows.split(",")], bw)
    summary = {"gpu": gpu, "copy_bandwidth_TBps": bw / 1e12, "prompt": a.prompt, "new": a.new,
               "decode_roofline_fraction": roofline_fractions(rows)}
    if a.out:
        Path(a.out).write_text(json.dumps({"summary": summary, "rows": rows}, indent=1))
    print(f"\n{'system':24} {'rows':>5} {'tok/s':>9} {'roofline':>9} {'fraction':>8} {'peak GiB':>8}")
    for r in rows:
        if "tok_s" in r:
            print(f"{r['system']:24} {r['rows']:5d} {r['tok_s']:9,.0f} {r['roofline_tok_s']:9,.0f} "
                  f"{r['fraction']:8.3f} {r.get('peak_gib', 0):8.1f}")
        else:
            print(f"{r['system']:24} {r['rows']:5d} {r.get('error')}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
