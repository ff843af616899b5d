"""Whether a configuration can run on `world` ranks: every rule that depends on the world size, in one place.

Checked by the `shardfit train --nproc/--nnodes` launcher before it starts a process (so a bad layout is one line and
exit 2, not a traceback per rank), by the trainer on each rank, and by `shardfit plan` (`refusal`) before it calls a
layout fitting or proposes one: nothing here needs a model, a device or a process group.
"""

from __future__ import annotations

import functools
import inspect
from dataclasses import dataclass, field

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard

from shardfit.config.loader import accumulation_steps, validate
from shardfit.config.schema import Config, ParallelConfig
from shardfit.errors import ShardfitError


@dataclass(frozen=True)
class Meshes:
    """The device meshes and groups of one layout, built together once (ParallelLayout.meshes)."""

    fsdp: DeviceMesh  # [world], or (replicate R, shard world/R) with HSDP
    sequence: dist.ProcessGroup | None = None  # this rank's Ulysses group (sequence > 1)
    expert: DeviceMesh | None = None  # (efsdp, ep), or (replicate, efsdp, ep) with HSDP; experts running eagerly


@dataclass(frozen=True)
class ParallelLayout:
    """The parallel degrees of a run, this rank's positions in them, and the meshes built from them.

    Every group is made of neighbouring ranks (one node where it fits: the fastest links):
      HSDP      replica r // shard, shard position r % shard (shard = world / replicate ranks per replica);
      Ulysses   data-parallel position r // sequence of world / sequence, sequence position r % sequence (a group
                of `sequence` ranks shares every sample and takes 1/sequence of its tokens);
      experts   EP position r % expert, efsdp position r // expert (inside each replica with HSDP).
    FSDP shards over every rank (HSDP: over each replica's shard group) whatever the sequence and expert degrees.
    Nothing here needs a process group but `meshes`, which builds every mesh of the layout, once.
    """

    world: int  # 0: not known (the planner asks about a layout before choosing its world)
    rank: int = 0
    replicate: int = 1
    expert: int = 1
    sequence: int = 1
    offload: str = "none"
    moe: bool = False  # the model has experts: an expert mesh is built when they run eagerly
    _meshes: dict = field(default_factory=dict, init=False, compare=False, repr=False)

    @classmethod
    def of(cls, par: ParallelConfig, world: int, rank: int = 0, moe: bool = False) -> ParallelLayout:
        """The layout `par` asks for on `world` ranks, unchecked (see `checked`)."""
        return cls(world=world, rank=rank, replicate=par.replicate, expert=par.expert_parallel,
                   sequence=par.sequence_parallel, offload=par.offload, moe=moe)

    @classmethod
    def from_config(cls, cfg: Config, world: int, rank: int = 0) -> ParallelLayout:
        """The layout of `cfg` on `world` ranks once check_layout accepts it (ShardfitError otherwise): built once
        per rank, by Engine.start or the trainer, and handed down (parallelize, the batch source, rl/ packing)."""
        check_layout(cfg, world)
        return cls.of(cfg.parallel, world, rank, moe=cfg.model.n_experts > 0)

    # ---------------------------------------------------------------- degrees and positions
    @property
    def shard(self) -> int:
        """Ranks per replica: FSDP's shard group (every rank without HSDP)."""
        return self.world // self.replicate

    @property
    def replica(self) -> int:
        return self.rank // self.shard

    def replica_ranks(self, replica: int | None = None) -> range:
        """The ranks of one replica (this rank's by default): one shard group, holding one copy of every shard."""
        r = self.replica if replica is None else replica
        return range(r * self.shard, (r + 1) * self.shard)

    @property
    def data_size(self) -> int:
        """Data-parallel ranks: each reads its own share of the global batch."""
        return self.world // self.sequence

    @property
    def data_rank(self) -> int:
        return self.rank // self.sequence

    @property
    def sequence_rank(self) -> int:
        """This rank's position in its Ulysses group: it takes that slice of each sample's tokens."""
        return self.rank % self.sequence

    def sequence_ranks(self) -> range:
        """This rank's Ulysses group."""
        start = self.data_rank * self.sequence
        return range(start, start + self.sequence)

    def expert_ranks(self) -> range:
        """This rank's expert-parallel group."""
        start = self.rank - self.rank % self.expert
        return range(start, start + self.expert)

    # ---------------------------------------------------------------- predicates
    @property
    def experts_outside_fsdp(self) -> bool:
        """E = W (a world of one included: FSDP over one rank would only cast and copy) and a torch whose
        fully_shard takes ignored_params (2.7+): the experts stay out of FSDP (parallel/expert.py). Not with
        offload (FSDP's policy is what moves them to the host). The model must have experts: callers check."""
        return self.expert == self.world and self.offload == "none" and _fsdp_ignores_params()

    @property
    def experts_run_eagerly(self) -> bool:
        """An MoE model's layers get an exchange (MoE.exchange) that runs their experts outside the compiled graph:
        expert parallelism, or one rank whose experts are outside FSDP (LocalExperts)."""
        return self.expert > 1 or self.experts_outside_fsdp

    # ---------------------------------------------------------------- meshes
    def meshes(self, device_type: str) -> Meshes:
        """Every mesh of the layout, built on the first call (in this order on every rank: Ulysses groups, expert
        mesh, FSDP mesh) and the same object afterwards. Needs the process group of `world` ranks."""
        if device_type in self._meshes:
            return self._meshes[device_type]
        if dist.get_world_size() != self.world or dist.get_rank() != self.rank:
            raise RuntimeError(f"layout of rank {self.rank} of {self.world} used by rank {dist.get_rank()} of "
                               f"{dist.get_world_size()}")
        sequence = None
        if self.sequence > 1:
            sequence = init_device_mesh(device_type, (self.data_size, self.sequence),
                                        mesh_dim_names=("dp", "sp"))["sp"].get_group()
        expert = None
        if self.moe and self.experts_run_eagerly:
            if self.replicate == 1:
                expert = init_device_mesh(device_type, (self.world // self.expert, self.expert),
                                          mesh_dim_names=("efsdp", "ep"))
            else:  # each replica holds every expert: gathered within it, reduced across replicas once
                expert = init_device_mesh(device_type, (self.replicate, self.shard // self.expert, self.expert),
                                          mesh_dim_names=("replicate", "efsdp", "ep"))
        if self.replicate == 1:
            fsdp = init_device_mesh(device_type, (self.world,))
        else:  # FSDP2 reduce-scatters within the shard group, all-reduces across replicas and divides by world
            fsdp = init_device_mesh(device_type, (self.replicate, self.shard), mesh_dim_names=("replicate", "shard"))
        self._meshes[device_type] = Meshes(fsdp, sequence, expert)
        return self._meshes[device_type]


@functools.cache
def _fsdp_ignores_params() -> bool:
    return "ignored_params" in inspect.signature(fully_shard).parameters


# -------------------------------------------------------------------- validation: every world-size rule
def check_layout(cfg: Config, world: int) -> None:
    """Ulysses' divisibility, HSDP's replica count, expert parallelism's group size, what offload supports, and
    how the batch splits over the data-parallel ranks: row micro-batches must divide each rank's share of the global
    batch (micro_batch 0 is chosen at launch: checked with 1), token budgets (global_batch counts examples) must
    hold a whole item."""
    sp = cfg.parallel.sequence_parallel
    check_sequence_parallel(sp, world, cfg.data.seq_len, cfg.model.n_heads)
    check_replicate(cfg.parallel.replicate, world)
    check_expert_parallel(cfg.parallel.expert_parallel, world, cfg.model.n_experts, cfg.parallel.replicate,
                          cfg.parallel.offload, cfg.parallel.expert_overlap)
    check_offload(cfg.parallel, cfg.compute.fp8, cfg.model.n_layers)
    if cfg.train.micro_batch_tokens:
        check_token_budget(cfg.train.micro_batch_tokens, cfg.data.seq_len, sp)
    else:
        accumulation_steps(cfg.train.global_batch, cfg.train.micro_batch or 1, world // sp)
    if cfg.train.eval_every and not (cfg.data.val_path or cfg.data.val_fraction):
        raise ShardfitError("train.eval_every is set but there is no validation data", where="train.eval_every",
                            fix="set data.val_path or data.val_fraction, or train.eval_every=0")


def refusal(cfg: Config, world: int) -> ShardfitError | None:
    """What `shardfit train` would say, before building anything, about cfg on `world` ranks: the loader's rules
    (validate) and check_layout's; None when it accepts the layout."""
    try:
        validate(cfg)
        check_layout(cfg, world)
    except ShardfitError as e:
        return e
    return None


def check_token_budget(budget: int, seq_len: int, sp: int) -> None:
    """train.micro_batch_tokens: a [1, budget] row must hold the longest item, and Ulysses cuts it into sp parts."""
    if budget < seq_len:
        raise ShardfitError(f"train.micro_batch_tokens={budget} is below data.seq_len={seq_len}: an item of seq_len "
                            "tokens would not fit", where="train.micro_batch_tokens", fix=f"use at least {seq_len}")
    if budget % sp:
        raise ShardfitError(f"train.micro_batch_tokens={budget} is not a multiple of parallel.sequence_parallel={sp}",
                            where="train.micro_batch_tokens", fix=f"use a multiple of {sp}")


def check_sequence_parallel(P: int, world: int, seq_len: int, n_heads: int) -> None:
    """The sizes Ulysses needs: P divides the world, the sequence and the heads."""
    if world % P:
        raise ShardfitError(f"parallel.sequence_parallel={P} does not divide the world size {world}",
                            where="parallel.sequence_parallel", fix=f"use a divisor of {world}")
    if seq_len % P:
        raise ShardfitError(f"data.seq_len={seq_len} is not a multiple of parallel.sequence_parallel={P}",
                            where="data.seq_len", fix=f"use a multiple of {P}")
    if n_heads % P:
        raise ShardfitError(f"model.n_heads={n_heads} is not a multiple of parallel.sequence_parallel={P} (Ulysses "
                            "splits heads)", where="parallel.sequence_parallel", fix=f"use a divisor of {n_heads}")


def check_replicate(R: int, world: int) -> None:
    """HSDP's replica count must split the ranks into equal shard groups."""
    if world % R:
        raise ShardfitError(f"parallel.replicate={R} does not divide the world size {world}",
                            where="parallel.replicate", fix=f"use a divisor of {world}")


def check_expert_parallel(ep: int, world: int, n_experts: int, replicate: int, offload: str,
                          overlap: str = "none") -> None:
    """Refuse a layout EP cannot run (one line, exit 2)."""
    _check_overlap(overlap, ep, world, replicate)
    if ep == 1:
        return
    where = "parallel.expert_parallel"
    if n_experts == 0:
        raise ShardfitError(f"{where}={ep} needs a mixture-of-experts model (model.n_experts is 0)", where=where,
                            fix="set parallel.expert_parallel=1")
    if world % ep:
        raise ShardfitError(f"{where}={ep} does not divide the world size {world}", where=where,
                            fix=f"use a divisor of {world}")
    if n_experts % ep:
        raise ShardfitError(f"{where}={ep} does not divide model.n_experts={n_experts}", where=where,
                            fix=f"use a divisor of {n_experts}")
    if replicate > 1 and (world // replicate) % ep:
        raise ShardfitError(f"{where}={ep} does not divide the HSDP shard group of {world // replicate} ranks "
                            f"(parallel.replicate={replicate})", where=where,
                            fix=f"use a divisor of {world // replicate}: EP groups stay inside one replica")
    if offload != "none":
        # FSDP's offload policy is what keeps shards on the host; under EP the experts are sharded over the expert
        # mesh (their own FSDP group, or none with E = W: parallel/expert.py). Without EP they are in their block's
        # group and offload with it (expert LoRA adapters included).
        raise ShardfitError(f"{where}={ep} does not combine with parallel.offload={offload} yet", where=where,
                            fix=f"set {where}=1 (the experts then shard and offload with their blocks), or "
                                "parallel.offload=none")


def _check_overlap(overlap: str, ep: int, world: int, replicate: int) -> None:
    """parallel.expert_overlap runs the experts more than once a layer: only where they are outside FSDP."""
    if overlap == "none" or (ep > 1 and ParallelLayout(world, expert=ep).experts_outside_fsdp and replicate == 1):
        return
    if ep == 1:
        why = "expert parallelism over every rank of a world of 2 or more (parallel.expert_parallel is 1)"
    elif ep != world:
        why = f"parallel.expert_parallel equal to the world size ({world}; it is {ep})"
    else:
        why = "no HSDP (parallel.replicate=1)" if replicate > 1 else "torch >= 2.7 (fully_shard's ignored_params)"
    raise ShardfitError(f"parallel.expert_overlap={overlap} needs the experts outside FSDP: {why}; they run "
                        "more than once a layer, which under FSDP would gather them each time",
                        where="parallel.expert_overlap", fix="set parallel.expert_overlap=none" + (
                            f" or parallel.expert_parallel={world}" if world > 1 and ep != world else ""))


def check_offload(cfg: ParallelConfig, fp8: str = "none", n_layers: int | None = None) -> None:
    """Refuse what offload cannot do (one line, exit 2): with compute.fp8 (`fp8`), or keeping more blocks on the GPU
    than the model's n_layers (model.n_layers; unchecked when not given) by parallel.offload_gpu_blocks."""
    if cfg.offload == "all" and fp8 != "none":
        # FP8 weights refresh their scales with an all-reduce of amaxes computed on the weights (on the host here)
        # and all-gather through torchao's own pre-all-gather hook: neither is built for host-resident shards.
        raise ShardfitError("parallel.offload=all does not combine with compute.fp8", where="parallel.offload",
                            fix="set compute.fp8=none, or parallel.offload=none")
    if cfg.offload_gpu_blocks and cfg.offload != "all":
        raise ShardfitError(f"parallel.offload_gpu_blocks={cfg.offload_gpu_blocks} keeps blocks on the GPU out of "
                            f"an offload, but parallel.offload={cfg.offload}", where="parallel.offload_gpu_blocks",
                            fix="set parallel.offload=all, or parallel.offload_gpu_blocks=0")
    if n_layers is not None and cfg.offload_gpu_blocks > n_layers:
        raise ShardfitError(f"parallel.offload_gpu_blocks={cfg.offload_gpu_blocks} is more than the model's "
                            f"{n_layers} blocks", where="parallel.offload_gpu_blocks",
                            fix=f"use at most {n_layers} (all blocks on the GPU; shardfit plan proposes one)")
