"""The attention variants of benchmarks/bench_doc_attention.py: one layer's document-masked attention over
Engine.forward's rows (Layout, Ctx), each variant a builder of a call over all rows (VARIANTS, FLEX_OPTIONS): flex
(shardfit's and with kernel_options), SDPA per document, padded bins, varlen and cuDNN ragged. The timing, checking
and report harness, and what each variant letter means, are bench_doc_attention.py's.
"""

from __future__ import annotations

import contextlib
import sys
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))  # rollouts, bench_attention
sys.path.insert(0, str(HERE.parent / "src"))  # shardfit, when it is not installed

from bench_attention import _sync  # noqa: E402
from rollouts import make_rollouts, to_datums, token_budget  # noqa: E402

from shardfit.models.attention import (  # noqa: E402
    DocumentMask,
    _compiled_flex,
    document_block_mask,
    document_ids,
    sdpa_attention,
    to_device,
    varlen_available,
)
from shardfit.rl.pack import pack_row, plan_datums  # noqa: E402

VOCAB = 151936  # Qwen3's (the rollouts' token ids only; the lengths do not depend on it)
SHAPES = {"moe": (32, 4, 128), "dense": (32, 8, 128)}  # query heads, KV heads, head_dim
CPU_SHAPES = {"moe": (8, 1, 16), "dense": (8, 2, 16)}
LAYERS = {"moe": 6, "dense": 36}  # the profiled forwards' layers (6 of Qwen3-30B-A3B's 48, all 36 of Qwen3-8B)

# kernel_options of the b variants (forward only, no grad). Inductor's own sm90 default for bf16, head_dim 128
# (what a runs with): BLOCK_M 128, BLOCK_N 64, 3 stages, 8 warps.
FLEX_OPTIONS = {  # in the order run (the deadline cuts the last first)
    "128x128w8s2": {"BLOCK_M": 128, "BLOCK_N": 128, "num_warps": 8, "num_stages": 2},
    "tma": {"USE_TMA": True},
    "prescale": {"PRESCALE_QK": True},
    "128x128w8s2+tma+prescale": {"BLOCK_M": 128, "BLOCK_N": 128, "num_warps": 8, "num_stages": 2, "USE_TMA": True,
                                 "PRESCALE_QK": True},
    "128x64w4s3": {"BLOCK_M": 128, "BLOCK_N": 64, "num_warps": 4, "num_stages": 3},
    "docstart": {},
    "128x128w8s3": {"BLOCK_M": 128, "BLOCK_N": 128, "num_warps": 8, "num_stages": 3},
    "128x64w8s2": {"BLOCK_M": 128, "BLOCK_N": 64, "num_warps": 8, "num_stages": 2},
    "64x128w4s3": {"BLOCK_M": 64, "BLOCK_N": 128, "num_warps": 4, "num_stages": 3},
}
# FlexKernelOptions' keys in torch 2.13 (used where this torch has no FlexKernelOptions to read them from)
KNOWN_FLEX_KEYS = {"num_warps", "num_stages", "BLOCK_M", "BLOCK_N", "BLOCK_M1", "BLOCK_N1", "BLOCK_M2", "BLOCK_N2",
                   "PRESCALE_QK", "ROWS_GUARANTEED_SAFE", "BLOCKS_ARE_CONTIGUOUS", "WRITE_DQ",
                   "FORCE_USE_FLEX_ATTENTION", "USE_TMA", "BACKEND"}


# --------------------------------------------------------------------------------------------------- the data
@dataclass
class Layout:
    """Engine.forward's rows for the rollouts: position ids, and each row's real documents (start, length)."""

    T: int
    pos: torch.Tensor  # [M, T] int64, host
    docs: list[list[tuple[int, int]]]  # per row, the datums' (start, length); the padded tail not listed
    stats: dict = field(default_factory=dict)

    @property
    def rows(self) -> int:
        return self.pos.shape[0]

    def real(self, dev: torch.device) -> torch.Tensor:
        """[M, T] bool: the documents' tokens (not the tail)."""
        r = torch.zeros(self.pos.shape, dtype=torch.bool)
        for m, docs in enumerate(self.docs):
            r[m, :sum(n for _, n in docs)] = True
        return r.to(dev)


def rollout_layout(scale: float, anchor, budget: int = 0) -> Layout:
    r = make_rollouts(VOCAB, scale=scale, anchor=anchor)
    datums = to_datums(r)
    T = budget or token_budget(r)
    plan = plan_datums(datums, T, 1, 1)
    coefs = [np.zeros(len(d), np.float32) for d in datums]
    pos, docs = [], []
    for items in plan.bins[0]:
        if not items:
            continue
        pos.append(pack_row(T, datums, items, coefs, set(), None)[2][0])  # the row's position ids
        starts = np.cumsum([0] + [len(datums[i]) for i in items])
        docs.append([(int(s), len(datums[i])) for s, i in zip(starts, items)])
    lengths = [n for d in docs for _, n in d]
    tails = [T - sum(n for _, n in d) for d in docs]
    stats = {"rows": len(docs), "T": T, "docs": len(lengths), "real_tokens": sum(lengths),
             "docs_per_row": [len(d) for d in docs], "tail_tokens": tails, "longest": max(lengths),
             "causal_pairs": sum(n * (n + 1) // 2 for n in lengths),
             "tail_pairs": sum(t * (t + 1) // 2 for t in tails)}
    return Layout(T, torch.stack(pos), docs, stats)


# ------------------------------------------------------------------------------------------------- variants
@dataclass
class Ctx:
    layout: Layout
    q: torch.Tensor  # [M, T, H, D]
    k: torch.Tensor  # [M, T, K, D]
    v: torch.Tensor
    dev: torch.device
    anchor: object
    masks: dict = field(default_factory=dict)  # kind -> per-row masks, built once per shape

    @property
    def gqa(self) -> bool:
        return self.k.shape[2] != self.q.shape[2]

    def doc_masks(self, kind: str) -> list:
        """DocumentMask.build per row (kind "flex" | "varlen"), as Engine.forward builds them."""
        if kind not in self.masks:
            self.masks[kind] = [DocumentMask.build(self.layout.pos[m:m + 1].clone(), kind, self.dev)
                                for m in range(self.layout.rows)]
        return self.masks[kind]

    def block_masks(self, mask_mod=None) -> list:
        """document_block_mask per row (never None: a one-document row gets its causal mask), optionally with
        another mask_mod over the same block lists."""
        key = ("blocks", mask_mod)
        if key not in self.masks:
            out = []
            for m in range(self.layout.rows):
                pos = self.layout.pos[m:m + 1]
                bm = document_block_mask(document_ids(pos), self.dev)
                if mask_mod is not None:
                    from torch.nn.attention.flex_attention import BlockMask

                    bm = BlockMask.from_kv_blocks(bm.kv_num_blocks, bm.kv_indices, bm.full_kv_num_blocks,
                                                  bm.full_kv_indices, BLOCK_SIZE=bm.BLOCK_SIZE,
                                                  mask_mod=mask_mod(pos, self.dev), seq_lengths=bm.seq_lengths)
                out.append(bm)
            self.masks[key] = out
        return self.masks[key]

    def cu_seqlens(self) -> list[tuple[torch.Tensor, int]]:
        """Per row (cu_seqlens on the device, longest document), from DocumentMask.build's varlen mask."""
        out = []
        for mask in self.doc_masks("varlen"):
            if mask is None:  # one document filling the row
                out.append((torch.tensor([0, self.layout.T], dtype=torch.int32, device=self.dev), self.layout.T))
            else:
                out.append((mask.cu_seqlens, mask.max_seqlen))
        return out

    def packed(self, parts, where) -> torch.Tensor:
        """Per-document outputs [1, H, n, D] -> [M, T, H, D] (zeros in the tails); `where` lists (row, start, n)."""
        out = torch.zeros_like(self.q)
        for o, (m, s, n) in zip(parts, where):
            out[m, s:s + n] = o[0].transpose(0, 1)
        return out


def rows_of(ctx: Ctx):
    """Each row's (q, k, v) as shardfit's attention receives them: [1, T, heads, D] (contiguous)."""
    return [(ctx.q[m:m + 1], ctx.k[m:m + 1], ctx.v[m:m + 1]) for m in range(ctx.layout.rows)]


def v_shardfit_flex(ctx: Ctx):
    masks, rows = ctx.doc_masks("flex"), rows_of(ctx)

    def run():
        return [sdpa_attention(q, k, v, mask) for (q, k, v), mask in zip(rows, masks)]

    return run, torch.cat, {}


def flex_option_keys() -> set[str]:
    try:
        from torch.nn.attention.flex_attention import FlexKernelOptions

        return set(FlexKernelOptions.__annotations__)
    except ImportError:
        return set(KNOWN_FLEX_KEYS)


def guarded_options(opts: dict) -> tuple[dict, list[str]]:
    """(the options this torch's FlexKernelOptions lists, the keys dropped)."""
    keys = flex_option_keys()
    kept = {k: v for k, v in opts.items() if k.removeprefix("fwd_").removeprefix("bwd_") in keys}
    return kept, sorted(set(opts) - set(kept))


def _docstart_mask_mod(pos: torch.Tensor, dev: torch.device):
    """Same document and causal as kv >= start[q] and kv <= q: start[q] = q - position[q] (documents are contiguous
    and their positions restart at 0), one value per query row."""
    start = to_device((torch.arange(pos.shape[1]) - pos[0]).to(torch.int32)[None], dev)

    def mask_mod(b, h, q_idx, kv_idx):
        return (kv_idx >= start[b, q_idx]) & (q_idx >= kv_idx)

    return mask_mod


def v_flex_options(name: str):
    def make(ctx: Ctx):
        opts, dropped = guarded_options(FLEX_OPTIONS[name])
        masks = ctx.block_masks(_docstart_mask_mod if name == "docstart" else None)
        if ctx.q.is_cuda:
            fn = _compiled_flex()  # shardfit's compiled function: a new set of options is a recompilation
        else:
            from torch.nn.attention.flex_attention import flex_attention as fn
        kw = {"kernel_options": opts} if opts else {}
        rows = [tuple(t.transpose(1, 2) for t in r) for r in rows_of(ctx)]

        def run():
            return [fn(q, k, v, block_mask=bm, enable_gqa=ctx.gqa, **kw).transpose(1, 2)
                    for (q, k, v), bm in zip(rows, masks)]

        return run, torch.cat, {"kernel_options": opts, **({"dropped_keys": dropped} if dropped else {})}

    return make


BACKENDS = {"cudnn": "CUDNN_ATTENTION", "flash": "FLASH_ATTENTION", "default": None, "math": "MATH"}


def sdpa_backend(name: str, dev: torch.device):
    """A context selecting SDPA's backend `name` (the math one on the CPU)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    if dev.type != "cuda":
        name = "math"
    if BACKENDS[name] is None:
        return contextlib.nullcontext()
    return sdpa_kernel([getattr(SDPBackend, BACKENDS[name])])


def _sdpa(q, k, v, gqa):
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)


def v_per_document(backend: str, graph: bool = False):
    def make(ctx: Ctx):
        where = [(m, s, n) for m, docs in enumerate(ctx.layout.docs) for s, n in docs]
        views = [tuple(t[m:m + 1, s:s + n].transpose(1, 2) for t in (ctx.q, ctx.k, ctx.v)) for m, s, n in where]

        def run():
            with sdpa_backend(backend, ctx.dev):
                return [_sdpa(q, k, v, ctx.gqa) for q, k, v in views]

        return (graphed(run) if graph else run), (lambda parts: ctx.packed(parts, where)), {"launches": len(where)}

    return make


def graphed(run):
    """`run` captured once in a CUDA graph (after one eager call: cuDNN plans, workspaces); returns a replayer that
    gives the captured call's (static) outputs."""
    run()
    _sync(torch.device("cuda"))
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        static = run()

    def replay():
        g.replay()
        return static

    return replay


def v_padded_bins(backend: str, convert: bool = False):
    """The anchor's padnm layout: its own bins_padded over the documents, right-padded, is_causal."""

    def make(ctx: Ctx):
        lay = ctx.layout
        where = [(m, s, n) for m, docs in enumerate(lay.docs) for s, n in docs]
        bins = ctx.anchor.bins_padded([n for _, _, n in where], lay.T)
        M, T, H, D = ctx.q.shape
        flat = [t.reshape(M * T, t.shape[2], D) for t in (ctx.q, ctx.k, ctx.v)]
        gather, src, dst = [], [], []  # per bin: [n * L] token indices; the padded slots that are real, their tokens
        for b in bins:
            L = max(where[i][2] for i in b)
            idx = torch.empty(len(b), L, dtype=torch.long)
            s_idx, d_idx = [], []
            for r, i in enumerate(b):
                m, s, n = where[i]
                tok = m * T + s + torch.arange(n)
                idx[r, :n] = tok
                idx[r, n:] = m * T + s  # padding reads the document's first token: right padding, causal: never seen
                s_idx.append(r * L + torch.arange(n))
                d_idx.append(tok)
            gather.append(idx.flatten().to(ctx.dev))
            src.append(torch.cat(s_idx).to(ctx.dev))
            dst.append(torch.cat(d_idx).to(ctx.dev))
        shapes = [(len(b), max(where[i][2] for i in b)) for b in bins]

        def padded(i):  # bin i's q, k, v: [n, heads, L, D] views of [n, L, heads, D]
            n, L = shapes[i]
            return [f.index_select(0, gather[i]).view(n, L, f.shape[1], D).transpose(1, 2) for f in flat]

        out_flat = torch.zeros(M * T, H, D, dtype=ctx.q.dtype, device=ctx.dev)  # tails stay 0

        def scatter(outs):
            for i, o in enumerate(outs):
                n, L = shapes[i]
                out_flat.index_copy_(0, dst[i], o.transpose(1, 2).reshape(n * L, H, D).index_select(0, src[i]))
            return out_flat.view(M, T, H, D)

        if convert:
            def run():
                with sdpa_backend(backend, ctx.dev):
                    return scatter([_sdpa(*padded(i), ctx.gqa) for i in range(len(bins))])

            return run, (lambda out: out.clone()), {"bins": shapes}
        pre = [padded(i) for i in range(len(bins))]

        def run_kernels():
            with sdpa_backend(backend, ctx.dev):
                return [_sdpa(q, k, v, ctx.gqa) for q, k, v in pre]

        pad_pairs = sum(n * L * (L + 1) // 2 for n, L in shapes)
        return run_kernels, (lambda outs: scatter(outs).clone()), {
            "bins": shapes, "padded_over_real_work": round(pad_pairs / lay.stats["causal_pairs"], 4)}

    return make


def _cuda_only(ctx: Ctx):
    if not ctx.q.is_cuda:
        raise Skipped("CUDA only")


class Skipped(Exception):
    pass


def v_shardfit_varlen(ctx: Ctx):
    _cuda_only(ctx)
    if not varlen_available():
        raise Skipped("torch.nn.attention.varlen missing")
    masks, rows = ctx.doc_masks("varlen"), rows_of(ctx)

    def run():
        return [sdpa_attention(q, k, v, mask) for (q, k, v), mask in zip(rows, masks)]

    return run, torch.cat, {}


def v_flash_varlen_gqa(ctx: Ctx):
    _cuda_only(ctx)
    cus, T = ctx.cu_seqlens(), ctx.layout.T
    rows = [tuple(t[0] for t in r) for r in rows_of(ctx)]  # [T, heads, D]

    def run():
        return [torch.ops.aten._flash_attention_forward(q, k, v, cu, cu, mx, mx, 0.0, True, False)[0]
                for (q, k, v), (cu, mx) in zip(rows, cus)]

    return run, (lambda outs: torch.stack(outs).view(-1, T, *outs[0].shape[1:])), {}


def v_cudnn_ragged(repeat: bool, static_max: bool = False):
    def make(ctx: Ctx):
        _cuda_only(ctx)
        cus, T = ctx.cu_seqlens(), ctx.layout.T
        if static_max:  # every row's bound the row length: one shape for cuDNN's plan cache and for torch.compile
            cus = [(cu, T) for cu, _ in cus]
        rows = [tuple(t[0] for t in r) for r in rows_of(ctx)]
        rep = ctx.q.shape[2] // ctx.k.shape[2]

        def run():
            outs = []
            for (q, k, v), (cu, mx) in zip(rows, cus):
                if repeat and rep > 1:
                    k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
                outs.append(torch.ops.aten._cudnn_attention_forward(q, k, v, None, cu, cu, mx, mx, False, 0.0, True,
                                                                    False)[0])
            return outs

        return run, (lambda outs: torch.stack(outs).view(-1, T, *outs[0].shape[1:])), {}

    return make


# id -> (tier, maker, description). Tier 0 runs for both shapes first, then tier 1 (moe, then dense).
VARIANTS = {
    "a": (0, v_shardfit_flex, "flex, shardfit today (default kernel options)"),
    **{f"b:{n}": (1, v_flex_options(n), f"flex {n}") for n in FLEX_OPTIONS},
    "c:cudnn": (0, v_per_document("cudnn"), "SDPA per document, cuDNN"),
    "c:flash": (0, v_per_document("flash"), "SDPA per document, flash"),
    "c:cudnn+graph": (0, v_per_document("cudnn", graph=True), "per document, cuDNN, CUDA graph"),
    "c:flash+graph": (0, v_per_document("flash", graph=True), "per document, flash, CUDA graph"),
    "d:default": (0, v_padded_bins("default"), "anchor bins padded, SDPA default"),
    "d:cudnn": (0, v_padded_bins("cudnn"), "anchor bins padded, cuDNN"),
    "d:flash": (0, v_padded_bins("flash"), "anchor bins padded, flash"),
    "d:cudnn+convert": (0, v_padded_bins("cudnn", convert=True), "padded cuDNN + gather/scatter"),
    "e": (0, v_shardfit_varlen, "varlen, shardfit (K/V repeated)"),
    "f": (0, v_flash_varlen_gqa, "varlen FA2 direct, GQA (no repeat)"),
    "g": (0, v_cudnn_ragged(False), "cuDNN ragged, GQA"),
    "g:rep": (0, v_cudnn_ragged(True), "cuDNN ragged, K/V repeated"),
    "g:maxT": (0, v_cudnn_ragged(False, True), "cuDNN ragged, GQA, max_seqlen = T"),
    "g:rep+maxT": (0, v_cudnn_ragged(True, True), "cuDNN ragged, repeated, max_seqlen = T"),
}
CUDA_ONLY_LABELS = ("+graph",)

