"""`model.init_from`: a new run's starting weights from a shardfit checkpoint, on any parallel layout.

Weights only: the optimizer, the schedule and the step start afresh, and the RNG is the run's own seed's. A LoRA run
takes its frozen base from there, at its start and at every resume (its own checkpoints hold only the adapters):
the step directory is recorded in each checkpoint's trainer.json (`base_from`). The
checkpoint is chosen as resume chooses one (`agree_on_resume`: every file checked whole, one all-gather so that every
rank loads the same step) and read through the checked loader (checkpoint_verify.load_tensors: nothing unpickled,
every tensor's shape compared first). The loader has already taken the architecture from its config.toml
(config/init_from.py); a shape that still differs is one line here, on every rank alike.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict

from shardfit.config.init_from import newest_step_dir
from shardfit.errors import ShardfitError
from shardfit.weights.checkpoint import agree_on_resume, frozen_names, load_checkpoint
from shardfit.weights.checkpoint_verify import COMPLETE, load_tensors


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


def base_source(resume: Path, notices: list[str], device: torch.device) -> Path:
    """The step directory a resumed LoRA run's frozen base came from (trainer.json's `base_from`, written at every
    save): pinned, so that a resume never takes a newer step of the source run than the one the adapters trained on.
    Checked whole and agreed on by every rank (agree_on_resume's one all-gather), as a new run's choice is."""
    recorded = json.loads((resume / "trainer.json").read_text()).get("base_from")
    if recorded is None:  # the same file on every rank: all raise alike
        raise ShardfitError("this LoRA checkpoint does not record the base it trained on (model.init_from)",
                            where=str(resume), fix="start the run again from model.init_from")
    path = Path(recorded)
    try:
        chosen = agree_on_resume(str(path), path.parent, notices, device)
    except ShardfitError as e:
        raise ShardfitError(f"the frozen base this LoRA run trained on cannot be read ({e.what})", where=recorded,
                            fix="restore that checkpoint: the run's own checkpoints hold only its adapters") from None
    if chosen is None:
        raise ShardfitError("the frozen base this LoRA run trained on is gone", where=recorded,
                            fix="restore that checkpoint: the run's own checkpoints hold only its adapters")
    return chosen


def load_frozen_base(path: Path, model) -> None:
    """A LoRA run's frozen parameters from a full checkpoint (its adapters keep their fresh init). Read through the
    checked loader like any checkpoint; the tensors are the checkpoint's own names, those of the model before
    adapters (a LoRALinear keeps its base's `weight`)."""
    frozen = frozen_names(model)
    state = {"model": {k: v for k, v in get_model_state_dict(model).items() if k in frozen}}
    load_tensors(state, path, cast=True)  # fp32 masters of a full fine-tune into a base kept in the compute dtype
    set_model_state_dict(model, state["model"], options=StateDictOptions(strict=False))


def load_init_weights(path: Path, model, device: torch.device, notices: list[str], lora: bool = False,
                      resumed: bool = False) -> None:
    """Weights only. lora: the run's frozen base alone, from a full fine-tune's checkpoint (resumed: under the
    adapters and optimizer a resume restores next)."""
    try:
        if lora:
            load_frozen_base(path, model)
            step = json.loads((path / "trainer.json").read_text()).get("step")
        else:
            step = load_checkpoint(path, model, None, device, rng=False).get("step")
    except ShardfitError as e:
        raise ShardfitError(e.what, where=f"model.init_from={path}", fix="drop the model.* overrides that change "
                            "its shape (model.init_from takes the architecture saved with it)") from None
    what = "frozen base for the LoRA adapters" if lora else "weights"
    rest = "the adapters and optimizer from the resumed checkpoint" if resumed else \
        "a fresh optimizer and schedule from step 0"
    notices.append(f"{what} from {path} (step {step}, model.init_from); {rest}")
