"""Distributed checkpoints with torch.distributed.checkpoint, written so that a crash never leaves a half-written
checkpoint under a final name, and read so that a crafted or damaged one never runs code or loads garbage.

Layout of <dir>/step_00000100/:
  .metadata, __*.distcp    DCP: model (frozen parameters left out) and optimizer tensors, each rank its own shards
  rng/rank<r>.safetensors  each rank's RNG state
  trainer.json             step, skipped steps, tokens seen, the run's id (the data position is the step), and
                           whether the optimizer's state is in it
  config.toml              the resolved config of the run
  complete.json            written last, by rank 0, after every rank has finished

Every rank writes into step_00000100.tmp/; once all have (one collective of their outcomes) rank 0 writes
complete.json and renames the directory. A failed write (disk full, read-only) is raised on every rank alike and
leaves the previous checkpoint as it was; a full disk (fsutil.full_disk: DCP wraps the OSError in a RuntimeError
inside a CheckpointException, and loses it when it gathers the ranks' failures; safetensors words it in its own
error) names the directory and the space a rank needs.
Weights that are not finite are never saved. checkpoint.keep prunes only this run's own older checkpoints (same
run id, carried across resumes). Loading goes through checkpoint_verify.
Saved without an optimizer (Engine.save_state(optimizer=False): weights for a sampler), a checkpoint holds the
trained parameters and buffers only, a third of the bytes under Adam (fp32 weights and two fp32 moments each); it is
written, checked and loaded as any other, and an attempt to restore an optimizer from it is one line.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import uuid
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file, save_file
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from shardfit.errors import DiskFull, ShardfitError
from shardfit.fsutil import full_disk_error, write_atomic
from shardfit.models.init import is_quantized_storage
from shardfit.parallel.agreement import agree
from shardfit.weights.checkpoint_verify import COMPLETE, check_files, load_tensors

_STEP_DIR = re.compile(r"^step_(\d{8})$")
# Frozen parameters (a LoRA run's base) are not saved: the Engine rebuilds them from model.path or the seed, as the
# run started, and a checkpoint holds what training changes (adapters, buffers, optimizer). strict=False on load:
# the frozen keys are then absent from the state dict by design.
_TRAINED_LOAD = StateDictOptions(ignore_frozen_params=True, strict=False)


def frozen_names(model) -> set[str]:
    """Every name of a frozen parameter, tied aliases included (lm_head.weight beside a frozen embed_tokens.weight)."""
    return {n for n, p in model.named_parameters(remove_duplicate=False) if not p.requires_grad}


def trained_state(model) -> dict:
    """The model's state dict without its frozen parameters (DCP's ignore_frozen_params keeps a tied alias of one,
    so the names are dropped here too)."""
    frozen = frozen_names(model)
    state = get_model_state_dict(model, options=StateDictOptions(ignore_frozen_params=True))
    return {k: v for k, v in state.items() if k not in frozen}


class NonFiniteWeights(ShardfitError):
    """The weights hold NaN or inf: nothing is saved or exported from them."""

    exit_code = 3


def _local_bytes(state) -> int:
    """Bytes of this rank's share of a state dict (DTensors by their local shard), nested dicts walked."""
    if isinstance(state, dict):
        return sum(_local_bytes(v) for v in state.values())
    if isinstance(state, torch.Tensor):
        t = state.to_local() if hasattr(state, "to_local") else state
        return t.numel() * t.element_size()
    return 0


def new_run_id() -> str:
    return uuid.uuid4().hex[:12]


def _write_json(path: Path, obj: dict) -> None:
    write_atomic(path, json.dumps(obj, indent=2, sort_keys=True))


def _rng_state(device: torch.device) -> dict[str, torch.Tensor]:
    state = {"cpu": torch.get_rng_state()}
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def weights_finite(model, device: torch.device) -> bool:
    """Whether every rank's parameter shards are finite: one pass of foreach norms (no temporaries the size of a
    parameter) and one collective."""
    from shardfit.parallel import all_gather_rows
    from shardfit.parallel.offload import grad_sq_norm
    from shardfit.parallel.step_overlap import local_tensor

    # an NF4 weight's storage is codes carried in a float dtype (adapters/nf4.py): its bytes are not numbers
    sq = grad_sq_norm([local_tensor(p.detach()) for n, p in model.named_parameters() if not is_quantized_storage(n)],
                      device)
    if dist.is_initialized() and dist.get_world_size() > 1:
        sq = all_gather_rows(sq.reshape(1))
    return bool(torch.isfinite(sq).all())


def refuse_non_finite(model, device: torch.device, step: int, root: Path, what: str) -> None:
    if not weights_finite(model, device):
        last = complete_checkpoints(root)
        raise NonFiniteWeights(f"the weights are not finite after step {step}: {what} refused"
                               + (f"; the last complete checkpoint, {last[-1]}, is intact" if last else ""),
                               where=f"step {step}", fix="lower train.lr or raise train.warmup_steps (or check the "
                               "data), then resume from the last complete checkpoint")


def save_checkpoint(root: Path, step: int, model, optimizer, trainer_state: dict, config_toml: str,
                    device: torch.device, keep: int = 0) -> Path:
    """Save; trainer_state holds "run_id" (pruning) besides what it records; optimizer None: the model alone.
    Raises on every rank alike."""
    refuse_non_finite(model, device, step, root, "saving a checkpoint")
    rank, world = dist.get_rank(), dist.get_world_size()
    final = root / f"step_{step:08d}"
    tmp = root / f"step_{step:08d}.tmp"
    fix = f"free space or fix permissions in {root} (or set checkpoint.dir), then resume"

    full = []  # a full disk seen here: the error is then a DiskFull (serve answers it as its own failure)

    def failed(e: BaseException, r: int, needed: int | None = None) -> str | None:
        """The line's problem for a write that raised `e` on rank r; None when it is no write failure (a bug)."""
        disk = full_disk_error(e, root, f"checkpoint {final.name} on rank {r}", fix, needed)
        if disk is not None:
            full.append(r)
            return disk.what
        if isinstance(e, OSError):
            return f"could not write checkpoint {final.name} on rank {r} ({e.strerror or e})"
        return None

    def attempt(fn, needed: int | None = None) -> str | None:
        try:
            fn()
        except Exception as e:  # any: a rank that raised alone would leave the others waiting in settle
            return failed(e, rank, needed) or f"could not write checkpoint {final.name} on rank {rank} " \
                                              f"({type(e).__name__}: {e})"
        return None

    def prepare():
        shutil.rmtree(tmp, ignore_errors=True)
        (tmp / "rng").mkdir(parents=True)

    def settle(problem: str | None) -> None:
        """Every rank learns whether any failed (one collective); on failure the temporary directory goes."""
        try:
            agree(problem, str(root), fix, device)
        except ShardfitError as e:
            if rank == 0:
                shutil.rmtree(tmp, ignore_errors=True)
            last = complete_checkpoints(root)
            previous = f"the previous checkpoint {last[-1]} is intact" if last else "no checkpoint of this run " \
                                                                                    "exists yet"
            raise (DiskFull if full else ShardfitError)(f"{e.what}; {previous}", where=e.where, fix=e.fix) from None

    settle(attempt(prepare) if rank == 0 else None)
    state = {"model": trained_state(model)}
    if optimizer is not None:
        state["optim"] = get_optimizer_state_dict(model, optimizer)["state"]
    needed = _local_bytes(state)  # what this rank writes (its shards), for a full disk's message
    try:
        dcp.save(state, checkpoint_id=str(tmp))
        problem = attempt(lambda: save_file(_rng_state(device), str(tmp / "rng" / f"rank{rank}.safetensors")),
                          needed)
    except CheckpointException as e:  # DCP gathers every rank's failure and raises it on all ranks alike
        said = {r: failed(err, r, needed) for r, (err, _trace) in e.failures.items()}
        said = {r: p for r, p in said.items() if p is not None}
        if not said:
            raise
        problem = said[min(said)]
    settle(problem)  # every rank has finished writing, or all stop here

    def publish():
        _write_json(tmp / "trainer.json", {**trainer_state, "step": step, "world_size": world,
                                           "optimizer": optimizer is not None})
        write_atomic(tmp / "config.toml", config_toml)
        _write_json(tmp / COMPLETE, {"step": step, "world_size": world})
        if final.exists():  # a corrupt one resume passed over (run_dir.check_no_overwrite refuses whole ones)
            shutil.rmtree(final)
        os.replace(tmp, final)

    settle(attempt(publish) if rank == 0 else None)  # nobody proceeds (or exits) before the rename
    if rank == 0 and keep:
        prune(root, keep, trainer_state.get("run_id"), step)
    return final


def run_id_of(path: Path) -> str | None:
    try:
        rec = json.loads((path / "trainer.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return rec.get("run_id") if isinstance(rec, dict) else None


def prune(root: Path, keep: int, run_id: str | None, newest: int) -> list[Path]:
    """Delete this run's checkpoints older than its `keep` newest (up to step `newest`); another run's, or one
    without a run id (an older shardfit's), is never touched."""
    if run_id is None:
        return []
    ours = [p for p in complete_checkpoints(root) if step_of(p) <= newest and run_id_of(p) == run_id]
    for old in ours[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    return ours[:-keep]


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
            problem = check_files(path)
            if problem is None:
                return path
            if skipped is not None:
                skipped.append(f"skipped corrupt checkpoint {path}: {problem}")
        return None
    path = Path(spec)
    if not (path / COMPLETE).is_file():
        raise ShardfitError("not a complete shardfit checkpoint (no complete.json)", where=str(path),
                            fix="pass a step_XXXXXXXX directory, or checkpoint.resume=auto")
    problem = check_files(path)
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


def load_checkpoint(path: Path, model, optimizer, device: torch.device, rng: bool = True) -> dict:
    """Restore model and optimizer shards (any world size) and this rank's RNG (rng=False: not); return trainer.json.

    The files were checked whole when the checkpoint was chosen; here the tensors are checked against this model
    and optimizer before DCP reads them (checkpoint_verify.load_tensors)."""
    trainer_state = json.loads((path / "trainer.json").read_text())
    if optimizer is not None and trainer_state.get("optimizer") is False:  # the same file on every rank: all raise
        raise ShardfitError("saved without the optimizer's state (save_state(optimizer=False)): it holds the "
                            "weights only", where=str(path), fix="load its weights alone (Engine.load_state(path, "
                            "optimizer=False)), or resume from a checkpoint saved with its optimizer")
    state = {"model": trained_state(model)}
    if optimizer is not None:  # None: the weights alone
        osd = get_optimizer_state_dict(model, optimizer)  # creates the optimizer state to load into
        state["optim"] = osd["state"]
    load_tensors(state, path)
    set_model_state_dict(model, state["model"], options=_TRAINED_LOAD)
    if optimizer is not None:
        set_optimizer_state_dict(model, optimizer, {"state": state["optim"], "param_groups": osd["param_groups"]})
    rng_file = path / "rng" / f"rank{dist.get_rank()}.safetensors"
    if rng and rng_file.is_file() and trainer_state.get("world_size") == dist.get_world_size():
        rng = load_file(str(rng_file))
        torch.set_rng_state(rng["cpu"])
        if "cuda" in rng and device.type == "cuda":
            torch.cuda.set_rng_state(rng["cuda"], device)
    return trainer_state
