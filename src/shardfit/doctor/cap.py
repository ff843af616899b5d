"""The per-process memory cap (`torch.cuda.set_per_process_memory_fraction`) and where the doctor learns it.
Why it matters and what PyTorch does not record: docs/doctor.md, "The per-process memory cap".

With a cap, c10's caching allocator fails an allocation when reserved + size > fraction x device total, however much
the driver still has free; so whether another setting would have let an OOM's request through depends on the cap.
PyTorch's snapshots record neither the fraction nor the device total. The fraction, first found wins:
  1. the caller (`shardfit doctor --memory-fraction F`): source "given";
  2. shardfit's own snapshots ({"shardfit": {"memory_fraction", "device_total"}}, doctor/record.py): "recorded";
  3. `per_process_memory_fraction:F` in the recorded PYTORCH_CUDA_ALLOC_CONF: "allocator_settings".
The device total: the caller (`--gpu-memory GIB`), shardfit's record, or else, at an OOM, reserved plus the driver's
free memory (a lower bound). A fraction of 1 is a known absence of a cap: an OOM the device had room for is then
"unexplained", not blamed on an unrecorded cap.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from shardfit.doctor.snapshot import Snapshot
from shardfit.errors import ShardfitError

_CONF_KEY = re.compile(r"(?:^|,)\s*per_process_memory_fraction\s*:\s*([^,\]\s]+)")


@dataclass(frozen=True)
class CapSettings:
    """What the doctor's caller knows about the cap: both optional."""

    memory_fraction: float | None = None
    device_memory: int | None = None  # bytes

    def __post_init__(self):
        if self.memory_fraction is not None and not 0 < self.memory_fraction <= 1:
            raise ShardfitError(f"memory fraction {self.memory_fraction} is outside (0, 1]", where="--memory-fraction",
                                fix="pass the value given to torch.cuda.set_per_process_memory_fraction, e.g. 0.5")
        if self.device_memory is not None and self.device_memory <= 0:
            raise ShardfitError(f"device memory {self.device_memory} is not positive", where="--gpu-memory",
                                fix="pass the GPU's total memory, e.g. 139 (GiB) for an H200")


def fraction_of(snap: Snapshot, given: CapSettings) -> tuple[float | None, str | None]:
    """(fraction, source) or (None, None) when nothing is known; 1.0 when it is known that no cap was set."""
    if given.memory_fraction is not None:
        return given.memory_fraction, "given"
    recorded = snap.shardfit.get("memory_fraction")
    if isinstance(recorded, (int, float)) and not isinstance(recorded, bool) and 0 < recorded <= 1:
        return float(recorded), "recorded"
    m = _CONF_KEY.search(str(snap.allocator_settings.get("PYTORCH_CUDA_ALLOC_CONF") or ""))
    if m:
        try:
            value = float(m.group(1))
        except ValueError:
            return None, None
        if 0 < value <= 1:
            return value, "allocator_settings"
    return None, None


def device_total(snap: Snapshot, given: CapSettings, reserved: int, device_free: int) -> tuple[int, str]:
    """(bytes, source): "given", "recorded", or "estimate" (reserved + driver-free at the OOM, a lower bound)."""
    if given.device_memory is not None:
        return given.device_memory, "given"
    recorded = snap.shardfit.get("device_total")
    if isinstance(recorded, int) and recorded > 0:
        return recorded, "recorded"
    return reserved + device_free, "estimate"
