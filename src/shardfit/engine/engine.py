"""The Engine: the sharded model, its optimizer and step runner, and the one step path every caller takes.

    result = engine.forward_backward(batches, loss)   # every micro-batch's forward and backward, then ONE collective
    record = engine.optim_step(AdamParams(...))        # gradient scale and clip, the optimizer launched, zeroed
                                                       # (engine/update.py)

`batches` is a list of engine/batch.py PackedBatch, the same count and shapes on every rank; `loss` (engine/losses.py)
is the only variable: the trainer's cross-entropy, an RL per-token loss (rl/ turns datums into packed batches and
TokenLoss), validation's cross-entropy without the MoE term (forward). `forward` is the same pass under no_grad.
MoE load balancing, phase timings, the watchdog's beat (on_micro_batch) and the OOM report to the doctor are here,
so `shardfit train`, the RL API and `shardfit serve` all have them.

Collectives of one pass, identical on every rank and in this order: FSDP's own all-gathers and reduce-scatters
(gradients reduced after every micro-batch, or with parallel.reduce_every_micro_batch=false after the last one), with
sequence parallelism the attention all-to-alls, with expert parallelism the MoE exchanges; then exactly one
all-gather per pass, after all micro-batches, of each rank's stats (squared gradient norm, loss, tokens, non-finite
flag, stop request, memory, expert load) and the loss's per-token outputs: the pass's only host-device sync. optim_step
issues none (with tensorwise FP8 all-gather, after an applied update, one all-reduce of the weights' amaxes).
A pass of several LoRA models (model=[...], engine/multi_model.py) adds one all-gather of their adapters before its
micro-batches and, in forward_backward, one reduce-scatter of their gradients after the last backward, before the
stats collective.

Gradient scale (engine/losses.py): a mean_over_tokens loss backpropagates loss / C (C: this rank's capacity of the
pass) and optim_step multiplies by world x C / N (N: the global batch's loss tokens from the stats); a coefficient
loss backpropagates its sum and optim_step multiplies by world (FSDP averages over ranks). Passes accumulate until
optim_step; a mean_over_tokens pass must be the first (its N is known only after it), and a later pass first folds its
factor into the gradients. Fused AdamW takes the factor as grad_scale (no pass of its own); the foreach AdamW of CPU
runs gets the gradients multiplied first. LoRA (docs/lora.md): the same step over the adapters only.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path

import torch

from shardfit.adapters.lora import lora_summary
from shardfit.config import Config
from shardfit.config.shape import StepShape
from shardfit.doctor.record import SnapshotRecorder
from shardfit.engine.batch import PackedBatch, to_device_batch, total_capacity
from shardfit.engine.build import apply_alloc_conf, resolve_auto_checkpointing
from shardfit.engine.losses import CrossEntropy, Loss
from shardfit.engine.optim import build_optimizer
from shardfit.engine.records import (
    _INPUT,
    OutOfMemory,
    StepStats,
)
from shardfit.engine.registry import ModelRegistry
from shardfit.engine.sampling import EngineSampling
from shardfit.engine.state import EngineState
from shardfit.engine.stats import ExpertLoad, memory_vector
from shardfit.engine.timing import StepTimer
from shardfit.engine.update import EngineUpdate
from shardfit.errors import ShardfitError
from shardfit.models import build_model, count_params
from shardfit.models.attention import choose_doc_kernel
from shardfit.models.loss import choose_loss_kernel
from shardfit.parallel import DistInfo, all_gather_rows, parallelize
from shardfit.parallel.fp8 import fp8_notice, refresh_fp8_scales
from shardfit.parallel.gathered import fits_gathered, gathered_for_pass
from shardfit.parallel.layout import ParallelLayout
from shardfit.parallel.offload import grad_sq_norm
from shardfit.parallel.parallelize import mixed_precision
from shardfit.parallel.step_overlap import local_tensor
from shardfit.parallel.step_runner import build_step_runner
from shardfit.weights.checkpoint import load_checkpoint, new_run_id


def _check_call(name: str, loss) -> None:
    if not isinstance(loss, Loss):  # the datum API of shardfit <= session 17 called these with datums
        raise ShardfitError(f"Engine.{name} takes packed batches and an engine Loss, not {type(loss).__name__}",
                            where=f"Engine.{name}", fix=f"send datums through shardfit.rl.{name}(engine, datums, "
                            "loss_fn, loss_fn_config)")


class Engine(EngineState, EngineSampling, EngineUpdate):
    """Builds the sharded model (initialised, or loaded from `cfg.model.path` or the checkpoint `resume`), its
    optimizer and step runner, and runs steps fed from anywhere: the trainer's data loader, the RL API, a server."""

    @classmethod
    def start(cls, cfg: Config | None = None, overrides: list[str] | None = None,
              resume: Path | None = None, frozen: bool = False) -> Engine:
        """An Engine on this process: torch.distributed from the launcher's environment (torchrun, or RANK /
        WORLD_SIZE / MASTER_ADDR / MASTER_PORT as Ray or SLURM set them; one process without), the config from
        `cfg` or from key=value overrides as `shardfit train` takes them. Every rank calls it. frozen: an Engine
        that samples and scores only (__init__)."""
        from shardfit.config import load_config
        from shardfit.parallel import init_distributed
        from shardfit.weights.peft_config import adapter_lora_fields

        cfg = cfg if cfg is not None else load_config(None, list(overrides or []), adapter_lora_fields)
        apply_alloc_conf(cfg.memory.alloc_conf)
        dist = init_distributed(cfg.train.device)
        return cls(cfg, dist, resume, layout=ParallelLayout.from_config(cfg, dist.world_size, dist.rank),
                   frozen=frozen)

    def __init__(self, cfg: Config, dist: DistInfo, resume: Path | None = None, notices: list[str] | None = None,
                 layout: ParallelLayout | None = None, frozen: bool = False):
        """layout: this rank's, built once by the caller (ParallelLayout.from_config: checked); None: built here.
        frozen: every parameter frozen and stored in the compute dtype, as a LoRA run's base (parallelize): an Engine
        that samples and scores (shardfit serve's --serve.models), with nothing to train and no optimizer state."""
        if frozen and cfg.lora.rank:
            raise ShardfitError("a frozen Engine has no adapters to train", where="lora.rank",
                                fix="leave lora.rank at 0 for a model that is sampled and scored only")
        self.cfg, self.dist, self.device = cfg, dist, dist.device
        self.layout = layout or ParallelLayout.from_config(cfg, dist.world_size, dist.rank)
        self.notices = notices if notices is not None else []
        # called with (step, i, count) before micro-batch i, and with i = count before the stats collective:
        # progress display and the watchdog's beat
        self.on_micro_batch: Callable[[int, int, int], None] | None = None  # the trainer's and serve's watchdog
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
        self.parallel = parallelize(model, self.layout, parallel=cfg.parallel, compute=cfg.compute, lora=cfg.lora,
                                    quantize=cfg.model.quantize, device=self.device, seed=cfg.train.seed,
                                    init=not from_hf and self.init_from is None, frozen=frozen)
        self.model, self.layout = model, self.parallel.layout
        self.lora_targets = self.parallel.lora_targets
        if cfg.compute.fp8 != "none":
            self.notices.append(fp8_notice(cfg.compute, self.parallel.fp8_layers, self.device.type))
        self.expert_load = ExpertLoad(self.model, self.device, cfg.model.router_bias_rate)
        if self.parallel.offload_notice:
            self.notices.append(self.parallel.offload_notice)
        if from_hf:
            from shardfit.weights.hf_load import load_report
            from shardfit.weights.quantized_io import load_base

            t0 = time.perf_counter()
            loaded = load_base(self.model, cfg.model.path)  # a quantised base quantised as it is read
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
            if self.parallel.quantized_layers:
                from shardfit.adapters.quantized import quantized_summary

                self.notices.append(quantized_summary(self.model))
        self.recorder: SnapshotRecorder | None = None  # OOM snapshots for the doctor: a caller with a run directory
        self._pending: list[StepStats] = []  # forward_backward passes since the last optim_step
        # why the gradients since the last optim_step were dropped (a forward_backward that failed midway): the next
        # optim_step refuses with it rather than step on part of a pass (engine/update.py)
        self.dropped: str | None = None
        self.timer = StepTimer(self.device, cfg.logging.step_timing)
        self.timer.watch_fsdp_waits([*self.model.model.layers, self.model.model.embed_tokens, self.model.lm_head,
                                     self.model])
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.n_params = count_params(self.model)
        self.optimizer = build_optimizer(self.model, cfg.train, self.device, cfg.parallel.offload)
        self.step, self.skipped, self.tokens_seen = 0, 0, 0
        self.weights_epoch = 0  # + 1 whenever the weights change (optim_step applied, load_state, a new model)
        self.stop_requested = 0  # a signal number, set by a handler at any time (train/stop.py); read by _collect
        self.run_id = new_run_id()  # follows the run across resumes: checkpoint.keep prunes only its own
        if resume is not None:
            state = load_checkpoint(resume, self.model, self.optimizer, self.device)
            self.step, self.skipped = state["step"], state.get("skipped", 0)
            self.tokens_seen = state.get("tokens_seen", 0)
            self.run_id = state.get("run_id") or self.run_id
        refresh_fp8_scales(self.model, cfg.compute)  # FP8 scales of the weights in place: initialised, loaded, resumed
        self.runner = build_step_runner(cfg, self.model, self.optimizer, self.device)
        # The trained parameters are a slot that models and frozen versions fill in turn (engine/registry.py): with
        # LoRA many models on the frozen base; without it one model, its versions in the compute dtype
        lora = self.lora_targets is not None
        self.models = ModelRegistry(self, int(cfg.memory.versions_gib * 2**30), lora=lora,
                                    version_dtype=None if lora else
                                    mixed_precision(cfg.compute, self.device).param_dtype)

    # ------------------------------------------------------------------ models and versions (engine/registry.py)
    def using(self, model: str | None) -> None:
        """Put `model` (a model name, a version id, or registry.BASE) in the trained parameters' slot; None: leave
        the slot as it is. Every rank makes the same calls."""
        if model is not None:
            self.models.activate(model)

    def add_model(self, name: str, seed: int | None = None) -> None:
        """A new LoRA model on the frozen base, starting at the base exactly (B = 0), with its own optimizer state and
        step; it becomes the active one. Without LoRA: refused naming --lora.rank."""
        self.models.add(name, self.cfg.train.seed if seed is None else seed)
        self.weights_epoch += 1  # a name removed and added again is another model

    def freeze(self, model: str | None = None) -> str:
        """A frozen version of `model` (the active one by default): its adapters, or without LoRA a copy of every
        weight in the compute dtype; its id, which `using` accepts."""
        return self.models.freeze(model or self.models.current)

    def _check_trainable(self, what: str) -> None:
        if not self.models.trainable:
            raise ShardfitError(f"{what} on {self.models.current!r}, a frozen version (or the base): it samples and "
                                "scores only", where="model_id", fix="train the model itself, not a sampler's version")

    # ------------------------------------------------------------------ the step
    @property
    def pending(self) -> bool:
        """Gradients of forward_backward passes wait for an optim_step."""
        return bool(self._pending)

    def forward_backward(self, batches: list[PackedBatch], loss: Loss,
                         fingerprint: int | Callable[[], int] | None = None,
                         model: list[str] | None = None) -> StepStats | list[StepStats]:
        """Accumulate the gradients of these micro-batches (this rank's part of the step) under `loss`, then the
        pass's one collective. Every rank passes the same number of micro-batches of the same shapes. fingerprint
        (< 2**52, or a function returning it, called once the micro-batches are queued): what the caller was given,
        which must be the same on every rank (the RL API's datums): compared in the pass's collective; a difference
        drops the gradients since the last optim_step and is one error.
        model: a list of K LoRA models trained in this ONE pass (engine/multi_model.py: each token's model is its
        batch's `slots` entry, an index into the list); returns one StepStats per model, in the list's order, each
        pending for that model's own optim_step. One model is today's pass with that model in the slot."""
        self.release_sampler()  # a kept Sampler's KV pool and graphs: this call's memory (engine/sampling.py)
        _check_call("forward_backward", loss)
        if model is not None:
            from shardfit.engine.multi_model import forward_backward_models

            return forward_backward_models(self, batches, loss, model, fingerprint)
        self._check_trainable("forward_backward")
        if self._pending and (loss.mean_over_tokens or self._pending[0].mean_over_tokens):
            self._fold_pending(loss)
        try:
            stats = self._pass(batches, loss, backward=True, fingerprint=fingerprint)
        except BaseException as err:  # the micro-batches done so far added to .grad: none of it may be stepped on
            self._drop_pending()
            self.dropped = (str(err).splitlines() or [""])[0][:200] or type(err).__name__
            raise
        self._pending.append(stats)
        self._check_fingerprint(stats, fingerprint)
        return stats

    def forward(self, batches: Iterable[PackedBatch], loss: Loss, fingerprint: int | Callable[[], int] | None = None,
                model: list[str] | None = None) -> StepStats | list[StepStats]:
        """The same pass without gradients (log-probs, validation). On one rank the weights are gathered once for the
        whole call where they fit (gather_once, parallel/gathered.py). model: a list of K LoRA models scored in
        this ONE pass, as forward_backward's (engine/multi_model.py forward_models); one StepStats per model."""
        self.release_sampler()  # a kept Sampler's KV pool and graphs: this call's memory (engine/sampling.py)
        _check_call("forward", loss)
        if model is not None:
            from shardfit.engine.multi_model import forward_models

            return forward_models(self, batches, loss, model, fingerprint)
        with torch.no_grad(), self.gathered_pass():
            stats = self._pass(batches, loss, backward=False, fingerprint=fingerprint)
        self._check_fingerprint(stats, fingerprint)
        return stats

    def _drop_pending(self) -> None:
        """The slot's gradients since the last optim_step, dropped with their passes: no step will use them."""
        self._pending = []
        self.runner.zero(False)

    def _check_fingerprint(self, stats: StepStats, fingerprint: int | Callable[[], int] | None,
                           drop: Callable[[], None] | None = None) -> None:
        """Every rank reads the same rows: all raise or none does (no rank left in a collective). drop: what drops
        the gradients of a pass of several models (None: the slot's, when `stats` is its last pending pass)."""
        if fingerprint is None:
            return
        seen = stats.rows[:, _INPUT]
        if bool((seen == seen[0]).all()):
            return
        odd = [r for r in range(len(seen)) if seen[r] != seen[0]]
        if drop is not None:
            drop()
        elif self._pending and stats is self._pending[-1]:  # gradients of data that differ between ranks: dropped
            self._drop_pending()
        raise ShardfitError(f"ranks were given different data: rank(s) {', '.join(map(str, odd))} differ from rank 0 "
                            "(the gradients since the last optim_step are dropped)", where="datums",
                            fix="pass every rank the same list of datums (sample on every rank, or broadcast rank "
                            "0's list first)")

    def evaluate(self, batches: Iterable[PackedBatch]) -> dict:
        """Validation loss over these micro-batches (the same count on every rank): the cross-entropy alone."""
        t0 = time.perf_counter()
        stats = self.forward(batches, CrossEntropy(router_aux=False))
        n = stats.loss_tokens
        return {"val_loss": stats.loss_sum / n if n else float("nan"), "val_tokens": int(n),
                "val_s": time.perf_counter() - t0}

    def _pass(self, batches: Iterable[PackedBatch], loss: Loss, backward: bool,
              fingerprint: int | Callable[[], int] | None = None,
              after_backward: Callable[[], torch.Tensor] | None = None) -> StepStats:
        """fingerprint: forward_backward's, or a function returning it (called after the micro-batches).
        after_backward: a pass of several models (engine/multi_model.py): called after the last micro-batch (its
        backward, if any), before the collective; what it returns (float64 [e]) rides at the end of each rank's
        stats row, and the slot's own gradient norm is not taken (its figures are per model, in those columns)."""
        # validation's may be a generator, the RL API's LazyBatches (engine/batch.py): both make one mask at a time,
        # as the loop reaches it; a backward needs the count, so a generator is listed, a sequence is not
        if backward and not isinstance(batches, Sequence):
            batches = list(batches)
        count = len(batches) if backward else 0
        # the backward's divisor (engine/losses.py): C, this rank's capacity of the pass, for a mean over tokens
        divisor = total_capacity(batches) if backward and loss.mean_over_tokens else 1
        capacity = tokens = 0
        real = 0.0
        loss_sum = torch.zeros((), dtype=torch.float32, device=self.device)
        outputs: list[torch.Tensor] = []  # [n_outputs, local] per micro-batch, detached
        step = self.step + 1
        for i, b in enumerate(batches):
            if backward and self.on_micro_batch is not None:
                self.on_micro_batch(step, i, count)
            capacity += b.capacity
            tokens += b.loss_tokens  # counted on the host: no sync
            real += b.real_tokens
            if backward:
                # Default: reduce-scatter after every micro-batch (FSDP adds each into the sharded gradient).
                # Deferring it to the last keeps unsharded fp32 gradients of the whole model on every GPU in between.
                self.model.set_requires_gradient_sync(self.cfg.parallel.reduce_every_micro_batch or i == count - 1)
            dev = to_device_batch(b, self.device, self.model.loss_chunk)
            try:
                self.timer.start("forward")
                total, out = loss(self.model, dev)  # summed loss, fp32 scalar; per-token outputs [n] each
                self.timer.stop("forward")
                if backward:
                    self.timer.start("backward")
                    self.runner.wait()  # backward writes new gradients: the last step must be done (see offload)
                    (total / divisor if divisor != 1 else total).backward()
                    self.timer.stop("backward")
                    self.expert_load.add_micro_batch()
            except torch.OutOfMemoryError as err:
                self._on_oom(err)
            loss_sum += total.detach()
            if loss.outputs:
                outputs.append(torch.stack([out[k].detach().float() for k in loss.outputs]))
        if backward and self.on_micro_batch is not None:
            self.on_micro_batch(step, count, count)  # all done: the collective next
        extra = after_backward() if after_backward is not None else None
        # a function (rl/step.py: the datums' hash, milliseconds of host time) is called here, once every micro-batch
        # is queued: it runs under their GPU work instead of before the first one
        fingerprint = fingerprint() if callable(fingerprint) else fingerprint
        rows, gathered = self._collect(loss_sum, tokens, real, outputs, grads=backward and extra is None,
                                       fingerprint=-1 if fingerprint is None else fingerprint, extra=extra)
        # Everything recorded so far (this pass, the previous step's optimizer) finished before that sync.
        return StepStats(rows, capacity, loss.mean_over_tokens, gathered, self.timer.collect())

    def _collect(self, loss_sum: torch.Tensor, tokens: int, real: float, outputs: list[torch.Tensor],
                 grads: bool, fingerprint: int,
                 extra: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The pass's single collective: every rank's stats [world, k] (float64) and outputs [world, n_out, M x
        local] (fp32), on the host. The stats ride as fp32 pairs (a float64 viewed as two fp32 words): one buffer,
        exact counts and sums, the outputs not widened. extra (float64 [e]): appended to the stats (_pass)."""
        # offload=all: host gradients, and with offload_gpu_blocks device ones too: a norm per device, where they are
        zero = torch.zeros((), dtype=torch.float64, device=self.device)
        sq = grad_sq_norm([local_tensor(p.grad) for p in self.params if p.grad is not None],
                          self.device) if grads else zero
        f64 = {"dtype": torch.float64, "device": self.device}
        head = torch.stack([sq.double(), loss_sum.double(), torch.tensor(float(tokens), **f64),
                            (~torch.isfinite(loss_sum)).double(), torch.tensor(float(real), **f64),
                            torch.tensor(float(self.stop_requested), **f64), torch.tensor(float(fingerprint), **f64)])
        mem = torch.tensor(memory_vector(self.device), **f64)
        moe = self.expert_load.take()  # [L*E] rows per expert (MoE models; empty otherwise)
        stats = torch.cat([head, mem, moe] + ([extra] if extra is not None else []))
        flat = [stats.view(torch.float32)]
        if outputs:
            out = torch.stack(outputs, 1)  # [n_out, M, local]
            flat.append(out.reshape(-1))
        rows = all_gather_rows(torch.cat(flat)).cpu()  # the one host-device sync of the pass
        k = 2 * stats.numel()
        gathered = rows[:, k:].reshape(rows.shape[0], out.shape[0], -1) if outputs else None
        return rows[:, :k].contiguous().view(torch.float64), gathered

    def _on_oom(self, err: BaseException) -> None:
        """Dump this rank's snapshot, diagnose it, and stop with one clear message. Peers blocked in a collective
        with this rank are released when it exits (torchrun tears the job down; NCCL aborts its communicators)."""
        step = self.step + 1
        path = self.recorder.dump_oom(step) if self.recorder is not None else None
        verdict = ""
        if path is not None:
            from shardfit.doctor import examine
            from shardfit.doctor.report import verdict as one_line

            try:
                verdict = "; doctor: " + one_line(examine([str(path)])[1])
            except ShardfitError:
                verdict = ""
        first = str(err).splitlines()[0] if str(err) else "CUDA out of memory"
        raise OutOfMemory(f"rank {self.dist.rank} ran out of GPU memory in step {step} ({first})"
                          + (f"; snapshot {path}" if path else "") + verdict, where=f"step {step}",
                          fix="lower train.micro_batch or data.seq_len, or set compute.activation_checkpoint")

    def gathered_pass(self):
        """A context for a no-grad pass of several forward calls (forward's micro-batches, a sampler's decoding
        steps): on one rank, where they fit half the free memory and gather_once is on, the weights are gathered
        once for all of them and dropped at its end (parallel/gathered.py); otherwise FSDP's own per-call gathers."""
        keep = self.gather_once and self.dist.world_size == 1 and fits_gathered(self.model, self.device)
        return gathered_for_pass(self.model, keep)

    def datum_budget(self) -> int:
        """T, the tokens of one [1, T] row of datums (rl/pack.py): train.micro_batch_tokens, else data.seq_len x
        train.micro_batch."""
        return StepShape.of(self.cfg).datum_budget

    def doc_kernel(self, budget: int, grad: bool) -> str:
        """The document-masked attention kernel for rows of `budget` tokens: a no-grad pass (grad False) takes
        cudnn_docs when asked for (it has no backward), else the training kernel as forward_backward does
        (choose_doc_kernel); under sampling.logprobs=trainer a packing-invariant one (varlen) where auto chooses:
        the log-probs the sampler returns then hold for the datums in any order or grouping."""
        fp32 = self.cfg.compute.param_dtype == "float32"
        return choose_doc_kernel(self.cfg.compute.doc_attention, self.device, budget,
                                 torch.float32 if fp32 else torch.bfloat16, grad=grad,
                                 invariant=self.cfg.sampling.logprobs == "trainer")
