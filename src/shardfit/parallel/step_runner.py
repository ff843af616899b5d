"""How an optimizer step runs, chosen once from the config: the step itself never asks about offload.

Every runner has the same four members:
  launch()             step the optimizer on the gradients in .grad (learning rate and gradient scale already set);
                       an overlapped runner returns at once and owns the gradients from then on
  wait()               the launched step is done: parameters and optimizer state may be read
  zero(applied)        after the step's decision, drop or zero the gradients the runner does not own (all of them
                       when the step was skipped)
  grad_scale_device    where the fused AdamW's grad_scale tensor lives (host tensors under offload)
The three runners: `PlainStep` (in place), `StreamOverlappedStep` (parallel/step_overlap.py: the GPU step on a side
stream, each group under the next forward) and `OverlappedStep` (parallel/offload.py: the CPU step of offload=all
on a worker thread, each group under the next forward).
"""

from __future__ import annotations

from collections.abc import Collection

import torch
from torch import nn

from shardfit.config.schema import Config
from shardfit.parallel.expert import fresh_grad_params
from shardfit.parallel.offload import OverlappedStep
from shardfit.parallel.step_overlap import StreamOverlappedStep, zero_grads


class PlainStep:
    """optimizer.step() where it is called."""

    overlapped = False

    def __init__(self, optimizer: torch.optim.Optimizer, keep_grads: bool, grad_scale_device: torch.device,
                 free_grad: Collection[nn.Parameter] = ()):
        self.optimizer, self.keep_grads, self.grad_scale_device = optimizer, keep_grads, grad_scale_device
        self.free_grad = list(free_grad)  # freed after every step whatever keep_grads says (zero_grads)

    def launch(self) -> None:
        self.optimizer.step()

    def wait(self) -> None:
        pass

    def zero(self, applied: bool) -> None:
        zero_grads(self.optimizer, keep=self.keep_grads, free_grad=self.free_grad)


def build_step_runner(cfg: Config, model: nn.Module, optimizer: torch.optim.Optimizer, device: torch.device):
    """The runner the config asks for. keep_grads (memory.keep_grads) zeroes gradients instead of freeing them;
    under offload they are host tensors and always freed (a kept one makes FSDP copy each reduce-scatter output to
    the host synchronously inside backward); the gradients the experts outside FSDP write fresh are always freed
    (expert.fresh_grad_params)."""
    p = cfg.parallel
    blocks = list(model.model.layers)
    if p.offload == "all":
        if p.offload_overlap:
            return OverlappedStep(model, optimizer, blocks, p.prefetch, device)
        return PlainStep(optimizer, keep_grads=False, grad_scale_device=torch.device("cpu"))
    fresh = fresh_grad_params(model)
    if p.overlap_optimizer:
        return StreamOverlappedStep(model, optimizer, blocks, p.prefetch, cfg.memory.keep_grads, device, fresh)
    return PlainStep(optimizer, cfg.memory.keep_grads, device, fresh)
