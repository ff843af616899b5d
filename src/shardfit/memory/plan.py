"""`shardfit plan`: predict a rank's peak allocated memory before launch, and pick the largest micro-batch that fits.

No GPU and no weights are needed. Activation bytes are not guessed from formulas: one decoder block runs on the meta
device (shapes only, no data, no compute) and every tensor autograd saves for backward is counted, by storage, with
the selective-checkpointing policy applied to the same operations the training run uses. The rest is arithmetic:

  states       fp32 parameters (4 B/param), Adam's two moments (8 B) and the fp32 gradients (4 B: kept, or with
               accumulation live from the first micro-batch on), each 1/world, or under HSDP (parallel.replicate =
               R) 1/(world/R): a shard group's share, every replica holding its own copy; with
               parallel.reduce_every_micro_batch=false and accumulation, the whole model's fp32 gradients unsharded
               instead. CPU offload moves states to host memory (the `host` term, per rank): all = FSDP2's
               CPUOffloadPolicy, the sharded parameters, gradients and moments (16 B/param/shard), the step on the
               CPU, but for the first parallel.offload_gpu_blocks blocks, whose states stay on the GPU (their
               gradients freed after each step like memory.keep_grads=false's); optimizer = the moments
               (8 B/param/shard; parameters and gradients stay), counted for comparison only: the trainer refuses
               it (parallel/offload.py)
  fsdp         bf16 unsharded parameters in flight: the root group (embedding, head, final norm) for the whole
               forward and backward, plus two blocks (the one running and the one prefetched), plus one block's
               fp32 reduce-scatter input in backward
  offload      with offload=all, shards in transit: one block's fp32 shard copied to the GPU for its all-gather, and
               one reduced gradient shard waiting for its copy to the host (shown with fsdp in the table)
  activations  per block: none = everything saved; selective = the block input and the outputs of matmuls and
               attention; full = the block input; times the number of blocks
  working      the larger of: the fused loss (its saved gradients and one fp32 logits chunk), or one block's backward
               (gradients of its input, output and MLP projections, plus its recomputed tensors under checkpointing)

Attention is counted as the flash/cuDNN kernels store it (q, k, v, output and an fp32 log-sum-exp per head and
token): the block calls the flash attention operator itself, not the math fallback the meta device would pick.
With `parallel.compile=true` a dense block saves what the compiled one saves: the block is traced with AOTAutograd
and split into forward and backward by the partitioner Inductor uses (it recomputes cheap elementwise work instead
of saving it), and the tensors the forward hands to the backward are counted, by storage, parameters excluded
(eager blocks save ~45% more). With parallel.fp8 the traced block has the FP8 layers a GPU run has (torchao's casts
in the graph), and FP8 all-gather halves the converted weights' gathered bytes. MoE blocks, expert parallelism and
the gradients of experts outside FSDP (freed every step, written again in backward): see plan_moe.py.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from shardfit.config.schema import Config, ModelConfig, ParallelConfig
from shardfit.memory import plan_moe
from shardfit.parallel.fp8 import apply_fp8, fp8_linears, gathers_in_fp8

GiB = 1 << 30


def _flash_core(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask=None) -> torch.Tensor:
    """The attention core as the flash kernel runs it (it has a meta implementation; its autograd saves q, k, v, the
    output and a [B, H, S] fp32 log-sum-exp). q [B, S, H, Dh], k/v [B, S, K, Dh] -> [B, S, H, Dh]. Document-masked
    kernels (varlen, flex) save the same tensors: the plan counts packed rows alike."""
    q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    return torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, True)[0].transpose(1, 2)


def _compiled_saved_bytes(block: torch.nn.Module, *inputs: torch.Tensor) -> int:
    """Bytes the compiled block's forward saves for backward: AOTAutograd traces forward and backward together and
    Inductor's min-cut partitioner decides what is saved and what is recomputed."""
    from torch._functorch.aot_autograd import aot_function
    from torch._functorch.partitioners import min_cut_rematerialization_partition

    names, params = zip(*block.named_parameters())
    saved = []

    def forward_graph(gm, _inputs):
        placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
        param_storages = {n.meta["val"].untyped_storage()._cdata for n in placeholders[:len(params)]}
        outputs = next(n for n in gm.graph.nodes if n.op == "output").args[0]
        storages = {}
        for node in outputs[1:]:  # the block's output first, then what the backward needs
            val = node.meta.get("val") if isinstance(node, torch.fx.Node) else None
            if isinstance(val, torch.Tensor) and val.untyped_storage()._cdata not in param_storages:
                storages[val.untyped_storage()._cdata] = val.untyped_storage().nbytes()
        saved.append(sum(storages.values()))
        return gm

    def run(*args):
        return torch.func.functional_call(block, dict(zip(names, args[:len(params)])), args[len(params):])

    traced = aot_function(run, fw_compiler=forward_graph, bw_compiler=lambda gm, _inputs: gm,
                          partition_fn=functools.partial(min_cut_rematerialization_partition, compiler="inductor"))
    traced(*params, *inputs)
    return saved[0]


@functools.lru_cache(maxsize=16)
def _compiled_line(model: tuple, S: int, dtype: torch.dtype, layer: int, fp8: str = "none",
                   moe: bool = False, eager_experts: bool = False) -> tuple[int, int]:
    """(bytes at micro-batch 1, bytes per further sequence) a compiled dense block saves, for the model config given
    as a tuple of its fields. Every saved tensor is [B, ...] except two RNG scalars of the attention (24 bytes), so
    the count is linear in B: traced once at micro-batch 1 and 2 per shape, not once per candidate micro-batch and
    checkpointing mode (a trace takes ~0.5 s; `shardfit plan` asks for dozens).

    With FP8 (parallel.fp8) the block is traced with torchao's Float8Linear layers, so the partitioner's choice (it
    keeps the FP8 casts of the layers' inputs, 1 byte an element, instead of their bf16 originals) is what is
    counted. The casts of the weights are the traced graph's one other constant part, and they are not held from
    forward to backward in a run: FSDP gathers the weights again for backward (with FP8 all-gather, already cast).
    Measured on 2 x H200 at micro-batch 4 (tests/memory/test_plan.py): tensorwise 106.5 GiB, rowwise 103.2 GiB; with
    that part dropped the plan is within 2.5% of both, with it rowwise would be 8% high. moe: an MoE block, traced
    as the GPU compiles it, graph breaks included (eager_experts: its experts outside the graph; plan_moe)."""
    m = ModelConfig(**dict(model))
    count = plan_moe.compiled_saved_bytes if moe else _compiled_saved_bytes
    first, second = (count(*_meta_block(m, layer, b, S, dtype, fp8, eager_experts)) for b in (1, 2))
    per_sequence = second - first
    return (per_sequence if fp8 != "none" else first), per_sequence


def _meta_block(m: ModelConfig, layer: int, micro_batch: int, S: int, dtype: torch.dtype, fp8: str = "none",
                eager_experts: bool = False):
    """One decoder block on the meta device, with the flash attention core (and an MoE layer's CUDA expert path:
    plan_moe.meta_moe), its chosen linear layers FP8 if asked, and its inputs: (block, x [b, S, D], cos, sin)."""
    from shardfit.models.decoder import DecoderBlock, is_moe_layer

    head_dim = m.head_dim or m.dim // m.n_heads
    with torch.device("meta"):
        block = DecoderBlock(m, layer).to(dtype)
        x = torch.empty(micro_batch, S, m.dim, dtype=dtype, requires_grad=True)
        cos = torch.empty(micro_batch, S, head_dim, dtype=dtype)
        sin = torch.empty_like(cos)
    # the layers a GPU run converts (the plan is for GPUs); the weights are cast in the graph here
    apply_fp8(block, ParallelConfig(fp8=fp8, fp8_all_gather=False), "cuda", None, prefix=f"model.layers.{layer}.")
    block.self_attn.core = _flash_core
    if is_moe_layer(m, layer):
        plan_moe.meta_moe(block.mlp, eager_experts)
    return block, x, cos, sin


class _SavedOps(TorchDispatchMode):
    """Output bytes of the operations selective checkpointing keeps (matmuls, attention)."""

    def __init__(self, ops):
        super().__init__()
        self.ops, self.nbytes = ops, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func in self.ops:
            self.nbytes += sum(t.nbytes for t in (out if isinstance(out, (tuple, list)) else [out])
                               if isinstance(t, torch.Tensor))
        return out


def _compute_dtype(par: ParallelConfig) -> torch.dtype:
    """The dtype a GPU run computes in (parallel.mixed_precision: auto is bf16 on CUDA)."""
    return torch.bfloat16 if par.param_dtype in ("auto", "bfloat16") else torch.float32


def block_activation_bytes(cfg: Config, micro_batch: int, layer: int = 0, world: int = 0) -> dict[str, int]:
    """Bytes one block keeps for backward per checkpointing mode, for micro_batch sequences on one rank of `world`
    (it matters only for a world of one, whose experts run outside the compiled graph: parallel/expert.py)."""
    par, S = cfg.parallel, cfg.data.seq_len // cfg.parallel.sequence_parallel  # Ulysses: each rank keeps S/P tokens
    return dict(_block_bytes(_key(cfg.model), micro_batch, S, _compute_dtype(par), layer, par.compile, par.fp8,
                             par.expert_parallel, plan_moe.eager_experts(par, world)))


def _key(m: ModelConfig) -> tuple:
    """The model config as a hashable key of the caches below."""
    return tuple(dataclasses.asdict(m).items())


@functools.lru_cache(maxsize=512)
def _block_bytes(model: tuple, micro_batch: int, S: int, dtype: torch.dtype, layer: int, compile: bool,
                 fp8: str, ep: int = 1, eager_experts: bool = False) -> tuple[tuple[str, int], ...]:
    """block_activation_bytes, cached (the sharding and offload change nothing here): `plan --propose` traces once."""
    from shardfit.models.decoder import is_moe_layer
    from shardfit.parallel.parallelize import _SAVE_OPS

    m = ModelConfig(**dict(model))
    moe = is_moe_layer(m, layer)
    block, x, cos, sin = _meta_block(m, layer, micro_batch, S, dtype, eager_experts=eager_experts)
    compiled = None  # compiled blocks: what the partitioner saves (MoE: graph by graph, plan_moe)
    if compile:
        first, per_sequence = _compiled_line(model, S, dtype, layer, fp8, moe, eager_experts and moe)
        compiled = first + per_sequence * (micro_batch - 1)
    saved_ops = _SavedOps(_SAVE_OPS)
    with plan_moe.saved_storages(block) as seen, saved_ops:
        block(x, cos, sin)
    block_input = x.nbytes  # selective: the attention kernel's outputs (out, log-sum-exp) are among saved_ops' bytes
    ffn = m.moe_ffn_dim * m.experts_per_token if moe else m.ffn_dim
    none = sum(seen.values()) if compiled is None else compiled
    exchange = plan_moe.exchange_bytes(m, micro_batch * S, ep, x.element_size()) if moe else 0
    return (("none", none), ("selective", block_input + saved_ops.nbytes), ("full", block_input),
            ("block_input", block_input), ("ffn_grads", 2 * micro_batch * S * ffn * x.element_size()),
            ("exchange", exchange))


@functools.lru_cache(maxsize=4)
def _meta_model(model: tuple) -> torch.nn.Module:
    """The model built on meta (shapes only), once per model config: building it takes 0.04 s at 70B, and the
    proposals ask for hundreds of estimates."""
    from shardfit.models import build_model

    with torch.device("meta"):
        return build_model(ModelConfig(**dict(model)))


@functools.lru_cache(maxsize=16)
def _param_counts(model: tuple, fp8: str, fp8_all_gather: bool) -> tuple[int, tuple[int, ...], int]:
    """(parameters, parameters of each block, the largest block's weights all-gathered in FP8)."""
    built = _meta_model(model)
    blocks = tuple(sum(p.numel() for p in b.parameters()) for b in built.model.layers)
    fp8_bytes = 0
    if gathers_in_fp8(ParallelConfig(fp8=fp8, fp8_all_gather=fp8_all_gather)):
        fp8_bytes = max(sum(mod.weight.numel() for _, mod in fp8_linears(b, fp8, True, f"model.layers.{i}."))
                        for i, b in enumerate(built.model.layers))
    return sum(p.numel() for p in built.parameters()), blocks, fp8_bytes


@functools.lru_cache(maxsize=256)
def _pinned_shard_bytes(model: tuple, shard: int, gpu_blocks: int = 0) -> int:
    """Pinned host bytes of one rank's fp32 parameter shards under offload=all: FSDP2 pins each shard (dim 0 split
    over `shard` ranks, padded to a whole row count) as an allocation of its own, and PyTorch's pinned allocator rounds
    each up to a power of two (Llama-3-8B on one rank: a 224 MiB MLP matrix takes 256 MiB; 33 GiB for 29.9). The
    gradient shards copied back are pinned the same way: the same bytes again. The first gpu_blocks blocks'
    shards stay on the GPU (parallel.offload_gpu_blocks): not counted."""
    built = _meta_model(model)
    kept = {id(p) for b in built.model.layers[:gpu_blocks] for p in b.parameters()}
    total = 0
    for p in (p for p in built.parameters() if id(p) not in kept):
        rows = -(-p.shape[0] // shard) if p.dim() else 1
        nbytes = 4 * rows * (p[0].numel() if p.dim() else 1)
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
    if not cfg.train.micro_batch_tokens:
        return cfg
    return dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, seq_len=cfg.train.micro_batch_tokens),
                               train=dataclasses.replace(cfg.train, micro_batch=1, micro_batch_tokens=0))


def estimate(cfg: Config, world: int, micro_batch: int) -> Estimate:
    from shardfit.models.decoder import is_moe_layer
    from shardfit.parallel.parallelize import check_replicate

    check_replicate(cfg.parallel.replicate, world)
    cfg = as_rows(cfg)  # token budgets: micro_batch counts [1, micro_batch_tokens] rows
    shard = world // cfg.parallel.replicate  # ranks the states are sharded over (HSDP: one replica's group)
    m, par = cfg.model, cfg.parallel
    n_params, block_params, fp8_bytes = _param_counts(_key(m), par.fp8, par.fp8_all_gather)
    root_params = n_params - sum(block_params)
    # offload=all keeps only the first offload_gpu_blocks blocks' states on the GPU (parallel/offload.py)
    kept = par.offload_gpu_blocks
    on_gpu = sum(block_params[:kept]) if par.offload == "all" else n_params
    # fp32 weights, Adam's two fp32 moments, fp32 gradients
    weights, moments, sharded_grads = 4 * on_gpu // shard, 8 * on_gpu // shard, 4 * on_gpu // shard
    # under offload=all the trainer frees every gradient after the step, the GPU-kept blocks' too
    keep = cfg.memory.keep_grads and par.offload != "all"
    # experts outside FSDP (E = W) free their gradients after every step whatever keep says (step_overlap.zero_grads)
    # and the backward writes them again as it frees the activations: added below, never idle in FSDP's pool
    experts = plan_moe.expert_params(_meta_model(_key(m)))
    fresh = 4 * plan_moe.outside_fsdp_params(experts, par.expert_parallel, world, par.offload)
    grads, idle_cache = (sharded_grads - fresh, 0) if keep else (0, sharded_grads - fresh)  # freed: cached (fits)
    unsharded = 0
    accumulating = cfg.train.global_batch > micro_batch * (world // par.sequence_parallel)
    if accumulating:
        if not par.reduce_every_micro_batch:
            # accumulated unsharded in fp32 between micro-batches, on every GPU (EP: a rank's n/E experts; E = W: fresh)
            unsharded = 4 * (n_params - sum(experts) + (0 if fresh else sum(experts) // par.expert_parallel))
        elif not keep:
            grads, idle_cache = sharded_grads - fresh, 0  # live from the first micro-batch on: allocated, not idle
    host = copies = 0
    if par.offload == "optimizer":  # the moments and the step on the CPU; parameters and gradients stay
        host, moments = moments, 0
    elif par.offload == "all":  # FSDP2's CPUOffloadPolicy: the other groups' sharded states in host memory
        # gradients copied there after each reduce-scatter; parameters and gradients pinned, each shard rounded up
        # to a power of two by the pinned allocator; the moments are plain host memory
        host = 2 * _pinned_shard_bytes(_key(m), shard, kept) + 8 * (n_params - on_gpu) // shard
        # FSDP2 copies a group's fp32 shard to the GPU before its all-gather (the prefetched block's, while one
        # computes), and each reduced gradient shard sits on the GPU until its copy to the host is done: one
        # offloaded block's shard of each, 4 B/param/shard twice (0.8 GiB for 70B on 8 GPUs)
        copies = 2 * 4 * max(block_params[kept:], default=0) // shard
    grads += unsharded  # the unsharded accumulation stays on the GPU, offload or not
    # bf16 gathered params of the root and two blocks (EP: only a rank's n/E experts, plan_moe), one fp32
    # reduce-scatter input; FP8 all-gather gathers the converted weights at 1 byte each. The same with offload=all.
    big_block = max(plan_moe.gathered_params(block_params, experts, par.expert_parallel, fresh > 0))
    fsdp = 2 * (root_params + 2 * big_block) - 2 * fp8_bytes + 4 * big_block
    mode = par.activation_checkpoint
    fsdp += plan_moe.outside_transient_bytes(experts, par, _compute_dtype(par).itemsize) if fresh else 0
    kinds = {is_moe_layer(m, i) for i in range(m.n_layers)}
    per_block = {k: block_activation_bytes(cfg, micro_batch, layer=next(
        i for i in range(m.n_layers) if is_moe_layer(m, i) == k), world=world) for k in kinds}
    acts = 0
    for i in range(m.n_layers):
        b = per_block[is_moe_layer(m, i)]
        checkpointed = mode == "selective" or (mode == "full" and i % par.ac_every == 0)
        acts += b[mode] if checkpointed else b["none"] + plan_moe.held_expert_bytes(
            experts[i], par.expert_parallel, world, _compute_dtype(par).itemsize, par.offload)
    # fresh expert gradients replace activations in backward (the larger counts), or stay between micro-batches
    grads += fresh if accumulating else max(0, fresh - acts)
    tokens = micro_batch * cfg.data.seq_len // par.sequence_parallel
    # the fused loss keeps dloss/dh [tokens, D] and dloss/dW [V, D] in bf16, and one logits chunk [c, V]: eager bf16
    # logits, an fp32 copy, logsumexp's fp32 temporary (10 B); compiled (compile_loss) bf16 logits and gradient (4 B)
    per_logit = 4 if par.compile and par.compile_loss and par.kernels != "liger" else 10
    loss = tokens * m.dim * 2 + m.vocab_size * m.dim * 2 + par.loss_chunk * m.vocab_size * per_logit
    # backward of one block: gradients of its input and output, of the gate and up projections' outputs, expert
    # parallelism's exchange buffers, and under checkpointing the block's recomputed tensors on top
    backward = max(2 * b["block_input"] + b["ffn_grads"] + b["exchange"] + (b["none"] if mode != "none" else 0)
                   for b in per_block.values())
    return Estimate(micro_batch, weights, grads, moments, fsdp, acts, max(loss, backward), offload_copies=copies,
                    idle_cache=idle_cache, host=host)


def host_per_node(e: Estimate, world: int, gpus_per_node: int = 8) -> int:
    """Host memory the offloaded states of one node's ranks take: FSDP2 pins the sharded parameters and gradients
    (page-locked: the OS cannot swap them), the moments are plain host memory the CPU step reads in place."""
    return e.host * min(world, gpus_per_node)


HOST_USABLE = 0.9  # of a node's host memory, for the offloaded states


def host_budget(host_gib: float) -> float:
    """Bytes of a host of host_gib the offloaded states may take: 10% is left to the processes themselves (CUDA
    context, libraries, Python, data loading: a few GiB per rank) and to the kernel and page cache (dataset reads,
    checkpoint writes). Measured: Llama-3-8B offloaded on one H100 of a 123 GiB host was killed by the OOM killer at
    ~120 GiB resident (59 GB of moments, 70 GB of pinned shards still growing), 3 GiB short of the total."""
    return HOST_USABLE * host_gib * GiB


def host_fits(e: Estimate, world: int, gpus_per_node: int, host_gib: float | None) -> bool:
    """Whether one node's offloaded states fit host_budget (True when no host size is given)."""
    return host_gib is None or host_per_node(e, world, gpus_per_node) <= host_budget(host_gib)


def largest_micro_batch(cfg: Config, world: int, budget_bytes: float, limit: int = 64,
                        device_bytes: float | None = None, accept=None) -> Estimate | None:
    """The largest micro-batch (1, 2, 3, ...) whose predicted peak fits the budget; None if even 1 does not.
    accept(mb): whether train takes that micro-batch (plan_table: it must split the global batch); others skipped."""
    best = None
    for mb in range(1, limit + 1):
        if accept is not None and not accept(mb):
            continue
        e = estimate(cfg, world, mb)
        if not fits(e, budget_bytes, device_bytes):
            break
        best = e
    return best


def allocation_budget(device_bytes: float) -> float:
    """Bytes a rank may allocate on a GPU of device_bytes: reserved memory runs ~1.04x allocated with expandable
    segments, and the CUDA context takes ~0.5 GiB."""
    return 0.95 * device_bytes - 0.5 * GiB


def fits(e: Estimate, budget_bytes: float, device_bytes: float | None = None) -> bool:
    """Within the allocation budget, and (device size given) with freed gradients' idle cache besides: FSDP2 allocates
    the sharded gradients in its reduce-scatter stream's pool, so once freed (memory.keep_grads=false) they stay
    cached there, idle for the compute stream. Measured on 2 x H200, Llama-3-8B (15.0 GiB of gradients per GPU):
    reserved was allocated + 16.9 GiB (bf16 and FP8 at micro-batch 4) and + 18.0 GiB (FP8 at 5, no retries); FP8 at
    6 (132.8 GiB allocated, inside the allocation budget) hit the device's memory and retried 29 times a step. So
    allocated + that cache + 3 GiB must stay 1.5 GiB under the device's memory."""
    if e.peak > budget_bytes:
        return False
    return device_bytes is None or e.peak + e.idle_cache <= device_bytes - 4.5 * GiB


def divisors(n: int) -> list[int]:
    """n's divisors, ascending, in O(sqrt(n)) steps (a global batch of 2^40 must not mean 2^40 of them)."""
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return small + [n // d for d in reversed(small) if d * d != n]


def choose_micro_batch(cfg: Config, world: int, budget_bytes: float, per_rank: int,
                       device_bytes: float | None = None) -> Estimate:
    """The largest divisor of the per-rank batch whose predicted peak fits (train.micro_batch=0). The peak grows with
    the micro-batch: a binary search over the divisors, a few estimates however many there are."""
    from shardfit.errors import ShardfitError
    from shardfit.memory.plan_checks import check_model_sizes

    check_model_sizes(cfg)
    cands = divisors(per_rank)
    lo, hi, best = 0, len(cands) - 1, None
    while lo <= hi:
        mid = (lo + hi) // 2
        e = estimate(cfg, world, cands[mid])
        if fits(e, budget_bytes, device_bytes):
            best, lo = e, mid + 1
        else:
            hi = mid - 1
    if best is not None:
        return best
    e = estimate(cfg, world, 1)
    raise ShardfitError(f"even micro-batch 1 is predicted to need {e.peak / GiB:.1f} GiB per GPU, more than the "
                        f"{budget_bytes / GiB:.1f} GiB budget", where="train.micro_batch=0",
                        fix="set parallel.activation_checkpoint=selective or full, shorten data.seq_len, or add GPUs")


def auto_micro_batch(cfg: Config, world: int, device_bytes: float, per_rank: int) -> tuple[Estimate, str]:
    """choose_micro_batch on a GPU of device_bytes, and the line the trainer prints: the choice, and what freeing the
    gradients between steps (memory.keep_grads=false) would allow instead, when that is more."""
    budget = allocation_budget(device_bytes)
    e = choose_micro_batch(cfg, world, budget, per_rank, device_bytes)
    line = (f"train.micro_batch=0: chose {e.micro_batch}, predicted peak {e.peak / GiB:.1f} GiB of a "
            f"{budget / GiB:.1f} GiB budget per GPU (shardfit plan)")
    if cfg.memory.keep_grads:
        freed = dataclasses.replace(cfg, memory=dataclasses.replace(cfg.memory, keep_grads=False))
        alt = choose_micro_batch(freed, world, budget, per_rank, device_bytes)
        if alt.micro_batch > e.micro_batch:
            line += (f"; with --memory.keep_grads=false {alt.micro_batch} would fit ({alt.peak / GiB:.1f} GiB), "
                     f"reserved memory then running ~1.15x allocated")
    return e, line
