"""The Engine's weights and state, read and written: checkpoints (save_state / load_state, the trainer's save),
the bucketed stream of full tensors an inference engine loads (weights), Hugging Face and PEFT exports.

Every reader of the parameters waits for a launched overlapped step and drops the gathered copies a no-grad pass
kept (finish, parallel/gathered.py) first: it then reads the weights after the last optim_step.
"""

from __future__ import annotations

from pathlib import Path

import torch

from shardfit.errors import ShardfitError
from shardfit.parallel.fp8 import refresh_fp8_scales
from shardfit.weights.checkpoint import load_checkpoint, refuse_non_finite, save_checkpoint


class EngineState:
    """Mixed into Engine (engine/engine.py): needs its cfg, model, optimizer, device, step counters and finish()."""

    def save_state(self, root: Path, optimizer: bool = True, model: str | None = None) -> Path:
        """Model and optimizer (exact resume) as a checkpoint directory root/step_N, the only one of this run kept
        under root (a name saved again is replaced); returns it. model: which LoRA model (engine/registry.py)."""
        from shardfit.config import config_to_toml

        self.using(model)
        return self.save(Path(root), config_to_toml(self.cfg), keep=1, optimizer=optimizer)

    def load_state(self, path: Path, optimizer: bool = True, model: str | None = None) -> None:
        """Weights (and the optimizer's state and step) from a checkpoint: a step directory save_state or train
        wrote, or a directory holding them (the newest whole one is taken). Checked whole before it is read.
        model: the LoRA model it fills (engine/registry.py)."""
        path = _checked_step(path)
        self.using(model)
        self.finish()
        state = load_checkpoint(path, self.model, self.optimizer if optimizer else None, self.device)
        if optimizer:
            self.step, self.skipped = state["step"], state.get("skipped", 0)
        self.weights_epoch += 1  # Engine.sample's decode weights and cached adapter slots are stale
        refresh_fp8_scales(self.model, self.cfg.compute)

    def load_version(self, path: Path, name: str = "") -> str:
        """A frozen version of the weights a checkpoint holds (as load_state finds and checks it), which `using`
        accepts: with LoRA its adapters, without every weight in the compute dtype (engine/registry.py). No model
        is changed: the one in the slot is put back by its next call. name: what the version was loaded from (a
        tinker:// path), kept in the registry's record."""
        path = _checked_step(path)

        def load() -> None:
            load_checkpoint(path, self.model, None, self.device, rng=False)  # the trainer's RNG is not the version's
            refresh_fp8_scales(self.model, self.cfg.compute)

        vid = self.models.load_version(load, name or str(path))
        self.weights_epoch += 1  # the slot was written: Engine.sample's cached copies of it are stale
        return vid

    def weights(self, dtype: torch.dtype = torch.bfloat16, bucket_bytes: int = 1 << 28, model: str | None = None):
        """Full tensors under Hugging Face names, bucket after bucket (lists of (name, tensor) of about
        bucket_bytes), on every rank, for an inference engine's load_weights; one parameter is gathered at a time
        beyond the bucket being filled. Every rank must iterate to the end (each gather is a collective)."""
        from shardfit.weights.hf_export import batched_by_bytes, hf_tensors

        self.using(model)
        self.finish()
        yield from batched_by_bytes(hf_tensors(self.model, dtype, params=self._merged()), lambda nt: nt[1].nbytes,
                                    bucket_bytes)

    def save(self, root: Path, config_toml: str, keep: int = 0, optimizer: bool = True) -> Path:
        self.finish()
        # a LoRA run's base, when it came from model.init_from: the step a resume and an export must read again
        base = str(self.init_from.resolve()) if self.init_from and self.cfg.lora.rank else None
        return save_checkpoint(root, self.step, self.model, self.optimizer if optimizer else None,
                               {"skipped": self.skipped, "tokens_seen": self.tokens_seen, "run_id": self.run_id,
                                "base_from": base}, config_toml, self.device, keep=keep)

    def refuse_non_finite(self, root: Path, what: str) -> None:
        self.finish()
        refuse_non_finite(self.model, self.device, self.step, root, what)

    def export_hf(self, out: str, dtype: str, source: str | None, merged: bool = False,
                  tokenizer: str | None = None) -> Path:
        """A Hugging Face model directory; of a LoRA run the PEFT adapter (fp32), or with merged=True the base with
        the adapters merged in (weights/peft.py). tokenizer: the run's data.tokenizer ("byte": its files written)."""
        from shardfit.weights.hf_export import export_hf

        self.finish()
        if self.lora_targets is not None and not merged:
            from shardfit.weights.peft import export_adapter

            export_adapter(self.model, out, self.cfg.lora, self.lora_targets, self.cfg.model.path or None, source)
        else:
            export_hf(self.model, out, dtype, source, params=self._merged(), tokenizer=tokenizer)
        return Path(out)

    def _merged(self):
        """The (name, full tensor) stream of a LoRA model's merged weights; None (every parameter) otherwise."""
        if self.lora_targets is None:
            return None
        from shardfit.weights.peft import merged_parameters

        return merged_parameters(self.model)


def _checked_step(path: Path) -> Path:
    """The step directory to load: `path` itself when complete, else the newest whole one under it; checked whole
    before it is read (one line: none there, or what is corrupt)."""
    from shardfit.weights.checkpoint import complete_checkpoints
    from shardfit.weights.checkpoint_verify import COMPLETE, check_files

    path = Path(path)
    if not (path / COMPLETE).is_file():
        found = complete_checkpoints(path) if path.is_dir() else []
        if not found:
            raise ShardfitError("no checkpoint here", where=str(path), fix="name a directory save_state wrote")
        path = found[-1]
    problem = check_files(path)
    if problem:
        raise ShardfitError(f"corrupt checkpoint: {problem}", where=str(path), fix="load an earlier checkpoint")
    return path
