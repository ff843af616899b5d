"""How a config key may be spelled, and what a key spelled otherwise is told: old spellings, other tools', typos.

- **Old spellings** (keys that moved) are accepted for one release with one notice line each. The keys of [compute]
  (activation checkpointing, compile, dtypes, attention and loss kernels, FP8, NUMA binding) lived in [parallel]
  before 0.2: `--parallel.compile=true`, and `[parallel] compile = true` in a TOML file (a saved run's config.toml
  included), still load as `compute.compile`. data.format named the file format before 0.2 and names the record
  layout now (sharegpt, alpaca, ...): its file-format values jsonl and parquet move to data.file_format the same way
  (auto and text mean the same under both keys). Each old spelling used gets one line on stderr per run, printed
  once the config has loaded (a bad config stays one error line), by the launching process only: not again by the
  ranks `shardfit train --nproc` starts, nor by ranks other than 0 under a torchrun the user started. Both spellings
  of one key in the same source is an error naming both: which one was meant cannot be told.
- **Other tools' spellings** are refused with shardfit's key or, where shardfit has none, what to do instead. Users
  arrive from the Hugging Face Trainer and TRL (`--learning_rate`, `--per_device_train_batch_size`, `packing`),
  torchtune (`batch_size`, `max_seq_len`) and axolotl (`micro_batch_size`, `sequence_len`, `lora_r`). Their spelling,
  bare (`--learning_rate=1e-4`) or under a section (`--train.learning_rate`), on the command line or in a TOML file,
  is answered by name; string similarity alone proposed `train.min_lr_ratio` for `learning_rate` and `train.seed`
  for `lr_scheduler`. The run stops, so the user learns the key once and the saved config.toml holds one spelling.
- **Typos** get "did you mean" only when the name is really close to a key (one letter off or two swapped, or the
  key a prefix of it: `stpes`, `warmup`), else the keys of the section; one of shardfit's keys given without its
  section (`--seq_len=128`) is named with it.
"""

from __future__ import annotations

import dataclasses
import os
import sys
from collections.abc import Iterable

from shardfit.config.schema import ComputeConfig, Config
from shardfit.errors import LAUNCHER_PID, ShardfitError

# ---- old spellings --------------------------------------------------------------------------------------------------

UNTIL = "0.3"  # the release that drops the old spellings
NEW_IN_COMPUTE = frozenset({"ac_blocks", "share_prefix"})  # [compute] keys added after the split: never in [parallel]
RENAMED: dict[str, str] = {f"parallel.{f.name}": f"compute.{f.name}" for f in dataclasses.fields(ComputeConfig)
                           if f.name not in NEW_IN_COMPUTE}
# a key whose old meaning is told by its value: (the key those values belong to now, the values)
MOVED_VALUES: dict[str, tuple[str, frozenset[str]]] = {"data.format": ("data.file_format",
                                                                       frozenset({"jsonl", "parquet"}))}
_announced: set[str] = set()  # old spellings already named by this process


class Spellings:
    """The keys of one source (a TOML file, or the command line): old spellings mapped to their new key, and a key
    given under both spellings refused."""

    def __init__(self, where: str):
        self.where = where
        self.given: dict[str, str] = {}  # new key -> the spelling this source used
        self.old: list[str] = []  # old spellings used, in order

    def key(self, section: str, key: str, value: object = None) -> tuple[str, str]:
        """(section, key) as the schema names it now; value tells a MOVED_VALUES key's meaning."""
        name = f"{section}.{key}"
        new, label = RENAMED.get(name, name), name
        moved = MOVED_VALUES.get(name)
        if moved and isinstance(value, str) and value.strip().lower() in moved[1]:
            new, label = moved[0], f"{name}={value.strip()}"
        first = self.given.setdefault(new, name)
        if first != name:
            old = first if first != new else name
            raise ShardfitError(f"{old} and {new} are both given ({old} is the old spelling of {new})",
                                where=self.where, fix=f"keep {new} only")
        if new != name and label not in self.old:
            self.old.append(label)
        new_section, _, new_key = new.partition(".")
        return new_section, new_key


def notice(old: str) -> str:
    name, eq, value = old.partition("=")
    if eq:
        return (f"shardfit: {old} is now {MOVED_VALUES[name][0]}={value} ({name} names the record layout: "
                f"messages, sharegpt, alpaca, prompt_completion or text); the old spelling is accepted until {UNTIL}")
    return f"shardfit: {old} is now {RENAMED[old]}; the old spelling is accepted until {UNTIL}"


def announce(*sources: Spellings) -> None:
    """One stderr line per old spelling the sources used, once per process and once per run (see the docstring)."""
    quiet = bool(os.environ.get(LAUNCHER_PID)) or os.environ.get("RANK", "0") != "0"  # the launcher said them
    for old in (name for s in sources for name in s.old):
        if old not in _announced:
            _announced.add(old)
            if not quiet:
                print(notice(old), file=sys.stderr)


# ---- other tools' spellings -----------------------------------------------------------------------------------------

_STEPS = "train.steps (optimizer steps)"
_MICRO = "train.micro_batch (sequences per GPU per forward/backward)"
_SEQ = "data.seq_len"
_ACCUM = ("train.global_batch (accumulation follows from it: global_batch / (micro_batch x GPUs); "
          "--train.global_batch=64 --train.micro_batch=4 on 4 GPUs accumulates 4)")
_MODEL = "model.path (a local Hugging Face model directory, or a Hub id already in the local cache)"
_ATTENTION = "compute.attention (auto, flash, cudnn or efficient: PyTorch's SDPA kernels on CUDA)"

# the other tool's key (lower case, dashes as underscores) -> shardfit's key, with a translation where needed
FOREIGN: dict[str, str] = {
    # Hugging Face Trainer / TRL
    "learning_rate": "train.lr", "lr": "train.lr", "max_steps": _STEPS, "num_train_epochs": "train.epochs",
    "per_device_train_batch_size": _MICRO, "train_batch_size": _MICRO, "gradient_accumulation_steps": _ACCUM,
    "max_seq_length": _SEQ, "max_length": _SEQ, "warmup_steps": "train.warmup_steps",
    "warmup_ratio": "train.warmup_steps (a step count: ratio x train.steps)", "weight_decay": "train.weight_decay",
    "max_grad_norm": "train.grad_clip", "adam_beta1": "train.beta1", "adam_beta2": "train.beta2",
    "adam_epsilon": "train.eps", "seed": "train.seed", "output_dir": "logging.run_dir",
    "save_steps": "checkpoint.every", "save_total_limit": "checkpoint.keep", "logging_steps": "logging.log_every",
    "eval_steps": "train.eval_every", "resume_from_checkpoint": "checkpoint.resume",
    "model_name_or_path": _MODEL, "gradient_checkpointing": "compute.activation_checkpoint=full",
    "bf16": "compute.param_dtype (bf16 is the default on CUDA)", "torch_dtype": "compute.param_dtype",
    "torch_compile": "compute.compile", "report_to": "logging.tensorboard / logging.wandb",
    "run_name": "logging.wandb_name", "dataset_text_field": "data.text_field", "dataset_name": "data.path",
    "packing": "data.pack (fine-tuning examples packed into rows as separate documents; on by default)",
    "attn_implementation": _ATTENTION, "use_peft": "lora.rank (> 0 trains LoRA adapters)",
    "load_in_4bit": "model.quantize=nf4 (QLoRA: with lora.rank > 0)", "tokenizer_name": "data.tokenizer",
    "tokenizer_name_or_path": "data.tokenizer",
    # torchtune
    "batch_size": _MICRO, "max_seq_len": _SEQ, "epochs": "train.epochs", "clip_grad_norm": "train.grad_clip",
    "enable_activation_checkpointing": "compute.activation_checkpoint=full", "compile": "compute.compile",
    "dtype": "compute.param_dtype", "log_every_n_steps": "logging.log_every",
    "conversation_style": "data.format (sharegpt, messages, alpaca, prompt_completion or text)",
    "chat_template": "data.chat_template (auto, tokenizer, plain, none, or a Jinja file)",
    # axolotl
    "micro_batch_size": _MICRO, "sequence_len": _SEQ, "base_model": _MODEL, "datasets": "data.path",
    "val_set_size": "data.val_fraction", "sample_packing": "data.pack", "lora_r": "lora.rank",
    "lora_alpha": "lora.alpha", "lora_dropout": "lora.dropout", "lora_target_modules": "lora.targets",
    "lora_model_dir": "lora.adapter", "num_epochs": "train.epochs", "flash_attention": _ATTENTION,
    "adapter": "lora.rank (> 0: LoRA; with model.quantize=nf4: QLoRA)",
}

_ADAMW = ("the optimizer is AdamW (fused on CUDA) in every run; set its train.lr, train.beta1, train.beta2, "
          "train.eps and train.weight_decay")
_SCHEDULE = ("the schedule is linear warm-up (train.warmup_steps) then cosine decay to train.lr x train.min_lr_ratio; "
             "train.min_lr_ratio=1 holds the rate constant after warm-up")
_SHARDING = ("shardfit shards every run with FSDP2 itself: the layout is the [parallel] keys, and shardfit plan "
             "proposes one that fits")
# the other tool's key -> what to do in shardfit, which has no key for it
NOT_A_KEY: dict[str, str] = {
    "optim": _ADAMW, "optimizer": _ADAMW, "lr_scheduler": _SCHEDULE, "lr_scheduler_type": _SCHEDULE,
    "trust_remote_code": "shardfit runs its own implementation of each architecture it supports (llama, mistral, "
                         "qwen2, qwen3, qwen3_moe: model.path's config.json picks it) and never runs a model's code; "
                         "drop it",
    "fp16": "shardfit computes in bf16 on CUDA (compute.param_dtype), never fp16 with loss scaling; drop it",
    "load_in_8bit": "model.quantize=fp8 (an 8-bit float base, with lora.rank > 0)",
    "deepspeed": _SHARDING, "fsdp": _SHARDING, "fsdp_config": _SHARDING,
    "local_rank": "start the ranks with --nproc N (and --nnodes for several hosts), or under torchrun; drop it",
    "push_to_hub": "export the model (checkpoint.export_hf=true, or shardfit export), then upload the directory "
                   "(huggingface-cli upload)",
    "neftune_noise_alpha": "shardfit adds no NEFTune noise to the embeddings; drop it",
}


def _bare(name: str) -> str:
    """The key an option names, without dashes, value or section: '--train.Max-Steps=3' -> 'max_steps'."""
    return name.lstrip("-").split("=", 1)[0].rsplit(".", 1)[-1].replace("-", "_").lower()


def foreign_spelling(name: str) -> str | None:
    """`fix` text for an option name from another tool ('--learning_rate', 'train.learning_rate'), else None."""
    key = _bare(name)
    if key in NOT_A_KEY:
        return f"'{key}' is not a shardfit key: {NOT_A_KEY[key]}"
    ours = FOREIGN.get(key)
    if ours is None:
        return None
    return f"'{key}' is {ours} in shardfit (shardfit train --help lists every key)"


def sectionless(name: str) -> str | None:
    """`fix` text for one of shardfit's own keys given without its section ('--seq_len=128'), else None."""
    key = _bare(name)
    cfg = Config()
    sections = [s for s, obj in vars(cfg).items() if key in {f.name for f in dataclasses.fields(obj)}]
    if not sections:
        return None
    return "write " + " or ".join(f"--{s}.{key}" for s in sections) + ": an option names its section"


# ---- typos ----------------------------------------------------------------------------------------------------------

def _edits(a: str, b: str) -> int:
    """Insertions, deletions, substitutions and swaps of two neighbours that turn a into b (optimal string
    alignment distance)."""
    prev2: list[int] = []
    prev = list(range(len(b) + 1))
    for i in range(1, len(a) + 1):
        row = [i] + [0] * len(b)
        for j in range(1, len(b) + 1):
            row[j] = min(prev[j] + 1, row[j - 1] + 1, prev[j - 1] + (a[i - 1] != b[j - 1]))
            if i > 1 and j > 1 and a[i - 1] == b[j - 2] and a[i - 2] == b[j - 1]:
                row[j] = min(row[j], prev2[j - 2] + 1)
        prev2, prev = prev, row
    return prev[-1]


def close_to(name: str, option: str) -> bool:
    """Whether a mistyped `name` plausibly meant `option`: a letter or two off (one per four letters, at least one),
    or one a prefix of the other and at least half of it (`warmup` for warmup_steps, `dataset` for data). Looser
    measures matched any two keys that share a section and a few letters (train.seed for train.lr_scheduler)."""
    name, option = name.lower(), option.lower()
    if _edits(name, option) <= max(1, max(len(name), len(option)) // 4):
        return True
    short, long = sorted((name, option), key=len)
    return len(short) >= 4 and long.startswith(short) and 2 * len(short) >= len(long)


def closest(name: str, options: Iterable[str]) -> str | None:
    """The option `name` most likely meant, or None when none is close (close_to)."""
    near = [o for o in options if close_to(name, o)]
    return min(near, key=lambda o: (_edits(name.lower(), o.lower()), o)) if near else None


def did_you_mean(name: str, options: Iterable[str]) -> str:
    """The fix for an unknown name among `options` (a section, a preset): the close one, else all of them."""
    options = list(options)
    match = closest(name, options)
    return f"did you mean '{match}'?" if match else "valid: " + ", ".join(sorted(options))


def unknown_key_fix(section: str, key: str, keys: dict[str, list[str]]) -> str:
    """The fix for `section.key` that is no key (`keys`: each section's keys): another tool's spelling named, else the
    close key of any section (this section's first), else this section's keys."""
    foreign = foreign_spelling(key)
    if foreign:
        return foreign
    match = closest(key, keys[section]) or closest(key, [k for s in keys if s != section for k in keys[s]])
    if match:
        where = section if match in keys[section] else next(s for s in keys if match in keys[s])
        return f"did you mean '{where}.{match}'?"
    return f"[{section}] has {', '.join(keys[section])} (shardfit train --help explains each)"
