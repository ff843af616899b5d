"""The planner's inputs, checked before anything is built: one line instead of an overflow deep in torch.

`shardfit plan` takes its numbers from the CLI (which parses them) and from the API (`plan_table`, `configured`,
`proposals`, ... called with any float). A non-finite or non-positive memory size would make every comparison false
(NaN) or every layout fit (inf). Config keys are checked one by one by the loader, but valid keys can combine into a
model no machine holds: a dim of 2^32 makes the meta device's storage size overflow, a hundred million layers make
the planner build a hundred million blocks. The bounds below are far above any real model or machine, so that only
nonsense is refused; each message names the key and the size it implies.
"""

from __future__ import annotations

import math

from shardfit.config.schema import Config
from shardfit.config.shape import StepShape
from shardfit.errors import ShardfitError

MAX_GIB = 1 << 20  # memory of one GPU or one host: 1 PiB
MAX_WORLD = 1 << 20  # GPUs
MAX_LAYERS = 10_000  # the planner builds and walks every block on the meta device
MAX_PARAMS = 1 << 50  # about 10^15 parameters
MAX_ELEMENTS = 1 << 56  # of one tensor (its bytes must stay below 2^63 as the meta device counts them)
SIZES = "give sizes of a model that fits in a cluster (shardfit recipes lists real ones)"


def check_gib(value, where: str, optional: bool = False) -> None:
    if value is None and optional:
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or not (
            0 < value <= MAX_GIB):
        raise ShardfitError(f"{value!r} GiB is not a memory size (a finite number in (0, {MAX_GIB:,}])", where=where,
                            fix="give one device's memory in GiB, e.g. 79 (80 GB H100) or 139 (H200)")


def check_count(value, where: str, cap: int = MAX_WORLD) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 < value <= cap:
        raise ShardfitError(f"{value!r} is not a number of GPUs in [1, {cap:,}]", where=where, fix="give 1 or more")


def check_plan_inputs(cfg: Config, world: int, gpu_gib: float, host_gib: float | None = None,
                      gpus_per_node: int = 8) -> None:
    """The machine's numbers (--nproc, --gpu-memory, --host-memory, --gpus-per-node) and the model's sizes."""
    check_count(world, "--nproc")
    check_count(gpus_per_node, "--gpus-per-node")
    check_gib(gpu_gib, "--gpu-memory")
    check_gib(host_gib, "--host-memory", optional=True)
    check_model_sizes(cfg)


def check_model_sizes(cfg: Config, micro_batch: int = 64) -> None:
    """Sizes that are each valid but together not a model: too many blocks to plan, more parameters than any
    cluster holds, or a tensor of one micro-batch (the planner tries up to 64) too large to count in bytes."""
    m = cfg.model
    if m.n_layers > MAX_LAYERS:
        raise ShardfitError(f"model.n_layers={m.n_layers:,} is more blocks than the planner builds "
                            f"(at most {MAX_LAYERS:,})", where="model.n_layers", fix=SIZES)
    head_dim = m.head_dim or m.dim // max(m.n_heads, 1)
    attn = m.dim * head_dim * (2 * m.n_heads + 2 * m.n_kv_heads)
    mlp = 3 * m.dim * (m.moe_ffn_dim * m.n_experts + m.dim * m.n_experts if m.n_experts else m.ffn_dim)
    params = m.n_layers * (attn + mlp) + 2 * m.vocab_size * m.dim
    if params > MAX_PARAMS:
        raise ShardfitError(f"model.dim={m.dim:,}, model.n_layers={m.n_layers:,}, model.vocab_size={m.vocab_size:,} "
                            f"and the inner sizes make about {params:.2g} parameters, more than {MAX_PARAMS:.2g}",
                            where="model", fix=SIZES)
    tokens = max(cfg.train.micro_batch, micro_batch) * max(cfg.data.seq_len, StepShape.of(cfg).budget)
    widest = max(m.dim, m.ffn_dim, m.moe_ffn_dim * max(m.experts_per_token, 1), m.n_heads * head_dim)
    for what, n, where in (
            ("the tokens of a micro-batch x the widest activation", tokens * widest, "data.seq_len"),
            ("model.vocab_size x model.dim", m.vocab_size * m.dim, "model.vocab_size"),
            ("the widest weight", m.dim * widest * max(m.n_experts, 1), "model.dim")):
        if n > MAX_ELEMENTS:
            raise ShardfitError(f"{what} is {n:.2g} elements, more than one tensor can hold ({MAX_ELEMENTS:.2g})",
                                where=where, fix=SIZES)
