"""Run shardfit and the anchor recipes on one machine in one invocation; print one table of ratios.

  python benchmarks/bench_train.py --suite SUITE --nproc N [--anchors DIR] [--out FILE.json]

Each case is a fresh `torchrun --standalone` job. shardfit figures are the median over steps after the first three
(metrics.jsonl, one record per step); anchor figures are the JSON line the anchor script prints (median after three
warm-up steps, the same rule). Memory: the largest per-rank peak over the measured steps. Read benchmarks/README.md
for how the committed results were produced.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# name -> list of (kind, label, args). kind "shardfit" takes `shardfit train` overrides; "anchor" takes the
# anchor script's flags. {nproc} is filled in.
LLAMA8B_4K = ["--model.name=llama3-8b", "--data.seq_len=4096", "--train.steps=14", "--train.warmup_steps=2",
              "--train.lr=1e-4"]
COMPILED = [*LLAMA8B_4K, "--parallel.compile=true"]
MBS4 = [*COMPILED, "--train.micro_batch=4", "--train.global_batch={4n}"]  # the compiled baseline of sessions 3-4
BF16_BEST = [*MBS4, "--parallel.reduce_dtype=bfloat16"]  # session 4's best bf16 configuration
# The levers, best, long and single suites were measured before memory.keep_grads existed (gradients were freed
# between steps); FREED reproduces that. At the edge of memory (mbs 4, seq 262,144) kept gradients cause retries.
# FREED goes first, so that a case's own --memory.keep_grads wins.
FREED = ["--memory.keep_grads=false"]
CURVE = ["--model.name=llama3-1b", "--data.seq_len=4096", "--train.steps=50", "--train.warmup_steps=5",
         "--train.lr=3e-4", "--train.global_batch=4"]
CURVE8 = [*CURVE, "--train.lr=1e-4", "--train.warmup_steps=10"]
SINGLE_1B = ["--model.name=llama3-1b", "--data.seq_len=4096", "--train.steps=14", "--train.warmup_steps=2",
             "--train.lr=1e-4", "--parallel.compile=true", "--train.micro_batch=4", "--train.global_batch=4"]
LIGER_ANCHOR = ["--size", "8b", "--seq", "4096", "--mbs", "2", "--liger", "--ac", "none"]
SUITES: dict[str, list[tuple[str, str, list[str]]]] = {
    "tiny": [
        ("shardfit", "tiny default", []),
    ],
    "llama8b": [
        ("shardfit", "shardfit 8B mbs2 no-AC", [*LLAMA8B_4K, "--train.micro_batch=2", "--train.global_batch={2n}"]),
        ("shardfit", "shardfit 8B mbs4 selective-AC", [*LLAMA8B_4K, "--train.micro_batch=4",
                                                       "--train.global_batch={4n}",
                                                       "--parallel.activation_checkpoint=selective"]),
        ("shardfit", "shardfit 8B mbs2 no-AC compile", [*LLAMA8B_4K, "--train.micro_batch=2",
                                                        "--train.global_batch={2n}", "--parallel.compile=true"]),
        ("anchor", "anchor plain full-AC mbs2", ["--size", "8b", "--seq", "4096", "--mbs", "2"]),
        ("anchor", "anchor liger no-AC mbs2", LIGER_ANCHOR),
    ],
    # session 2's levers, one change at a time from the compiled baseline (NOTES.md has the predictions)
    "levers": [  # all with FREED (added below)
        ("shardfit", "compile mbs2 torch-CE", [*COMPILED, "--train.micro_batch=2", "--train.global_batch={2n}",
                                               "--parallel.kernels=torch", "--memory.snapshot_steps=6"]),
        ("shardfit", "compile mbs2 liger-CE", [*COMPILED, "--train.micro_batch=2", "--train.global_batch={2n}",
                                               "--parallel.kernels=liger"]),
        ("shardfit", "compile mbs2 liger-CE cudnn", [*COMPILED, "--train.micro_batch=2", "--train.global_batch={2n}",
                                                     "--parallel.kernels=liger", "--parallel.attention=cudnn"]),
        ("shardfit", "compile mbs4 liger-CE", [*MBS4, "--parallel.kernels=liger"]),
        ("anchor", "anchor liger no-AC mbs2", LIGER_ANCHOR),
    ],
    # the best 2-GPU configuration, for scaling (run with --nproc 2 and 4) and one more lever on it
    "best": [
        ("shardfit", "compile mbs4", MBS4),
        ("shardfit", "compile mbs4 bf16-reduce", BF16_BEST),
    ],
    # memory.keep_grads (on by default since session 2): reserved vs allocated, eager defaults and the best config
    "honest": [
        ("shardfit", "eager mbs2 (defaults)", [*LLAMA8B_4K, "--train.micro_batch=2", "--train.global_batch={2n}"]),
        ("shardfit", "compile mbs4", MBS4),
    ],
    # next levers (written in session 2, not yet run; predictions in NOTES.md): each from "compile mbs4"
    "levers2": [
        ("shardfit", "compile mbs4", MBS4),
        ("shardfit", "compile mbs4 loss-chunk 4096", [*MBS4, "--parallel.loss_chunk=4096"]),
        ("shardfit", "compile mbs4 prefetch 2", [*MBS4, "--parallel.prefetch=2"]),
        ("shardfit", "compile mbs6 selective-AC", [*COMPILED, "--train.micro_batch=6", "--train.global_batch={6n}",
                                                   "--parallel.activation_checkpoint=selective"]),
        ("anchor", "anchor liger no-AC mbs2", LIGER_ANCHOR),
    ],
    # session 3's levers, each from "compile mbs4" (NOTES.md has the predictions); the first two are profiled
    "levers3": [
        ("shardfit", "compile mbs4 eager-loss", [*MBS4, "--parallel.compile_loss=false", "--logging.profile_step=8"]),
        ("shardfit", "compile mbs4", [*MBS4, "--logging.profile_step=8"]),
        ("shardfit", "compile mbs4 loss-chunk 4096", [*MBS4, "--parallel.loss_chunk=4096"]),
        ("shardfit", "compile mbs4 prefetch 2", [*MBS4, "--parallel.prefetch=2"]),
        ("shardfit", "compile mbs4 cudnn", [*MBS4, "--parallel.attention=cudnn", "--logging.profile_step=8"]),
        ("shardfit", "compile mbs6 selective-AC", [*COMPILED, "--train.micro_batch=6", "--train.global_batch={6n}",
                                                   "--parallel.activation_checkpoint=selective"]),
        ("anchor", "anchor liger no-AC mbs2", LIGER_ANCHOR),
        ("shardfit", "compile mbs4 keep-grads", [*MBS4, "--memory.keep_grads=true"]),
    ],
    # session 3, after levers3: the compiled loss is on; amortising the optimizer and FSDP's fp32 reduce copy
    "levers4": [
        ("shardfit", "compile mbs4", [*MBS4, "--logging.profile_step=8"]),
        ("shardfit", "compile mbs4 bf16-reduce", BF16_BEST),
        ("shardfit", "compile mbs4 accum2", [*COMPILED, "--train.micro_batch=4", "--train.global_batch={8n}"]),
        ("shardfit", "compile mbs4 accum2 bf16-reduce", [
            *COMPILED, "--train.micro_batch=4", "--train.global_batch={8n}", "--parallel.reduce_dtype=bfloat16",
            "--logging.profile_step=8"]),
        ("anchor", "anchor liger no-AC mbs2", LIGER_ANCHOR),
    ],
    # session 4's first call: the best configuration profiled (the trace is kept: matmul time under communication)
    "profile": [
        ("shardfit", "compile mbs4 bf16-reduce", [*BF16_BEST, "--logging.profile_step=8"]),
    ],
    # session 4: FP8 matmuls (torchao), reported apart from bf16; each from the bf16 best (compile mbs4 bf16-reduce)
    "fp8": [
        ("shardfit", "compile mbs4 bf16-reduce", BF16_BEST),
        ("shardfit", "fp8 tensorwise mbs4", [*BF16_BEST, "--parallel.fp8=tensorwise",
                                             "--logging.profile_step=8"]),
        ("shardfit", "fp8 rowwise mbs4", [*BF16_BEST, "--parallel.fp8=rowwise"]),
        ("anchor", "anchor liger no-AC mbs2", LIGER_ANCHOR),
    ],
    # session 4's closing comparison: bf16 best, FP8 best and larger FP8 micro-batches (FP8 frees ~13 GiB), anchor
    "final4": [
        ("shardfit", "compile mbs4 bf16-reduce", BF16_BEST),
        ("shardfit", "fp8 tensorwise mbs4", [*BF16_BEST, "--parallel.fp8=tensorwise"]),
        ("shardfit", "fp8 tensorwise mbs5", [*COMPILED, "--train.micro_batch=5", "--train.global_batch={5n}",
                                             "--parallel.reduce_dtype=bfloat16", "--parallel.fp8=tensorwise"]),
        ("shardfit", "fp8 tensorwise mbs6", [*COMPILED, "--train.micro_batch=6", "--train.global_batch={6n}",
                                             "--parallel.reduce_dtype=bfloat16", "--parallel.fp8=tensorwise"]),
        ("anchor", "anchor liger no-AC mbs2", LIGER_ANCHOR),
    ],
    # session 3's closing comparison: the best configurations with the anchor in the same call
    "final": [
        ("shardfit", "compile mbs4", MBS4),
        ("shardfit", "compile mbs4 bf16-reduce", BF16_BEST),
        ("anchor", "anchor liger no-AC mbs2", LIGER_ANCHOR),
    ],
    # correctness does not move: 50 steps of the fastest configuration against the plain one on the same data (one
    # GPU, Llama-3.2-1B shape); the plain one with another loss chunk size measures bf16 rounding noise alone
    "curve": [
        ("shardfit", "plain: eager, full AC, mbs1 x accum4", [*CURVE, "--train.micro_batch=1",
                                                              "--parallel.activation_checkpoint=full"]),
        ("shardfit", "plain, loss chunk 512 (noise)", [*CURVE, "--train.micro_batch=1",
                                                        "--parallel.activation_checkpoint=full",
                                                        "--parallel.loss_chunk=512"]),
        ("shardfit", "fast: compiled, no AC, mbs4", [*CURVE, "--train.micro_batch=4", "--parallel.compile=true"]),
    ],
    # FP8 against bf16 over 50 steps, same data (one GPU, Llama-3.2-1B shape). At CURVE's lr 3e-4 even bf16 spikes
    # in warm-up and the curves measure the spike's sensitivity (session 4, third call); curve8 trains at 1e-4 with
    # 10 warm-up steps, and its noise case (bf16, another loss chunk) is the yardstick in the same regime.
    "curve8": [
        ("shardfit", "fast bf16: compiled, no AC, mbs4", [*CURVE8, "--train.micro_batch=4", "--parallel.compile=true"]),
        ("shardfit", "bf16, loss chunk 512 (noise)", [*CURVE8, "--train.micro_batch=4", "--parallel.compile=true",
                                                      "--parallel.loss_chunk=512"]),
        ("shardfit", "fast fp8 tensorwise", [*CURVE8, "--train.micro_batch=4", "--parallel.compile=true",
                                             "--parallel.fp8=tensorwise"]),
        ("shardfit", "fast fp8 rowwise", [*CURVE8, "--train.micro_batch=4", "--parallel.compile=true",
                                          "--parallel.fp8=rowwise"]),
    ],
    # capacity: one 262,144-token sequence split over 2 ranks (Ulysses), full checkpointing, 2 steps (the second
    # is measured); the data file must hold more than 262,145 tokens (device_run.sh makes one)
    "long": [
        ("shardfit", "seq 262144 ulysses-2 full-AC", [
            "--model.name=llama3-8b", "--model.max_seq_len=262144", "--data.seq_len=262144",
            "--data.path=/tmp/long.txt", "--train.steps=2",
            "--train.warmup_steps=1", "--train.lr=1e-5", "--train.micro_batch=1", "--train.global_batch=1",
            "--parallel.sequence_parallel=2", "--parallel.activation_checkpoint=full", *FREED]),
    ],
    # one GPU (H100): FP8 on the 1B shape against bf16 and the Liger anchor
    "single8": [
        ("shardfit", "llama3-1b compile mbs4", [*SINGLE_1B]),
        ("shardfit", "llama3-1b compile mbs4 fp8 tensorwise", [*SINGLE_1B, "--parallel.fp8=tensorwise"]),
        ("anchor", "anchor 1b liger no-AC mbs4", ["--size", "1b", "--seq", "4096", "--mbs", "4", "--liger",
                                                 "--ac", "none"]),
    ],
    # one GPU (H100): a model that fits, against the anchor at the same size
    "single": [
        ("shardfit", "llama3-1b compile mbs4", ["--model.name=llama3-1b", "--data.seq_len=4096", "--train.steps=14",
                                                "--train.warmup_steps=2", "--train.lr=1e-4", "--parallel.compile=true",
                                                "--train.micro_batch=4", "--train.global_batch=4"]),
        ("shardfit", "llama3-1b untied compile mbs4", [
            "--model.name=llama3-1b", "--model.tie_embeddings=false", "--data.seq_len=4096", "--train.steps=14",
            "--train.warmup_steps=2", "--train.lr=1e-4", "--parallel.compile=true", "--train.micro_batch=4",
            "--train.global_batch=4"]),
        ("anchor", "anchor 1b liger no-AC mbs4", ["--size", "1b", "--seq", "4096", "--mbs", "4", "--liger",
                                                 "--ac", "none"]),
        ("anchor", "anchor 1b plain full-AC mbs4", ["--size", "1b", "--seq", "4096", "--mbs", "4"]),
    ],
}


for _suite in ("levers", "best", "single", "levers2", "levers3", "levers4", "final", "profile", "fp8", "final4"):
    SUITES[_suite] = [(k, label, FREED + args if k == "shardfit" else args) for k, label, args in SUITES[_suite]]


def _fill(args: list[str], nproc: int) -> list[str]:
    for k in (2, 4, 5, 6, 8):
        args = [a.replace(f"{{{k}n}}", str(k * nproc)) for a in args]
    return args


def run_shardfit(label: str, args: list[str], nproc: int, timeout: int) -> dict:
    run_dir = Path(tempfile.mkdtemp(prefix="sf-bench-"))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", "-m",
           "shardfit", "train", *args, f"--logging.run_dir={run_dir}", "--logging.log_every=1",
           "--logging.progress=lines", "--checkpoint.final=false", "--checkpoint.resume=none"]
    t0 = time.time()
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=ROOT)
    out = {"system": "shardfit", "label": label, "nproc": nproc, "wall_s": round(time.time() - t0, 1),
           "rc": p.returncode, "cmd": "torchrun ... -m shardfit train " + " ".join(args)}
    metrics = run_dir / "metrics.jsonl"
    recs = [json.loads(x) for x in metrics.read_text().splitlines()] if metrics.is_file() else []
    steady = [r for r in recs if r["step"] > min(3, len(recs) - 1)]  # after warm-up; the last step of short runs
    if p.returncode != 0 or not steady:
        out["error"] = (p.stderr or p.stdout)[-1500:]
        out["oom"] = "OutOfMemoryError" in (p.stderr or "")
        return out
    out["losses"] = [round(r["loss"], 5) for r in recs]
    out.update(tok_s_gpu=round(statistics.median(r["tokens_per_s_per_gpu"] for r in steady)),
               mfu=round(statistics.median(r["mfu"] for r in steady), 3) if steady[0]["mfu"] else None,
               peak_alloc_GiB=round(max(r["peak_allocated_max"] for r in steady), 2),
               peak_reserved_GiB=round(max(r["peak_reserved_max"] for r in steady), 2),
               alloc_min_GiB=round(min(r["peak_allocated_min"] for r in steady), 2),
               retries=max(r["alloc_retries_max"] for r in steady), final_loss=round(recs[-1]["loss"], 4))
    if "time_forward_s" in steady[-1]:  # rank 0's phase times (train/timing.py), median seconds per step
        out["phases_s"] = {k: round(statistics.median(r[f"time_{k}_s"] for r in steady), 4)
                           for k in ("forward", "backward", "optimizer", "comm_wait")}
    profiles = sorted((run_dir / "profile").glob("step*_summary.json"))  # --logging.profile_step
    if profiles:
        out["profile"] = json.loads(profiles[-1].read_text())
        keep = os.environ.get("BENCH_KEEP_TRACES")  # a folder: the rank-0 trace is copied there, named by case
        if keep:
            shutil.copy(out["profile"]["trace"], Path(keep) / (label.replace(" ", "_") + ".json.gz"))
    doctor = sorted((run_dir / "snapshots").glob("doctor_step*.txt"))
    if doctor:
        out["doctor"] = doctor[-1].read_text()
    return out


def run_anchor(label: str, args: list[str], nproc: int, anchors: Path, timeout: int) -> dict:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
           str(anchors / "plain_fsdp2_llama.py"), *args, "--steps", "14"]
    t0 = time.time()
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    out = {"system": "anchor", "label": label, "nproc": nproc, "wall_s": round(time.time() - t0, 1),
           "rc": p.returncode, "cmd": "torchrun plain_fsdp2_llama.py " + " ".join(args)}
    lines = [x for x in p.stdout.splitlines() if x.startswith("{")]
    if not lines:
        out["error"] = (p.stderr or p.stdout)[-1500:]
        return out
    r = json.loads(lines[-1])
    out.update(tok_s_gpu=r.get("tok_s_gpu"), mfu=r.get("mfu"), peak_alloc_GiB=r.get("peak_alloc_GiB"),
               peak_reserved_GiB=r.get("peak_reserved_GiB"), retries=r.get("retries"), oom=r.get("oom", False))
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--suite", required=True, choices=sorted(SUITES))
    ap.add_argument("--nproc", type=int, default=1)
    ap.add_argument("--anchors", default=str(ROOT / ".anchors"))
    ap.add_argument("--out", default="")
    ap.add_argument("--timeout", type=int, default=300)
    ap.add_argument("--only", default="", help="run only the case with this label")
    a = ap.parse_args()
    import torch

    env = {"gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu",
           "torch": torch.__version__, "nproc": a.nproc, "suite": a.suite,
           "alloc_conf_env": os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "")}
    rows = []
    for kind, label, args in SUITES[a.suite]:
        if a.only and a.only != label:
            continue
        args = _fill(args, a.nproc)
        try:
            row = (run_shardfit(label, args, a.nproc, a.timeout) if kind == "shardfit"
                   else run_anchor(label, args, a.nproc, Path(a.anchors), a.timeout))
        except subprocess.TimeoutExpired:
            row = {"system": kind, "label": label, "nproc": a.nproc, "error": "timeout"}
        rows.append(row)
        print(json.dumps(row), flush=True)
    best_anchor = max((r.get("tok_s_gpu") or 0 for r in rows if r["system"] == "anchor"), default=0)
    print(f"\n{env['gpu']} x{a.nproc}, torch {env['torch']}, suite {a.suite}")
    print(f"{'case':34} {'tok/s/gpu':>10} {'MFU':>6} {'alloc':>7} {'resv':>7} {'resv/alloc':>10} {'retry':>5} "
          f"{'vs best anchor':>14}  fwd/bwd/opt/comm-wait s")
    for r in rows:
        if r.get("tok_s_gpu"):
            ratio = f"{r['tok_s_gpu'] / best_anchor:.2f}x" if best_anchor else "-"
            ra = r["peak_reserved_GiB"] / r["peak_alloc_GiB"] if r.get("peak_alloc_GiB") else 0
            print(f"{r['label']:34} {r['tok_s_gpu']:>10,} {r['mfu'] or 0:>6.3f} {r['peak_alloc_GiB']:>7.1f} "
                  f"{r['peak_reserved_GiB']:>7.1f} {ra:>10.2f} {r['retries']:>5.0f} {ratio:>14}  "
                  + "/".join(f"{v:.3f}" for v in r.get("phases_s", {}).values()))
        else:
            print(f"{r['label']:34} {'OOM' if r.get('oom') else 'FAILED':>10}")
    curves = [r for r in rows if len(r.get("losses", [])) >= 50]
    if len(curves) > 1:  # the loss curves against the first case's, step by step
        base = curves[0]["losses"]
        print(f"\nloss curves against '{curves[0]['label']}' ({len(base)} steps, {base[0]:.3f} -> {base[-1]:.3f})")
        for r in curves[1:]:
            d = [abs(x - y) for x, y in zip(r["losses"], base)]
            r["curve_vs_first"] = {"max_abs": round(max(d), 5), "mean_abs": round(sum(d) / len(d), 5),
                                   "final": r["losses"][-1]}
            print(f"{r['label']:40} max |diff| {max(d):.4f}, mean |diff| {sum(d) / len(d):.4f}, "
                  f"final {r['losses'][-1]:.4f}")
    if a.out:
        Path(a.out).write_text(json.dumps({"env": env, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
