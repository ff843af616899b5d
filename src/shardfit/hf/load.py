"""Load a Hugging Face safetensors checkpoint into a (sharded) model.

Each rank reads only the rows of each tensor that its FSDP shard holds, through safetensors' memory-mapped slices:
no rank reads or holds a full copy of the model, the bytes read over all ranks add up to one copy, and there are no
collectives at all (nothing to deadlock, nothing to broadcast). Values land directly in the local shards.

Errors name the file and the tensor: a missing shard file, a missing or unexpected tensor, a shape mismatch, a
truncated or corrupt file.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn

from shardfit.errors import ShardfitError
from shardfit.models.init import local_view

_IGNORED = ("rotary_emb.inv_freq",)  # buffers some old exports stored; rebuilt by init_buffers


def weight_map(path: Path) -> dict[str, Path]:
    """Tensor name -> file, from model.safetensors.index.json or a single model.safetensors."""
    index = path / "model.safetensors.index.json"
    if index.is_file():
        try:
            names = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as e:
            raise ShardfitError(f"unreadable index ({e})", where=str(index), fix="re-export the checkpoint") from None
        return {k: path / v for k, v in names.items()}
    single = path / "model.safetensors"
    if not single.is_file():
        raise ShardfitError("no model.safetensors or model.safetensors.index.json", where=str(path),
                            fix="point model.path at a directory saved with safetensors")
    with _open(single) as f:
        names = f.keys()
    return dict.fromkeys(names, single)


def _open(file: Path):
    from safetensors import safe_open

    if not file.is_file():
        raise ShardfitError("checkpoint shard is missing", where=str(file), fix="copy the complete checkpoint")
    try:
        return safe_open(str(file), framework="pt", device="cpu")
    except Exception as e:  # SafetensorError for truncated headers, bad JSON, wrong sizes
        raise ShardfitError(f"corrupt or truncated safetensors file ({e})", where=str(file),
                            fix="re-download or re-export this shard") from None


@torch.no_grad()
def load_hf_checkpoint(model: nn.Module, path: str | Path) -> int:
    """Fill every parameter of `model` (plain or FSDP-sharded) from the checkpoint; returns bytes read here."""
    path = Path(path)
    files = weight_map(path)
    params = dict(model.named_parameters())  # tied weights appear once
    tied_extra = {"lm_head.weight"} if getattr(model, "cfg", None) is not None and model.cfg.tie_embeddings else set()
    missing = [n for n in params if n not in files]
    if missing:
        raise ShardfitError(f"tensor '{missing[0]}' is not in the checkpoint ({len(missing)} missing)",
                            where=str(path), fix="check that config.json matches the weights")
    unexpected = [n for n in files if n not in params and n not in tied_extra and not n.endswith(_IGNORED)]
    if unexpected:
        raise ShardfitError(f"checkpoint tensor '{unexpected[0]}' has no place in the model "
                            f"({len(unexpected)} unexpected)", where=str(files[unexpected[0]]),
                            fix="the architecture in config.json does not match these weights")
    by_file: dict[Path, list[str]] = {}
    for name in params:
        by_file.setdefault(files[name], []).append(name)
    read = 0
    for file, names in sorted(by_file.items()):
        with _open(file) as f:
            for name in names:
                p = params[name]
                local, shape, row0 = local_view(p)
                try:
                    sl = f.get_slice(name)
                    got = tuple(sl.get_shape())
                    if got != shape:
                        raise ShardfitError(f"tensor '{name}' has shape {list(got)}, the model expects {list(shape)}",
                                            where=str(file), fix="check that config.json matches the weights")
                    if local.numel() == 0:
                        continue
                    part = sl[row0:row0 + local.shape[0]] if local.dim() else sl[:]
                except ShardfitError:
                    raise
                except Exception as e:  # data past the end of a truncated file
                    raise ShardfitError(f"cannot read tensor '{name}' ({e})", where=str(file),
                                        fix="re-download or re-export this shard") from None
                local.copy_(part.to(local.dtype), non_blocking=False)
                read += part.numel() * part.element_size()
    model.init_buffers()
    return read
