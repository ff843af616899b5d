"""Throughput, MFU and the per-rank memory summary of the log (the figures themselves: engine/stats.py).

MFU counts the FLOPs of the parameters each token actually multiplies by (see flops_per_token): for a dense model the
anchors' (torchtitan's) formula, for an MoE model only the routed top-k experts, as the MoE anchor
(anchors/hf_fsdp2_qwen3moe.py, mfu_active) does. Peak FLOP/s are dense bf16 datasheet figures.
"""

from __future__ import annotations

import time

import torch

from shardfit.config.schema import is_moe_layer
from shardfit.engine.stats import MEMORY_FIELDS
from shardfit.engine.timing import PHASES

# Dense bf16 peak FLOP/s by device-name substring (first match wins).
PEAK_FLOPS = [
    ("H200", 989e12), ("H100", 989e12), ("H800", 989e12), ("GH200", 989e12), ("B200", 2250e12), ("B100", 1750e12),
    ("A100", 312e12), ("A800", 312e12), ("L40S", 362e12), ("L4", 121e12), ("A10G", 125e12), ("RTX 4090", 165e12),
]



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
        """rec: an engine.StepRecord."""
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
