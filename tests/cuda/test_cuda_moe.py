"""The grouped-matmul expert path on CUDA against the every-expert loop, for the same routing."""

import pytest
import torch

from shardfit.models.moe import Experts

pytestmark = pytest.mark.cuda


def _rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def test_grouped_mm_experts_match_loop_forward_and_backward():
    torch.manual_seed(0)
    E, H, I = 16, 256, 128
    counts = torch.tensor([40, 0, 7, 100, 0, 0, 33, 1, 60, 12, 0, 90, 5, 5, 47, 0], device="cuda")  # empty experts too
    fast = Experts(E, H, I).cuda()
    with torch.no_grad():
        for p in fast.parameters():
            p.normal_(0, 0.05)
    ref = Experts(E, H, I).cuda().double()
    ref.load_state_dict(fast.state_dict())
    fast = fast.bfloat16()
    with torch.no_grad():  # same (bf16-rounded) weights on both sides
        for p, q in zip(fast.parameters(), ref.parameters()):
            q.copy_(p.double())
    xs = torch.randn(int(counts.sum()), H, device="cuda")
    xb = xs.bfloat16().requires_grad_()
    xr = xb.detach().double().requires_grad_()
    out = fast(xb, counts)  # bf16 on CUDA: torch._grouped_mm
    want = ref(xr, counts)  # fp64: the loop over every expert
    assert _rel(out, want) < 1e-2
    out.float().square().sum().backward()
    want.square().sum().backward()
    assert _rel(xb.grad, xr.grad) < 2e-2
    for (name, p), q in zip(fast.named_parameters(), ref.parameters()):
        assert _rel(p.grad, q.grad) < 2e-2, name
        assert p.grad[1].abs().sum() == 0 and p.grad[4].abs().sum() == 0  # empty experts get zero gradient


def _train_moe(rank, world, extra, run_dir):
    from shardfit.train import Trainer
    from tests.helpers import small_config

    trainer = Trainer(small_config("--train.device=cuda", "--model.n_experts=8", "--model.experts_per_token=2",
                                   "--model.moe_ffn_dim=64", "--train.micro_batch=2", "--train.watchdog_s=90", *extra,
                                   run_dir=run_dir))  # a hang dumps every rank's stacks into run_dir in 90 s
    history = trainer.fit()
    return {"losses": [h["loss"] for h in history], "norms": [h["grad_norm"] for h in history]}


COMPILED = ["--compute.compile=true", "--model.max_seq_len=256", "--data.seq_len=256"]


@pytest.mark.parametrize("extra,ep_extra,tol", [
    (["--compute.param_dtype=float32", "--compute.activation_checkpoint=full"], [], 1e-4),
    # bf16 grouped GEMM, compiled blocks; rows of 256 tokens: the compiled flex kernel needs >= 128 (attention.py)
    (COMPILED, [], 3e-2),
    # the dispatch launched on NCCL's stream while the own rows run (parallel/expert_overlap.py), fp32 to see it
    (["--compute.param_dtype=float32", "--compute.activation_checkpoint=full"], ["--parallel.expert_overlap=both"],
     1e-4),
    (COMPILED, ["--parallel.expert_overlap=dispatch"], 3e-2),
    (COMPILED, ["--parallel.expert_overlap=both"], 3e-2),
], ids=["fp32-fullac", "bf16-compile", "fp32-fullac-overlap-both", "bf16-compile-overlap-dispatch",
        "bf16-compile-overlap-both"])
def test_expert_parallel_on_nccl_matches_plain_sharding(tmp_path, extra, ep_extra, tol):
    """EP over 2 GPUs (one expert group per rank: FSDP's group of one divides by the world size as it copies) trains
    as plain FSDP does: same losses and gradient norms (a wrongly scaled expert gradient shows in the norm)."""
    from tests._dist import run_ranks

    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    plain = run_ranks(_train_moe, 2, extra, str(tmp_path / "plain"), backend="nccl")
    ep = run_ranks(_train_moe, 2, [*extra, *ep_extra, "--parallel.expert_parallel=2"], str(tmp_path / "ep"),
                   backend="nccl")
    for key in ("losses", "norms"):
        torch.testing.assert_close(torch.tensor(ep[0][key]), torch.tensor(plain[0][key]), rtol=tol, atol=tol)


@pytest.mark.parametrize("extra,overlap,tol", [
    (["--compute.param_dtype=float32", "--compute.activation_checkpoint=full"], "both", 1e-4),
    (COMPILED, "dispatch", 3e-2),
    (COMPILED, "both", 3e-2),
], ids=["fp32-fullac-both", "bf16-compile-dispatch", "bf16-compile-both"])
def test_expert_overlap_two_ranks_on_one_gpu_over_gloo(tmp_path, extra, overlap, tol):
    """The overlapped exchange's CUDA path where only one GPU is lent: two ranks on cuda:0 over gloo (its CUDA
    all-to-all copies through the host on its own stream; wait() makes the compute stream wait) against the plain
    exchange on the same two ranks: same losses and gradient norms. Streams, the async launch,
    and compile around the exchange run as under NCCL; NCCL's own stream does not."""
    from tests._dist import run_ranks

    if torch.cuda.device_count() < 1:
        pytest.skip("needs a GPU")
    ep = [*extra, "--parallel.expert_parallel=2"]
    plain = run_ranks(_train_moe, 2, ep, str(tmp_path / "plain"), backend="gloo-one-gpu")
    over = run_ranks(_train_moe, 2, [*ep, f"--parallel.expert_overlap={overlap}"], str(tmp_path / "over"),
                     backend="gloo-one-gpu")
    for key in ("losses", "norms"):
        torch.testing.assert_close(torch.tensor(over[0][key]), torch.tensor(plain[0][key]), rtol=tol, atol=tol)


def test_one_gpu_experts_outside_fsdp_match_two_ranks_of_plain_fsdp(tmp_path):
    """One GPU, one rank: the experts out of FSDP (LocalExperts: the cast in the computation, the gradient written
    by kernels/scaled_accumulate, the block's compiled graph broken around them), bf16 compiled, against plain FSDP
    over two ranks on the same GPU (gloo), whose experts are gathered and reduce-scattered: same losses and norms."""
    from tests._dist import run_ranks

    if torch.cuda.device_count() < 1:
        pytest.skip("needs a GPU")
    one = run_ranks(_train_moe, 1, COMPILED, str(tmp_path / "one"), backend="gloo-one-gpu")
    two = run_ranks(_train_moe, 2, COMPILED, str(tmp_path / "two"), backend="gloo-one-gpu")
    for key in ("losses", "norms"):
        torch.testing.assert_close(torch.tensor(one[0][key]), torch.tensor(two[0][key]), rtol=3e-2, atol=3e-2)


def test_expert_parallel_inside_hsdp_on_nccl_matches_plain_sharding(tmp_path):
    """Multi-node MoE's layout on 4 GPUs: 2 HSDP replicas, EP 2 inside each (experts HSDP-sharded over
    (replicate, efsdp)), against plain FSDP over the 4: same losses and gradient norms."""
    from tests._dist import run_ranks

    if torch.cuda.device_count() < 4:
        pytest.skip("needs 4 GPUs")
    extra = ["--compute.param_dtype=float32", "--compute.activation_checkpoint=full", "--train.global_batch=8"]
    plain = run_ranks(_train_moe, 4, extra, str(tmp_path / "plain"), backend="nccl")
    hsdp = run_ranks(_train_moe, 4, [*extra, "--parallel.replicate=2", "--parallel.expert_parallel=2"],
                     str(tmp_path / "hsdp_ep"), backend="nccl")
    for key in ("losses", "norms"):
        torch.testing.assert_close(torch.tensor(hsdp[0][key]), torch.tensor(plain[0][key]), rtol=1e-4, atol=1e-4)
