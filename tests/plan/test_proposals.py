"""shardfit plan's CPU-offload and HSDP counts, and its proposals: each one fits when re-planned from its flags, and
none is a layout the loader, the launcher or the trainer would refuse."""

import json

import pytest

from shardfit.config import accumulation_steps, load_config
from shardfit.parallel.parallelize import check_replicate
from shardfit.parallel.ulysses import check_sequence_parallel
from shardfit.plan.activation_trace import model_key
from shardfit.plan.estimate import (
    GiB,
    allocation_budget,
    estimate,
    fits,
    host_budget,
    host_per_node,
    pinned_shard_bytes,
)
from shardfit.plan.proposals import SCHEMA, accepted, apply, proposals
from shardfit.plan.table import configured

N_8B = 8_030_261_248  # Llama-3-8B's parameters
BLOCK_8B = 218_112_000  # one of its blocks: q/k/v/o 4096 x (4096 + 2 x 1024 + 4096), MLP 3 x 4096 x 14336, 2 norms
BASE_8B = ["--model.name=llama3-8b", "--data.seq_len=4096"]


def _host_8b(shard: int) -> int:
    """offload=all's host bytes per rank at 8B: pinned fp32 parameter and gradient shards (each rounded up to a power
    of two by the pinned allocator) and the unpinned moments."""
    return 2 * pinned_shard_bytes(model_key(load_config(None, BASE_8B).model), shard) + 8 * N_8B // shard


def test_pinned_shards_round_each_tensor_up_to_a_power_of_two():
    pinned = pinned_shard_bytes(model_key(load_config(None, BASE_8B).model), 1)
    assert 4 * N_8B < pinned < 4.5 * N_8B  # 33.0 GiB for 29.9: the MLP's 224 MiB matrices take 256 MiB
    assert round(_host_8b(1) / GiB, 1) == 125.8  # the H100 host has 128 GiB: offload of 8B on it is at the edge


def test_offload_moves_exactly_the_counted_states_to_the_host():
    """offload=all takes every sharded state (16 B/param/shard) off the GPU and adds only the shards in transit (one
    block's fp32 shard in, one gradient shard out); what a micro-batch needs is unchanged."""
    base = [*BASE_8B, "--train.micro_batch=2", "--train.global_batch=4"]  # 2 ranks, no accumulation
    none, off = (estimate(load_config(None, [*base, f"--parallel.offload={o}"]), 2, 2) for o in ("none", "all"))
    assert none.host == 0 and none.states == 16 * N_8B // 2
    assert off.host == _host_8b(2) > none.states and off.states == 0
    assert off.offload_copies == 2 * 4 * BLOCK_8B // 2
    assert none.peak - off.peak == none.states - off.offload_copies
    assert (off.fsdp, off.activations, off.working) == (none.fsdp, none.activations, none.working)
    assert host_per_node(off, 16, 8) == 8 * off.host and host_per_node(off, 2, 8) == 2 * off.host
    # gradients freed between steps: FSDP2 still allocates them on the host for the step; no GPU cache idles
    freed = estimate(load_config(None, [*base, "--parallel.offload=all", "--memory.keep_grads=false"]), 2, 2)
    assert freed.host == off.host and freed.idle_cache == 0 and freed.peak == off.peak


def test_hsdp_divides_states_and_host_memory_by_the_shard_group():
    """16 GPUs as 2 replicas of 8: states 1/8 each, on the GPU or (offload=all) on the host."""
    base = [*BASE_8B, "--train.micro_batch=1", "--train.global_batch=16"]
    for offload in ("none", "all"):
        hsdp = estimate(load_config(None, [*base, "--parallel.replicate=2", f"--parallel.offload={offload}"]), 16, 1)
        assert (hsdp.states, hsdp.host) == ((16 * N_8B // 8, 0) if offload == "none" else (0, _host_8b(8)))


def _replan(base: list[str], p, world: int):
    """The proposal's flags on the command line, loaded and planned as `shardfit plan` would."""
    flags = [f for f in p.flags if not f.startswith("--nproc=")]
    nproc = next((int(f.split("=")[1]) for f in p.flags if f.startswith("--nproc=")), world)
    cfg = load_config(None, [*base, *flags])
    return cfg, nproc, estimate(cfg, nproc, cfg.train.micro_batch)


SCENARIOS = [  # (base flags, world, GPU GiB, --propose): each proposal is re-planned from its flags
    (["--model.name=llama3-70b", "--data.seq_len=4096"], 8, 80, False),  # the issue's case
    ([*BASE_8B], 1, 80, False),
    ([*BASE_8B, "--train.micro_batch=2"], 16, 80, True),  # fits: alternatives, HSDP on 2 nodes among them
    (["--model.name=llama3-1b", "--data.seq_len=65536", "--train.global_batch=12"], 12, 80, False),  # Ulysses
    (["--model.name=qwen3-30b-a3b", "--data.seq_len=4096", "--compute.activation_checkpoint=full"], 8, 80, True),
]


@pytest.mark.parametrize("base,world,gib,_", SCENARIOS,
                         ids=["70b-8x80", "8b-1x80", "8b-16x80", "1b-seq64k-12", "30b-a3b-8x80"])
def test_every_proposal_fits_when_replanned_from_its_flags(base, world, gib, _):
    cfg = load_config(None, base)
    props, _short = proposals(cfg, world, gib)
    assert props
    for p in props:
        got, nproc, e = _replan(base, p, world)
        assert nproc == p.world and e == p.estimate
        assert e.peak <= allocation_budget(gib * GiB) and fits(e, allocation_budget(gib * GiB), gib * GiB)
        # what the launcher checks before starting processes (the loader already accepted the flags)
        sp = got.parallel.sequence_parallel
        check_sequence_parallel(sp, nproc, got.data.seq_len, got.model.n_heads)
        check_replicate(got.parallel.replicate, nproc)
        accumulation_steps(got.train.global_batch, got.train.micro_batch, nproc // sp)
        assert accepted(got, nproc) and apply(cfg, p.changes) == got
    kinds = [p.kind for p in props]
    order = ["expert_parallel", "checkpointing", "sequence_parallel", "offload_all", "lora", "fp8_base", "qlora",
             "more_gpus", "hsdp"]
    assert kinds == sorted(kinds, key=order.index)  # what the user gives up grows down the list


def test_ulysses_is_proposed_only_where_it_divides():
    """12 GPUs, Llama-3.2-1B (32 heads) at 65,536 tokens: 3, 6 and 12 do not divide the heads (nor the sequence);
    the proposal is the smallest degree that does and fits."""
    cfg = load_config(None, SCENARIOS[3][0])
    props, _ = proposals(cfg, 12, 80)
    sp = [p for p in props if p.kind == "sequence_parallel"]
    assert [p.changes["parallel.sequence_parallel"] for p in sp] == [2]
    assert not accepted(apply(cfg, {"parallel.sequence_parallel": 3, "train.micro_batch": 1}), 12)
    hsdp = [p for p in proposals(load_config(None, SCENARIOS[2][0]), 16, 80)[0] if p.kind == "hsdp"]
    assert [(p.world, p.changes["parallel.replicate"]) for p in hsdp] == [(16, 2)]  # 2 nodes: one shard group each
    assert "traffic across groups is only the gradient all-reduce" in hsdp[0].note


def test_moe_models_are_proposed_expert_parallelism_within_a_node_and_a_shard_group():
    """An MoE model without EP gets it first (it gives up nothing), with the overlapped optimizer step: the largest E
    dividing its 128 experts and a shard group, at most a node; a dense model, or EP already at that degree, none."""
    from shardfit.plan.proposals import expert_parallel_degree

    moe = load_config(None, SCENARIOS[4][0])
    assert [expert_parallel_degree(moe, w, 8) for w in (1, 2, 6, 8, 16)] == [1, 2, 2, 8, 8]
    assert expert_parallel_degree(apply(moe, {"parallel.replicate": 2}), 8, 8) == 4  # EP inside a replica
    assert expert_parallel_degree(load_config(None, BASE_8B), 8, 8) == 1
    first = proposals(moe, 8, 80)[0][0]
    assert first.kind == "expert_parallel" and first.world == 8
    assert first.changes["parallel.expert_parallel"] == 8 and first.changes["parallel.overlap_optimizer"] is True
    assert "holds 16 experts of every layer" in first.note
    # EP gathers no expert: less memory in flight than the same model without it
    plain = next(p for p in proposals(moe, 8, 80)[0] if p.kind == "checkpointing")
    assert first.estimate.fsdp < plain.estimate.fsdp
    done = apply(moe, {"parallel.expert_parallel": 8})
    assert "expert_parallel" not in [p.kind for p in proposals(done, 8, 80)[0]]


def test_70b_on_one_node_of_80_gb_and_8b_on_one_gpu_have_a_proposal_that_fits():
    """The issue: Llama-3-70B on 8 x 80 GB fits with CPU offload of every state; Llama-3-8B on one 80 GB GPU too."""
    big = load_config(None, SCENARIOS[0][0])
    props, _ = proposals(big, 8, 80)
    one_node = [p for p in props if p.world == 8]
    assert [p.kind for p in one_node] == ["offload_all", "lora"]  # the same training first, then LoRA's
    assert next(p for p in props if p.kind == "more_gpus").world == 24  # without offload: three nodes
    small = load_config(None, BASE_8B)
    offload = next(p for p in proposals(small, 1, 80)[0] if p.kind == "offload_all")
    assert {"parallel.offload", "compute.activation_checkpoint", "train.micro_batch"} <= set(offload.changes)
    assert offload.host_per_node == _host_8b(1)  # the whole model's states in one host


def test_host_memory_short_leaves_offload_out():
    """A host too small for any number of GPU-kept blocks that the GPU can also hold (30 GiB: 27 usable, 29 blocks
    kept would be needed, their weights and moments 71 GiB on the GPU): offload of every block is shown with what
    it needs."""
    props, short = proposals(load_config(None, BASE_8B), 1, 80, host_gib=30)
    assert [p.kind for p in short] == ["offload_all"] and "offload_all" not in [p.kind for p in props]
    assert "parallel.offload_gpu_blocks" not in short[0].changes and short[0].host_per_node == _host_8b(1)


# One Llama-3-8B block's pinned fp32 shard on one rank: q and o 64 MiB, k and v 16 MiB, the three 224 MiB MLP matrices
# rounded up to 256 MiB each, two 16 KiB norms
BLOCK_PINNED_8B = (2 * 64 + 2 * 16 + 3 * 256 << 20) + (2 * 16 << 10)
ISSUE_8B = [*BASE_8B, "--parallel.offload=all", "--compute.activation_checkpoint=full", "--train.micro_batch=16",
            "--train.global_batch=16", "--compute.compile=true"]  # issue 13: full fine-tuning on one 80 GB H100


@pytest.mark.parametrize("kept", [3, 32])
def test_gpu_kept_blocks_move_their_states_from_the_host_to_the_gpu(kept):
    """parallel.offload_gpu_blocks=k: the host loses exactly the k blocks' pinned parameter and gradient shards and
    their moments; the GPU gains their fp32 weights and moments (12 B/param) at the peak and their freed gradients
    (4 B/param) in the reduce-scatter pool's cache, or live with accumulation; what a micro-batch needs is the same.
    All 32 kept: no block's shard crosses PCIe any more."""
    base = [*ISSUE_8B, "--train.micro_batch=2"]  # 8 micro-batches: accumulation
    off0 = estimate(load_config(None, ISSUE_8B), 1, 16)
    offk = estimate(load_config(None, [*ISSUE_8B, f"--parallel.offload_gpu_blocks={kept}"]), 1, 16)
    assert off0.host - offk.host == kept * (2 * BLOCK_PINNED_8B + 8 * BLOCK_8B)
    assert (offk.weights, offk.moments, offk.grads) == (4 * kept * BLOCK_8B, 8 * kept * BLOCK_8B, 0)
    assert offk.idle_cache == 4 * kept * BLOCK_8B and off0.idle_cache == 0
    assert offk.peak - off0.peak == 12 * kept * BLOCK_8B - off0.offload_copies * (kept == 32)
    assert offk.offload_copies == (0 if kept == 32 else off0.offload_copies)
    assert (offk.fsdp, offk.activations, offk.working) == (off0.fsdp, off0.activations, off0.working)
    accum = estimate(load_config(None, [*base, f"--parallel.offload_gpu_blocks={kept}"]), 1, 2)
    assert (accum.grads, accum.idle_cache) == (4 * kept * BLOCK_8B, 0)  # live from the first micro-batch on


def test_offload_proposal_keeps_the_fewest_blocks_that_fit_the_host():
    """Issue 13 on the H100 machine (123 GiB host, killed at ~120 GiB resident): all states offloaded need 125.8
    GiB; the proposal keeps the first 5 blocks on the GPU (host 108.6 GiB, under the 110.7 usable; 4 would need
    112.0), with the configured full checkpointing and one micro-batch of 16, peak 46.0 GiB of the GPU's 75.5 GiB
    budget. Re-planned from its flags it fits both."""
    cfg = load_config(None, ISSUE_8B)
    assert not configured(cfg, 1, 80, 123)[1]  # as configured: the host is short
    props, short = proposals(cfg, 1, 80, host_gib=123)
    offload = next(p for p in props if p.kind == "offload_all")
    assert offload.changes == {"parallel.offload_gpu_blocks": 5, "parallel.offload": "all",
                               "compute.activation_checkpoint": "full", "train.micro_batch": 16}
    assert "the first 5 blocks' states stay on the GPU" in offload.note
    got, nproc, e = _replan(ISSUE_8B, offload, 1)
    assert e == offload.estimate and configured(got, 1, 80, 123)[1]
    assert round(e.peak / GiB, 1) == 46.0 and round(e.host / GiB, 1) == 108.6  # measured: 45.4 GiB
    fewer = estimate(apply(got, {"parallel.offload_gpu_blocks": 4}), 1, 16)
    assert host_budget(123) < fewer.host and e.host <= host_budget(123) == 0.9 * 123 * GiB
    assert all(p.kind != "offload_all" for p in short)
    # no host size: nothing to keep on the GPU, the configuration fits as it is
    assert configured(cfg, 1, 80)[1] and "offload_all" not in [p.kind for p in proposals(cfg, 1, 80)[0]]


def test_plan_text_says_which_blocks_stay_on_the_gpu(capsys):
    from shardfit.cli.main import main

    assert main(["plan", *ISSUE_8B, "--nproc", "1", "--gpu-memory", "80", "--host-memory", "123"]) == 0
    out = capsys.readouterr().out
    assert "EXCEEDS the host's 123 GiB (110.7 GiB usable" in out
    assert "--parallel.offload=all --parallel.offload_gpu_blocks=5 --compute.activation_checkpoint=full" in out
    assert main(["plan", *ISSUE_8B, "--parallel.offload_gpu_blocks=5", "--nproc", "1", "--gpu-memory", "80",
                 "--host-memory", "123"]) == 0
    out = capsys.readouterr().out
    assert "CPU offload of all but the first 5 blocks" in out and "as configured: fits" in out
    assert ("108.6 GiB (fp32 parameters and gradients, pinned, and Adam moments, the first 5 blocks' on the GPU "
            "instead" in out)


def test_plan_json_carries_the_proposals_as_numbers(capsys):
    from shardfit.cli.main import main

    assert main(["plan", *BASE_8B, "--nproc", "1", "--gpu-memory", "80", "--host-memory", "512", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["schema"] == SCHEMA and out["configured"]["fits"] is False and out["largest"]["full"] is None
    assert out["configured"]["terms"]["peak"] > out["budget"]
    for p in out["proposals"]:
        assert p["terms"]["peak"] <= out["budget"] and isinstance(p["micro_batch"], int) and p["flags"]
    offload = next(p for p in out["proposals"] if p["kind"] == "offload_all")
    assert offload["host_per_node"] == offload["terms"]["host"] == _host_8b(1)
    assert offload["changes"]["parallel.offload"] == "all"


def test_plan_text_lists_flags_and_host_memory(capsys):
    from shardfit.cli.main import main

    assert main(["plan", *BASE_8B, "--nproc", "1", "--gpu-memory", "80", "--parallel.offload=all",
                 "--compute.activation_checkpoint=full", "--train.micro_batch=1", "--host-memory", "100"]) == 0
    out = capsys.readouterr().out
    assert "as configured: DOES NOT FIT the host" in out and "host memory per node: 125.8 GiB" in out
    assert "EXCEEDS the host's 100 GiB" in out
    assert "--nproc=2 --parallel.offload=none" in out  # more GPUs, without offload


def test_an_offload_proposal_without_host_memory_states_its_assumption(capsys):
    """Issue 27: a 70B proposal must not silently assume 1.1 TB of host memory a node; given --host-memory, the
    same proposal is checked and stated as a figure, and with too little it is left out."""
    from shardfit.cli.main import main

    args = ["plan", "--config", "recipe:llama3-70b-sft", "--nproc", "8", "--gpu-memory", "79"]
    assert main(args) == 0
    out = capsys.readouterr().out
    line = next(x for x in out.splitlines() if "offload_all: peak" in x)
    assert "IF each node has" in line and "not checked, add --host-memory" in line
    assert main([*args, "--host-memory", "2TiB"]) == 0
    line = next(x for x in capsys.readouterr().out.splitlines() if "offload_all: peak" in x)
    assert "IF" not in line and "host memory" in line and "GiB per node" in line
    assert main([*args, "--host-memory", "512GB"]) == 0
    out = capsys.readouterr().out
    assert "offload_all: peak" not in out and "left out: offload_all" in out


@pytest.mark.parametrize("per_node, nodes_text", [(8, "3 nodes of 8 GPUs (shardfit train --nproc 8 --nnodes 3"),
                                                  (3, "nodes of 3 GPUs (shardfit train --nproc 3 --nnodes")])
def test_more_gpus_proposes_whole_nodes(capsys, per_node, nodes_text):
    from shardfit.cli.main import main

    assert main(["plan", "--config", "recipe:llama3-70b-sft", "--nproc", "8", "--gpu-memory", "79",
                 "--gpus-per-node", str(per_node)]) == 0
    out = capsys.readouterr().out
    flags = next(x for x in out.splitlines() if "--nproc=" in x and "offload" not in x)
    world = int(flags.split("--nproc=")[1].split()[0])
    assert world % per_node == 0 and nodes_text in out and "1 nodes" not in out
