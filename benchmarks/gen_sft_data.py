"""A fine-tuning set with a realistic length distribution, and the same texts as a pretraining corpus (issue 12).

  python benchmarks/gen_sft_data.py --out /tmp/varlen            # 20,000 examples, seed 0: the benchmark set
  python benchmarks/gen_sft_data.py --out /tmp/small --n 500      # a smaller one for CPU smoke runs

Writes, deterministically (the same bytes for the same arguments, on any machine):
  DIR/sft.jsonl      {"prompt": ..., "completion": ...} per line: shardfit's fine-tuning format (loss on the
                     completion and the EOS after it), read the same way by benchmarks/anchor_sft.py;
  DIR/docs.jsonl     {"text": prompt + completion} per line: the same texts as a pretraining corpus of many short
                     documents (shardfit's JSON-lines reader makes one document of each line);
  DIR/summary.json   the distribution below, and the arguments.

Lengths are counted in tokens of shardfit's byte tokenizer (`--data.tokenizer=byte`, the default: one token per
UTF-8 byte; the text is ASCII, so one token per character). An example's total length T = prompt + completion +
EOS is drawn log-normal: ln T ~ Normal(ln median, sigma), median 400 and sigma 1.0 by default, rounded and clipped
to [16, 8192]. That gives a mean of ~660 tokens, p90 ~1,440, p99 ~4,100 (about 1% of the examples are longer than a
4,096-token row and get truncated there; ~0.1% reach the 8,192 clip), the shape of public instruction-tuning sets
(most examples a few hundred tokens, a long tail of documents). The prompt takes a share of T drawn uniform in
[0.2, 0.8] (at least one token; the completion at least one token besides the EOS), so about half of the tokens
carry loss. Text is words drawn uniformly (with replacement) from the ASCII words of shardfit's embedded corpus
(src/shardfit/data/corpus/field_guide.txt), joined by spaces into one stream that the examples cut consecutive
slices of, so every prompt and completion has exactly its drawn length.

The generator is numpy's PCG64 (`np.random.default_rng(seed)`): lengths, prompt shares and words in that order.
`sample_lengths` is the length draw alone (benchmarks/bench_attention.py packs documents with it).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
CORPUS = ROOT / "src/shardfit/data/corpus/field_guide.txt"
DEFAULTS = dict(n=20000, seed=0, median=400.0, sigma=1.0, min_len=16, max_len=8192, share_lo=0.2, share_hi=0.8)


def sample_lengths(n: int, rng: np.random.Generator, median: float = 400.0, sigma: float = 1.0,
                   min_len: int = 16, max_len: int = 8192) -> np.ndarray:
    """n total lengths (tokens, EOS included): log-normal with this median and sigma, rounded, clipped."""
    return np.clip(np.rint(np.exp(rng.normal(np.log(median), sigma, n))), min_len, max_len).astype(np.int64)


def generate(out: Path, n: int = DEFAULTS["n"], seed: int = DEFAULTS["seed"], median: float = DEFAULTS["median"],
             sigma: float = DEFAULTS["sigma"], min_len: int = DEFAULTS["min_len"], max_len: int = DEFAULTS["max_len"],
             share_lo: float = DEFAULTS["share_lo"], share_hi: float = DEFAULTS["share_hi"],
             quiet: bool = False) -> dict:
    """Write sft.jsonl, docs.jsonl and summary.json under `out`; return the summary."""
    if min_len < 3:
        raise ValueError("min_len must leave room for a prompt, a completion and the EOS (>= 3)")
    rng = np.random.default_rng(seed)
    total = sample_lengths(n, rng, median, sigma, min_len, max_len)
    share = rng.uniform(share_lo, share_hi, n)
    prompt = np.clip(np.rint(total * share).astype(np.int64), 1, total - 2)
    completion = total - prompt - 1  # + EOS = total
    words = [w for w in CORPUS.read_text(encoding="utf-8").split() if w.isascii() and w.isprintable()]
    need = int(total.sum())
    # One stream of random words, long enough for every example; example i cuts consecutive slices of it.
    mean_word = np.mean([len(w) + 1 for w in words])
    parts: list[str] = []
    have = 0
    while have < need:
        chunk = " ".join(words[int(i)] for i in rng.integers(0, len(words), int(need / mean_word) + 1024)) + " "
        parts.append(chunk)
        have += len(chunk)
    stream = "".join(parts)
    out.mkdir(parents=True, exist_ok=True)
    pos = 0
    with open(out / "sft.jsonl", "w", encoding="ascii") as f, open(out / "docs.jsonl", "w", encoding="ascii") as g:
        for p, c in zip(prompt.tolist(), completion.tolist()):
            pr, co = stream[pos:pos + p], stream[pos + p:pos + p + c]
            pos += p + c
            f.write(json.dumps({"prompt": pr, "completion": co}) + "\n")
            g.write(json.dumps({"text": pr + co}) + "\n")
    q = np.percentile(total, [50, 90, 99])
    summary = {
        "args": dict(n=n, seed=seed, median=median, sigma=sigma, min_len=min_len, max_len=max_len,
                     share_lo=share_lo, share_hi=share_hi),
        "examples": n, "median": float(q[0]), "p90": float(q[1]), "p99": float(q[2]), "max": int(total.max()),
        "mean": round(float(total.mean()), 1), "tokens": need, "loss_tokens": int(completion.sum() + n),
        # a row of 4,096 inputs holds an example of up to 4,097 tokens (inputs are tokens 0..T-2)
        "frac_over_4096": round(float((total > 4097).mean()), 5),
        "frac_at_clip": round(float((total >= max_len).mean()), 5),
        "padded_fill_4096": round(float(np.minimum(total - 1, 4096).mean() / 4096), 4),
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    if not quiet:
        print(f"{out}/sft.jsonl, docs.jsonl: {n:,} examples, seed {seed}; total length (tokens, EOS included): "
              f"median {q[0]:.0f}, p90 {q[1]:.0f}, p99 {q[2]:.0f}, max {total.max()}, mean {total.mean():.0f}; "
              f"{need:,} tokens, {summary['loss_tokens']:,} carry loss; "
              f"{summary['frac_over_4096']:.2%} longer than a 4,096-token row; "
              f"a padded 4,096 row is {summary['padded_fill_4096']:.1%} real tokens on average")
    return summary


def ensure(out: Path, **kw) -> Path:
    """The data set under `out`, generated unless summary.json says it was made with the same arguments."""
    want = {**DEFAULTS, **kw}
    s = out / "summary.json"
    if (s.is_file() and (out / "sft.jsonl").is_file() and (out / "docs.jsonl").is_file()
            and json.loads(s.read_text()).get("args") == want):
        return out
    generate(out, **want)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="directory for sft.jsonl, docs.jsonl, summary.json")
    ap.add_argument("--n", type=int, default=DEFAULTS["n"])
    ap.add_argument("--seed", type=int, default=DEFAULTS["seed"])
    ap.add_argument("--median", type=float, default=DEFAULTS["median"])
    ap.add_argument("--sigma", type=float, default=DEFAULTS["sigma"])
    ap.add_argument("--min-len", type=int, default=DEFAULTS["min_len"])
    ap.add_argument("--max-len", type=int, default=DEFAULTS["max_len"])
    a = ap.parse_args()
    generate(Path(a.out), n=a.n, seed=a.seed, median=a.median, sigma=a.sigma, min_len=a.min_len, max_len=a.max_len)
    return 0


if __name__ == "__main__":
    sys.exit(main())
