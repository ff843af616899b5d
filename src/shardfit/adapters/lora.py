"""LoRA adapters on a frozen base: the modules, the swap that puts them on a model, their seeded initialisation.

In place, names kept: each target keeps its module object, its parameters and their Hugging Face names
(`...q_proj.weight` stays, so checkpoints, the loader and the export are unchanged); its class becomes a subclass
that adds the adapter (LoRALinear for nn.Linear; torch's parametrize swaps classes the same way), and the adapter's
parameters are registered beside the weight. So an FP8 layer (parallel/fp8.py's Float8Linear, swapped first) takes
an adapter too: its base matmul in FP8, the adapter's in the compute dtype.
Shapes: a linear layer W [out, in] gets lora_A [r, in] and lora_B [out, r]: y = W x (+ b) + (alpha/r) B A drop(x).
An embedding E [V, D] gets PEFT's lora_embedding_A [r, V] and lora_embedding_B [D, r]: y = E[ids] + (alpha/r)
(A^T[ids] B^T), no dropout (PEFT applies none there). The output head's adapter is added to its weight,
W + (alpha/r) B A, which the fused loss then reads (no dropout: the config refuses it).
MoE experts (stacked [E, out, in] weights, not linear modules) take per-expert adapters run as grouped GEMMs:
adapters/expert_lora.py (LoRAExperts); apply_lora, is_adapter and init_adapters here cover them.
Frozen base (`freeze_base`): every parameter but the adapters has requires_grad=False and is stored in the compute
dtype (bf16 on CUDA): no fp32 master, no gradient, no optimizer state. Adapters are fp32 (FSDP casts them for the
forward and reduces their gradients in fp32; optimizer state fp32).
Initialisation depends only on (seed, parameter name) (models/init.py): lora_A ~ N(0, 1/(3 in)), the variance of
PEFT's kaiming-uniform, lora_B = 0, so training starts from the base exactly; embeddings the other way round, as
PEFT does (A = 0, B ~ N(0, 1)). 1 and N ranks start identical. No collectives; works on the meta model
(parallelize's step 0) and on a materialised one (shardfit generate --adapter).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from shardfit.adapters.expert_lora import (
    EXPERT_LEAVES,
    LoRAExperts,
    add_expert_adapters,
    expert_names,
    expert_targets,
    is_expert_target,
    peft_caveat,
)
from shardfit.config.schema import LORA_LINEAR, LoraConfig
from shardfit.errors import ShardfitError
from shardfit.models.decoder import OutputHead, count_params
from shardfit.models.init import ShardView, seeded_normal_, whole_view

LINEAR_LEAVES = ("lora_A", "lora_B")
EMBEDDING_LEAVES = ("lora_embedding_A", "lora_embedding_B")


class LoRAModule:
    """What every adapted module has: its rank, scale alpha / r and dropout; `delta_weight` is the adapter as a
    weight-shaped update (what merging adds)."""

    lora_rank: int
    lora_scale: float
    lora_dropout: float

    def adapter_pair(self) -> tuple[nn.Parameter, nn.Parameter]:
        """(A, B) as registered on the module."""
        return self.lora_A, self.lora_B

    def delta_weight(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        """The update to the base weight, fp32, from full A and B (linear: [out, in])."""
        return (b.float() @ a.float()) * self.lora_scale


class _LinearAdapter(LoRAModule):
    # a pass of several models: this layer's share of adapters/lora_stack.py's AdapterStack, used instead of A and B
    lora_stack = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = super().forward(x)
        if self.lora_stack is not None:
            return out + self.lora_stack.delta(self, x).to(out.dtype)
        a, b = self.lora_A, self.lora_B
        h = x.to(a.dtype)
        if self.lora_dropout:
            h = F.dropout(h, self.lora_dropout, self.training)
        return out + (F.linear(F.linear(h, a), b) * self.lora_scale).to(out.dtype)


class LoRALinear(_LinearAdapter, nn.Linear):
    """nn.Linear with an adapter: y = W x (+ b) + (alpha/r) B A drop(x)."""


class LoRAEmbedding(LoRAModule, nn.Embedding):
    """nn.Embedding with PEFT's embedding adapter: y = E[ids] + (alpha/r) A^T[ids] B^T."""

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        out = super().forward(ids)
        a, b = self.lora_embedding_A, self.lora_embedding_B
        return out + (F.embedding(ids, a.t()) @ b.t() * self.lora_scale).to(out.dtype)

    def adapter_pair(self) -> tuple[nn.Parameter, nn.Parameter]:
        return self.lora_embedding_A, self.lora_embedding_B

    def delta_weight(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return (b.float() @ a.float()).t() * self.lora_scale  # [V, D]


class LoRAOutputHead(LoRAModule, OutputHead):
    """The output head with an adapter added to the weight every path multiplies by (logits, fused loss)."""

    def head_weight(self) -> torch.Tensor:
        w = self.weight
        return w + ((self.lora_B @ self.lora_A) * self.lora_scale).to(w.dtype)


_CLASSES: dict[type, type] = {nn.Linear: LoRALinear, nn.Embedding: LoRAEmbedding, OutputHead: LoRAOutputHead}


def lora_class(cls: type) -> type:
    """The adapted class of a module class: one of the above, or for another nn.Linear subclass (torchao's
    Float8Linear) a subclass made once, whose forward is that class's plus the adapter."""
    if cls not in _CLASSES:
        if not issubclass(cls, nn.Linear):
            raise TypeError(f"LoRA adapts linear and embedding layers, not {cls.__name__}")
        _CLASSES[cls] = type(f"LoRA{cls.__name__}", (_LinearAdapter, cls), {})
    return _CLASSES[cls]


def lora_targets(model: nn.Module, spec: str) -> list[tuple[str, nn.Module]]:
    """(name, module) of the modules lora.targets names, in model order: linear layers of the blocks whose own name
    is listed (all-linear: every one but MoE routers), and embed_tokens / lm_head when listed."""
    names = {t.strip() for t in spec.split(",") if t.strip()}
    out = []
    for fqn, mod in model.named_modules():
        leaf = fqn.rpartition(".")[2]
        if fqn == "model.embed_tokens":
            chosen = "embed_tokens" in names
        elif fqn == "lm_head":
            chosen = "lm_head" in names
        elif fqn.startswith("model.layers.") and isinstance(mod, nn.Linear):
            chosen = leaf in names or ("all-linear" in names and not fqn.endswith("mlp.gate"))
        else:
            chosen = False
        if chosen:
            out.append((fqn, mod))
    return out


def target_names(targets: list[str]) -> list[str]:
    """The module names (adapter_config.json's target_modules) of the adapted modules' full names (apply_lora's);
    the experts' weights left out (PEFT's target_parameters: adapters/expert_lora.py)."""
    return sorted({fqn.rpartition(".")[2] for fqn in targets if not is_expert_target(fqn)})


def freeze_base(model: nn.Module, dtype: torch.dtype | None) -> None:
    """Every parameter frozen and, when dtype is given, stored in it (a tied weight stays one parameter)."""
    made: dict[int, nn.Parameter] = {}
    for mod in model.modules():
        for key, p in list(mod._parameters.items()):
            if p is None:
                continue
            if dtype is None or p.dtype == dtype:
                p.requires_grad_(False)
                continue
            if id(p) not in made:
                made[id(p)] = nn.Parameter(p.detach().to(dtype), requires_grad=False)
            mod._parameters[key] = made[id(p)]


def add_adapter(mod: nn.Module, rank: int, alpha: float, dropout: float) -> None:
    """Register fp32 adapter parameters on `mod` (zeros: init_adapters draws them) and swap in its LoRA class."""
    new = lora_class(type(mod))
    f32 = {"dtype": torch.float32, "device": mod.weight.device}
    if issubclass(new, LoRAEmbedding):
        vocab, dim = mod.weight.shape
        mod.lora_embedding_A = nn.Parameter(torch.zeros(rank, vocab, **f32))
        mod.lora_embedding_B = nn.Parameter(torch.zeros(dim, rank, **f32))
    else:
        out_f, in_f = mod.weight.shape
        mod.lora_A = nn.Parameter(torch.zeros(rank, in_f, **f32))
        mod.lora_B = nn.Parameter(torch.zeros(out_f, rank, **f32))
    mod.__class__ = new
    mod.lora_rank, mod.lora_scale, mod.lora_dropout = rank, alpha / rank, dropout


def apply_lora(model: nn.Module, cfg: LoraConfig, base_dtype: torch.dtype | None) -> list[str]:
    """Freeze the base (stored in base_dtype) and put adapters on lora.targets; returns the adapted modules' names,
    then the adapted expert weights' (`model.layers.0.mlp.experts.gate_up_proj`: adapters/expert_lora.py).
    Called on the meta model before checkpointing, compile and FSDP (parallel/parallelize.py, step 0)."""
    targets = lora_targets(model, cfg.targets)
    experts, adapted = expert_targets(model, cfg.targets), expert_names(cfg.targets)
    if adapted and not experts:
        raise ShardfitError(f"'{cfg.targets}' names the experts of MoE layers, and this model has none",
                            where="lora.targets", fix="leave experts out of lora.targets")
    if not targets and not experts:
        raise ShardfitError(f"'{cfg.targets}' matches no module of this model", where="lora.targets",
                            fix="name modules the model has (on an MoE model, experts adapts its experts)")
    freeze_base(model, base_dtype)
    for _, mod in targets:
        add_adapter(mod, cfg.rank, cfg.alpha, cfg.dropout)
    for _, mod in experts:
        add_expert_adapters(mod, adapted, cfg.rank, cfg.alpha)
    return [fqn for fqn, _ in targets] + [f"{fqn}.{w}" for fqn, _ in experts for w in adapted]


def is_adapter(name: str) -> bool:
    """Whether a parameter name is an adapter's."""
    return name.rpartition(".")[2] in LINEAR_LEAVES + EMBEDDING_LEAVES + EXPERT_LEAVES


def has_adapters(model: nn.Module) -> bool:
    return any(isinstance(m, (LoRAModule, LoRAExperts)) for m in model.modules())


def base_parameters(model: nn.Module) -> dict[str, nn.Parameter]:
    """{name: parameter} of everything but the adapters: what a Hugging Face checkpoint fills."""
    return {n: p for n, p in model.named_parameters() if not is_adapter(n)}


@torch.no_grad()
def init_adapters(model, seed: int, view: ShardView = whole_view) -> None:
    """Draw every adapter parameter from (seed, its name) (module docstring). `model` may be anything with
    named_parameters (parallel/offload.py's device twins of host shards)."""
    for name, p in model.named_parameters():
        leaf = name.rpartition(".")[2]
        if leaf in ("lora_A", *EXPERT_LEAVES[::2]):  # [r, in], an expert's [E, r, in]: PEFT's variance, 1/(3 in)
            seeded_normal_(p, (3 * p.shape[-1]) ** -0.5, seed, name, view)
        elif leaf == "lora_embedding_B":
            seeded_normal_(p, 1.0, seed, name, view)
        elif leaf in ("lora_B", "lora_embedding_A", *EXPERT_LEAVES[1::2]):
            view(p)[0].zero_()


def lora_summary(model: nn.Module, targets: list[str]) -> str:
    """One notice line: what trains and what is frozen (on an MoE model, whether its experts are adapted)."""
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    total = count_params(model)  # an NF4 weight (adapters/qlora.py) as its weights, not its bytes
    frozen = {p.dtype for p in model.parameters() if not p.requires_grad and p.is_floating_point()}
    dtype = ", ".join(sorted(str(d).replace("torch.", "") for d in frozen))
    first = next(m for m in model.modules() if isinstance(m, (LoRAModule, LoRAExperts)))
    modules = [t for t in targets if not is_expert_target(t)]
    experts = [m for m in model.modules() if isinstance(m, LoRAExperts)]
    where = f"{len(modules)} modules ({', '.join(target_names(targets))})" if modules else ""
    if experts:
        where += (" and " if where else "") + (f"the experts of {len(experts)} MoE layers "
                                               f"({', '.join(experts[0].adapted)})")
    elif expert_targets(model, "experts"):
        where += " (the MoE experts frozen: add experts to lora.targets to adapt them)"
    caveat = peft_caveat(model, targets)
    return (f"LoRA rank {first.lora_rank} (scale {first.lora_scale:g}) on {where}: {trainable:,} trainable parameters "
            f"of {total:,}; the base is frozen in {dtype}" + (f"; {caveat}" if caveat else ""))


__all__ = ["LORA_LINEAR", "LoRAEmbedding", "LoRAExperts", "LoRALinear", "LoRAModule", "LoRAOutputHead", "add_adapter",
           "apply_lora", "base_parameters", "freeze_base", "has_adapters", "init_adapters", "is_adapter",
           "lora_class", "lora_summary", "lora_targets", "target_names"]
