"""The optimizer step, group by group, under the next forward (parallel.overlap_optimizer, CUDA), and the helpers it
shares with the offloaded CPU step (parallel/offload.py). Design: docs/offload.md, "The step under the next forward".

For a host-bound forward (MoE under expert parallelism) the fused AdamW step is enqueued on a side stream, one FSDP
group at a time in forward order (root, embedding, blocks, head), and each group's forward waits on the GPU (no host
sync) only for its own group: launch() makes the side stream wait for the compute stream, then per group steps,
zeroes (keep_grads) and records event[i]; a pre-forward hook registered before FSDP's own makes the compute stream
wait for events[0..upto) (upto covers explicit prefetch); wait() waits for all of them (before backward,
checkpoints, export, eval, the end of fit). Expert weights kept out of FSDP belong to their block's group.
Memory: nothing is freed by another stream than the one that allocated it; freed gradients (no keep_grads, and
free_grad parameters) are dropped per group once the compute stream has waited for that group's event. The first
step runs on the compute stream so that AdamW's moments are allocated there. The results are one
optimizer.step()'s (AdamW is elementwise per tensor). No collective here.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Collection

import torch
from torch import nn

from shardfit.parallel.dtensor import local_tensor


def param_group(module: nn.Module):
    """The FSDP2 parameter group of a module passed to fully_shard (None for other modules)."""
    state = module._get_fsdp_state() if hasattr(module, "_get_fsdp_state") else None
    return getattr(state, "_fsdp_param_group", None)


def forward_order_groups(model: nn.Module, optimizer: torch.optim.Optimizer
                         ) -> tuple[list[nn.Module], list[list[nn.Parameter]]]:
    """The modules passed to fully_shard in forward order (the root first: its pre-forward runs first; then as
    modules() lists them: embedding, blocks 0..L-1, head) and the parameters each one's step covers: its FSDP
    group's shards, and optimized parameters outside every group (experts kept out of FSDP) in the innermost listed
    module holding them. Raises if an optimized parameter would be stepped twice or never."""
    modules = [model] + [m for m in model.modules() if m is not model and hasattr(m, "_get_fsdp_state")]
    stepped = {id(p): p for group in optimizer.param_groups for p in group["params"]}
    owned: set[int] = set()
    groups: list[list[nn.Parameter]] = []
    for m in modules:
        group = param_group(m)
        params = [p.sharded_param for p in group.fsdp_params] if group is not None else []
        # frozen parameters (a LoRA run's base) sit in FSDP's groups but not in the optimizer: nothing to step
        params = [p for p in params if id(p) not in owned and id(p) in stepped]
        owned.update(id(p) for p in params)
        groups.append(params)
    for i in reversed(range(len(modules))):  # innermost first: a block before the root that contains it
        for p in modules[i].parameters():
            if id(p) in stepped and id(p) not in owned:
                groups[i].append(p)
                owned.add(id(p))
    if owned != set(stepped):
        raise RuntimeError("the overlapped step needs every optimized parameter in one group")
    return modules, groups


def step_group(optimizer: torch.optim.Optimizer, params: list[nn.Parameter], grads: list[torch.Tensor | None]
               ) -> bool:
    """One group's share of optimizer.step(): the group's gradients put back, the step (it steps exactly the
    parameters that have a gradient), the gradients taken out again (out of the next groups' steps). False when the
    group has no gradient."""
    if all(g is None for g in grads):
        return False
    for p, g in zip(params, grads):
        p.grad = g
    optimizer.step()
    for p in params:
        p.grad = None
    return True


def zero_grads(optimizer: torch.optim.Optimizer, keep: bool, free_grad: Collection[nn.Parameter] = ()) -> None:
    """optimizer.zero_grad: gradients zeroed in place when `keep` (memory.keep_grads), else freed. The parameters in
    `free_grad` (experts outside FSDP: expert.fresh_grad_params) are freed either way: they are written fresh in one
    pass on the next backward instead of zeroed here and read back there (one pass over those gradients a step
    fewer), and their allocations repeat at the same sizes every step on the compute stream, so the allocator
    hands the same blocks back (what keep_grads guards against is FSDP's reduce-scatter stream caching freed
    gradients)."""
    if keep:
        for p in free_grad:
            p.grad = None
    optimizer.zero_grad(set_to_none=not keep)


def add_wait_hooks(modules: list[nn.Module], blocks: list[nn.Module], prefetch: int,
                   wait: Callable[[int], None]) -> None:
    """Group i's forward pre-hook calls wait(upto) before FSDP's own pre-forward: upto = i + 1, plus the `prefetch`
    groups after a block (parallelize's explicit prefetch unshards them from the block's pre-forward)."""
    block_ids = {id(b) for b in blocks}
    for i, m in enumerate(modules):
        upto = min(len(modules), i + 1 + (prefetch if id(m) in block_ids else 0))
        m.register_forward_pre_hook(lambda *_, _upto=upto: wait(_upto), prepend=True)


class StreamOverlappedStep:
    """The GPU optimizer step on a side stream, group by group, each group's forward waiting for its own (module
    docstring). Same interface as the offload's OverlappedStep: launch() after the gradient scale and learning rate
    are set, wait() before anything that reads the parameters or the optimizer."""

    overlapped = True

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, blocks: list[nn.Module], prefetch: int,
                 keep_grads: bool, device: torch.device, free_grad: Collection[nn.Parameter] = ()):
        self.optimizer, self.keep_grads, self.grad_scale_device = optimizer, keep_grads, device
        self.free_grad = list(free_grad)  # freed after every step whatever keep_grads says (zero_grads)
        self._free_ids = {id(p) for p in self.free_grad}
        self.modules, self.groups = forward_order_groups(model, optimizer)
        # Off CUDA there are no streams: the groups are stepped at once, in order (the same results; tested so)
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self.events: list[torch.cuda.Event | None] = [None] * len(self.groups)
        # gradients taken out at launch (not kept), per group, dropped when the compute stream waits for the group
        self.taken: list[list[torch.Tensor]] = [[] for _ in self.groups]
        add_wait_hooks(self.modules, blocks, prefetch, self._wait_groups)

    def _wait_groups(self, upto: int) -> None:
        current = torch.cuda.current_stream() if self.stream is not None else None
        for i in range(upto):
            if self.events[i] is not None:
                current.wait_event(self.events[i])
                self.events[i] = None  # waited once: later forwards (eval, recomputation) need not wait again
            # the compute stream now runs after the step that read them: their blocks are its to reuse
            self.taken[i] = []

    def launch(self) -> None:
        if not all(p in self.optimizer.state for g in self.groups for p in g if p.grad is not None):
            # the first step: AdamW allocates its moments, which must belong to the compute stream's pool
            self.optimizer.step()
            zero_grads(self.optimizer, self.keep_grads, self.free_grad)
            return
        grads = [[p.grad for p in params] for params in self.groups]
        for params in self.groups:
            for p in params:
                p.grad = None
        if self.stream is not None:
            self.stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self.stream) if self.stream is not None else contextlib.nullcontext():
            for i, (params, gs) in enumerate(zip(self.groups, grads)):
                if step_group(self.optimizer, params, gs):
                    kept = [g for p, g in zip(params, gs) if g is not None and self.keeps(p)]
                    if kept:
                        torch._foreach_zero_([local_tensor(g) for g in kept])  # read here, zeroed here
                    self.taken[i] = [g for p, g in zip(params, gs) if g is not None and not self.keeps(p)]
                if self.stream is not None:
                    self.events[i] = self.stream.record_event()
        for params, gs in zip(self.groups, grads):  # the kept ones given back, already zeroed on the side stream
            for p, g in zip(params, gs):
                if self.keeps(p):
                    p.grad = g

    def keeps(self, p: nn.Parameter) -> bool:
        return self.keep_grads and id(p) not in self._free_ids

    def wait(self) -> None:
        self._wait_groups(len(self.events))

    def zero(self, applied: bool) -> None:
        if not applied:  # a launched step took the gradients (and gave back the kept ones zeroed)
            zero_grads(self.optimizer, self.keep_grads, self.free_grad)
