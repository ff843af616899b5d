"""Many LoRA models on one base, and frozen versions (engine/registry.py), in the plan: what each costs one rank, and
how many fit beside the configured run.

The run's peak (plan/estimate.py) already holds one model: the adapters in the slot with their gradients and AdamW's
two moments. Every further model keeps, while out of the slot, its adapter values, its gradients since its last
optim_step (counted always: a client may leave them pending) and its two moments: 4 x 4 bytes an adapter parameter,
sharded like the adapters (over world / replicate ranks). A version keeps its adapter values (4 bytes a parameter,
sharded alike) on the device while the versions' bytes fit memory.versions_gib, in host memory beyond it.
  models that fit = 1 + floor((budget - peak) / model_bytes)   (budget: plan/estimate.py allocation_budget)
A pass of several models (engine/multi_model.py) gathers, for the pass only, the K models' whole adapters onto every
rank as fp32 leaves outside FSDP, and their whole fp32 gradients: PASS_BYTES = 4 + 4 bytes an adapter parameter, K
times, not sharded, held from the gather to the reduce-scatter after the last backward, so on top of the step's peak
(multi_model_pass_bytes, which that module's docstring points to).
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
PASS_BYTES = 8  # fp32 whole values and gradients of one model in a pass of several, per adapter parameter


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


def multi_model_pass_bytes(cfg: Config, k: int) -> int:
    """What a pass of k models (engine/multi_model.py, k >= 2) holds on every rank beside the step's peak: each
    model's whole adapter values and gradients in fp32 (module docstring); 0 for one model (the slot's own pass)."""
    return PASS_BYTES * k * adapter_params(cfg)[0] if k > 1 else 0


def multi_model_refusal(cfg: Config) -> str | None:
    """What of this config a pass of several models refuses (engine/multi_model.py check_engine), or None; the
    adapters' targets are checked by the engine alone (embedding, head or experts: one line there)."""
    if cfg.parallel.offload != "none":
        return "parallel.offload=all (the pass keeps the adapters on the device)"
    if cfg.model.n_experts:
        return "an MoE model (the load-balancing term is not per model)"
    if cfg.parallel.replicate > 1 or cfg.parallel.expert_parallel > 1:
        return "sharding other than plain FSDP (parallel.replicate, parallel.expert_parallel)"
    return None


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
    if models > 1:
        lines.append(pass_line(cfg, cost, models, peak, budget))
    return lines


def pass_line(cfg: Config, cost: ModelsCost, k: int, peak: int, budget: float) -> str:
    """The line about a pass of the k models asked for (multi_model_pass_bytes): its bytes and whether it fits
    beside the step's peak, the other models and the versions on the device."""
    why = multi_model_refusal(cfg)
    if why is not None:
        return f"a pass of {k} models in one forward/backward: refused with {why}; run them one after another"
    extra = multi_model_pass_bytes(cfg, k)
    total = peak + cost.device_bytes + extra
    gib = 2**30
    return (f"a pass of {k} models in one forward/backward holds {extra / gib:.2f} GiB more on every rank (their "
            f"whole fp32 adapters and gradients): peak {total / gib:.1f} GiB with the models and versions, "
            + ("within" if total <= budget else "OVER") + f" the {budget / gib:.1f} GiB budget")
