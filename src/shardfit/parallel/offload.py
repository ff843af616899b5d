"""CPU offload (parallel.offload=all): FSDP2's CPUOffloadPolicy, the shards' materialisation in host memory, and the
threads of the CPU optimizer step.

Where everything lives with offload=all (P parameters, N ranks; fp32 states; bf16 compute on CUDA):
  host, pinned:  the fp32 parameter shard (4P/N bytes), its fp32 gradient (4P/N, allocated by FSDP at each step's
                 first reduce-scatter and freed by zero_grad), Adam's two moments (8P/N, plain host memory: the CPU
                 step reads them in place and they never cross PCIe);
  GPU:           the buffers (RoPE frequencies), each group's gathered bf16 parameters while it computes, the
                 unsharded fp32 gradients of the group being reduced, activations.
Per micro-batch FSDP2 copies each group's fp32 shard to the GPU before its all-gather (forward, and again in
backward for the groups resharded after forward: 4P/N bytes each time) and each reduced gradient shard back to
pinned host memory (4P/N, asynchronously in the reduce-scatter stream; the host waits for those copies once, at the
end of backward, in FSDP's finalize_backward). The optimizer step then runs on the CPU (fused AdamW: one pass over
parameter, gradient and both moments per element; train/optim.py), one per rank, on this rank's share of the cores.

offload=optimizer (moments and step on the CPU, parameters and gradients on the GPU) is refused: FSDP2 has no such
policy, and doing it outside FSDP means a second fp32 copy of every shard in host memory kept equal to the GPU's
through every path that writes parameters (initialisation, Hugging Face load, DCP resume), an optimizer wrapper whose
state DCP maps back to the model's parameters, and 8 bytes per parameter over PCIe each step with the GPU idle during
the CPU step unless it is pipelined by chunks. It would keep 8 bytes per parameter on the GPU (fp32 weights and
gradients): Llama-3-8B would still not fit one 80 GB GPU, which offload=all does.
"""

from __future__ import annotations

import os

import torch
from torch import nn
from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy

from shardfit.config.schema import ParallelConfig
from shardfit.errors import ShardfitError


def check_offload(cfg: ParallelConfig) -> None:
    """Refuse what offload cannot do, before any process group or module is built (one line, exit 2)."""
    if cfg.offload == "optimizer":
        raise ShardfitError("parallel.offload=optimizer is not supported: FSDP2 offloads parameters, gradients and "
                            "optimizer states together or not at all (parallel/offload.py says why)",
                            where="parallel.offload", fix="use parallel.offload=all, or none")
    if cfg.offload == "all" and cfg.fp8 != "none":
        # FP8 weights refresh their scales with an all-reduce of amaxes computed on the weights (on the host here)
        # and all-gather through torchao's own pre-all-gather hook: neither is built for host-resident shards.
        raise ShardfitError("parallel.offload=all does not combine with parallel.fp8", where="parallel.offload",
                            fix="set parallel.fp8=none, or parallel.offload=none")


def offload_policy(cfg: ParallelConfig, device: torch.device) -> OffloadPolicy:
    """FSDP2's policy for every group. Pinned host memory on CUDA: the per-group host-to-device copies before each
    all-gather and the gradient copies back are then asynchronous DMA transfers that overlap compute (pageable memory
    would make each a synchronous staged copy on the host thread). Without CUDA there is nothing to pin (and pinning
    needs a CUDA runtime): the CPU run takes the same FSDP code paths (host shards, gradients moved to the host after
    each reduce-scatter, host accumulation) with the copies being no-ops."""
    if cfg.offload != "all":
        return OffloadPolicy()
    return CPUOffloadPolicy(pin_memory=device.type == "cuda")


def offloaded(model: nn.Module) -> bool:
    """Whether FSDP2 keeps this model's shards on the host (read from FSDP's own state, for tests and notices)."""
    state = model._get_fsdp_state() if hasattr(model, "_get_fsdp_state") else None
    group = getattr(state, "_fsdp_param_group", None)
    return bool(group and group.fsdp_params and all(p.offload_to_cpu for p in group.fsdp_params))


class _DeviceTwins:
    """Stands in for the model in its own init_weights (same attributes it reads: cfg, named_parameters,
    init_buffers), so that offloaded shards get exactly the values a run without offload draws on the device.

    Initial values come from the device's generator (models/init.py: CUDA and CPU generators draw different numbers),
    so drawing them into host shards directly would start offload=all from other weights than offload=none. Each
    parameter is lent out as a device twin (a DTensor of the same global shape, mesh and placements, so the seeded
    init finds the same global rows), and once init has filled it, copied into the host shard: one parameter's shard
    is on the device at a time (at 8B on one rank, the largest is the 2 GiB fp32 embedding)."""

    def __init__(self, model: nn.Module, device: torch.device):
        self.model, self.device, self.cfg = model, device, model.cfg

    def named_parameters(self, *args, **kwargs):
        from torch.distributed.tensor import DTensor

        for name, p in self.model.named_parameters(*args, **kwargs):
            host = p.to_local() if isinstance(p, DTensor) else p.data
            twin_local = torch.empty(host.shape, dtype=host.dtype, device=self.device)
            twin = (DTensor.from_local(twin_local, p.device_mesh, p.placements, run_check=False, shape=p.shape,
                                       stride=p.stride()) if isinstance(p, DTensor) else twin_local)
            yield name, twin
            # The caller has filled the twin (a generator resumes only when the next parameter is asked for, and
            # once more after the last). A blocking copy: the twin is freed right after.
            host.copy_(twin_local)

    def init_buffers(self) -> None:
        self.model.init_buffers()


def materialize_offloaded(model: nn.Module, device: torch.device, seed: int, init: bool) -> None:
    """Steps 5 and 6 of parallelize for offload=all: shards in host memory, buffers on the device, weights drawn on
    the device (or left for a checkpoint to fill: init=False).

    FSDP2 requires offloaded shards to be materialised on the CPU (it checks at the first forward) and pins them
    itself (CPUOffloadPolicy.pin_memory) when they are set; the buffers are not FSDP's and must sit where the
    compute runs (the RoPE frequencies multiply device tensors)."""
    model.to_empty(device="cpu")
    if device.type != "cpu":
        for module in model.modules():
            for key, buf in module._buffers.items():
                if buf is not None:
                    module._buffers[key] = torch.empty_like(buf, device=device)
    if not init:
        model.init_buffers()
    elif device.type == "cpu":
        model.init_weights(seed)
    else:
        type(model).init_weights(_DeviceTwins(model, device), seed)


def step_threads(device: torch.device) -> str | None:
    """Intra-op threads for the CPU optimizer step, set process-wide; a notice for the banner, or None on the CPU.

    Each rank steps its own shards, so a rank gets its share of the cores it may run on: len(affinity) cores, of
    which the ranks of this node (LOCAL_WORLD_SIZE) share os.cpu_count() (NUMA binding, parallel.numa_bind, already
    narrowed the affinity to the GPU's node, shared by that node's ranks). torchrun sets OMP_NUM_THREADS=1 for more
    than one process per node, which would leave the step, memory-bound on ~16 bytes read and 12 written per
    parameter, on one core. CPU training (device cpu) keeps the threads it was given: the compute uses them."""
    if device.type == "cpu":
        return None
    local_world = max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    threads = max(1, min(usable, (os.cpu_count() or 1) // local_world))
    torch.set_num_threads(threads)
    return (f"parallel.offload=all: sharded parameters, gradients and Adam states in host memory; the optimizer "
            f"step runs on the CPU with {threads} threads per rank ({local_world} rank(s) on this node)")
