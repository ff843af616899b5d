"""`model.init_from`: a new run's starting weights from a shardfit checkpoint, on any parallel layout.

Weights only: the optimizer, the schedule and the step start afresh, and the RNG is the run's own seed's. The
checkpoint is chosen as resume chooses one (`agree_on_resume`: every file checked whole, one all-gather so that every
rank loads the same step) and read through the checked loader (checkpoint_verify.load_tensors: nothing unpickled,
every tensor's shape compared first). The loader has already taken the architecture from its config.toml
(config/init_from.py); a shape that still differs is one line here, on every rank alike.
"""

from __future__ import annotations

from pathlib import Path

import torch

from shardfit.config.init_from import newest_step_dir
from shardfit.errors import ShardfitError
from shardfit.train.checkpoint import agree_on_resume, load_checkpoint
from shardfit.train.checkpoint_verify import COMPLETE


def resolve_init_from(spec: str, notices: list[str], device: torch.device) -> Path:
    """The step directory to start from, the same on every rank (one collective, like resume's)."""
    path = Path(spec)
    if (path / COMPLETE).is_file():
        chosen = agree_on_resume(str(path), path.parent, notices, device)
    else:
        root = newest_step_dir(spec).parent  # raises, one line, when it holds no complete checkpoint
        chosen = agree_on_resume("auto", root, notices, device)
    if chosen is None:
        raise ShardfitError("no whole checkpoint to start from (each one found is corrupt: see above)",
                            where=f"model.init_from={spec}", fix="name an earlier step_XXXXXXXX directory")
    return chosen


def load_init_weights(path: Path, model, device: torch.device, notices: list[str]) -> None:
    try:
        state = load_checkpoint(path, model, None, device, rng=False)
    except ShardfitError as e:
        raise ShardfitError(e.what, where=f"model.init_from={path}", fix="drop the model.* overrides that change "
                            "its shape (model.init_from takes the architecture saved with it)") from None
    notices.append(f"weights from {path} (step {state.get('step')}, model.init_from); a fresh optimizer and "
                   "schedule from step 0")
