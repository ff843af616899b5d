"""Issue 36 item 6: the train/sample log-prob gap of Engine.sample, and what sampling.logprobs=trainer costs. One GPU.

  python benchmarks/bench_logprob_gap.py --out OUT.json           # Qwen3-8B shape, bf16, LoRA r=16, 64 x 512 + 256
  python benchmarks/bench_logprob_gap.py --shape tiny --device cpu --prompts 4 --prompt 16 --new 8   # a CPU check

The Engine (shardfit.Engine: the RL API) of the shape (benchmarks/rl_worker_setup.py SHAPES), random weights, LoRA
r=16 on every linear layer after one optimizer step (so that the adapters add something: B = 0 at the start),
train.micro_batch_tokens = --row (rows of several datums, as an RL step packs them), sampling.logprobs=trainer
(the setting a loop that wants the trainer's numbers gives: under compute.doc_attention=auto the Engine then takes
a packing-invariant attention kernel, Engine.doc_kernel; each call below names its mode). --prompts random prompts of
--prompt tokens, one sample each of --new tokens (no stop token: random weights), temperature 1, seeded.

1. logprobs="decode": the sample call timed (the kept Sampler dropped first, as a training command between two
   sampling phases drops it), then the cookbook's datums of the samples (prompt + completion[:-1], targets shifted,
   the sampler's log-probs as the `logprobs` input, 0 at the prompt) through Engine.forward: the gap over the sampled
   tokens as an RL step reports it (rl/losses.py sampler_gap: sampler_logprob_gap:mean / :max, sampler_kl:mean) and
   its effect on the importance ratio, mean |exp(lp_decode - lp_forward) - 1|; and through forward_backward
   (importance_sampling: the attention kernel of a pass with gradients, Engine.doc_kernel), the step's own metrics.
2. logprobs="trainer": the same call (the same tokens: checked), timed; its log-probs against Engine.forward on the
   same datums in the same order (expected 0), in reverse order, and on the first half alone (another grouping: each
   datum at another column of another row), and against forward_backward's.
The switch's cost: (trainer call - decode call) / decode call; the forward's own time beside it. Each setting is
timed --reps times, the two taking turns (the best kept), after a warm-up call of each on a few short prompts (the
forward's kernels built); each timed call builds its Sampler's pool and graphs (dropped before it, as training
drops them), in both settings alike.
Prints one JSON line per part and a table last; --out: one JSON with a `summary`.
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

from rl_worker_setup import SHAPES, lora_overrides  # noqa: E402


def start_engine(a):
    from shardfit import Engine

    ov = [*SHAPES[a.shape], f"--train.device={a.device}", "--logging.run_dir=", "--logging.progress=none",
          f"--model.max_seq_len={a.prompt + a.new + 64}", f"--data.seq_len={a.prompt + a.new}",
          f"--train.micro_batch_tokens={a.row}", "--sampling.logprobs=trainer", *lora_overrides(a.lora),
          *a.extra.split()]
    return Engine.start(overrides=ov)


def sync(device: str) -> None:
    import torch

    if device == "cuda":
        torch.cuda.synchronize()


def one_step(engine, a) -> None:
    """One LoRA step on random datums (the adapters' B leaves 0)."""
    import numpy as np

    from shardfit.rl import AdamParams, make_datum

    rng = np.random.default_rng(7)
    seqs = rng.integers(10, engine.cfg.model.vocab_size - 1, (4, a.prompt + 1))
    engine.forward_backward([make_datum(s[:-1], target_tokens=s[1:]) for s in seqs], "cross_entropy")
    engine.optim_step(AdamParams(learning_rate=1e-3))


def timed_samples(engine, a, prompts, new: int, reps: int) -> dict[str, tuple[list, float]]:
    """Per setting (decode, trainer): (its results, the best seconds of `reps` sample calls), the settings taking
    turns (a busy host or card slows both alike); the kept Sampler dropped before each call."""
    from shardfit.sampling.params import SamplingParams

    params = [SamplingParams(max_tokens=new, temperature=1.0, seed=i) for i in range(len(prompts))]
    out = {}
    for _ in range(reps):
        for mode in ("decode", "trainer"):
            engine.release_sampler()
            sync(a.device)
            t = time.perf_counter()
            res = engine.sample(prompts, params, logprobs=mode)
            sync(a.device)
            dt = time.perf_counter() - t
            out[mode] = (res, min(dt, out[mode][1]) if mode in out else dt)
    return out


def loop_datums(prompts, results) -> list:
    """The cookbook's datums: prompt + completion[:-1], targets shifted, the sampler's log-probs (0 at the prompt)."""
    from shardfit.rl import make_datum

    out = []
    for p, r in zip(prompts, results):
        s = r.samples[0]
        seq = p + s.tokens
        n = len(p) - 1
        out.append(make_datum(seq[:-1], target_tokens=seq[1:], logprobs=[0.0] * n + s.logprobs,
                              advantages=[0.0] * n + [1.0] * len(s.tokens)))
    return out


def gap(datums, logprobs) -> dict:
    """The RL step's metrics (rl/losses.py sampler_gap) and the importance ratio's mean error, over sampled tokens."""
    import numpy as np

    from shardfit.rl.losses import sampled, sampler_gap

    out = sampler_gap(datums, logprobs)
    delta = np.concatenate([(d.inputs["logprobs"] - lp)[sampled(d)] for d, lp in zip(datums, logprobs)])
    out["importance_ratio_error:mean"] = float(np.abs(np.expm1(delta.astype(np.float64))).mean())
    out["tokens"] = int(delta.size)
    return {k: (float(f"{v:.4g}") if isinstance(v, float) else v) for k, v in out.items()}


def forward(engine, datums, a):
    sync(a.device)
    t = time.perf_counter()
    lp = [o["logprobs"] for o in engine.forward(datums, "cross_entropy").outputs]
    sync(a.device)
    return lp, time.perf_counter() - t


def fwdbwd(engine, datums) -> list:
    """forward_backward(importance_sampling)'s log-probs; its gradients dropped (no step is taken)."""
    res = engine.forward_backward(datums, "importance_sampling")
    engine.models.drop_gradients(engine.models.current)
    return [o["logprobs"] for o in res.outputs]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="8b", choices=sorted(SHAPES))
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--new", type=int, default=256)
    ap.add_argument("--lora", type=int, default=16)
    ap.add_argument("--row", type=int, default=0, help="train.micro_batch_tokens; 0: 4 datums a row")
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--fwdbwd", type=int, default=1, help="1: the forward_backward comparisons too")
    ap.add_argument("--extra", default="", help="more Engine overrides, e.g. --compute.doc_attention=varlen (forward "
                    "then takes forward_backward's attention kernel instead of cudnn_docs)")
    ap.add_argument("--out", default="")
    a = ap.parse_args()
    import torch

    a.row = a.row or 4 * (a.prompt + a.new)
    t0 = time.perf_counter()
    engine = start_engine(a)
    one_step(engine, a)
    rows: list[dict] = [{"part": "start", "seconds": round(time.perf_counter() - t0, 2)}]
    print(json.dumps(rows[-1]), flush=True)
    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(10, engine.cfg.model.vocab_size - 1, (a.prompts, a.prompt), generator=g).tolist()
    timed_samples(engine, a, [p[:64] for p in prompts[:4]], 4, 1)  # warm-up: the forward's kernels built
    timed = timed_samples(engine, a, prompts, a.new, a.reps)
    (dec, t_dec), (tra, t_tra) = timed["decode"], timed["trainer"]
    datums = loop_datums(prompts, dec)
    lp_fwd, t_fwd = forward(engine, datums, a)
    rows.append({"part": "decode vs forward", "sample_s": round(t_dec, 3), "forward_s": round(t_fwd, 3),
                 **gap(datums, lp_fwd)})
    print(json.dumps(rows[-1]), flush=True)

    same_tokens = [s.tokens for r in tra for s in r.samples] == [s.tokens for r in dec for s in r.samples]
    tdat = loop_datums(prompts, tra)
    rows.append({"part": "trainer vs forward, same datums", "sample_s": round(t_tra, 3),
                 "same_tokens_as_decode": same_tokens, **gap(tdat, lp_fwd)})
    print(json.dumps(rows[-1]), flush=True)
    rev, _ = forward(engine, tdat[::-1], a)
    rows.append({"part": "trainer vs forward, reversed order", **gap(tdat, rev[::-1])})
    print(json.dumps(rows[-1]), flush=True)
    half = len(tdat) // 2 or 1
    first, _ = forward(engine, tdat[:half], a)
    rows.append({"part": "trainer vs forward, first half alone", **gap(tdat[:half], first)})
    print(json.dumps(rows[-1]), flush=True)
    if a.fwdbwd:
        fb = fwdbwd(engine, datums)
        rows.append({"part": "decode vs forward_backward", **gap(datums, fb)})
        print(json.dumps(rows[-1]), flush=True)
        rows.append({"part": "trainer vs forward_backward", **gap(tdat, fb)})
        print(json.dumps(rows[-1]), flush=True)

    base = rows[1]
    summary = {"gpu": torch.cuda.get_device_name() if a.device == "cuda" else "cpu", "shape": a.shape,
               "prompts": a.prompts, "prompt": a.prompt, "new": a.new, "lora": a.lora, "row_tokens": a.row,
               "sampler_logprob_gap:mean": base["sampler_logprob_gap:mean"],
               "sampler_logprob_gap:max": base["sampler_logprob_gap:max"],
               "importance_ratio_error:mean": base["importance_ratio_error:mean"],
               "trainer_gap_same_datums:max": rows[2]["sampler_logprob_gap:max"],
               "trainer_gap_reversed:max": rows[3]["sampler_logprob_gap:max"],
               "trainer_gap_half:max": rows[4]["sampler_logprob_gap:max"],
               "sample_s_decode": round(t_dec, 3), "sample_s_trainer": round(t_tra, 3), "forward_s": round(t_fwd, 3),
               "trainer_cost_fraction": round((t_tra - t_dec) / t_dec, 4), "same_tokens": same_tokens}
    if a.out:
        Path(a.out).write_text(json.dumps({"summary": summary, "rows": rows}, indent=1))
    print(f"\n{'part':36} {'gap mean':>10} {'gap max':>10} {'|r-1| mean':>10} {'seconds':>8}")
    for r in rows[1:]:
        print(f"{r['part']:36} {r['sampler_logprob_gap:mean']:10.3g} {r['sampler_logprob_gap:max']:10.3g} "
              f"{r['importance_ratio_error:mean']:10.3g} " + (f"{r['sample_s']:8.3f}" if "sample_s" in r else ""))
    print(f"trainer's cost: {summary['trainer_cost_fraction']:+.1%} of the sample call (forward {t_fwd:.2f} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
