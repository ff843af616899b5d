"""Load a Hugging Face safetensors checkpoint into a (sharded) model.

Each rank reads only the rows of each tensor that its FSDP shard holds (its own experts for MoE layers), as
zero-copy views of the memory-mapped files (CPU) or through pinned staging buffers (CUDA): no rank reads or holds a
full copy of the model, the bytes read over all ranks add up to one copy, and there are no collectives at all
(nothing to deadlock, nothing to broadcast). The tensors are split into byte-balanced lists, one per reading thread
(the node's cores shared among its ranks), each copying to the GPU on its own stream (reads and copies release the
GIL and overlap).

Errors name the file and the tensor: a missing shard file, a missing or unexpected tensor, a shape mismatch, a
truncated or corrupt file.
"""

from __future__ import annotations

import heapq
import json
import os
import re
from concurrent.futures import ThreadPoolExecutor
from contextlib import nullcontext
from pathlib import Path
from typing import NamedTuple

import torch
from torch import nn

from shardfit.errors import ShardfitError
from shardfit.hf.safetensors_view import SafetensorsView
from shardfit.models.init import local_view

_IGNORED = ("rotary_emb.inv_freq",)  # buffers some old exports stored; rebuilt by init_buffers
# Benchmark knobs (benchmarks/device_run.sh load-variants): SHARDFIT_LOAD_THREADS and SHARDFIT_PINNED_MIB override
# the defaults below, so that one device call can compare settings without code changes.
_PINNED_BYTES = int(os.environ.get("SHARDFIT_PINNED_MIB", 32)) << 20  # two pinned staging buffers per thread: small,
# because pinning costs ~0.3 ms per MiB (measured) and small chunks pipeline


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
    view = _open(single)
    names = list(view.header)
    view.close()
    return dict.fromkeys(names, single)


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


@torch.no_grad()
def load_hf_checkpoint(model: nn.Module, path: str | Path) -> int:
    """Fill every parameter of `model` (plain or FSDP-sharded) from the checkpoint; returns bytes read here."""
    path = Path(path)
    files = weight_map(path)
    params = dict(model.named_parameters())  # tied weights appear once
    tied_extra = {"lm_head.weight"} if getattr(model, "cfg", None) is not None and model.cfg.tie_embeddings else set()
    # plan: what this rank holds, one _Item per checkpoint tensor. The local shard of each parameter is looked up
    # once here (a DTensor query costs ~50 us; a 30B MoE checkpoint has 18,867 tensors).
    plan: list[_Item] = []
    expected: set[str] = set()
    for name, p in params.items():
        local, shape, row0 = local_view(p)
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
        for it in plan:  # in parameter order, before any copy: the first mismatch is the one reported
            got = views[it.file].shape(it.key)
            if got != it.shape:
                raise ShardfitError(f"tensor '{it.key}' has shape {list(got)}, the model expects {list(it.shape)}",
                                    where=str(it.file), fix="check that config.json matches the weights")
        with ThreadPoolExecutor(reader_threads()) as pool:  # a failure in any thread is raised here
            read = sum(pool.map(lambda items: _load_items(items, views), _balance(plan, reader_threads())))
    finally:
        for view in views.values():
            view.close()
    model.init_buffers()
    return read


class _Item(NamedTuple):
    file: Path
    key: str  # the checkpoint's tensor name
    dest: torch.Tensor  # this rank's part of the parameter (one expert's slice for stacked experts)
    shape: tuple  # the shape the checkpoint must hold
    rows: tuple[int, int] | None  # the rows of it this rank reads; None: all


def _balance(plan: list[_Item], n: int) -> list[list[_Item]]:
    """Split the work into n lists of about equal bytes (largest first onto the lightest list), each in file order:
    a few large files must not leave most threads idle."""
    bins: list[list[_Item]] = [[] for _ in range(max(1, min(n, len(plan))))]
    heap = [(0, i) for i in range(len(bins))]  # (bytes so far, bin)
    for item in sorted(plan, key=lambda it: it.dest.nbytes, reverse=True):
        load, i = heapq.heappop(heap)
        bins[i].append(item)
        heapq.heappush(heap, (load + item.dest.nbytes, i))
    return [sorted(b, key=lambda it: (str(it.file), it.key)) for b in bins if b]


class _PinnedCopier:
    """Reads byte ranges of a file into two reused pinned buffers (os.preadv: the kernel copies from the page
    cache, no per-page faults) and copies them to the GPU asynchronously; an event per buffer guards its reuse."""

    def __init__(self, size: int = _PINNED_BYTES):
        self.bufs = [torch.empty(size, dtype=torch.uint8, pin_memory=True) for _ in range(2)]
        self.events: list[torch.cuda.Event | None] = [None, None]
        self.turn = 0

    def copy(self, fd: int, offset: int, nbytes: int, dtype: torch.dtype, dest: torch.Tensor) -> None:
        flat = dest.view(-1)  # local shards and expert slices are contiguous
        item = dtype.itemsize
        per = self.bufs[0].numel() // item  # elements per chunk
        for e0 in range(0, flat.numel(), per):
            n = min(per, flat.numel() - e0)
            buf, event = self.bufs[self.turn], self.events[self.turn]
            if event is not None:
                event.synchronize()  # the previous copy out of this buffer has finished
            got = os.preadv(fd, [memoryview(buf[:n * item].numpy())], offset + e0 * item)
            if got != n * item:
                raise ValueError(f"short read at byte {offset + e0 * item} (truncated?)")
            flat[e0:e0 + n].copy_(buf[:n * item].view(dtype), non_blocking=True)
            self.events[self.turn] = torch.cuda.Event()
            self.events[self.turn].record()
            self.turn ^= 1


@torch.no_grad()  # grad mode is per thread: the pool's threads need their own
def _load_items(items: list[_Item], views: dict[Path, SafetensorsView]) -> int:
    stream = copier = None
    if items[0].dest.is_cuda:
        stream = torch.cuda.Stream(items[0].dest.device)
        copier = _PinnedCopier()
    read = 0
    with torch.cuda.stream(stream) if stream is not None else nullcontext():
        for it in items:
            read += _copy_slice(views[it.file], it.file, it.key, it.dest, it.rows, copier)
    if stream is not None:
        stream.synchronize()  # the pinned staging buffers must outlive the copies out of them
    return read


def _copy_slice(view: SafetensorsView, file: Path, key: str, dest: torch.Tensor, rows: tuple[int, int] | None,
                copier: _PinnedCopier | None = None) -> int:
    if dest.numel() == 0:
        return 0
    try:
        if copier is not None:  # CUDA: pinned staging, asynchronous copies
            offset, nbytes, dtype, _ = view.byte_range(key, *rows) if rows else view.byte_range(key)
            copier.copy(view.fileno(), offset, nbytes, dtype, dest)
            return nbytes
        part = view.rows(key, *rows) if rows else view.rows(key)
    except (ValueError, KeyError) as e:
        raise ShardfitError(f"corrupt or truncated safetensors file (tensor '{key}': {e})", where=str(file),
                            fix="re-download or re-export this shard") from None
    dest.copy_(part)  # CPU: from the mmap view, dtype cast included
    return part.numel() * part.element_size()
