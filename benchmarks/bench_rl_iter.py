"""Issue 36: a tinker-cookbook-shaped RL iteration through the official tinker SDK against `shardfit serve` (one GPU,
loopback): how much of the iteration is sampling, against the training step it feeds.

  python benchmarks/bench_rl_iter.py --out rl_iter.json              # Qwen3-8B shape, LoRA r=16 (device_run.sh rl-iter)
  python benchmarks/bench_rl_iter.py --src .old/src --out old.json   # the same against an older tree's server
  python benchmarks/bench_rl_iter.py --tiny --out /tmp/rl_iter.json  # the machinery on CPU (tiny shape, seconds)

One iteration, as the cookbook's synchronous RL loop runs it: save_weights_and_get_sampling_client (a frozen version
of the policy), --prompts requests of --prompt-len random tokens sent at once (SDK futures, as the cookbook's
asyncio.gather), each num_samples=--samples, max_tokens=--max-tokens at temperature 1 with no stop (stop=[]: random
weights, every row runs its whole length); then the rollouts as datums (the prompt's positions weight 0, the
sampled tokens the sampler's log-probs and one random advantage a rollout) in one forward_backward
(importance_sampling) and an optim_step, pipelined as the SDK sends them. --warm-prompts prompts of --warm-tokens new
tokens first (compiled blocks, the sampler's first CUDA graphs), not counted; then --iters timed iterations (the
ones the --budget holds).
Figures per iteration: wall_s, sample_s (the snapshot to the last sample's answer), build_s (datums, host), train_s
(forward_backward + optim_step), sample_batches (the sizes of the server's batches of requests, from its log);
summary (medians over the timed iterations): rl_iter_s, rl_iter_sample_s, rl_iter_train_s,
rl_iter_sample_over_train (sample_s / train_s: the issue's target <= 2), sampled_tok_s. The server is started with
--src first on its PYTHONPATH (default src): an older tree (device_run.sh carries one as .old/src) gives the figure
before a change, in a call of its own.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_train import ROOT  # noqa: E402
from rl_worker_setup import SHAPES, lora_overrides, moe_overrides  # noqa: E402
from serve_process import running_server  # noqa: E402

ADAM = dict(learning_rate=1e-6, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0, grad_clip_norm=1.0)


def shape_overrides(a) -> list[str]:
    if a.shape == "moe6":  # Qwen3-30B-A3B with 6 of its 48 layers (bench_rl's MoE rows), LoRA as the SDK trains
        return moe_overrides(6, a.tiny)
    return SHAPES["tiny" if a.tiny else a.shape]


def base_model(a) -> str:
    """The served model.name the client names: a preset's, else the default ("tiny", every size set over it)."""
    return next((x.split("=", 1)[1] for x in shape_overrides(a) if x.startswith("--model.name=")), "tiny")


def server_cmd(a, run_dir: Path) -> list[str]:
    """`shardfit serve` of the shape: LoRA r=--lora on the 7 linear layers (full checkpointing, as bench_rl's
    lora-ppo), rows of --budget-tokens tokens, a context that holds prompt + max_tokens."""
    gpu = not a.tiny
    ov = [*shape_overrides(a), *lora_overrides(a.lora),
          f"--train.micro_batch_tokens={a.budget_tokens}", f"--data.seq_len={min(a.budget_tokens, 4096)}",
          f"--model.max_seq_len={max(a.prompt_len + a.max_tokens, 4096)}", f"--train.device={'cuda' if gpu else 'cpu'}",
          f"--logging.run_dir={run_dir}", "--logging.progress=none"]
    if gpu:
        ov.append("--compute.compile=true")
    return [sys.executable, "-m", "shardfit", "serve", "--port=0", *ov, *a.sf_extra.split()]


def batches(lines: list[str]) -> list[int]:
    """The sizes of the server's sample batches in these log lines (each request of a batch of n logs 'in a batch of
    n'; a request alone logs none; on one rank each request of a sample run, serve/sample_joining.py, logs 'in
    sample run R': the requests of each run)."""
    runs: dict[str, int] = {}
    for x in lines:
        if x.startswith("shardfit serve: sample ") and (m := re.search(r"in sample run (\d+)", x)):
            runs[m.group(1)] = runs.get(m.group(1), 0) + 1
    if runs:
        return list(runs.values())
    sizes = [int(m.group(1)) if (m := re.search(r"in a batch of (\d+)", x)) else 1
             for x in lines if x.startswith("shardfit serve: sample ")]
    out, i = [], 0
    while i < len(sizes):
        out.append(sizes[i])
        i += sizes[i]
    return out


def iteration(tc, log: list[str], prompts: list[list[int]], samples: int, max_tokens: int, seed: int, rng) -> dict:
    """One RL iteration (module docstring); its timings and counts, and the server's sample batches (`log`: its
    lines so far)."""
    import numpy as np
    from tinker import types

    seen = len(log)
    t0 = time.perf_counter()
    sampler = tc.save_weights_and_get_sampling_client().result()
    params = types.SamplingParams(max_tokens=max_tokens, temperature=1.0, stop=[], seed=seed)
    futures = [sampler.sample(types.ModelInput.from_ints(p), num_samples=samples, sampling_params=params)
               for p in prompts]
    results = [f.result() for f in futures]
    t1 = time.perf_counter()
    datums, sampled = [], 0
    for p, res in zip(prompts, results):
        for seq in res.sequences:
            toks, n = list(p) + list(seq.tokens), len(seq.tokens)
            sampled += n
            zeros = np.zeros(len(p) - 1, np.float32)
            datums.append(types.Datum(model_input=types.ModelInput.from_ints(toks[:-1]), loss_fn_inputs={
                "target_tokens": np.asarray(toks[1:], np.int64),
                "logprobs": np.concatenate([zeros, np.asarray(seq.logprobs, np.float32)]),
                "advantages": np.concatenate([zeros, np.full(n, rng.standard_normal(), np.float32)])}))
    t2 = time.perf_counter()
    fb = tc.forward_backward(datums, "importance_sampling")
    op = tc.optim_step(types.AdamParams(**ADAM))
    fb, op = fb.result(), op.result()
    t3 = time.perf_counter()
    sizes = batches(log[seen:])  # read after the step: the last batch's lines were printed long before
    return {"wall_s": round(t3 - t0, 3), "sample_s": round(t1 - t0, 3), "build_s": round(t2 - t1, 3),
            "train_s": round(t3 - t2, 3), "rollouts": len(datums), "sampled_tokens": sampled, "sample_batches": sizes,
            "tokens_trained": sum(len(d.model_input.to_ints()) for d in datums),
            "loss": fb.metrics.get("loss:sum"), "grad_norm": op.metrics.get("grad_norm:mean")}


def drive(a, url: str, log: list[str], out: dict, write) -> None:
    import numpy as np
    import tinker

    vocab = 3000 if a.tiny else 151936  # the MoE shape's too (rl_worker_setup.MOE)
    rng = np.random.default_rng(a.seed)
    t = time.perf_counter()
    tc = tinker.ServiceClient(base_url=url, api_key="tml-local").create_lora_training_client(
        base_model=base_model(a), rank=a.lora).result()
    out["client_s"] = round(time.perf_counter() - t, 2)

    def prompts(n):
        return [rng.integers(0, vocab, a.prompt_len).tolist() for _ in range(n)]

    out["warmup"] = iteration(tc, log, prompts(a.warm_prompts), a.samples, a.warm_tokens, 0, rng)
    write()
    for i in range(a.iters):
        last = out["iterations"][-1]["wall_s"] if out["iterations"] else out["warmup"]["wall_s"]
        left = a.budget - (time.time() - out["t0"])
        if out["iterations"] and left < 1.2 * last:
            out["skipped"] = f"{a.iters - i} iteration(s): {left:.0f} s of the budget left, the last took {last:.0f}"
            break
        out["iterations"].append(iteration(tc, log, prompts(a.prompts), a.samples, a.max_tokens, 1 + i, rng))
        write()


def summarize(out: dict) -> dict:
    its = out["iterations"]
    if not its:
        return {}
    med = {k: statistics.median(it[k] for it in its) for k in ("wall_s", "sample_s", "train_s", "build_s")}
    return {"rl_iter_s": med["wall_s"], "rl_iter_sample_s": med["sample_s"], "rl_iter_train_s": med["train_s"],
            "rl_iter_build_s": med["build_s"], "rl_iter_sample_over_train": round(med["sample_s"] / med["train_s"], 3),
            "sampled_tok_s": round(statistics.median(it["sampled_tokens"] / it["sample_s"] for it in its), 1),
            "trained_tok_s": round(statistics.median(it["tokens_trained"] / it["train_s"] for it in its), 1)}


def table(out: dict) -> str:
    rows = [("warm-up", out.get("warmup"))] + [(f"iteration {i + 1}", it) for i, it in enumerate(out["iterations"])]
    lines = ["| | wall s | sampling s | datums s | fwd/bwd + optim s | rollouts | sampled tokens | sample batches |",
             "|---|---|---|---|---|---|---|---|"]
    lines += [f"| {name} | {r['wall_s']:.1f} | {r['sample_s']:.1f} | {r['build_s']:.1f} | {r['train_s']:.1f} | "
              f"{r['rollouts']} | {r['sampled_tokens']} | {r['sample_batches']} |" for name, r in rows if r]
    s = out.get("summary") or {}
    if s:
        lines.append(f"rl_iter_sample_over_train = {s['rl_iter_sample_over_train']} (target <= 2); "
                     f"{s['sampled_tok_s']:.0f} sampled tok/s, {s['trained_tok_s']:.0f} trained tok/s")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", default="8b", choices=[k for k in SHAPES if k != "tiny"] + ["moe6"],
                    help="moe6: Qwen3-30B-A3B, 6 of 48 layers (issue 36's MoE row; LoRA, as the Tinker SDK trains)")
    ap.add_argument("--lora", type=int, default=16)
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--samples", type=int, default=16)
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--max-tokens", type=int, default=512)
    ap.add_argument("--warm-prompts", type=int, default=8)
    ap.add_argument("--warm-tokens", type=int, default=32)
    ap.add_argument("--iters", type=int, default=2, help="timed iterations after the warm-up")
    ap.add_argument("--budget-tokens", type=int, default=16384, help="train.micro_batch_tokens (rows of datums)")
    ap.add_argument("--budget", type=float, default=540.0, help="seconds: no iteration starts that would pass it")
    ap.add_argument("--start-cap", type=float, default=300.0, help="seconds the server may take to listen")
    ap.add_argument("--src", default="src", help="the tree the server runs (PYTHONPATH): src, or .old/src")
    ap.add_argument("--sf-extra", default="", help="more Engine overrides for the server")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--tiny", action="store_true", help="CPU, the tiny shape, 4 prompts x 2 samples x 8 tokens")
    ap.add_argument("--out", default="")
    a = ap.parse_args()
    if a.tiny:
        a.prompts, a.samples, a.prompt_len, a.max_tokens, a.warm_prompts, a.warm_tokens, a.iters = 4, 2, 16, 8, 2, 4, 2
        a.budget_tokens = 512
    out = {"t0": time.time(), "args": vars(a), "iterations": []}
    run_dir = Path(tempfile.mkdtemp(prefix="rliter-"))
    cmd = server_cmd(a, run_dir / "run")
    out["cmd"] = " ".join(cmd[1:])
    try:
        import torch

        out["machine"] = {"gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
                          "torch": torch.__version__}
    except ImportError:
        out["machine"] = {}

    def write() -> None:
        out["summary"] = summarize(out)
        if a.out:
            Path(a.out).write_text(json.dumps(out, indent=1))

    src = str((ROOT / a.src).resolve())  # first on the server's path: it wins over a src already there
    path = os.pathsep.join(x for x in (src, os.environ.get("PYTHONPATH", "")) if x)
    env = {**os.environ, "TINKER_TELEMETRY": "0", "PYTHONUNBUFFERED": "1", "PYTHONPATH": path}
    with running_server(cmd, a.start_cap, ROOT, env) as server:
        out["server_start_s"] = server.start_s
        if server.url:
            drive(a, server.url, server.log, out, write)
        else:
            out["error"] = server.error
    out["server_log_tail"] = server.log_tail()
    write()
    print(json.dumps({"summary": out["summary"], "skipped": out.get("skipped"), "error": out.get("error")}))
    print(table(out))
    return 0 if out["iterations"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
