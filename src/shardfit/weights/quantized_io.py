"""A quantised base in and out (model.quantize: NF4, adapters/qlora.py; FP8, adapters/fp8_base.py): loaded from
model.path shard by shard, and dequantised whole for a merged export.

Loading (`load_base`, the Engine's start from model.path, resumes included): the unquantised parameters (embeddings,
norms, head, the base of layers without an adapter) are read as for plain LoRA, in one pass of hf_load.py's reader
(each rank its own rows, no collective). Then the quantised weights, a batch of layers at a time: for each, this
rank's rows [r0, r1) that cover its storage rows (the module's span) are read into an fp32 staging buffer
(hf_load.py's Rows), quantised into its shards and dropped before the next batch. A batch stages at most _STAGE_BYTES
on this rank's device (a layer larger than that goes alone: one 14336 x 4096 Llama-3-8B MLP weight is 235 MB in fp32
on one rank, 1/world of that on each of world ranks). So loading holds the quantised shards plus one batch of fp32
rows, never the whole model in bf16, and a missing or misshapen tensor is the loader's one error line, the same on
every rank (a rank with no rows of a layer still checks its shape).
Merging (`merged_weight`): the storage tensors gathered whole (hf_export.py's full_tensor, a collective every rank
issues in the same order) and dequantised in fp32: the merged weight carries the format's rounding (the model
trained on that base, not on the original weights).
"""

from __future__ import annotations

import time
from pathlib import Path

import torch
from torch import nn

from shardfit.adapters.lora import base_parameters
from shardfit.adapters.quantized import QuantizedLinear, Span, is_storage, quantized_modules, staging_rows
from shardfit.parallel.dtensor import local_view
from shardfit.weights.hf_export import batched_by_bytes, full_tensor
from shardfit.weights.hf_load import LoadResult, Rows, load_hf_checkpoint, weight_map

_STAGE_BYTES = 256 << 20  # fp32 rows staged per batch of quantised layers while loading


def _staged_bytes(item: tuple[str, QuantizedLinear, Span]) -> int:
    """A layer's rows on this rank, staged in fp32 (staging_rows)."""
    _, mod, span = item
    return (span.rows[1] - span.rows[0]) * mod.in_features * 4


@torch.no_grad()
def load_base(model: nn.Module, path: str | Path) -> LoadResult:
    """Fill the model's frozen base (every parameter but the adapters) from a Hugging Face directory; quantised
    weights quantised as they are read (module docstring). Without them: one call of load_hf_checkpoint."""
    files = weight_map(Path(path))
    quantized = {f"{fqn}.weight": mod for fqn, mod in quantized_modules(model)}
    plain = {n: p for n, p in base_parameters(model).items() if not is_storage(n)}
    results = [load_hf_checkpoint(model, path, params=plain,
                                  files={k: f for k, f in files.items() if k not in quantized})]
    spans = [(key, mod, mod.span(local_view)) for key, mod in quantized.items()]
    quantize_s = 0.0
    for batch in batched_by_bytes(spans, _staged_bytes, _STAGE_BYTES):
        rows = {k: Rows(staging_rows(m, s), (m.out_features, m.in_features), s.rows[0]) for k, m, s in batch}
        results.append(load_hf_checkpoint(model, path, params=rows, files={k: files[k] for k in rows if k in files}))
        t0 = time.perf_counter()
        for key, mod, span in batch:
            mod.quantize_rows(rows[key].local, span)
        quantize_s += time.perf_counter() - t0
        del rows  # the batch's staging, freed before the next one is allocated
    return LoadResult.total(results, quantize_s)


def merged_weight(mod: QuantizedLinear) -> torch.Tensor:
    """The whole dequantised weight [out, in], fp32, on every rank (a gather per storage tensor, module
    docstring)."""
    return mod.dequantized([full_tensor(getattr(mod, n)) for n in mod.STORAGE], torch.float32)


__all__ = ["load_base", "merged_weight"]
