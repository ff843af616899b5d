"""Load a Hugging Face safetensors checkpoint into a (sharded) model.

Each rank reads only the rows of each tensor that its FSDP shard holds, through safetensors' memory-mapped slices:
no rank reads or holds a full copy of the model, the bytes read over all ranks add up to one copy, and there are no
collectives at all (nothing to deadlock, nothing to broadcast). Values land directly in the local shards.

Errors name the file and the tensor: a missing shard file, a missing or unexpected tensor, a shape mismatch, a
truncated or corrupt file.
"""

from __future__ import annotations

import json
import re
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
    # plan: file -> [(checkpoint key, parameter name, expert index or None)] for what this rank holds
    plan: dict[Path, list[tuple[str, str, int | None]]] = {}
    expected: set[str] = set()
    for name, p in params.items():
        if name in files:
            expected.add(name)
            plan.setdefault(files[name], []).append((name, name, None))
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
        local, _, row0 = local_view(p)
        for e in range(row0, row0 + (local.shape[0] if local.numel() else 0)):  # only this rank's experts
            plan.setdefault(files[keys[e]], []).append((keys[e], name, e))
    unexpected = [n for n in files if n not in expected and n not in tied_extra and not n.endswith(_IGNORED)]
    if unexpected:
        raise ShardfitError(f"checkpoint tensor '{unexpected[0]}' has no place in the model "
                            f"({len(unexpected)} unexpected)", where=str(files[unexpected[0]]),
                            fix="the architecture in config.json does not match these weights")
    read = 0
    for file, items in sorted(plan.items()):
        with _open(file) as f:
            for key, name, expert in items:
                local, shape, row0 = local_view(params[name])
                if expert is not None:
                    dest, want, rows = local[expert - row0], shape[1:], None
                else:
                    dest, want, rows = local, shape, (row0, row0 + local.shape[0]) if local.dim() else None
                read += _copy_slice(f, file, key, dest, want, rows)
    model.init_buffers()
    return read


def _copy_slice(f, file: Path, key: str, dest: torch.Tensor, want: tuple, rows: tuple[int, int] | None) -> int:
    try:
        sl = f.get_slice(key)
        got = tuple(sl.get_shape())
        if got != tuple(want):
            raise ShardfitError(f"tensor '{key}' has shape {list(got)}, the model expects {list(want)}",
                                where=str(file), fix="check that config.json matches the weights")
        if dest.numel() == 0:
            return 0
        part = sl[rows[0]:rows[1]] if rows else sl[:]
    except ShardfitError:
        raise
    except Exception as e:  # data past the end of a truncated file
        raise ShardfitError(f"cannot read tensor '{key}' ({e})", where=str(file),
                            fix="re-download or re-export this shard") from None
    dest.copy_(part.to(dest.dtype))
    return part.numel() * part.element_size()
