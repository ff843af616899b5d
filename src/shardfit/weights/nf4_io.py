"""An NF4 base in and out (adapters/qlora.py): loaded from model.path shard by shard, and dequantised whole for a
merged export.

Loading (`load_base`, the Engine's start from model.path, resumes included): the unquantised parameters (embeddings,
norms, head, the base of layers without an adapter) are read as for plain LoRA, in one pass of hf_load.py's reader
(each rank its own rows, no collective). Then the NF4 weights, a batch of layers at a time: for each, this rank's
rows [r0, r1) that cover its groups (qlora.shard_span) are read into an fp32 staging buffer (hf_load.py's Rows),
quantised into its shards and dropped before the next batch. A batch stages at most _STAGE_BYTES on this rank's
device (a layer larger than that goes alone: one 14336 x 4096 Llama-3-8B MLP weight is 235 MB in fp32 on one rank,
1/world of that on each of world ranks). So loading holds the NF4 shards plus one batch of fp32 rows, never the
whole model in bf16, and a missing or misshapen tensor is the loader's one error line, the same on every rank (a
rank with no rows of a layer still checks its shape).
Merging (`merged_weight`): the three storage tensors gathered whole (hf_export.py's full_tensor, a collective every
rank issues in the same order) and dequantised in fp32: the merged weight carries the NF4 rounding (the model
trained on that base, not on the original weights).
"""

from __future__ import annotations

import time
from pathlib import Path

import torch
from torch import nn

from shardfit.adapters.lora import base_parameters
from shardfit.adapters.qlora import (
    STORAGE,
    NF4Linear,
    Span,
    dequantized,
    is_storage,
    quantize_rows,
    quantized_modules,
    shard_span,
    staging_rows,
)
from shardfit.parallel.dtensor import local_view
from shardfit.weights.hf_export import batched_by_bytes, full_tensor
from shardfit.weights.hf_load import LoadResult, Rows, load_hf_checkpoint, weight_map

_STAGE_BYTES = 256 << 20  # fp32 rows staged per batch of NF4 layers while loading


def _staged_bytes(item: tuple[str, NF4Linear, Span]) -> int:
    """A layer's rows on this rank, staged in fp32 (staging_rows)."""
    _, mod, span = item
    return (span.rows[1] - span.rows[0]) * mod.in_features * 4


@torch.no_grad()
def load_base(model: nn.Module, path: str | Path) -> LoadResult:
    """Fill the model's frozen base (every parameter but the adapters) from a Hugging Face directory; NF4 weights
    quantised as they are read (module docstring). Without NF4 layers: one call of load_hf_checkpoint."""
    files = weight_map(Path(path))
    quantized = {f"{fqn}.weight": mod for fqn, mod in quantized_modules(model)}
    plain = {n: p for n, p in base_parameters(model).items() if not is_storage(n)}
    results = [load_hf_checkpoint(model, path, params=plain,
                                  files={k: f for k, f in files.items() if k not in quantized})]
    spans = [(key, mod, shard_span(mod, local_view)) for key, mod in quantized.items()]
    quantize_s = 0.0
    for batch in batched_by_bytes(spans, _staged_bytes, _STAGE_BYTES):
        rows = {k: Rows(staging_rows(m, s), (m.out_features, m.in_features), s.rows[0]) for k, m, s in batch}
        results.append(load_hf_checkpoint(model, path, params=rows, files={k: files[k] for k in rows if k in files}))
        t0 = time.perf_counter()
        for key, mod, span in batch:
            quantize_rows(mod, rows[key].local, span)
        quantize_s += time.perf_counter() - t0
        del rows  # the batch's staging, freed before the next one is allocated
    return LoadResult.total(results, quantize_s)


def merged_weight(mod: NF4Linear) -> torch.Tensor:
    """The whole dequantised weight [out, in], fp32, on every rank (three gathers, module docstring)."""
    codes, absmax, stats = (full_tensor(getattr(mod, n)) for n in STORAGE)
    return dequantized(codes, absmax, stats, (mod.out_features, mod.in_features), torch.float32)


__all__ = ["load_base", "merged_weight"]
