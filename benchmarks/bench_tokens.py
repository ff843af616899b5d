"""Corpus-scale data: `shardfit train` start-up and host memory on >= 2B tokens of shards, and `shardfit tokenize`
throughput.

    python benchmarks/bench_tokens.py                      # 2.1B tokens under /tmp, deleted afterwards
    python benchmarks/bench_tokens.py --tokens 2e8 --json ''   # a quick look, nothing saved

(a) A corpus of random byte-tokenizer ids (EOS closing documents of random length, mean 1,024 tokens) is written
directly as shards, in pieces of 64M tokens, through the same ShardWriter that `shardfit tokenize` uses: tokenizing
2B tokens of text on two cores would take the better part of an hour and measure nothing more. Then `shardfit train`
with the embedded tiny model runs on it with 1 and 2 ranks (`--nproc 2`); measured: seconds from process start to
the first step's log line, each rank's peak RSS (VmHWM) and the resident pages of shard files in each rank's address
space (smaps), and, in a separate probe process per rank, the RSS that building the datasets and the first step's
batches adds (everything the data costs a rank, maps and arrays).
(b) `shardfit tokenize` (the CLI, end to end) on the embedded corpus repeated to ~100 MB of JSON lines, 1 and 2
workers. Every figure is the median of --repeats runs (the 2-core box is shared with other users).

Prediction (written before the first run, 2-core CPU box): start-up is python + torch import (~3 s measured for
`import shardfit.data.token_shards`), model build and gloo init (~1 s), opening the shards (the manifest and 34 .npy
headers: milliseconds), the epoch permutation of 8.2M windows (~0.2 s, 66 MB of int64) and one tiny step (~0.5 s):
~5 s with 1 rank, ~8 s with 2 (torchrun, and two torch imports sharing two cores). Data RSS per rank: the
permutation (66 MB) plus the touched pages: 16 windows of 257 uint16 tokens sit on ~16 distinct pages of the token
maps, plus readahead, and each window's document lookup binary-searches doc_starts (~21 pages): a few MB. So ~70 MB
per rank, far under the 1 GB target; peak RSS ~400-500 MB per rank, nearly all torch. Tokenize: the byte tokenizer
is pure Python (list(bytes), then an array), ~10-20 MB/s per worker; 2 workers ~1.6x, less the ~3 s each spawned
worker spends importing torch through shardfit.data's package __init__.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np

from shardfit.data.token_shards import ShardWriter, tokenizer_identity
from shardfit.data.tokenizer import ByteTokenizer

PIECE_TOKENS = 1 << 26  # 64M uint16 tokens = 128 MB per piece: the size `shardfit tokenize` caps a piece near
TINY = ["--train.device=cpu", "--train.steps=2", "--logging.log_every=1", "--checkpoint.every=0"]


def generate(out: Path, n_tokens: int, mean_doc: int = 1024, seed: int = 0) -> dict:
    """Random documents (ids 0-255, EOS 257 closing each) as shards; memory: one piece at a time (~200 MB)."""
    tok = ByteTokenizer()
    n_pieces = -(-n_tokens // PIECE_TOKENS)
    sizes = [min(PIECE_TOKENS, n_tokens - i * PIECE_TOKENS) for i in range(n_pieces)]
    plan = {"inputs": [f"synthetic:{n_tokens}"], "input_format": "synthetic", "text_field": "",
            "tokenizer": tokenizer_identity("byte", tok), "dtype": "uint16",
            "pieces": [{"index": i, "bytes": s, "segments": []} for i, s in enumerate(sizes)]}
    writer = ShardWriter(out, plan)
    rng = np.random.default_rng(seed)
    t0 = time.perf_counter()
    for i, size in enumerate(sizes):
        if writer.done(i):
            continue
        tokens = rng.integers(0, 256, size, dtype=np.uint16)
        lengths = rng.geometric(1 / mean_doc, size // mean_doc * 2)
        ends = np.cumsum(lengths)
        ends = ends[ends < size]
        tokens[ends - 1] = tok.eos_id  # each document ends with EOS, like tokenize_documents' stream
        if not len(ends) or ends[-1] != size:
            tokens[-1] = tok.eos_id
        writer.write_piece(i, tokens, np.concatenate([[0], ends]).astype(np.int64))
    manifest = writer.finish()
    return {"seconds": time.perf_counter() - t0, "tokens": manifest["tokens"], "documents": manifest["documents"],
            "pieces": len(manifest["pieces"]), "bytes_on_disk": sum(p.stat().st_size for p in out.iterdir())}


def _status(pid: int) -> dict[str, int]:
    """VmHWM, VmRSS, RssAnon, RssFile of a process, in bytes ({} once it has gone)."""
    try:
        text = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return {}
    return {k: int(v.split()[0]) * 1024 for k, v in re.findall(r"^(VmHWM|VmRSS|RssAnon|RssFile):\s+(.*)$", text,
                                                                    re.M)}


def _shard_resident(pid: int, root: Path) -> int:
    """Resident bytes of the shard files mapped into a process (its smaps lines under the shard directory)."""
    total, inside = 0, False
    try:
        with open(f"/proc/{pid}/smaps") as f:
            for line in f:
                if re.match(r"^[0-9a-f]+-[0-9a-f]+ ", line):
                    inside = str(root) in line
                elif inside and line.startswith("Rss:"):
                    total += int(line.split()[1]) * 1024
    except OSError:
        pass
    return total


def _children(pid: int) -> list[int]:
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            out.append(int(stat.parent.name))
    return out


def measure_train(shards: Path | None, nproc: int, run_dir: Path) -> dict:
    """Process start to the first step's line, and per rank: peak RSS and resident shard pages. shards=None: the
    embedded corpus tokenized on the fly (16 KB of text), the baseline that shows what start-up costs without data."""
    data = [f"--data.path={shards}"] if shards else []
    cmd = [sys.executable, "-m", "shardfit", "train", *TINY, *data, f"--logging.run_dir={run_dir}"]
    if nproc > 1:
        cmd.append(f"--nproc={nproc}")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    t0 = time.perf_counter()
    shutil.rmtree(run_dir, ignore_errors=True)  # a fresh run each time, not a resume
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    first_step, lines = [None], []

    def read():
        for line in p.stdout:
            lines.append(line)
            if first_step[0] is None and re.search(r"step 1/", line):
                first_step[0] = time.perf_counter() - t0

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    ranks: dict[int, dict] = {}
    while p.poll() is None:
        pids = [p.pid] if nproc == 1 else [c for c in _children(p.pid)
                                            if "train" in Path(f"/proc/{c}/cmdline").read_text(errors="replace")]
        for pid in pids:
            st = _status(pid)
            if st:
                r = ranks.setdefault(pid, {"peak_rss": 0, "shard_resident": 0})
                r["peak_rss"] = max(r["peak_rss"], st["VmHWM"])
                if shards:
                    r["shard_resident"] = max(r["shard_resident"], _shard_resident(pid, shards))
        time.sleep(0.1)
    reader.join()
    if p.returncode != 0:
        raise SystemExit("".join(lines[-30:]))
    startup = [ln.strip() for ln in lines if ln.startswith("shardfit:")][:1]
    return {"nproc": nproc, "data": str(shards) if shards else "embedded corpus", "first_step_s": first_step[0],
            "total_s": time.perf_counter() - t0,
            "ranks": list(ranks.values()), "startup_line": startup[0] if startup else ""}


PROBE = """
import json, re, sys
from pathlib import Path
from shardfit.config import load_config
from shardfit.data.build import build_datasets
def rss():
    t = Path('/proc/self/status').read_text()
    return {k: int(v) * 1024 for k, v in re.findall(r'^(VmRSS|RssAnon|RssFile):\\s+(\\d+)', t, re.M)}
cfg = load_config(None, ['--data.path=' + sys.argv[1], '--train.device=cpu'])
rank, world = int(sys.argv[2]), int(sys.argv[3])
before = rss()
train, _, _ = build_datasets(cfg.data, cfg.model.vocab_size)
opened = rss()
train.step_batches(0, cfg.train.global_batch, cfg.train.global_batch // world, rank, world)
stepped = rss()
print(json.dumps({'opened': {k: opened[k] - before[k] for k in before},
                  'first_step': {k: stepped[k] - before[k] for k in before}, 'windows': train.num_windows}))
"""


def measure_data_rss(shards: Path, world: int) -> list[dict]:
    """Per rank, in a fresh process: RSS added by build_datasets, and by the first step's batches too."""
    out = []
    for rank in range(world):
        p = subprocess.run([sys.executable, "-c", PROBE, str(shards), str(rank), str(world)], capture_output=True,
                           text=True, check=True)
        out.append({"rank": rank, **json.loads(p.stdout.strip().splitlines()[-1])})
    return out


def text_corpus(path: Path, target_bytes: int) -> int:
    """The embedded corpus's paragraphs as JSON lines, repeated (each copy numbered) to about target_bytes."""
    from shardfit.data.sources import embedded_corpus

    docs = [json.dumps({"text": text}) for text, _ in embedded_corpus()]
    written, copy = 0, 0
    with open(path, "w") as f:
        while written < target_bytes:
            for d in docs:
                line = d[:-1] + f', "copy": {copy}}}\n'
                f.write(line)
                written += len(line)
            copy += 1
    return path.stat().st_size


def measure_tokenize(corpus: Path, out: Path, workers: int) -> dict:
    """The CLI end to end (wall, CPU of it and its workers), and the rate its own progress line reports (from the
    start of the work: without the ~3 s of interpreter and torch import)."""
    import resource

    shutil.rmtree(out, ignore_errors=True)
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    p = subprocess.run([sys.executable, "-m", "shardfit", "tokenize", str(corpus), "--out", str(out),
                        f"--workers={workers}"], check=True, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    m = json.loads((out / "manifest.json").read_text())
    rate = float(re.findall(r"([\d.]+)M tokens/s", p.stderr)[-1]) * 1e6
    return {"workers": workers, "seconds": wall, "tokens": m["tokens"], "pieces": len(m["pieces"]),
            "cpu_s": after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime,
            "input_mb_per_s": corpus.stat().st_size / wall / 1e6, "tokens_per_s_end_to_end": m["tokens"] / wall,
            "tokens_per_s_reported": rate, "loadavg_1min": os.getloadavg()[0]}


def median_run(measure, repeats: int) -> dict:
    """The run with the median first-step time of `repeats` (the box is shared: single runs are noisy)."""
    runs = sorted((measure() for _ in range(repeats)), key=lambda r: r.get("first_step_s") or r["seconds"])
    return {**runs[len(runs) // 2], "all_s": [r.get("first_step_s") or r["seconds"] for r in runs],
            "loadavg_1min": os.getloadavg()[0]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=float, default=2.1e9)
    ap.add_argument("--text-mb", type=float, default=100)
    ap.add_argument("--repeats", type=int, default=3, help="runs per measurement; the median is reported")
    ap.add_argument("--root", default="/tmp/shardfit_bench_tokens")
    ap.add_argument("--json", default="benchmarks/results/2026-11-23_cpu_tokens.json")
    ap.add_argument("--keep", action="store_true", help="leave the corpus under --root")
    a = ap.parse_args()
    root = Path(a.root)
    root.mkdir(parents=True, exist_ok=True)
    ram = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") / 2**30
    res: dict = {"machine": f"{os.cpu_count()}-core CPU box, {ram:.0f} GiB RAM", "python": sys.version.split()[0]}
    try:
        shards = root / "shards"
        res["generate"] = generate(shards, int(a.tokens))
        g = res["generate"]
        print(f"generated {g['tokens']:,} tokens, {g['documents']:,} documents, {g['pieces']} pieces, "
              f"{g['bytes_on_disk'] / 1e9:.2f} GB in {g['seconds']:.1f} s")
        os.sync()  # 4 GB of dirty pages written back now, not during the timed runs
        res["train"] = [median_run(lambda n=n: measure_train(shards, n, root / "run"), a.repeats) for n in (1, 2)]
        res["train_embedded_corpus"] = [median_run(lambda n=n: measure_train(None, n, root / "run"), a.repeats)
                                        for n in (1, 2)]
        res["data_rss"] = {str(n): measure_data_rss(shards, n) for n in (1, 2)}
        corpus = root / "text.jsonl"
        res["text_bytes"] = text_corpus(corpus, int(a.text_mb * 1e6))
        res["tokenize"] = [median_run(lambda w=w: measure_tokenize(corpus, root / "tok", w), a.repeats)
                           for w in (1, 2)]
    finally:
        if not a.keep:
            shutil.rmtree(root, ignore_errors=True)
    mb = 1e6
    print(f"\n(a) shardfit train start-up on {res['generate']['tokens']:,} tokens of shards, tiny model, "
          f"{res['machine']}")
    print(f"{'ranks':>5} {'to first step s':>15} {'peak RSS/rank MB':>17} {'shard pages/rank MB':>20} "
          f"{'data RSS/rank MB (probe)':>25}")
    for t in res["train"]:
        probe = res["data_rss"][str(t["nproc"])]
        peak = " / ".join(f"{r['peak_rss'] / mb:.0f}" for r in t["ranks"])
        pages = " / ".join(f"{r['shard_resident'] / mb:.1f}" for r in t["ranks"])
        data = " / ".join(f"{r['first_step']['VmRSS'] / mb:.0f}" for r in probe)
        print(f"{t['nproc']:>5} {t['first_step_s']:>15.2f} {peak:>17} {pages:>20} {data:>25}")
    for t in res["train_embedded_corpus"]:
        peak = " / ".join(f"{r['peak_rss'] / mb:.0f}" for r in t["ranks"])
        print(f"{t['nproc']:>5} {t['first_step_s']:>15.2f} {peak:>17}   (baseline: embedded 16 KB corpus, no shards)")
    print(f"\n(b) shardfit tokenize, {res['text_bytes'] / mb:.0f} MB of JSON lines, byte tokenizer")
    print(f"{'workers':>7} {'wall s':>7} {'CPU s':>6} {'MB/s end to end':>15} {'M tokens/s (progress line)':>27}")
    for t in res["tokenize"]:
        print(f"{t['workers']:>7} {t['seconds']:>7.1f} {t['cpu_s']:>6.1f} {t['input_mb_per_s']:>15.1f} "
              f"{t['tokens_per_s_reported'] / 1e6:>27.2f}")
    loads = ", ".join(f"{r['loadavg_1min']:.1f}" for r in res["train"] + res["tokenize"])
    print(f"1-minute load average after each measurement (the box is shared): {loads}")
    if a.json:
        Path(a.json).parent.mkdir(parents=True, exist_ok=True)
        Path(a.json).write_text(json.dumps(res, indent=1) + "\n")


if __name__ == "__main__":
    main()
