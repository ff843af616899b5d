"""One rank's predicted peak allocated GPU memory, term by term, for a config, a world size and a micro-batch.

  states       fp32 parameters, Adam's two moments and fp32 gradients (16 B/param) over the shard group (world, or
               world / parallel.replicate under HSDP); freed gradients (memory.keep_grads=false) are counted as
               idle cache, not peak, unless micro-batches accumulate; parallel.offload moves states to host memory.
               LoRA (lora.rank): 16 B per adapter parameter, the frozen base as stored (adapters.py)
  fsdp         bf16 gathered parameters: the root group, the running and the prefetched block (the running one
               alone on a shard group of one); offload=all adds one block's shards in transit
  activations  per block what activation_trace.py counts for its checkpointing mode, times the blocks
  working      the larger of the fused loss's buffers and one block's backward with what exists only then (one
               fp32 reduce-scatter input, LoRA: the adapters'; QLoRA's one dequantised weight), less a frozen head's
               gathered weight, which FSDP frees before the blocks' backward
  host         what parallel.offload keeps in host memory per rank (pinned shards rounded to powers of two)
The model is built once on the meta device per config (shapes only) to count parameters per block. fits() compares
an estimate with the allocation budget of a GPU and, for freed gradients, their cached pool besides. MoE terms come
from moe.py, what a block saves from activation_trace.py. Every figure is bytes. Design, the reasoning behind each
term and the measurements that check it: docs/memory-plan.md.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

import torch

from shardfit.config.schema import ComputeConfig, Config, ModelConfig
from shardfit.config.shape import StepShape
from shardfit.parallel.fp8 import fp8_linears, gathers_in_fp8
from shardfit.plan import adapters, moe
from shardfit.plan.activation_trace import block_activation_bytes, compute_dtype, model_key

GiB = 1 << 30
CUDA_CONTEXT = GiB // 2  # what the CUDA context takes of a GPU's memory, outside the allocator's counts
LOSS_CHUNK_BYTES = 10  # the fused loss's buffers for each logit of one chunk, eager or compiled (see estimate)


@functools.lru_cache(maxsize=4)
def _meta_model(model: tuple) -> torch.nn.Module:
    """The model built on meta (shapes only), once per model config: the proposals ask for hundreds of estimates."""
    from shardfit.models import build_model

    with torch.device("meta"):
        return build_model(ModelConfig(**dict(model)))


@functools.lru_cache(maxsize=16)
def _param_counts(model: tuple, fp8: str, fp8_all_gather: bool) -> tuple[int, tuple[int, ...], int]:
    """(parameters, parameters of each block, the largest block's weights all-gathered in FP8)."""
    built = _meta_model(model)
    blocks = tuple(sum(p.numel() for p in b.parameters()) for b in built.model.layers)
    fp8_bytes = 0
    if gathers_in_fp8(ComputeConfig(fp8=fp8, fp8_all_gather=fp8_all_gather)):
        fp8_bytes = max(sum(mod.weight.numel() for _, mod in fp8_linears(b, fp8, True, f"model.layers.{i}."))
                        for i, b in enumerate(built.model.layers))
    return sum(p.numel() for p in built.parameters()), blocks, fp8_bytes


@functools.lru_cache(maxsize=256)
def pinned_shard_bytes(model: tuple, shard: int, gpu_blocks: int = 0, element: int = 4) -> int:
    """Pinned host bytes of one rank's parameter shards (fp32; a LoRA run's frozen base: element, its compute dtype)
    under offload=all: FSDP2 pins each shard (dim 0 split over `shard` ranks, padded to a whole row count) as an
    allocation of its own, and PyTorch's pinned allocator rounds each up to a power of two. The fp32 gradient shards
    copied back are pinned the same way: the same bytes again. The first gpu_blocks blocks' shards stay on the GPU
    (parallel.offload_gpu_blocks): not counted."""
    built = _meta_model(model)
    kept = {id(p) for b in built.model.layers[:gpu_blocks] for p in b.parameters()}
    total = 0
    for p in (p for p in built.parameters() if id(p) not in kept):
        rows = -(-p.shape[0] // shard) if p.dim() else 1
        nbytes = element * rows * (p[0].numel() if p.dim() else 1)
        total += 1 << max(0, (nbytes - 1).bit_length())  # the next power of two
    return total


@dataclass
class Estimate:
    """One rank's predicted memory in bytes, term by term (a measured peak can be compared with each term)."""

    micro_batch: int
    weights: int  # fp32 sharded parameters on the GPU (0 with parallel.offload=all)
    grads: int  # fp32 gradients on the GPU: sharded (kept, or live during accumulation), or the unsharded model's
    moments: int  # Adam's exp_avg and exp_avg_sq on the GPU (0 with any parallel.offload)
    fsdp: int
    activations: int
    working: int
    offload_copies: int = 0  # offload=all: shards in transit between host and GPU (see estimate)
    idle_cache: int = 0  # freed gradients cached in the reduce-scatter stream's pool (see fits); not in the peak
    host: int = 0  # states this rank keeps in host memory (parallel.offload); not in the peak

    @property
    def states(self) -> int:
        return self.weights + self.grads + self.moments

    @property
    def peak(self) -> int:
        return self.states + self.fsdp + self.offload_copies + self.activations + self.working


def as_rows(cfg: Config) -> Config:
    """Token-budget micro-batches (train.micro_batch_tokens = T) as the plan counts them: each forward/backward is
    one [1, T] row of whole examples (document-masked kernels save what a plain row of T tokens saves), so the
    configured case is micro-batch 1 at sequence T, and "micro-batch k" in the table means k such rows. The global
    batch (examples) stays: above one row per rank it counts as accumulation, which keeps gradients live."""
    shape = StepShape.of(cfg)
    if not shape.by_tokens:
        return cfg
    return dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, seq_len=shape.budget),
                               train=dataclasses.replace(cfg.train, micro_batch=1, micro_batch_tokens=0))


@dataclass
class _Trained:
    """What a run keeps of its parameters, counted once per estimate: full fine-tuning trains every parameter (fp32
    master, gradient, moments); a LoRA run trains its adapters and stores the frozen base as it is (adapters.py)."""

    params: int  # parameters that train, whole model
    block_params: tuple[int, ...]  # of each block
    frozen_bytes: int  # the frozen base as stored, whole model (0: full fine-tuning)
    block_frozen_bytes: tuple[int, ...]
    lora: adapters.Counts | None


def _trained(cfg: Config, n_params: int, block_params: tuple[int, ...], element: int) -> _Trained:
    if not cfg.lora.rank:
        return _Trained(n_params, block_params, 0, (0,) * len(block_params), None)
    c = adapters.counts(_meta_model(model_key(cfg.model)), adapters.lora_key(cfg), adapters.quantize(cfg), element)
    return _Trained(c.adapters, c.block_adapters, c.base_bytes, c.block_base_bytes, c)


def adapter_params(cfg: Config) -> tuple[int, int]:
    """(parameters that train, parameters of the model): every one, or under LoRA the adapters' of the base's."""
    m, comp = cfg.model, cfg.compute
    n_params, block_params, _ = _param_counts(model_key(m), comp.fp8, comp.fp8_all_gather)
    return _trained(cfg, n_params, block_params, compute_dtype(comp).itemsize).params, n_params


def estimate(cfg: Config, world: int, micro_batch: int) -> Estimate:
    from shardfit.config.schema import is_moe_layer
    from shardfit.parallel.parallelize import check_replicate, checkpointed_blocks

    check_replicate(cfg.parallel.replicate, world)
    cfg = as_rows(cfg)  # token budgets: micro_batch counts [1, micro_batch_tokens] rows
    shard = world // cfg.parallel.replicate  # ranks the states are sharded over (HSDP: one replica's group)
    m, par, comp = cfg.model, cfg.parallel, cfg.compute
    element = compute_dtype(comp).itemsize
    n_params, block_params, fp8_bytes = _param_counts(model_key(m), comp.fp8, comp.fp8_all_gather)
    root_params = n_params - sum(block_params)
    t = _trained(cfg, n_params, block_params, element)  # LoRA: adapters train, the base is frozen as stored
    # offload=all keeps only the first offload_gpu_blocks blocks' states on the GPU (parallel/offload.py)
    kept = par.offload_gpu_blocks
    offloaded = par.offload == "all"
    on_gpu = sum(t.block_params[:kept]) if offloaded else t.params
    frozen_on_gpu = sum(t.block_frozen_bytes[:kept]) if offloaded else t.frozen_bytes
    # fp32 weights, Adam's two fp32 moments, fp32 gradients of what trains; the frozen base as stored
    weights, moments, sharded_grads = (frozen_on_gpu + 4 * on_gpu) // shard, 8 * on_gpu // shard, 4 * on_gpu // shard
    # under offload=all the step runner frees every gradient after the step, the GPU-kept blocks' too (offload.py)
    keep = cfg.memory.keep_grads and not offloaded
    # experts outside FSDP (E = W) free their gradients after every step whatever keep says (step_overlap.zero_grads)
    # and the backward writes them again as it frees the activations: added below, never idle in FSDP's pool. A LoRA
    # run's experts are frozen, stored in the compute dtype (no cast held or recomputed); what trains there is their
    # adapters, if lora.targets names them (adapters/expert_lora.py), which sit where the experts sit
    experts = moe.expert_params(_meta_model(model_key(m)))
    outside = moe.outside_fsdp_params(experts, par.expert_parallel, world, par.offload)
    trained_experts = (t.lora.block_expert_adapters if t.lora else experts)  # parameters that train, per block
    fresh = 4 * moe.outside_fsdp_params(trained_experts, par.expert_parallel, world, par.offload)
    grads, idle_cache = (sharded_grads - fresh, 0) if keep else (0, sharded_grads - fresh)  # freed: cached (fits)
    unsharded = 0
    accumulating = cfg.train.global_batch > micro_batch * (world // par.sequence_parallel)
    if accumulating:
        if not par.reduce_every_micro_batch:
            # accumulated unsharded in fp32 between micro-batches, on every GPU (EP: a rank's n/E experts; E = W: fresh)
            unsharded = 4 * (t.params - sum(trained_experts)
                             + (0 if fresh else sum(trained_experts) // par.expert_parallel))
        elif not keep:
            grads, idle_cache = sharded_grads - fresh, 0  # live from the first micro-batch on: allocated, not idle
    host = copies = 0
    if offloaded:  # FSDP2's CPUOffloadPolicy: the other groups' sharded states in host memory
        host, copies = _offloaded(cfg, t, shard, n_params, on_gpu, element)
    grads += unsharded  # the unsharded accumulation stays on the GPU, offload or not
    # gathered params of the root and two blocks in the compute dtype (EP: only a rank's n/E experts, moe.py); the
    # fp32 reduce-scatter input is a block's backward's (in_backward, counted in working); FP8 all-gather gathers
    # the converted weights at 1 byte each. The same with offload=all. LoRA: the base as stored, the adapters cast;
    # only the adapters' gradients are reduced
    gathered = moe.gathered_params(block_params, experts, par.expert_parallel, outside > 0)
    running = gathered_blocks(shard)
    if t.lora:
        adapted = moe.gathered_params(t.block_params, trained_experts, par.expert_parallel, outside > 0)
        blocks = adapters.adapted_block_bytes(t.lora, gathered, adapted, element)
        root = t.frozen_bytes - sum(t.block_frozen_bytes) + (t.params - sum(t.block_params)) * element
        fsdp = root + running * (max(blocks) - fp8_bytes)
        # backward only: the adapters' fp32 reduce-scatter input (FSDP's post-backward), QLoRA's one weight
        # dequantised at a time (inside an NF4 layer's forward or backward; none at the loss), an FP8 base's codes
        in_backward = 4 * max(adapted) + adapters.dequant_bytes(t.lora)
    else:
        big_block = max(gathered)
        fsdp = 2 * root_params + running * (2 * big_block - fp8_bytes)
        in_backward = 4 * big_block  # the fp32 reduce-scatter input, made by FSDP's post-backward
    mode = comp.activation_checkpoint
    fsdp += moe.outside_transient_bytes(trained_experts, cfg, element) if fresh else 0
    kinds = {is_moe_layer(m, i) for i in range(m.n_layers)}
    per_block = {k: block_activation_bytes(cfg, micro_batch, layer=next(
        i for i in range(m.n_layers) if is_moe_layer(m, i) == k), world=world) for k in kinds}
    chosen = checkpointed_blocks(comp, m.n_layers)  # the blocks parallelize checkpoints (ac_every, ac_blocks)
    saved = [per_block[is_moe_layer(m, i)][mode] if chosen[i] else
             per_block[is_moe_layer(m, i)]["none"] + moe.held_expert_bytes(
                 trained_experts[i], par.expert_parallel, world, element, par.offload) for i in range(m.n_layers)]
    acts = sum(saved)
    # fresh expert gradients replace activations in backward (the larger counts), or stay between micro-batches
    grads += fresh if accumulating else max(0, fresh - acts)
    tokens = micro_batch * cfg.data.seq_len // par.sequence_parallel
    # the fused loss keeps dloss/dh [tokens, D] and dloss/dW [V, D] in bf16 (a frozen head: none; an adapter on it:
    # the merged weight too), and one logits chunk [c, V] at 10 B a logit: eager, bf16 logits, an fp32 copy and
    # logsumexp's fp32 temporary; compiled (compile_loss), bf16 logits, the fp32 probabilities Inductor writes for
    # scatter_add_, the chunk's bf16 gradient and the previous chunk's, still bound to `g` until the call returns
    # (models/loss.py; at [1024, 128,256]: 250.5 + 501 + 250.5 + 250.5 MiB, as snapshots show: docs/memory-plan.md)
    head = 1 if not t.lora else 2 if t.lora.head_trains else 0  # [V, D] buffers: dW; LoRA's merged weight and dW
    loss = tokens * m.dim * 2 + head * m.vocab_size * m.dim * 2 + comp.loss_chunk * m.vocab_size * LOSS_CHUNK_BYTES
    # backward of one block: gradients of its input and output, of the gate and up projections' outputs, expert
    # parallelism's exchange buffers, and a checkpointed block's recomputed tensors on top of what is still saved
    # then (recompute_on_top; compiled and fully checkpointed, an adapted MLP recomputes more than it saves:
    # adapters.recompute_extra); an adapted MLP's extra buffers (adapters.backward_extra)
    extra = adapters.recompute_extra(t.lora, tokens, element) if t.lora and comp.compile and mode == "full" else None
    recomputed = [per_block[is_moe_layer(m, i)]["none"] + (extra[i] if extra else 0) for i in range(m.n_layers)]
    backward = max(2 * b["block_input"] + b["ffn_grads"] + b["exchange"] + recompute_on_top(
        saved, chosen, recomputed, i) for i, b in ((i, per_block[is_moe_layer(m, i)]) for i in range(m.n_layers)))
    backward += adapters.backward_extra(t.lora, tokens, element) if t.lora else 0
    working = max(loss, backward + in_backward - released_head(cfg, t, element))
    return Estimate(micro_batch, weights, grads, moments, fsdp, acts, working, offload_copies=copies,
                    idle_cache=idle_cache, host=host)


def gathered_blocks(shard: int) -> int:
    """Blocks whose gathered parameters are live at once: the running one and the one FSDP2 prefetches (the next in
    forward, the previous in backward). On a shard group of one rank FSDP2's unshard() (the prefetch) allocates
    nothing: the copy of the shards into the gathered parameters is made in wait_for_unshard, when the group itself
    runs (torch.distributed.fsdp._fully_shard._fsdp_param_group), so one block is gathered at a time (one-GPU runs'
    peaks hold one block, never two: benchmarks/README.md#plan-terms)."""
    return 1 if shard == 1 else 2


def released_head(cfg: Config, t: _Trained, element: int) -> int:
    """Bytes of the output head's gathered weight [V, D] gone before any block's backward: an untied head is an FSDP
    group of its own (parallelize.apply_fsdp) whose post-backward reshards it as soon as the loss's backward hands
    dloss/dh on, so the fsdp term's root counts it at the loss but not under a block's backward. Only a frozen head
    (LoRA without an adapter on lm_head): a trained one's post-backward starts its gradient's reduce-scatter, whose
    fp32 [V, D] input takes more than the weight frees, and a tied head is the embedding, used again at the end.
    Snapshots of 4-block runs show it: at the last block's backward peak the gathered parameters are the embedding
    and that block alone, the head freed (benchmarks/README.md#plan-terms)."""
    m = cfg.model
    if not t.lora or t.lora.head_trains or m.tie_embeddings:
        return 0
    return m.vocab_size * m.dim * element


def recompute_on_top(saved: list[int], chosen: list[bool], recomputed: list[int], i: int) -> int:
    """What block i's backward holds above the end of the forward's activations (the peak's): a checkpointed block
    recomputes its forward (recomputed[i]) while the blocks before it still hold what they saved and the later ones
    are freed, so it adds max(0, saved[:i+1] + recomputed[i] - all saved). The last block checkpointed (every block
    is, by default): all of it on top. Checkpointing only the first N of L blocks (compute.ac_blocks): block N-1
    recomputes after L-N blocks' activations are freed, nothing on top. An unrecomputed block: 0."""
    return max(0, sum(saved[:i + 1]) + recomputed[i] - sum(saved)) if chosen[i] else 0


def _offloaded(cfg: Config, t: _Trained, shard: int, n_params: int, on_gpu: int, element: int) -> tuple[int, int]:
    """offload=all: (host bytes per rank, shards in transit on the GPU). Host: gradients copied there after each
    reduce-scatter; parameters and gradients pinned, each shard rounded up to a power of two by the pinned allocator;
    the moments plain host memory. In transit: FSDP2 copies a group's shard to the GPU before its all-gather (the
    prefetched block's, while one computes), and each reduced gradient shard sits on the GPU until its copy to the
    host is done: one offloaded block's shard of each (fp32: 4 B/param/shard twice; LoRA: the base as stored, the
    adapters' fp32 shard and gradient). LoRA: no gradient for the frozen base (NF4 shards counted unrounded)."""
    kept = cfg.parallel.offload_gpu_blocks
    key = model_key(cfg.model)
    if not t.lora:
        host = 2 * pinned_shard_bytes(key, shard, kept) + 8 * (n_params - on_gpu) // shard
        return host, 2 * 4 * max(t.block_params[kept:], default=0) // shard
    base = (pinned_shard_bytes(key, shard, kept, element) if adapters.quantize(cfg) == "none"
            else (t.frozen_bytes - sum(t.block_frozen_bytes[:kept])) // shard)
    host = base + 2 * adapters.pinned_adapter_bytes(t.lora, shard, kept) + 8 * (t.params - on_gpu) // shard
    transit = max((f + 8 * a for f, a in zip(t.block_frozen_bytes[kept:], t.block_params[kept:])), default=0)
    return host, transit // shard


def host_per_node(e: Estimate, world: int, gpus_per_node: int = 8) -> int:
    """Host memory the offloaded states of one node's ranks take: FSDP2 pins the sharded parameters and gradients
    (page-locked: the OS cannot swap them), the moments are plain host memory the CPU step reads in place."""
    return e.host * min(world, gpus_per_node)


HOST_USABLE = 0.9  # of a node's host memory, for the offloaded states


def host_budget(host_gib: float) -> float:
    """Bytes of a host of host_gib the offloaded states may take: 10% is left to the processes themselves (CUDA
    context, libraries, Python, data loading: a few GiB per rank) and to the kernel and page cache (dataset reads,
    checkpoint writes); docs/memory-plan.md has the run that set it."""
    return HOST_USABLE * host_gib * GiB


def host_fits(e: Estimate, world: int, gpus_per_node: int, host_gib: float | None) -> bool:
    """Whether one node's offloaded states fit host_budget (True when no host size is given)."""
    return host_gib is None or host_per_node(e, world, gpus_per_node) <= host_budget(host_gib)


def allocation_budget(device_bytes: float) -> float:
    """Bytes a rank may allocate on a GPU of device_bytes: reserved memory runs a few percent above allocated with
    expandable segments, and the CUDA context takes about half a GiB."""
    return 0.95 * device_bytes - CUDA_CONTEXT


def fits(e: Estimate, budget_bytes: float, device_bytes: float | None = None) -> bool:
    """Within the allocation budget, and (device size given) with freed gradients' idle cache besides: FSDP2 allocates
    the sharded gradients in its reduce-scatter stream's pool, so once freed (memory.keep_grads=false) they stay
    cached there, idle for the compute stream; allocated + that cache + 3 GiB must stay 1.5 GiB under the device's
    memory (docs/memory-plan.md: the runs that set the margin)."""
    if e.peak > budget_bytes:
        return False
    return device_bytes is None or e.peak + e.idle_cache <= device_bytes - 4.5 * GiB
