"""`shardfit plan` proposals: when a configuration does not fit (or with --propose), configurations that would.

One proposal per kind, in the order of what the user gives up, least first: partial_checkpointing (a configuration
with full checkpointing that fits with room: the fewest blocks to checkpoint at its micro-batch, compute.ac_blocks;
printed even when the configuration fits), expert_parallel (MoE models: the
experts split within a node, with the overlapped optimizer step), checkpointing (heavier checkpointing or a smaller
micro-batch), sequence_parallel (Ulysses over the smallest P that fits), offload_all (FSDP2's CPU offload, the
fewest GPU-kept blocks whose host memory fits --host-memory), lora then fp8_base then qlora (adapters on a frozen
base, an FP8 then an NF4 one where model.quantize exists: they change what is trained, so they follow every layout
that trains what was asked on these GPUs), more_gpus (the smallest fitting world without offload), hsdp (replicas of
whole-node shard groups). Each kind takes the lightest checkpointing at which some micro-batch fits and there the
largest micro-batch dividing a data-parallel rank's share of the global batch; offload_all the largest micro-batch first
(one micro-batch per step wins under offload). A proposal is config keys
and a world size: applied to the config, checked as the loader, the launcher and parallelize check it (accepted),
and re-planned by the same estimate, so what is printed is what `shardfit plan` with those flags predicts.
plan_json is `--json` (schema shardfit.plan/1, every figure in bytes). Why each kind, and in this order:
docs/memory-plan.md.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from shardfit.config.schema import Config
from shardfit.config.shape import StepShape
from shardfit.plan.adapters import quantize
from shardfit.plan.checks import check_plan_inputs
from shardfit.plan.estimate import (
    HOST_USABLE,
    Estimate,
    GiB,
    adapter_params,
    allocation_budget,
    estimate,
    fits,
    host_fits,
    host_per_node,
)
from shardfit.plan.table import MODES, configured, largest_per_mode

SCHEMA = "shardfit.plan/1"
MAX_GPUS = 4096  # more_gpus gives up beyond this
LORA = {"lora.rank": 16, "lora.alpha": 32}  # what the lora, fp8_base and qlora proposals set (docs/lora.md)
QUANTIZED = (("fp8_base", "fp8"), ("qlora", "nf4"))  # (proposal, model.quantize): the quantized bases, finest first
MIN_SAVING = 0.01  # of a step's compute: partial_checkpointing proposes nothing that saves less
CHECKPOINTING = {"none": "no recomputation", "selective": "selective checkpointing recomputes the elementwise work "
                 "(a few percent more compute)", "full": "full checkpointing recomputes each block's forward in "
                 "backward (about 1/3 more compute; 1/2 under LoRA, whose backward computes no weight gradients)"}


@dataclass
class Proposal:
    kind: str
    changes: dict[str, Any]  # config key ("section.key") -> value
    world: int
    new_world: bool  # the world size differs from --nproc
    estimate: Estimate
    host_per_node: int  # bytes of host memory the offloaded states take on one node
    note: str

    @property
    def flags(self) -> list[str]:
        """The exact arguments to add to the command (`--nproc=N` first when the world changes)."""
        def text(v: Any) -> str:
            return str(v).lower() if isinstance(v, bool) else str(v)

        return ([f"--nproc={self.world}"] if self.new_world else []) + \
            [f"--{k}={text(v)}" for k, v in self.changes.items()]


def apply(cfg: Config, changes: dict[str, Any]) -> Config:
    """cfg with changes ("section.key" -> value) applied, as the same flags on the command line would set them."""
    sections: dict[str, dict[str, Any]] = {}
    for key, value in changes.items():
        section, _, name = key.partition(".")
        sections.setdefault(section, {})[name] = value
    return dataclasses.replace(cfg, **{s: dataclasses.replace(getattr(cfg, s), **kv) for s, kv in sections.items()})


def accepted(cfg: Config, world: int) -> bool:
    """What the config loader, the launcher and parallelize accept (parallel/layout.py: refusal): the keys' rules, the
    offload layouts the Engine implements, Ulysses' divisibility (world, data.seq_len, model.n_heads), HSDP's replica
    count dividing the world, expert parallelism's groups and overlap, and the global batch splitting over the
    data-parallel ranks and micro-batches."""
    from shardfit.parallel.layout import refusal

    return refusal(cfg, world) is None


def fitting(cfg: Config, world: int, gpu_gib: float, changes: dict[str, Any],
            largest_first: bool = False) -> tuple[dict, Estimate] | None:
    """changes completed with the lightest checkpointing and the largest micro-batch that fit (largest_first: the
    largest micro-batch, and there the lightest checkpointing), and their estimate; None when nothing fits or the
    loader would refuse the layout."""
    budget, device = allocation_budget(gpu_gib * GiB), gpu_gib * GiB
    base = apply(cfg, changes)
    sp = base.parallel.sequence_parallel
    if world % sp or world % base.parallel.replicate:
        return None
    dp = world // sp
    extra: dict[str, Any] = {}
    if not StepShape.of(base).by_tokens and base.train.global_batch % dp:  # rows: the data-parallel ranks must
        # split the global batch, the next multiple up (token budgets count examples: any number splits)
        extra["train.global_batch"] = -(-base.train.global_batch // dp) * dp
    per_rank = extra.get("train.global_batch", base.train.global_batch) // dp
    if StepShape.of(base).by_tokens:  # token-budget micro-batches: the row size is the user's, not proposed
        sizes = [1]  # one [1, micro_batch_tokens] row per forward/backward (estimate.py: as_rows)
    else:
        sizes = [d for d in range(min(per_rank, 64), 0, -1) if per_rank % d == 0]
    order = ([(mode, mb) for mb in sizes for mode in MODES] if largest_first
             else [(mode, mb) for mode in MODES for mb in sizes])
    for mode, mb in order:
        ch = {**changes, "compute.activation_checkpoint": mode, **extra}
        if not StepShape.of(base).by_tokens:
            ch["train.micro_batch"] = mb
        c = apply(cfg, ch)
        if accepted(c, world):
            e = estimate(c, world, mb)
            if fits(e, budget, device):
                return ch, e
    return None


def gpu_blocks_for_host(cfg: Config, world: int, host_gib: float | None, gpus_per_node: int) -> int | None:
    """parallel.offload_gpu_blocks for offload=all: the fewest blocks kept on the GPU whose host memory fits the
    host's budget (estimate.py: host_budget, 90% of host_gib); 0 without a host size, None when not even every
    block kept on the GPU brings it under. The host term does not depend on the micro-batch or the checkpointing;
    each block kept takes its 16 B/param/shard (pinned rounding included) off the host."""
    for n in range(cfg.model.n_layers + 1) if host_gib is not None else [0]:
        c = apply(cfg, {"parallel.offload": "all", "parallel.offload_gpu_blocks": n})
        if host_fits(estimate(c, world, 1), world, gpus_per_node, host_gib):
            return n
    return None


def expert_parallel_degree(cfg: Config, world: int, gpus_per_node: int) -> int:
    """The EP degree to propose for an MoE model: the largest E that divides its experts and a shard group
    (world / parallel.replicate: EP groups live inside a replica), at most one node (the all-to-alls stay on its
    links); 1 for a dense model."""
    n, group = cfg.model.n_experts, world // cfg.parallel.replicate
    if not n:
        return 1
    return max(e for e in range(1, min(group, gpus_per_node) + 1) if n % e == 0 and group % e == 0)


def _gpu_counts(world: int, gpus_per_node: int):
    """World sizes above world: within one node powers of two and the whole node, beyond it whole nodes (the
    launcher starts the same number of ranks on every node)."""
    n = world + 1
    while n <= MAX_GPUS:
        if (n <= gpus_per_node and (n & (n - 1) == 0 or n == gpus_per_node)) or n % gpus_per_node == 0:
            yield n
        n += 1


def partial_checkpointing(cfg: Config, world: int, gpu_gib: float, gpus_per_node: int = 8) -> Proposal | None:
    """At the configured micro-batch, the fewest checkpointed blocks that fit, as compute.ac_blocks = N (the first N
    blocks; parallel/parallelize.py's checkpointed_blocks), when that saves at least MIN_SAVING of a step's compute
    against what is configured: full checkpointing that fits with room (then N = 0, no checkpointing, may be the
    answer), or no or selective checkpointing that does not fit (against checkpointing every block). None otherwise,
    and when the micro-batch is chosen at launch. Bisection: each block left unrecomputed keeps its activations, so
    the peak only grows as N falls (but for the last block, whose recompute runs at the peak itself: N = L - 1 is
    never above N = L, and is not proposed: it saves 1/L of the recompute)."""
    from shardfit.parallel.parallelize import checkpointed_blocks
    from shardfit.plan.estimate import as_rows

    comp, L = cfg.compute, cfg.model.n_layers
    if not (cfg.train.micro_batch or StepShape.of(cfg).by_tokens) or L < 2:
        return None
    budget, device = allocation_budget(gpu_gib * GiB), gpu_gib * GiB
    mb = as_rows(cfg).train.micro_batch
    full = comp.activation_checkpoint == "full"
    now = sum(checkpointed_blocks(comp, L)) if full else L  # not full: against checkpointing every block

    def changes(n: int) -> dict[str, Any]:
        ch = {"compute.activation_checkpoint": "full" if n else "none", "compute.ac_blocks": n,
              "compute.ac_every": 1}
        return {k: v for k, v in ch.items() if getattr(comp, k.split(".")[1]) != v}

    def fitting_estimate(c: Config) -> Estimate | None:
        e = estimate(c, world, mb)
        return e if accepted(c, world) and fits(e, budget, device) else None

    share = 1 / 2 if cfg.lora.rank else 1 / 3  # a block's recomputed forward against the rest of its work
    lo = 0 if full else 1  # not full: no checkpointing is the configuration, which does not fit
    hi = min(L - 1, now - int(-(-MIN_SAVING * L * (1 + share) // share)))  # saves at least MIN_SAVING
    if hi < lo or (not full and fitting_estimate(cfg) is not None) or fitting_estimate(apply(cfg, changes(hi))) is None:
        return None
    while lo < hi:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if fitting_estimate(apply(cfg, changes(mid))) is not None else (mid + 1, hi)
    e = fitting_estimate(apply(cfg, changes(hi)))
    saved = (now - hi) / L * share / (1 + share)
    what = (f"checkpoints the first {hi} of {L} blocks instead of " + (f"{now}" if full else "every block") +
            f": the other {L - hi} keep their activations" if hi else
            f"no checkpointing instead of {now} checkpointed blocks: every block keeps its activations")
    note = (f"{what}; {now - hi} blocks' forward is not run twice, about {saved:.0%} less compute a step at the "
            f"micro-batch given ({mb})")
    return Proposal("partial_checkpointing", changes(hi), world, False, e, host_per_node(e, world, gpus_per_node),
                    note)


def adapter_kinds(cfg: Config) -> list[tuple[str, dict[str, Any]]]:
    """The adapter proposals for cfg, in order: LoRA (full fine-tuning as given), then LoRA on an FP8 base (half a
    bf16 base, e4m3's rounding), then QLoRA (an NF4 base: a quarter, coarser rounding); the quantized bases only on a
    shardfit with model.quantize, each coarser than the base given; each tried only if the one before does not fit.
    A quantized base drops compute.fp8 (lora_rules.py refuses the two together)."""
    kinds = [] if cfg.lora.rank else [("lora", dict(LORA))]
    if not hasattr(cfg.model, "quantize"):
        return kinds
    compute = getattr(getattr(cfg, "compute", None), "fp8", "none")
    rest = {**({} if cfg.lora.rank else LORA), **({"compute.fp8": "none"} if compute != "none" else {})}
    finer = ["none", *(q for _, q in QUANTIZED)]
    finer = finer[:finer.index(quantize(cfg)) + 1]  # the base given and the finer ones: not proposed
    return kinds + [(kind, {"model.quantize": q, **rest}) for kind, q in QUANTIZED if q not in finer]


def _adapter_note(kind: str, cfg: Config, ch: dict) -> str:
    """What a LoRA, FP8-base or QLoRA proposal changes: what trains, and what the base becomes."""
    c = apply(cfg, ch)
    trained, total = adapter_params(c)
    base = {"qlora": "in NF4 (4-bit, dequantised layer by layer: its forward is not the bf16 model's)",
            "fp8_base": "in FP8 (e4m3, a scale per row; FP8 matmuls on GPUs of compute capability >= 8.9: its "
                        "forward is not the bf16 model's)"}.get(kind, "in the compute dtype")
    return (f"changes what is trained: rank-{c.lora.rank} adapters on {c.lora.targets} ({trained / 1e6:.0f}M "
            f"parameters, {trained / total:.2%} of {total / 1e9:.1f}B) on a frozen base {base}, not every weight; the "
            "result is the base plus a low-rank update (docs/lora.md)")


def _note(kind: str, ch: dict, e: Estimate, world: int, cfg: Config, gpus_per_node: int) -> str:
    host = host_per_node(e, world, gpus_per_node) / GiB
    mode = ch["compute.activation_checkpoint"]
    P, R = ch.get("parallel.sequence_parallel", 1), ch.get("parallel.replicate", 1)
    kept = ch.get("parallel.offload_gpu_blocks", cfg.parallel.offload_gpu_blocks)
    E = ch.get("parallel.expert_parallel", 1)
    notes = {
        "expert_parallel": f"each GPU of an EP group of {E} holds {cfg.model.n_experts // max(E, 1)} experts of every "
                           "layer (all-to-alls of the routed rows instead of gathering every expert), the optimizer "
                           "step under the next forward",
        "checkpointing": CHECKPOINTING[mode],
        "sequence_parallel": f"each sequence split over {P} GPUs (two all-to-alls per attention layer), "
                             f"{world // P} data-parallel ranks",
        "offload_all": f"parameters, gradients and the optimizer step on the CPU ({host:.0f} GiB of host memory per "
                       "node), every block's weights copied over PCIe each step: slower (benchmarks/README.md)" + (
                           f"; the first {kept} blocks' states stay on the GPU (the fewest whose host memory fits "
                           "90% of --host-memory)" if kept else ""),
        "more_gpus": f"{world} GPUs, no offload" + (
            f", {world // gpus_per_node} nodes of {gpus_per_node} GPUs (shardfit train --nproc {gpus_per_node} "
            f"--nnodes {world // gpus_per_node} on each)" if world > gpus_per_node else ""),
        "hsdp": f"{R} replicas of {world // R}-GPU shard groups ("
                + ("one node" if world // R == gpus_per_node else f"{world // R // gpus_per_node} nodes") + " each): "
                "all-gathers and reduce-scatters stay inside a group, traffic across groups is only the gradient "
                "all-reduce",
    }
    note = _adapter_note(kind, cfg, ch) if kind in ("lora", "fp8_base", "qlora") else notes[kind]
    if kind != "checkpointing" and mode != "none":
        note += f"; {mode} checkpointing"
    if "train.global_batch" in ch:
        note += f"; global batch {cfg.train.global_batch} -> {ch['train.global_batch']} to split evenly"
    return note


def proposals(cfg: Config, world: int, gpu_gib: float, host_gib: float | None = None,
              gpus_per_node: int = 8) -> tuple[list[Proposal], list[Proposal]]:
    """(the proposals that fit, those left out because their host memory exceeds host_gib), cheapest first."""
    check_plan_inputs(cfg, world, gpu_gib, host_gib, gpus_per_node)
    found: list[Proposal] = []
    par = cfg.parallel

    def propose(kind: str, changes: dict[str, Any], w: int = world) -> bool:
        got = fitting(cfg, w, gpu_gib, changes, largest_first=kind == "offload_all")
        if got is None:
            return False
        ch, e = got
        if w == world and apply(cfg, ch) == cfg:
            return True  # the configuration as given: nothing to change
        found.append(Proposal(kind, ch, w, w != world, e, host_per_node(e, w, gpus_per_node),
                              _note(kind, ch, e, w, cfg, gpus_per_node)))
        return True

    partial = partial_checkpointing(cfg, world, gpu_gib, gpus_per_node)  # the configuration with room to spare
    if partial is not None:
        found.append(partial)
    ep = expert_parallel_degree(cfg, world, gpus_per_node)
    if ep > par.expert_parallel:
        propose("expert_parallel", {"parallel.expert_parallel": ep, "parallel.overlap_optimizer": True})
    fits_here = propose("checkpointing", {}) and par.offload == "none"
    for P in range(par.sequence_parallel + 1, world + 1):
        if world % P == 0 and propose("sequence_parallel", {"parallel.sequence_parallel": P}):
            break
    # offload with the fewest GPU-kept blocks whose host memory fits; failing that (the host or the GPU short) of
    # every block, which a short host leaves out and so shows what it needs. The configuration as given is not one.
    for n in dict.fromkeys((gpu_blocks_for_host(cfg, world, host_gib, gpus_per_node), 0)):
        if n is None or (par.offload == "all" and n == par.offload_gpu_blocks):
            continue
        kept = {"parallel.offload_gpu_blocks": n} if n != par.offload_gpu_blocks else {}
        if propose("offload_all", {"parallel.offload": "all", **kept}):
            break
    on_gpu = {**({"parallel.offload": "none"} if par.offload != "none" else {}),
              **({"parallel.offload_gpu_blocks": 0} if par.offload_gpu_blocks else {})}
    plain = {**on_gpu, **({"parallel.replicate": 1} if par.replicate > 1 else {})}
    # LoRA, then on an FP8 base, then QLoRA, on these GPUs when full fine-tuning does not fit them without offload:
    # they change what is trained, so they come after every layout that trains what was asked here, before asking
    # for more GPUs
    if not fits_here:
        for kind, changes in adapter_kinds(cfg):
            if propose(kind, {**on_gpu, **changes}):
                break
    # more GPUs only when this world does not fit without offload
    more = None if fits_here else next(
        (n for n in _gpu_counts(world, gpus_per_node) if propose("more_gpus", plain, n)), None)
    # HSDP on the multi-node world given, else on the one more_gpus found: shard groups of the fewest whole nodes
    for w in (world, more):
        if w and w > gpus_per_node and w % gpus_per_node == 0 and any(
                propose("hsdp", {**plain, "parallel.replicate": w // g}, w)
                for g in range(gpus_per_node, w, gpus_per_node) if w % g == 0):
            break
    short = [p for p in found if not host_fits(p.estimate, p.world, gpus_per_node, host_gib)]
    return [p for p in found if p not in short], short


def proposals_text(props: list[Proposal], short: list[Proposal], gpu_gib: float, host_gib: float | None) -> str:
    budget = allocation_budget(gpu_gib * GiB) / GiB
    if not props:
        lines = ["no proposal fits: not even with CPU offload of every state, sequence parallelism or "
                 f"{MAX_GPUS} GPUs"]
    else:
        lines = ["proposals, each predicted to fit (add the flags to the command; what is given up grows down the "
                 "list):"]
    for i, p in enumerate(props, 1):
        host = ""
        if p.host_per_node:  # an assumption unless the user said how much host memory a node has
            states = p.host_per_node / GiB
            host = (f", host memory {states:.1f} GiB per node" if host_gib is not None else
                    f", IF each node has {states / HOST_USABLE:.0f} GiB of host memory ({states:.0f} GiB of states, "
                    f"{HOST_USABLE:.0%} of it): not checked, add --host-memory GIB")
        lines += [f"  {i}. {p.kind}: peak {p.estimate.peak / GiB:.1f} of {budget:.1f} GiB{host}",
                  "     " + " ".join(p.flags), "     " + p.note]
    for p in short:
        lines.append(f"  left out: {p.kind} ({' '.join(p.flags)}) needs {p.host_per_node / GiB:.0f} GiB of host "
                     f"memory per node, more than 90% of --host-memory {host_gib:.0f}")
    return "\n".join(lines)


def _terms(e: Estimate | None) -> dict[str, int] | None:
    """An estimate's terms in bytes, with its states and peak."""
    return None if e is None else {**dataclasses.asdict(e), "states": e.states, "peak": e.peak}


def plan_json(cfg: Config, world: int, gpu_gib: float, host_gib: float | None, gpus_per_node: int,
              props: list[Proposal], short: list[Proposal], served: list | None = None) -> dict[str, Any]:
    """`shardfit plan --json` (schema shardfit.plan/1): every figure in bytes.

    configured: the config as given (its micro-batch, 1 when chosen at launch): terms, fits, host_per_node
    largest: per checkpointing mode, the terms of the largest micro-batch that fits (null: none fits)
    proposals, left_out (host memory short): kind, flags (arguments to add), changes (config key -> value), world,
    micro_batch, terms, host_per_node, note; refused: train's line when it refuses the configured layout, else null
    auto_checkpointing (added by cli/plan.py, only with compute.activation_checkpoint=auto): changes (config key ->
    value: what auto chose on this GPU, which configured's terms are of) and line (what the run prints)
    sampling: in-process sampling beside the configured step (plan/sampler.py SamplingCost: decode_kind,
    decode_bytes, bank_bytes, resident, free, kv_blocks, kv_bytes, dtype, served_bytes: free is what is left after
    the frozen extra models too), or {"refused": why}
    served: shardfit serve's frozen extra models (--serve.models; `served`: plan/served.py ServedCost list):
    models (name, params, dtype, shard_bytes, decode_bytes, bytes: one rank's) and total (bytes, one rank)"""
    from shardfit.parallel.layout import refusal
    from shardfit.plan.sampler import refused as sampling_refused
    from shardfit.plan.sampler import sampling_cost

    mine, ok = configured(cfg, world, gpu_gib, host_gib, gpus_per_node)
    refused = refusal(cfg, world)
    served = served or []
    served_total = sum(c.bytes for c in served)

    def proposal(p: Proposal) -> dict[str, Any]:
        return {"kind": p.kind, "flags": p.flags, "changes": p.changes, "world": p.world,
                "micro_batch": p.estimate.micro_batch, "terms": _terms(p.estimate),
                "host_per_node": p.host_per_node, "note": p.note}

    return {"schema": SCHEMA, "model": cfg.model.name, "world": world, "seq_len": cfg.data.seq_len,
            "gpu_memory_gib": gpu_gib, "budget": int(allocation_budget(gpu_gib * GiB)), "host_memory_gib": host_gib,
            "gpus_per_node": gpus_per_node,
            "configured": {"terms": _terms(mine), "fits": ok, "refused": None if refused is None else str(refused),
                           "host_per_node": host_per_node(mine, world, gpus_per_node)},
            "largest": {m: _terms(e) for m, e in largest_per_mode(cfg, world, gpu_gib).items()},
            "proposals": [proposal(p) for p in props], "left_out": [proposal(p) for p in short],
            "sampling": ({"refused": sampling_refused(cfg)} if sampling_refused(cfg) else
                         dataclasses.asdict(sampling_cost(cfg, world, mine, gpu_gib * GiB, served_total))),
            "served": {"models": [{**dataclasses.asdict(c), "bytes": c.bytes} for c in served],
                       "total": served_total}}
