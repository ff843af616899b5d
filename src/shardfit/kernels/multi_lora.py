"""Multi-LoRA: the rows of one batch each through their own LoRA adapter (a decode batch holding several weight
versions: sampling/lora_bank.py wraps this math around the decode model's linear layers; a training pass of several
LoRA models: adapters/lora_stack.py, with a 0/1 mask as cols and the scale applied after).

For token n of slot s = slot[n] (-1: no adapter), with A_s [r, in], B_s [out, r] and scale_s (alpha / r):
    y[n] = x[n] W^T (the base linear, not here) + scale_s (x[n] A_s^T) B_s^T
The bank of S slots is kept stacked (stack_bank): A_all [S*R, in] (slot s's rows s*R:(s+1)*R), B_all [S*R, out]
(B_s transposed, stacked the same way), R the bank's rank. Then, for N tokens:
    h = x A_all^T                   [N, S*R]   every slot's shrink for every token
    h = h * cols                    cols [N, S*R] (slot_columns): scale_s on token n's own slot's R columns, 0 elsewhere
    delta = h B_all                 [N, out]
Exact where it must be: a token of slot -1 has a zero row of cols, so its delta is exactly 0 (0 x finite) and y is
the base's output bit for bit; an adapter of rank r < R fills r of its slot's R rows and leaves the rest zero, which
add exact zeros (padding to the bank's rank changes nothing). Static shapes, no host sync, no data-dependent Python:
capturable in a CUDA graph. cols is made once per forward (the slots of its tokens) and shared by every banked layer.

Cost of this form, per banked layer and step (bf16): it reads the whole bank, S R (in + out) elements, where a
per-token gather reads only the slots the batch uses; and it does 2 N S R (in + out) FLOPs instead of 2 N R (in +
out). For the 8B shape's q_proj (in = out = 4096) at R = 16, S = 8 slots: the bank is 1.0 M elements against the
base weight's 16.8 M (6% more bytes read), and at decode (N <= 256 tokens) the step is bound by memory traffic, so
the S-fold adapter FLOPs (256 x 8 x 16 x 8192 x 2 = 0.54 GFLOP) are hidden; a prefill chunk of 512 tokens adds
about S x 0.8% to the base matmul's 17 GFLOP. The alternative, a per-token or per-segment gather of each token's own
A_s and B_s (punica's BGMV / SGMV, vLLM's LoRA kernels), reads only the slots present and does N R (in + out) MACs:
it wins when the bank holds many slots (tens to hundreds of resident adapters) of which a batch uses few, or when S R
grows toward in (long prefills with many adapters, where the S-fold FLOPs stop hiding); it needs a custom kernel or
a data-dependent gather that a CUDA graph must fix in size. For the few versions an RL batch holds, this form is it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def stack_bank(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A bank [S, R, in], B bank [S, out, R] -> (A_all [S*R, in], B_all [S*R, out]) (B_all a copy: transposed)."""
    return a.reshape(-1, a.shape[-1]), b.transpose(1, 2).reshape(-1, b.shape[1])


def slot_columns(slot: torch.Tensor, scale: torch.Tensor, rank: int) -> torch.Tensor:
    """cols [N, S*R] of slot [N] (long, -1: none) and scale [S]: scale[s] on the R columns of token n's slot s, 0 on
    every other column (all of them for slot -1). In scale's dtype."""
    col_slot = torch.arange(scale.shape[0] * rank, device=slot.device) // rank  # [S*R]: each column's slot
    per_col = scale.repeat_interleave(rank)  # [S*R]
    return torch.where(slot[:, None] == col_slot[None, :], per_col[None, :], torch.zeros((), dtype=scale.dtype,
                                                                                         device=scale.device))


def expand(h: torch.Tensor, cols: torch.Tensor, b_all: torch.Tensor) -> torch.Tensor:
    """(h [N, S*R] * cols) B_all [S*R, out] -> delta [N, out]: each token's own slot's expand, scaled."""
    return (h * cols) @ b_all


def multi_lora(x: torch.Tensor, a_all: torch.Tensor, b_all: torch.Tensor, cols: torch.Tensor) -> torch.Tensor:
    """delta [N, out] of x [N, in] through the stacked bank (A_all [S*R, in], B_all [S*R, out]) by cols (module
    docstring). Computed in the bank's dtype."""
    return expand(F.linear(x.to(a_all.dtype), a_all), cols, b_all)


def multi_lora_embedding(ids: torch.Tensor, a_t: torch.Tensor, b_all: torch.Tensor,
                         cols: torch.Tensor) -> torch.Tensor:
    """PEFT's embedding adapter (A [r, V], B [D, r]: delta = scale A^T[id] B^T), banked: ids [N], a_t [V, S*R] (each
    slot's A transposed, side by side), B_all [S*R, D] -> delta [N, D]. The shrink is a row gather, not a matmul."""
    return expand(F.embedding(ids, a_t), cols, b_all)


def multi_lora_grouped(x: torch.Tensor, a_bank: torch.Tensor, b_bank: torch.Tensor, cols: torch.Tensor,
                       linear) -> torch.Tensor:
    """MoE experts' adapters, banked: x [N, in] the routed rows sorted by expert, a_bank [E, S*R, in] (expert e's
    A of every slot stacked), b_bank [E, out, S*R], cols [N, S*R] (each row's token's), `linear(x, w [E, o, i])` the
    matmul over the experts' row groups (models/moe.py's grouped_linear or split_linear) -> delta [N, out]: two more
    grouped matmuls, each row through its expert's adapter of its own slot."""
    return linear(linear(x, a_bank) * cols, b_bank)


__all__ = ["expand", "multi_lora", "multi_lora_embedding", "multi_lora_grouped", "slot_columns", "stack_bank"]
