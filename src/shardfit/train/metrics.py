"""Throughput, MFU, per-rank memory figures, and the expert load of MoE models.

MFU counts the FLOPs of the parameters each token actually multiplies by (see flops_per_token): for a dense model the
anchors' (torchtitan's) formula, for an MoE model only the routed top-k experts, as the MoE anchor
(anchors/hf_fsdp2_qwen3moe.py, mfu_active) does. Peak FLOP/s are dense bf16 datasheet figures.
"""

from __future__ import annotations

import resource
import sys
import time

import numpy as np
import torch
from torch import nn

from shardfit.config.schema import is_moe_layer
from shardfit.models.moe import MoE, update_balance_bias
from shardfit.train.timing import PHASES

# Dense bf16 peak FLOP/s by device-name substring (first match wins).
PEAK_FLOPS = [
    ("H200", 989e12), ("H100", 989e12), ("H800", 989e12), ("GH200", 989e12), ("B200", 2250e12), ("B100", 1750e12),
    ("A100", 312e12), ("A800", 312e12), ("L40S", 362e12), ("L4", 121e12), ("A10G", 125e12), ("RTX 4090", 165e12),
]

# Order of the memory fields inside the per-step stats vector (see Engine._reduce).
MEMORY_FIELDS = ("peak_allocated", "peak_reserved", "peak_active", "allocated", "reserved", "inactive_split",
                 "alloc_retries", "ooms")


def peak_flops(device: torch.device, override_tflops: float = 0.0) -> float | None:
    if override_tflops:
        return override_tflops * 1e12
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    for key, value in PEAK_FLOPS:
        if key in name:
            return value
    return None


def active_params(model_cfg) -> int:
    """Weights one token multiplies by, as the MoE anchor counts them: per layer q/k/v/o ([dim, heads x head_dim],
    two [dim, kv_heads x head_dim], [heads x head_dim, dim]) and either the router [dim, experts] plus the top-k
    experts' three [dim, moe_ffn] matrices (MoE layer) or the dense MLP's three [dim, ffn] (dense layer); plus the
    output head [vocab, dim]. Norm weights and biases are left out (under 0.01% of a real model)."""
    c = model_cfg
    width = c.n_heads * (c.head_dim or c.dim // c.n_heads)  # attention width: heads x head_dim, not always dim
    kv = c.n_kv_heads * (c.head_dim or c.dim // c.n_heads)
    attn = 2 * c.dim * width + 2 * c.dim * kv
    moe = c.dim * c.n_experts + c.experts_per_token * 3 * c.dim * c.moe_ffn_dim
    mlp = 3 * c.dim * c.ffn_dim
    return sum(attn + (moe if is_moe_layer(c, i) else mlp) for i in range(c.n_layers)) + c.vocab_size * c.dim


def flops_per_token(model_cfg, n_params: int, seq_len: int) -> float:
    """Training FLOPs per token: 6 x the parameters a token multiplies by + 12 x layers x heads x head_dim x sequence
    (attention scores and values, counted as full, not causal).

    MoE models: 6 x active_params, the MoE anchor's formula exactly (every expert's parameters would overstate the
    work by experts / top-k: MFU above 1 on Qwen3-30B-A3B). Dense models keep the anchors' (torchtitan's) count,
    6 x non-embedding parameters: active_params plus the norm weights and biases. The input embedding is a lookup and
    costs no FLOPs; the output head is a matmul. A tied model counts the shared weight once in n_params, so only an
    untied model subtracts the embedding: tied and untied models of one shape report the same FLOPs per token."""
    c = model_cfg
    attention = 12 * c.n_layers * c.n_heads * (c.head_dim or c.dim // c.n_heads) * seq_len
    if c.n_experts:
        return 6 * active_params(c) + attention
    embedding = 0 if c.tie_embeddings else c.vocab_size * c.dim
    return 6 * (n_params - embedding) + attention


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


def summarize_memory(rows: torch.Tensor) -> dict[str, float]:
    """rows [world, len(MEMORY_FIELDS)] -> {field_min, field_max} in GiB (counts stay counts)."""
    out = {}
    for i, name in enumerate(MEMORY_FIELDS):
        col = rows[:, i]
        scale = 1.0 if name in ("alloc_retries", "ooms") else 1 / 2**30
        out[f"{name}_max"] = float(col.max()) * scale
        out[f"{name}_min"] = float(col.min()) * scale
    if out["peak_allocated_max"] > 0:
        out["reserved_over_allocated"] = out["peak_reserved_max"] / out["peak_allocated_max"]
    return out


class ExpertLoad:
    """Expert load of a mixture-of-experts model, per step: rows routed to each expert of each MoE layer, summed
    over the step's micro-batches and every rank, as max / mean per layer (1.0: perfectly even) in the log and
    metrics.jsonl; and the auxiliary-loss-free balancing bias (model.router_bias_rate, models/moe.py) moved by that
    global load.

    No collective of its own: each rank adds its layers' counts [L, E] after every micro-batch (device adds, no
    sync), and the L x E sums ride in the step's one stats collective (train/engine.py), after all micro-batches.
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


class LogWindow:
    """Steps since the last log line: their wall time, token counts, and each phase's seconds (rank 0's;
    train.timing). The wall time runs from the previous window's last step to this window's last one, so the loop's
    own work (logging, the data) counts; evaluation and checkpoints do not (`restart` after them)."""

    def __init__(self, since: float | None = None):
        self.mark = time.perf_counter() if since is None else since  # where the next step's wall time starts
        self.seconds, self.steps = 0.0, 0
        self.capacity = self.loss_tokens = self.real_tokens = 0.0  # this rank's capacity; the world's token counts
        self.phases: dict[str, list[float]] = {}

    def add(self, rec) -> None:
        """rec: a train.engine.StepRecord."""
        now = time.perf_counter()
        self.seconds += now - self.mark
        self.mark = now
        self.steps += 1
        self.capacity += rec.capacity
        self.loss_tokens += rec.loss_tokens
        self.real_tokens += rec.real_tokens
        for k, v in rec.phases.items():
            self.phases.setdefault(k, []).append(v)

    def restart(self) -> None:
        """Leave out the time since the last step (evaluation, a checkpoint): not training."""
        self.mark = time.perf_counter()

    def phase_means(self) -> dict[str, float]:
        if "forward" not in self.phases:
            return {}
        return {f"time_{k}_s": sum(self.phases.get(k, [0.0])) / len(self.phases.get(k, [0.0])) for k in PHASES}
