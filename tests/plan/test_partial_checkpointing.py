"""compute.ac_blocks (checkpoint only the first N blocks): the blocks it wraps, the same gradients as no checkpointing,
the plan's terms moving as the blocks do, and the planner's partial_checkpointing proposal (the fewest checkpointed
blocks that fit at the configured micro-batch; printed even when the configuration fits)."""

import copy

import pytest
import torch

from shardfit.config import load_config
from shardfit.config.schema import ComputeConfig
from shardfit.errors import ShardfitError
from shardfit.parallel.parallelize import apply_activation_checkpointing, checkpointed_blocks
from shardfit.plan.activation_trace import block_activation_bytes
from shardfit.plan.estimate import GiB, allocation_budget, estimate, fits
from shardfit.plan.proposals import apply, partial_checkpointing, proposals

QLORA_70B = ["--model.name=llama3-70b", "--data.seq_len=4096", "--lora.rank=16", "--lora.alpha=32",
             "--model.quantize=nf4", "--compute.compile=true", "--compute.activation_checkpoint=full",
             "--train.micro_batch=1", "--train.global_batch=1"]
H100, H200 = 79.1, 139.8  # GiB as torch reports an 80 GB H100 and a 141 GB H200


def _ck(mode="full", every=1, first=0, n=8):
    return checkpointed_blocks(ComputeConfig(activation_checkpoint=mode, ac_every=every, ac_blocks=first), n)


def test_the_first_n_blocks_and_every_kth_of_them():
    assert _ck() == [True] * 8 and _ck("none") == [False] * 8 and _ck("selective", first=2) == [True] * 8
    assert _ck(first=3) == [True] * 3 + [False] * 5
    assert _ck(every=3) == [True, False, False, True, False, False, True, False]
    assert _ck(every=2, first=5) == [True, False, True, False, True, False, False, False]
    assert _ck(first=8) == _ck(first=0)


def test_checkpointing_the_first_blocks_wraps_those_and_leaves_the_gradients_bit_for_bit():
    """The first N blocks run under torch.utils.checkpoint (their forward replaced), the others as they were; the
    loss and every gradient equal those of no checkpointing exactly (recomputation repeats the same ops)."""
    torch.manual_seed(0)
    ref = [torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 16)) for _ in range(4)]
    x = torch.randn(8, 16)

    def run(first):
        blocks = copy.deepcopy(ref)
        apply_activation_checkpointing(blocks, "full" if first is not None else "none", first=first or 0)
        h = x
        for b in blocks:
            h = b(h)
        h.square().mean().backward()
        wrapped = ["forward" in b.__dict__ for b in blocks]
        return h.detach(), [p.grad for b in blocks for p in b.parameters()], wrapped

    out0, grads0, wrapped0 = run(None)
    out2, grads2, wrapped2 = run(2)
    assert wrapped0 == [False] * 4 and wrapped2 == [True, True, False, False]
    assert torch.equal(out0, out2) and all(torch.equal(a, b) for a, b in zip(grads0, grads2))


def test_the_plan_keeps_the_unrecomputed_blocks_activations_and_no_recompute_at_the_peak():
    """70B QLoRA at 4,096 tokens on one GPU: with the first N of 80 blocks checkpointed, activations are N block
    inputs and 80 - N whole blocks; the recompute is on top of the activations only when the last block is
    checkpointed (N = 80: every block; the first blocks' backward comes after the later blocks' activations are
    freed), and then after the frozen head's gathered weight is freed: less than the last block's activations."""
    cfg = load_config(None, QLORA_70B)
    b = block_activation_bytes(cfg, 1, world=1)
    full = estimate(cfg, 1, 1)
    none = estimate(apply(cfg, {"compute.activation_checkpoint": "none"}), 1, 1)
    peaks = []
    for n in (1, 20, 44, 57, 79):
        e = estimate(apply(cfg, {"compute.ac_blocks": n}), 1, 1)
        assert e.activations == n * b["full"] + (80 - n) * b["none"]
        assert e.working == none.working < full.working  # no recompute on top: the loss's or a block's backward
        assert (e.states, e.fsdp) == (full.states, full.fsdp)
        peaks.append(e.peak)
    assert none.peak > peaks[0] and peaks == sorted(peaks, reverse=True)
    # checkpointing the last block too saves its activations and recomputes them in its backward, the head's
    # [V, D] freed by then: 2 [T, D] of gradients, 2 + 3 + 3 [T, ffn] (adapters.backward_extra, recompute_extra)
    # and the recompute, less the head (estimate.released_head), with the block's backward buffers beside: the
    # adapters' fp32 reduce-scatter input and one NF4 weight dequantised (bf16, the largest: [28,672, 8,192])
    T, F, VD = 4096, 28672, 128_256 * 8192
    in_backward = 4 * 16 * (2 * 8192 + 2 * (8192 + 1024) + 2 * 8192 + 3 * (8192 + 28672)) + 2 * F * 8192
    assert full.working == (2 * b["block_input"] + b["ffn_grads"] + 6 * T * F * 2 + b["none"] - 2 * VD
                            + in_backward)
    assert full.peak - peaks[-1] == b["full"] - b["none"] + full.working - none.working < 0
    assert estimate(apply(cfg, {"compute.ac_blocks": 80}), 1, 1).peak == full.peak
    # ac_every: every other block, the last (79) not among them: its backward recomputes nothing at the peak
    every2 = estimate(apply(cfg, {"compute.ac_every": 2}), 1, 1)
    assert every2.activations == 40 * b["full"] + 40 * b["none"] and every2.working == none.working


def test_the_planner_proposes_the_fewest_checkpointed_blocks_that_fit():
    """Full checkpointing at micro-batch 1 fits both GPUs with room (50.7 GiB): on an H200 no checkpointing fits as
    well; on an H100 the first 56 of 80 blocks (57 fit too, 55 do not), 24 blocks' recompute saved (measured on an
    H100: the first 60 at 70.5 GiB, planned 70.0)."""
    cfg = load_config(None, QLORA_70B)
    h200 = partial_checkpointing(cfg, 1, H200)
    assert h200.changes == {"compute.activation_checkpoint": "none"} and "every block keeps" in h200.note
    h100 = partial_checkpointing(cfg, 1, H100)
    assert h100.changes == {"compute.ac_blocks": 56} and h100.flags == ["--compute.ac_blocks=56"]
    assert "the first 56 of 80 blocks instead of 80" in h100.note and "about 10% less compute" in h100.note
    budget = allocation_budget(H100 * GiB)
    for n, fit in ((56, True), (55, False)):
        replanned = load_config(None, [*QLORA_70B, f"--compute.ac_blocks={n}"])
        assert fits(estimate(replanned, 1, 1), budget, H100 * GiB) is fit
    assert proposals(cfg, 1, H100)[0][0].kind == "partial_checkpointing"  # first: nothing given up
    # nothing to propose: already the fewest, or 2 blocks fewer (under 1% of a step), a micro-batch chosen at
    # launch, or no checkpointing that fits as it is
    for extra in (["--compute.ac_blocks=56"], ["--compute.ac_blocks=58"], ["--train.micro_batch=0"]):
        assert partial_checkpointing(load_config(None, [*QLORA_70B, *extra]), 1, H100) is None, extra
    assert partial_checkpointing(load_config(None, [*QLORA_70B, "--compute.activation_checkpoint=none"]), 1,
                                 H200) is None
    # no checkpointing that does not fit the H100: the fewest blocks at its micro-batch, before heavier checkpointing
    none = load_config(None, [*QLORA_70B, "--compute.activation_checkpoint=none"])
    props = proposals(none, 1, H100)[0]
    assert props[0].kind == "partial_checkpointing" and props[1].kind == "checkpointing"
    assert props[0].flags == ["--compute.activation_checkpoint=full", "--compute.ac_blocks=56"]
    assert "instead of every block" in props[0].note
    # micro-batch 2 on an H200: 42 of 80
    two = load_config(None, [*QLORA_70B, "--train.micro_batch=2", "--train.global_batch=2"])
    assert partial_checkpointing(two, 1, H200).changes == {"compute.ac_blocks": 42}


def test_plan_prints_the_proposal_when_the_configuration_fits(capsys):
    from shardfit.cli.main import main

    assert main(["plan", *QLORA_70B, "--nproc", "1", "--gpu-memory", str(H100)]) == 0
    out = capsys.readouterr().out
    assert "<- as configured: fits" in out and "partial_checkpointing: peak 74.2 of 74.6 GiB" in out
    assert "--compute.ac_blocks=56" in out
    assert main(["plan", *QLORA_70B, "--compute.ac_blocks=56", "--nproc", "1", "--gpu-memory", str(H100)]) == 0
    out = capsys.readouterr().out
    assert "full 56/80" in out and "proposals" not in out


def test_more_blocks_than_the_model_has_is_one_line():
    with pytest.raises(ShardfitError, match="compute.ac_blocks: 81 is more than the model's 80 blocks"):
        load_config(None, [*QLORA_70B, "--compute.ac_blocks=81"])


@pytest.mark.parametrize("key", ["--compute.ac_blocks=40", "--compute.ac_every=2"])
@pytest.mark.parametrize("mode", ["none", "selective"])
def test_choosing_blocks_without_full_checkpointing_is_one_line(key, mode):
    """ac_blocks and ac_every pick blocks for full checkpointing: with another mode they would do nothing."""
    with pytest.raises(ShardfitError, match=f"{key[2:].split('=')[0]}: .* but compute.activation_checkpoint={mode}"):
        load_config(None, [*QLORA_70B, f"--compute.activation_checkpoint={mode}", key])
