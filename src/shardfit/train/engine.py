"""The one step implementation: model, optimizer and step runner; `forward_backward` then `optim_step`.

Collectives of one step, identical on every rank and in this order: FSDP's own all-gathers and reduce-scatters
(gradients reduced after every micro-batch, or with parallel.reduce_every_micro_batch=false after the last one),
with sequence parallelism the attention all-to-alls, with expert parallelism the MoE exchanges; then exactly one
all-gather of a small stats vector per rank, after all micro-batches (forward_backward's last act, and the step's
only host-device sync); with tensorwise FP8 all-gather, after an applied update, one all-reduce of the weights'
amaxes. Every rank derives the same token count, gradient norm and skip decision from the stats rows.

Loss scaling: each micro-batch backpropagates (summed token loss) / C, C = this rank's token capacity per step (the
same on every rank: same micro-batch count and shapes), and FSDP averages over ranks. optim_step scales the
gradients by world x C / N (N = loss tokens of the global batch) and the clip coefficient: exactly the gradient of
the mean token loss over the global batch. Fused AdamW takes that factor as grad_scale (no pass of its own); the
foreach AdamW of CPU runs gets the gradients multiplied first.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from shardfit.config import Config
from shardfit.errors import ShardfitError
from shardfit.models import build_model, count_params
from shardfit.models.loss import liger_available
from shardfit.parallel import DistInfo, all_gather_rows, parallelize
from shardfit.parallel.fp8 import fp8_notice, gathers_in_fp8, refresh_fp8_scales
from shardfit.parallel.offload import grad_sq_norm
from shardfit.parallel.step_overlap import local_tensor
from shardfit.parallel.step_runner import build_step_runner
from shardfit.train.batches import LocalBatch
from shardfit.train.checkpoint import load_checkpoint, new_run_id, refuse_non_finite, save_checkpoint
from shardfit.train.evaluate import evaluate
from shardfit.train.metrics import MEMORY_FIELDS, ExpertLoad, memory_vector
from shardfit.train.optim import build_optimizer, set_lr
from shardfit.train.timing import StepTimer

_SQNORM, _LOSS, _TOKENS, _NONFINITE, _REAL, _MEM = 0, 1, 2, 3, 4, 5


def choose_loss_kernel(kind: str, device: torch.device) -> str:
    if kind == "liger" and (device.type != "cuda" or not liger_available()):
        raise ShardfitError("parallel.kernels=liger needs CUDA and the liger-kernel package",
                            where="parallel.kernels", fix="pip install 'shardfit[liger]' on a GPU machine, or use auto")
    if kind == "auto":
        return "liger" if device.type == "cuda" and liger_available() else "torch"
    return kind


@dataclass
class StepStats:
    """forward_backward's result, the same on every rank (from the one stats collective)."""

    rows: torch.Tensor  # [world, k] on the host: each rank's squared norm, loss, tokens, flags, memory, expert load
    capacity: int  # C: this rank's tokens of the step, padding included
    phases: dict[str, float] = field(default_factory=dict)  # seconds per phase (train.timing), rank 0's view


@dataclass
class StepRecord:
    """What one optimizer step did (optim_step's result): the figures a log line or a caller needs."""

    step: int
    loss: float  # mean token loss over the global batch
    grad_norm: float
    lr: float
    skipped: bool
    bad_ranks: list[int]  # ranks whose loss was not finite
    no_tokens: bool
    capacity: int
    loss_tokens: float  # of the world
    real_tokens: float  # of the world, padding excluded
    memory: torch.Tensor  # [world, len(MEMORY_FIELDS)]
    moe: dict
    phases: dict[str, float]
    time_s: float = 0.0


class Engine:
    """Builds the sharded model (initialised, or loaded from `cfg.model.path` or the checkpoint `resume`), its
    optimizer and step runner, and runs steps fed from anywhere: the trainer's data loader, or a server."""

    def __init__(self, cfg: Config, dist: DistInfo, resume: Path | None = None, notices: list[str] | None = None):
        self.cfg, self.dist, self.device = cfg, dist, dist.device
        self.notices = notices if notices is not None else []
        # called with (step, i, count) before micro-batch i, and with i = count before the stats collective:
        # progress display and the watchdog's beat
        self.on_micro_batch: Callable[[int, int, int], None] | None = None
        with torch.device("meta"):
            model = build_model(cfg.model, loss_chunk=cfg.parallel.loss_chunk)
        model.loss_impl = choose_loss_kernel(cfg.parallel.kernels, self.device)
        if self.device.type == "cuda" and cfg.parallel.numa_bind:
            from shardfit.parallel.affinity import bind_to_numa_node, gpu_pci_bus_id

            self.notices.append(f"rank {dist.rank}: " + bind_to_numa_node(gpu_pci_bus_id(self.device.index)))
        from_hf = bool(cfg.model.path) and resume is None  # a resumed run takes its weights from the checkpoint
        self.parallel = parallelize(model, cfg.parallel, self.device, dist.world_size, cfg.train.seed,
                                    init=not from_hf)
        self.model, self.layout = model, self.parallel.layout
        if cfg.parallel.fp8 != "none":
            self.notices.append(fp8_notice(cfg.parallel, self.parallel.fp8_layers, self.device.type))
        self.expert_load = ExpertLoad(self.model, self.device, cfg.model.router_bias_rate)
        if self.parallel.offload_notice:
            self.notices.append(self.parallel.offload_notice)
        if from_hf:
            from shardfit.hf.load import load_hf_checkpoint, load_report

            t0 = time.perf_counter()
            loaded = load_hf_checkpoint(self.model, cfg.model.path)
            self.notices.append(load_report(cfg.model.path, time.perf_counter() - t0, loaded, self.device))
        self.timer = StepTimer(self.device, cfg.logging.step_timing)
        self.timer.watch_fsdp_waits([*self.model.model.layers, self.model.model.embed_tokens, self.model.lm_head,
                                     self.model])
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.n_params = count_params(self.model)
        self.optimizer = build_optimizer(self.model, cfg.train, self.device, cfg.parallel.offload)
        self.step, self.skipped, self.tokens_seen = 0, 0, 0
        self.run_id = new_run_id()  # follows the run across resumes: checkpoint.keep prunes only its own
        if resume is not None:
            state = load_checkpoint(resume, self.model, self.optimizer, self.device)
            self.step, self.skipped = state["step"], state.get("skipped", 0)
            self.tokens_seen = state.get("tokens_seen", 0)
            self.run_id = state.get("run_id") or self.run_id
        refresh_fp8_scales(self.model, cfg.parallel)  # FP8 scales of the weights in place: initialised, loaded, resumed
        self.runner = build_step_runner(cfg, self.model, self.optimizer, self.device)

    # ------------------------------------------------------------------ one step
    def forward_backward(self, batches: list[LocalBatch]) -> StepStats:
        """Accumulate the gradients of these micro-batches (this rank's part of the step), then the step's one
        stats collective. Every rank passes the same number of micro-batches of the same shapes."""
        capacity = sum(b.capacity for b in batches)
        tokens = sum(b.loss_tokens for b in batches)  # counted on the host: no sync
        real = sum(b.real_tokens for b in batches)
        loss_sum = torch.zeros((), dtype=torch.float32, device=self.device)
        for i, b in enumerate(batches):
            if self.on_micro_batch is not None:
                self.on_micro_batch(self.step + 1, i, len(batches))
            # Default: reduce-scatter after every micro-batch (FSDP adds each into the sharded gradient). Deferring
            # it to the last micro-batch keeps unsharded fp32 gradients of the whole model on every GPU in between.
            self.model.set_requires_gradient_sync(self.cfg.parallel.reduce_every_micro_batch or i == len(batches) - 1)
            ids = b.input_ids.to(self.device, non_blocking=True)
            labels = b.labels.to(self.device, non_blocking=True)
            positions = b.position_ids.to(self.device, non_blocking=True) if b.position_ids is not None else None
            self.timer.start("forward")
            loss = self.model(ids, labels, positions, b.mask)  # summed token loss, fp32 scalar
            self.timer.stop("forward")
            self.timer.start("backward")
            self.runner.wait()  # backward writes new gradients: the last step must be done (it is: see offload)
            (loss / capacity).backward()
            self.timer.stop("backward")
            loss_sum += loss.detach()
            self.expert_load.add_micro_batch()
        if self.on_micro_batch is not None:
            self.on_micro_batch(self.step + 1, len(batches), len(batches))  # all done: the stats collective next
        rows = self._reduce(loss_sum, tokens, real)
        # Everything recorded so far (this step's passes, the previous step's optimizer) finished before that sync.
        return StepStats(rows, capacity, self.timer.collect())

    def _reduce(self, loss_sum: torch.Tensor, tokens: int, real: float) -> torch.Tensor:
        """The step's single collective: stats of every rank, [world, k], on the host."""
        # offload=all: host gradients, and with offload_gpu_blocks device ones too: a norm per device, where they are
        sq = grad_sq_norm([local_tensor(p.grad) for p in self.params if p.grad is not None], self.device)
        f64 = {"dtype": torch.float64, "device": self.device}
        head = torch.stack([sq, loss_sum.double(), torch.tensor(float(tokens), **f64),
                            (~torch.isfinite(loss_sum)).double(), torch.tensor(float(real), **f64)])
        mem = torch.tensor(memory_vector(self.device), **f64)
        moe = self.expert_load.take()  # [L*E] rows per expert (MoE models; empty otherwise)
        return all_gather_rows(torch.cat([head, mem, moe])).cpu()  # the one host-device sync of the step

    def optim_step(self, stats: StepStats, lr: float) -> StepRecord:
        """Scale (exact mean over the global batch), clip, step and zero; or skip on every rank alike when any rank
        saw a non-finite loss or the step has no loss tokens."""
        rows, world = stats.rows, self.dist.world_size
        n_tokens = float(rows[:, _TOKENS].sum())
        bad_ranks = [r for r in range(world) if rows[r, _NONFINITE] > 0]
        scale = world * stats.capacity / n_tokens if n_tokens > 0 else math.nan
        # HSDP: the R replica groups hold the same shards, so the squared norm is summed over one group's ranks
        one_replica = self.layout.replica_ranks(0)
        grad_norm = math.sqrt(float(rows[one_replica.start:one_replica.stop, _SQNORM].sum())) * scale
        loss = float(rows[:, _LOSS].sum()) / n_tokens if n_tokens > 0 else math.nan
        ok = n_tokens > 0 and not bad_ranks and math.isfinite(grad_norm)  # the same on every rank
        self.timer.start("optimizer")
        if ok:
            clip = self.cfg.train.grad_clip
            coef = min(1.0, clip / (grad_norm + 1e-6)) if clip > 0 else 1.0
            set_lr(self.optimizer, lr)
            if self.optimizer.defaults.get("fused"):
                # Fused AdamW divides each gradient by grad_scale as it reads it: no pass of its own over the
                # gradients. An overlapped runner reads lr and grad_scale until the next forward has waited for it.
                self.optimizer.grad_scale = torch.tensor(1.0 / (scale * coef), dtype=torch.float32,
                                                         device=self.runner.grad_scale_device)
            else:
                torch._foreach_mul_([local_tensor(p.grad) for p in self.params if p.grad is not None], scale * coef)
            self.runner.launch()  # an overlapped runner takes the gradients and frees them group by group
            if gathers_in_fp8(self.cfg.parallel):
                self.runner.wait()  # the FP8 scales are read from the updated weights, all of them, now
            refresh_fp8_scales(self.model, self.cfg.parallel)
        else:
            self.skipped += 1
        # keep_grads: zeroed, not freed (freed sharded gradients become another stream's idle cache); FSDP then adds
        # each step's reduce-scatter output into them, in that stream. A launched overlapped step owns its gradients.
        self.runner.zero(ok)
        self.timer.stop("optimizer")
        self.step += 1
        self.tokens_seen += int(n_tokens)
        return StepRecord(step=self.step, loss=loss, grad_norm=grad_norm, lr=lr, skipped=not ok, bad_ranks=bad_ranks,
                          no_tokens=n_tokens == 0, capacity=stats.capacity, loss_tokens=n_tokens,
                          real_tokens=float(rows[:, _REAL].sum()), memory=rows[:, _MEM:_MEM + len(MEMORY_FIELDS)],
                          moe=self.expert_load.finish_step(rows[:, _MEM + len(MEMORY_FIELDS):], ok),
                          phases=stats.phases)

    def finish(self) -> None:
        """Wait for a launched overlapped step: parameters and optimizer are then those after the last optim_step."""
        self.runner.wait()

    # ------------------------------------------------------------------ state
    def evaluate(self, batches) -> dict:
        """Validation loss over these micro-batches (the same count on every rank), reduced once."""
        return evaluate(self.model, batches, self.device)

    def save(self, root: Path, config_toml: str, keep: int = 0) -> Path:
        self.finish()
        return save_checkpoint(root, self.step, self.model, self.optimizer,
                               {"skipped": self.skipped, "tokens_seen": self.tokens_seen, "run_id": self.run_id},
                               config_toml, self.device, keep=keep)

    def refuse_non_finite(self, root: Path, what: str) -> None:
        self.finish()
        refuse_non_finite(self.model, self.device, self.step, root, what)

    def export_hf(self, out: str, dtype: str, source: str | None) -> Path:
        from shardfit.hf import export_hf

        self.finish()
        export_hf(self.model, out, dtype, source)
        return Path(out)
