"""CPU offload (parallel.offload=all): FSDP2's CPUOffloadPolicy, the shards' materialisation in host memory, and the
CPU optimizer step on a worker thread (OverlappedStep). The design and its arithmetic: docs/offload.md.

Placement, P parameters over N ranks: host, pinned, the fp32 parameter shard (4P/N) and its fp32 gradient (4P/N);
host, plain, Adam's two moments (8P/N, read in place by the CPU step); GPU, the buffers, each group's gathered bf16
parameters while it computes, the unsharded gradients being reduced, activations. Per micro-batch FSDP2 copies each
group's shard to the GPU before its all-gather and each reduced gradient shard back (async in the reduce-scatter
stream; the host waits once, in finalize_backward). The pinned allocator rounds each allocation up to a power of two.
parallel.offload_gpu_blocks = N keeps the FIRST N blocks' states on the GPU (stepped there, on the main thread);
the embedding, head and root groups stay on the host. FSDP2 has no optimizer-only offload (docs/offload.md).
Initial values are drawn on the device and copied into the host shards (_DeviceTwins): the same weights as without
offload. OverlappedStep issues no collective: every rank's step is its own shards'.
"""

from __future__ import annotations

import os

import torch
from torch import nn
from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy

from shardfit.adapters.lora import init_adapters
from shardfit.config.schema import ParallelConfig
from shardfit.parallel.dtensor import local_view
from shardfit.parallel.step_overlap import (
    add_wait_hooks,
    forward_order_groups,
    param_group,
    step_group,
    zero_grads,
)


def offload_policy(cfg: ParallelConfig, device: torch.device, block: int | None = None) -> OffloadPolicy:
    """FSDP2's policy for block `block`'s group (None: the embedding, head and root groups). The first
    parallel.offload_gpu_blocks blocks get no offload: their states stay on the device. Pinned host memory on CUDA:
    the per-group host-to-device copies before each all-gather and the gradient copies back are then asynchronous
    DMA transfers that overlap compute (pageable memory would make each a synchronous staged copy on the host
    thread). Without CUDA there is nothing to pin (and pinning needs a CUDA runtime): the CPU run takes the same FSDP
    code paths (host shards, gradients moved to the host after each reduce-scatter, host accumulation) with the
    copies being no-ops."""
    if cfg.offload != "all" or (block is not None and block < cfg.offload_gpu_blocks):
        return OffloadPolicy()
    return CPUOffloadPolicy(pin_memory=device.type == "cuda")


def _group_on_host(module: nn.Module) -> bool | None:
    """Whether the module's own FSDP group is offloaded (its policy: CPUOffloadPolicy); None without a group."""
    group = param_group(module)
    if group is None or not group.fsdp_params:
        return None
    return all(p.offload_to_cpu for p in group.fsdp_params)


def offloaded(module: nn.Module) -> bool:
    """Whether FSDP2 keeps every parameter of this module in host shards, read from FSDP's own state (for tests and
    notices): the groups of the module and of the modules under it (a block, the embedding, the head, or the whole
    model: False there when offload_gpu_blocks keeps blocks on the device). A module whose parameters belong to a
    group above it (a layer inside a block) has none of its own: False."""
    flags = {id(p.sharded_param): p.offload_to_cpu for m in module.modules() if (g := param_group(m)) is not None
             for p in g.fsdp_params}
    params = list(module.parameters())
    return bool(params) and all(flags.get(id(p), False) for p in params)


def grad_sq_norm(grads: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    """Squared L2 norm of the gradients (local tensors), fp64 on `device`. With offload the gradients are host
    tensors (complete: FSDP's finalize_backward waited for their copies), and with offload_gpu_blocks some are device
    tensors: each device's norm is computed where its gradients are and only the scalar moves (foreach kernels and
    torch.stack take one device). With a single device the result is that of one stack, bit for bit (0 + x = x)."""
    by_device: dict[torch.device, list[torch.Tensor]] = {}
    for g in grads:
        by_device.setdefault(g.device, []).append(g)
    sq = torch.zeros((), dtype=torch.float64, device=device)
    for gs in by_device.values():
        sq = sq + torch.stack(torch._foreach_norm(gs, 2)).double().pow(2).sum().to(device)
    return sq


class _DeviceTwins:
    """Stands in for the model in its own init_weights (same attributes it reads: cfg, named_parameters,
    init_buffers), so that offloaded shards get exactly the values a run without offload draws on the device.

    Initial values come from the device's generator (models/init.py: CUDA and CPU generators draw different numbers),
    so drawing them into host shards directly would start offload=all from other weights than offload=none. Each
    parameter is lent out as a device twin (a DTensor of the same global shape, mesh and placements, so the seeded
    init finds the same global rows), and once init has filled it, copied into the host shard: one parameter's shard
    is on the device at a time (at 8B on one rank, the largest is the 2 GiB fp32 embedding). The shards of blocks
    kept on the device (offload_gpu_blocks) are lent as they are and initialised in place."""

    def __init__(self, model: nn.Module, device: torch.device):
        self.model, self.device, self.cfg = model, device, model.cfg

    def named_parameters(self, *args, **kwargs):
        from torch.distributed.tensor import DTensor

        for name, p in self.model.named_parameters(*args, **kwargs):
            host = p.to_local() if isinstance(p, DTensor) else p.data
            if host.device.type != "cpu":  # a kept block's shard, already on the device
                yield name, p
                continue
            twin_local = torch.empty(host.shape, dtype=host.dtype, device=self.device)
            twin = (DTensor.from_local(twin_local, p.device_mesh, p.placements, run_check=False, shape=p.shape,
                                       stride=p.stride()) if isinstance(p, DTensor) else twin_local)
            yield name, twin
            # The caller has filled the twin (a generator resumes only when the next parameter is asked for, and
            # once more after the last). A blocking copy: the twin is freed right after.
            host.copy_(twin_local)

    def init_buffers(self) -> None:
        self.model.init_buffers()


def materialize_offloaded(model: nn.Module, device: torch.device, seed: int, init: bool,
                          adapters: bool = False) -> None:
    """Steps 5 and 6 of parallelize for offload=all: shards in host memory (those of the blocks kept on the device
    there), buffers on the device, weights drawn on the device (or left for a checkpoint to fill: init=False);
    LoRA adapters (adapters=True) drawn on the device in any case.

    FSDP2 requires offloaded shards to be materialised on the CPU (it checks at the first forward) and pins them
    itself (CPUOffloadPolicy.pin_memory) when they are set; the buffers are not FSDP's and must sit where the
    compute runs (the RoPE frequencies multiply device tensors)."""
    _to_empty(model, device, torch.device("cpu"))
    if device.type != "cpu":
        for module in model.modules():
            for key, buf in module._buffers.items():
                if buf is not None:
                    module._buffers[key] = torch.empty_like(buf, device=device)
    target = model if device.type == "cpu" else _DeviceTwins(model, device)
    if not init:
        model.init_buffers()
    else:
        type(model).init_weights(target, seed, view=local_view)
    if adapters:
        init_adapters(target, seed, view=local_view)


def _to_empty(module: nn.Module, device: torch.device, where: torch.device) -> None:
    """to_empty group by group: each FSDP group's shards where its policy keeps them (offloaded: the host, else
    `device`), a module without a group of its own where its group's module is (`where`). Children first, then the
    module's own tensors and, for a group's module, FSDP's re-registration of its shards (FSDPModule._apply), as
    to_empty(recurse=True) orders them. Nothing is allocated twice: the kept blocks' shards never touch the host."""
    if (on_host := _group_on_host(module)) is not None:
        where = torch.device("cpu") if on_host else device
    for child in module.children():
        _to_empty(child, device, where)
    module.to_empty(device=where, recurse=False)


def step_threads(device: torch.device) -> str | None:
    """Intra-op threads for the CPU optimizer step, set process-wide; a notice for the banner, or None on the CPU.

    Each rank steps its own shards, so a rank gets its share of the cores it may run on: len(affinity) cores, of
    which the ranks of this node (LOCAL_WORLD_SIZE) share os.cpu_count() (NUMA binding, compute.numa_bind, already
    narrowed the affinity to the GPU's node, shared by that node's ranks). torchrun sets OMP_NUM_THREADS=1 for more
    than one process per node, which would leave the step, memory-bound on ~16 bytes read and 12 written per
    parameter, on one core. One of the rank's cores is left to the main thread: it launches the GPU work of the next
    forward while the step runs (OverlappedStep). CPU training (device cpu) keeps the threads it was given: the
    compute uses them."""
    if device.type == "cpu":
        return None
    local_world = max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    threads = max(1, min(usable, (os.cpu_count() or 1) // local_world) - 1)
    torch.set_num_threads(threads)
    return (f"parallel.offload=all: sharded parameters, gradients and Adam states in host memory; the optimizer "
            f"step runs on the CPU with {threads} threads per rank ({local_world} rank(s) on this node)")


class OverlappedStep:
    """The CPU optimizer step of offload=all, run group by group on a worker thread while the next forward runs.

    Without it the GPU idles through the whole CPU step (at Llama-3-8B: ~225 GB of host memory traffic, seconds).
    FSDP reads a group's host shard only when that group is unsharded, in its forward pre-hook; so the worker steps
    the groups in forward order (root, embedding, blocks, head) and each group's forward pre-hook, registered before
    FSDP's, waits until the worker has stepped that group and the `prefetch` groups after it (explicit forward
    prefetch unshards them from this hook). The host-to-device copy of a shard is enqueued after that wait, so the
    DMA reads updated weights; the worker's own work is CPU-only (no kernels, no streams: it only sets its thread's
    current device, see _run). While one block computes, the next one is stepped: a block's step (~6 GB of host
    traffic at 8B) takes about as long as its forward at micro-batch 16.

    The groups kept on the device (offload_gpu_blocks) are stepped by launch() itself, on the main thread, before the
    worker starts: their step only enqueues the fused AdamW's kernels on the current stream (the next forward's
    all-gathers are ordered after them as without offload), and the optimizer is never stepped from two threads at
    once (step() takes the parameters that have a gradient: a concurrent step would see the other's). One optimizer
    holds both devices' parameters: torch's fused AdamW groups its tensors by device and copies grad_scale to each
    (torch/optim/adam.py, _fused_adam), so DCP's optimizer state dict and the synchronous step need nothing else.

    The results are those of one optimizer.step(): AdamW is elementwise per tensor and its state is per parameter,
    so stepping the parameters in slices changes nothing (tested bit for bit against the synchronous step). The
    gradients are taken out of the parameters when the step is handed over (param.grad = None on the main thread),
    given back one group at a time by the worker, and dropped after that group's step: the main thread never
    touches a .grad while a step is pending, and backward (which writes new ones) starts only after the forward
    has waited for every group. wait() joins the step, re-raising the worker's exception; the Engine calls it
    before anything else that reads the parameters or the optimizer (checkpoints, export, the end of fit) and
    before the first backward (a no-op safety net: every group's forward has waited already).
    """

    overlapped = True
    grad_scale_device = torch.device("cpu")  # one host tensor serves both devices: fused AdamW copies it per device

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, blocks: list[nn.Module],
                 prefetch: int = 0, device: torch.device | None = None):
        import threading
        from concurrent.futures import ThreadPoolExecutor

        self.optimizer, self.device = optimizer, device
        modules, self.groups = forward_order_groups(model, optimizer)
        self.on_host = [_group_on_host(m) is not False for m in modules]  # False: kept on the device
        self.events = [threading.Event() for _ in modules]
        for e in self.events:
            e.set()
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="shardfit-cpu-step")
        self.future = None
        add_wait_hooks(modules, blocks, prefetch, self._wait_groups)

    def _wait_groups(self, upto: int) -> None:
        for e in self.events[:upto]:
            e.wait()
        if self.future is not None and self.future.done():
            self.wait()  # re-raises a failure of the worker on the main thread

    def launch(self) -> None:
        """Hand the step over: step the groups kept on the device here, take the host groups' gradients out of the
        parameters, start the worker on them, return at once."""
        grads = [[p.grad if host else None for p in params] for params, host in zip(self.groups, self.on_host)]
        for params, host in zip(self.groups, self.on_host):
            for p in params:
                if host:
                    p.grad = None
        kept = [p for params, host in zip(self.groups, self.on_host) if not host for p in params]
        if any(p.grad is not None for p in kept):
            self.optimizer.step()  # only the kept parameters have a gradient now
            for p in kept:
                p.grad = None
        for e, host in zip(self.events, self.on_host):
            if host:  # a kept group's forward has nothing to wait for
                e.clear()
        self.future = self.pool.submit(self._run, grads)

    def _run(self, grads: list[list[torch.Tensor | None]]) -> None:
        if self.device is not None and self.device.type == "cuda":
            # The current device is per thread and a new thread's is GPU 0: optimizer.step() asks whether the
            # current stream is capturing a CUDA graph, which on rank r != 0 would create a context on GPU 0.
            torch.cuda.set_device(self.device)
        try:
            for i, (params, gs) in enumerate(zip(self.groups, grads)):
                step_group(self.optimizer, params, gs)
                self.events[i].set()
        finally:
            for e in self.events:  # a failure must not leave the main thread waiting on a hook forever
                e.set()

    def wait(self) -> None:
        if self.future is not None:
            future, self.future = self.future, None
            future.result()

    def zero(self, applied: bool) -> None:
        if not applied:  # host gradients are always freed (see parallel/step_runner.py)
            zero_grads(self.optimizer, keep=False)
