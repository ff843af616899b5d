"""Expert load of a mixture-of-experts model, per step: rows routed to each expert of each MoE layer, summed over the
step's micro-batches and every rank, as max / mean per layer (1.0: perfectly even) in the log and metrics.jsonl;
and the auxiliary-loss-free balancing bias (model.router_bias_rate, models/moe.py) moved by that global load.

No collective of its own: each rank adds its layers' counts [L, E] after every micro-batch (device adds, no sync),
and the L x E sums ride in the step's one stats collective (train/trainer.py), after all micro-batches. Every rank
then reads the same global load and applies the same bias update, so the biases stay equal without a broadcast.
A recomputation under checkpointing writes a layer's counts again with the same values; they are read once per
micro-batch, after its backward.
"""

from __future__ import annotations

import torch
from torch import nn

from shardfit.models.moe import MoE, update_balance_bias


class ExpertLoad:
    def __init__(self, model: nn.Module, device: torch.device, bias_rate: float = 0.0):
        named = [(name, m) for name, m in model.named_modules() if isinstance(m, MoE)]
        self.layers = [m for _, m in named]
        # the decoder's layer index of each MoE layer ("model.layers.7.mlp" -> 7), for the log
        self.layer_ids = [int(name.split("layers.")[-1].split(".")[0]) for name, _ in named]
        self.bias_rate = bias_rate
        n_experts = self.layers[0].experts.gate_proj.shape[0] if self.layers else 0
        self.shape = (len(self.layers), n_experts)
        self.total = torch.zeros(self.shape, dtype=torch.float64, device=device)

    @property
    def width(self) -> int:
        """Columns this adds to each rank's stats row."""
        return self.shape[0] * self.shape[1]

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
        load = columns.sum(0).view(self.shape)  # [L, E], the global batch
        ratio = (load.max(1).values / load.mean(1).clamp_min(1e-9)).tolist()
        if applied and self.bias_rate > 0:
            update_balance_bias(self.layers, load.to(self.layers[0].balance_bias.device), self.bias_rate)
        worst = max(range(len(ratio)), key=ratio.__getitem__)
        return {"moe_load_max_over_mean": ratio[worst], "moe_load_worst_layer": self.layer_ids[worst],
                "moe_load_per_layer": [round(r, 3) for r in ratio]}
