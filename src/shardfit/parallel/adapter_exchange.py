"""The two collectives of a pass of several LoRA models (engine/multi_model.py): K models' FSDP-sharded adapter shards
gathered whole onto every rank before the pass, and their whole gradients reduced back to this rank's shards after
the backward.

FSDP2 shards each adapter parameter P [d0, ...] along dim 0 as torch.chunk does: with W ranks in the shard group and
c = ceil(d0 / W), rank j holds rows j c .. min((j + 1) c, d0) (possibly none). Both collectives move one flat
buffer: each rank's shards padded to c rows, model after model, parameter after parameter,
    buffer [sum_k sum_P c_P x rest_P]      (rest_P: the elements of one row of P)
so that K models of any number of parameters cost ONE all-gather before the pass and ONE reduce-scatter (averaged
over ranks, as FSDP reduces its own gradients) after it, issued by every rank in the same order. The padding rows
are zeros going out and are dropped coming back. Supported: adapters that are DTensors sharded (Shard(0),) over one
mesh (FSDP, sequence parallelism included), or plain tensors on one process; HSDP, tensor or expert parallel
placements are refused in one line by the caller (`shard_group`).
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Shard

from shardfit.errors import ShardfitError


def shard_group(params: list[torch.Tensor]):
    """The process group the adapters are sharded over (None: plain tensors, one process). Refuses other layouts."""
    if not any(isinstance(p, DTensor) for p in params):
        return None
    mesh = params[0].device_mesh if isinstance(params[0], DTensor) else None
    for p in params:
        if not isinstance(p, DTensor) or p.device_mesh != mesh or tuple(p.placements) != (Shard(0),):
            raise ShardfitError("a pass of several models needs adapters sharded by plain FSDP (one mesh, dim 0); "
                                f"this engine places them {getattr(p, 'placements', 'unsharded')}",
                                where="parallel", fix="run the models one after another (model=name), or use "
                                "plain FSDP (no HSDP, tensor or expert parallelism)")
    return mesh.get_group()


def _world(group) -> int:
    return dist.get_world_size(group) if group is not None else 1


def _rows(p: torch.Tensor, world: int) -> tuple[int, int]:
    """(c, rest): the padded rows of one rank's shard of p, and the elements of one row."""
    d0 = p.shape[0]
    return math.ceil(d0 / world), math.prod(p.shape[1:])


def gather_whole(params: list[torch.Tensor], shards: list[list[torch.Tensor]], group) -> list[list[torch.Tensor]]:
    """shards[k][i]: model k's local shard of params[i] (this rank's rows) -> [k][i] the whole tensor, shaped like
    params[i], on every rank: one all-gather (module docstring). New tensors, fp32 as the shards are."""
    world = _world(group)
    if world == 1:
        return [[s.detach().clone().view(p.shape) for p, s in zip(params, model)] for model in shards]
    pieces = []
    for model in shards:
        for p, s in zip(params, model):
            c, rest = _rows(p, world)
            flat = s.detach().reshape(-1, rest)
            pieces.append(torch.cat([flat, flat.new_zeros(c - flat.shape[0], rest)]).reshape(-1))
    buf = torch.cat(pieces)  # [n]: this rank's padded shards
    out = torch.empty(world * buf.numel(), dtype=buf.dtype, device=buf.device)
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor  # renamed in torch 2.13
    gather(out, buf, group=group)
    per_rank = out.view(world, -1)  # [W, n]
    whole, at = [], 0
    for _ in shards:
        row = []
        for p in params:
            c, rest = _rows(p, world)
            block = per_rank[:, at:at + c * rest].reshape(world * c, rest)[:p.shape[0]]  # ranks' rows in order
            row.append(block.reshape(p.shape).clone())
            at += c * rest
        whole.append(row)
    return whole


def reduce_to_shards(params: list[torch.Tensor], grads: list[list[torch.Tensor]], group) -> list[list[torch.Tensor]]:
    """grads[k][i]: this rank's whole gradient of model k's params[i] -> [k][i] this rank's shard of their average
    over the ranks (FSDP's convention: optim_step multiplies by the world), in one reduce-scatter."""
    world = _world(group)
    if world == 1:
        return [[g.view(p.shape) for p, g in zip(params, model)] for model in grads]
    rank = dist.get_rank(group)
    per_rank = []  # [W] lists of pieces: rank j's rows of every (model, parameter)
    for j in range(world):
        pieces = []
        for model in grads:
            for p, g in zip(params, model):
                c, rest = _rows(p, world)
                rows = g.reshape(-1, rest)[j * c:(j + 1) * c]
                pieces.append(torch.cat([rows, rows.new_zeros(c - rows.shape[0], rest)]).reshape(-1))
        per_rank.append(torch.cat(pieces))
    buf = torch.cat(per_rank)  # [W x n]
    out = torch.empty(buf.numel() // world, dtype=buf.dtype, device=buf.device)
    scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor  # renamed in torch 2.13
    scatter(out, buf, op=dist.ReduceOp.AVG, group=group)
    shards, at = [], 0
    for _ in grads:
        row = []
        for p in params:
            c, rest = _rows(p, world)
            n_local = max(0, min(c, p.shape[0] - rank * c))  # this rank's real rows
            row.append(out[at:at + n_local * rest].view(n_local, *p.shape[1:]))
            at += c * rest
        shards.append(row)
    return shards
