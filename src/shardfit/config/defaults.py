"""Training defaults that follow the model: its size (schema.SIZE_DEFAULTS), where its weights come from (scratch or
fine-tuning), the data (pretraining tokens per step or fine-tuning examples) and LoRA. The loader applies them to
the train.* keys (and data.seq_len) a user leaves unset, once the preset or config.json is known; `shardfit train
--help` prints the table.

Two facts they need are not config's to work out, and config imports nothing above errors/fsutil: the model's
parameter count (models/ builds the model on the meta device: no memory, ~0.1 s at 70B) and whether data.path holds
fine-tuning examples (data/ reads the files' first records). They are asked of the packages that know, through
`ANSWERS`, which the root package fills on import (shardfit/__init__.py); every import of shardfit.config runs that
file first, so the answers are there whoever loads a config.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from shardfit.config.schema import (
    REAL_SEQ_LEN,
    SFT_GLOBAL_BATCH,
    SIZE_DEFAULTS,
    WARMUP_FRACTION,
    Config,
    DataConfig,
    ModelConfig,
)
from shardfit.errors import ShardfitError


@dataclass
class Answers:
    """What the defaults ask of the packages above config (see the docstring)."""

    param_count: Callable[[ModelConfig], int] | None = None  # models.param_count: the model's parameters, as built
    holds_examples: Callable[[DataConfig], bool] | None = None  # data.mode.holds_examples: fine-tuning data or not


ANSWERS = Answers()

# LoRA fine-tuning trains low-rank adapters from zero (B = 0): the recipes that train them (PEFT's examples, axolotl,
# torchtune) use 1e-4 to 3e-4, about ten times a full fine-tune's 2e-5, which leaves adapters barely moved.
LORA_LR = 1e-4


def training_regime(cfg: Config) -> tuple[bool, bool]:
    """(pretrained weights: model.path or model.init_from; fine-tuning data). data.mode=auto decides as the data
    loader does, from the files' first lines (unreadable ones count as pretraining data: the loader reports them)."""
    try:
        sft = ANSWERS.holds_examples(cfg.data)
    except (ShardfitError, OSError):
        sft = False
    return bool(cfg.model.path or cfg.model.init_from), sft


def training_defaults(n_params: int, pretrained: bool, sft: bool, seq_len: int, steps: int) -> dict[str, Any]:
    """The train.* defaults of a model of n_params parameters (schema.SIZE_DEFAULTS): the weights decide the rate and
    the warm-up (from scratch or fine-tuning), the data the batch (tokens per step, or fine-tuning examples)."""
    _, _, scratch_lr, tune_lr, tokens = next(row for row in SIZE_DEFAULTS if n_params < row[0])
    out: dict[str, Any] = {"lr": tune_lr if pretrained else scratch_lr,
                           "warmup_steps": max(1, round(WARMUP_FRACTION["pretrained" if pretrained else "scratch"]
                                                        * steps))}
    if not tokens:  # the embedded tiny model's own setting, whatever the data
        out.update(global_batch=16, micro_batch=8)
    else:
        sequences = SFT_GLOBAL_BATCH if sft else max(8, 1 << round(math.log2(max(1, tokens / seq_len))))
        out.update(global_batch=sequences, micro_batch=0)
    return out


def _apply_training_defaults(cfg: Config, explicit: set[str], weights: bool = False) -> None:
    """Fill the train.* keys the user left unset with the defaults of this model's size, weights and data. weights:
    the config (a recipe's [recipe.needs]) requires model.path, so it fine-tunes even before model.path is given."""
    n_params = ANSWERS.param_count(cfg.model)
    if "data.seq_len" not in explicit and n_params >= SIZE_DEFAULTS[0][0]:
        # the schema's 256 is the tiny model's; real models train (and are planned) at a real context length
        cfg.data.seq_len = min(REAL_SEQ_LEN, cfg.model.max_seq_len)
    pretrained, sft = training_regime(cfg)
    values = training_defaults(n_params, pretrained or weights, sft, cfg.data.seq_len, cfg.train.steps)
    if cfg.lora.rank and (pretrained or weights):  # adapters, not every weight: a LoRA rate, not a full fine-tune's
        values["lr"] = max(values["lr"], LORA_LR)
    for key, value in values.items():
        if f"train.{key}" not in explicit:
            setattr(cfg.train, key, value)
    if cfg.train.epochs and "train.warmup_steps" not in explicit:  # steps come from the data (train/schedule.py)
        cfg.train.warmup_fraction = WARMUP_FRACTION["pretrained" if pretrained or weights else "scratch"]


def defaults_table() -> str:
    """SIZE_DEFAULTS as `shardfit train --help` prints them."""
    lines = ["Training defaults by model size (total parameters) for the train.* keys you leave unset; "
             "the resolved values are saved in <run_dir>/config.toml. Scratch: no model.path; fine-tuning: "
             "model.path weights; sft data: prompt/completion or chat JSON lines (data.mode).",
             f"  {'size':9} {'lr scratch':>10} {'lr fine-tuning':>14} {'global_batch, pretraining data':>31} "
             f"{'sft data':>8} {'micro_batch':>11}"]
    for _, label, scratch, tune, tokens in SIZE_DEFAULTS:
        batch = "16 sequences" if not tokens else f"{tokens // 1024}K tokens / data.seq_len"
        sft = 16 if not tokens else SFT_GLOBAL_BATCH
        lines.append(f"  {label:9} {scratch:>10.1e} {tune:>14.1e} {batch:>31} {sft:>8} "
                     f"{'8' if not tokens else '0 (auto)':>11}")
    lines.append(f"  warmup_steps: {WARMUP_FRACTION['scratch']:.0%} of train.steps from scratch, "
                 f"{WARMUP_FRACTION['pretrained']:.0%} fine-tuning, at least 1")
    lines.append(f"  LoRA (lora.rank > 0) fine-tuning: lr at least {LORA_LR:.0e}")
    lines.append(f"  data.seq_len: {REAL_SEQ_LEN} from {SIZE_DEFAULTS[0][1].replace('< ', '')} up (at most "
                 "model.max_seq_len); the schema's default below that")
    return "\n".join(lines)
