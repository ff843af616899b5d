"""LoRA on MoE experts: per-expert low-rank adapters on the stacked expert weights, run as grouped GEMMs beside them.

Targets (lora.targets): `experts` (both projections), or one of `experts.gate_up_proj`, `experts.down_proj`: PEFT's
target_parameters names. transformers 5 stores Qwen3-MoE experts fused, gate_up_proj [E, 2I, H] (the gate's I rows
first) and down_proj [E, H, I]; shardfit keeps gate_proj and up_proj apart, so the gate_up adapter is one A shared by
both and one B whose rows :I add to the gate and I: to the up projection, exactly PEFT's adapter on the fused weight.
Shapes (E experts, r rank, H hidden, I expert inner size), on the Experts module beside its weights, fp32:
  gate_up_proj_lora_A [E, r, H]   gate_up_proj_lora_B [E, 2I, r]
  down_proj_lora_A    [E, r, I]   down_proj_lora_B    [E, H, r]
Expert e's rows x get W_e x + (alpha/r) B_e A_e x: x A^T [N, r] and then that times B^T, each one more grouped GEMM
over the same row groups as the base's (models/moe.py's grouped_linear on CUDA in bf16, its loop elsewhere). No
dropout: PEFT folds these adapters into the weight (ParamWrapper) and refuses dropout, so the config refuses it too.
Stacked along E like the base, the adapters shard with it: expert parallelism cuts every parameter of the module
along E (parallel/expert.py), FSDP groups them with the base experts (a frozen compute-dtype base and fp32 adapters
in one group, as a block's linear adapters), and with E = W they are cast by the computation like the base and
their gradients written in fp32 by its backward. Initialisation is lora.py's (A ~ N(0, 1/(3 in)), B = 0, drawn
from (seed, name) row by row of E: 1 and N ranks start alike). The router stays frozen. No collectives here.
PEFT's layout of these adapters in a file (its keys, E*r rows and r*E columns) is weights/peft.py's.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from shardfit.models.moe import Experts

GATE_UP, DOWN = "gate_up_proj", "down_proj"  # PEFT's (transformers 5's) names of the expert weights
# lora.targets name -> the expert weights it adapts
EXPERT_TARGETS = {"experts": (GATE_UP, DOWN), f"experts.{GATE_UP}": (GATE_UP,), f"experts.{DOWN}": (DOWN,)}
EXPERT_LEAVES = tuple(f"{w}_lora_{ab}" for w in (GATE_UP, DOWN) for ab in "AB")
_BASE = {"gate_proj": GATE_UP, "up_proj": GATE_UP, "down_proj": DOWN}  # shardfit's weight -> the adapter on it


class LoRAExperts(Experts):
    """Experts with LoRA adapters on gate_up_proj and/or down_proj (module docstring); the class an adapted Experts
    module takes in place (its parameters and names stay)."""

    lora_rank: int
    lora_scale: float
    lora_dropout = 0.0
    adapted: tuple[str, ...]  # GATE_UP and/or DOWN

    def weight_params(self) -> tuple[nn.Parameter | None, ...]:
        """(gate, up, down, gate_up A, gate_up B, down A, down B); None for a projection without an adapter."""
        return (*super().weight_params(), *(getattr(self, n, None) for n in EXPERT_LEAVES))

    def swiglu(self, xs: torch.Tensor, linear, weights) -> torch.Tensor:
        gate, up, down, a_gu, b_gu, a_d, b_d = weights
        g, u = linear(xs, gate), linear(xs, up)  # [N, I] each
        if a_gu is not None:
            d = self._low_rank(xs, a_gu, b_gu, linear)  # [N, 2I]: the gate's rows, then the up's
            half = gate.shape[1]
            g, u = g + d[:, :half], u + d[:, half:]
        h = F.silu(g) * u  # [N, I]
        y = linear(h, down)  # [N, H]
        return y if a_d is None else y + self._low_rank(h, a_d, b_d, linear)

    def _low_rank(self, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, linear) -> torch.Tensor:
        """(alpha/r) B_e A_e x_e for every expert's rows: x [N, in], a [E, r, in], b [E, out, r] -> [N, out]. The
        scale goes on the narrow [N, r] product. Adapters already in x's dtype under FSDP or the cast (bf16 on CUDA);
        cast here for a model that was not sharded (shardfit generate --adapter on a bf16 base)."""
        return linear(linear(x, a.to(x.dtype)) * self.lora_scale, b.to(x.dtype))

    def delta(self, weight: str, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        """The update to the stacked base `weight` (gate_proj, up_proj or down_proj), fp32 [E, out, in], from the
        full A and B of its adapter (gate_up's B rows split between gate and up)."""
        b = b.float()
        if weight != "down_proj":
            half = b.shape[1] // 2
            b = b[:, :half] if weight == "gate_proj" else b[:, half:]
        return torch.bmm(b, a.float()) * self.lora_scale


def expert_names(spec: str) -> tuple[str, ...]:
    """The expert weights (GATE_UP, DOWN, in that order) that lora.targets' names ask for."""
    names = {t.strip() for t in spec.split(",")}
    return tuple(w for w in (GATE_UP, DOWN) if any(w in EXPERT_TARGETS[n] for n in names & EXPERT_TARGETS.keys()))


def expert_targets(model: nn.Module, spec: str) -> list[tuple[str, Experts]]:
    """(name, module) of the MoE layers' Experts modules, in model order, when lora.targets names experts."""
    if not expert_names(spec):
        return []
    return [(fqn, m) for fqn, m in model.named_modules() if isinstance(m, Experts)]


def peft_caveat(model: nn.Module, targets: list[str]) -> str | None:
    """The notice for adapters on the dense MLP layers of an MoE model (decoder_sparse_step, mlp_only_layers): PEFT
    (0.18+ on transformers 5) reads gate_proj / up_proj / down_proj in a Qwen3-MoE adapter's target_modules as
    transformers 4's expert layers and moves them to the fused experts (transformers_weight_conversion.py), so its
    PeftModel would not load those adapters. shardfit's own reading (lora.adapter, generate --adapter) and the merged
    export are unaffected. None otherwise."""
    dense = sorted({t.rpartition(".")[2] for t in targets if ".mlp." in t and not is_expert_target(t)})
    if not dense or not any(isinstance(m, Experts) for m in model.modules()):
        return None
    return (f"the exported adapter's {'/'.join(dense)} adapters sit on dense MLP layers of an MoE model: PEFT on "
            f"transformers 5 takes those names for the experts' weights and will not load them (shardfit does)")


def add_expert_adapters(mod: Experts, adapted: tuple[str, ...], rank: int, alpha: float) -> None:
    """Register fp32 adapters (zeros: init_adapters draws them) for `adapted` and make `mod` a LoRAExperts."""
    n, inner, dim = mod.gate_proj.shape
    f32 = {"dtype": torch.float32, "device": mod.gate_proj.device}
    shapes = {GATE_UP: ((n, rank, dim), (n, 2 * inner, rank)), DOWN: ((n, rank, inner), (n, dim, rank))}
    for w in adapted:
        for ab, shape in zip("AB", shapes[w]):
            setattr(mod, f"{w}_lora_{ab}", nn.Parameter(torch.zeros(shape, **f32)))
    mod.__class__ = LoRAExperts
    mod.lora_rank, mod.lora_scale, mod.adapted = rank, alpha / rank, adapted


def adapter_of(weight: str) -> str:
    """The adapter (GATE_UP or DOWN) a stacked base weight's merge takes."""
    return _BASE[weight]


def is_expert_adapter(name: str) -> bool:
    return name.rpartition(".")[2] in EXPERT_LEAVES


def is_expert_target(fqn: str) -> bool:
    """Whether one of apply_lora's names is an expert weight's (`<layer>.mlp.experts.down_proj`), not a module's."""
    module, _, weight = fqn.rpartition(".")
    return weight in (GATE_UP, DOWN) and module.rpartition(".")[2] == "experts"


def adapted_experts(targets: list[str]) -> tuple[str, ...]:
    """The expert weights (GATE_UP, DOWN, in that order) among apply_lora's names."""
    found = {fqn.rpartition(".")[2] for fqn in targets if is_expert_target(fqn)}
    return tuple(w for w in (GATE_UP, DOWN) if w in found)


__all__ = ["DOWN", "EXPERT_LEAVES", "EXPERT_TARGETS", "GATE_UP", "LoRAExperts", "adapted_experts", "adapter_of",
           "add_expert_adapters", "expert_names", "expert_targets", "is_expert_adapter", "is_expert_target",
           "peft_caveat"]
