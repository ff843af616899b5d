"""Load a Hugging Face safetensors checkpoint into a (sharded) model.

Each rank reads only the rows of each tensor that its FSDP shard holds (its own experts for MoE layers) with
os.preadv into small reused staging buffers (pinned on CUDA): no rank reads or holds a full copy of the model, the
bytes read over all ranks add up to one copy, and there are no collectives at all (nothing to deadlock, nothing to
broadcast). Byte-adjacent tensors of a file are read together (one read for an expert's three matrices), and the
reads are split into byte-balanced lists, one per reading thread (the node's cores shared among its ranks), each
copying to the GPU on its own stream (reads and copies release the GIL and overlap). What is left under the GIL is
one small copy call per tensor: a 30B MoE checkpoint has ~9,400 tensors per rank on 2 ranks.

Errors name the file and the tensor: a missing shard file, a missing or unexpected tensor, a shape mismatch, a
truncated or corrupt file.
"""

from __future__ import annotations

import heapq
import json
import os
import re
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import nullcontext
from pathlib import Path
from typing import NamedTuple

import torch
from torch import nn

from shardfit.errors import ShardfitError
from shardfit.parallel.dtensor import local_view
from shardfit.weights.safetensors import SafetensorsView

_IGNORED = ("rotary_emb.inv_freq",)  # buffers some old exports stored; rebuilt by init_buffers
# Benchmark knobs (benchmarks/device_run.sh load-variants): SHARDFIT_LOAD_THREADS and SHARDFIT_PINNED_MIB override
# the defaults below, so that one device call can compare settings without code changes.
# Two staging buffers per thread, pinned on CUDA; a buffer is also the largest single read. 16 MiB was the fastest
# of the sizes load-variants compares (benchmarks/README.md): pinning costs time per MiB, and smaller reads spread
# more evenly over the threads.
_PINNED_BYTES = int(os.environ.get("SHARDFIT_PINNED_MIB", 16)) << 20


def reader_threads() -> int:
    """Reading threads per rank: the node's cores shared by its ranks (the page-cache copy is per-core work)."""
    if os.environ.get("SHARDFIT_LOAD_THREADS"):
        return max(1, int(os.environ["SHARDFIT_LOAD_THREADS"]))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 4)
    return max(1, min(16, cores // max(1, local_world) if local_world > 1 else cores))


def weight_map(path: Path) -> dict[str, Path]:
    """Tensor name -> file, from model.safetensors.index.json or a single model.safetensors."""
    index = path / "model.safetensors.index.json"
    if index.is_file():
        try:
            names = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as e:
            raise ShardfitError(f"unreadable index ({e})", where=str(index), fix="re-export the checkpoint") from None
        shard_paths = {v: path / v for v in set(names.values())}  # one Path per file, not per tensor
        return {k: shard_paths[v] for k, v in names.items()}
    single = path / "model.safetensors"
    if not single.is_file():
        raise ShardfitError("no model.safetensors or model.safetensors.index.json", where=str(path),
                            fix="point model.path at a directory saved with safetensors")
    return file_map(single)


def file_map(file: Path) -> dict[str, Path]:
    """Tensor name -> file, for the tensors of one safetensors file."""
    view = _open(file)
    names = list(view.header)
    view.close()
    return dict.fromkeys(names, file)


def _open(file: Path) -> SafetensorsView:
    if not file.is_file():
        raise ShardfitError("checkpoint shard is missing", where=str(file), fix="copy the complete checkpoint")
    try:
        return SafetensorsView(file)
    except (ValueError, UnicodeDecodeError, OSError) as e:  # bad header length, JSON, or mapping
        raise ShardfitError(f"corrupt or truncated safetensors file ({e})", where=str(file),
                            fix="re-download or re-export this shard") from None


# A 3-D parameter stacked over experts ("...experts.gate_proj", [E, ...]) is stored per expert in Hugging Face
# checkpoints as "...experts.{e}.gate_proj.weight".
STACKED = re.compile(r"^(.*\.experts)\.(gate_proj|up_proj|down_proj)$")


def expert_key(name: str, e: int) -> str:
    m = STACKED.match(name)
    return f"{m.group(1)}.{e}.{m.group(2)}.weight"


class Rows(NamedTuple):
    """A destination that is part of a tensor: rows [row0, row0 + len(local)) of a tensor of `shape`, read into
    `local` (a caller that transforms what it reads: adapters/qlora.py quantises its staged rows)."""
    local: torch.Tensor
    shape: tuple[int, ...]
    row0: int


class LoadResult(NamedTuple):
    bytes: int  # read by this rank
    tensors: int  # checkpoint tensors (or expert slices) this rank read
    reads: int  # preadv calls: adjacent tensors of a file are read together
    threads: int
    plan_s: float  # matching parameters to checkpoint tensors and checking shapes
    read_s: float  # reading and copying (to the GPU: finished)

    @staticmethod
    def total(results: list[LoadResult], extra_s: float = 0.0) -> LoadResult:
        """Several loads (batches of staged rows) as one; extra_s: time spent on the staged rows, counted as
        reading."""
        return LoadResult(sum(r.bytes for r in results), sum(r.tensors for r in results),
                          sum(r.reads for r in results), results[0].threads, sum(r.plan_s for r in results),
                          sum(r.read_s for r in results) + extra_s)


@torch.no_grad()
def load_hf_checkpoint(model: nn.Module, path: str | Path, params: dict[str, nn.Parameter] | None = None,
                       files: dict[str, Path] | None = None) -> LoadResult:
    """Fill every parameter of `model` (plain or FSDP-sharded) from the checkpoint. params: {checkpoint key:
    parameter or Rows} to fill instead (a LoRA model's base without its adapters; its adapters under PEFT's keys,
    peft.py; the staged rows of NF4 weights, adapters/qlora.py); files: {checkpoint key: file} instead of
    the directory's weight map."""
    t0 = time.perf_counter()
    path = Path(path)
    files = weight_map(path) if files is None else files
    params = dict(model.named_parameters()) if params is None else params  # tied weights appear once
    tied_extra = {"lm_head.weight"} if getattr(model, "cfg", None) is not None and model.cfg.tie_embeddings else set()
    # plan: what this rank holds, one _Item per checkpoint tensor. The local shard of each parameter is looked up
    # once here (a DTensor query costs ~50 us; a 30B MoE checkpoint has 18,867 tensors).
    plan: list[_Item] = []
    expected: set[str] = set()
    for name, p in params.items():
        local, shape, row0 = p if isinstance(p, Rows) else local_view(p)
        if name in files:
            expected.add(name)
            rows = (row0, row0 + local.shape[0]) if local.dim() else None
            plan.append(_Item(files[name], name, local, tuple(shape), rows))
            continue
        if not STACKED.match(name) or expert_key(name, 0) not in files:
            raise ShardfitError(f"tensor '{name}' is not in the checkpoint", where=str(path),
                                fix="check that config.json matches the weights")
        keys = [expert_key(name, e) for e in range(p.shape[0])]
        absent = [k for k in keys if k not in files]
        if absent:
            raise ShardfitError(f"tensor '{absent[0]}' is not in the checkpoint ({len(absent)} experts missing)",
                                where=str(path), fix="check that config.json matches the weights")
        expected.update(keys)
        for e in range(row0, row0 + (local.shape[0] if local.numel() else 0)):  # only this rank's experts
            plan.append(_Item(files[keys[e]], keys[e], local[e - row0], tuple(shape[1:]), None))
    unexpected = [n for n in files if n not in expected and n not in tied_extra and not n.endswith(_IGNORED)]
    if unexpected:
        raise ShardfitError(f"checkpoint tensor '{unexpected[0]}' has no place in the model "
                            f"({len(unexpected)} unexpected)", where=str(files[unexpected[0]]),
                            fix="the architecture in config.json does not match these weights")
    views = {f: _open(f) for f in sorted({it.file for it in plan})}  # headers read once, shared by the threads
    try:
        runs = _runs(plan, views)
        t1 = time.perf_counter()
        threads = reader_threads()
        with ThreadPoolExecutor(threads) as pool:  # a failure in any thread is raised here
            read = sum(pool.map(lambda work: _read_runs(work, views), _balance(runs, threads)))
    finally:
        for view in views.values():
            view.close()
    model.init_buffers()
    return LoadResult(read, len(plan), len(runs), threads, t1 - t0, time.perf_counter() - t1)


def load_report(path: str, seconds: float, loaded: LoadResult, device: torch.device) -> str:
    """One all-gather (every rank, right after loading): load time, device memory and peak host RSS per rank;
    rank 0's split of its time."""
    import resource

    from shardfit.parallel import all_gather_rows

    dev_gib = (torch.cuda.memory_allocated(device) if device.type == "cuda" else 0) / 2**30
    rss_gib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux
    rows = all_gather_rows(torch.tensor([seconds, dev_gib, rss_gib], dtype=torch.float64, device=device)).cpu().tolist()
    dev = [r[1] for r in rows]
    spread = (max(dev) - min(dev)) / max(dev) * 100 if max(dev) > 0 else 0.0
    return (f"loaded {path} in {max(r[0] for r in rows):.2f} s (slowest rank; rank 0: planning {loaded.plan_s:.2f} "
            f"s, reading {loaded.read_s:.2f} s, {loaded.tensors:,} tensors in {loaded.reads:,} reads over "
            f"{loaded.threads} threads); device memory after load per "
            f"rank: {' / '.join(f'{d:.2f}' for d in dev)} GiB ({spread:.1f}% apart); peak host RSS per rank: "
            f"{' / '.join(f'{r[2]:.1f}' for r in rows)} GiB")


class _Item(NamedTuple):
    file: Path
    key: str  # the checkpoint's tensor name
    dest: torch.Tensor  # this rank's part of the parameter (one expert's slice for stacked experts)
    shape: tuple  # the shape the checkpoint must hold
    rows: tuple[int, int] | None  # the rows of it this rank reads; None: all


class _Run(NamedTuple):
    """Adjacent byte ranges of one file, read with one preadv: in a Hugging Face MoE checkpoint an expert's
    down/gate/up matrices (and often the next experts of the same rank) follow each other."""
    file: Path
    offset: int
    nbytes: int
    parts: list[tuple[int, int, torch.dtype, torch.Tensor]]  # (offset in the run, bytes, dtype, destination)


def _runs(plan: list[_Item], views: dict[Path, SafetensorsView]) -> list[_Run]:
    """Check every shape (in parameter order, before any read: the first mismatch is the one reported), then merge
    byte-adjacent items of one file and one dtype into runs of at most one staging buffer."""
    spans = []
    for it in plan:
        view = views[it.file]
        got = view.shape(it.key)
        if got != it.shape:
            raise ShardfitError(f"tensor '{it.key}' has shape {list(got)}, the model expects {list(it.shape)}",
                                where=str(it.file), fix="check that config.json matches the weights")
        if it.dest.numel():
            try:
                offset, nbytes, dtype, _ = view.byte_range(it.key, *it.rows) if it.rows else view.byte_range(it.key)
            except ValueError as e:
                raise _corrupt(it.file, f"tensor '{it.key}'", e) from None
            spans.append((str(it.file), offset, nbytes, dtype, it))
    runs: list[_Run] = []
    for _, offset, nbytes, dtype, it in sorted(spans, key=lambda s: s[:2]):
        last = runs[-1] if runs else None
        if (last is not None and last.file == it.file and last.offset + last.nbytes == offset
                and last.parts[-1][2] == dtype and last.nbytes + nbytes <= _PINNED_BYTES):
            last.parts.append((last.nbytes, nbytes, dtype, it.dest))
            runs[-1] = last._replace(nbytes=last.nbytes + nbytes)
        else:
            runs.append(_Run(it.file, offset, nbytes, [(0, nbytes, dtype, it.dest)]))
    return runs


def _corrupt(file: Path, what: str, err: Exception) -> ShardfitError:
    return ShardfitError(f"corrupt or truncated safetensors file ({what}: {err})", where=str(file),
                         fix="re-download or re-export this shard")


def _balance(runs: list[_Run], n: int) -> list[list[_Run]]:
    """Split the work into n lists of about equal bytes (largest first onto the lightest list), each in file order:
    a few large files must not leave most threads idle."""
    bins: list[list[_Run]] = [[] for _ in range(max(1, min(n, len(runs))))]
    heap = [(0, i) for i in range(len(bins))]  # (bytes so far, bin)
    for run in sorted(runs, key=lambda r: r.nbytes, reverse=True):
        load, i = heapq.heappop(heap)
        bins[i].append(run)
        heapq.heappush(heap, (load + run.nbytes, i))
    return [sorted(b, key=lambda r: (str(r.file), r.offset)) for b in bins if b]


class _Stager:
    """Two reused staging buffers per thread: os.preadv fills one (the kernel copies from the page cache, no
    per-page faults, GIL released) while the copies out of the other run. On CUDA the buffers are pinned, the copies
    to the GPU are asynchronous on this thread's stream, and an event per buffer guards its reuse."""

    def __init__(self, device: torch.device):
        cuda = device.type == "cuda"
        self.bufs = [torch.empty(_PINNED_BYTES, dtype=torch.uint8, pin_memory=cuda) for _ in range(2)]
        self.events = [torch.cuda.Event() for _ in range(2)] if cuda else None
        self.used = [False, False]
        self.turn = 0

    def _fill(self, fd: int, offset: int, nbytes: int) -> torch.Tensor:
        """The next buffer, once the copies out of it have finished, with `nbytes` of the file read into it."""
        if self.events is not None and self.used[self.turn]:
            self.events[self.turn].synchronize()
        buf = self.bufs[self.turn][:nbytes]
        if os.preadv(fd, [memoryview(buf.numpy())], offset) != nbytes:
            raise ValueError(f"short read at byte {offset} (truncated?)")
        return buf

    def _done(self) -> None:
        if self.events is not None:
            self.events[self.turn].record()
        self.used[self.turn] = True
        self.turn ^= 1

    def read(self, fd: int, run: _Run) -> None:
        if run.nbytes <= self.bufs[0].numel():  # one read, then one copy per tensor in it
            buf = self._fill(fd, run.offset, run.nbytes)
            for at, nbytes, dtype, dest in run.parts:
                dest.copy_(buf[at:at + nbytes].view(dtype).view(dest.shape), non_blocking=True)
            self._done()
            return
        (_, _, dtype, dest), = run.parts  # a tensor larger than a buffer is alone in its run: read it in chunks
        # local shards are contiguous; a block of columns (peft_per_expert.py's zero-padded B) is read
        # into a temporary of its own and copied once
        whole = dest if dest.is_contiguous() else torch.empty(dest.shape, dtype=dest.dtype, device=dest.device)
        flat, per = whole.view(-1), self.bufs[0].numel() // dtype.itemsize
        for e0 in range(0, flat.numel(), per):
            n = min(per, flat.numel() - e0)
            buf = self._fill(fd, run.offset + e0 * dtype.itemsize, n * dtype.itemsize)
            flat[e0:e0 + n].copy_(buf.view(dtype), non_blocking=True)
            self._done()
        if whole is not dest:
            dest.copy_(whole)


@torch.no_grad()  # grad mode is per thread: the pool's threads need their own
def _read_runs(runs: list[_Run], views: dict[Path, SafetensorsView]) -> int:
    device = runs[0].parts[0][3].device
    stream = torch.cuda.Stream(device) if device.type == "cuda" else None
    stager = _Stager(device)
    with torch.cuda.stream(stream) if stream is not None else nullcontext():
        for run in runs:
            try:
                stager.read(views[run.file].fileno(), run)
            except ValueError as e:
                raise _corrupt(run.file, f"bytes {run.offset}-{run.offset + run.nbytes}", e) from None
    if stream is not None:
        stream.synchronize()  # the staging buffers must outlive the copies out of them
    return sum(run.nbytes for run in runs)
