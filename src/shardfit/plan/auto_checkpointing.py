"""compute.activation_checkpoint=auto: the checkpointing chosen at start-up from the plan, for the GPU in hand.

Checkpointing trades compute for memory block by block: a checkpointed block keeps only its input and runs its forward
again in backward (about a third more of its work, half under LoRA, whose backward has no weight gradients of the
base). `full` everywhere is what frameworks default to; on a GPU with room it recomputes for nothing. `auto` takes the
fewest blocks checkpointed (the first N: parallel/parallelize.py's checkpointed_blocks says why the first) that the
plan predicts to fit the allocation budget at the configured micro-batch (proposals.partial_checkpointing, the same
search `shardfit plan` proposes), none when every block fits, every block when nothing less fits or saves at
least proposals.MIN_SAVING of the compute (then a block or two fewer is not worth the margin it takes).

Every rank must build the same model: the choice is made from the config, the world size and the smallest GPU of
the job (the Engine's one all-reduce of the device's memory before it builds), so every rank chooses alike.
"""

from __future__ import annotations

from shardfit.config.schema import Config
from shardfit.plan.estimate import GiB, allocation_budget, as_rows, estimate, fits
from shardfit.plan.proposals import apply, partial_checkpointing

EVERY_BLOCK = {"compute.activation_checkpoint": "full", "compute.ac_blocks": 0, "compute.ac_every": 1}


def auto_checkpointing(cfg: Config, world: int, gpu_gib: float | None) -> tuple[dict, str]:
    """The changes that resolve compute.activation_checkpoint=auto on `world` GPUs of gpu_gib each (None: no GPU,
    no checkpointing), and the line the run prints. The changes always set activation_checkpoint and ac_blocks."""
    if gpu_gib is None:
        return ({"compute.activation_checkpoint": "none", "compute.ac_blocks": 0},
                "compute.activation_checkpoint=auto on the CPU: no checkpointing (no device memory to fit)")
    full = apply(cfg, EVERY_BLOCK)
    proposal = partial_checkpointing(full, world, gpu_gib)
    changes = {**EVERY_BLOCK, **(proposal.changes if proposal else {})}
    L = cfg.model.n_layers
    if proposal is None and L < 2:  # partial_checkpointing searches 2 blocks or more: one block is all or nothing
        nothing = {**EVERY_BLOCK, "compute.activation_checkpoint": "none"}
        c = apply(cfg, nothing)
        if fits(estimate(c, world, as_rows(c).train.micro_batch), allocation_budget(gpu_gib * GiB), gpu_gib * GiB):
            changes = nothing
    chosen = apply(cfg, changes)
    n = changes["compute.ac_blocks"]
    what = ("no checkpointing" if changes["compute.activation_checkpoint"] == "none" else
            f"the first {n} of {L} blocks checkpointed" if n else
            "every block checkpointed (fewer would not fit, or would save under 1% of the compute)")
    peak = (proposal.estimate if proposal else estimate(chosen, world, as_rows(chosen).train.micro_batch)).peak
    budget = allocation_budget(gpu_gib * GiB)
    line = (f"compute.activation_checkpoint=auto: {what}, predicted peak {peak / GiB:.1f} GiB of a "
            f"{budget / GiB:.1f} GiB budget per GPU (shardfit plan)")
    if peak > budget:
        line += "; even that is predicted NOT to fit: see `shardfit plan --propose` with this config"
    return changes, line


def resolved(cfg: Config, world: int, gpu_gib: float | None) -> Config:
    """cfg as a run on `world` GPUs of gpu_gib would build it: compute.activation_checkpoint=auto replaced by its
    choice (anything else unchanged)."""
    if cfg.compute.activation_checkpoint != "auto":
        return cfg
    return apply(cfg, auto_checkpointing(cfg, world, gpu_gib)[0])
