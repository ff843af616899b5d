"""The MoE terms: what expert parallelism gathers and exchanges, experts outside FSDP (held casts, fresh gradients)
and unsharded accumulation."""

import pytest

from shardfit.config import load_config
from shardfit.plan.estimate import estimate
from tests.plan import MOE


def test_expert_parallel_gathers_a_ranks_experts_and_counts_the_exchange():
    """EP 2 on 2 ranks: each block gathers (bf16) and reduce-scatters (fp32) half its experts (E = W: none; a
    block's backward holds their bf16 weight gradients instead), the states stay 16 B/param/W; without
    checkpointing each block
    holds its bf16 half of the experts until its backward (E = W: out of FSDP, nothing reshards them); a MoE
    block's backward adds the exchange's send, receive and regroup buffers [T*k, H] in bf16. On 4 ranks (E < W,
    FSDP over the experts' pairs) nothing is held. A layout the trainer refuses (EP with offload) is still counted,
    and left out of the proposals."""
    from shardfit.parallel.expert import experts_outside_fsdp
    from shardfit.plan.activation_trace import block_activation_bytes
    from shardfit.plan.proposals import accepted

    one, two = (load_config(None, [*MOE, f"--parallel.expert_parallel={e}"]) for e in (1, 2))
    m = one.model
    experts = 3 * 8 * 64 * m.dim  # per block
    a, b = estimate(one, 2, 2), estimate(two, 2, 2)
    assert a.states == b.states
    held = m.n_layers * 2 * experts // 2 if experts_outside_fsdp(2, 2) else 0
    assert b.activations - a.activations == held
    # two gathered blocks in bf16 of a rank's half of the experts (E = W: of none); the fp32 reduce-scatter input is
    # a backward buffer (working)
    gathered = experts - experts // 2 if not experts_outside_fsdp(2, 2) else experts
    assert a.fsdp - b.fsdp == 2 * 2 * gathered - (2 * experts // 2 if experts_outside_fsdp(2, 2) else 0)
    assert estimate(two, 4, 2).activations == estimate(one, 4, 2).activations
    assert block_activation_bytes(one, 2)["exchange"] == 0
    assert block_activation_bytes(two, 2)["exchange"] == 3 * (2 * 128 * 2) * m.dim * 2
    offloaded = load_config(None, [*MOE, "--parallel.expert_parallel=2", "--parallel.offload=all"])
    assert estimate(offloaded, 2, 2).host > 0 and not accepted(offloaded, 2)


def test_one_rank_holds_its_cast_experts_and_compiles_around_them():
    """A world of one keeps its experts out of FSDP (parallel/expert.py, LocalExperts): an unrecomputed block holds
    its bf16 cast of every expert until its backward, and a compiled block breaks around the experts as under EP
    (SiLU(g) and the routing weights saved). With offload=all FSDP keeps them: neither."""
    from shardfit.parallel.expert import experts_outside_fsdp
    from shardfit.plan.activation_trace import block_activation_bytes

    if not experts_outside_fsdp(1, 1):
        pytest.skip("experts stay in FSDP before torch 2.7")
    plain, compiled = (load_config(None, [*MOE, *extra]) for extra in ([], ["--compute.compile=true"]))
    experts = 3 * 8 * 64 * plain.model.dim  # per block
    held = estimate(plain, 1, 2).activations - estimate(plain, 2, 2).activations
    assert held == plain.model.n_layers * 2 * experts
    ep2 = load_config(None, [*MOE, "--compute.compile=true", "--parallel.expert_parallel=2"])
    assert block_activation_bytes(compiled, 2, world=1)["none"] == block_activation_bytes(ep2, 2)["none"]
    assert block_activation_bytes(compiled, 2, world=2)["none"] < block_activation_bytes(compiled, 2, world=1)["none"]
    offloaded = load_config(None, [*MOE, "--compute.compile=true", "--parallel.offload=all"])
    assert block_activation_bytes(offloaded, 2, world=1) == block_activation_bytes(compiled, 2, world=2)


def test_expert_gradients_outside_fsdp_and_unsharded_accumulation():
    """E = W: the experts' fp32 gradients are freed after every step and written again in backward as it frees the
    activations, so the peak holds the larger of the two (full checkpointing: the gradients), and both while
    micro-batches accumulate. reduce_every_micro_batch=false accumulates unsharded the gradients of what a rank
    gathers: a rank's n/E experts (E < W), none of them outside FSDP (E = W: their fresh gradients instead)."""
    from shardfit.parallel.expert import experts_outside_fsdp

    if not experts_outside_fsdp(2, 2):
        pytest.skip("experts stay in FSDP before torch 2.7")
    full = [*MOE, "--compute.activation_checkpoint=full", "--train.micro_batch=1", "--train.global_batch=4"]
    one, two = (load_config(None, [*full, f"--parallel.expert_parallel={e}"]) for e in (1, 2))
    experts = one.model.n_layers * 3 * 8 * 64 * one.model.dim  # every layer's, whole
    fresh = 4 * experts // 2  # fp32, a rank's half
    a, b = estimate(one, 2, 2), estimate(two, 2, 2)  # no accumulation: 2 ranks x micro-batch 2 = 4
    assert fresh > b.activations and b.grads == a.grads - fresh + (fresh - b.activations)
    a, b = estimate(one, 2, 1), estimate(two, 2, 1)  # two micro-batches: the first's gradients stay
    assert b.grads == a.grads
    unsharded = ["--parallel.reduce_every_micro_batch=false", "--train.global_batch=8"]  # 4 ranks accumulate
    a, b, c = (estimate(load_config(None, [*full, *unsharded, f"--parallel.expert_parallel={e}"]), w, 1)
               for e, w in ((1, 4), (2, 4), (4, 4)))
    assert a.grads - b.grads == 4 * experts // 2  # E = 2 < W = 4: half the experts gathered, half accumulated
    assert a.grads - c.grads == 4 * experts  # E = W: none unsharded (their fresh quarter is the rank's shard)
