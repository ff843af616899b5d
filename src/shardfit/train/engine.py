"""The one step implementation: model, optimizer and step runner; `forward_backward` then `optim_step`.

Collectives of one step, identical on every rank and in this order: FSDP's own all-gathers and reduce-scatters
(gradients reduced after every micro-batch, or with parallel.reduce_every_micro_batch=false after the last one),
with sequence parallelism the attention all-to-alls, with expert parallelism the MoE exchanges; then exactly one
all-gather of a small stats vector per rank, after all micro-batches (forward_backward's last act, and the step's
only host-device sync; it also carries each rank's stop request, train/stop.py); with tensorwise FP8 all-gather,
after an applied update, one all-reduce of the weights' amaxes. Every rank derives the same token count, gradient
norm, skip and stop decisions from the stats rows.

Loss scaling: each micro-batch backpropagates (summed token loss) / C, C = this rank's token capacity per step (the
same on every rank: same micro-batch count and shapes), and FSDP averages over ranks. optim_step scales the
gradients by world x C / N (N = loss tokens of the global batch) and the clip coefficient: exactly the gradient of
the mean token loss over the global batch. Fused AdamW takes that factor as grad_scale (no pass of its own); the
foreach AdamW of CPU runs gets the gradients multiplied first.
LoRA (lora.rank, docs/lora.md): the same step over the parameters that train (the adapters): the norm, clip and
skip decision cover them only; the frozen base comes from model.path (or the seed) at every start, resumes included
(QLoRA, model.quantize=nf4: quantised again, identically, adapters/qlora.py).
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from shardfit.adapters.lora import lora_summary
from shardfit.config import Config
from shardfit.errors import ShardfitError
from shardfit.models import build_model, count_params
from shardfit.models.attention import DocumentMask, choose_doc_kernel, to_device
from shardfit.models.logprobs import scored_rows
from shardfit.models.loss import choose_loss_kernel
from shardfit.parallel import DistInfo, all_gather_rows, parallelize
from shardfit.parallel.fp8 import fp8_notice, gathers_in_fp8, refresh_fp8_scales
from shardfit.parallel.gathered import drop_gathered, fits_gathered, gathered_for_pass
from shardfit.parallel.offload import grad_sq_norm
from shardfit.parallel.step_overlap import local_tensor
from shardfit.parallel.step_runner import build_step_runner
from shardfit.parallel.ulysses import local_slice
from shardfit.rl.datum import AdamParams, Datum, ForwardBackwardResult, check_adam, check_datums
from shardfit.rl.losses import coefficients, counted, ppo_clip_fraction, resolve_loss, sampler_gap, token_loss
from shardfit.rl.pack import build_row, plan_datums, unpack
from shardfit.train.batches import LocalBatch
from shardfit.train.evaluate import evaluate
from shardfit.train.metrics import MEMORY_FIELDS, ExpertLoad, memory_vector
from shardfit.train.optim import build_optimizer, set_hyperparameters, set_lr
from shardfit.train.timing import StepTimer
from shardfit.weights.checkpoint import load_checkpoint, new_run_id, refuse_non_finite, save_checkpoint

_SQNORM, _LOSS, _TOKENS, _NONFINITE, _REAL, _STOP, _MEM = 0, 1, 2, 3, 4, 5, 6


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
    stop: int = 0  # a signal any rank received before this step's stats collective (0: none): every rank stops
    stop_ranks: list[int] = field(default_factory=list)  # the ranks that received it


def apply_alloc_conf(alloc_conf: str) -> None:
    """Default allocator settings for CUDA runs; must happen before the first CUDA allocation. The user's own
    PYTORCH_CUDA_ALLOC_CONF always wins."""
    if alloc_conf and "PYTORCH_CUDA_ALLOC_CONF" not in os.environ:
        os.environ["PYTORCH_CUDA_ALLOC_CONF"] = alloc_conf


def device_memory_bytes(cfg: Config, device: torch.device) -> float:
    """What a run may plan for on this GPU: its memory, times memory.max_fraction where set."""
    return torch.cuda.get_device_properties(device).total_memory * (cfg.memory.max_fraction or 1.0)


def resolve_auto_checkpointing(cfg: Config, dist: DistInfo) -> str:
    """compute.activation_checkpoint=auto, resolved in place before the model is built (plan/auto_checkpointing.py)
    for the job's smallest GPU: one all-reduce (MIN) of the device memory, so every rank builds the same blocks.
    Returns the line the run prints."""
    from shardfit.plan.auto_checkpointing import auto_checkpointing

    gpu_gib = None
    if dist.device.type == "cuda":
        total = torch.tensor(device_memory_bytes(cfg, dist.device), device=dist.device, dtype=torch.float64)
        if dist.world_size > 1:
            torch.distributed.all_reduce(total, op=torch.distributed.ReduceOp.MIN)
        gpu_gib = total.item() / 2**30
    changes, line = auto_checkpointing(cfg, dist.world_size, gpu_gib)
    for key, value in changes.items():
        section, _, name = key.partition(".")
        setattr(getattr(cfg, section), name, value)
    return line


class Engine:
    """Builds the sharded model (initialised, or loaded from `cfg.model.path` or the checkpoint `resume`), its
    optimizer and step runner, and runs steps fed from anywhere: the trainer's data loader, or a server."""

    @classmethod
    def start(cls, cfg: Config | None = None, overrides: list[str] | None = None,
              resume: Path | None = None) -> Engine:
        """An Engine on this process: torch.distributed from the launcher's environment (torchrun, or RANK /
        WORLD_SIZE / MASTER_ADDR / MASTER_PORT as Ray or SLURM set them; one process without), the config from
        `cfg` or from key=value overrides as `shardfit train` takes them. Every rank calls it."""
        from shardfit.config import load_config
        from shardfit.parallel import init_distributed
        from shardfit.parallel.layout import check_layout
        from shardfit.weights.peft_config import adapter_lora_fields

        cfg = cfg if cfg is not None else load_config(None, list(overrides or []), adapter_lora_fields)
        apply_alloc_conf(cfg.memory.alloc_conf)
        dist = init_distributed(cfg.train.device)
        check_layout(cfg, dist.world_size)
        return cls(cfg, dist, resume)

    def __init__(self, cfg: Config, dist: DistInfo, resume: Path | None = None, notices: list[str] | None = None):
        self.cfg, self.dist, self.device = cfg, dist, dist.device
        self.notices = notices if notices is not None else []
        # called with (step, i, count) before micro-batch i, and with i = count before the stats collective:
        # progress display and the watchdog's beat
        self.on_micro_batch: Callable[[int, int, int], None] | None = None
        # forward() on one rank gathers (casts) the weights once per call instead of once per micro-batch where they
        # fit half the free memory (parallel/gathered.py); False: once per micro-batch, as FSDP does by itself
        self.gather_once = True
        if cfg.compute.activation_checkpoint == "auto":
            self.notices.append(resolve_auto_checkpointing(cfg, dist))
        with torch.device("meta"):
            model = build_model(cfg.model, loss_chunk=cfg.compute.loss_chunk)
        model.loss_impl = choose_loss_kernel(cfg.compute.kernels, self.device)
        if self.device.type == "cuda" and cfg.compute.numa_bind:
            from shardfit.parallel.affinity import bind_to_numa_node, gpu_pci_bus_id

            self.notices.append(f"rank {dist.rank}: " + bind_to_numa_node(gpu_pci_bus_id(self.device.index)))
        # A resumed run takes its weights from the checkpoint; a LoRA checkpoint holds no base (frozen: rebuilt from
        # model.path or the seed, as the run started), only adapters, optimizer and buffers. A new run takes them
        # from model.init_from's checkpoint, or model.path's.
        lora = cfg.lora.rank > 0
        self.init_from = None
        if cfg.model.init_from and resume is None:
            from shardfit.weights.init_from import resolve_init_from

            self.init_from = resolve_init_from(cfg.model.init_from, self.notices, self.device)
        elif cfg.model.init_from and lora:  # a resumed LoRA run: the base it trained on, as recorded
            from shardfit.weights.init_from import base_source

            self.init_from = base_source(resume, self.notices, self.device)
        from_hf = bool(cfg.model.path) and (resume is None or lora)
        self.parallel = parallelize(model, cfg, self.device, dist.world_size, cfg.train.seed,
                                    init=not from_hf and self.init_from is None)
        self.model, self.layout = model, self.parallel.layout
        self.lora_targets = self.parallel.lora_targets
        if cfg.compute.fp8 != "none":
            self.notices.append(fp8_notice(cfg.compute, self.parallel.fp8_layers, self.device.type))
        self.expert_load = ExpertLoad(self.model, self.device, cfg.model.router_bias_rate)
        if self.parallel.offload_notice:
            self.notices.append(self.parallel.offload_notice)
        if from_hf:
            from shardfit.weights.hf_load import load_report
            from shardfit.weights.nf4_io import load_base

            t0 = time.perf_counter()
            loaded = load_base(self.model, cfg.model.path)  # an NF4 base quantised as it is read
            self.notices.append(load_report(cfg.model.path, time.perf_counter() - t0, loaded, self.device))
        if self.init_from is not None:
            from shardfit.weights.init_from import load_init_weights

            load_init_weights(self.init_from, self.model, self.device, self.notices, lora, resume is not None)
        if lora:
            if cfg.lora.adapter and resume is None:
                from shardfit.weights.peft import adapter_notices, load_adapter

                load_adapter(self.model, cfg.lora.adapter)
                self.notices += adapter_notices(cfg.lora.adapter)  # a transformers-4 MoE adapter's conversion
            self.notices.append(lora_summary(self.model, self.lora_targets))
            if self.parallel.nf4_layers:
                from shardfit.adapters.qlora import qlora_summary

                self.notices.append(qlora_summary(self.model))
        self.timer = StepTimer(self.device, cfg.logging.step_timing)
        self.timer.watch_fsdp_waits([*self.model.model.layers, self.model.model.embed_tokens, self.model.lm_head,
                                     self.model])
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.n_params = count_params(self.model)
        self.optimizer = build_optimizer(self.model, cfg.train, self.device, cfg.parallel.offload)
        self.step, self.skipped, self.tokens_seen = 0, 0, 0
        self.stop_requested = 0  # a signal number, set by a handler at any time (train/stop.py); read by _reduce
        self.run_id = new_run_id()  # follows the run across resumes: checkpoint.keep prunes only its own
        if resume is not None:
            state = load_checkpoint(resume, self.model, self.optimizer, self.device)
            self.step, self.skipped = state["step"], state.get("skipped", 0)
            self.tokens_seen = state.get("tokens_seen", 0)
            self.run_id = state.get("run_id") or self.run_id
        refresh_fp8_scales(self.model, cfg.compute)  # FP8 scales of the weights in place: initialised, loaded, resumed
        self.runner = build_step_runner(cfg, self.model, self.optimizer, self.device)

    # ------------------------------------------------------------------ one step
    def forward_backward_batches(self, batches: list[LocalBatch]) -> StepStats:
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
                            (~torch.isfinite(loss_sum)).double(), torch.tensor(float(real), **f64),
                            torch.tensor(float(self.stop_requested), **f64)])
        mem = torch.tensor(memory_vector(self.device), **f64)
        moe = self.expert_load.take()  # [L*E] rows per expert (MoE models; empty otherwise)
        return all_gather_rows(torch.cat([head, mem, moe])).cpu()  # the one host-device sync of the step

    def optim_step_stats(self, stats: StepStats, lr: float) -> StepRecord:
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
            set_lr(self.optimizer, lr)
            self._update(scale, grad_norm, self.cfg.train.grad_clip)
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
                          phases=stats.phases, stop=int(rows[:, _STOP].max()),
                          stop_ranks=[r for r in range(world) if rows[r, _STOP] > 0])

    def _update(self, scale: float, grad_norm: float, clip: float) -> None:
        """Launch the optimizer on gradients x scale x (clip coefficient)."""
        drop_gathered(self.model)  # a no-grad pass's gathered copies would outlive the step stale (parallel/gathered)
        coef = min(1.0, clip / (grad_norm + 1e-6)) if clip > 0 else 1.0
        if self.optimizer.defaults.get("fused"):
            # Fused AdamW divides each gradient by grad_scale as it reads it: no pass of its own over the
            # gradients. An overlapped runner reads lr and grad_scale until the next forward has waited for it.
            self.optimizer.grad_scale = torch.tensor(1.0 / (scale * coef), dtype=torch.float32,
                                                     device=self.runner.grad_scale_device)
        else:
            torch._foreach_mul_([local_tensor(p.grad) for p in self.params if p.grad is not None], scale * coef)
        self.runner.launch()  # an overlapped runner takes the gradients and frees them group by group
        if gathers_in_fp8(self.cfg.compute):
            self.runner.wait()  # the FP8 scales are read from the updated weights, all of them, now
        refresh_fp8_scales(self.model, self.cfg.compute)

    def finish(self) -> None:
        """Wait for a launched overlapped step: parameters and optimizer are then those after the last optim_step,
        and every parameter is its shard again (no gathered copy left by a no-grad pass)."""
        self.runner.wait()
        drop_gathered(self.model)

    # ------------------------------------------------------------------ the RL API (issue 24): datums in
    def forward(self, datums: list[Datum], loss_fn="cross_entropy", loss_fn_config: dict | None = None
                ) -> ForwardBackwardResult:
        """Per-token log-probabilities of every datum's target tokens (and the loss's value), no gradients. On one
        rank the weights are gathered once for the whole call where they fit (gather_once, parallel/gathered.py)."""
        with torch.no_grad(), self.gathered_pass():
            return self._datum_pass(datums, loss_fn, loss_fn_config, backward=False)

    def gathered_pass(self):
        """A context for a no-grad pass of several forward calls (forward's micro-batches, a sampler's decoding
        steps): on one rank, where they fit half the free memory and gather_once is on, the weights are gathered
        once for all of them and dropped at its end (parallel/gathered.py); otherwise FSDP's own per-call gathers."""
        keep = self.gather_once and self.dist.world_size == 1 and fits_gathered(self.model, self.device)
        return gathered_for_pass(self.model, keep)

    def forward_backward(self, datums: list[Datum], loss_fn="cross_entropy", loss_fn_config: dict | None = None
                         ) -> ForwardBackwardResult:
        """Accumulate the gradient of sum_t c_t x loss_t (rl/losses.py) over every datum; optim_step applies it."""
        return self._datum_pass(datums, loss_fn, loss_fn_config, backward=True)

    def _datum_pass(self, datums: list[Datum], loss_fn, loss_fn_config: dict | None,
                    backward: bool) -> ForwardBackwardResult:
        spec = resolve_loss(loss_fn, loss_fn_config)
        check_datums(datums, self.cfg.model.vocab_size, spec.required)
        sp, dp_rank, sp_rank = self.layout.sequence, self.layout.data_rank, self.layout.sequence_rank
        plan = plan_datums(datums, self.datum_budget(), self.layout.data_size, sp)
        coefs = coefficients(datums, spec)
        scored = [counted(d) for d in datums] if spec.logprobs_at == "counted" else None  # None: every token
        names = set().union(*(d.inputs for d in datums)) - {"target_tokens"}
        names = {k for k in names if all(k in d.inputs for d in datums)}  # inputs every datum has
        want_entropy = spec.entropy_coef != 0
        local = plan.budget // sp
        out = torch.zeros(plan.micro_batches * local * (2 if want_entropy else 1) + 2, device=self.device)
        for m, items in enumerate(plan.bins[dp_rank]):
            row = build_row(plan, datums, items, coefs, names, scored)
            mask = DocumentMask.build(row.position_ids, self._doc_kernel(plan.budget, grad=backward), self.device)
            cut = (lambda x: local_slice(x, sp_rank, sp)) if sp > 1 else (lambda x: x)
            ids, labels, pos = (to_device(cut(x), self.device) for x in (row.input_ids, row.labels, row.position_ids))
            x = {k: to_device(cut(v), self.device).flatten() for k, v in row.inputs.items()}
            coef = to_device(cut(row.coef), self.device).flatten()
            if backward:
                self.model.set_requires_gradient_sync(self.cfg.parallel.reduce_every_micro_batch
                                                      or m == plan.micro_batches - 1)
            rows = (to_device(scored_rows(cut(row.scored), self.model.loss_chunk), self.device)
                    if row.scored is not None else None)  # the head's rows: made on the host, no sync
            logp, ent = self.model(ids, labels, pos, mask, logprobs=True, entropy=want_entropy, rows=rows)
            logp, ent = logp.flatten(), (ent.flatten() if ent is not None else None)
            total = (coef * token_loss(spec, logp, ent, x)).sum()
            if backward:
                self.runner.wait()  # backward writes gradients: a launched step must be done with them
                total.backward()  # FSDP averages over ranks; optim_step multiplies by the world size
            out[m * local:(m + 1) * local] = logp.detach()
            if want_entropy:
                out[(plan.micro_batches + m) * local:(plan.micro_batches + m + 1) * local] = ent.detach()
            out[-2] += total.detach()
        out[-1] = (~torch.isfinite(out[-2])).float()  # on the device: the collective's .cpu() is the one host sync
        rows = all_gather_rows(out).cpu()  # the pass's one collective: every rank's outputs and loss
        n = plan.micro_batches * local
        logprobs = unpack(plan, datums, rows[:, :n])
        outputs = [{"logprobs": lp} for lp in logprobs]
        if want_entropy:
            for o, e in zip(outputs, unpack(plan, datums, rows[:, n:2 * n])):
                o["entropy"] = e
        metrics = {"loss:sum": float(rows[:, -2].sum()), **sampler_gap(datums, logprobs),
                   **ppo_clip_fraction(datums, logprobs, spec)}
        return ForwardBackwardResult(outputs, metrics)

    def datum_budget(self) -> int:
        """T, the tokens of one datum micro-batch: train.micro_batch_tokens, else data.seq_len x train.micro_batch."""
        t = self.cfg.train
        return t.micro_batch_tokens or self.cfg.data.seq_len * max(t.micro_batch, 1)

    def _doc_kernel(self, budget: int, grad: bool) -> str:
        """The document-masked kernel of a datum pass: forward (grad False) may take cudnn_docs, which has no
        backward; forward_backward takes the training kernel (choose_doc_kernel)."""
        fp32 = self.cfg.compute.param_dtype == "float32"
        return choose_doc_kernel(self.cfg.compute.doc_attention, self.device, budget,
                                 torch.float32 if fp32 else torch.bfloat16, grad=grad)

    def optim_step(self, adam: AdamParams | None = None) -> dict[str, float]:
        """One AdamW step on the gradients accumulated by forward_backward since the last one (exactly their sum,
        FSDP's average over ranks undone), clipped to adam.grad_clip_norm; skipped on every rank alike when the
        gradient norm is not finite. One collective (the gradient norm)."""
        adam = adam or AdamParams()
        check_adam(adam)
        world = self.dist.world_size
        sq = grad_sq_norm([local_tensor(p.grad) for p in self.params if p.grad is not None], self.device)
        rows = all_gather_rows(sq.reshape(1)).cpu()
        one_replica = self.layout.replica_ranks(0)  # HSDP: one replica group's shards make the whole
        grad_norm = math.sqrt(float(rows[one_replica.start:one_replica.stop, 0].sum())) * world
        ok = math.isfinite(grad_norm)
        if ok:
            set_hyperparameters(self.optimizer, adam.learning_rate, (adam.beta1, adam.beta2), adam.eps,
                                adam.weight_decay)
            self._update(world, grad_norm, adam.grad_clip_norm)
        else:
            self.skipped += 1
        self.runner.zero(ok)
        self.step += 1
        return {"grad_norm:mean": grad_norm, "skipped:max": float(not ok), "learning_rate:mean": adam.learning_rate}

    def save_state(self, root: Path, optimizer: bool = True) -> Path:
        """Model and optimizer (exact resume) as a checkpoint directory root/step_N, the only one of this run kept
        under root (a name saved again is replaced); returns it."""
        from shardfit.config import config_to_toml

        return self.save(Path(root), config_to_toml(self.cfg), keep=1, optimizer=optimizer)

    def load_state(self, path: Path, optimizer: bool = True) -> None:
        """Weights (and the optimizer's state and step) from a checkpoint: a step directory save_state or train
        wrote, or a directory holding them (the newest whole one is taken). Checked whole before it is read."""
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
        self.finish()
        state = load_checkpoint(path, self.model, self.optimizer if optimizer else None, self.device)
        if optimizer:
            self.step, self.skipped = state["step"], state.get("skipped", 0)
        refresh_fp8_scales(self.model, self.cfg.compute)

    def weights(self, dtype: torch.dtype = torch.bfloat16, bucket_bytes: int = 1 << 28):
        """Full tensors under Hugging Face names, bucket after bucket (lists of (name, tensor) of about
        bucket_bytes), on every rank, for an inference engine's load_weights; one parameter is gathered at a time
        beyond the bucket being filled. Every rank must iterate to the end (each gather is a collective)."""
        from shardfit.weights.hf_export import batched_by_bytes, hf_tensors

        self.finish()
        yield from batched_by_bytes(hf_tensors(self.model, dtype, params=self._merged()), lambda nt: nt[1].nbytes,
                                    bucket_bytes)

    # ------------------------------------------------------------------ state
    def evaluate(self, batches) -> dict:
        """Validation loss over these micro-batches (the same count on every rank), reduced once."""
        return evaluate(self.model, batches, self.device)

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
