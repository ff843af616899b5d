"""Record CUDA memory snapshots from inside `shardfit train`.

`--memory.snapshot_steps=3,4` records allocator history from the start of step 3 to the end of step 4 on every rank
and dumps `<run_dir>/snapshots/step000003_rank<r>.pickle` after each listed step (written under a temporary name,
then renamed). On a CUDA OOM the rank that failed dumps `oom_step<N>_rank<r>.pickle` whether or not history was on:
the segment layout alone already shows what filled the GPU.

Each file is what `torch.cuda.memory._dump_snapshot` writes plus one key PyTorch does not record:
{"shardfit": {"device_total": bytes, "memory_fraction": the per-process cap's fraction}}, so the doctor can tell
whether a cap refused an OOM's request (see doctor/cap.py).
"""

from __future__ import annotations

import os
import pickle
from pathlib import Path

import torch

from shardfit.errors import ShardfitError


def parse_steps(spec: str) -> set[int]:
    steps = set()
    for part in filter(None, (p.strip() for p in spec.split(","))):
        try:
            lo, _, hi = part.partition("-")
            steps.update(range(int(lo), int(hi or lo) + 1))
        except ValueError:
            raise ShardfitError(f"cannot read step list '{spec}'", where="memory.snapshot_steps",
                                fix="give steps like 3,4 or 10-12") from None
    return steps


def device_facts() -> dict:
    """The current device's total memory and per-process memory fraction (1.0: no cap)."""
    facts = {"device_total": torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory}
    if hasattr(torch.cuda, "get_per_process_memory_fraction"):  # absent from older PyTorch
        facts["memory_fraction"] = float(torch.cuda.get_per_process_memory_fraction())
    return facts


class SnapshotRecorder:
    def __init__(self, spec: str, out_dir: Path, rank: int, device: torch.device, max_entries: int):
        self.steps = parse_steps(spec)
        self.out_dir, self.rank, self.max_entries = out_dir, rank, max_entries
        self.enabled = device.type == "cuda"
        self.recording = False
        self.files: dict[int, Path] = {}

    def _dump(self, name: str) -> Path:
        self.out_dir.mkdir(parents=True, exist_ok=True)
        path = self.out_dir / name
        tmp = path.with_suffix(".tmp")
        snap = torch.cuda.memory._snapshot()  # what _dump_snapshot pickles, plus the cap it leaves out
        snap["shardfit"] = device_facts()
        with open(tmp, "wb") as f:
            pickle.dump(snap, f)
        os.replace(tmp, path)
        return path

    def before_step(self, step: int) -> None:
        """step: 1-based number of the step about to run."""
        if self.enabled and step in self.steps and not self.recording:
            torch.cuda.memory._record_memory_history(enabled="all", stacks="python", max_entries=self.max_entries)
            self.recording = True

    def after_step(self, step: int) -> None:
        if not (self.enabled and step in self.steps):
            return
        self.files[step] = self._dump(f"step{step:06d}_rank{self.rank}.pickle")
        if step == max(self.steps):
            torch.cuda.memory._record_memory_history(enabled=None)
            self.recording = False

    def dump_oom(self, step: int) -> Path | None:
        if not self.enabled:
            return None
        try:
            return self._dump(f"oom_step{step:06d}_rank{self.rank}.pickle")
        except Exception:  # the dump itself can fail when memory is exhausted; the OOM report goes on without it
            return None

    def diagnose_last(self, is_main: bool, say) -> None:
        """After the run: the doctor on the last recorded step of every rank; rank 0 writes the report beside the
        snapshots and says its first line and findings. A barrier first (every rank, the same call): every rank's
        snapshot is on disk."""
        if not self.files:
            return
        import torch.distributed as dist

        from shardfit.doctor import examine
        from shardfit.doctor.report import to_text

        dist.barrier()
        if not is_main:
            return
        last = max(self.files)
        files = [str(p) for p in sorted(self.files[last].parent.glob(f"step{last:06d}_rank*.pickle"))]
        results, findings = examine(files)
        report = to_text(results, findings)
        out = self.out_dir / f"doctor_step{last:06d}.txt"
        out.write_text(report)
        say(report.splitlines()[0] + f" (full report: {out})")
        for f in findings:
            say(f"  {f.severity}: {f.title}")
