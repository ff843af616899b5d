"""The decode step (sampling/step.py decode_step) captured as CUDA graphs, one per shape bucket, replayed per token.

A bucket is (rows B, table width M, top-k, draw): B and M rounded up to a power of two, so that a few graphs
cover every batch (1, 2, 4, ... max_rows rows; 1, 2, 4, ... blocks a row). The graph's one input that changes
between buckets' replays is its static `active` buffer (the rows' slots, padded with the padding slot): every other
input (tokens, positions, tables, sampling params, seeds) already lives in RowState's fixed tensors, which the step
reads and advances in place, and the slot mapping is computed inside the step. A graph is captured the first time
its bucket runs, with every entry of `active` on the padding slot, so that the warm-up runs before capture touch
only the padding slot and the KV cache's trash block. All graphs share one memory pool: a graph's scratch may lie
where another graph's outputs are, so the runner copies a replay's outputs (runner._record) before any other replay.

Off (the CPU, cuda_graphs=False, FlexAttention, or a model whose forward reads the device: an MoE layer outside
the bf16 grouped-GEMM path reads its expert counts on the host), the same step runs eagerly at the batch's own size.
"""

from __future__ import annotations

import torch


def capturable(model) -> bool:
    """Whether the model's decode forward has no host sync: every MoE layer runs the grouped GEMM (CUDA, bf16)."""
    from shardfit.models.moe import MoE

    grouped = model.lm_head.weight.dtype == torch.bfloat16 and hasattr(torch, "_grouped_mm")
    return grouped or not any(isinstance(m, MoE) for m in model.modules())


def bucket(n: int, cap: int) -> int:
    """The smallest power of two >= n, at most cap (cap itself when n is above the last power below it)."""
    b = 1
    while b < n:
        b *= 2
    return min(b, cap)


class DecodeGraphs:
    """Calls step(active, width, topk, draw) -> outputs, through a captured graph per bucket when enabled."""

    def __init__(self, step, pad_slot: int, enabled: bool):
        self.step, self.pad, self.enabled = step, pad_slot, enabled
        self.graphs: dict[tuple, tuple] = {}
        self.pool = torch.cuda.graph_pool_handle() if enabled else None

    def __call__(self, active: torch.Tensor, width: int, topk: int, draw: str, state_key=None):
        """state_key: what identifies the state tensors a graph reads, when one may be replaced (RowState's stop
        tokens, widened): a graph is captured per value."""
        if not self.enabled:
            return self.step(active, width, topk, draw)
        key = (active.shape[0], width, topk, draw, state_key)
        if key not in self.graphs:
            self.graphs[key] = self._capture(*key[:4])
        graph, static_active, outputs = self.graphs[key]
        static_active.copy_(active)
        graph.replay()
        return outputs

    def _capture(self, rows: int, width: int, topk: int, draw: str):
        static_active = torch.full((rows,), self.pad, dtype=torch.int64, device="cuda")
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):  # warm-up: lazy inits and autotuning happen outside the capture
                self.step(static_active, width, topk, draw)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            outputs = self.step(static_active, width, topk, draw)
        return graph, static_active, outputs
