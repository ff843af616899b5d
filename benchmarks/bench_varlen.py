"""Variable-length training on a GPU machine (issue 12): packed vs padded fine-tuning, document masks vs none, and
the third seed report's memory experiment redone. One invocation per suite; one table of ratios; JSON with --out.

  python benchmarks/bench_varlen.py data --out /tmp/varlen            # the data sets (deterministic)
  python benchmarks/bench_varlen.py sft8b --nproc 2 --data /tmp/varlen --out sft8b.json
  python benchmarks/bench_varlen.py docmask8b --nproc 2 --data /tmp/varlen --out docmask8b.json
  python benchmarks/bench_varlen.py flat300 --gpu 0 --data /tmp/varlen --only NAME --out flat.json

The fine-tuning set: 20,000 prompt/completion examples whose total length in tokens (bytes: the byte tokenizer
gives one token per byte, and EOS after the completion) is log-normal with median 400 and sigma 1.0, clipped to
[16, 8192] (mean ~660, p90 ~1,440, p99 ~4,100, ~1% longer than a 4,096-token row and truncated there); the prompt
takes a uniform 20-80% of each example. Words are drawn from the embedded corpus. Seeded: the same file every time.
The pretraining corpus is the same texts as JSON lines of `text` (20,000 short documents).

shardfit figures: medians over steps 4.. of metrics.jsonl records (tokens per second per GPU that carry loss, that are
not padding, and row capacity); anchor figures: the JSON line anchor_sft_hf.py prints (the same rule).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
LLAMA8B = ["--data.seq_len=4096", "--train.warmup_steps=2", "--train.lr=1e-5",
           "--parallel.compile=true", "--memory.keep_grads=false", "--logging.log_every=1"]
ROWS4 = ["--train.micro_batch=4", "--train.global_batch={4n}"]  # the compiled mbs-4 layout of sessions 3-4
LLAMA1B = ["--model.name=llama3-1b", "--data.seq_len=4096", "--train.warmup_steps=5", "--train.lr=1e-5",
           "--logging.log_every=1", "--train.steps=300"]


def make_data(out: Path, n: int = 20000, seed: int = 0) -> None:
    words = (ROOT / "src/shardfit/data/corpus/field_guide.txt").read_text().split()
    words = [w for w in words if w.isascii()]
    rng = np.random.default_rng(seed)
    total = np.clip(np.exp(rng.normal(np.log(400), 1.0, n)), 16, 8192).astype(int)
    share = rng.uniform(0.2, 0.8, n)
    out.mkdir(parents=True, exist_ok=True)

    def text(length: int) -> str:
        s = " ".join(words[int(i)] for i in rng.integers(0, len(words), length // 4 + 2))
        return s[:length]

    with open(out / "sft.jsonl", "w") as f, open(out / "docs.jsonl", "w") as g:
        for t, sh in zip(total, share):
            p = max(1, int(t * sh))
            prompt, completion = text(p), text(int(t) - p - 1)  # + EOS = t tokens
            f.write(json.dumps({"prompt": prompt, "completion": completion}) + "\n")
            g.write(json.dumps({"text": prompt + completion}) + "\n")
    q = np.percentile(total, [50, 90, 99])
    print(f"{n} examples: median {q[0]:.0f}, p90 {q[1]:.0f}, p99 {q[2]:.0f}, max {total.max()}, mean "
          f"{total.mean():.0f}, {total.sum():,} tokens, {(total > 4097).mean():.1%} longer than a 4,096 row")


def run_shardfit(args: list[str], nproc: int, gpus: str, timeout: int) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        args = [a.replace("{4n}", str(4 * nproc)) for a in args]
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", "-m",
               "shardfit", "train", *args, f"--logging.run_dir={tmp}", "--logging.progress=lines",
               "--checkpoint.final=false"]
        env = {**os.environ, "CUDA_VISIBLE_DEVICES": gpus}
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
        if p.returncode:
            return {"error": (p.stdout + p.stderr)[-1500:]}
        with open(f"{tmp}/metrics.jsonl") as f:
            recs = [json.loads(x) for x in f if '"eval"' not in x]
        notes = [x for x in p.stdout.splitlines() if x.startswith(("fine-tuning", "shardfit:"))]
    w = [r for r in recs if r["step"] > 3]  # with log_every=1 each record's rates are over its own step
    med = lambda k: float(np.median([r[k] for r in w]))  # noqa: E731
    return {"loss_tok_s_gpu": med("loss_tokens_per_s_per_gpu"), "real_tok_s_gpu": med("real_tokens_per_s_per_gpu"),
            "tok_s_gpu": med("tokens_per_s_per_gpu"), "peak_alloc_GiB": max(r["peak_allocated_max"] for r in w),
            "peak_reserved_GiB": max(r["peak_reserved_max"] for r in w),
            "retries": max(r["alloc_retries_max"] for r in recs), "notes": notes,
            "per_step": [{"step": r["step"], "reserved": r["peak_reserved_max"], "allocated": r["peak_allocated_max"],
                          "retries": r["alloc_retries_max"]} for r in recs]}


def run_anchor(args: list[str], nproc: int, gpus: str, timeout: int) -> dict:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
           str(ROOT / "benchmarks/anchor_sft_hf.py"), *args]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout,
                       env={**os.environ, "CUDA_VISIBLE_DEVICES": gpus})
    lines = [json.loads(x) for x in p.stdout.splitlines() if x.startswith("{")]
    if p.returncode or not lines:
        return {"error": (p.stdout + p.stderr)[-1500:]}
    res = lines[-1]
    res["per_step"] = [{"step": r["step"], "reserved": r["peak_reserved_GiB"], "allocated": r["peak_alloc_GiB"],
                        "retries": r["retries"]} for r in lines if r.get("per_step")]
    return res


def suites(data: Path, size: str) -> dict[str, list[tuple[str, str, list[str]]]]:
    """size: the Llama-3 shape of the sft8b and docmask8b suites (8b on 2 GPUs; 3b where one GPU is all there is)."""
    sft, docs = f"--data.path={data}/sft.jsonl", f"--data.path={data}/docs.jsonl"
    anchor = ["--data", f"{data}/sft.jsonl", "--seq", "4096"]
    LLAMA = [f"--model.name=llama3-{size}", *LLAMA8B]
    return {
        "sft8b": [
            ("shardfit", "padded (data.pack=false)", [*LLAMA, *ROWS4, sft, "--data.pack=false", "--train.steps=12"]),
            ("shardfit", "packed", [*LLAMA, *ROWS4, sft, "--train.steps=12"]),
            ("shardfit", "token budget 16384", [*LLAMA, sft, "--train.micro_batch_tokens=16384",
                                                "--train.global_batch=48", "--train.steps=12"]),
            ("anchor", "HF + Liger, padded, no AC, mbs 2", [*anchor, "--size", size, "--mbs", "2", "--liger",
                                                            "--ac", "none", "--pad", "max", "--steps", "12"]),
        ],
        "docmask8b": [
            ("shardfit", "packed, no document mask", [*LLAMA, *ROWS4, docs, "--data.mode=pretrain",
                                                      "--data.document_mask=false", "--train.steps=12"]),
            ("shardfit", "packed, document mask (varlen)", [*LLAMA, *ROWS4, docs, "--data.mode=pretrain",
                                                            "--parallel.doc_attention=varlen", "--train.steps=12"]),
            ("shardfit", "packed, document mask (flex)", [*LLAMA, *ROWS4, docs, "--data.mode=pretrain",
                                                          "--parallel.doc_attention=flex", "--train.steps=12"]),
        ],
        "flat300": [
            ("shardfit", "shardfit packed", [*LLAMA1B, sft, "--train.micro_batch=2", "--train.global_batch=2"]),
            ("shardfit", "shardfit token budget 8192", [*LLAMA1B, sft, "--train.micro_batch_tokens=8192",
                                                        "--train.global_batch=12"]),
            ("shardfit", "shardfit padded", [*LLAMA1B, sft, "--data.pack=false", "--train.micro_batch=2",
                                             "--train.global_batch=2"]),
            ("anchor", "HF + Liger, dynamic padding (variable shapes)", [*anchor, "--size", "1b", "--mbs", "2",
                                                                         "--liger", "--pad", "longest", "--steps",
                                                                         "300", "--per-step"]),
            ("anchor", "HF + Liger, padded to 4096", [*anchor, "--size", "1b", "--mbs", "2", "--liger", "--pad",
                                                      "max", "--steps", "300", "--per-step"]),
        ],
    }


def flatness(per_step: list[dict], warm: int = 20) -> dict:
    after = [r for r in per_step if r["step"] > warm]
    if not after:
        return {}
    resv = [r["reserved"] for r in after]
    return {"reserved_spread_pct": round(100 * (max(resv) - min(resv)) / max(resv), 2),
            "reserved_min_GiB": round(min(resv), 2), "reserved_max_GiB": round(max(resv), 2),
            "reserved_over_allocated": round(max(r["reserved"] / r["allocated"] for r in after), 3),
            "retries_after_warmup": after[-1]["retries"] - (per_step[warm - 1]["retries"] if warm else 0)}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("suite", choices=["data", "sft8b", "docmask8b", "flat300"])
    ap.add_argument("--data", default="/tmp/varlen")
    ap.add_argument("--nproc", type=int, default=1)
    ap.add_argument("--gpus", default="")
    ap.add_argument("--only", default="")
    ap.add_argument("--size", default="8b", choices=("1b", "3b", "8b"))
    ap.add_argument("--timeout", type=int, default=420)
    ap.add_argument("--out", default="")
    a = ap.parse_args()
    if a.suite == "data":
        make_data(Path(a.data))
        return 0
    gpus = a.gpus or ",".join(str(i) for i in range(a.nproc))
    results = []
    for kind, label, args in suites(Path(a.data), a.size)[a.suite]:
        if a.only and a.only not in label:
            continue
        run = run_shardfit if kind == "shardfit" else run_anchor
        r = {"label": label, "kind": kind, "args": args, **run(args, a.nproc, gpus, a.timeout)}
        if "per_step" in r:
            r["flatness"] = flatness(r["per_step"])
        results.append(r)
        print(json.dumps({k: v for k, v in r.items() if k not in ("per_step", "args")}), flush=True)
    out = {"suite": a.suite, "size": a.size, "nproc": a.nproc, "results": results}
    by = {r["label"]: r for r in results if "error" not in r}
    if a.suite == "sft8b" and "packed" in by and "padded (data.pack=false)" in by:
        out["packed_vs_padded"] = by["packed"]["loss_tok_s_gpu"] / by["padded (data.pack=false)"]["loss_tok_s_gpu"]
        anchors = [r for r in by.values() if r["kind"] == "anchor"]
        if anchors:
            out["packed_vs_anchor"] = by["packed"]["loss_tok_s_gpu"] / anchors[0]["loss_tok_s_gpu"]
    if a.suite == "docmask8b" and "packed, no document mask" in by:
        base = by["packed, no document mask"]["tok_s_gpu"]
        out["masked_vs_unmasked"] = {k: v["tok_s_gpu"] / base for k, v in by.items() if "document mask (" in k}
    if a.out:
        Path(a.out).write_text(json.dumps(out, indent=1))
    print(f"\n{'case':<52} {'loss tok/s/GPU':>14} {'real tok/s':>11} {'rows tok/s':>11} {'alloc/resv GiB':>15} "
          f"{'retries':>7} {'flat %':>7}")
    for r in results:
        if "error" in r:
            print(f"{r['label']:<52} ERROR {r['error'][-300:]}")
            continue
        fl = r.get("flatness", {}).get("reserved_spread_pct", "")
        print(f"{r['label']:<52} {r['loss_tok_s_gpu']:>14,.0f} {r['real_tok_s_gpu']:>11,.0f} {r['tok_s_gpu']:>11,.0f} "
              f"{r['peak_alloc_GiB']:>7.1f}/{r['peak_reserved_GiB']:<7.1f} {r['retries']:>7} {fl:>7}")
    for k in ("packed_vs_padded", "packed_vs_anchor", "masked_vs_unmasked"):
        if k in out:
            print(f"{k}: {out[k]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
