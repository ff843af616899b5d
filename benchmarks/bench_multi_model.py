"""Issue 35 item 2: K LoRA models trained in ONE pass over the shared base (engine/multi_model.py) against the same K
models run one after another (one pass each, the registry's swap between them), in one process and one call.

  python benchmarks/bench_multi_model.py --models 4 --out /tmp/mm.json            # tiny shapes on the CPU (machinery)
  python benchmarks/bench_multi_model.py --models 1,4,16 --datums 8 --length 1024 --out mm.json -- \\
      --model.dim=4096 --model.n_layers=36 --model.n_heads=32 --model.n_kv_heads=8 --model.ffn_dim=12288 \\
      --model.vocab_size=151936 --lora.rank=16 --lora.targets=all-linear --train.micro_batch_tokens=16384 ...

Everything after `--` is the Engine's config (key=value as `shardfit train` takes them; without any: a tiny model on
the CPU). Each model gets --datums random datums of --length tokens a step (cross_entropy, token_mean: each model a
mean over its own tokens); a step is, per K: every model's forward_backward then every model's optim_step, either one
after another ("sequential") or as one forward_backward_many ("one_pass"); with --call=forward, every model's forward
(log-probs: an RL loop's reference or old policy, no optimizer step) one after another or as one forward_many.
Figures: the median step time over --steps timed steps after --warmup, aggregate tokens/s (all models' tokens),
one_pass / sequential, the largest loss difference between the two ways (the same models, the same data: it
should be fp32 / bf16 rounding), and compile_fallbacks: the functions torch.compile gave up on so far (past
recompile_limit their calls run eager, parallel/compile_watch.py): 0, or the figures are of a partly eager pass.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import numpy as np

TINY = ["--model.dim=64", "--model.n_layers=2", "--model.n_heads=4", "--model.n_kv_heads=2", "--model.ffn_dim=128",
        "--model.max_seq_len=256", "--train.device=cpu", "--train.micro_batch_tokens=256", "--logging.run_dir=",
        "--logging.progress=none", "--lora.rank=8", "--lora.targets=all-linear"]


def _datums(vocab: int, n: int, length: int, seed: int):
    from shardfit.rl import make_datum

    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        s = rng.integers(0, vocab, length + 1)
        out.append(make_datum(s[:-1], target_tokens=s[1:], weights=np.ones(length)))
    return out


def _run(engine, k: int, a, together: bool) -> tuple[list[float], list[float]]:
    """Step times and the losses of every step's models, the models made fresh (seed i) for this run."""
    from shardfit.engine import AdamParams

    names = [f"{'one' if together else 'seq'}{k}-{i}" for i in range(k)]
    for i, n in enumerate(names):
        engine.add_model(n, seed=i)
    vocab, mean = engine.cfg.model.vocab_size, {"normalize": "token_mean"}
    times, losses = [], []
    for step in range(a.warmup + a.steps):
        data = {n: _datums(vocab, a.datums, a.length, 1000 * step + i) for i, n in enumerate(names)}
        engine.finish()
        t0 = time.perf_counter()
        many, one = ((engine.forward_many, engine.forward) if a.call == "forward" else
                     (engine.forward_backward_many, engine.forward_backward))
        if together:
            res = many(data, "cross_entropy", mean)
        else:
            res = {n: one(d, "cross_entropy", mean, model=n) for n, d in data.items()}
        for n in names if a.call == "forward_backward" else ():
            engine.optim_step(AdamParams(learning_rate=1e-4), model=n)
        engine.finish()
        if engine.device.type == "cuda":
            import torch

            torch.cuda.synchronize()
        if step >= a.warmup:
            times.append(time.perf_counter() - t0)
        losses += [res[n].metrics["loss:sum"] for n in names]
    for n in names:
        engine.models.remove(n)
    return times, losses


def main() -> int:
    argv = sys.argv[1:]
    overrides = argv[argv.index("--") + 1:] if "--" in argv else TINY
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="1,4", help="comma-separated K values")
    ap.add_argument("--datums", type=int, default=4, help="datums per model per step")
    ap.add_argument("--length", type=int, default=48, help="tokens per datum")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--call", choices=("forward_backward", "forward"), default="forward_backward",
                    help="forward_backward + optim_step a step, or forward alone (module docstring)")
    ap.add_argument("--out", default="")
    a = ap.parse_args(argv[:argv.index("--")] if "--" in argv else argv)
    from shardfit.parallel.compile_watch import fallback_count
    from shardfit.rl import DatumEngine

    engine = DatumEngine.start(overrides=overrides)
    out = {"overrides": overrides, "call": a.call, "datums": a.datums, "length": a.length, "cases": {}}
    for k in (int(x) for x in a.models.split(",")):
        tokens = k * a.datums * a.length
        row = {}
        for together in (False, True):
            times, losses = _run(engine, k, a, together)
            row["one_pass" if together else "sequential"] = {"step_s": statistics.median(times),
                                                             "tokens_per_s": tokens / statistics.median(times),
                                                             "losses": losses}
        seq, one = row["sequential"], row["one_pass"]
        row["one_pass_over_sequential"] = one["tokens_per_s"] / seq["tokens_per_s"]
        row["max_loss_diff"] = float(np.max(np.abs(np.subtract(one.pop("losses"), seq.pop("losses")))))
        row["compile_fallbacks"] = fallback_count()  # so far in this process: > 0, and some blocks ran eager
        out["cases"][k] = row
        print(json.dumps({k: row}), flush=True)
    if a.out:
        with open(a.out, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
