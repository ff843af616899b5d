"""Many LoRA models trained in ONE pass over the shared frozen base: `Engine.forward_backward(batches, loss,
model=["a", "b", "c"])` (the RL API: rl/step.py's DatumEngine.forward_backward_many), or scored in one: `Engine.forward
(batches, loss, model=[...])` (DatumEngine.forward_many: reference or old-policy log-probs).

Each token of the pass belongs to one model (PackedBatch.slots: an index into the list, -1 for padding). The rows of
model k go through model k's adapter, each model's gradients reach only its own adapter, and each model keeps what
it gets alone: its loss normalised over its own datums (the caller's coefficients, made per model: rl/losses.py), its
own pending passes and gradient norm, then its own `optim_step(model=k)` with its own Adam state.

How, per pass (registry: engine/registry.py; the layer math: adapters/lora_stack.py):
  1. every model's adapter shards (wherever the registry keeps them: the slot or the model's own copies) gathered
     whole onto every rank: ONE all-gather (parallel/adapter_exchange.py);
  2. stacked per adapted layer, A_all [K*r, in] and B_all [K*r, out], fp32 leaves outside FSDP, replicated; the
     LoRA layers use them for the pass instead of the slot's adapter (each token's own model's columns, exact zeros
     for the others); FSDP still gathers the slot's (unused) adapter with the base: it gets no gradient and FSDP
     reduces nothing for it;
  3. the micro-batches' forwards and backwards as usual (no collective of ours inside the backward);
  4. after the last backward, the stacked gradients reduced to each model's shards: ONE reduce-scatter (averaged, as
     FSDP's), added into each model's own sharded gradients; each model's squared gradient norm, summed loss, loss
     tokens and real tokens ride in the pass's one stats collective, which then becomes one StepStats per model.
So a pass of K models issues the same collectives on every rank, in this order: the all-gather, FSDP's own, the
reduce-scatter, the stats all-gather. One model (K = 1) is not this: it is today's pass, the model in the slot.
A forward (forward_models) is steps 1 to 3 without the backward: the stack takes no gradient, step 4 is only the
per-model sums riding in the stats collective (no reduce-scatter), nothing is left pending. It gathers the adapters
again rather than keep a previous pass's stack (forward_models says why).

The loss is the caller's, per micro-batch, with each token's model known to the stack; each model's loss sum is its
tokens' share of the loss's per-token terms ("terms": TokenLoss's c_t l_t; PairLoss's c_t x its unit's loss, which
sum over a unit's tokens to w_k loss_k). So a pair loss (DPO and kin, engine/preference.py) runs as it is: its units
never straddle models, its datum indices and 1/U coefficients come from rl/preference.py pair_pass_many, each model's
over its own pairs, and its batch constants are per unit (join_terms), each its own model's.

Why outside FSDP (the alternative: K-slot adapter parameters gathered by FSDP with the base's groups). Per model, r
= 16 on all linear layers of the 8B shape is 43.6 M parameters (r x sum over layers of (in + out)): 174 MB in fp32.
Outside FSDP, per rank and pass: K x 174 MB of whole values + K x 174 MB of whole gradients (K = 16: 5.6 GB, held
for the pass only), and on the wire once per pass K x 174 MB x (W-1)/W gathered and the same reduce-scattered,
whatever the number of micro-batches M. Inside FSDP the adapters would be re-gathered with every block in every
micro-batch's forward and backward (2 M gathers of K x 87 MB in bf16 and M reduce-scatters in fp32), the sharded
parameters would change shape with K from pass to pass (FSDP2 fixes them at fully_shard), and the optimizer's
per-parameter state would no longer be one model's. For RL-sized passes (M of a few, K up to tens) on one node the
per-pass exchange is the smaller; its price is the whole-adapter memory above, which `shardfit plan --models K`
counts (plan/models.py multi_model_pass_bytes: this arithmetic, in one place).

Refused in one line: a model twice, a name that is not a model (unknown, a frozen version, the base), a mean-over-
tokens loss (its normalisation is the whole pass's, and it gives no per-token terms: use a coefficient loss, which
the RL API makes per model), adapters other than linear layers' (embedding, output head, MoE experts), MoE models
(the load-balancing term is not per model), host offload, and sharding other than plain FSDP.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from shardfit.adapters.lora import LoRAModule, has_adapters
from shardfit.adapters.lora_stack import AdapterStack
from shardfit.engine.batch import LazyBatches, PackedBatch, total_capacity
from shardfit.engine.losses import Loss
from shardfit.engine.records import _LOSS, _NONFINITE, _REAL, _SQNORM, _TOKENS, StepStats, fold_first_mean
from shardfit.engine.registry import BASE
from shardfit.errors import ShardfitError
from shardfit.models.attention import to_device
from shardfit.models.moe import MoE
from shardfit.parallel.adapter_exchange import gather_whole, reduce_to_shards, shard_group
from shardfit.parallel.offload import grad_sq_norm
from shardfit.parallel.parallelize import mixed_precision


def check_models(engine, models) -> list[str]:
    """The pass's model list, or one line naming what is wrong with it."""
    reg = engine.models
    if isinstance(models, str) or not models:
        raise ShardfitError(f"model={models!r}: a pass of several models takes a non-empty list of model names",
                            where="model", fix="pass model=[name, ...] (one name: model=name)")
    seen = set()
    for m in models:
        if m in seen:
            raise ShardfitError(f"model {m!r} appears twice in one pass", where="model",
                                fix="put all of a model's datums in one group")
        seen.add(m)
        if m in reg.versions or m == BASE:
            raise ShardfitError(f"{m!r} is a frozen version (or the base): it samples and scores only", where="model",
                                fix="train the model itself, not a sampler's version")
        if m not in reg.models:
            raise reg._unknown(m)
    return list(models)


def check_engine(engine) -> list[nn.Module]:
    """The layers a pass of several models stacks; what this Engine cannot do so (module docstring): one line."""
    if not engine.models.lora or not has_adapters(engine.model):
        raise ShardfitError("a pass of several models needs LoRA models", where="lora.rank",
                            fix="start the engine with --lora.rank=R")
    if engine.cfg.parallel.offload != "none":
        raise ShardfitError("a pass of several models keeps the adapters on the device", where="parallel.offload",
                            fix="run the models one after another (model=name), or parallel.offload=none")
    if any(isinstance(m, MoE) for m in engine.model.modules()):
        raise ShardfitError("a pass of several models on an MoE model: the load-balancing term is not per model",
                            where="model", fix="run the models one after another (model=name)")
    layers = [m for m in engine.model.modules() if isinstance(m, LoRAModule)]
    # the linear layers' adapters (LoRALinear, and over an FP8 or NF4 base) take a stack; the embedding's and the
    # output head's do not
    other = [type(m).__name__ for m in layers if not hasattr(type(m), "lora_stack")]
    if other or len(engine.models.params) != 2 * len(layers):
        raise ShardfitError(f"a pass of several models adapts linear layers only; this engine also adapts "
                            f"{', '.join(sorted(set(other))) or 'MoE experts'}", where="lora.targets",
                            fix="leave embed_tokens, lm_head and experts out of lora.targets, or run the models one "
                            "after another (model=name)")
    shard_group(engine.models.params)  # plain FSDP, or one process
    return layers


def _check_pass(engine, loss: Loss) -> list[nn.Module]:
    """The layers the pass stacks; refusals of the engine and the loss in one line (the micro-batches': _Counted)."""
    if loss.mean_over_tokens:
        raise ShardfitError("a pass of several models takes a coefficient loss (each model normalised over its own "
                            "datums), not a mean over the whole pass's tokens", where="loss",
                            fix="use TokenLoss with per-model coefficients (the RL API makes them)")
    return check_engine(engine)


def _stack(engine, layers: list[nn.Module], models: list[str], grad: bool) -> AdapterStack:
    """Steps 1 and 2: the K models' adapters gathered whole (one all-gather) and stacked per layer; grad: leaves
    that take the pass's gradients (forward_backward), else plain tensors (forward)."""
    reg, k = engine.models, len(models)
    params = reg.params
    at = {id(p): i for i, p in enumerate(params)}
    whole = gather_whole(params, [reg.shards(m) for m in models], shard_group(params))  # [K][P] whole tensors
    a = [torch.cat([whole[j][at[id(mod.lora_A)]] for j in range(k)]).requires_grad_(grad) for mod in layers]
    b = [torch.cat([whole[j][at[id(mod.lora_B)]].t() for j in range(k)]).requires_grad_(grad) for mod in layers]
    return AdapterStack(layers, a, b, k, layers[0].lora_rank,
                        mixed_precision(engine.cfg.compute, engine.device).param_dtype or torch.float32)


class _Counted:
    """The pass's micro-batches, each checked (its slots) and counted per model on the host as the Engine's loop
    makes it: `batches`, LazyBatches over the caller's (engine/batch.py: each made when the loop reaches it, its
    document mask's host time under the GPU's work of the micro-batches before it). Listing them first to check and
    count them built every mask of the pass before its first forward, with the GPU idle (~2.3 ms of host time a flex
    mask in benchmarks/README.md's RL forward: ~130 ms for the 57 micro-batches of the 8B clients benchmark's pass
    of 15 models), where K passes of one hide theirs. A bad micro-batch (a packing bug) is refused when reached: no
    model's gradients have changed by then (they take the stack's in step 4, after the last backward)."""

    def __init__(self, batches, k: int):
        self.source = batches if isinstance(batches, Sequence) else list(batches)
        self.k = k
        self.counts: list[tuple[torch.Tensor, torch.Tensor] | None] = [None] * len(self.source)
        self.batches = LazyBatches(len(self.source), self._make, total_capacity(self.source))

    def _make(self, i: int) -> PackedBatch:
        b, k = self.source[i], self.k
        if b.slots is None:
            raise ShardfitError(f"micro-batch {i} has no slots (each token's model)", where="PackedBatch.slots",
                                fix="pack the datums with their model's index (rl/pack.py's datum_batches slots=)")
        # bin 0 takes padding (slot -1) and, for the loss tokens, labels of -100: one bincount, no boolean indexing,
        # whose nonzero cost ~8 ms a [4096] row on a 2-core host (a count per model and micro-batch: K x M reads)
        bins = b.slots.flatten() + 1
        real = torch.bincount(bins, minlength=k + 1)
        if real.numel() > k + 1:
            raise ShardfitError(f"micro-batch {i} names model {real.numel() - 2} of {k}", where="PackedBatch.slots",
                                fix="index the model list given as model=")
        tokens = torch.bincount(torch.where(b.labels.flatten() != -100, bins, 0), minlength=k + 1)
        self.counts[i] = tokens[1:], real[1:]  # by index: a micro-batch made twice is counted once
        return b

    def sums(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """Per model, this rank's loss tokens and real tokens [K] each (float64 on `device`, copied without a host
        sync: called after the last backward is queued), of every micro-batch made."""
        zero = torch.zeros(self.k, dtype=torch.long)
        tokens = sum((c[0] for c in self.counts if c is not None), zero)
        real = sum((c[1] for c in self.counts if c is not None), zero)
        return (to_device(tokens.double(), device), to_device(real.double(), device))


def _per_model_stats(stats: StepStats, k: int) -> list[StepStats]:
    """The pass's StepStats -> one per model: its columns (squared gradient norm, loss sum, loss tokens, real
    tokens: the 4 x K appended to every rank's row, model after model per column) in the usual places."""
    base = stats.rows.shape[1] - 4 * k
    out = []
    for j in range(k):
        rows = stats.rows[:, :base].clone()
        for col, at_col in ((_SQNORM, 0), (_LOSS, 1), (_TOKENS, 2), (_REAL, 3)):
            rows[:, col] = stats.rows[:, base + at_col * k + j]
        rows[:, _NONFINITE] = (~torch.isfinite(rows[:, _LOSS])).double()
        out.append(StepStats(rows, stats.capacity, False, stats.outputs, stats.phases))
    return out


def forward_models(engine, batches: list[PackedBatch], loss: Loss, models, fingerprint: int | None
                   ) -> list[StepStats]:
    """Engine.forward(..., model=[...]): the pass of forward_backward_models without its backward (no gradient, no
    reduce-scatter): each model's per-token outputs and loss sum, one StepStats per model, none pending. The
    adapters are gathered again for each pass (one all-gather, as forward_backward's): a cache of the stack would
    hold K whole adapters between calls (module docstring: 174 MB a model at the 8B shape, r = 16) and would have
    to follow every optim_step, load_state and add_model of each model; the gather is one collective of the
    adapters, small beside the pass's forward. One model is Engine.forward with that model in the slot, bit for
    bit."""
    models = check_models(engine, models)
    if len(models) == 1:
        engine.using(models[0])
        return [engine.forward(batches, loss, fingerprint)]
    k = len(models)
    layers = _check_pass(engine, loss)
    engine.finish()  # a launched overlapped step writes the slot's adapters
    stack = _stack(engine, layers, models, grad=False)
    counted = _Counted(batches, k)
    per_model = _PerModelLoss(loss, stack, k, engine.device)

    def count() -> torch.Tensor:  # [sq norms K (none: 0), loss sums K, tokens K, real K]
        tokens, real = counted.sums(engine.device)
        return torch.cat([torch.zeros_like(tokens), per_model.sums.double(), tokens, real])

    stack.install()
    try:
        with torch.no_grad(), engine.gathered_pass():
            stats = engine._pass(counted.batches, per_model, backward=False, fingerprint=fingerprint,
                                 after_backward=count)
    finally:
        stack.remove()
    engine._check_fingerprint(stats, fingerprint)  # nothing pending to drop
    return _per_model_stats(stats, k)


def forward_backward_models(engine, batches: list[PackedBatch], loss: Loss, models, fingerprint: int | None
                            ) -> list[StepStats]:
    """Engine.forward_backward(..., model=[...]): one StepStats per model (module docstring)."""
    models = check_models(engine, models)
    if len(models) == 1:  # today's pass, bit for bit: the model in the slot
        engine.using(models[0])
        return [engine.forward_backward(batches, loss, fingerprint)]
    k, reg = len(models), engine.models
    layers = _check_pass(engine, loss)
    engine.finish()  # a launched overlapped step writes the slot's adapters and owns its gradients
    for m in models:  # a first pass of a mean over tokens: its factor folded now (Engine._fold_pending)
        if reg.pending(m) and reg.pending(m)[0].mean_over_tokens:
            fold_first_mean(reg.pending(m), reg.grads(m))
    params = reg.params
    at = {id(p): i for i, p in enumerate(params)}
    stack = _stack(engine, layers, models, grad=True)
    a, b, rank = stack.a, stack.b, stack.rank
    counted = _Counted(batches, k)
    per_model = _PerModelLoss(loss, stack, k, engine.device)

    def reduce_and_count() -> torch.Tensor:
        """Step 4: the stacked gradients onto each model's shards; [sq norms K, loss sums K, tokens K, real K]."""
        grads = []
        for j in range(k):
            rows = slice(j * rank, (j + 1) * rank)
            g = {}
            for mod, ta, tb in zip(layers, a, b):
                ga = ta.grad[rows] if ta.grad is not None else torch.zeros_like(ta[rows])
                gb = tb.grad[rows] if tb.grad is not None else torch.zeros_like(tb[rows])
                g[at[id(mod.lora_A)]], g[at[id(mod.lora_B)]] = ga, gb.t().contiguous()
            grads.append([g[i] for i in range(len(params))])
        shards = reduce_to_shards(params, grads, shard_group(params))
        sq = []
        for m, shard in zip(models, shards):
            own = reg.grads(m)
            torch._foreach_add_(own, shard)
            sq.append(grad_sq_norm(own, engine.device))
        return torch.cat([torch.stack(sq), per_model.sums.double(), *counted.sums(engine.device)])

    stack.install()
    try:
        stats = engine._pass(counted.batches, per_model, backward=True, fingerprint=fingerprint,
                             after_backward=reduce_and_count)
    finally:
        stack.remove()
    out = _per_model_stats(stats, k)
    for m, own in zip(models, out):
        reg.pending(m).append(own)
    engine._check_fingerprint(stats, fingerprint, drop=lambda: [reg.drop_gradients(m) for m in models])
    return out


class _PerModelLoss(Loss):
    """The caller's coefficient loss, with the stack told each micro-batch's tokens' models first, and its per-token
    terms c_t l_t summed per model (a [K] sum on the device, read in the pass's collective)."""

    mean_over_tokens = False

    def __init__(self, loss: Loss, stack: AdapterStack, k: int, device: torch.device):
        self.loss, self.stack, self.outputs = loss, stack, loss.outputs
        self.sums = torch.zeros(k, dtype=torch.float32, device=device)

    def __call__(self, model, b):
        self.stack.set_rows(b.slots)
        total, out = self.loss(model, b)
        if "terms" not in out:
            raise ShardfitError(f"{type(self.loss).__name__} gives no per-token terms to sum per model", where="loss",
                                fix="use TokenLoss (engine/losses.py) or PairLoss (engine/preference.py)")
        terms = out["terms"].detach().float()
        own = b.slots >= 0
        self.sums.index_add_(0, torch.where(own, b.slots, 0), torch.where(own, terms, 0.0))
        return total, out
