"""`shardfit plan`: a rank's peak GPU memory before launch, the largest micro-batch that fits, and proposals."""

from __future__ import annotations

from shardfit.cli.args import count, gib, number, take_options
from shardfit.errors import ShardfitError

PLAN_HELP = """\
Predict a rank's peak GPU memory before launch, pick the largest micro-batch that fits, and when the configuration
does not fit, propose configurations that do.

  shardfit plan [--config FILE.toml | --config recipe:NAME] [--section.key=value ...] --nproc N [--gpu-memory GIB]
                [--host-memory GIB] [--gpus-per-node G] [--models N] [--versions K] [--propose] [--json]

The same config keys as `shardfit train` (model, data.seq_len, parallel.*, compute.*, memory.keep_grads). --nproc is
the number of GPUs the model is sharded over, all nodes together; --gpu-memory the memory of one GPU in GiB (default:
this machine's GPU, else 80). With --compute.compile=true dense blocks are counted as the compiled graph saves them.
With --parallel.offload=all the host memory each node needs is printed; --host-memory (one node's, GiB) checks it.
With --compute.activation_checkpoint=auto the plan is of what a run would choose on a GPU of --gpu-memory, and says
which blocks that is (in --json: auto_checkpointing). With LoRA, --models N and --versions K count a server's LoRA
models on one base and their frozen versions (plan/models.py): what each adds to a rank, and how many models fit;
without LoRA, --versions K counts frozen copies of every weight (shardfit serve's serve.versions); --models N also
counts a pass of the N models in one forward/backward (their whole adapters and gradients on every rank).
In-process sampling (Engine.sample, shardfit serve) is counted too (plan/sampler.py): the decode model's memory (none
on one GPU where the weights are viewed in the compute dtype, a cast copy where their dtype differs, the whole model
on each of N GPUs) and the KV cache the sampler would get at sampling.kv_fraction of the memory left after the states
kept between steps; with sampling.keep_kv=true a warning when that cache and the step's peak do not fit together.
With --serve.models=PATH[,PATH...] (shardfit serve's frozen extra models) each one's bytes a rank (its weights in the
compute dtype, sharded like the trained model; on N GPUs also its whole model gathered for sampling), their total,
and the KV cache counted in what is free after them (plan/served.py).

Proposals, printed when the configuration does not fit or always with --propose, cheapest first: fewer checkpointed
blocks (--compute.ac_blocks; also printed when a configuration with full checkpointing fits with room), expert
parallelism within a node with the overlapped optimizer step (MoE models), checkpointing and micro-batch, sequence
parallelism, CPU offload, more GPUs, HSDP with shard groups of whole nodes (--gpus-per-node, default 8). Each is the
flags to add, re-planned with them; --nproc=N in a proposal is the world size (on several nodes: shardfit train
--nproc G --nnodes N/G). --json prints the plan and the proposals as JSON, every figure in bytes (schema
shardfit.plan/1, described in src/shardfit/plan/proposals.py).
"""


def plan(argv: list[str]) -> int:
    if any(a in ("-h", "--help") for a in argv):
        print(PLAN_HELP)
        return 0
    switches = {a for a in argv if a in ("--propose", "--json")}
    opts, rest = take_options([a for a in argv if a not in switches],
                              ("--config", "--nproc", "--gpu-memory", "--host-memory", "--gpus-per-node", "--models",
                               "--versions"))
    # The numbers first: each is one line before the config is read.
    world = count(opts.get("--nproc", "1"), "--nproc", "GPUs")
    per_node = count(opts.get("--gpus-per-node", "8"), "--gpus-per-node", "GPUs per node")
    models = count(opts.get("--models", "1"), "--models", "LoRA models")
    versions = number(opts.get("--versions", "0"), "--versions", int)
    if versions < 0:
        raise ShardfitError(f"{versions} is out of range", where="--versions", fix="give 0 or more frozen versions")
    gpu = opts.get("--gpu-memory")
    gpu_gib = None if gpu is None else gib(gpu, "--gpu-memory", "give one GPU's memory in GiB, e.g. 79 (80 GB H100) "
                                           "or 139 (H200)")
    host_gib = (gib(opts["--host-memory"], "--host-memory", "give one node's host memory in GiB, e.g. 1900")
                if "--host-memory" in opts else None)
    from shardfit.config import load_config
    from shardfit.plan.proposals import accepted, apply, partial_checkpointing, plan_json, proposals, proposals_text
    from shardfit.plan.table import configured, plan_table
    from shardfit.weights.peft_config import adapter_lora_fields

    cfg = load_config(opts.get("--config"), rest, adapter_lora_fields)
    if gpu_gib is None:
        import torch

        gpu_gib = torch.cuda.get_device_properties(0).total_memory / 2**30 if torch.cuda.is_available() else 80.0
    gpu_gib *= cfg.memory.max_fraction or 1.0  # the share the run may use, as train caps it (device_memory_bytes)
    auto = None
    if cfg.compute.activation_checkpoint == "auto":  # what the run would choose on this GPU (plan/auto_checkpointing)
        from shardfit.plan.auto_checkpointing import auto_checkpointing

        changes, line = auto_checkpointing(cfg, world, gpu_gib)  # one search: the choice and its line
        auto, cfg = {"changes": changes, "line": line}, apply(cfg, changes)
    propose = ("--propose" in switches or not configured(cfg, world, gpu_gib, host_gib, per_node)[1]
               or not accepted(cfg, world))  # e.g. a layout shardfit train refuses: counted, with what would fit
    if propose:
        props, short = proposals(cfg, world, gpu_gib, host_gib, per_node)
    else:  # it fits: still say when fewer checkpointed blocks would (less recompute, the same micro-batch)
        partial = partial_checkpointing(cfg, world, gpu_gib, per_node)
        props, short = [partial] if partial else [], []
    from shardfit.plan.served import served_costs
    from shardfit.serve.served import served_configs

    served = served_costs(served_configs(cfg), world)  # each --serve.models path read as serve reads it
    if "--json" in switches:
        import json

        out = plan_json(cfg, world, gpu_gib, host_gib, per_node, props, short, served)
        if auto:  # the configured terms are those of the choice: say which it is
            out["auto_checkpointing"] = auto
        print(json.dumps(out, indent=1))
        return 0
    print(plan_table(cfg, world, gpu_gib, host_gib, per_node))
    from shardfit.plan.estimate import allocation_budget
    from shardfit.plan.sampler import sampling_lines
    from shardfit.plan.served import served_lines

    e, _ = configured(cfg, world, gpu_gib, host_gib, per_node)
    print("\n".join(["", *served_lines(served, world, e.peak, allocation_budget(gpu_gib * 2**30)),
                     *sampling_lines(cfg, world, e, gpu_gib, sum(c.bytes for c in served))]))
    if "--versions" in opts or (cfg.lora.rank and "--models" in opts):  # a server's clients (engine/registry.py)
        if not cfg.lora.rank and models > 1:
            raise ShardfitError("several models share one base only with LoRA", where="--models",
                                fix="add --lora.rank=R (e.g. 16), as shardfit serve would run")
        from shardfit.plan.models import models_lines

        print("\n".join(models_lines(cfg, world, models, versions, e.peak, allocation_budget(gpu_gib * 2**30))))
    elif "--models" in opts and models > 1:
        raise ShardfitError("several models share one base only with LoRA", where="--models",
                            fix="add --lora.rank=R (e.g. 16), as shardfit serve would run")
    if auto:
        print(auto["line"])
    if propose or props:
        print("\n" + proposals_text(props, short, gpu_gib, host_gib))
    return 0
