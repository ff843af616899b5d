"""What every step measures besides the loss, carried in the step's one stats collective: each rank's memory
figures and, for mixture-of-experts models, the expert load and the auxiliary-loss-free balancing bias moved by it.

Both are read on the device (load) or the host (memory) with no collective of their own: the Engine puts them in the
stats vector of its one all-gather per pass (engine/engine.py), so every rank reads the same global figures.
"""

from __future__ import annotations

import resource
import sys

import numpy as np
import torch
from torch import nn

from shardfit.models.moe import MoE, update_balance_bias

MEMORY_FIELDS = ("peak_allocated", "peak_reserved", "peak_active", "allocated", "reserved", "inactive_split",
                 "alloc_retries", "ooms")


def memory_vector(device: torch.device) -> list[float]:
    """This rank's memory figures in MEMORY_FIELDS order (bytes; counts for the last two). A host call only."""
    if device.type == "cuda":
        s = torch.cuda.memory_stats(device)
        return [float(s.get(k, 0)) for k in (
            "allocated_bytes.all.peak", "reserved_bytes.all.peak", "active_bytes.all.peak",
            "allocated_bytes.all.current", "reserved_bytes.all.current", "inactive_split_bytes.all.current",
            "num_alloc_retries", "num_ooms")]
    # CPU: the process's peak resident set stands in for the allocator figures.
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * (1 if sys.platform == "darwin" else 1024)
    return [float(rss), float(rss), float(rss), float(rss), float(rss), 0.0, 0.0, 0.0]


def reset_peaks(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


class ExpertLoad:
    """Expert load of a mixture-of-experts model, per step: rows routed to each expert of each MoE layer, summed
    over the step's micro-batches and every rank, as max / mean per layer (1.0: perfectly even) in the log and
    metrics.jsonl; and the auxiliary-loss-free balancing bias (model.router_bias_rate, models/moe.py) moved by that
    global load.

    No collective of its own: each rank adds its layers' counts [L, E] after every micro-batch (device adds, no
    sync), and the L x E sums ride in the step's one stats collective (engine/engine.py), after all micro-batches.
    Every rank then reads the same global load and applies the same bias update, so the biases stay equal without
    a broadcast. A recomputation under checkpointing writes a layer's counts again with the same values; they are
    read once per micro-batch, after its backward."""

    def __init__(self, model: nn.Module, device: torch.device, bias_rate: float = 0.0):
        moe = [(i, layer.mlp) for i, layer in enumerate(model.model.layers) if isinstance(layer.mlp, MoE)]
        self.layer_ids = [i for i, _ in moe]  # the decoder's index of each MoE layer, for the log
        self.layers = [m for _, m in moe]
        self.bias_rate = bias_rate
        n_experts = self.layers[0].experts.gate_proj.shape[0] if self.layers else 0
        self.shape = (len(self.layers), n_experts)
        self.total = torch.zeros(self.shape, dtype=torch.float64, device=device)

    def add_micro_batch(self) -> None:
        if self.layers:
            self.total += torch.stack([m.load for m in self.layers])

    def take(self) -> torch.Tensor:
        """This rank's counts of the step, flat [L*E] float64 (exact below 2**53 rows), and a fresh start."""
        flat, self.total = self.total.reshape(-1), torch.zeros_like(self.total)
        return flat

    def finish_step(self, columns: torch.Tensor, applied: bool) -> dict:
        """columns [world, L*E]: every rank's counts (host). Returns the step's load figures; moves the balancing
        biases when the optimizer step was applied (a skipped step changes nothing, biases included)."""
        if not self.layers:
            return {}
        # a few hundred numbers on the host: numpy, no torch dispatch
        load = columns.numpy().sum(0).reshape(self.shape)  # [L, E], the global batch
        ratio = (load.max(1) / np.maximum(load.mean(1), 1e-9)).tolist()
        if applied and self.bias_rate > 0:
            update_balance_bias(self.layers, torch.from_numpy(load).to(self.layers[0].balance_bias.device),
                                self.bias_rate)
        worst = max(range(len(ratio)), key=ratio.__getitem__)
        return {"moe_load_max_over_mean": ratio[worst], "moe_load_worst_layer": self.layer_ids[worst],
                "moe_load_per_layer": [round(r, 3) for r in ratio]}
