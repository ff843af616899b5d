"""A model built whole on one device (CPU or one GPU) from its weights: what `shardfit generate` decodes with and
`shardfit export` writes out, in one process with no process group.

- `load_hf`: a Hugging Face model directory (or a shardfit export), read through hf_load.py's reader; with an
  adapter, a PEFT adapter directory put on it unmerged (peft.attach_adapter: `generate --adapter`).
- `load_dcp`: a shardfit checkpoint (a step directory, or the newest whole one of a run or checkpoints directory),
  whatever number of ranks wrote it and in whatever layout: every file checked whole first (checkpoint_verify.py:
  nothing unpickled), its config.toml's model, lora and data keys (and train.seed) checked as `train` checks them,
  then every shard read into these full tensors. A LoRA run's checkpoint holds its adapters only: they are put on
  the base the run built (its model.path, the full checkpoint its model.init_from names, or the seeded
  initialisation it started from, drawn on this device; a quantised base (QLoRA's NF4, FP8) quantised as training did).
- `write_hf`: such a model as a Hugging Face directory (hf_export.py's writer), a LoRA model's adapters merged in.
Loaded weights are in the asked dtype, the RoPE frequencies in fp32 as in training, quantised storage bit for bit.
"""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

import torch

from shardfit.adapters.fp8_base import quantized_class
from shardfit.adapters.lora import apply_lora, is_adapter
from shardfit.adapters.quantized import apply_quantized, to_dtype
from shardfit.config.families import read_hf_config
from shardfit.config.loader import _set, validate
from shardfit.config.schema import Config, ModelConfig
from shardfit.config.spellings import Spellings
from shardfit.errors import ShardfitError
from shardfit.models import build_model
from shardfit.models.decoder import CausalLM
from shardfit.weights.checkpoint import COMPLETE, frozen_names, resolve_resume
from shardfit.weights.checkpoint_verify import CheckpointProblem, config_toml, load_tensors
from shardfit.weights.hf_export import export_hf
from shardfit.weights.hf_load import load_hf_checkpoint
from shardfit.weights.init_from import base_source
from shardfit.weights.peft import attach_adapter, merged_parameters
from shardfit.weights.tokenizer_files import tokenizer_source


def load_hf(path: str, device: torch.device, dtype: torch.dtype, adapter: str | None = None
            ) -> tuple[CausalLM, str]:
    """A Hugging Face model directory (or a shardfit export): (model, tokenizer spec); adapter: a PEFT adapter
    directory put on it, unmerged (its fp32 adapters then in `dtype`, as the base)."""
    family, fields = read_hf_config(path)
    model = _build(ModelConfig(**{**fields, "name": family.model_type}), device)
    load_hf_checkpoint(model, path)
    if adapter:
        attach_adapter(_in_dtype(model, dtype), adapter)
    tok = Path(path) / "tokenizer.json"
    return _in_dtype(model, dtype), str(tok) if tok.is_file() else "byte"


def load_dcp(path: str, device: torch.device, dtype: torch.dtype, saved: dict | None = None) -> tuple[CausalLM, str]:
    """A shardfit checkpoint (step_XXXXXXXX), a checkpoints directory or a run directory (the newest complete
    checkpoint in it): the model part only, on one device, whatever the number of ranks that wrote it. saved, when
    given, receives the run's data.chat_template and the config.toml that records it."""
    root = Path(path)
    if not root.exists():
        raise ShardfitError("checkpoint not found", where=path,
                            fix="give a step_XXXXXXXX, checkpoints or run directory")
    if not (root / COMPLETE).is_file() and (root / "checkpoints").is_dir():
        root = root / "checkpoints"
    skipped: list[str] = []  # every file checked (checkpoint_verify) before anything reads the tensors
    ckpt = resolve_resume(str(root) if (root / COMPLETE).is_file() else "auto", root, skipped)
    if ckpt is None:
        raise ShardfitError("no complete checkpoint here" + (f" ({skipped[0]})" if skipped else ""), where=path,
                            fix="train with checkpoint.final=true or checkpoint.every, or give a step_XXXXXXXX "
                            "directory")
    for line in skipped:
        print(f"shardfit: {line}", file=sys.stderr)
    cfg = checkpoint_config(ckpt)
    if saved is not None:
        saved.update(chat_template=cfg.data.chat_template, where=str(ckpt / "config.toml"))
    if not cfg.lora.rank:
        model = _build(cfg.model, device)
    else:  # the checkpoint holds the adapters (and buffers); the frozen base is rebuilt as the run built it
        model = load_hf(cfg.model.path, device, torch.float32)[0] if cfg.model.path else _build(cfg.model, device)
        if not cfg.model.path:
            model.init_weights(cfg.train.seed)
        if cfg.model.init_from:  # the full checkpoint the run's base came from, as its trainer.json records it
            base = {"model": model.state_dict()}
            _load_quietly(base, base_source(ckpt, [], device))
            model.load_state_dict(base["model"])
        targets = apply_lora(model, cfg.lora, None)
        if cfg.model.quantize != "none":  # the base the adapters trained on, quantised as training did
            apply_quantized(model, targets, quantized_class(cfg.model.quantize))
    frozen = frozen_names(model)  # a LoRA run's base: not in its checkpoint
    state = {"model": {k: v for k, v in model.state_dict().items() if k not in frozen}}
    _load_quietly(state, ckpt)
    model.load_state_dict(state["model"], strict=not frozen)
    return _in_dtype(model, dtype), cfg.data.tokenizer


def _load_quietly(state: dict, ckpt: Path) -> None:
    """The checked loader without a process group: every shard is read into these full tensors."""
    with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
        warnings.filterwarnings("ignore", message=".*single process", category=UserWarning)
        load_tensors(state, ckpt)


def checkpoint_config(ckpt: Path) -> Config:
    """The run's config saved in the checkpoint, its model, lora and data keys (and train.seed) checked as `train`
    checks them."""
    try:
        saved = config_toml(ckpt)
    except CheckpointProblem as e:
        raise ShardfitError(str(e), where=str(ckpt), fix="give the step directory of a whole checkpoint") from None
    cfg, where = Config(), str(ckpt / "config.toml")
    spellings = Spellings(where)  # a run of an older shardfit: its data.format=jsonl is data.file_format now
    for section in ("model", "lora", "data", "train"):
        table = saved.get(section, {})
        if not isinstance(table, dict):
            raise ShardfitError(f"[{section}] is not a table", where=where, fix="restore the run's config.toml")
        for key, value in table.items():
            new_section, new_key = spellings.key(section, key, value)
            fields = type(getattr(cfg, new_section)).__dataclass_fields__
            # of [train], the seed only (a LoRA run's seeded base): its batch keys are checked against a world size
            if new_key in fields and (section != "train" or new_key == "seed"):
                _set(cfg, new_section, new_key, value, f"{where} [{section}] {key}", set())
    validate(cfg)
    return cfg


def _in_dtype(model: CausalLM, dtype: torch.dtype) -> CausalLM:
    """The weights in `dtype`, the RoPE frequencies in fp32 as in training (FSDP's mixed precision casts parameters
    only): a bf16 inv_freq turns positions into angles off by ~0.7 rad at position 4,000."""
    to_dtype(model, dtype).eval()  # quantised storage (a QLoRA or FP8-base checkpoint's base) kept bit for bit
    model.init_buffers_fp32()
    return model


def _build(m: ModelConfig, device: torch.device) -> CausalLM:
    with torch.device(device):
        model = build_model(m)
    model.init_buffers()  # RoPE frequencies; every weight is loaded next
    return model


def write_hf(model: CausalLM, out: Path, dtype: str, tokenizer: str, chat_template: str) -> None:
    """`model` (load_dcp's) as the Hugging Face directory `out`, with the tokenizer's files (tokenizer: a
    tokenizer.json or its directory, or "byte": its files written) and the chat template the run applied
    (data/chat.py's export_template); a LoRA model's adapters merged into its base, as checkpoint.export_merged
    writes it."""
    from shardfit.data.chat import export_template

    lora = any(is_adapter(name) for name, _ in model.named_parameters())
    export_hf(model, out, dtype, tokenizer_source(tokenizer), params=merged_parameters(model) if lora else None,
              tokenizer=tokenizer)
    export_template(out, chat_template)  # the template the run applied, as the trainer's export
