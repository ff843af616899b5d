"""Causal self-attention kernels, plain and document-masked.

A packed row holds several documents. With document masking a token attends only to earlier tokens of its own
document, and its RoPE position counts from that document's start. Both come from one tensor: the row's position
ids [b, S], which restart at 0 where a document starts. `DocumentMask.build` turns the full position ids of a
micro-batch into what the chosen kernel reads, once per micro-batch, on the host side of the step and outside any
checkpointed or compiled region. Under activation checkpointing the recomputation then reads the very same object,
and under Ulysses sequence parallelism every rank of a group builds it from the same full position ids (the kernel
runs after the all-to-all, on all S tokens of its heads), so no exchange is ever needed for it.

Kernels, on q [B, S, H, Dh] and k/v [B, S, K, Dh] (grouped-query: K divides H):
  sdpa    SDPA with a dense boolean mask [B, 1, S, S]: the reference the CPU tests use (mask: S^2 bytes a row);
  varlen  FlashAttention over cumulative sequence lengths (torch.nn.attention.varlen): the B rows are one
          flattened sequence of B*S tokens cut at every document start; no mask in memory, no masked tiles;
  flex    FlexAttention with a document block mask (torch.nn.attention.flex_attention, compiled): tiles that
          cross documents are skipped.
Which is faster on a GPU is measured (benchmarks/bench_attention.py, bench_train.py's docmask8b);
parallel.doc_attention=auto takes the winner: flex.
"""

from __future__ import annotations

import functools
import inspect
from dataclasses import dataclass

import torch
import torch.nn.functional as F


def sdpa_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   mask: DocumentMask | None = None) -> torch.Tensor:
    """Causal attention. q [B, S, H, Dh], k/v [B, S, K, Dh] -> [B, S, H, Dh]; document-masked when mask is given.

    enable_gqa lets SDPA's flash/cuDNN kernels read the K heads directly: no [B, H, S, Dh] copy of k and v.
    """
    if mask is not None:
        return KERNELS[mask.kernel](q, k, v, mask)
    q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # [B, H|K, S, Dh]
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=k.shape[1] != q.shape[1])
    return out.transpose(1, 2)


@dataclass
class DocumentMask:
    """Where the documents of one micro-batch start, in the form `kernel` reads. Build it with `build`."""

    kernel: str  # "sdpa" | "varlen" | "flex"
    dense: torch.Tensor | None = None  # sdpa: [B, 1, S, S] bool, True where attention is allowed
    cu_seqlens: torch.Tensor | None = None  # varlen: [docs + 1] int32 offsets into the B*S flattened tokens
    max_seqlen: int = 0  # varlen: the longest document
    block_mask: object = None  # flex: a BlockMask over [B, 1, S, S]

    @staticmethod
    def build(position_ids: torch.Tensor, kernel: str, device: torch.device) -> DocumentMask | None:
        """From the full position ids [B, S] of a micro-batch (a document starts where they are 0). None when every
        row is one document from its first token: plain causal attention is then exactly the masked one."""
        starts = position_ids == 0
        starts[:, 0] = True  # a row always starts a document (a window may begin inside one: positions restart)
        if int(starts.sum()) == starts.shape[0]:
            return None
        B, S = position_ids.shape
        if kernel == "varlen":
            # Offsets of every document in the flattened [B*S] tokens, then the end.
            flat = torch.nonzero(starts.reshape(-1)).flatten()
            cu = torch.cat([flat, torch.tensor([B * S])]).to(torch.int32)
            max_len = int((cu[1:] - cu[:-1]).max())
            return DocumentMask("varlen", cu_seqlens=cu.to(device, non_blocking=True), max_seqlen=max_len)
        doc = (starts.cumsum(1) - 1).to(torch.int32).to(device)  # [B, S] document index within the row
        if kernel == "flex":
            from torch.nn.attention.flex_attention import create_block_mask

            def same_document_causal(b, h, q_idx, kv_idx):
                return (doc[b, q_idx] == doc[b, kv_idx]) & (q_idx >= kv_idx)

            return DocumentMask("flex", block_mask=create_block_mask(same_document_causal, B, None, S, S,
                                                                     device=str(device)))
        causal = torch.ones(S, S, dtype=torch.bool, device=device).tril_()
        dense = (doc[:, :, None] == doc[:, None, :]) & causal  # [B, S, S]
        return DocumentMask("sdpa", dense=dense[:, None])


def _dense_masked(q, k, v, mask: DocumentMask) -> torch.Tensor:
    q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # [B, H|K, S, Dh]
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask.dense, enable_gqa=k.shape[1] != q.shape[1])
    return out.transpose(1, 2)


@functools.lru_cache(maxsize=1)
def _varlen_api():
    """torch.nn.attention.varlen.varlen_attn and how this release spells causality and grouped-query heads: newer
    releases take window_size=(-1, 0) and enable_gqa, the first ones (2.10) is_causal and equal head counts."""
    from torch.nn.attention.varlen import varlen_attn

    params = inspect.signature(varlen_attn).parameters
    return varlen_attn, "window_size" in params, "enable_gqa" in params


def varlen_available() -> bool:
    try:
        _varlen_api()
    except ImportError:
        return False
    return True


def _varlen(q, k, v, mask: DocumentMask) -> torch.Tensor:
    B, S, H, Dh = q.shape
    fn, has_window, has_gqa = _varlen_api()
    if k.shape[2] != H and not has_gqa:  # older releases: repeat the K/V heads up to H (grouped-query order kept)
        k, v = (t.repeat_interleave(H // t.shape[2], dim=2) for t in (k, v))
    q, k, v = (t.reshape(B * S, t.shape[2], Dh) for t in (q, k, v))  # [B*S, heads, Dh]: views, no copy
    kw = {"window_size": (-1, 0)} if has_window else {"is_causal": True}
    if has_gqa:
        kw["enable_gqa"] = k.shape[1] != H
    cu, m = mask.cu_seqlens, mask.max_seqlen
    return fn(q, k, v, cu, cu, m, m, **kw).view(B, S, H, Dh)


@functools.lru_cache(maxsize=1)
def _compiled_flex():
    # FlexAttention must be compiled to run its fused kernel (eager falls back to a dense reference); inside an
    # already compiled block dynamo inlines this call.
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, dynamic=False)


def _flex(q, k, v, mask: DocumentMask) -> torch.Tensor:
    q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # [B, H|K, S, Dh]
    if q.is_cuda:
        fn = _compiled_flex()
    else:  # eager: the dense reference FlexAttention falls back to (the CPU tests check the block mask with it)
        from torch.nn.attention.flex_attention import flex_attention as fn
    out = fn(q, k, v, block_mask=mask.block_mask, enable_gqa=k.shape[1] != q.shape[1])
    return out.transpose(1, 2)


KERNELS = {"sdpa": _dense_masked, "varlen": _varlen, "flex": _flex}


# Below this many tokens a row, Inductor lowers FlexAttention to its decoding kernel, which in torch 2.11 has no
# kernel for training (CUDA tests at sequence 64: "NoValidChoicesError"); auto then takes varlen.
FLEX_MIN_TOKENS = 128


def choose_doc_kernel(kind: str, device: torch.device, row_tokens: int = FLEX_MIN_TOKENS) -> str:
    """parallel.doc_attention resolved for this device and row length (tokens per row of a micro-batch). The CPU
    always uses the dense reference (FlashAttention's varlen kernel is CUDA-only; FlexAttention would compile a CPU
    kernel per shape)."""
    if device.type != "cuda":
        return "sdpa"
    if kind == "auto" and row_tokens < FLEX_MIN_TOKENS:
        return "varlen" if varlen_available() else "sdpa"
    if kind == "auto":
        # Measured (benchmarks/NOTES.md, session 6, Llama-3-8B packed pretraining, compiled, 2 x H200): flex at
        # micro-batch 4 ran 1.02x the unmasked step with its memory; varlen 0.83x, because torch 2.11's varlen has
        # no grouped-query heads, so K/V are repeated to all 32 heads and saved for backward (+6 GiB, over the
        # edge: allocator retries). varlen stays the choice where FlexAttention is missing.
        return "flex" if flex_available() else "varlen"
    return kind


def flex_available() -> bool:
    try:
        from torch.nn.attention.flex_attention import create_block_mask  # noqa: F401
    except ImportError:
        return False
    return True
