"""The Engine's update: optim_step (the pending passes' gradients scaled to the exact normalisation, clipped,
stepped, zeroed, or the step skipped on every rank alike) and what it reads and launches.

No collective here: the last pass's stats collective (engine/engine.py) carried every rank's squared gradient norm,
loss, token counts, non-finite flag, stop request, memory and expert load; every rank takes the same decision from
those rows. With tensorwise FP8 all-gather, after an applied update, refresh_fp8_scales' one all-reduce of the
weights' amaxes. The gradient scale (engine/engine.py's docstring): world x C / N for a lone mean-over-tokens pass,
world for coefficient losses; a later pass first folds an earlier mean's C / N into the gradients (_fold_pending).
"""

from __future__ import annotations

import math

import torch

from shardfit.engine.losses import Loss
from shardfit.engine.optim import AdamParams, check_adam, set_hyperparameters
from shardfit.engine.records import _MEM, _REAL, _SQNORM, _STOP, StepRecord, fold_first_mean
from shardfit.engine.stats import MEMORY_FIELDS
from shardfit.errors import ShardfitError
from shardfit.parallel.compile_watch import fallback_count
from shardfit.parallel.fp8 import gathers_in_fp8, refresh_fp8_scales
from shardfit.parallel.gathered import drop_gathered
from shardfit.parallel.step_overlap import local_tensor


class EngineUpdate:
    """Mixed into Engine (engine/engine.py): needs its cfg, model, params, optimizer, runner, dist, layout, timer,
    expert_load, _pending (the passes since the last optim_step), step counters, release_sampler and
    _check_trainable."""

    def _fold_pending(self, loss: Loss) -> None:
        """A pass after a mean-over-tokens one (its N known now): fold that pass's factor C / N into the gradients
        (one pass over them, only here), so that every pending gradient is a coefficient loss's, scaled by world."""
        if loss.mean_over_tokens:
            raise ShardfitError("a loss averaged over the global batch's tokens must be the first forward_backward "
                                "since the last optim_step (its token count is known only after its pass)",
                                where="forward_backward", fix="call optim_step first, or use a coefficient loss")
        if self._pending[0].mean_over_tokens:
            self.runner.wait()
            fold_first_mean(self._pending, [local_tensor(p.grad) for p in self.params if p.grad is not None])

    def optim_step(self, adam: AdamParams) -> StepRecord:
        """One AdamW step on the gradients of the forward_backward passes since the last one: scaled (exact
        normalisation, FSDP's average over ranks undone), clipped to adam.grad_clip_norm, stepped and zeroed; or
        skipped on every rank alike when a rank saw a non-finite loss, the gradient norm is not finite, or a mean
        over tokens has no tokens. No collective: the last pass's stats carry the norm of every pending gradient."""
        self.release_sampler()  # a kept Sampler's KV pool and graphs: this call's memory (engine/sampling.py)
        check_adam(adam)
        self._check_trainable("optim_step")
        if self.dropped is not None:  # every rank alike: the failure raised on each (a rank-local one ends the job)
            why, self.dropped = self.dropped, None
            self._drop_pending()
            raise ShardfitError(f"a forward_backward since the last optim_step failed ({why}): its partial gradients "
                                "and those of the calls before it were dropped, and no step was taken",
                                where="optim_step", fix="send this step's forward_backward calls again, then "
                                "optim_step")
        pending, self._pending = self._pending, []
        world = self.dist.world_size
        last = pending[-1] if pending else None
        mean = bool(pending) and pending[0].mean_over_tokens  # only a lone first pass stays a mean (_fold_pending)
        n_tokens = sum(p.loss_tokens for p in pending)
        bad_ranks = sorted({r for p in pending for r in p.non_finite_ranks})
        if mean:
            scale = world * pending[0].capacity / n_tokens if n_tokens > 0 else math.nan
        else:
            scale = float(world)
        # HSDP: the R replica groups hold the same shards, so the squared norm is summed over one group's ranks
        one_replica = self.layout.replica_ranks(0)
        sq = float(last.rows[one_replica.start:one_replica.stop, _SQNORM].sum()) if last is not None else 0.0
        grad_norm = math.sqrt(sq) * scale
        loss_sum = sum(p.loss_sum for p in pending)
        loss = (loss_sum / n_tokens if n_tokens > 0 else math.nan) if mean else loss_sum
        ok = not bad_ranks and math.isfinite(grad_norm) and (n_tokens > 0 or not mean)  # the same on every rank
        self.timer.start("optimizer")
        if ok:
            set_hyperparameters(self.optimizer, adam.learning_rate, (adam.beta1, adam.beta2), adam.eps,
                                adam.weight_decay)
            self._update(scale, grad_norm, adam.grad_clip_norm)
            self.weights_epoch += 1  # Engine.sample's decode weights and cached adapter slots are stale
        else:
            self.skipped += 1
        # keep_grads: zeroed, not freed (freed sharded gradients become another stream's idle cache); FSDP then adds
        # each step's reduce-scatter output into them, in that stream. A launched overlapped step owns its gradients.
        self.runner.zero(ok)
        self.timer.stop("optimizer")
        self.step += 1
        self.tokens_seen += int(n_tokens)
        rows = last.rows if last is not None else torch.zeros(world, _MEM + len(MEMORY_FIELDS), dtype=torch.float64)
        moe_cols = sum(p.rows[:, _MEM + len(MEMORY_FIELDS):] for p in pending) if pending else rows[:, :0]
        phases: dict[str, float] = {}
        for p in pending:
            for k, v in p.phases.items():
                phases[k] = phases.get(k, 0.0) + v
        return StepRecord(step=self.step, loss=loss, grad_norm=grad_norm, lr=adam.learning_rate, skipped=not ok,
                          bad_ranks=bad_ranks, no_tokens=n_tokens == 0, capacity=last.capacity if last else 0,
                          loss_tokens=n_tokens, real_tokens=sum(float(p.rows[:, _REAL].sum()) for p in pending),
                          memory=rows[:, _MEM:_MEM + len(MEMORY_FIELDS)],
                          moe=self.expert_load.finish_step(moe_cols, ok) if pending else {}, phases=phases,
                          stop=int(rows[:, _STOP].max()), stop_ranks=[r for r in range(world) if rows[r, _STOP] > 0],
                          compile_fallbacks=fallback_count())

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
            grads = [local_tensor(p.grad) for p in self.params if p.grad is not None]
            if grads:  # none: an optim_step with no forward_backward since the last one (a no-op but for Adam's state)
                torch._foreach_mul_(grads, scale * coef)
        self.runner.launch()  # an overlapped runner takes the gradients and frees them group by group
        if gathers_in_fp8(self.cfg.compute):
            self.runner.wait()  # the FP8 scales are read from the updated weights, all of them, now
        refresh_fp8_scales(self.model, self.cfg.compute)

    def finish(self) -> None:
        """Wait for a launched overlapped step: parameters and optimizer are then those after the last optim_step,
        and every parameter is its shard again (no gathered copy left by a no-grad pass)."""
        self.runner.wait()
        drop_gathered(self.model)
