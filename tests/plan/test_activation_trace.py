"""What a block saves for backward, traced on the meta device: compiled counts linear in the micro-batch, compiled
MoE blocks as the GPU compiles them, and traces that leave the training run's compile caches alone."""

from shardfit.config import load_config
from shardfit.plan.estimate import estimate
from tests.plan import MOE


def test_compiled_count_is_linear_in_the_micro_batch():
    """The compiled count is traced at micro-batch 1 and 2 and extended linearly: a direct trace agrees exactly."""
    import dataclasses

    import torch

    from shardfit.plan.activation_trace import compiled_line, compiled_saved_bytes, meta_block

    m = load_config(None, ["--model.name=tiny"]).model
    first, per_sequence = compiled_line(tuple(dataclasses.asdict(m).items()), 256, torch.bfloat16, 0)
    assert compiled_saved_bytes(*meta_block(m, 0, 5, 256, torch.bfloat16)) == first + 4 * per_sequence


def test_moe_models_plan_on_meta_and_activations_scale_with_tokens():
    cfg = load_config(None, ["--model.n_experts=8", "--model.experts_per_token=2", "--model.moe_ffn_dim=64",
                             "--model.router_aux_coef=0.01", "--data.seq_len=128"])
    one, two = estimate(cfg, 2, 1), estimate(cfg, 2, 2)
    assert one.activations > 0 and abs(two.activations / one.activations - 2) < 0.01
    assert two.states == one.states and two.fsdp == one.fsdp


def test_compiled_moe_block_recomputes_only_silu_and_expert_parallel_runs_its_experts_eagerly():
    """A compiled MoE block (dynamo on meta, one graph without EP, Inductor's partitioner) saves what the eager block
    saves but SiLU(g) [T*k, I], which the partitioner recomputes from g; the attention half saves less too. Expert
    parallelism leaves the exchange, experts included, out of the compiled graphs (the block breaks in two around
    it): SiLU(g) comes back, and the routing weights [T, k] in bf16, which the combine graph takes as an input."""
    import dataclasses

    import torch

    from shardfit.plan.activation_trace import (
        block_activation_bytes,
        compiled_line,
        compiled_moe_saved_bytes,
        meta_block,
    )

    def saved(*extra):
        return block_activation_bytes(load_config(None, [*MOE, *extra]), 2)["none"]

    silu = 2 * 128 * 2 * 64 * 2  # micro-batch 2 x 128 tokens, top-2, I = 64, bf16
    eager, compiled = saved(), saved("--compute.compile=true")
    assert compiled < eager - silu
    assert saved("--compute.compile=true", "--parallel.expert_parallel=2") - compiled == silu + 256 * 2 * 2
    assert saved("--parallel.expert_parallel=2") == eager  # eager either way
    # traced at micro-batch 1 and 2 and extended linearly, as dense blocks are: a direct trace at 3 agrees
    m = load_config(None, MOE).model
    first, per_sequence = compiled_line(tuple(dataclasses.asdict(m).items()), 128, torch.bfloat16, 0, moe=True)
    assert compiled_moe_saved_bytes(*meta_block(m, 0, 3, 128, torch.bfloat16)) == first + 2 * per_sequence


def test_moe_trace_leaves_no_trace_behind():
    """The plan's dynamo traces use private code copies: the compile caches (and recompile counts) of the training
    run's DecoderBlock.forward, MoE.forward and MoE.run gain nothing."""
    from torch._C._dynamo.eval_frame import _debug_get_cache_entry_list

    from shardfit.models.decoder import DecoderBlock
    from shardfit.models.moe import MoE

    def entries():
        return [len(_debug_get_cache_entry_list(f.__code__)) for f in (MoE.forward, MoE.run, DecoderBlock.forward)]

    before = entries()
    estimate(load_config(None, [*MOE, "--compute.compile=true", "--data.seq_len=96"]), 2, 1)
    estimate(load_config(None, [*MOE, "--compute.compile=true", "--parallel.expert_parallel=2"]), 2, 1)
    assert entries() == before
