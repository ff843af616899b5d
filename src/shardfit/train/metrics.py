"""Throughput, MFU and per-rank memory figures.

MFU uses the formula the anchors use (torchtitan's): per token 6 x non-embedding parameters + 12 x layers x hidden
x sequence (attention counted as full, not causal). Peak FLOP/s are dense bf16 datasheet figures.
"""

from __future__ import annotations

import resource
import sys

import torch

# Dense bf16 peak FLOP/s by device-name substring (first match wins).
PEAK_FLOPS = [
    ("H200", 989e12), ("H100", 989e12), ("H800", 989e12), ("GH200", 989e12), ("B200", 2250e12), ("B100", 1750e12),
    ("A100", 312e12), ("A800", 312e12), ("L40S", 362e12), ("L4", 121e12), ("A10G", 125e12), ("RTX 4090", 165e12),
]

# Order of the memory fields inside the per-step stats vector (see Trainer._reduce_step).
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


def flops_per_token(model_cfg, n_params: int, seq_len: int) -> float:
    """The anchors' (torchtitan's) formula: 6 x non-embedding parameters + 12 x layers x hidden x sequence.

    The input embedding is a lookup and costs no FLOPs; the output head is a matmul. A tied model counts the shared
    weight once in n_params, so only an untied model subtracts the embedding: tied and untied models of one shape
    then report the same FLOPs per token, as they do the same work."""
    embedding = 0 if model_cfg.tie_embeddings else model_cfg.vocab_size * model_cfg.dim
    return 6 * (n_params - embedding) + 12 * model_cfg.n_layers * model_cfg.dim * seq_len


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
