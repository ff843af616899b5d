"""`model.init_from`: the model keys and the tokenizer of the shardfit checkpoint a new run starts from.

As `model.path` takes a Hugging Face model's architecture from its config.json, `model.init_from` takes it from the
config.toml saved in the checkpoint (a step_XXXXXXXX directory, or a run or checkpoints directory: its newest
complete step directory). An explicit model key that contradicts it would not load (another shape): refused here in
one line, before anything is built; training choices stored among the model keys may differ. The weights are read
by the Engine (weights/init_from.py), through the checked loader. Torch-free: the loader imports it.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path
from typing import Any

from shardfit.errors import ShardfitError

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

COMPLETE = "complete.json"  # weights/checkpoint_verify.py's marker (that module imports torch)
_STEP = re.compile(r"^step_\d{8}$")
# model keys that are training choices, not architecture: a run started from a checkpoint may set its own
TRAINING_CHOICES = {"router_aux_coef", "router_bias_rate", "init_std"}
_NOT_COPIED = {"path", "init_from"}  # where that run's own weights came from


def newest_step_dir(spec: str) -> Path:
    """The step directory `spec` names: itself, or the newest complete one in it or in its checkpoints/."""
    path = Path(spec)
    if (path / COMPLETE).is_file():
        return path
    fix = "name a step_XXXXXXXX directory, or a run directory that holds checkpoints (checkpoint.final=true saves one)"
    if not path.is_dir():
        raise ShardfitError("no such checkpoint or run directory", where=f"model.init_from={spec}", fix=fix)
    root = path / "checkpoints" if (path / "checkpoints").is_dir() else path
    steps = sorted(p for p in root.iterdir() if _STEP.match(p.name) and (p / COMPLETE).is_file())
    if not steps:
        raise ShardfitError(f"no complete checkpoint in {root}", where=f"model.init_from={spec}", fix=fix)
    return steps[-1]


def saved_config(step_dir: Path, where: str) -> dict[str, Any]:
    """The config.toml saved in a step directory, parsed; one line if it is missing or not TOML."""
    try:
        return tomllib.loads((step_dir / "config.toml").read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise ShardfitError(f"cannot read {step_dir / 'config.toml'} ({e.__class__.__name__}: {e})", where=where,
                            fix="name a whole checkpoint (shardfit writes config.toml into every one)") from None


def apply_init_from(cfg, explicit: set[str], fill) -> None:
    """Fill the model keys (and data.tokenizer, unless given) from the checkpoint's saved config; fill is the
    loader's `_fill` (each value checked, an explicit key that differs refused)."""
    if cfg.model.path:
        raise ShardfitError("model.init_from and model.path both name starting weights", where="model.init_from",
                            fix="give one: model.path (a Hugging Face directory) or model.init_from (a shardfit "
                            "checkpoint or run directory)")
    step = newest_step_dir(cfg.model.init_from)
    saved = saved_config(step, "model.init_from")
    if getattr(getattr(cfg, "lora", None), "rank", 0):
        # the base comes from a full checkpoint, read as it is stored (a quantised base, NF4 or FP8, is quantised
        # from Hugging Face weights as they are read: weights/quantized_io.py), and a LoRA run's checkpoints hold
        # adapters only
        merged = "export it (shardfit export RUN DIR merges the adapters in) and give DIR as model.path"
        if (quantize := getattr(cfg.model, "quantize", "none")) != "none":
            raise ShardfitError(f"model.init_from does not start a run on a quantized base (model.quantize="
                                f"{quantize}): it is quantised from Hugging Face weights", where="model.init_from",
                                fix="export the run (shardfit export RUN DIR) and give DIR as model.path")
        if (saved.get("lora") or {}).get("rank"):
            raise ShardfitError(f"{step} is a LoRA run's checkpoint: it holds adapters, not the weights they adapt",
                                where="model.init_from", fix=merged)
    known = type(cfg.model).__dataclass_fields__
    fields = {k: v for k, v in (saved.get("model") or {}).items() if k in known and k not in _NOT_COPIED
              and not (k in TRAINING_CHOICES and f"model.{k}" in explicit)}
    fill(cfg, "model", fields, str(step / "config.toml"), explicit, "model.init_from fixes the architecture")
    tokenizer = (saved.get("data") or {}).get("tokenizer")
    if "data.tokenizer" not in explicit and isinstance(tokenizer, str):
        cfg.data.tokenizer = tokenizer
