"""Frozen extra models (`shardfit serve --serve.models=PATH[,PATH...]`, serve/served.py) in the plan: what each holds
on one rank, and what they leave the sampler's KV cache.

Each is an Engine of its own held as a LoRA run holds its frozen base (Engine(frozen=True)): every parameter stored
in the compute dtype, sharded over the FSDP ranks like the trained model (dim 0 split over world / replicate ranks;
the plan counts rank 0's share, the largest: ceil(rows / shard) rows of each parameter), and nothing else (no
gradients, no optimizer state). Its decode model (sampling/source.py) reads views of those shards on one rank (no
copy: they are in the compute dtype already); on N ranks its first sample gathers the whole model in the compute
dtype on every rank, kept for later calls: params x dtype bytes more a rank. Both stay allocated while the server
runs, so the memory the trained model's sampler finds free for its KV cache is that much smaller (plan/sampler.py
takes the total). The callers (cli/plan.py) read each model's config as serve reads it (serve/served.py's
served_configs: from the directory's config.json), so the counts are of the model the server would build.
"""

from __future__ import annotations

from dataclasses import dataclass

from shardfit.config.schema import Config
from shardfit.plan.activation_trace import compute_dtype, model_key
from shardfit.plan.estimate import GiB, _meta_model


@dataclass
class ServedCost:
    """One frozen extra model on one rank of `world`."""

    name: str  # the path as given (what sampling clients pass as base_model)
    params: int  # its parameters (a tied weight once)
    dtype: str  # the compute dtype, that of its stored weights
    shard_bytes: int  # this rank's shards of its parameters
    decode_bytes: int  # its decode model's own copy: 0 on one rank (views), the whole model on N ranks

    @property
    def bytes(self) -> int:
        return self.shard_bytes + self.decode_bytes


def served_cost(name: str, cfg: Config, world: int) -> ServedCost:
    """What the extra model of config `cfg` (served_configs' value for `name`) holds on one rank of `world`."""
    dtype = compute_dtype(cfg.compute)
    shard = max(world // cfg.parallel.replicate, 1)
    built = _meta_model(model_key(cfg.model))
    params = sum(p.numel() for p in built.parameters())
    elements = sum((-(-p.shape[0] // shard) * (p[0].numel() if p.dim() > 1 else 1)) if p.dim() else 1
                   for p in built.parameters())  # rank 0's dim-0 chunk of each parameter
    decode = 0 if world == 1 else params * dtype.itemsize
    return ServedCost(name, params, str(dtype).split(".")[-1], elements * dtype.itemsize, decode)


def served_costs(served: dict[str, Config], world: int) -> list[ServedCost]:
    return [served_cost(name, c, world) for name, c in served.items()]


def served_lines(costs: list[ServedCost], world: int, peak: int, budget: float) -> list[str]:
    """The plan's lines about the frozen extra models: each one's bytes, their total, and whether the training
    step's peak fits beside them within `budget` (they stay allocated through training)."""
    if not costs:
        return []
    lines = [f"frozen extra model {c.name} (serve.models): {c.params:,} parameters in {c.dtype}, "
             f"{c.shard_bytes / GiB:.3f} GiB of shards a rank" + (
                 f" + {c.decode_bytes / GiB:.3f} GiB gathered for sampling on each of {world} ranks"
                 if c.decode_bytes else " (sampled from views of them: no copy)") for c in costs]
    total = sum(c.bytes for c in costs)
    lines.append(f"frozen extra models: {total / GiB:.3f} GiB a rank in all, held while the server runs: step peak + "
                 f"these = {(peak + total) / GiB:.1f} GiB, " + ("within" if peak + total <= budget else "OVER")
                 + f" the {budget / GiB:.1f} GiB budget; the KV cache below gets what is free after them")
    return lines
