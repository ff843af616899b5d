"""Attention of each row's new queries over that row's own blocks of the paged KV cache (sampling/kv.py).

Shapes: B rows, S new tokens per row (1 when decoding, a prompt chunk when prefilling), H query heads, K key/value
heads, Dh head size, M blocks per row (the table's width, padded with the trash block), bs tokens per block,
T = M x bs keys per row.

- "gather" (the reference, every device, capturable in a CUDA graph at fixed B, S, M): the row's blocks gathered by
  its table into k, v [B, T, K, Dh], then SDPA with a per-row mask: key t is visible to the query at position p iff
  t <= p. That one rule is causal inside a prefill chunk, covers everything cached before it, and hides the table's
  padding and the unwritten tail of the last block (they lie past p).
- "flex" (CUDA): the same gathered keys through FlexAttention with the rule as its mask_mod, compiled once; it skips
  the work of masked key blocks (a long table with short rows) that SDPA's dense mask pays for. The gather itself is
  the same, so both paths read the same bytes (measured against each other in benchmarks/README.md).
- "triton" (CUDA with Triton; the Sampler's default there, "auto"): decoding reads each row's keys in place through
  its table (kernels/paged_attention.py), once instead of three times; a prefill chunk takes the gather path.
Whatever the path, a forward of prompts' first chunks (PagedKV.bind's fresh: every row starts at position 0) takes
`causal_attention` over its own keys: nothing cached before it, so nothing to gather and no mask to build.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def gather_blocks(pool: torch.Tensor, tables: torch.Tensor) -> torch.Tensor:
    """pool [n_blocks + 1, bs, K, Dh], tables [B, M] -> [B, M x bs, K, Dh]: each row's keys (or values) in order."""
    return pool[tables].flatten(1, 2)


def visible(positions: torch.Tensor, n_keys: int) -> torch.Tensor:
    """[B, S, T] bool: key t visible to the query at positions[b, s] (t <= that position)."""
    keys = torch.arange(n_keys, device=positions.device)
    return keys[None, None, :] <= positions[:, :, None]


def gather_attention(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, tables: torch.Tensor,
                     positions: torch.Tensor) -> torch.Tensor:
    """q [B, S, H, Dh] at positions [B, S] over the row's blocks -> [B, S, H, Dh].

    Grouped queries: the G = H / K query heads of a key/value head (heads k*G .. k*G+G-1, Hugging Face's layout) are
    stacked as G x S queries of that head, so SDPA reads each gathered key once instead of repeating it per query
    head (what enable_gqa's math path does)."""
    B, S, H, Dh = q.shape
    K = k_pool.shape[2]
    G = H // K
    k = gather_blocks(k_pool, tables).transpose(1, 2)  # [B, K, T, Dh]
    v = gather_blocks(v_pool, tables).transpose(1, 2)
    qg = q.view(B, S, K, G, Dh).permute(0, 2, 1, 3, 4).reshape(B, K, S * G, Dh)  # query (s, g) at row s * G + g
    mask = visible(positions, k.shape[2]).repeat_interleave(G, dim=1)[:, None]  # [B, 1, S x G, T]
    out = F.scaled_dot_product_attention(qg, k, v, attn_mask=mask)  # [B, K, S x G, Dh]
    return out.view(B, K, S, G, Dh).permute(0, 2, 1, 3, 4).reshape(B, S, H, Dh)


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """q [B, S, H, Dh], k/v [B, S, K, Dh] of rows that start at position 0 -> [B, S, H, Dh]: query s sees keys
    0 .. s of its row (a row's padding lies after its real tokens, so no real query sees it). SDPA's causal form
    with grouped heads: FlashAttention on CUDA in bf16/fp16, no [S, T] mask."""
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True,
                                         enable_gqa=k.shape[2] != q.shape[2])  # [B, H, S, Dh]
    return out.transpose(1, 2)


_FLEX = {}


def flex_block_mask(positions: torch.Tensor, n_keys: int):
    """The visibility rule as FlexAttention's block mask for queries at positions [B, S] over n_keys keys: built once
    per forward (PagedKV.bind), used by every layer."""
    from torch.nn.attention.flex_attention import create_block_mask

    def mask_mod(b, h, q_idx, kv_idx):
        return kv_idx <= positions[b, q_idx]

    B, S = positions.shape
    return create_block_mask(mask_mod, B, None, S, n_keys, device=positions.device)


def flex_attention_paged(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, tables: torch.Tensor,
                         block_mask) -> torch.Tensor:
    """The gather path's keys through FlexAttention with the visibility rule as a block mask (CUDA)."""
    from torch.nn.attention.flex_attention import flex_attention

    if "fn" not in _FLEX:
        # static shapes, a compile per (rows, table width): Inductor's CPU code for dynamic ones does not build
        # (torch 2.13); the runner rounds widths to buckets so that a steady batch compiles once
        _FLEX["fn"] = torch.compile(flex_attention, dynamic=False)
    k = gather_blocks(k_pool, tables).transpose(1, 2)  # [B, K, T, Dh]
    v = gather_blocks(v_pool, tables).transpose(1, 2)
    out = _FLEX["fn"](q.transpose(1, 2), k, v, block_mask=block_mask, enable_gqa=k.shape[1] != q.shape[2])
    return out.transpose(1, 2)
