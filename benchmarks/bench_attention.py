"""Document-masked attention kernels at the Llama-3-8B attention shape, forward + backward (issue 12).

  python benchmarks/bench_attention.py --out attn.json                       # GPU: bf16, seq 4096, rows 4,2,1
  python benchmarks/bench_attention.py --device cpu --seq 256 --reps 2 --mask-seqs 2048   # CPU smoke run (fp32)
  python benchmarks/bench_attention.py --rows "" --out mask.json             # GPU: the mask-build memory case only

Shape: q [B, S, 32, 128], k/v [B, S, 8, 128] (grouped-query, Llama-3-8B), bf16 on CUDA. A micro-batch of B rows is
made the way shardfit packs fine-tuning examples: document lengths drawn from the benchmark set's distribution
(benchmarks/gen_sft_data.py: log-normal, median 400, sigma 1.0, clipped to [16, 8192]; a document is min(T - 1, S)
tokens, as shardfit feeds an example of T tokens), packed first-fit into rows of S tokens by shardfit's own
`pack_rows`, the row's tail padding a document of its own (`concat_documents`). --batches distinct micro-batches
are made per B and timed in turn.

Kernels, each through shardfit's code path (src/shardfit/models/attention.py):
  causal  `sdpa_attention(q, k, v)`: plain causal SDPA, no mask (attends across documents): the unmasked ceiling;
  varlen  `DocumentMask.build(position_ids, "varlen", device)` then `sdpa_attention(q, k, v, mask)`;
  flex    the same with "flex" (FlexAttention, compiled, document block mask);
  sdpa    the same with "sdpa" (a dense [B, 1, S, S] boolean mask: the CPU reference).
Each is timed with CUDA events (wall clock on the CPU): forward alone and forward + backward (gradients of q, k, v
from a fixed random output gradient), --warmup untimed runs on the first micro-batch, then --reps runs of each
micro-batch; the median is reported. `DocumentMask.build` is timed separately per micro-batch: host (until it
returns) and total (until the device has finished: host + device), median. Peak allocated memory per kernel is
the largest over its runs. "work" is sum(len^2) / (B x S^2) of the micro-batches: the share of a causal row's
score tiles that document masking leaves (plus what the kernels' tile edges add).

Mask-build memory (--mask-seqs, default 16384,32768 on CUDA): FlexAttention's block mask for --mask-rows rows of
each length, built both ways: "create_block_mask" (document_block_mask_reference, shardfit's build before: it
evaluates the mask_mod on every (query, key) pair: ~10 bytes per pair live at once, measured on the CPU: the S^2
bool mask, its padded copy and that copy's int64 cast for the per-block sums; 2.5 GiB a 16,384-token row, 10 GiB at
32,768) and "from_blocks"
(document_block_mask, what DocumentMask.build does now: [S/128, S/128] tables, ~1 MiB a row). Reported per way:
peak device memory allocated during the build above what was allocated before it (torch.cuda.max_memory_allocated;
the CPU run reports time only), what the mask keeps, host + device ms; and whether both gave the same blocks.

Prints a table; --out writes everything as JSON.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))  # gen_sft_data, beside this file
sys.path.insert(0, str(HERE.parent / "src"))  # shardfit, when it is not installed

from gen_sft_data import sample_lengths  # noqa: E402

from shardfit.data.sft_packed import concat_documents, pack_rows  # noqa: E402
from shardfit.models.attention import (  # noqa: E402
    DocumentMask,
    choose_doc_kernel,
    document_block_mask,
    document_block_mask_reference,
    document_ids,
    sdpa_attention,
)

KERNELS = ("causal", "varlen", "flex", "sdpa")


def packed_position_ids(rows: int, seq: int, rng: np.random.Generator, median: float, sigma: float
                        ) -> tuple[torch.Tensor, dict]:
    """[rows, seq] position ids of packed documents (0 where a document starts) and their statistics."""
    need = rows * seq
    lengths = np.zeros(0, dtype=np.int64)
    while True:
        lengths = np.concatenate([lengths, np.minimum(sample_lengths(4 * need // 400 + 64, rng, median, sigma) - 1,
                                                      seq)])
        packed = pack_rows(lengths, seq)
        if len(packed) > rows + 64:  # the first rows are closed full; the last ones are still open
            break
    pos, docs, fill, sq = [], 0, 0, 0
    for r in packed[:rows]:
        parts = [(np.zeros(lengths[i], np.int64), np.zeros(lengths[i], np.int64), np.arange(lengths[i]))
                 for i in r]
        _, _, p, real = concat_documents(parts, seq, 0)
        pos.append(p)
        docs += len(r)
        fill += real
        sq += int(sum(int(lengths[i]) ** 2 for i in r)) + (seq - real) ** 2
    return torch.from_numpy(np.stack(pos)), {"docs": docs, "fill": fill / need, "work": sq / (rows * seq * seq)}


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def time_build(pos: torch.Tensor, kernel: str, dev: torch.device) -> tuple[DocumentMask | None, float, float]:
    """(mask, host ms, host + device ms) of one DocumentMask.build."""
    _sync(dev)
    t0 = time.perf_counter()
    mask = DocumentMask.build(pos, kernel, dev)
    t1 = time.perf_counter()
    _sync(dev)
    t2 = time.perf_counter()
    return mask, (t1 - t0) * 1e3, (t2 - t0) * 1e3


def time_kernel(q, k, v, g, mask, dev: torch.device) -> tuple[float, float]:
    """(forward ms, forward + backward ms) of one call."""
    q.grad = k.grad = v.grad = None
    if dev.type == "cuda":
        ev = [torch.cuda.Event(enable_timing=True) for _ in range(3)]
        ev[0].record()
        out = sdpa_attention(q, k, v, mask)
        ev[1].record()
        out.backward(g)
        ev[2].record()
        ev[2].synchronize()
        return ev[0].elapsed_time(ev[1]), ev[0].elapsed_time(ev[2])
    t0 = time.perf_counter()
    out = sdpa_attention(q, k, v, mask)
    t1 = time.perf_counter()
    out.backward(g)
    t2 = time.perf_counter()
    return (t1 - t0) * 1e3, (t2 - t0) * 1e3


MASK_BUILDS = {"create_block_mask": document_block_mask_reference, "from_blocks": document_block_mask}
BLOCK_FIELDS = ("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices")


def bench_mask_memory(seq: int, a, dev: torch.device, rng: np.random.Generator) -> dict:
    """Peak memory and time of building one micro-batch's FlexAttention block mask, each way (MASK_BUILDS)."""
    pos, stats = packed_position_ids(a.mask_rows, seq, rng, a.median, a.sigma)
    doc = document_ids(pos)
    out = {"seq": seq, "rows": a.mask_rows, "docs_per_row": stats["docs"] / a.mask_rows, "builds": {}}
    masks = {}
    for name, build in MASK_BUILDS.items():
        rec: dict = {}
        try:
            build(doc[:, :256], dev)  # warm-up: imports, the first kernels' launch overheads
            _sync(dev)
            if dev.type == "cuda":
                torch.cuda.reset_peak_memory_stats(dev)
                base = torch.cuda.memory_allocated(dev)
            t0 = time.perf_counter()
            mask = build(doc, dev)
            _sync(dev)
            rec["ms"] = round((time.perf_counter() - t0) * 1e3, 3)
            if dev.type == "cuda":
                rec["peak_GiB"] = round((torch.cuda.max_memory_allocated(dev) - base) / 2**30, 4)
                rec["kept_MiB"] = round((torch.cuda.memory_allocated(dev) - base) / 2**20, 3)
            masks[name] = mask
        except Exception as e:  # e.g. out of memory for create_block_mask at a long row: say so, go on
            rec["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"
        out["builds"][name] = rec
    if len(masks) == 2:
        a_, b_ = masks.values()
        out["same_blocks"] = all(torch.equal(getattr(a_, f), getattr(b_, f)) for f in BLOCK_FIELDS)
    return out


def bench(rows: int, a, dev: torch.device, dtype: torch.dtype, rng: np.random.Generator) -> dict:
    layouts = [packed_position_ids(rows, a.seq, rng, a.median, a.sigma) for _ in range(a.batches)]
    gen = torch.Generator(device=dev).manual_seed(0)
    shape_q, shape_kv = (rows, a.seq, a.heads, a.head_dim), (rows, a.seq, a.kv_heads, a.head_dim)
    q = torch.randn(shape_q, device=dev, dtype=dtype, generator=gen).requires_grad_()
    k = torch.randn(shape_kv, device=dev, dtype=dtype, generator=gen).requires_grad_()
    v = torch.randn(shape_kv, device=dev, dtype=dtype, generator=gen).requires_grad_()
    g = torch.randn(shape_q, device=dev, dtype=dtype, generator=gen)
    out = {"rows": rows, "docs_per_row": sum(s["docs"] for _, s in layouts) / (rows * a.batches),
           "fill": statistics.mean(s["fill"] for _, s in layouts),
           "work": statistics.mean(s["work"] for _, s in layouts), "kernels": {}}
    for kernel in a.kernels:
        rec: dict = {}
        try:
            masks, host, total = [], [], []
            for pos, _ in layouts:
                if kernel == "causal":
                    masks.append(None)
                    continue
                for _ in range(2 if not masks else 1):  # the first build of a kernel warms it up (imports, compile)
                    m, h, t = time_build(pos.clone(), kernel, dev)
                host.append(h)
                total.append(t)
                masks.append(m)
            unmasked = sum(1 for m in masks if m is None) if kernel != "causal" else 0
            if unmasked:  # build returns None where every row is one document: that layout runs plain causal
                rec["layouts_without_mask"] = unmasked
            if host:
                rec["build_host_ms"] = round(statistics.median(host), 4)
                rec["build_total_ms"] = round(statistics.median(total), 4)
            for _ in range(a.warmup):
                time_kernel(q, k, v, g, masks[0], dev)
            if dev.type == "cuda":
                torch.cuda.reset_peak_memory_stats(dev)
                base = torch.cuda.memory_allocated(dev)
            fwd, both = [], []
            for _ in range(a.reps):
                for m in masks:
                    f, b = time_kernel(q, k, v, g, m, dev)
                    fwd.append(f)
                    both.append(b)
            rec.update(fwd_ms=round(statistics.median(fwd), 4), fwd_bwd_ms=round(statistics.median(both), 4),
                       fwd_bwd_min_ms=round(min(both), 4), runs=len(both))
            if dev.type == "cuda":
                rec["peak_extra_GiB"] = round((torch.cuda.max_memory_allocated(dev) - base) / 2**30, 3)
            del masks
        except Exception as e:  # a kernel this build lacks (varlen on the CPU, flex without triton): say so, go on
            rec["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"
        out["kernels"][kernel] = rec
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    ap.add_argument("--dtype", default="", help="bfloat16 (CUDA default) or float32 (CPU default)")
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--rows", default="4,2,1", help="micro-batch sizes (rows of --seq tokens), comma-separated, in the "
                    "order run (4 first: the micro-batch of the 8B runs)")
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--kernels", default=",".join(KERNELS))
    ap.add_argument("--batches", type=int, default=4, help="distinct micro-batches (document layouts) per size")
    ap.add_argument("--reps", type=int, default=10, help="timed runs of each micro-batch")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--median", type=float, default=400.0, help="document length distribution (gen_sft_data.py)")
    ap.add_argument("--sigma", type=float, default=1.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--mask-seqs", default=None, help="row lengths of the mask-build memory case, comma-separated "
                    "(default 16384,32768 on CUDA, 2048 on the CPU; empty: skip it)")
    ap.add_argument("--mask-rows", type=int, default=1, help="rows of the mask-build memory case's micro-batch")
    ap.add_argument("--out", default="")
    a = ap.parse_args()
    a.kernels = [x for x in a.kernels.split(",") if x]
    unknown = set(a.kernels) - set(KERNELS)
    if unknown:
        ap.error(f"unknown kernels {sorted(unknown)}; choose from {', '.join(KERNELS)}")
    if a.device == "cuda" and not torch.cuda.is_available():
        ap.error("no CUDA device; use --device cpu for the smoke run")
    dev = torch.device(a.device, 0) if a.device == "cuda" else torch.device("cpu")
    dtype = getattr(torch, a.dtype or ("bfloat16" if a.device == "cuda" else "float32"))
    rng = np.random.default_rng(a.seed)
    env = {"device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu", "torch": torch.__version__,
           "dtype": str(dtype).removeprefix("torch."), "seq": a.seq, "heads": a.heads, "kv_heads": a.kv_heads,
           "head_dim": a.head_dim, "batches": a.batches, "reps": a.reps,
           "auto_kernel": choose_doc_kernel("auto", dev)}
    if a.mask_seqs is None:
        a.mask_seqs = "16384,32768" if dev.type == "cuda" else "2048"
    results, mask_results = [], []

    def save():  # after each case: a run cut short keeps what it measured
        if a.out:
            Path(a.out).write_text(json.dumps({"env": env, "results": results, "mask_memory": mask_results},
                                              indent=1) + "\n")

    for seq in [int(x) for x in a.mask_seqs.split(",") if x]:
        mask_results.append(bench_mask_memory(seq, a, dev, rng))
        print(json.dumps(mask_results[-1]), flush=True)
        save()
    for rows in [int(x) for x in a.rows.split(",") if x]:
        r = bench(rows, a, dev, dtype, rng)
        results.append(r)
        print(json.dumps(r), flush=True)
        save()
    print(f"\n{env['device']}, torch {env['torch']}, {env['dtype']}, q [B, {a.seq}, {a.heads}, {a.head_dim}], "
          f"k/v {a.kv_heads} heads; compute.doc_attention=auto -> {env['auto_kernel']}")
    print(f"{'B':>2} {'docs/row':>8} {'work':>5} {'kernel':>7} {'fwd ms':>8} {'fwd+bwd ms':>10} {'vs causal':>9} "
          f"{'build host/total ms':>20} {'extra GiB':>9}")
    for r in results:
        base = r["kernels"].get("causal", {}).get("fwd_bwd_ms")
        for name, k in r["kernels"].items():
            if "error" in k:
                print(f"{r['rows']:>2} {r['docs_per_row']:>8.1f} {r['work']:>5.2f} {name:>7} {k['error'][:80]}")
                continue
            vs = f"{k['fwd_bwd_ms'] / base:.2f}x" if base else "-"
            build = f"{k['build_host_ms']:.2f}/{k['build_total_ms']:.2f}" if "build_host_ms" in k else "-"
            note = f"  ({k['layouts_without_mask']} of {a.batches} unmasked: one document a row)" \
                if k.get("layouts_without_mask") else ""
            print(f"{r['rows']:>2} {r['docs_per_row']:>8.1f} {r['work']:>5.2f} {name:>7} {k['fwd_ms']:>8.3f} "
                  f"{k['fwd_bwd_ms']:>10.3f} {vs:>9} {build:>20} {k.get('peak_extra_GiB', '-'):>9}{note}")
    if mask_results:
        print(f"\nFlexAttention block mask build, {a.mask_rows} row(s): peak GiB above the start / kept MiB / ms")
        for m in mask_results:
            cells = [f"{n}: {r['error'][:60]}" if "error" in r else
                     f"{n}: {r.get('peak_GiB', '-')} / {r.get('kept_MiB', '-')} / {r['ms']}"
                     for n, r in m["builds"].items()]
            print(f"S={m['seq']:>6}  " + "   ".join(cells) + f"   same blocks: {m.get('same_blocks', '-')}")
    save()
    return 0


if __name__ == "__main__":
    sys.exit(main())
