"""The report of `shardfit plan`: the configured case, the largest micro-batch per checkpointing mode, host memory.

Only what `shardfit train` accepts is reported as fitting: the configured layout goes through the loader's rules and
parallel/layout.py's checks (the ones train runs before it builds anything), and a refused layout is printed as
such, with train's own line, its memory still shown for comparison. The per-mode rows list only micro-batches that
split the global batch as train requires (micro_batch.py walks up to 64). The inputs are checked first (checks.py):
one line naming the option or key instead of an overflow deep in torch or a planner that never returns.
Figures in the table are GiB of one rank's allocated memory, the terms of estimate.py.
"""
from __future__ import annotations

import dataclasses

from shardfit.config.schema import Config
from shardfit.config.shape import StepShape
from shardfit.errors import ShardfitError
from shardfit.parallel.layout import refusal
from shardfit.plan.adapters import quantize
from shardfit.plan.checks import check_plan_inputs
from shardfit.plan.estimate import (
    Estimate,
    GiB,
    allocation_budget,
    as_rows,
    estimate,
    fits,
    host_budget,
    host_fits,
    host_per_node,
)
from shardfit.plan.micro_batch import largest_micro_batch

MODES = ("none", "selective", "full")  # activation checkpointing, from the least recomputation to the most

_LORA_KIND = {"none": "LoRA", "nf4": "QLoRA (NF4 base)", "fp8": "LoRA (FP8 base)"}


def with_mode(cfg: Config, mode: str) -> Config:
    return dataclasses.replace(cfg, compute=dataclasses.replace(cfg.compute, activation_checkpoint=mode))


def mode_label(cfg: Config) -> str:
    """The checkpointing column: the mode, and under full how many of the blocks when not all (ac_blocks, ac_every:
    "full 57/80")."""
    from shardfit.parallel.parallelize import checkpointed_blocks

    mode, n = cfg.compute.activation_checkpoint, cfg.model.n_layers
    k = sum(checkpointed_blocks(cfg.compute, n))
    return f"{mode} {k}/{n}" if mode == "full" and k < n else mode


def with_micro_batch(cfg: Config, micro_batch: int) -> Config:
    return dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, micro_batch=micro_batch))


def layout_refusal(cfg: Config, world: int) -> ShardfitError | None:
    """Why train refuses this layout whatever the micro-batch (checked at micro-batch 1), or None."""
    return refusal(cfg if StepShape.of(cfg).by_tokens else with_micro_batch(cfg, 1), world)


def largest_per_mode(cfg: Config, world: int, gpu_gib: float) -> dict[str, Estimate | None]:
    """The largest micro-batch that fits a GPU of gpu_gib and that train accepts (it splits the global batch), per
    checkpointing mode; None: not even 1, or train refuses the layout (layout_refusal)."""
    check_plan_inputs(cfg, world, gpu_gib)
    if layout_refusal(cfg, world) is not None:
        return dict.fromkeys(MODES)
    rows = StepShape.of(cfg).budget  # rows of a token budget: train takes the budget, not a row count

    def accept(mode_cfg: Config):
        return None if rows else lambda mb: refusal(with_micro_batch(mode_cfg, mb), world) is None

    return {mode: largest_micro_batch(as_rows(with_mode(cfg, mode)), world, allocation_budget(gpu_gib * GiB),
                                      device_bytes=gpu_gib * GiB, accept=accept(with_mode(cfg, mode)))
            for mode in MODES}


def host_line(e: Estimate, cfg: Config, world: int, gpus_per_node: int, host_gib: float | None) -> str:
    """What parallel.offload asks of each node's host memory, and whether it exceeds --host-memory."""
    ranks = min(world, gpus_per_node)
    kept = cfg.parallel.offload_gpu_blocks
    what = ("fp32 parameters and gradients, pinned, and Adam moments"
            + (f", the first {kept} blocks' on the GPU instead" if kept else ""))
    line = (f"host memory per node: {host_per_node(e, world, gpus_per_node) / GiB:.1f} GiB ({what}, of {ranks} "
            f"rank(s), {e.host / GiB:.1f} GiB each)")
    if host_gib is not None:
        usable = f"{host_budget(host_gib) / GiB:.1f} GiB usable: 10% left to the processes and the page cache"
        line += (f": {'within' if host_fits(e, world, gpus_per_node, host_gib) else 'EXCEEDS'} the host's "
                 f"{host_gib:.0f} GiB ({usable})")
    return line


def configured(cfg: Config, world: int, gpu_gib: float, host_gib: float | None = None,
               gpus_per_node: int = 8) -> tuple[Estimate, bool]:
    """The config as given (its micro-batch; 1 when chosen at launch) and whether train accepts it (refusal) and
    it fits the GPU and, host memory given, the offloaded states fit one node's host memory."""
    check_plan_inputs(cfg, world, gpu_gib, host_gib, gpus_per_node)
    accepted = refusal(cfg, world) is None
    cfg = as_rows(cfg)  # token budgets: one [1, micro_batch_tokens] row
    e = estimate(cfg, world, cfg.train.micro_batch or 1)
    return e, accepted and fits(e, allocation_budget(gpu_gib * GiB), gpu_gib * GiB) and host_fits(
        e, world, gpus_per_node, host_gib)


def plan_table(cfg: Config, world: int, gpu_gib: float, host_gib: float | None = None,
               gpus_per_node: int = 8) -> str:
    """The report of `shardfit plan`: the configured micro-batch's peak, then the largest micro-batch per mode."""
    check_plan_inputs(cfg, world, gpu_gib, host_gib, gpus_per_node)
    budget = allocation_budget(gpu_gib * GiB)
    m = cfg.model
    budget_rows = StepShape.of(cfg).budget
    given, cfg = cfg, as_rows(cfg)
    gpus = f"{world} GPU{'s' if world > 1 else ''}"
    lines = [f"shardfit plan: {m.name}, {gpus} of {gpu_gib:.4g} GiB, seq {cfg.data.seq_len}"
             + (" (token-budget rows: micro-batch k is k rows)" if budget_rows else "")
             + (f" (Ulysses over {cfg.parallel.sequence_parallel})" if cfg.parallel.sequence_parallel > 1 else "")
             + (f", HSDP: {cfg.parallel.replicate} replicas of {world // cfg.parallel.replicate}-GPU shard groups"
                if cfg.parallel.replicate > 1 else "")
             + (f", CPU offload of {cfg.parallel.offload}" if cfg.parallel.offload != "none" else "")
             + (f", expert parallel {cfg.parallel.expert_parallel}" if cfg.parallel.expert_parallel > 1 else "")
             + (f" but the first {cfg.parallel.offload_gpu_blocks} blocks" if cfg.parallel.offload_gpu_blocks else "")
             + f", keep_grads={str(cfg.memory.keep_grads).lower()}"
             + (", compiled blocks" if cfg.compute.compile else ", eager blocks")
             + (f", FP8 {cfg.compute.fp8}" if cfg.compute.fp8 != "none" else "")
             + (f", {_LORA_KIND[quantize(cfg)]} rank {cfg.lora.rank}"
                if cfg.lora.rank else "")
             + f"; budget for allocated memory {budget / GiB:.1f} GiB",
             "", f"{'checkpointing':13} {'micro-batch':>11} {'peak GiB':>9} {'states':>7} {'fsdp':>6} "
             f"{'activations':>11} {'working':>8}"]

    refused, refused_any = refusal(given, world), layout_refusal(given, world)

    def row(mode: str, e: Estimate | None, note: str = "") -> str:
        if e is None:
            return f"{mode:13} {'-':>11} " + (f"{'refused by shardfit train (above)':>45}" if refused_any else
                                               f"{'does not fit even at micro-batch 1':>45}")
        fsdp = e.fsdp + e.offload_copies
        return (f"{mode:13} {e.micro_batch:>11} {e.peak / GiB:>9.1f} {e.states / GiB:>7.1f} {fsdp / GiB:>6.1f} "
                f"{e.activations / GiB:>11.1f} {e.working / GiB:>8.1f}{note}")

    mine, ok = configured(given, world, gpu_gib, host_gib, gpus_per_node)
    if mine.idle_cache:
        lines[0] += (f", and allocated + the freed gradients' {mine.idle_cache / GiB:.1f} GiB cache under "
                     f"{gpu_gib - 4.5:.1f} GiB")
    verdict = ("fits" if ok else "DOES NOT FIT" if not fits(mine, budget, gpu_gib * GiB)
               else "DOES NOT FIT the host" if refused is None else "memory counted for comparison")
    lines.append(row(mode_label(cfg), mine, f"  <- as configured: {verdict}"))
    if refused is not None:  # train's own line: every layout printed as fitting is one train accepts
        lines.append(f"  REFUSED by shardfit train: {refused}")
    for mode, best in largest_per_mode(given, world, gpu_gib).items():
        lines.append(row(mode_label(with_mode(cfg, mode)), best, "  (largest tried: 64; more may fit)"
                         if best and best.micro_batch == 64 else "  (largest that fits)"))
    if cfg.parallel.offload != "none":
        lines += ["", host_line(mine, cfg, world, gpus_per_node, host_gib)]
    return "\n".join(lines)
