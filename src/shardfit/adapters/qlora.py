"""QLoRA (model.quantize=nf4): the adapted linear layers' frozen base weights stored in NF4 (adapters/nf4.py); the
storage, sharding and filling that every quantised base shares are adapters/quantized.py's.

The storage: weight_nf4 (8192 bytes a group), weight_absmax (256) and weight_stats (8) (g = ceil(out x in / 16,384)
groups of the flattened weight), viewed as [g, bytes / size] in the carrier dtype. FSDP2 shards the three along dim 0,
so a rank holds groups [g0, g0 + n) of each: whole groups (a group never straddles ranks) and 1/world of the codes; the
weight rows [r0, r1) covering them are what a rank stages in fp32 to fill them. Its forward dequantises the whole
weight to the input's dtype inside a custom operator (shardfit::nf4_linear; on CUDA by one Triton kernel,
kernels/nf4_dequant.py), multiplies and frees it; backward dequantises again for dX = dY W (saved: the codes, never
the dequantised weight). Checkpointing's recompute repeats the forward, dequantisation included. Embeddings, norms,
the head and MoE experts stay in the compute dtype. Loading from model.path and the merge's whole weight:
weights/quantized_io.py.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from shardfit.adapters.nf4 import (
    GROUP,
    ROW_STORED_BYTES,
    carried,
    dequantize,
    dequantize_kernel,
    kernel_dequantizes,
    n_groups,
    pad_to_groups,
    quantize,
)
from shardfit.adapters.quantized import QuantizedLinear, Span, local_shards, register_frozen_matmul
from shardfit.models.init import NF4_STORAGE, ShardView
from shardfit.models.loss import compiled_once

# Groups quantised at once. quantize() is ~40 small kernels a chunk whatever its size: on the CPU 64 groups (~1M
# weights, ~20 MB of transients) keep the memory down; on a GPU the launches dominate (a 70B base is 68.5B NF4 weights,
# 4.2M groups: ~2.6M launches at 64 groups, ~15-25 s; at 1024 groups ~170k, ~1-2 s, for ~330 MB of transients:
# fp32 weights, their ratios to the absmax and int32 level indices, 64 MB each, beside a 940 MB fp32 staging buffer).
_CHUNK_GROUPS_CPU, _CHUNK_GROUPS_GPU = 64, 1024


def dequantized(codes: torch.Tensor, absmax: torch.Tensor, stats: torch.Tensor, shape: tuple[int, int],
                dtype: torch.dtype) -> torch.Tensor:
    """The weight [out, in] in dtype from its whole (gathered) storage."""
    return dequantize(codes, absmax, stats, dtype)[:shape[0] * shape[1]].view(shape)


# The frozen matmul is a custom operator, opaque to torch.compile: inside a checkpointed block the compiled graph then
# holds one node for it, which checkpointing recomputes like any other. As an autograd.Function traced into the
# graph, its matmul outputs escaped the checkpoint's recompute tags and were saved (measured: 0.56 GiB a block of the
# 70B shape at 4,096 tokens, 97 GiB at full checkpointing where 52 were planned). Its autograd saves the codes, never
# the dequantised weight. On CUDA with Triton the dequantisation is one hand-written kernel (nf4.dequantize_kernel,
# kernels/nf4_dequant.py: ~2.5 bytes of traffic a weight at the memory's speed), compiled or not; elsewhere fused
# dequantises with one compiled kernel (compute.compile; ~2.5 bytes a weight instead of ~18 eagerly, but at about
# half the speed on an H200), made once per process and shape-generic. All three give the same bits.


def _dequant(codes: torch.Tensor, absmax: torch.Tensor, stats: torch.Tensor, out_features: int, in_features: int,
             dtype: torch.dtype, fused: bool) -> torch.Tensor:
    if kernel_dequantizes(codes, dtype):
        return dequantize_kernel(codes, absmax, stats, out_features * in_features, dtype).view(out_features,
                                                                                                in_features)
    fn = compiled_once(dequantized, dynamic=True) if fused else dequantized
    return fn(codes, absmax, stats, (out_features, in_features), dtype)


@torch.library.custom_op("shardfit::nf4_linear", mutates_args=())
def nf4_linear(x: torch.Tensor, codes: torch.Tensor, absmax: torch.Tensor, stats: torch.Tensor, out_features: int,
               in_features: int, fused: bool) -> torch.Tensor:
    """y = x W^T, W [out, in] dequantised from its NF4 storage and freed."""
    return F.linear(x, _dequant(codes, absmax, stats, out_features, in_features, x.dtype, fused))


@torch.library.custom_op("shardfit::nf4_linear_input_grad", mutates_args=())
def nf4_linear_input_grad(dy: torch.Tensor, codes: torch.Tensor, absmax: torch.Tensor, stats: torch.Tensor,
                          out_features: int, in_features: int, fused: bool) -> torch.Tensor:
    """dX = dY W, W dequantised again."""
    return dy @ _dequant(codes, absmax, stats, out_features, in_features, dy.dtype, fused)


register_frozen_matmul(nf4_linear, nf4_linear_input_grad, n_storage=3)


class NF4Linear(QuantizedLinear):
    """A frozen linear layer whose weight is stored in NF4 (module docstring)."""

    STORAGE = NF4_STORAGE
    FORMAT = "nf4"
    LABEL = "NF4"
    DESCRIPTION = ("QLoRA: the base weights of {} adapted linear layers ({:,} weights) are NF4 with double-quantised "
                   "scales")
    NOTICE = "they dequantise one layer at a time in forward and backward"

    @classmethod
    def storage_shapes(cls, out_features: int, in_features: int, carrier: torch.dtype) -> list[tuple[int, int]]:
        g = n_groups(out_features * in_features)
        return [(g, nbytes // carrier.itemsize) for nbytes in ROW_STORED_BYTES]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = nf4_linear(x, self.weight_nf4, self.weight_absmax, self.weight_stats, self.out_features,
                         self.in_features, self.fused_dequant)
        return out if self.bias is None else out + self.bias

    def span(self, view: ShardView) -> Span:
        shards, g0, n = local_shards(self, view)  # groups [g0, g0 + n)
        numel, width = self.quantized_numel, self.in_features
        e0, e1 = min(g0 * GROUP, numel), min((g0 + n) * GROUP, numel)
        return Span(shards, n, (e0, e1), (e0 // width, -(-e1 // width) if n else e0 // width))

    @torch.no_grad()
    def quantize_rows(self, rows: torch.Tensor, span: Span) -> None:
        """Quantise this rank's groups from `rows` (the weight's rows span.rows), a chunk of groups at a time."""
        (e0, e1), skip = span.elems, span.rows[0] * self.in_features
        flat = pad_to_groups(rows.reshape(-1)[e0 - skip:e1 - skip].float(), span.groups)
        chunk = _CHUNK_GROUPS_CPU if rows.device.type == "cpu" else _CHUNK_GROUPS_GPU
        for c0 in range(0, span.groups, chunk):
            c1 = min(span.groups, c0 + chunk)
            for dst, src in zip(span.shards, carried(quantize(flat[c0 * GROUP:c1 * GROUP]), span.shards[0].dtype)):
                dst[c0:c1].copy_(src)  # the same dtype: a copy of the bytes

    def dequantized(self, parts: list[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
        return dequantized(*parts, (self.out_features, self.in_features), dtype)


__all__ = ["NF4Linear", "dequantized"]
