"""The training loop: set-up (run directory, data, resume point), then `fit` feeds the Engine (engine/engine.py: the
one step implementation) from the data loader, with evaluation, logging, checkpoints and export around it.

Besides the step's collectives (see engine.py), the loop issues: every train.eval_every steps the validation
forwards (the same count on every rank) and one all-gather of their summed loss and token count; at start-up the
run directory's, the resume point's and the saved config's agreements (run_dir.py, checkpoint.py, run_config.py);
the saves' and export's agreements. Every decision that must agree is read from those collectives, so every rank
takes the same branch; a stop on SIGINT / SIGTERM is read from the step's own stats collective (stop.py).
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
import weakref
from pathlib import Path

import torch

from shardfit.adapters.fp8_base import quantized_class
from shardfit.config import Config, accumulation_steps, config_to_dict, config_to_toml
from shardfit.config.shape import StepShape
from shardfit.data.build import build_datasets, build_preference
from shardfit.data.chat import export_template
from shardfit.doctor import MemoryMonitor
from shardfit.doctor.record import SnapshotRecorder
from shardfit.engine import AdamParams, CrossEntropy, Engine, StepRecord
from shardfit.engine.build import apply_alloc_conf, device_memory_bytes
from shardfit.engine.optim import lr_at
from shardfit.engine.stats import reset_peaks
from shardfit.errors import ShardfitError, Stopped
from shardfit.fsutil import write_atomic
from shardfit.parallel import init_distributed
from shardfit.parallel.agreement import agree
from shardfit.parallel.compile_watch import FallbackNotes
from shardfit.parallel.layout import ParallelLayout
from shardfit.train import stop
from shardfit.train.batches import BatchSource
from shardfit.train.curves import end_of_run
from shardfit.train.metrics import LogWindow, flops_per_token, peak_flops, summarize_memory
from shardfit.train.preference import PreferenceSteps, check_preference_config, mean_metrics
from shardfit.train.profile import StepProfiler
from shardfit.train.progress import Progress
from shardfit.train.run_config import check_config, default_run_dir, saved_config, sibling_hint
from shardfit.train.run_dir import RunClaim, check_no_overwrite
from shardfit.train.schedule import apply_epochs, schedule_lines
from shardfit.train.watchdog import EXIT_CODE as WATCHDOG_EXIT
from shardfit.train.watchdog import Watchdog
from shardfit.weights.checkpoint import agree_on_resume
from shardfit.weights.checkpoint_verify import COMPLETE
from shardfit.weights.tokenizer_files import tokenizer_source


class TrainingHalted(ShardfitError):
    """Training stopped on purpose (too many non-finite steps); a checkpoint of the last good state was saved."""

    exit_code = 3


class Trainer:
    def __init__(self, cfg: Config):
        self.cfg = cfg
        apply_alloc_conf(cfg.memory.alloc_conf)
        self.dist = init_distributed(cfg.train.device)
        self.device = self.dist.device
        if self.device.type == "cuda" and cfg.memory.max_fraction:
            torch.cuda.set_per_process_memory_fraction(min(cfg.memory.max_fraction, 1.0), self.device)
        # the default directory is the experiment's own (run_config.py); the config records where the run went
        self.default_dir = not cfg.logging.run_dir
        self.run_dir = Path(cfg.logging.run_dir or default_run_dir(cfg))
        cfg.logging.run_dir = str(self.run_dir)
        self.ckpt_dir = Path(cfg.checkpoint.dir) if cfg.checkpoint.dir else self.run_dir / "checkpoints"
        self.config_toml = config_to_toml(cfg)
        # Nothing is written until fit(): a bad dataset or checkpoint found here leaves no half-made run directory.
        # The watchdog starts now: loading a checkpoint issues collectives too.
        self.watchdog = Watchdog(cfg.train.watchdog_s, self.dist.rank, self.run_dir)
        self.watchdog.beat("start-up (data, model, checkpoint)")
        try:
            # Locked, writable, no export target to clobber: checked before anything the run could lose.
            exports = {"checkpoint.export_hf": cfg.checkpoint.export_hf,
                       "checkpoint.export_merged": cfg.checkpoint.export_merged}
            self.claim = RunClaim(self.run_dir, self.ckpt_dir, exports, self.dist.rank, self.device)
            weakref.finalize(self, self.claim.release)  # a Trainer dropped without fit() frees its directories
            self._set_up(cfg)
        except BaseException:
            self.watchdog.stop()  # a failed start-up leaves no thread behind
            if hasattr(self, "claim"):
                self.claim.release(failed=True)
            raise

    def _set_up(self, cfg: Config) -> None:
        """Data, sequence-parallel layout, model (sharded, initialised or loaded), optimizer, checkpoint resume."""
        self.preference: PreferenceSteps | None = None  # preference.objective's steps over pairs
        self.pref_window: list[dict[str, float]] = []  # their metrics since the last log line
        if cfg.preference.objective != "none":
            check_preference_config(cfg)
            self.dataset, pref_val, self.tokenizer = build_preference(cfg.data, cfg.model.vocab_size,
                                                                      cfg.preference.objective)
            self.val_set, self.preference = None, PreferenceSteps(cfg, self.dataset, self.run_dir, pref_val)
        else:
            self.dataset, self.val_set, self.tokenizer = build_datasets(cfg.data, cfg.model.vocab_size,
                                                                        token_budget=StepShape.of(cfg).by_tokens)
        # Ulysses: a group of sp ranks shares every sample and takes S/sp of its tokens each; the batch is split over
        # the data-parallel ranks (parallel/layout.py)
        self.layout = ParallelLayout.from_config(cfg, self.dist.world_size, self.dist.rank)  # once, handed down
        self.sp, self.sp_rank = self.layout.sequence, self.layout.sequence_rank
        self.dp_rank, self.dp_size = self.layout.data_rank, self.layout.data_size
        self.notices: list[str] = list(self.dataset.notices)  # printed by rank 0 when fit() starts
        self.header: list[str] = list(self.dataset.header)  # the data and the schedule: printed first
        if StepShape.of(cfg).by_tokens:
            self.accum = None  # micro-batches per step follow from the step's lengths (data/batching.py)
        else:
            if cfg.train.micro_batch == 0:
                self._choose_micro_batch()
            self.accum = accumulation_steps(cfg.train.global_batch, cfg.train.micro_batch, self.dp_size)
        self.batches = BatchSource(cfg, self.dataset, self.val_set, self.dp_rank, self.dp_size, self.sp_rank,
                                   self.sp, self.device)
        if self.batches.describe():
            self.notices.append(self.batches.describe())
        self._resolve_data(cfg)

        resume = agree_on_resume(cfg.checkpoint.resume, self.ckpt_dir, self.notices, self.device)
        self._check_run_config(resume)
        check_no_overwrite(self.ckpt_dir, resume, self.dist.rank, self.device, self.notices)
        self.resumed_from = resume
        self.engine = Engine(cfg, self.dist, resume, self.notices, layout=self.layout)
        # compute.activation_checkpoint=auto stays "auto" in config.toml (a resume on another GPU chooses again); the
        # choice made on this one is recorded beside it, as a comment
        chosen = [n for n in self.notices if n.startswith("compute.activation_checkpoint=auto")]
        self.config_toml = "".join(f"# {n}\n" for n in chosen) + self.config_toml
        self.engine.on_micro_batch = self._on_micro_batch
        if cfg.parallel.offload == "all" and self.accum != 1:
            self.notices.append("parallel.offload=all with several micro-batches per step: FSDP2 copies the gradients "
                                "of every micro-batch after the first to the host synchronously and adds them on the "
                                "CPU inside backward; one larger micro-batch (full checkpointing lets it grow) is "
                                "faster (parallel/offload.py)")
        self.progress: Progress | None = None  # made by fit()
        self.flops_per_token = flops_per_token(cfg.model, self.engine.n_params, cfg.data.seq_len)
        self.peak = peak_flops(self.device, cfg.logging.peak_tflops)
        self.recorder = SnapshotRecorder(cfg.memory.snapshot_steps, self.run_dir / "snapshots", self.dist.rank,
                                         self.device, cfg.memory.snapshot_max_entries)
        self.engine.recorder = self.recorder  # an OOM in a pass dumps a snapshot the doctor reads
        self.profiler = StepProfiler(cfg.logging.profile_step, self.run_dir / "profile", self.dist.is_main,
                                     self.device)

    def _resolve_data(self, cfg: Config) -> None:
        """What the data decide: train.steps from train.epochs, the schedule's header lines, and the chat template
        applied, recorded in config.toml for `shardfit generate` (train/schedule.py, data/chat.py)."""
        note = apply_epochs(cfg, self.dataset)
        self.header += schedule_lines(cfg, self.dataset, StepShape.of(cfg).rows_per_round(self.dp_size))
        if self.dataset.info:
            cfg.data.chat_template = self.dataset.info["template"]
        resolved = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, epochs=0.0)) if note else cfg
        self.config_toml = (note or "") + config_to_toml(resolved)

    def _check_run_config(self, resume: Path | None) -> None:
        """This config against the run it continues (the resumed checkpoint's config, or the one a run that trained
        recorded here): refused on every rank alike (one collective) unless only compatible or allowed keys differ."""
        problem = where = fix = None
        try:
            saved, source = saved_config(resume, self.run_dir)
            step = json.loads((resume / COMPLETE).read_text())["step"] if resume is not None else 0
            self.notices += check_config(self.cfg, saved, source, step, str(resume) if resume else None)
        except ShardfitError as e:
            problem, where, fix = e.what, e.where, e.fix
        agree(problem, where or str(self.run_dir), fix or "", self.device)
        hint = sibling_hint(self.cfg, self.run_dir) if resume is None and self.default_dir else None
        if hint:
            self.notices.append(hint)

    # ------------------------------------------------------------------ the Engine's state, for callers and tests
    model = property(lambda self: self.engine.model)
    optimizer = property(lambda self: self.engine.optimizer)
    skipped = property(lambda self: self.engine.skipped)

    @property
    def step(self) -> int:
        return self.engine.step

    @step.setter
    def step(self, value: int) -> None:
        self.engine.step = value

    # ------------------------------------------------------------------ one step
    def _on_micro_batch(self, step: int, i: int, n: int) -> None:
        if i == n:
            self.watchdog.beat(f"step {step} stats collective (after all micro-batches)")
            return
        self.watchdog.beat(f"step {step} micro-batch {i + 1}/{n} (forward/backward)")
        if self.progress is not None:
            self.progress.micro_batch(step, i, n)

    def train_step(self) -> StepRecord:
        """One step of the data loader's batches through the Engine."""
        t0 = time.perf_counter()
        self.recorder.before_step(self.step + 1)
        if self.preference is not None:
            self.pref_window.append(self.preference.step(self.engine, self.step)[0])
        else:
            self.engine.forward_backward(self.batches.step(self.step), CrossEntropy())
        rec = self.engine.optim_step(AdamParams.of_train(self.cfg.train, lr_at(self.step, self.cfg.train)))
        self.recorder.after_step(self.step)
        rec.time_s = time.perf_counter() - t0
        return rec

    # ------------------------------------------------------------------ the loop
    def finish_step(self) -> None:
        """Wait for an overlapped optimizer step: the parameters and the optimizer are then those after the last
        train_step. fit() does it itself; callers of train_step() who read them must call it."""
        self.engine.finish()

    def save(self) -> Path:
        self.watchdog.beat(f"step {self.step} checkpoint save")
        return self.engine.save(self.ckpt_dir, self.config_toml, keep=self.cfg.checkpoint.keep)

    def fit(self) -> list[dict]:
        cfg = self.cfg
        total = cfg.train.steps
        if self.step >= total:  # the same on every rank (the resume point is agreed): nothing written, non-zero exit
            self.watchdog.stop()
            self.claim.release()
            raise ShardfitError(f"nothing to train: resumed at step {self.step} ({self.resumed_from}), and "
                                f"train.steps={total}", where="train.steps", fix=f"to continue this run, "
                                f"--train.steps=N (above {self.step}) --checkpoint.allow_changes=train.steps; another "
                                "experiment gets its own directory (leave logging.run_dir empty)")
        progress = Progress(self.run_dir, total, self.step, cfg.logging.progress, self.dist.is_main,
                            cfg.logging.tensorboard, debug=cfg.logging.level == "debug",
                            config=config_to_dict(cfg))
        self.progress = progress
        for notice in self.header + self.notices:
            progress.message(notice)
        progress.message(self._banner())
        if self.preference is not None:
            self.watchdog.beat("reference log-probs (a no-grad pass over the pairs)")
            self.preference.prepare(self.engine, self.resumed_from is not None, progress.message,
                                    self.watchdog.beat)
        monitor = MemoryMonitor(cfg.memory.warn_growth_mib / 1024)
        fallbacks = FallbackNotes()  # compiled functions dynamo gave up on: each told once, as the step that met it
        history: list[dict] = []
        window = LogWindow()  # since the last log line
        signals = stop.StopSignals(self.engine).install()  # a signal stops the loop at a step boundary (stop.py)
        try:
            while self.step < total:
                with self.profiler.around(self.step + 1):
                    rec = self.train_step()
                self._tell(fallbacks, progress)
                if not history and self.dist.is_main:  # the run's record, once it has trained (never before)
                    write_atomic(self.run_dir / "config.toml", self.config_toml)
                if self.profiler.summary:
                    progress.message(self.profiler.summary)
                    self.profiler.summary = None
                history.append({k: getattr(rec, k) for k in ("step", "loss", "grad_norm", "lr", "skipped")})
                window.add(rec)
                progress.advance(self.step)
                if rec.skipped:
                    self._on_skip(rec, progress)
                halt = rec.stop and self.step < total  # at the last step the run finishes as it would
                if self.step % cfg.logging.log_every == 0 or self.step in (1, total) or halt:
                    self._log(rec, window, progress, monitor)
                    window = LogWindow(since=window.mark)  # the log line's own time counts in the next window
                if halt:
                    raise self._stop(rec, progress)
                if cfg.train.eval_every and (self.step % cfg.train.eval_every == 0 or self.step == total):
                    self.watchdog.beat(f"step {self.step} validation")
                    progress.log_eval({"step": self.step, **(
                        self.preference.evaluate(self.engine, self.watchdog.beat) if self.preference is not None
                        else self.engine.evaluate(self.batches.validation()))})
                    window.restart()
                every = cfg.checkpoint.every
                if every and self.step % every == 0 and self.step < total:
                    self.save()
                    window.restart()
            self.finish_step()
            self._tell(fallbacks, progress)  # a validation after the last step compiles too
            if history and not cfg.checkpoint.final:  # the final save checks them itself (the export follows it)
                exporting = cfg.checkpoint.export_hf or cfg.checkpoint.export_merged
                self.engine.refuse_non_finite(self.ckpt_dir, "exporting them" if exporting
                                              else "ending the run with them")
            done = [h["loss"] for h in history if not h["skipped"]]
            if done:
                progress.message(f"done: {len(history)} steps, loss {done[0]:.3f} -> {done[-1]:.3f}, "
                                 f"{self.skipped} skipped; metrics in {self.run_dir / 'metrics.jsonl'}")
            if history and cfg.checkpoint.final:
                progress.message(f"saved checkpoint {self.save()}")
            if cfg.checkpoint.export_hf:
                what = "the PEFT adapter" if cfg.lora.rank else "Hugging Face model"
                progress.message(f"exported {what} to {self.export_hf(cfg.checkpoint.export_hf)}")
            if cfg.checkpoint.export_merged:
                rounding = "" if cfg.model.quantize == "none" else \
                    f" (its base weights carry {quantized_class(cfg.model.quantize).LABEL}'s rounding, dequantised)"
                progress.message(f"exported the merged Hugging Face model to "
                                 f"{self.export_hf(cfg.checkpoint.export_merged, merged=True)}{rounding}")
            self.recorder.diagnose_last(self.dist.is_main, progress.message)
            if cfg.logging.plot and self.dist.is_main:
                progress.message(end_of_run(self.run_dir))
        except KeyboardInterrupt:  # a second Ctrl-C of a single process (stop.py): out at once, said what is lost
            raise stop.interrupted(self.step, total, self) from None
        except Exception as e:
            if self.watchdog.fired.is_set():  # the hang is already reported; a peer's exit broke the collective
                os._exit(WATCHDOG_EXIT)
            if not isinstance(e, Stopped):
                signals.die_if_stopping()
            raise
        finally:
            signals.uninstall()
            progress.close()
            self.watchdog.stop()
            self.claim.release()
        return history

    def _stop(self, rec: StepRecord, progress: Progress) -> ShardfitError:
        """Every rank read the same stop request from the step's stats: save (checkpoint.on_signal), draw the
        picture, and return the one line to raise."""
        who = "every rank" if len(rec.stop_ranks) == self.dist.world_size else \
            "rank " + ", ".join(map(str, rec.stop_ranks))
        progress.message(f"step {self.step}: {stop.name(rec.stop)} received ({who}): "
                         + ("saving a checkpoint and stopping" if self.cfg.checkpoint.on_signal else "stopping"))
        err = stop.stopped(rec.stop, self.step, self.cfg.train.steps, self, self.cfg.checkpoint.on_signal)
        if self.cfg.logging.plot and self.dist.is_main:
            progress.message(end_of_run(self.run_dir))
        return err

    def export_hf(self, out: str, merged: bool = False) -> Path:
        self.watchdog.beat(f"step {self.step} Hugging Face export")
        tokenizer = self.cfg.data.tokenizer
        path = self.engine.export_hf(out, self.cfg.checkpoint.export_dtype, tokenizer_source(tokenizer), merged,
                                     tokenizer=tokenizer)
        if self.dist.is_main:  # the chat template the model was fine-tuned with, where generate and HF tools read it
            export_template(path, self.cfg.data.chat_template)
        return path

    def _tell(self, fallbacks: FallbackNotes, progress: Progress) -> None:
        for line in fallbacks.new():
            progress.message(f"step {self.step}: {line}")

    def _on_skip(self, rec: StepRecord, progress: Progress) -> None:
        limit = self.cfg.train.max_skipped_steps
        why = "no tokens" if rec.no_tokens else (
            f"non-finite loss on rank(s) {rec.bad_ranks}" if rec.bad_ranks else "non-finite gradient norm")
        progress.message(f"step {self.step}: {why}; step skipped on all ranks ({self.skipped}/{limit} allowed)")
        if self.skipped > limit:
            path = self.save()  # parameters and optimizer are still those of the last good step
            raise TrainingHalted(f"{self.skipped} non-finite steps, more than train.max_skipped_steps={limit}; "
                                 f"saved the last good state to {path}", where=f"step {self.step}",
                                 fix="lower train.lr or check the data, then resume")

    def _log(self, rec: StepRecord, window: LogWindow, progress: Progress, monitor: MemoryMonitor) -> None:
        mem = summarize_memory(rec.memory)
        tps = window.capacity / window.seconds  # this rank's tokens per second, padding included
        world = self.dist.world_size
        progress.log({"step": self.step, "total_steps": self.cfg.train.steps, "device": self.device.type,
                      "world": world, "loss": rec.loss, "grad_norm": rec.grad_norm, "lr": rec.lr,
                      "tokens_per_s_per_gpu": tps,
                      "real_tokens_per_s_per_gpu": window.real_tokens / world / window.seconds,
                      "loss_tokens_per_s_per_gpu": window.loss_tokens / world / window.seconds,
                      "mfu": tps * self.flops_per_token / self.peak if self.peak else None,
                      "tokens_seen": self.engine.tokens_seen, "skipped_steps": self.skipped,
                      "compile_fallbacks": rec.compile_fallbacks,
                      "eta_s": progress.eta(self.step), **window.phase_means(), **mem, **rec.moe,
                      **mean_metrics(self.pref_window)})
        self.pref_window = []
        for warning in monitor.update(mem):
            progress.message(warning)
        reset_peaks(self.device)

    def _choose_micro_batch(self) -> None:
        """train.micro_batch=0: the largest micro-batch dividing this rank's batch that shardfit plan predicts to fit
        (every rank computes the same, from the config alone: no collective). Saved in the resolved config."""
        from shardfit.plan.micro_batch import auto_micro_batch

        cfg = self.cfg
        per_rank = accumulation_steps(cfg.train.global_batch, 1, self.dp_size)  # sequences per rank per step
        if self.device.type != "cuda":
            cfg.train.micro_batch = per_rank
            self.notices.append(f"train.micro_batch=0 on the CPU: {per_rank} (no accumulation)")
        else:
            e, notice = auto_micro_batch(cfg, self.dist.world_size, device_memory_bytes(cfg, self.device), per_rank)
            cfg.train.micro_batch = e.micro_batch
            self.notices.append(notice)
        self.config_toml = config_to_toml(cfg)

    def _banner(self) -> str:
        c, d = self.cfg, self.dist
        where = f"{d.world_size} x {self.device.type}" + (f" ({torch.cuda.get_device_name(self.device)})"
                                                          if self.device.type == "cuda" else "")
        resumed = f", resumed from {self.resumed_from}" if self.resumed_from else ""
        resumed += f", Ulysses sequence parallel over {self.sp} ranks" if self.sp > 1 else ""
        shape = StepShape.of(c)
        batch = shape.describe(self.accum)
        masked = (f", document-masked attention ({self.batches.kernel})"
                  if c.data.document_mask or shape.by_tokens else "")
        return (f"shardfit: {c.model.name} model, {self.engine.n_params / 1e6:.1f}M params, {where}, "
                f"{self.dataset.n_tokens:,} tokens of data, {batch}, loss kernel {self.model.loss_impl}{masked}, "
                f"run dir {self.run_dir}{resumed}")
