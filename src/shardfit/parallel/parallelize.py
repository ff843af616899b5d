"""Apply FP8, sequence and expert parallelism, activation checkpointing, compilation and FSDP2 to a model built on the
meta device. Why each step comes where it does: docs/architecture.md, "The layout".

The order is fixed and each step relies on the previous ones:
  0. module swaps on the meta model, so that everything after sees the final modules: FP8 Float8Linear layers
     (parallel/fp8.py), then LoRA adapters on them and the frozen base in the compute dtype (adapters/lora.py), the
     adapted linear layers' base in NF4 or FP8 with model.quantize (adapters/quantized.py), Ulysses around each
     attention kernel (parallel/ulysses.py), expert weights as DTensors over the EP group and each MoE layer's exchange
     (parallel/expert.py);
  1. activation checkpointing of each block's forward (non-reentrant; parameter names stay Hugging Face's);
  2. torch.compile of each block's forward, checkpoint included (FSDP's hooks, added next, stay outside the graph);
  3. fully_shard each block (its experts first, as a group of their own or left out when E = W), the embedding and
     an untied head, then the root, over a 1-D mesh of every rank or a (replicate R, shard W/R) HSDP mesh;
  4. explicit prefetch, if asked; 5. to_empty on the target device: each rank allocates only its own shards;
  6. init_weights / init_buffers on the shards, from (seed, parameter name) alone (quantised weights drawn the same
     way, then quantised); LoRA adapters likewise, always.
With parallel.offload=all (parallel/offload.py) step 3 gives every group FSDP2's CPU offload policy, step 5 puts the
shards in host memory, and step 6 draws on the device and copies into the host shards. Every rank runs the same steps
in the same order (mesh creation is a collective).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy, OffloadPolicy, fully_shard
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from shardfit.adapters.fp8_base import quantized_class  # with qlora: registers shardfit::fp8_linear, ::nf4_linear
from shardfit.adapters.lora import apply_lora, freeze_base, init_adapters
from shardfit.adapters.quantized import apply_quantized, init_quantized
from shardfit.config.schema import ComputeConfig, LoraConfig, ParallelConfig
from shardfit.models.moe import MoE
from shardfit.parallel.compile_watch import watch_compile
from shardfit.parallel.dtensor import local_view
from shardfit.parallel.expert import ExpertExchange, LocalExperts, apply_expert_parallel, shard_experts
from shardfit.parallel.expert_overlap import FullyOverlappedExpertExchange, OverlappedExpertExchange
from shardfit.parallel.fp8 import apply_fp8
from shardfit.parallel.layout import Meshes, ParallelLayout, check_offload, check_replicate
from shardfit.parallel.offload import materialize_offloaded, offload_policy, step_threads
from shardfit.parallel.ulysses import apply_sequence_parallel

# Selective checkpointing keeps the outputs of the expensive ops (matmuls and attention) and recomputes the cheap
# elementwise ones (norms, RoPE, SiLU): most of full checkpointing's memory saving for a few percent of recompute.
_SAVE_OPS = {
    torch.ops.aten.mm.default,
    torch.ops.aten.addmm.default,
    torch.ops.aten.bmm.default,
    torch.ops.aten._scaled_dot_product_flash_attention.default,
    torch.ops.aten._scaled_dot_product_efficient_attention.default,
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default,
    torch.ops.aten._scaled_mm.default,  # FP8 matmuls (compute.fp8): as expensive to recompute as the bf16 ones
}
# Document-masked attention (models/attention.py): FlashAttention's varlen forward, called directly or through
# torch.nn.attention.varlen's custom op (the op selective checkpointing sees depends on the release).
_SAVE_OPS.add(torch.ops.aten._flash_attention_forward.default)
for _ns, _name in (("aten", "_scaled_dot_product_cudnn_attention"), ("torch_attn", "_varlen_attn")):
    _op = getattr(getattr(torch.ops, _ns), _name, None)
    if _op is not None:
        _SAVE_OPS.add(_op.default)


# A quantised base's frozen matmuls (adapters/qlora.py, adapters/fp8_base.py): custom operators, as expensive to redo
# as the bf16 matmuls they replace
_SAVE_OPS.add(torch.ops.shardfit.nf4_linear.default)
_SAVE_OPS.add(torch.ops.shardfit.fp8_linear.default)
# An adapter's up-projection is a 2-D matmul (F.linear folds [B, S, r] to [B*S, r]): op -> (the input whose last
# dim is the contraction, the weight operand [r, out] whose first dim is it). Batched matmuls (the math attention's
# q k^T when head_dim equals the rank) are never adapters.
_ADAPTER_MATMULS = {torch.ops.aten.mm.default: (0, 1), torch.ops.aten.addmm.default: (1, 2)}


def keeps_output(op, args: tuple, adapter_rank: int = 0) -> bool:
    """Whether selective checkpointing saves op's output. A LoRA adapter's up-projection (h [T, r] @ B^T [r, out]:
    its contraction is the rank) is recomputed: its output is as large as the base matmul's [T, out] while it costs
    2 r FLOPs an element to redo (0.4% of a 4096-wide base's at r=16). Saving it would double what every adapted
    linear keeps (the plan measured selective above no checkpointing for a compiled LoRA block). Its input
    h = A x [T, r] (contraction `in`) stays saved: r/out of the base output's bytes."""
    if op not in _SAVE_OPS:
        return False
    operands = _ADAPTER_MATMULS.get(op)
    if not adapter_rank or operands is None:
        return True
    x, w = (args[i] for i in operands)
    return not (x.shape[-1] == adapter_rank and w.shape[0] == adapter_rank)


def _selective_policy(ctx, op, *args, adapter_rank: int = 0, **kwargs):
    return CheckpointPolicy.MUST_SAVE if keeps_output(op, args, adapter_rank) else CheckpointPolicy.PREFER_RECOMPUTE


def checkpointed_blocks(compute: ComputeConfig, n_blocks: int) -> list[bool]:
    """Which blocks activation checkpointing wraps (parallelize and shardfit plan both ask here): every block under
    selective; under full, block i when i % ac_every == 0 and, with ac_blocks = N, i < N. The FIRST N, not the last:
    at the peak (the end of the forward) every block's saved activations are live whichever are checkpointed, but
    the first blocks' backward comes last, when the later blocks' activations are freed, so their recompute adds
    nothing to the peak (plan/estimate.py counts it so)."""
    mode, every, first = compute.activation_checkpoint, compute.ac_every, compute.ac_blocks
    if mode == "auto":  # a choice for the GPU in hand, made before anything is built (plan/auto_checkpointing.py)
        raise ValueError("compute.activation_checkpoint=auto must be resolved first (Engine does it at start-up)")
    return [mode == "selective" or (mode == "full" and i % every == 0 and (not first or i < first))
            for i in range(n_blocks)]


def apply_activation_checkpointing(blocks: list[nn.Module], mode: str, every: int = 1, first: int = 0,
                                   adapter_rank: int = 0) -> None:
    """Replace each chosen block's forward with a non-reentrant checkpointed call (parameter names unchanged); the
    blocks checkpointed_blocks picks (every: compute.ac_every, first: compute.ac_blocks). adapter_rank: lora.rank
    (0: no adapters), whose up-projections selective checkpointing recomputes."""
    if mode == "none":
        return
    chosen = checkpointed_blocks(ComputeConfig(activation_checkpoint=mode, ac_every=every, ac_blocks=first),
                                 len(blocks))
    policy = functools.partial(_selective_policy, adapter_rank=adapter_rank)
    for i, block in enumerate(blocks):
        if not chosen[i]:
            continue
        inner = block.forward
        if mode == "selective":
            context_fn = functools.partial(create_selective_checkpoint_contexts, policy)
        else:
            context_fn = None

        def forward(*args, _inner=inner, _ctx=context_fn, **kwargs):
            extra = {"context_fn": _ctx} if _ctx is not None else {}
            return checkpoint(_inner, *args, use_reentrant=False, **extra, **kwargs)

        block.forward = forward


def apply_compile(blocks: list[nn.Module]) -> None:
    # Identical blocks share one compiled graph (modules are inlined, parameters are graph inputs), so the compile
    # cost is paid once, not once per layer. Past recompile_limit variants dynamo runs the rest eager, saying so
    # only in one warning: the watch turns it into the user's line and StepRecord.compile_fallbacks.
    watch_compile()
    for block in blocks:
        block.forward = torch.compile(block.forward)


def mixed_precision(cfg: ComputeConfig, device: torch.device) -> MixedPrecisionPolicy:
    """bf16 compute with fp32 gradient reduction on GPU; fp32 throughout on CPU (gloo and CPU kernels)."""
    if cfg.param_dtype == "auto":
        param = torch.bfloat16 if device.type == "cuda" else torch.float32
    else:
        param = getattr(torch, cfg.param_dtype)  # the config allows only dtype names
    return MixedPrecisionPolicy(param_dtype=param, reduce_dtype=getattr(torch, cfg.reduce_dtype))


def apply_fsdp(model: nn.Module, blocks: list[nn.Module], layout: ParallelLayout, meshes: Meshes,
               mp: MixedPrecisionPolicy, cfg: ParallelConfig,
               offload: Callable[[int | None], OffloadPolicy] = lambda block: OffloadPolicy()):
    # offload(i) is block i's offload policy, offload(None) that of the other groups (parallel/offload.py: with
    # offload=all every group's shards live on the host, but for the first offload_gpu_blocks blocks).
    off = {"offload_policy": offload(None)}
    mesh = meshes.fsdp
    ignored: set[nn.Parameter] = set()  # expert weights kept out of FSDP (parallel/expert.py: E = W)
    for i, block in enumerate(blocks):
        # The last block's parameters are needed again at once by backward: keeping them gathered saves one
        # all-gather per step (with offload, also one host-to-device copy of its shard) at the cost of one block's
        # unsharded weights.
        reshard = cfg.reshard_after_forward and i < len(blocks) - 1
        own = (shard_experts(block, layout, meshes.expert, mp, reshard_after_forward=reshard) if meshes.expert
               else set())
        ignored |= own
        fully_shard(block, mesh=mesh, mp_policy=mp, reshard_after_forward=reshard, offload_policy=offload(i),
                    **({"ignored_params": own} if own else {}))
    if not model.cfg.tie_embeddings:
        # Untied, the embedding and the output head are groups of their own (tied, one parameter with two users, they
        # stay in the root group). The step's first all-gather is then the embedding alone; the head's is issued
        # while the last blocks still compute; and the head's reduce-scatter starts as soon as the loss's backward
        # is done, under the blocks' backward, instead of with the root group's at the very end, exposed. Neither is
        # resharded after forward, as the root group is not: the memory is what it was in the root group.
        fully_shard(model.model.embed_tokens, mesh=mesh, mp_policy=mp, reshard_after_forward=False, **off)
        fully_shard(model.lm_head, mesh=mesh, mp_policy=mp, reshard_after_forward=False, **off)
    fully_shard(model, mesh=mesh, mp_policy=mp, reshard_after_forward=cfg.reshard_after_forward, **off,
                **({"ignored_params": ignored} if ignored else {}))
    if cfg.prefetch > 0:
        for i, block in enumerate(blocks):
            after = blocks[i + 1:i + 1 + cfg.prefetch]
            before = blocks[max(0, i - cfg.prefetch):i][::-1]
            if after:
                block.set_modules_to_forward_prefetch(after)
            if before:
                block.set_modules_to_backward_prefetch(before)
    return model


def select_attention_kernel(kind: str) -> None:
    """Restrict SDPA to one CUDA kernel (process-wide; compile reads the same flags when it traces). If that kernel
    cannot run a call (head size, dtype), SDPA raises at the first step rather than silently falling back."""
    if kind == "auto":
        return
    b = torch.backends.cuda
    b.enable_flash_sdp(kind == "flash")
    b.enable_cudnn_sdp(kind == "cudnn")
    b.enable_mem_efficient_sdp(kind == "efficient")
    b.enable_math_sdp(False)


@dataclass
class ParallelizeReport:
    """What parallelize did, for the caller's notices and for the step: the layout whose meshes the model is sharded
    over, and what the config's choices came to."""

    layout: ParallelLayout
    fp8_layers: int = 0  # linear layers swapped for FP8 ones (parallel/fp8.py)
    loss_compiled: bool = False  # the loss's per-chunk softmax and gradient compiled (CausalLM.use_compiled_loss)
    offload_notice: str | None = None  # offload=all: where the states live and the CPU step's threads
    lora_targets: list[str] | None = None  # the modules that carry LoRA adapters (lora.rank > 0)
    quantized_layers: int = 0  # adapted linear layers whose base is quantised (model.quantize=nf4|fp8)


def parallelize(model: nn.Module, layout: ParallelLayout, *, parallel: ParallelConfig, compute: ComputeConfig,
                lora: LoraConfig, quantize: str, device: torch.device, seed: int,
                init: bool = True, frozen: bool = False) -> ParallelizeReport:
    """Meta model in, sharded and initialised in place over `layout` (built once per rank:
    ParallelLayout.from_config), as `parallel` places it and `compute` asks; `lora` and `quantize` (model.quantize)
    for the adapters and a quantised base. See the module docstring for the order.

    init=False leaves the weights uninitialised (a checkpoint is loaded next) and only rebuilds the buffers.
    frozen=True (no LoRA): every parameter frozen and stored in the compute dtype, as a LoRA run's base (a model that
    is sampled and scored, never trained: serve/served.py).
    """
    cfg, world_size = parallel, layout.world
    check_replicate(cfg.replicate, world_size)
    check_offload(cfg, compute.fp8)
    moe = any(isinstance(m, MoE) for m in model.modules())
    if layout.moe != moe:  # the planner's and a test's model may differ from the config's: the model decides
        layout = dataclasses.replace(layout, moe=moe)
    meshes = layout.meshes(device.type)  # every mesh, once, in the same order on every rank
    report = ParallelizeReport(layout)
    blocks = list(model.model.layers)
    capability = None
    if device.type == "cuda":
        select_attention_kernel(compute.attention)
        capability = torch.cuda.get_device_capability(device)
    report.fp8_layers = apply_fp8(model, compute, device.type, capability)  # 0
    mp = mixed_precision(compute, device)
    if lora.rank:  # 0
        # After FP8: its swap takes plain nn.Linear layers only, and an adapter on a Float8Linear keeps the base
        # matmul in FP8 (the adapter's own runs in the compute dtype). Before FSDP: fully_shard reads requires_grad
        # and dtypes when it builds each group. The frozen base is stored in the compute dtype (bf16 on CUDA): no
        # fp32 master to keep for weights that never change. One FSDP group then holds a frozen bf16 base and fp32
        # adapters: FSDP2 (torch >= 2.6) needs one original dtype among the parameters that train (the adapters:
        # fp32) and casts every parameter to param_dtype for the all-gather (no cast for the base); gradients are
        # reduced for the adapters only, in reduce_dtype.
        report.lora_targets = apply_lora(model, lora, mp.param_dtype)
        if quantize != "none":
            # QLoRA (nf4) or an FP8 base: the adapted linear layers' base becomes storage carried bit for bit in
            # the base's dtype (param_dtype, so FSDP shards it along dim 0 and gathers it uncast);
            # adapters/quantized.py.
            report.quantized_layers = apply_quantized(model, report.lora_targets, quantized_class(quantize),
                                                      fused=compute.compile)
    elif frozen:  # weights that never change need no fp32 master: stored as FSDP casts them for the forward
        freeze_base(model, mp.param_dtype)
    if meshes.sequence is not None:
        apply_sequence_parallel(model, meshes.sequence)  # 0
    if meshes.expert is not None:  # EP, or one rank's experts out of FSDP (LocalExperts)
        exchange = {"none": ExpertExchange, "dispatch": OverlappedExpertExchange,
                    "both": FullyOverlappedExpertExchange}[cfg.expert_overlap] if world_size > 1 else LocalExperts
        apply_expert_parallel(model, meshes.expert, exchange)  # 0
    apply_activation_checkpointing(blocks, compute.activation_checkpoint, compute.ac_every, compute.ac_blocks,  # 1
                                   lora.rank)
    if compute.compile:
        apply_compile(blocks)  # 2
        # The loss's per-chunk softmax and gradient too (one fused kernel instead of ~8 passes over each fp32
        # [chunk, vocab] buffer); its matmuls stay outside, as cuBLAS calls.
        model.use_compiled_loss(compute.compile_loss)
        report.loss_compiled = compute.compile_loss
    # FSDP shards over every rank, sequence-parallel peers included: each holds 1/world of the parameters (HSDP:
    # 1/(world/R)). The sequence-parallel groups and the data each rank reads do not depend on R.
    policy = functools.partial(offload_policy, cfg, device)
    apply_fsdp(model, blocks, layout, meshes, mp, cfg, policy)  # 3, 4
    adapters = report.lora_targets is not None
    if cfg.offload == "all":
        materialize_offloaded(model, device, seed, init, adapters)  # 5, 6
        report.offload_notice = step_threads(device)
        return report
    model.to_empty(device=device)  # 5
    if init:
        model.init_weights(seed, view=local_view)  # 6
        init_quantized(model, seed, view=local_view)  # quantised weights: drawn as above, then quantised
    else:
        model.init_buffers()
    if adapters:  # drawn whatever the base's source (a resume or lora.adapter loads over them)
        init_adapters(model, seed, view=local_view)
    return report
