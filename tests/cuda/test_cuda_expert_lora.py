"""LoRA on MoE experts on CUDA (issue 23): the grouped-GEMM path with adapters (bf16, ranks grouped_mm must pad)
against the fp64 loop, and training runs where the experts run eagerly (one GPU), inside compiled blocks (2 GPUs, no
EP) and under expert parallelism: adapters learn, the bf16 base stays bit for bit."""

import pytest
import torch

from shardfit.adapters.expert_lora import EXPERT_LEAVES, add_expert_adapters
from shardfit.models.moe import Experts
from tests._dist import run_ranks
from tests.cuda.test_cuda_lora import _train

pytestmark = pytest.mark.cuda


def _rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


@pytest.mark.parametrize("rank", [4, 16])  # 4: 8-byte bf16 rows, padded to 16 bytes for grouped_mm
def test_grouped_mm_expert_adapters_match_loop_forward_and_backward(rank):
    torch.manual_seed(0)
    E, H, I = 16, 256, 128
    counts = torch.tensor([40, 0, 7, 100, 0, 0, 33, 1, 60, 12, 0, 90, 5, 5, 47, 0], device="cuda")
    fast = Experts(E, H, I).cuda()
    add_expert_adapters(fast, ("gate_up_proj", "down_proj"), rank, 2.0 * rank)
    with torch.no_grad():
        for p in fast.parameters():
            p.normal_(0, 0.05)
    ref = Experts(E, H, I).cuda()
    add_expert_adapters(ref, ("gate_up_proj", "down_proj"), rank, 2.0 * rank)
    fast.bfloat16()
    with torch.no_grad():
        ref.double()
        for p, q in zip(fast.parameters(), ref.parameters()):
            q.copy_(p.double())
    xb = torch.randn(int(counts.sum()), H, device="cuda").bfloat16().requires_grad_()
    xr = xb.detach().double().requires_grad_()
    out, want = fast(xb, counts), ref(xr, counts)  # torch._grouped_mm against the fp64 loop
    assert _rel(out, want) < 1e-2
    out.float().square().sum().backward()
    want.square().sum().backward()
    assert _rel(xb.grad, xr.grad) < 2e-2
    for name in EXPERT_LEAVES:
        g, r = getattr(fast, name).grad, getattr(ref, name).grad
        assert _rel(g, r) < 2e-2, name
        assert g[1].abs().sum() == 0 and g[4].abs().sum() == 0  # empty experts: zero gradient


MOE = ["--model.n_experts=8", "--model.experts_per_token=2", "--model.moe_ffn_dim=64", "--train.micro_batch=2",
       "--lora.targets=q_proj,v_proj,experts", "--model.max_seq_len=256", "--data.seq_len=256"]


@pytest.mark.parametrize("world, extra", [
    (1, []),  # the experts outside FSDP (LocalExperts), eager between the compiled halves of each block
    (2, ["--compute.compile=true"]),  # in the blocks' FSDP groups, inside the compiled graph: grouped_mm traced
    (2, ["--parallel.expert_parallel=2", "--compute.activation_checkpoint=full"]),
], ids=["1gpu", "2gpu-compiled", "2gpu-ep2-fullac"])
def test_expert_adapters_train_on_a_bf16_base(tmp_path, world, extra):
    if torch.cuda.device_count() < world:
        pytest.skip(f"needs {world} GPUs")
    res = run_ranks(_train, world, [*MOE, *extra], str(tmp_path), backend="nccl")
    for r in res:
        assert r["losses"][-1] < r["losses"][0] - 0.15, r["losses"]
        assert r["base_same"] and not r["grads_on_base"]
        assert r["dtypes"] == ["torch.bfloat16"] and r["adapter_dtypes"] == ["torch.float32"]
    assert sum(".experts." in k for k in res[0]["state"]) == 2 * 2 * 2  # gate_up and down, A and B, 2 blocks
