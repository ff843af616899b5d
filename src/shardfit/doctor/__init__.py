"""The doctor (`shardfit doctor`): CUDA memory snapshots read, replayed and explained; the in-training memory monitor,
snapshot recording and the profile-trace analyser of `shardfit profile`. Imports nothing above config: it measures, it
builds no model."""

from shardfit.doctor.examine import examine
from shardfit.doctor.monitor import MemoryMonitor
from shardfit.doctor.snapshot import load_snapshot
from shardfit.safe_pickle import SafeUnpickler

__all__ = ["MemoryMonitor", "SafeUnpickler", "examine", "load_snapshot"]
