"""FSDP2's gathered (unsharded) parameters between passes: dropped before anything changes or reads the shards, and
kept over the micro-batches of one no-grad pass on one rank, where that saves a cast per micro-batch.

Stale copies. A group built with reshard_after_forward=False (the last block, an untied embedding and head:
parallelize) keeps its gathered parameters after a forward; a backward reshards them (FSDP's post-backward), a no-grad
pass (Engine.forward, generation, evaluation) does not. The gathered parameter is a tensor of its own in the compute
dtype, so an optimizer step on the shards leaves it stale, and FSDP's next pre-forward, finding the group gathered,
computes with it: with torch 2.13 on one rank, forward, optim_step, forward read the last block's pre-step weights
(tests/train/test_engine_rl.py). drop_gathered(model) reshards every group (local: no collective); the Engine calls
it before each optimizer step and before reading the parameters (weights, export, save, load).

One gather per pass. FSDP2 gathers each group at every forward call, i.e. once per micro-batch. On one rank that
gather is a cast of each fp32 master shard to the compute dtype and a copy of the result into the gathered
parameter (torch's world-size-1 path, on the compute stream, not overlapped): about 10 bytes of memory traffic a
parameter, ~68 GB a micro-batch for the 35 resharded blocks of an 8B model (~23 ms at 3 TB/s) each time.
gathered_for_pass(model, keep=True) turns every group's resharding after forward off for one no-grad pass and drops
them all at its end: the cast then runs once per pass. It costs the model's gathered size in the compute dtype for
the pass (8B in bf16: 16.4 GB), so the Engine keeps them only where that fits half the memory free (fits_gathered),
and only on one rank: with several, whether a group is gathered decides whether its all-gather (a collective) runs,
and a decision taken from each rank's own free memory could differ between ranks.
Experts kept out of FSDP (parallel/expert.py: E = W, one rank included) are cast from their fp32 masters by the MoE
layer itself at every forward; in such a pass their cast is made once too (ShardedExperts.pass_cast) and freed at its
end (what the copies at every micro-batch cost a forward: benchmarks/README.md#rl-2x).
"""

from __future__ import annotations

import contextlib
import os

import torch
from torch import nn

from shardfit.parallel.expert import outside_fsdp_experts
from shardfit.parallel.step_overlap import param_group


def fsdp_groups(model: nn.Module) -> list:
    """The FSDP2 parameter group of every module passed to fully_shard (the root's included)."""
    return [g for g in (param_group(m) for m in model.modules()) if g is not None]


def drop_gathered(model: nn.Module) -> None:
    """Reshard every FSDP group that holds gathered parameters (frees them; the next forward gathers from the
    shards again). Local to the rank; a no-op for groups already sharded."""
    for m in model.modules():
        if param_group(m) is not None:
            m.reshard()


def gathered_bytes(model: nn.Module) -> int:
    """Bytes the groups not gathered now would take gathered, in their compute dtype (param_dtype), and the
    experts outside FSDP their cast for a pass: only weights stored in another dtype (a LoRA run's frozen experts
    are stored in the compute dtype, and their "cast" is the parameter itself: no bytes)."""
    from shardfit.parallel.dtensor import local_tensor

    total = sum(local_tensor(w).numel() * m.compute_dtype.itemsize for m in outside_fsdp_experts(model)
                for w in m.weight_params() if w is not None and w.dtype != m.compute_dtype)
    for g in fsdp_groups(model):
        if g.is_unsharded:
            continue
        cast = getattr(getattr(g, "mp_policy", None), "param_dtype", None)
        for fp in g.fsdp_params:
            total += fp.sharded_param.numel() * (cast or fp.sharded_param.dtype).itemsize
    return total


def free_bytes(device: torch.device) -> int:
    """Memory this process could still allocate on `device`: the driver's free memory plus what the caching
    allocator holds unused (CUDA); free physical pages (CPU; 0 where the system does not say)."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return 0


def fits_gathered(model: nn.Module, device: torch.device) -> bool:
    """Whether gathering every group for a whole pass leaves at least as much memory for the pass itself."""
    need = gathered_bytes(model)
    return need <= free_bytes(device) // 2


@contextlib.contextmanager
def gathered_for_pass(model: nn.Module, keep: bool):
    """keep=True: no group reshards after its forward inside (each is gathered once, at its first forward), and every
    group is resharded at the end, whatever happened inside. keep=False: FSDP's own behaviour, nothing changed."""
    import torch.distributed as dist

    # whether a group is gathered decides whether its all-gather runs: a per-rank choice only where there is one rank
    assert not keep or not dist.is_initialized() or dist.get_world_size() == 1, "keep=True on several ranks"
    if keep and hasattr(model, "_get_fsdp_state"):
        # FSDP's first-forward initialisation, now (idempotent): some releases set the root's resharding there, and
        # the values restored below must be those the passes after this one would have seen
        getattr(model._get_fsdp_state(), "_lazy_init", lambda: None)()
    groups = [g for g in fsdp_groups(model) if hasattr(g, "post_forward_mesh_info")] if keep else []
    saved = [g.post_forward_mesh_info for g in groups]
    experts = outside_fsdp_experts(model) if keep else []
    try:
        for g in groups:
            g.post_forward_mesh_info = None  # what fully_shard(reshard_after_forward=False) sets
        for m in experts:
            m.pass_cast = []  # filled at the layer's first forward of the pass
        yield
    finally:
        for g, info in zip(groups, saved):
            g.post_forward_mesh_info = info
        for m in experts:
            m.pass_cast = None  # the casts freed
        if keep:
            drop_gathered(model)
