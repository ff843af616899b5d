"""Whether a configuration can run on `world` ranks: every rule that depends on the world size, in one place.

Checked by the `shardfit train --nproc/--nnodes` launcher before it starts a process (so a bad layout is one line and
exit 2, not a traceback per rank), by the trainer on each rank, and by `shardfit plan` (`refusal`) before it calls a
layout fitting or proposes one: nothing here needs a model, a device or a process group.
"""

from __future__ import annotations

from shardfit.config.loader import accumulation_steps, validate
from shardfit.config.schema import Config
from shardfit.errors import ShardfitError
from shardfit.parallel.expert import check_expert_parallel
from shardfit.parallel.offload import check_offload
from shardfit.parallel.parallelize import check_replicate
from shardfit.parallel.ulysses import check_sequence_parallel


def check_token_budget(budget: int, seq_len: int, sp: int) -> None:
    """train.micro_batch_tokens: a [1, budget] row must hold the longest item, and Ulysses cuts it into sp parts."""
    if budget < seq_len:
        raise ShardfitError(f"train.micro_batch_tokens={budget} is below data.seq_len={seq_len}: an item of seq_len "
                            "tokens would not fit", where="train.micro_batch_tokens", fix=f"use at least {seq_len}")
    if budget % sp:
        raise ShardfitError(f"train.micro_batch_tokens={budget} is not a multiple of parallel.sequence_parallel={sp}",
                            where="train.micro_batch_tokens", fix=f"use a multiple of {sp}")


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
    check_offload(cfg.parallel, cfg.model.n_layers)
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
