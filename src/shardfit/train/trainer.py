"""The training loop.

Collectives of one optimizer step, identical on every rank and in this order:
  FSDP's own all-gathers and reduce-scatters (gradients reduced after every micro-batch, or with
  parallel.reduce_every_micro_batch=false after the last one only), and with sequence parallelism the attention
  all-to-alls (the same on every rank of a group, in forward, recompute and backward),
  then exactly one all-gather of a small stats vector per rank, after all micro-batches,
  (every train.eval_every steps: the validation forwards, the same count on every rank, and one all-gather of their
  summed loss and token count),
  and with tensorwise FP8 all-gather, after an applied optimizer update, one all-reduce of the weights' amaxes (the
  next step's FP8 scales; every rank takes the same branch, decided by the stats collective).
That one collective carries each rank's local squared gradient norm, summed loss, token count, a non-finite flag,
its real (non-padding) token count and its memory figures. From it every rank derives the same global token count,
gradient norm, skip decision and metrics, so no rank can take a different branch. It is also the step's only
host-device sync.

Loss scaling: each micro-batch backpropagates (summed token loss) / C, with C = this rank's token capacity per step
(a Python number from the micro-batches' shapes: the same on every rank, since every rank runs the same number of
micro-batches of the same shape), and FSDP averages over ranks. After the stats collective the gradients are
scaled by world x C / N (N = valid tokens of the whole global batch) and by the clip coefficient: the result is
exactly the gradient of the mean loss over the global batch, whatever the per-rank token counts. The fused AdamW
(CUDA, and the CPU step of parallel.offload=all, whose gradients are host tensors and, for the blocks
parallel.offload_gpu_blocks keeps on the GPU, device ones) takes that factor as its grad_scale and divides each
gradient by it as it reads it; the foreach AdamW of CPU training gets the gradients multiplied in one pass first.
"""

from __future__ import annotations

import math
import os
import time
import weakref
from pathlib import Path

import torch

from shardfit.config import Config, accumulation_steps, config_to_toml
from shardfit.data.packing import build_datasets
from shardfit.errors import ShardfitError
from shardfit.fsutil import write_atomic
from shardfit.memory import MemoryMonitor
from shardfit.memory.record import SnapshotRecorder
from shardfit.models import build_model, count_params
from shardfit.models.loss import liger_available
from shardfit.parallel import all_gather_rows, init_distributed, parallelize
from shardfit.parallel.fp8 import fp8_notice, gathers_in_fp8, refresh_fp8_scales
from shardfit.parallel.layout import check_layout
from shardfit.parallel.offload import OverlappedStep, grad_sq_norm
from shardfit.parallel.step_overlap import StreamOverlappedStep, local_tensor, zero_grads
from shardfit.train.batches import BatchSource
from shardfit.train.checkpoint import (
    agree_on_resume,
    load_checkpoint,
    new_run_id,
    refuse_non_finite,
    save_checkpoint,
)
from shardfit.train.evaluate import evaluate
from shardfit.train.metrics import (
    MEMORY_FIELDS,
    ExpertLoad,
    LogWindow,
    flops_per_token,
    memory_vector,
    peak_flops,
    reset_peaks,
    summarize_memory,
)
from shardfit.train.optim import build_optimizer, lr_at, set_lr
from shardfit.train.profile import StepProfiler
from shardfit.train.progress import Progress
from shardfit.train.run_dir import RunClaim, check_no_overwrite
from shardfit.train.timing import StepTimer
from shardfit.train.watchdog import EXIT_CODE as WATCHDOG_EXIT
from shardfit.train.watchdog import Watchdog

_STAT_SQNORM, _STAT_LOSS, _STAT_TOKENS, _STAT_NONFINITE, _STAT_REAL, _STAT_MEM = 0, 1, 2, 3, 4, 5


class TrainingHalted(ShardfitError):
    """Training stopped on purpose (too many non-finite steps); a checkpoint of the last good state was saved."""

    exit_code = 3


class OutOfMemory(ShardfitError):
    """A CUDA OOM on this rank: the snapshot is dumped and the doctor's verdict is in the message."""

    exit_code = 4


def apply_alloc_conf(alloc_conf: str) -> None:
    """Default allocator settings for CUDA runs; must happen before the first CUDA allocation. The user's own
    PYTORCH_CUDA_ALLOC_CONF always wins."""
    if alloc_conf and "PYTORCH_CUDA_ALLOC_CONF" not in os.environ:
        os.environ["PYTORCH_CUDA_ALLOC_CONF"] = alloc_conf


def choose_loss_kernel(kind: str, device: torch.device) -> str:
    if kind == "liger" and (device.type != "cuda" or not liger_available()):
        raise ShardfitError("parallel.kernels=liger needs CUDA and the liger-kernel package",
                            where="parallel.kernels", fix="pip install 'shardfit[liger]' on a GPU machine, or use auto")
    if kind == "auto":
        return "liger" if device.type == "cuda" and liger_available() else "torch"
    return kind


class Trainer:
    def __init__(self, cfg: Config):
        self.cfg = cfg
        apply_alloc_conf(cfg.memory.alloc_conf)
        self.dist = init_distributed(cfg.train.device)
        self.device = self.dist.device
        if self.device.type == "cuda" and cfg.memory.max_fraction:
            torch.cuda.set_per_process_memory_fraction(min(cfg.memory.max_fraction, 1.0), self.device)
        self.run_dir = Path(cfg.logging.run_dir or f"runs/{cfg.model.name}")
        self.ckpt_dir = Path(cfg.checkpoint.dir) if cfg.checkpoint.dir else self.run_dir / "checkpoints"
        self.config_toml = config_to_toml(cfg)
        # Nothing is written until fit(): a bad dataset or checkpoint found here leaves no half-made run directory.
        # The watchdog starts now: loading a checkpoint issues collectives too.
        self.watchdog = Watchdog(cfg.train.watchdog_s, self.dist.rank, self.run_dir)
        self.watchdog.beat("start-up (data, model, checkpoint)")
        try:
            # Locked, writable, no export target to clobber: checked before anything the run could lose.
            self.claim = RunClaim(self.run_dir, self.ckpt_dir, cfg.checkpoint.export_hf, self.dist.rank, self.device)
            weakref.finalize(self, self.claim.release)  # a Trainer dropped without fit() frees its directories
            self._set_up(cfg)
        except BaseException:
            self.watchdog.stop()  # a failed start-up leaves no thread behind
            if hasattr(self, "claim"):
                self.claim.release(failed=True)
            raise

    def _set_up(self, cfg: Config) -> None:
        """Data, sequence-parallel layout, model (sharded, initialised or loaded), optimizer, checkpoint resume."""
        self.dataset, self.val_set, self.tokenizer = build_datasets(cfg.data, cfg.model.vocab_size,
                                                                    token_budget=cfg.train.micro_batch_tokens > 0)
        # Ulysses: ranks r with the same r // sp share every sample and take S/sp of its tokens each; the batch is
        # split over the world // sp data-parallel ranks.
        self.sp = cfg.parallel.sequence_parallel
        check_layout(cfg, self.dist.world_size)
        self.dp_rank, self.sp_rank = divmod(self.dist.rank, self.sp)
        self.dp_size = self.dist.world_size // self.sp
        self.notices: list[str] = list(self.dataset.notices)  # printed by rank 0 when fit() starts
        if cfg.train.micro_batch_tokens:
            self.accum = None  # micro-batches per step follow from the step's lengths (data/batching.py)
        else:
            if cfg.train.micro_batch == 0:
                self._choose_micro_batch()
            self.accum = accumulation_steps(cfg.train.global_batch, cfg.train.micro_batch, self.dp_size)
        self.batches = BatchSource(cfg, self.dataset, self.val_set, self.dp_rank, self.dp_size, self.sp_rank,
                                   self.sp, self.device)
        if self.batches.describe():
            self.notices.append(self.batches.describe())

        with torch.device("meta"):
            model = build_model(cfg.model, loss_chunk=cfg.parallel.loss_chunk)
        model.loss_impl = choose_loss_kernel(cfg.parallel.kernels, self.device)
        if self.device.type == "cuda" and cfg.parallel.numa_bind:
            from shardfit.parallel.affinity import bind_to_numa_node, gpu_pci_bus_id

            self.notices.append(f"rank {self.dist.rank}: " + bind_to_numa_node(gpu_pci_bus_id(self.device.index)))
        resume = agree_on_resume(cfg.checkpoint.resume, self.ckpt_dir, self.notices, self.device)
        check_no_overwrite(self.ckpt_dir, resume, self.dist.rank, self.device, self.notices)
        from_hf = bool(cfg.model.path) and resume is None  # a resumed run takes its weights from the checkpoint
        self.model = parallelize(model, cfg.parallel, self.device, self.dist.world_size, cfg.train.seed,
                                 init=not from_hf)
        if cfg.parallel.fp8 != "none":
            self.notices.append(fp8_notice(cfg.parallel, self.model.fp8_layers, self.device.type))
        self.expert_load = ExpertLoad(self.model, self.device, cfg.model.router_bias_rate)
        # parallel.offload=all: shards, gradients and Adam states are host tensors (parallel/offload.py)
        self.offload = cfg.parallel.offload == "all"
        if self.model.offload_notice:
            self.notices.append(self.model.offload_notice)
        if self.offload and self.accum != 1:
            self.notices.append("parallel.offload=all with several micro-batches per step: FSDP2 copies the gradients "
                                "of every micro-batch after the first to the host synchronously and adds them on the "
                                "CPU inside backward; one larger micro-batch (full checkpointing lets it grow) is "
                                "faster (parallel/offload.py)")
        if from_hf:
            from shardfit.hf.load import load_hf_checkpoint, load_report

            t0 = time.perf_counter()
            loaded = load_hf_checkpoint(self.model, cfg.model.path)
            self.notices.append(load_report(cfg.model.path, time.perf_counter() - t0, loaded, self.device))
        self.timer = StepTimer(self.device, cfg.logging.step_timing)
        self.timer.watch_fsdp_waits([*self.model.model.layers, self.model.model.embed_tokens, self.model.lm_head,
                                     self.model])
        self.progress: Progress | None = None  # made by fit()
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.n_params = count_params(self.model)
        self.optimizer = build_optimizer(self.model, cfg.train, self.device, cfg.parallel.offload)

        self.step, self.skipped, self.tokens_seen = 0, 0, 0
        self.resumed_from, self.run_id = None, new_run_id()  # the run id follows a run across resumes (pruning)
        if resume is not None:
            state = load_checkpoint(resume, self.model, self.optimizer, self.device)
            self.step, self.skipped = state["step"], state.get("skipped", 0)
            self.tokens_seen = state.get("tokens_seen", 0)
            self.resumed_from, self.run_id = resume, state.get("run_id") or self.run_id
        refresh_fp8_scales(self.model, cfg.parallel)  # FP8 scales of the weights in place: initialised, loaded, resumed
        # offload=all: the CPU step runs group by group under the next forward (parallel/offload.py);
        # SHARDFIT_OFFLOAD_OVERLAP=0 runs it in place instead (the same results, bit for bit; for measurements).
        self.overlap = None
        if self.offload and os.environ.get("SHARDFIT_OFFLOAD_OVERLAP", "1") != "0":
            self.overlap = OverlappedStep(self.model, self.optimizer, list(self.model.model.layers),
                                          cfg.parallel.prefetch, self.device)
        elif cfg.parallel.overlap_optimizer:
            # the GPU step on a side stream, each group under the next forward (parallel/step_overlap.py)
            self.overlap = StreamOverlappedStep(self.model, self.optimizer, list(self.model.model.layers),
                                                cfg.parallel.prefetch, cfg.memory.keep_grads, self.device)

        seq = cfg.data.seq_len
        self.capacity = 0  # C: this rank's tokens of the current step (set by _forward_backward)
        self.flops_per_token = flops_per_token(cfg.model, self.n_params, seq)
        self.peak = peak_flops(self.device, cfg.logging.peak_tflops)
        self.recorder = SnapshotRecorder(cfg.memory.snapshot_steps, self.run_dir / "snapshots", self.dist.rank,
                                         self.device, cfg.memory.snapshot_max_entries)
        self.profiler = StepProfiler(cfg.logging.profile_step, self.run_dir / "profile", self.dist.is_main,
                                     self.device)

    # ------------------------------------------------------------------ one step
    def _forward_backward(self) -> tuple[torch.Tensor, int, float]:
        batches = self.batches.step(self.step)
        # The same on every rank: the same number of micro-batches, of the same shapes (train/batches.py).
        self.capacity = sum(b.capacity for b in batches)
        tokens = sum(b.loss_tokens for b in batches)  # counted on the host: no sync
        real = sum(b.real_tokens for b in batches)
        loss_sum = torch.zeros((), dtype=torch.float32, device=self.device)
        for i, b in enumerate(batches):
            ids, labels, positions = b.input_ids, b.labels, b.position_ids
            self.watchdog.beat(f"step {self.step + 1} micro-batch {i + 1}/{len(batches)} (forward/backward)")
            if self.progress is not None:
                self.progress.micro_batch(self.step + 1, i, len(batches))
            # Default: reduce-scatter after every micro-batch (FSDP adds each into the sharded gradient). Deferring
            # it to the last micro-batch keeps unsharded fp32 gradients of the whole model on every GPU in between.
            self.model.set_requires_gradient_sync(self.cfg.parallel.reduce_every_micro_batch or i == len(batches) - 1)
            ids = ids.to(self.device, non_blocking=True)
            labels = labels.to(self.device, non_blocking=True)
            if positions is not None:
                positions = positions.to(self.device, non_blocking=True)
            self.timer.start("forward")
            loss = self.model(ids, labels, positions, b.mask)  # summed token loss, fp32 scalar
            self.timer.stop("forward")
            self.timer.start("backward")
            if self.overlap is not None:
                self.overlap.wait()  # backward writes new gradients: the last step must be done (it is: see offload)
            (loss / self.capacity).backward()
            self.timer.stop("backward")
            loss_sum += loss.detach()
            self.expert_load.add_micro_batch()
        return loss_sum, tokens, real

    def _reduce_step(self, loss_sum: torch.Tensor, tokens: int, real: float) -> torch.Tensor:
        """The step's single collective: stats of every rank, [world, k], on the host."""
        self.watchdog.beat(f"step {self.step + 1} stats collective (after all micro-batches)")
        # offload=all: host gradients, and with offload_gpu_blocks device ones too: a norm per device, where they are
        sq = grad_sq_norm([local_tensor(p.grad) for p in self.params if p.grad is not None], self.device)
        head = torch.stack([sq, loss_sum.double(), torch.tensor(float(tokens), dtype=torch.float64, device=self.device),
                            (~torch.isfinite(loss_sum)).double(),
                            torch.tensor(float(real), dtype=torch.float64, device=self.device)])
        mem = torch.tensor(memory_vector(self.device), dtype=torch.float64, device=self.device)
        moe = self.expert_load.take()  # [L*E] rows per expert (MoE models; empty otherwise)
        return all_gather_rows(torch.cat([head, mem, moe])).cpu()  # the one host-device sync of the step

    def _on_oom(self, err: BaseException) -> None:
        """Dump this rank's snapshot, diagnose it, and stop with one clear message. Peers blocked in a collective
        with this rank are released when it exits (torchrun tears the job down; NCCL aborts its communicators)."""
        step = self.step + 1
        path = self.recorder.dump_oom(step)
        verdict = ""
        if path is not None:
            from shardfit.memory import examine
            from shardfit.memory.report import verdict as one_line

            try:
                verdict = "; doctor: " + one_line(examine([str(path)])[1])
            except ShardfitError:
                verdict = ""
        first = str(err).splitlines()[0] if str(err) else "CUDA out of memory"
        raise OutOfMemory(f"rank {self.dist.rank} ran out of GPU memory in step {step} ({first})"
                          + (f"; snapshot {path}" if path else "") + verdict, where=f"step {step}",
                          fix="lower train.micro_batch or data.seq_len, or set parallel.activation_checkpoint")

    def train_step(self) -> dict:
        t0 = time.perf_counter()
        self.recorder.before_step(self.step + 1)
        try:
            loss_sum, tokens, real = self._forward_backward()
        except torch.OutOfMemoryError as err:
            self._on_oom(err)
        rows = self._reduce_step(loss_sum, tokens, real)
        # Everything recorded so far (this step's passes, the previous step's optimizer) finished before that sync.
        timings = self.timer.collect()
        world = self.dist.world_size
        n_tokens = float(rows[:, _STAT_TOKENS].sum())
        bad_ranks = [r for r in range(world) if rows[r, _STAT_NONFINITE] > 0]
        scale = world * self.capacity / n_tokens if n_tokens > 0 else math.nan
        # HSDP: the R replica groups hold the same shards, so the squared norm is summed over one group's ranks
        # (the first world/R: parallel/parallelize.py lays the shard groups out as neighbouring ranks).
        one_replica = world // self.cfg.parallel.replicate
        grad_norm = math.sqrt(float(rows[:one_replica, _STAT_SQNORM].sum())) * scale
        loss = float(rows[:, _STAT_LOSS].sum()) / n_tokens if n_tokens > 0 else math.nan
        lr = lr_at(self.step, self.cfg.train)
        # Every rank reads the same rows, so every rank takes the same branch.
        ok = n_tokens > 0 and not bad_ranks and math.isfinite(grad_norm)
        self.timer.start("optimizer")
        if ok:
            clip = self.cfg.train.grad_clip
            coef = min(1.0, clip / (grad_norm + 1e-6)) if clip > 0 else 1.0
            set_lr(self.optimizer, lr)
            if self.optimizer.defaults.get("fused"):
                # The step is memory-bound: fused AdamW divides each gradient by grad_scale as it reads it, so the
                # scale costs no pass of its own over the gradients (measured: 20% of the CPU step under offload;
                # on the GPU a read and write of every fp32 gradient shard, ~7 ms at 4B parameters per rank). Under
                # offload lr and grad_scale are read by the worker until the next forward has waited for it; they
                # change only after that. The host tensor serves both devices (fused AdamW copies it per device).
                where = "cpu" if self.offload else self.device
                self.optimizer.grad_scale = torch.tensor(1.0 / (scale * coef), dtype=torch.float32, device=where)
            else:
                torch._foreach_mul_([local_tensor(p.grad) for p in self.params if p.grad is not None], scale * coef)
            if self.overlap is not None:
                self.overlap.launch()  # takes the gradients; the worker frees them group by group
            else:
                self.optimizer.step()
            if gathers_in_fp8(self.cfg.parallel) and self.overlap is not None:
                self.overlap.wait()  # the FP8 scales are read from the updated weights, all of them, now
            refresh_fp8_scales(self.model, self.cfg.parallel)
        else:
            self.skipped += 1
        # keep_grads: zeroed, not freed (see memory.keep_grads: freed sharded gradients become another stream's idle
        # cache); FSDP then adds each step's reduce-scatter output into them, in that stream. With offload the
        # gradients are host tensors and always freed: a kept one makes FSDP copy each reduce-scatter output to the
        # host synchronously and add it on the CPU inside backward (the host thread then stalls once per group,
        # the GPU waiting for its next kernels); the reduce-scatter pool keep_grads is about holds no gradients then.
        # A launched overlapped step owns the gradients (already taken out of the parameters): not touched here.
        if not (ok and self.overlap is not None):
            zero_grads(self.optimizer, keep=self.cfg.memory.keep_grads and not self.offload)
        self.timer.stop("optimizer")
        self.step += 1
        self.recorder.after_step(self.step)
        self.tokens_seen += int(n_tokens)
        return {"step": self.step, "loss": loss, "grad_norm": grad_norm, "lr": lr, "skipped": not ok,
                "bad_ranks": bad_ranks, "no_tokens": n_tokens == 0, "time_s": time.perf_counter() - t0,
                "phases": timings, "capacity": self.capacity, "loss_tokens": n_tokens,
                "real_tokens": float(rows[:, _STAT_REAL].sum()),
                "memory": rows[:, _STAT_MEM:_STAT_MEM + len(MEMORY_FIELDS)],
                "moe": self.expert_load.finish_step(rows[:, _STAT_MEM + len(MEMORY_FIELDS):], ok)}

    # ------------------------------------------------------------------ the loop
    def finish_step(self) -> None:
        """Wait for an overlapped CPU optimizer step (offload=all): the parameters and the optimizer are then those
        after the last train_step. fit() does it itself; callers of train_step() who read them must call it."""
        if self.overlap is not None:
            self.overlap.wait()

    def save(self) -> Path:
        self.watchdog.beat(f"step {self.step} checkpoint save")
        self.finish_step()
        return save_checkpoint(self.ckpt_dir, self.step, self.model, self.optimizer,
                               {"skipped": self.skipped, "tokens_seen": self.tokens_seen, "run_id": self.run_id},
                               self.config_toml,
                               self.device, keep=self.cfg.checkpoint.keep)

    def fit(self) -> list[dict]:
        cfg = self.cfg
        total = cfg.train.steps
        if self.dist.is_main:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            write_atomic(self.run_dir / "config.toml", self.config_toml)
        progress = Progress(self.run_dir, total, self.step, cfg.logging.progress, self.dist.is_main,
                            cfg.logging.tensorboard, debug=cfg.logging.level == "debug")
        self.progress = progress
        for notice in self.notices:
            progress.message(notice)
        progress.message(self._banner())
        monitor = MemoryMonitor(cfg.memory.warn_growth_mib / 1024)
        history: list[dict] = []
        window = LogWindow()  # since the last log line
        try:
            while self.step < total:
                with self.profiler.around(self.step + 1):
                    rec = self.train_step()
                if self.profiler.summary:
                    progress.message(self.profiler.summary)
                    self.profiler.summary = None
                history.append({k: rec[k] for k in ("step", "loss", "grad_norm", "lr", "skipped")})
                window.add(rec)
                progress.advance(self.step)
                if rec["skipped"]:
                    self._on_skip(rec, progress)
                if self.step % cfg.logging.log_every == 0 or self.step in (1, total):
                    self._log(rec, window, progress, monitor)
                    window = LogWindow()
                if cfg.train.eval_every and (self.step % cfg.train.eval_every == 0 or self.step == total):
                    self.watchdog.beat(f"step {self.step} validation")
                    progress.log_eval({"step": self.step, **evaluate(self.model, self.batches.validation(),
                                                                     self.device)})
                every = cfg.checkpoint.every
                if every and self.step % every == 0 and self.step < total:
                    self.save()
            self.finish_step()
            if history:  # a run that ends on non-finite weights is no success, saved or not
                refuse_non_finite(self.model, self.device, self.step, self.ckpt_dir, "saving or exporting them")
            done = [h["loss"] for h in history if not h["skipped"]]
            if done:
                progress.message(f"done: {len(history)} steps, loss {done[0]:.3f} -> {done[-1]:.3f}, "
                                 f"{self.skipped} skipped; metrics in {self.run_dir / 'metrics.jsonl'}")
            if history and cfg.checkpoint.final:
                progress.message(f"saved checkpoint {self.save()}")
            if cfg.checkpoint.export_hf:
                progress.message(f"exported Hugging Face model to {self.export_hf(cfg.checkpoint.export_hf)}")
            self.recorder.diagnose_last(self.dist.is_main, progress.message)
        except Exception:
            if self.watchdog.fired.is_set():  # the hang is already reported; a peer's exit broke the collective
                os._exit(WATCHDOG_EXIT)
            raise
        finally:
            progress.close()
            self.watchdog.stop()
            self.claim.release()
        return history

    def export_hf(self, out: str) -> Path:
        from shardfit.hf import export_hf

        self.watchdog.beat(f"step {self.step} Hugging Face export")
        self.finish_step()
        source = self.cfg.model.path or (str(Path(self.cfg.data.tokenizer).parent)
                                         if self.cfg.data.tokenizer != "byte" else None)
        export_hf(self.model, out, self.cfg.checkpoint.export_dtype, source)
        return Path(out)

    def _on_skip(self, rec: dict, progress: Progress) -> None:
        limit = self.cfg.train.max_skipped_steps
        why = "no tokens" if rec["no_tokens"] else (
            f"non-finite loss on rank(s) {rec['bad_ranks']}" if rec["bad_ranks"] else "non-finite gradient norm")
        progress.message(f"step {self.step}: {why}; step skipped on all ranks ({self.skipped}/{limit} allowed)")
        if self.skipped > limit:
            path = self.save()  # parameters and optimizer are still those of the last good step
            raise TrainingHalted(f"{self.skipped} non-finite steps, more than train.max_skipped_steps={limit}; "
                                 f"saved the last good state to {path}", where=f"step {self.step}",
                                 fix="lower train.lr or check the data, then resume")

    def _log(self, rec: dict, window: LogWindow, progress: Progress, monitor: MemoryMonitor) -> None:
        mem = summarize_memory(rec["memory"])
        tps = window.capacity / window.seconds  # this rank's tokens per second, padding included
        world = self.dist.world_size
        progress.log({"step": self.step, "total_steps": self.cfg.train.steps, "device": self.device.type,
                      "loss": rec["loss"], "grad_norm": rec["grad_norm"], "lr": rec["lr"],
                      "tokens_per_s_per_gpu": tps,
                      "real_tokens_per_s_per_gpu": window.real_tokens / world / window.seconds,
                      "loss_tokens_per_s_per_gpu": window.loss_tokens / world / window.seconds,
                      "mfu": tps * self.flops_per_token / self.peak if self.peak else None,
                      "tokens_seen": self.tokens_seen, "skipped_steps": self.skipped,
                      "eta_s": progress.eta(self.step), **window.phase_means(), **mem, **rec["moe"]})
        for warning in monitor.update(mem):
            progress.message(warning)
        reset_peaks(self.device)

    def _choose_micro_batch(self) -> None:
        """train.micro_batch=0: the largest micro-batch dividing this rank's batch that shardfit plan predicts to fit
        (every rank computes the same, from the config alone: no collective). Saved in the resolved config."""
        from shardfit.memory.plan import auto_micro_batch

        cfg = self.cfg
        per_rank = accumulation_steps(cfg.train.global_batch, 1, self.dp_size)  # sequences per rank per step
        if self.device.type != "cuda":
            cfg.train.micro_batch = per_rank
            self.notices.append(f"train.micro_batch=0 on the CPU: {per_rank} (no accumulation)")
        else:
            total = torch.cuda.get_device_properties(self.device).total_memory * (cfg.memory.max_fraction or 1.0)
            e, notice = auto_micro_batch(cfg, self.dist.world_size, total, per_rank)
            cfg.train.micro_batch = e.micro_batch
            self.notices.append(notice)
        self.config_toml = config_to_toml(cfg)

    def _banner(self) -> str:
        c, d = self.cfg, self.dist
        where = f"{d.world_size} x {self.device.type}" + (f" ({torch.cuda.get_device_name(self.device)})"
                                                          if self.device.type == "cuda" else "")
        resumed = f", resumed from {self.resumed_from}" if self.resumed_from else ""
        resumed += f", Ulysses sequence parallel over {self.sp} ranks" if self.sp > 1 else ""
        if c.train.micro_batch_tokens:
            batch = (f"global batch {c.train.global_batch} items in micro-batches of {c.train.micro_batch_tokens:,} "
                     f"tokens")
        else:
            batch = (f"global batch {c.train.global_batch} x {c.data.seq_len} = "
                     f"{c.train.global_batch * c.data.seq_len:,} tokens (micro-batch {c.train.micro_batch}, "
                     f"accumulation {self.accum})")
        masked = (f", document-masked attention ({self.batches.kernel})"
                  if c.data.document_mask or c.train.micro_batch_tokens else "")
        return (f"shardfit: {c.model.name} model, {self.n_params / 1e6:.1f}M params, {where}, "
                f"{self.dataset.n_tokens:,} tokens of data, {batch}, loss kernel {self.model.loss_impl}{masked}, "
                f"run dir {self.run_dir}{resumed}")
