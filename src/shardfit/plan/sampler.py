"""In-process sampling (Engine.sample, engine/sampling.py) in the plan: the decode model's memory and the KV cache the
sampler would get, for a config on `world` ranks.

The decode model (sampling/source.py) is a plain CausalLM over the Engine's weights in the compute dtype:
  one rank, weights stored in that dtype (a LoRA run's frozen base)  views of the storage: 0 bytes
  one rank, weights stored otherwise (full fine-tuning's fp32 masters) a copy cast to the compute dtype
  N ranks                                                             every parameter gathered whole, kept
                                                                      (a quantised base as stored: its codes)
plus, with LoRA, its bank of adapter slots (sampling/lora_bank.py: BANK_SLOTS slots at first, each a whole adapter
in the compute dtype). The Engine keeps the decode model and its bank between calls and across training commands
(only the Sampler is dropped), so they count against the training step's peak as well.

The KV cache: when the Sampler is built the allocator's cache has been emptied and the training step's memory
released (sampling/runner.py), so the device's free memory is what is left after the CUDA context, the states a
rank keeps between steps (weights, Adam's moments, the gradients when memory.keep_grads) and the decode model;
(and a server's frozen extra models, plan/served.py: `served_bytes`);
sampling.kv_fraction of it goes to blocks of BLOCK_SIZE tokens (sampling/kv.py's blocks_for_memory: called here,
the same arithmetic), plus the one trash block PagedKV adds. With sampling.keep_kv the Sampler is kept through the
training commands too: its pool then counts against the step's peak, and the plan warns in one line (with the
kv_fraction under which both fit) when they do not fit together.
Refused by Engine.sample, and said so here: parallel.offload=all.
"""

from __future__ import annotations

from dataclasses import dataclass

from shardfit.config.schema import Config
from shardfit.plan.activation_trace import compute_dtype, model_key
from shardfit.plan.adapters import counts, lora_key, quantize
from shardfit.plan.estimate import CUDA_CONTEXT, Estimate, GiB, _meta_model, adapter_params, allocation_budget
from shardfit.sampling.kv import BLOCK_SIZE, block_bytes, blocks_for_memory
from shardfit.sampling.lora_bank import BANK_SLOTS


@dataclass
class SamplingCost:
    """One rank's bytes for in-process sampling (module docstring)."""

    decode_kind: str  # "views" (no copy), "cast" (one rank, a copy in the compute dtype), "gathered" (N ranks)
    decode_bytes: int  # the decode model's own copy of the weights (0: views)
    bank_bytes: int  # its LoRA bank (0 without LoRA)
    resident: int  # what the rank holds between training steps: weights, Adam's moments, kept gradients
    free: int  # the device's free memory when the Sampler is built
    kv_blocks: int  # blocks the sampler gets (sampling/kv.py's blocks_for_memory)
    kv_bytes: int  # their pools, the trash block included (PagedKV.nbytes)
    dtype: str  # the compute dtype, that of the decode model and of the KV pools
    served_bytes: int = 0  # a server's frozen extra models (plan/served.py), held beside the trained model

    @property
    def decode_total(self) -> int:
        """What sampling keeps allocated across training commands, the KV pool aside."""
        return self.decode_bytes + self.bank_bytes


def refused(cfg: Config) -> str | None:
    """Why Engine.sample refuses this config (sampling/source.py), or None."""
    if cfg.parallel.offload != "none":
        return "parameters offloaded to the host (parallel.offload=all)"
    return None


def sampling_cost(cfg: Config, world: int, e: Estimate, device_bytes: float, served_bytes: int = 0) -> SamplingCost:
    """The decode model and the KV cache of one rank of `world` on a GPU of device_bytes; e: the configured step's
    estimate (plan/estimate.py), whose states the rank keeps between steps; served_bytes: what a server's frozen
    extra models hold on the rank (plan/served.py), not free for the KV cache either."""
    dtype = compute_dtype(cfg.compute)
    trained, n_params = adapter_params(cfg)  # the adapters' (whole model) and the base's parameters
    if world > 1:
        kind = "gathered"
    else:  # a LoRA run's frozen base is stored in the compute dtype (adapters.py); full fine-tuning's in fp32
        kind = "views" if cfg.lora.rank or dtype.itemsize == 4 else "cast"
    decode = 0 if kind == "views" else n_params * dtype.itemsize
    if kind == "gathered" and quantize(cfg) != "none":  # the base gathered as stored (sampling/source.py)
        decode = counts(_meta_model(model_key(cfg.model)), lora_key(cfg), quantize(cfg), dtype.itemsize).base_bytes
    bank = BANK_SLOTS * trained * dtype.itemsize if cfg.lora.rank else 0
    shard = world // cfg.parallel.replicate
    kept_grads = 4 * trained // shard if cfg.memory.keep_grads else 0  # sharded fp32 gradients (estimate.py)
    resident = e.weights + e.moments + kept_grads
    free = max(0, int(device_bytes - CUDA_CONTEXT - resident - decode - bank - served_bytes))
    blocks = blocks_for_memory(free, cfg.sampling.kv_fraction, cfg.model, dtype, BLOCK_SIZE)
    one = block_bytes(cfg.model, dtype, BLOCK_SIZE)
    return SamplingCost(kind, decode, bank, resident, free, blocks, (blocks + 1) * one, str(dtype).split(".")[-1],
                        served_bytes)


def kv_fraction_that_fits(cost: SamplingCost, cfg: Config, peak: int, budget: float) -> float:
    """The largest kv_fraction (two decimals, rounded down) whose pool fits beside the step's peak and the decode
    model within `budget`; 0 when none does."""
    one = block_bytes(cfg.model, compute_dtype(cfg.compute), BLOCK_SIZE)
    room = budget - peak - cost.decode_total - one  # the trash block comes with any pool
    if room <= 0 or not cost.free:
        return 0.0
    return min(1.0, int(100 * room / cost.free) / 100)


def _tokens_at(cost: SamplingCost, cfg: Config, fraction: float) -> int:
    """Tokens of the KV cache at another kv_fraction of the same free memory."""
    return blocks_for_memory(cost.free, fraction, cfg.model, compute_dtype(cfg.compute), BLOCK_SIZE) * BLOCK_SIZE


def sampling_lines(cfg: Config, world: int, e: Estimate, gpu_gib: float, served_bytes: int = 0) -> list[str]:
    """The plan's lines about Engine.sample for the configured step `e` on `world` GPUs of gpu_gib (beside a
    server's frozen extra models of served_bytes a rank)."""
    why = refused(cfg)
    if why is not None:
        return [f"in-process sampling (Engine.sample): refused with {why}; sample through Engine.weights() in an "
                "inference engine"]
    budget = allocation_budget(gpu_gib * GiB)
    c = sampling_cost(cfg, world, e, gpu_gib * GiB, served_bytes)
    what = {"views": f"views of the weights in {c.dtype}, no copy",
            "cast": f"a copy of the weights cast to {c.dtype}",
            "gathered": f"the whole model gathered in {c.dtype} on each of {world} ranks"}[c.decode_kind]
    line = (f"in-process sampling (Engine.sample), per rank: decode model {c.decode_bytes / GiB:.2f} GiB ({what})"
            + (f", LoRA bank of {BANK_SLOTS} adapter slots {c.bank_bytes / GiB:.2f} GiB" if cfg.lora.rank else ""))
    together = e.peak + c.decode_total
    if c.decode_total:
        line += (f"; kept across training: step peak + these = {together / GiB:.1f} GiB, "
                 + ("within" if together <= budget else "OVER") + f" the {budget / GiB:.1f} GiB budget")
    tokens = c.kv_blocks * BLOCK_SIZE
    rows = tokens // cfg.data.seq_len
    lines = [line, f"KV cache: {c.kv_blocks} blocks of {BLOCK_SIZE} tokens = {tokens} tokens ({rows} rows of "
             f"prompt+max_tokens = data.seq_len {cfg.data.seq_len}), {c.kv_bytes / GiB:.2f} GiB ({c.dtype}; "
             f"sampling.kv_fraction={cfg.sampling.kv_fraction:g} of the {c.free / GiB:.1f} GiB free after the "
             f"{c.resident / GiB:.1f} GiB of states kept between steps"
             + (" and the decode model" if c.decode_total else "")
             + (f" and the {c.served_bytes / GiB:.1f} GiB of frozen extra models" if c.served_bytes else "") + ")"
             + ("" if c.kv_blocks else ": no room left for a KV cache")]
    if cfg.sampling.keep_kv and together + c.kv_bytes > budget:
        fraction = kv_fraction_that_fits(c, cfg, e.peak, budget)
        lines.append(f"WARNING: sampling.keep_kv keeps the KV cache through training: step peak "
                     f"{e.peak / GiB:.1f} + decode model {c.decode_total / GiB:.1f} + KV cache "
                     f"{c.kv_bytes / GiB:.1f} = {(together + c.kv_bytes) / GiB:.1f} GiB, over the "
                     f"{budget / GiB:.1f} GiB budget: "
                     + (f"set --sampling.kv_fraction={fraction:g} or lower ({_tokens_at(c, cfg, fraction)} tokens)"
                        if fraction else
                        "no KV cache fits beside the step: set --sampling.keep_kv=false"))
    return lines
