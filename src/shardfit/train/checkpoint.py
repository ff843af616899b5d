"""Distributed checkpoints with torch.distributed.checkpoint, written so that a crash never leaves a half-written
checkpoint under a final name.

Layout of <dir>/step_00000100/:
  .metadata, __*.distcp    DCP: model and optimizer tensors, each rank writing its own shards
  rng/rank<r>.safetensors  each rank's RNG state
  trainer.json             step, skipped steps, tokens seen (the data position is the step)
  config.toml              the resolved config of the run
  complete.json            written last, by rank 0, after every rank has finished

Every rank writes into step_00000100.tmp/; after a barrier rank 0 writes complete.json and renames the directory.
Only tensors go through DCP (optimizer hyper-parameters come from the config), so loading never unpickles
anything but tensors with weights_only=True.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file, save_file
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from shardfit.errors import ShardfitError
from shardfit.fsutil import write_atomic

_STEP_DIR = re.compile(r"^step_(\d{8})$")
COMPLETE = "complete.json"


def _write_json(path: Path, obj: dict) -> None:
    write_atomic(path, json.dumps(obj, indent=2, sort_keys=True))


def _rng_state(device: torch.device) -> dict[str, torch.Tensor]:
    state = {"cpu": torch.get_rng_state()}
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def save_checkpoint(root: Path, step: int, model, optimizer, trainer_state: dict, config_toml: str,
                    device: torch.device, keep: int = 0) -> Path:
    rank, world = dist.get_rank(), dist.get_world_size()
    final = root / f"step_{step:08d}"
    tmp = root / f"step_{step:08d}.tmp"
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        (tmp / "rng").mkdir(parents=True)
    dist.barrier()
    state = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, optimizer)["state"]}
    dcp.save(state, checkpoint_id=str(tmp))
    save_file(_rng_state(device), str(tmp / "rng" / f"rank{rank}.safetensors"))
    dist.barrier()  # every rank has finished writing
    if rank == 0:
        _write_json(tmp / "trainer.json", {**trainer_state, "step": step, "world_size": world})
        (tmp / "config.toml").write_text(config_toml)
        _write_json(tmp / COMPLETE, {"step": step, "world_size": world})
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        if keep:
            for old in complete_checkpoints(root)[:-keep]:
                shutil.rmtree(old, ignore_errors=True)
    dist.barrier()  # nobody proceeds (or exits) before the rename
    return final


def check_checkpoint(path: Path) -> str | None:
    """None if the checkpoint is whole, else what is wrong with it.

    DCP's .metadata is a pickle that DCP later reads with plain pickle.load: it is read here first with an
    allowlist of DCP's own classes, so a tampered file is refused before anything runs. Every byte range it
    references must exist (a truncated or missing shard file is caught before the load starts).
    """
    from shardfit.safe_pickle import DCP_GLOBALS, DCP_MODULES, RefusedGlobal, safe_loads

    try:
        json.loads((path / COMPLETE).read_text())
        json.loads((path / "trainer.json").read_text())
        meta = safe_loads((path / ".metadata").read_bytes(), allowed=DCP_GLOBALS, modules=DCP_MODULES, dtypes=True)
    except FileNotFoundError as e:
        return f"missing {Path(e.filename).name}"
    except RefusedGlobal as e:
        return f".metadata {e}"
    except Exception as e:  # truncated JSON or pickle
        return f"unreadable ({type(e).__name__}: {e})"
    ends: dict[str, int] = {}
    for info in getattr(meta, "storage_data", {}).values():
        rel = str(info.relative_path)
        ends[rel] = max(ends.get(rel, 0), info.offset + info.length)
    for rel, end in sorted(ends.items()):
        f = path / rel
        if not f.is_file():
            return f"missing {rel}"
        if f.stat().st_size < end:
            return f"{rel} is truncated ({f.stat().st_size} of {end} bytes)"
    return None


def complete_checkpoints(root: Path) -> list[Path]:
    """Complete checkpoint directories under root, oldest first (a .tmp or unmarked directory is not one)."""
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if p.is_dir() and _STEP_DIR.match(p.name) and (p / COMPLETE).is_file()]
    return sorted(found, key=step_of)


def step_of(path: Path) -> int:
    return int(_STEP_DIR.match(path.name).group(1))


def resolve_resume(spec: str, root: Path, skipped: list[str] | None = None, at_most: int | None = None) -> Path | None:
    """'none' -> None; 'auto' -> the newest complete checkpoint under root (of step <= at_most, if given) that checks
    out whole (each corrupt one passed over is reported in `skipped`); else the given directory, which must be whole."""
    if spec == "none":
        return None
    if spec == "auto":
        for path in reversed(complete_checkpoints(root)):
            if at_most is not None and step_of(path) > at_most:
                continue
            problem = check_checkpoint(path)
            if problem is None:
                return path
            if skipped is not None:
                skipped.append(f"skipped corrupt checkpoint {path}: {problem}")
        return None
    path = Path(spec)
    if not (path / COMPLETE).is_file():
        raise ShardfitError("not a complete shardfit checkpoint (no complete.json)", where=str(path),
                            fix="pass a step_XXXXXXXX directory, or checkpoint.resume=auto")
    problem = check_checkpoint(path)
    if problem:
        raise ShardfitError(f"corrupt checkpoint: {problem}", where=str(path),
                            fix="resume from an earlier checkpoint (checkpoint.resume=auto skips corrupt ones)")
    return path


def agree_on_resume(spec: str, root: Path, notices: list[str], device: torch.device) -> Path | None:
    """resolve_resume on every rank, then one all-gather of the chosen steps so that all ranks load the same one.

    Ranks can see different checkpoints (a corrupt file only one node reads, a directory not on a shared
    filesystem). Every rank then takes the oldest step any rank chose, which the others also hold because
    checkpoints are kept in step order; a rank that has no checkpoint while others do is an error on every rank
    (all see the same gathered steps, so all raise): starting it from scratch would train different weights.
    """
    from shardfit.parallel import all_gather_rows

    try:
        path, error = resolve_resume(spec, root, notices), None
    except ShardfitError as e:  # raised below, after the gather: no peer is left waiting in it
        path, error = None, e
    if not dist.is_initialized() or dist.get_world_size() == 1:
        if error:
            raise error
        return path
    # -2: this rank could not use the checkpoint it was given; -1: none found; else the step (0 for an explicit path)
    code = -2 if error else (-1 if path is None else (step_of(path) if spec == "auto" else 0))
    steps = all_gather_rows(torch.tensor([code], dtype=torch.int64, device=device))[:, 0].tolist()
    if error:
        raise error
    if -2 in steps:
        raise ShardfitError(f"rank {steps.index(-2)} cannot read the checkpoint to resume (its error says why)",
                            where=spec if spec != "auto" else str(root), fix="see that rank's message")
    if len(set(steps)) == 1:
        return path
    by_rank = ", ".join(f"rank {r}: {'none' if s < 0 else f'step {s}'}" for r, s in enumerate(steps))
    if min(steps) < 0:
        raise ShardfitError(f"ranks see different checkpoints to resume ({by_rank})", where=str(root),
                            fix="put checkpoint.dir on a filesystem every rank reads, or set checkpoint.resume")
    agreed = min(steps)
    path = resolve_resume(spec, root, [], at_most=agreed)  # skips were reported by the first pass
    found = step_of(path) if path is not None else -1
    ok = torch.tensor([found == agreed], dtype=torch.int64, device=device)
    if not all(all_gather_rows(ok)[:, 0].tolist()):  # every rank learns whether the agreed step loads everywhere
        raise ShardfitError(f"ranks see different checkpoints to resume ({by_rank}) and step {agreed} is not whole "
                            "on every rank", where=str(root), fix="put checkpoint.dir on a shared filesystem")
    notices.append(f"ranks disagreed on the newest checkpoint ({by_rank}); all resume from step {agreed}")
    return path


def load_checkpoint(path: Path, model, optimizer, device: torch.device) -> dict:
    """Restore model and optimizer shards (any world size) and this rank's RNG; return trainer.json."""
    trainer_state = json.loads((path / "trainer.json").read_text())
    osd = get_optimizer_state_dict(model, optimizer)  # creates the optimizer state to load into
    state = {"model": get_model_state_dict(model), "optim": osd["state"]}
    dcp.load(state, checkpoint_id=str(path))
    set_model_state_dict(model, state["model"])
    set_optimizer_state_dict(model, optimizer, {"state": state["optim"], "param_groups": osd["param_groups"]})
    rng_file = path / "rng" / f"rank{dist.get_rank()}.safetensors"
    if rng_file.is_file() and trainer_state.get("world_size") == dist.get_world_size():
        rng = load_file(str(rng_file))
        torch.set_rng_state(rng["cpu"])
        if "cuda" in rng and device.type == "cuda":
            torch.cuda.set_rng_state(rng["cuda"], device)
    return trainer_state
