"""Export a (sharded) model as a Hugging Face directory that `transformers` loads.

Streaming: parameters are gathered one at a time (`full_tensor()`, a collective every rank issues in the same
order), cast, moved to rank 0's host memory and written in safetensors shards of at most `max_shard_bytes`; no rank
ever holds more than one full parameter on its GPU, and rank 0's host holds at most one shard. Everything is written
into <out>.tmp and renamed to <out> at the end, so a crash never leaves a half-written model under the final name.
Tokenizer files: copied from `source`, or written for the byte tokenizer (tokenizer_files.py), so that
`AutoTokenizer.from_pretrained(out)` works whatever the run trained with.
With parallel.offload=all on CUDA the shards live in pinned host memory but the gather runs over NCCL, which takes
device tensors only: each shard is copied to the GPU just before its gather (`_gatherable`). A LoRA model passes
its own (name, full tensor) stream (`params`: the base with the adapters merged in, peft.py); its adapter
export reuses `publish` and the tokenizer copy.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import TypeVar

import torch
import torch.distributed as dist
from safetensors.torch import save_file
from torch import nn
from torch.distributed.tensor import DTensor

from shardfit.config.families import hf_config_json
from shardfit.parallel.agreement import agree
from shardfit.weights.hf_load import STACKED, expert_key
from shardfit.weights.peft_config import ADAPTER_CONFIG, ADAPTER_WEIGHTS

T = TypeVar("T")

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json",
                    "tokenizer.model",
                    "generation_config.json", "vocab.json", "merges.txt")


def export_problem(out: Path) -> str | None:
    """Why exporting to `out` would lose someone's files (None: a new or empty directory, or a previous export,
    which holds only what an export writes and is replaced whole)."""
    if out.is_file():
        return "is a file, not a directory"
    if out.is_dir():
        ours = {"config.json", "model.safetensors", "model.safetensors.index.json", ADAPTER_CONFIG, ADAPTER_WEIGHTS,
                *_TOKENIZER_FILES}
        foreign = sorted(p.name for p in out.iterdir() if p.name not in ours
                         and not (p.name.startswith("model-") and p.suffix == ".safetensors"))
        if foreign:
            return f"exists and holds files an export would delete ({', '.join(foreign[:3])})"
    parent = out.parent
    while not parent.exists():
        parent = parent.parent
    if not os.access(parent, os.W_OK):
        return f"cannot be created ({parent} is not writable)"
    return None


def export_hf(model: nn.Module, out: str | Path, dtype: str = "bfloat16", source: str | Path | None = None,
              max_shard_bytes: int = 5 * 10**9, params=None, tokenizer: str | None = None) -> Path | None:
    """params: (name, full tensor) pairs to write instead of full_parameters(model) (every rank iterates them);
    tokenizer files from the directory `source`, or, for tokenizer="byte", the byte tokenizer's."""
    out = Path(out)
    rank = dist.get_rank() if dist.is_initialized() else 0
    tmp = out.with_name(out.name + ".tmp")
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    shards: list[dict[str, torch.Tensor]] = [{}]
    sizes = [0]
    files: list[str] = []
    weight_map: dict[str, str] = {}

    def flush():
        name = f"shard-{len(files):05d}.safetensors"
        write_safetensors(shards[0], tmp / name)
        files.append(name)
        weight_map.update({k: name for k in shards[0]})
        shards[0], sizes[0] = {}, 0

    total = 0
    for key, piece in hf_tensors(model, getattr(torch, dtype), keep=rank == 0, device=torch.device("cpu"),
                                 params=params):
        if shards[0] and sizes[0] + piece.nbytes > max_shard_bytes:
            flush()
        shards[0][key] = piece.contiguous()
        sizes[0] += piece.nbytes
        total += piece.nbytes
    problem = None
    if rank == 0:
        try:
            flush()
            problem = _finish(model, tmp, out, files, weight_map, total, dtype, source, tokenizer)
        except OSError as e:
            problem = f"could not write {tmp} ({e.strerror or e})"
    # every rank returns or raises together: rank 0's outcome, in one collective (this was the final barrier)
    agree(problem, "checkpoint.export_hf", f"move {tmp} where you want it, or free {out} and export again")
    return out if rank == 0 else None


def batched_by_bytes(items: Iterable[T], nbytes: Callable[[T], int], limit: int) -> Iterator[list[T]]:
    """items in order, as lists of at most `limit` bytes each (an item larger than limit alone), drawn lazily: one
    item beyond the list being filled is taken at a time (Engine.weights' buckets, load_adapter's staging)."""
    batch, size = [], 0
    for item in items:
        n = nbytes(item)
        if batch and size + n > limit:
            yield batch
            batch, size = [], 0
        batch.append(item)
        size += n
    if batch:
        yield batch


def full_tensor(p: torch.Tensor) -> torch.Tensor:
    """The whole of a (sharded) parameter: a collective for a DTensor, which every rank issues in the same order."""
    return _gatherable(p).full_tensor() if isinstance(p, DTensor) else p


def full_parameters(model: nn.Module):
    """(name, full tensor) of every parameter, one gathered at a time, in the same order on every rank."""
    for name, p in model.named_parameters():
        yield name, full_tensor(p)


def hf_tensors(model: nn.Module, dtype: torch.dtype, keep: bool = True, device: torch.device | None = None,
               params=None):
    """(Hugging Face name, full tensor in dtype) for every parameter, one gathered at a time: every rank must
    iterate to the end, in the same order (each DTensor's gather is a collective). keep=False: gather (the
    collective) but yield nothing on this rank. device: where the yielded tensors go (default: where gathered).
    params: the (name, full tensor) pairs to convert instead of full_parameters(model)."""
    for name, full in (params if params is not None else full_parameters(model)):
        if keep:
            t = full.detach().to(device=device, dtype=dtype)
            # stacked experts are given per expert, as Hugging Face checkpoints store them
            if STACKED.match(name):
                yield from ((expert_key(name, e), t[e]) for e in range(t.shape[0]))
            else:
                yield name, t
        del full


def _gatherable(p: DTensor) -> DTensor:
    """p, or where its local shard is not on its mesh's device the same DTensor with the shard copied there.

    FSDP2's CPUOffloadPolicy keeps each shard in (pinned) host memory while the parameter's mesh stays the one
    fully_shard was given: device type "cuda", process group NCCL (FSDP copies the shard to the GPU itself before
    each of its own all-gathers; _fsdp_param.py). full_tensor() would hand NCCL the host tensor. The copy is one
    shard (numel / world elements of the parameter dtype), freed with the returned DTensor once the caller's
    full_tensor() is done: the GPU holds one full parameter and one shard at a time.
    """
    mesh = p.device_mesh
    with torch.no_grad():
        local = p.to_local()
        if local.device.type == mesh.device_type:
            return p
        device = torch.device(mesh.device_type, torch.get_device_module(mesh.device_type).current_device())
        # The shard may be the short last one of an uneven split (FSDP pads only its own buffer): shape and stride
        # give from_local the global layout rather than inferring it from this rank's shard.
        return DTensor.from_local(local.to(device), mesh, p.placements, shape=p.shape, stride=p.stride(),
                                  run_check=False)


def write_safetensors(tensors: dict[str, torch.Tensor], path: Path) -> None:
    save_file(tensors, str(path), metadata={"format": "pt"})
    os.chmod(path, 0o666 & ~_umask())  # safetensors creates files 0600; the export is for everyone


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _finish(model, tmp: Path, out: Path, files: list[str], weight_map: dict[str, str], total: int, dtype: str,
            source, tokenizer: str | None = None) -> str | None:
    """Name the shards, write config and tokenizer files, and rename tmp to out; else why not."""
    n = len(files)
    names = {f: ("model.safetensors" if n == 1 else f"model-{i + 1:05d}-of-{n:05d}.safetensors")
             for i, f in enumerate(files)}
    for old, new in names.items():
        os.replace(tmp / old, tmp / new)
    if n > 1:
        (tmp / "model.safetensors.index.json").write_text(json.dumps(
            {"metadata": {"total_size": total}, "weight_map": {k: names[v] for k, v in sorted(weight_map.items())}},
            indent=2))
    config = {**hf_config_json(model.cfg), "torch_dtype": dtype, "dtype": dtype}
    (tmp / "config.json").write_text(json.dumps(config, indent=2))
    copy_tokenizer(source, tmp, tokenizer, model.cfg.max_seq_len)
    return publish(tmp, out)


def copy_tokenizer(source: str | Path | None, tmp: Path, tokenizer: str | None = None, max_length: int = 0) -> None:
    """The tokenizer's files of the source model directory, where it has them; the byte tokenizer's, written."""
    if tokenizer == "byte":
        from shardfit.weights.tokenizer_files import write_byte_tokenizer

        write_byte_tokenizer(tmp, max_length)
    elif source:
        for fname in _TOKENIZER_FILES:
            src = Path(source) / fname
            if src.is_file():
                shutil.copy2(src, tmp / fname)


def publish(tmp: Path, out: Path) -> str | None:
    """Rename the finished tmp directory to out (replacing a previous export); else why not."""
    problem = export_problem(out)  # checked at start-up too: files may have appeared since
    if problem:
        return f"{out} {problem}; the export is left in {tmp}"
    if out.exists():
        shutil.rmtree(out)
    os.replace(tmp, out)
    return None
