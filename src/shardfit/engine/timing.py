"""Where a step's time goes (forward, backward, optimizer, exposed communication), without adding host syncs.

On CUDA every boundary is a timing event recorded on the compute stream: recording costs no sync, and the events
are read only after the step's one existing sync (the stats all-gather copied to the host), when every event
recorded before it has completed. The optimizer's events of step n are read at step n + 1's sync, so the optimizer
figure lags one step. On the CPU the work is synchronous and host clocks say the same thing.

Exposed communication is the time the compute stream spends inside FSDP's unshard wait: a forward pre-hook placed
before FSDP's own (prepend) and one after it bracket FSDP's wait for the all-gather plus its copy-out, and two
gradient hooks on each block's output bracket the same wait in backward. An all-gather that finished under earlier
compute shows up as (near) zero; one that did not is time the GPU sat idle for the network.
"""

from __future__ import annotations

import time
from collections import defaultdict

import torch
from torch import nn

PHASES = ("forward", "backward", "optimizer", "comm_wait")


class _Clock:
    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"

    def stamp(self):
        if not self.cuda:
            return time.perf_counter()
        ev = torch.cuda.Event(enable_timing=True)
        ev.record()
        return ev

    def seconds(self, a, b) -> float:
        return a.elapsed_time(b) / 1000.0 if self.cuda else b - a


class StepTimer:
    def __init__(self, device: torch.device, enabled: bool = True):
        self.enabled = enabled
        self.clock = _Clock(device)
        self._open: dict[str, object] = {}
        self._spans: list[tuple[str, object, object]] = []  # recorded, not yet read

    def start(self, phase: str) -> None:
        if self.enabled:
            self._open[phase] = self.clock.stamp()

    def stop(self, phase: str) -> None:
        if self.enabled:
            self._spans.append((phase, self._open.pop(phase), self.clock.stamp()))

    def collect(self) -> dict[str, float]:
        """Seconds per phase of every span recorded so far. Call only after a host sync that follows them all."""
        out: dict[str, float] = defaultdict(float)
        for phase, a, b in self._spans:
            out[phase] += self.clock.seconds(a, b)
        self._spans.clear()
        return dict(out)

    def watch_fsdp_waits(self, modules: list[nn.Module]) -> None:
        """Bracket FSDP's unshard wait of each module, in forward and in backward (see the module docstring)."""
        if not self.enabled:
            return
        for m in modules:
            m.register_forward_pre_hook(lambda *_: self.start("comm_wait"), prepend=True)  # before FSDP's
            m.register_forward_pre_hook(lambda *_: self.stop("comm_wait"))  # after FSDP's wait and copy-out
            m.register_forward_hook(lambda _m, _i, out: self._on_grad(out, self._bwd_start), prepend=True)
            m.register_forward_hook(lambda _m, _i, out: self._on_grad(out, self._bwd_stop))

    @staticmethod
    def _on_grad(output, fn) -> None:
        # FSDP registers its pre-backward hook on the same output tensors in its post-forward hook; tensor hooks run
        # in registration order, so ours registered before and after FSDP's bracket it.
        for t in (output if isinstance(output, (tuple, list)) else (output,)):
            if isinstance(t, torch.Tensor) and t.requires_grad:
                t.register_hook(fn)
                return

    def _bwd_start(self, grad):
        self.start("comm_wait")

    def _bwd_stop(self, grad):
        if "comm_wait" in self._open:
            self.stop("comm_wait")
