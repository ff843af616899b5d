"""Other tools' spellings of shardfit's keys, for the one error line a mistyped option gets.

Users arrive from the Hugging Face Trainer (`--learning_rate`, `--per_device_train_batch_size`), torchtune
(`batch_size`, `max_seq_len`) and axolotl (`micro_batch_size`, `sequence_len`, `lora_r`). A spelling of theirs, bare
(`--learning_rate=1e-4`) or under a section (`--train.learning_rate`), is answered with shardfit's key and, where the
meaning differs, how to translate it; string similarity alone proposed `train.min_lr_ratio` for `learning_rate`.
Nothing here accepts the foreign spelling: the run stops, so the user learns the key once and the saved config.toml
holds one spelling.
"""

from __future__ import annotations

_STEPS = "train.steps (optimizer steps)"
_MICRO = "train.micro_batch (sequences per GPU per forward/backward)"
_SEQ = "data.seq_len"
_ACCUM = ("train.global_batch (accumulation follows from it: global_batch / (micro_batch x GPUs); "
          "--train.global_batch=64 --train.micro_batch=4 on 4 GPUs accumulates 4)")

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
    "model_name_or_path": "model.path (a local Hugging Face model directory)",
    "gradient_checkpointing": "compute.activation_checkpoint=full", "bf16": "compute.param_dtype (bf16 is the "
    "default on CUDA)", "torch_compile": "compute.compile", "report_to": "logging.tensorboard / logging.wandb",
    "dataset_text_field": "data.text_field", "lr_scheduler_type": "train.min_lr_ratio (the schedule is linear "
    "warm-up then cosine decay to lr x min_lr_ratio)",
    # torchtune
    "batch_size": _MICRO, "max_seq_len": _SEQ, "epochs": "train.epochs", "clip_grad_norm": "train.grad_clip",
    "enable_activation_checkpointing": "compute.activation_checkpoint=full", "compile": "compute.compile",
    "dtype": "compute.param_dtype", "log_every_n_steps": "logging.log_every",
    "conversation_style": "data.format (sharegpt, messages, alpaca, prompt_completion or text)",
    "chat_template": "data.chat_template (auto, tokenizer, plain or none)",
    # axolotl
    "micro_batch_size": _MICRO, "sequence_len": _SEQ, "base_model": "model.path (a local Hugging Face model "
    "directory)", "datasets": "data.path", "val_set_size": "data.val_fraction", "sample_packing": "data.pack",
    "lora_r": "lora.rank", "lora_alpha": "lora.alpha", "lora_dropout": "lora.dropout",
    "lora_target_modules": "lora.targets", "lora_model_dir": "lora.adapter", "num_epochs": "train.epochs",
    "optimizer": "train.* (AdamW; "
    "lr, beta1, beta2, eps, weight_decay)",
}


def foreign_spelling(name: str) -> str | None:
    """`fix` text for an option name from another tool ('--learning_rate', 'train.learning_rate'), else None."""
    key = name.lstrip("-").split("=", 1)[0].rsplit(".", 1)[-1].replace("-", "_").lower()
    ours = FOREIGN.get(key)
    if ours is None:
        return None
    return f"'{key}' is {ours} in shardfit (shardfit train --help lists every key)"
