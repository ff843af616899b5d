"""Many LoRA models on one base, and frozen versions (engine/registry.py), in the plan: what each costs one rank, and
how many fit beside the configured run.

The run's peak (plan/estimate.py) already holds one model: the adapters in the slot with their gradients and AdamW's
two moments. Every further model keeps, while out of the slot, its adapter values, its gradients since its last
optim_step (counted always: a client may leave them pending) and its two moments: 4 x 4 bytes an adapter parameter,
sharded like the adapters (over world / replicate ranks). A version keeps its adapter values (4 bytes a parameter,
sharded alike) on the device while the versions' bytes fit memory.versions_gib, in host memory beyond it.
  models that fit = 1 + floor((budget - peak) / model_bytes)   (budget: plan/estimate.py allocation_budget)
Without LoRA there is one model, and a version is a copy of every weight in the compute dtype (2 bytes a parameter
in bf16, sharded alike; engine/registry.py), placed the same way; `shardfit serve` holds serve.versions of them.
"""

from __future__ import annotations

from dataclasses import dataclass

from shardfit.config.schema import Config
from shardfit.plan.activation_trace import compute_dtype
from shardfit.plan.estimate import adapter_params

MODEL_BYTES = 16  # fp32 values, gradients, exp_avg, exp_avg_sq: a model out of the slot, per adapter parameter
VERSION_BYTES = 4  # fp32 values: a frozen version, per adapter parameter (without LoRA: the compute dtype's)


@dataclass
class ModelsCost:
    model_bytes: int  # one more model, one rank
    version_bytes: int  # one version, one rank
    models: int  # models asked for (the configured run's included)
    versions: int  # versions asked for
    version_device_bytes: int  # the versions kept on the device (up to memory.versions_gib), one rank
    host_bytes: int  # versions past memory.versions_gib, one rank's host memory

    @property
    def device_bytes(self) -> int:
        """What the models beyond the first and the versions on the device add to one rank's peak."""
        return self.model_bytes * max(self.models - 1, 0) + self.version_device_bytes


def models_cost(cfg: Config, world: int, models: int, versions: int) -> ModelsCost:
    trained, _ = adapter_params(cfg)  # without LoRA: every parameter
    shard = max(world // cfg.parallel.replicate, 1)
    per_model = -(-MODEL_BYTES * trained // shard) if cfg.lora.rank else 0  # without LoRA: one model only
    per_version = -(-(VERSION_BYTES if cfg.lora.rank else compute_dtype(cfg.compute).itemsize) * trained // shard)
    on_device = min(versions, int(cfg.memory.versions_gib * 2**30 // per_version) if per_version else versions)
    return ModelsCost(per_model, per_version, models, versions, per_version * on_device,
                      per_version * (versions - on_device))


def models_that_fit(cost: ModelsCost, peak: int, budget: float) -> int:
    """Models (the configured run's included) one rank holds within `budget` beside a peak of `peak` bytes, the
    asked-for versions counted first; 0 when the run itself does not fit."""
    room = budget - peak - cost.version_device_bytes
    if room < 0:
        return 0
    return 1 + int(room // cost.model_bytes) if cost.model_bytes else 1


def models_lines(cfg: Config, world: int, models: int, versions: int, peak: int, budget: float) -> list[str]:
    """The plan's lines about models and versions (without LoRA: versions only)."""
    cost = models_cost(cfg, world, models, versions)
    gib = 2**30
    if not cfg.lora.rank:
        room = budget - peak - cost.version_device_bytes
        return [f"frozen versions (without LoRA a copy of every weight): {cost.version_bytes / gib:.3f} GiB each "
                f"(one rank); {versions} version(s) add {cost.version_device_bytes / gib:.2f} GiB to the peak"
                + (f" and {cost.host_bytes / gib:.2f} GiB of host memory (past memory.versions_gib)" if cost.host_bytes
                   else "") + ("" if room >= 0 else "; they do not fit this GPU")]
    fit = models_that_fit(cost, peak, budget)
    lines = [f"LoRA models on one base: {cost.model_bytes / gib:.3f} GiB a model beyond the first, "
             f"{cost.version_bytes / gib:.3f} GiB a frozen version (one rank); {models} model(s) and {versions} "
             f"version(s) add {cost.device_bytes / gib:.2f} GiB to the peak"
             + (f" and {cost.host_bytes / gib:.2f} GiB of host memory (past memory.versions_gib)" if cost.host_bytes
                else "")]
    lines.append(f"models that fit this GPU with {versions} version(s): {fit}" if fit else
                 "models that fit this GPU: none (the run itself does not fit)")
    return lines
