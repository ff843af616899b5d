"""What one decoder block saves for backward, counted by running it on the meta device (shapes only, no compute).

Eager blocks: every tensor autograd saves is counted once per storage, parameters and views of them excluded
(saved_storages); selective checkpointing keeps the block input and the outputs of the operations
parallel/parallelize.py keeps (counted by a dispatch mode). Attention is the flash kernel's own operator (q, k, v,
output, fp32 log-sum-exp), not the math fallback the meta device would pick. Compiled blocks (compute.compile): a
dense block is traced with AOTAutograd and split by Inductor's min-cut partitioner; an MoE block is compiled by
dynamo with the graph breaks a GPU run has (meta_moe: the model's own MoE.forward with the CUDA grouped-GEMM path);
the tensors each forward graph hands to its backward are counted. Compiled counts are linear in the micro-batch:
traced at 1 and 2 and extended (compiled_line). LoRA runs trace the block with its adapters on a frozen base
(adapters.adapt_block). Every private torch API comes from torch_internals.py.
Shapes: x [B, S, D]; S is a rank's share of data.seq_len under Ulysses. Results are bytes, cached per model config.
Design and measurements: docs/memory-plan.md.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import types

import torch

from shardfit.config.schema import ComputeConfig, Config, ModelConfig
from shardfit.parallel.fp8 import apply_fp8
from shardfit.plan import adapters, moe, torch_internals


def compute_dtype(compute: ComputeConfig) -> torch.dtype:
    """The dtype a GPU run computes in (parallel.mixed_precision: auto is bf16 on CUDA)."""
    return torch.bfloat16 if compute.param_dtype in ("auto", "bfloat16") else torch.float32


def model_key(m: ModelConfig) -> tuple:
    """The model config as a hashable key of the planner's caches."""
    return tuple(dataclasses.asdict(m).items())


def _flash_core(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask=None) -> torch.Tensor:
    """The attention core as the flash kernel runs it (it has a meta implementation; its autograd saves q, k, v, the
    output and a [B, H, S] fp32 log-sum-exp). q [B, S, H, Dh], k/v [B, S, K, Dh] -> [B, S, H, Dh]. Document-masked
    kernels (varlen, flex) save the same tensors: the plan counts packed rows alike."""
    q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    return torch_internals.flash_attention(q, k, v).transpose(1, 2)


@contextlib.contextmanager
def saved_storages(module: torch.nn.Module):
    """Within: every tensor autograd saves for backward, counted once per storage ({storage: bytes}, yielded), the
    module's parameters and views of them excluded (they are counted as weights, not activations)."""
    params = {torch_internals.storage_id(p) for p in module.parameters()}
    seen: dict[int, int] = {}

    def pack(t):
        st = torch_internals.storage_id(t)
        if st not in params:
            seen[st] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        yield seen


def compiled_saved_bytes(block: torch.nn.Module, *inputs: torch.Tensor) -> int:
    """Bytes a compiled dense block's forward saves for backward: AOTAutograd traces forward and backward together
    and Inductor's min-cut partitioner decides what is saved and what is recomputed."""
    names, params = zip(*block.named_parameters())
    saved = []

    def forward_graph(gm, _inputs):
        placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
        param_storages = {torch_internals.storage_id(n.meta["val"]) for n in placeholders[:len(params)]}
        outputs = next(n for n in gm.graph.nodes if n.op == "output").args[0]
        storages = {}
        for node in outputs[1:]:  # the block's output first, then what the backward needs
            val = node.meta.get("val") if isinstance(node, torch.fx.Node) else None
            if isinstance(val, torch.Tensor) and torch_internals.storage_id(val) not in param_storages:
                storages[torch_internals.storage_id(val)] = val.untyped_storage().nbytes()
        saved.append(sum(storages.values()))
        return gm

    def run(*args):
        return torch.func.functional_call(block, dict(zip(names, args[:len(params)])), args[len(params):])

    traced = torch_internals.aot_function()(run, fw_compiler=forward_graph, bw_compiler=lambda gm, _inputs: gm,
                                            partition_fn=torch_internals.inductor_partition())
    traced(*params, *inputs)
    return saved[0]


def _grouped_experts(xs: torch.Tensor, counts: torch.Tensor, experts) -> torch.Tensor:
    """Experts.forward's CUDA path (the meta device cannot take its is_cuda branch): xs [N, H] sorted by expert,
    counts [n] -> [N, H]."""
    return experts.run_grouped(xs, counts)


def _fresh(fn):
    """A private copy of fn's code: dynamo keeps compiled graphs (and counts recompiles) per code object."""
    return types.FunctionType(fn.__code__.replace(), fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__)


def meta_moe(layer, eager_experts: bool) -> None:
    """Make a meta MoE layer run its own forward with the CUDA expert path; with eager_experts (expert parallelism,
    or experts outside FSDP on one rank) left out of torch.compile as ExpertExchange and LocalExperts are (the
    all-to-alls themselves save nothing for backward: their backward is the reverse exchange). The exchange's
    buffers are moe.exchange_bytes."""
    layer.exchange = torch.compiler.disable(_grouped_experts) if eager_experts else _grouped_experts
    # private copies of the code, so that the plan's traces on meta tensors do not fill the caches the training
    # run's frames will use (MoE.run becomes a frame of its own when the exchange breaks the block's graph)
    for name in ("forward", "run"):
        setattr(layer, name, types.MethodType(_fresh(getattr(type(layer), name)), layer))


@functools.cache
def _backend():
    """AOTAutograd with Inductor's partitioner, its graphs run as they are (on meta tensors): what Inductor would
    compile is split the same way, and only the split matters here."""
    boxed = torch_internals.make_boxed_func()
    return torch_internals.aot_autograd_backend(fw_compiler=lambda gm, _: boxed(gm.forward),
                                                bw_compiler=lambda gm, _: boxed(gm.forward),
                                                partition_fn=torch_internals.inductor_partition())


def compiled_moe_saved_bytes(block: torch.nn.Module, *inputs: torch.Tensor) -> int:
    """Bytes a compiled MoE block saves for backward: torch.compile of the block's forward (dynamo, with the graph
    breaks the GPU run has), each graph split by the partitioner Inductor uses, run on meta tensors; the tensors
    the compiled forwards save are counted by storage, parameters (and views of them) excluded."""
    compiled = torch.compile(types.MethodType(_fresh(type(block).forward), block), backend=_backend(), dynamic=False)
    with saved_storages(block) as saved:
        compiled(*inputs)
    return sum(saved.values())


def meta_block(m: ModelConfig, layer: int, micro_batch: int, S: int, dtype: torch.dtype, fp8: str = "none",
               eager_experts: bool = False, lora: tuple = ()):
    """One decoder block on the meta device, with the flash attention core (and an MoE layer's CUDA expert path:
    meta_moe), its chosen linear layers FP8 if asked, LoRA adapters on a frozen base if lora (adapters.lora_key),
    and its inputs: (block, x [b, S, D], cos, sin)."""
    from shardfit.config.schema import is_moe_layer
    from shardfit.models.decoder import DecoderBlock

    head_dim = m.head_dim or m.dim // m.n_heads
    with torch.device("meta"):
        block = DecoderBlock(m, layer).to(dtype)
        x = torch.empty(micro_batch, S, m.dim, dtype=dtype, requires_grad=True)
        cos = torch.empty(micro_batch, S, head_dim, dtype=dtype)
        sin = torch.empty_like(cos)
    # the layers a GPU run converts (the plan is for GPUs); the weights are cast in the graph here
    apply_fp8(block, ComputeConfig(fp8=fp8, fp8_all_gather=False), "cuda", None, prefix=f"model.layers.{layer}.")
    adapters.adapt_block(block, lora, dtype)  # after FP8, as parallelize orders them
    block.self_attn.core = _flash_core
    if is_moe_layer(m, layer):
        meta_moe(block.mlp, eager_experts)
    return block, x, cos, sin


@functools.lru_cache(maxsize=16)
def compiled_line(model: tuple, S: int, dtype: torch.dtype, layer: int, fp8: str = "none",
                  moe: bool = False, eager_experts: bool = False, lora: tuple = ()) -> tuple[int, int]:
    """(bytes at micro-batch 1, bytes per further sequence) a compiled block saves, for the model config given as
    a tuple of its fields (model_key). Every saved tensor is [B, ...] except two RNG scalars of the attention, so
    the count is linear in B: traced once at micro-batch 1 and 2 per shape, not once per candidate micro-batch and
    checkpointing mode (`shardfit plan` asks for dozens). With FP8 the traced block has torchao's Float8Linear
    layers, so the partitioner's choice (the FP8 casts of the layers' inputs instead of their bf16 originals) is
    what is counted; the casts of the weights, the graph's one other constant part, are not held from forward to
    backward in a run (FSDP gathers the weights again for backward), so the line starts at the per-sequence slope.
    moe: an MoE block, traced as the GPU compiles it, graph breaks included (eager_experts: its experts outside
    the graph). lora: the block with adapters (adapters.lora_key); their [B*S, r] tensors are linear in B too."""
    m = ModelConfig(**dict(model))
    count = compiled_moe_saved_bytes if moe else compiled_saved_bytes
    first, second = (count(*meta_block(m, layer, b, S, dtype, fp8, eager_experts, lora)) for b in (1, 2))
    per_sequence = second - first
    return (per_sequence if fp8 != "none" else first), per_sequence


@functools.cache
def _saved_ops_mode() -> type:
    """The dispatch mode counting the output bytes of the operations selective checkpointing keeps; built on first
    use, so that importing the planner needs no private torch API (torch_internals)."""

    from shardfit.parallel.parallelize import keeps_output  # the runtime's own rule, so the two cannot drift

    class SavedOps(torch_internals.dispatch_mode_base()):
        def __init__(self, adapter_rank: int):
            super().__init__()
            self.rank, self.nbytes = adapter_rank, 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if keeps_output(func, args, self.rank):
                self.nbytes += sum(t.nbytes for t in (out if isinstance(out, (tuple, list)) else [out])
                                   if isinstance(t, torch.Tensor))
            return out

    return SavedOps


def block_activation_bytes(cfg: Config, micro_batch: int, layer: int = 0, world: int = 0) -> dict[str, int]:
    """Bytes one block keeps for backward per checkpointing mode, for micro_batch sequences on one rank of `world`
    (it matters only for a world of one, whose experts run outside the compiled graph: parallel/expert.py)."""
    par, comp = cfg.parallel, cfg.compute
    S = cfg.data.seq_len // par.sequence_parallel  # Ulysses: each rank keeps S/P tokens
    return dict(_block_bytes(model_key(cfg.model), micro_batch, S, compute_dtype(comp), layer, comp.compile, comp.fp8,
                             par.expert_parallel, moe.eager_experts(par, world), adapters.lora_key(cfg)))


@functools.lru_cache(maxsize=512)
def _block_bytes(model: tuple, micro_batch: int, S: int, dtype: torch.dtype, layer: int, compile: bool,
                 fp8: str, ep: int = 1, eager_experts: bool = False, lora: tuple = ()) -> tuple[tuple[str, int], ...]:
    """block_activation_bytes, cached (the sharding and offload change nothing here): `plan --propose` traces once."""
    from shardfit.config.schema import is_moe_layer

    m = ModelConfig(**dict(model))
    is_moe = is_moe_layer(m, layer)
    block, x, cos, sin = meta_block(m, layer, micro_batch, S, dtype, eager_experts=eager_experts, lora=lora)
    compiled = None  # compiled blocks: what the partitioner saves (MoE: graph by graph)
    if compile:
        first, per_sequence = compiled_line(model, S, dtype, layer, fp8, is_moe, eager_experts and is_moe, lora)
        compiled = first + per_sequence * (micro_batch - 1)
    saved_ops = _saved_ops_mode()(lora[0] if lora else 0)
    with saved_storages(block) as seen, saved_ops:
        block(x, cos, sin)
    block_input = x.nbytes  # selective: the attention kernel's outputs (out, log-sum-exp) are among saved_ops' bytes
    ffn = m.moe_ffn_dim * m.experts_per_token if is_moe else m.ffn_dim
    none = sum(seen.values()) if compiled is None else compiled
    exchange = moe.exchange_bytes(m, micro_batch * S, ep, x.element_size()) if is_moe else 0
    return (("none", none), ("selective", block_input + saved_ops.nbytes), ("full", block_input),
            ("block_input", block_input), ("ffn_grads", 2 * micro_batch * S * ffn * x.element_size()),
            ("exchange", exchange))
