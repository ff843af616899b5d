"""FP8 matmuls for the blocks' linear layers (`--compute.fp8=tensorwise|rowwise`), through torchao's float8 training
(an optional extra: without it, asking for fp8 is a one-line error). Why torchao, which layers, the numerics:
docs/fp8.md.

Converted: the nn.Linear layers inside the decoder blocks whose two dims are multiples of 16 and, on GPUs, large
enough to gain by torchao's own thresholds (tensorwise skips in <= 4096 with out <= 1024; rowwise out <= 2048,
in <= 1024 or both <= 4096/2048). Never: the output head, the embedding, MoE routers and experts. On the CPU the
matmuls are emulated (same numerics, slow) and every eligible layer is converted.
Numerics: e4m3 forward operands, e5m2 (tensorwise) or e4m3 (rowwise) gradients, dynamic scales, fp32 accumulation;
master weights, gradients and optimizer states unchanged.
Collectives: with tensorwise FP8 all-gather (on by default) FSDP gathers each converted weight in e4m3 with one
scale per weight; `refresh_fp8_scales` computes all scales at once with ONE max all-reduce over the weights' amaxes,
issued by every rank at the same point (after every applied optimizer step, after init, load and resume), never
inside FSDP's gather hooks or backward.
"""

from __future__ import annotations

import dataclasses
import logging

from torch import nn

from shardfit.config.schema import ComputeConfig
from shardfit.errors import ShardfitError


def fp8_available() -> bool:
    # torchao logs a warning for each of its optional C++ kernels that does not load with this torch (none of them
    # is used here: the FP8 matmul is torch's own _scaled_mm); quiet during the import only. Its pytree
    # registration also trips a deprecation warning of newer torch's.
    logs = [logging.getLogger(name) for name in ("torchao", "torch.utils._pytree")]
    levels = [log.level for log in logs]
    for log in logs:
        log.setLevel(logging.ERROR)
    try:
        import torchao.float8  # noqa: F401
    except Exception:  # ImportError, or a torchao built for another torch failing at import
        return False
    finally:
        for log, level in zip(logs, levels):
            log.setLevel(level)
    return True


def gathers_in_fp8(cfg: ComputeConfig) -> bool:
    """FSDP all-gathers the converted weights in FP8 (tensorwise only; their scales come from refresh_fp8_scales)."""
    return cfg.fp8 == "tensorwise" and cfg.fp8_all_gather


def _worth_converting(mod: nn.Module, fqn: str, recipe: str, on_gpu: bool) -> bool:
    if type(mod) is not nn.Linear or ".layers." not in f".{fqn}" or fqn.endswith("mlp.gate"):
        return False  # subclasses (the output head), anything outside the blocks, MoE routers
    out_f, in_f = mod.weight.shape
    if in_f % 16 or out_f % 16:
        return False
    if not on_gpu:  # emulated (CPU): no speed to weigh, so every eligible layer takes the FP8 numerics
        return True
    if recipe == "tensorwise":
        return not (in_f <= 4096 and out_f <= 1024)
    return not (out_f <= 2048 or in_f <= 1024 or (out_f <= 4096 and in_f <= 2048))


def fp8_linears(model: nn.Module, recipe: str, on_gpu: bool, prefix: str = "") -> list[tuple[str, nn.Linear]]:
    """(name, module) of the linear layers apply_fp8 converts, without converting anything (`shardfit plan` counts
    their weights)."""
    return [(fqn, mod) for fqn, mod in model.named_modules() if _worth_converting(mod, prefix + fqn, recipe, on_gpu)]


def apply_fp8(model: nn.Module, cfg: ComputeConfig, device_type: str, capability: tuple[int, int] | None,
              prefix: str = "") -> int:
    """Swap the chosen linear layers for torchao's Float8Linear (on the meta model, before checkpointing, compile and
    FSDP). Returns how many were converted. prefix: the module's own name in the model, when it is a part of it (one
    block, as `shardfit plan` traces it: "model.layers.0.")."""
    if cfg.fp8 == "none":
        return 0
    if not fp8_available():
        raise ShardfitError("needs torchao, which is not installed or does not import with this torch",
                            where=f"compute.fp8={cfg.fp8}",
                            fix="pip install 'shardfit[fp8]' (or a local torchao wheel), or set compute.fp8=none")
    if device_type == "cuda" and capability is not None and capability < (8, 9):
        raise ShardfitError(f"needs FP8 tensor cores (compute capability 8.9 or newer: Ada, Hopper, Blackwell); "
                            f"this GPU has {capability[0]}.{capability[1]}", where=f"compute.fp8={cfg.fp8}",
                            fix="set compute.fp8=none")
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    if cfg.fp8 == "tensorwise":
        config = Float8LinearConfig(enable_fsdp_float8_all_gather=cfg.fp8_all_gather)
    else:  # rowwise: torchao's recipe (power-of-two scales, e4m3 everywhere); its all-gather stays bf16
        config = Float8LinearConfig.from_recipe_name(cfg.fp8)
    if device_type != "cuda":  # FP8-rounded operands, high-precision products: not every supported torch has a CPU
        config = dataclasses.replace(config, emulate=True)  # _scaled_mm, and CPU runs are for checking numerics
    chosen = {fqn for fqn, _ in fp8_linears(model, cfg.fp8, device_type == "cuda", prefix)}
    convert_to_float8_training(model, config=config, module_filter_fn=lambda mod, fqn: fqn in chosen)
    return len(chosen)


def refresh_fp8_scales(model: nn.Module, cfg: ComputeConfig) -> None:
    """After each optimizer step: the FP8 all-gather's per-weight scales from the updated weights (one all-reduce,
    issued by every rank at the same point; see the module docstring). A no-op unless tensorwise FP8 all-gather."""
    if gathers_in_fp8(cfg):
        from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

        precompute_float8_dynamic_scale_for_fsdp(model)


def fp8_notice(cfg: ComputeConfig, layers: int, device_type: str) -> str:
    """The Engine's notice at start: what runs in FP8, and what would keep it from paying."""
    if layers == 0:
        return (f"fp8 {cfg.fp8}: no linear layer is large enough to gain by torchao's thresholds (see "
                f"parallel/fp8.py): every matmul runs in bf16")
    gather = "FP8" if gathers_in_fp8(cfg) else "bf16"
    line = f"fp8 {cfg.fp8}: {layers} linear layers run FP8 matmuls (weights all-gathered in {gather})"
    if device_type != "cuda":
        line += "; emulated on the CPU (same numerics, no speed-up)"
    elif not cfg.compile:
        line += ("; without compute.compile each cast is a separate pass over its tensor and FP8 gains little or "
                 "nothing: set --compute.compile=true")
    return line
