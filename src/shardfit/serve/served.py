"""Frozen extra models (`shardfit serve --serve.models=PATH[,PATH...]`): more Hugging Face bases that sampling clients
name as base_model (a distillation teacher, a reference of another family), sampled and scored, never trained.

Each is an Engine of its own, built on every rank in the same order after the trained one (its own collectives), from
a config that is the server's but for [model] and the tokenizer, which come from the directory's config.json as
--model.path would bring them: sharded like the trained model (the same parallel, compute and memory keys), its
weights loaded at start. It is held as a LoRA run holds its frozen base (Engine(frozen=True)): every parameter frozen
and stored in the compute dtype (bf16 on CUDA; on the CPU fp32 unless compute.param_dtype says otherwise), so it
costs its parameters' shards in that dtype and nothing else (no gradients, no optimizer state); on one rank the
decode model samples views of them, no copy. `shardfit plan` counts each (plan/served.py). Every path is checked
before any rank starts (the CLI calls `served_configs`): a path that is no model directory is one line naming
serve.models, exit 2.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from pathlib import Path

from shardfit.config import Config, load_config
from shardfit.config.schema import LoraConfig
from shardfit.errors import ShardfitError

FIX = "give Hugging Face model directories (config.json and *.safetensors), comma-separated"


def served_paths(cfg: Config) -> list[str]:
    return [p.strip() for p in cfg.serve.models.split(",") if p.strip()]


def served_configs(cfg: Config) -> dict[str, Config]:
    """name (the path as given, what clients pass as base_model) -> the config its Engine is built from."""
    out: dict[str, Config] = {}
    main = str(Path(cfg.model.path)) if cfg.model.path else cfg.model.name
    for path in served_paths(cfg):
        where = f"serve.models {path[:200]}"
        if path in out or path == main:
            raise ShardfitError("named twice (the trained model is served already)", where=where,
                                fix="name each extra model once")
        try:
            # [model] and the tokenizer as --model.path brings them; a short data.seq_len: the default may exceed a
            # small model's limit, and only the server's own data keys are kept
            own = load_config(None, [f"--model.path={path}", "--data.seq_len=16"])
        except ShardfitError as e:
            raise ShardfitError(e.what, where=where, fix=FIX) from None
        if not any(Path(own.model.path).glob("*.safetensors")):
            raise ShardfitError("no *.safetensors weights in this directory", where=where, fix=FIX)
        extra = copy.deepcopy(cfg)
        extra.model, extra.data.tokenizer = own.model, own.data.tokenizer
        extra.lora = LoraConfig()  # frozen: no adapters
        extra.serve.models = ""
        out[path] = extra
    return out


def start_served(cfg: Config, factory: Callable[[Config], object]) -> dict[str, object]:
    """name -> its Engine, built by `factory(config, frozen=True)` on every rank (the same order everywhere)."""
    return {name: factory(extra, frozen=True) for name, extra in served_configs(cfg).items()}
