"""Expert parallelism (parallel/expert.py) on gloo ranks must train the weights one process trains."""

import pytest
import torch

from shardfit.models.moe import Experts
from shardfit.parallel.expert import ShardedExperts, experts_outside_fsdp
from shardfit.train import Trainer
from tests._dist import run_ranks
from tests.helpers import EXTEND, full_state, small_config

MOE = ["--model.n_experts=8", "--model.experts_per_token=2", "--model.moe_ffn_dim=32", "--train.micro_batch=2"]


def _train_ep(rank, world, overrides, run_dir):
    cfg = small_config(*overrides, run_dir=run_dir)
    trainer = Trainer(cfg)
    layer = trainer.model.model.layers[0].mlp
    local = layer.experts.gate_proj.to_local().shape[0] if hasattr(layer.experts.gate_proj, "to_local") else None
    from torch.distributed.fsdp import FSDPModule

    in_fsdp = isinstance(layer.experts, FSDPModule)
    seen = []
    block = trainer.model.model.layers[0]  # the block calls MoE's phases (models/decoder.py): hook the block
    block.register_forward_hook(lambda m, i, o: seen.append(m.mlp.load.tolist()))  # rows per expert, this rank
    history = trainer.fit()
    state = {k: v.tolist() for k, v in full_state(trainer.model).items()}
    kept = {"experts": layer.experts.gate_proj.grad is not None, "attention": block.self_attn.q_proj.weight.grad
            is not None}  # after the last step's zero_grad, memory.keep_grads=true (the default)
    return {"losses": [h["loss"] for h in history], "norms": [h["grad_norm"] for h in history],
            "state": state if rank == 0 else None, "local_rows": local, "routing": seen, "experts_in_fsdp": in_fsdp,
            "kept_grads": kept, "exchange": type(layer.exchange).__name__,
            "sharded": isinstance(layer.experts, ShardedExperts),
            "experts_module_count": sum(isinstance(m, Experts) for m in trainer.model.modules())}


_ONE: dict[tuple[str, ...], list] = {}  # the one-process reference of the overrides: cases of one config share it


def _one_process(plain: list[str], run_dir: str) -> list:
    """run_ranks(_train_ep, 1, plain) once per session: a run of one process is deterministic (what EP must match),
    so the cases whose plain overrides are the same compare to the same reference."""
    if tuple(plain) not in _ONE:
        _ONE[tuple(plain)] = run_ranks(_train_ep, 1, plain, run_dir)
    return _ONE[tuple(plain)]


@pytest.mark.parametrize("world,ep,ac,extra", [
    (2, 2, "none", []),
    pytest.param(2, 2, "full", [], marks=pytest.mark.slow),  # the layout and exchange of 2x2-full-sparse below
    (4, 2, "selective", []),
    # slow: E = W on 4 ranks with full recomputation is 4x4-full-sparse-overlap-dispatch's, the plain exchange with
    # full recomputation 2x2-full-sparse's; ~3.3 s
    pytest.param(4, 4, "full", [], marks=pytest.mark.slow),
    # 8 tokens a micro-batch, 16 routed rows over 8 experts: experts with no rows on a rank, every step
    (2, 2, "full", ["--data.seq_len=8", "--train.micro_batch=1"]),
    # the exchanges overlapped with the own rows (parallel/expert_overlap.py), with recomputation, and with ranks
    # routing none of their rows to their own experts
    (2, 2, "selective", ["--parallel.expert_overlap=both"]),
    (4, 4, "full", ["--parallel.expert_overlap=dispatch", "--data.seq_len=8", "--train.micro_batch=1"]),
], ids=["2x2-none", "2x2-full", "4x2-selective", "4x4-full", "2x2-full-sparse", "2x2-selective-overlap-both",
        "4x4-full-sparse-overlap-dispatch"])
def test_expert_parallel_matches_single_process(tmp_path, world, ep, ac, extra):
    overrides = [*MOE, *extra, f"--parallel.expert_parallel={ep}", f"--compute.activation_checkpoint={ac}"]
    plain = [x for x in overrides if not x.startswith(("--parallel.expert_parallel", "--parallel.expert_overlap"))]
    res = run_ranks(_train_ep, world, overrides, str(tmp_path), timeout=300)
    assert res[0]["routing"] != res[1]["routing"]  # ranks send their tokens to different experts
    overlap = {"--parallel.expert_overlap=both": "FullyOverlappedExpertExchange",
               "--parallel.expert_overlap=dispatch": "OverlappedExpertExchange"}
    assert res[0]["exchange"] == next((overlap[x] for x in extra if x in overlap), "ExpertExchange")
    # each layer's experts replaced by a module of their own (same parameter names: the states compare key by key)
    assert res[0]["sharded"] and res[0]["experts_module_count"] == 2  # (fully_shard subclasses it further)
    if "--train.micro_batch=1" in extra:
        assert all(any(0 in load for load in r["routing"]) for r in res)  # empty experts on every rank
    assert all(r["local_rows"] == 8 // world for r in res)  # each rank holds its own slice of the experts
    # E = W: the experts stay out of FSDP (cast and gradient division in parallel/expert.py); E < W: their own group
    assert res[0]["experts_in_fsdp"] == (not experts_outside_fsdp(ep, world))
    assert experts_outside_fsdp(2, 2) == (torch.__version__ >= "2.7")
    # gradients kept between steps, but those of experts outside FSDP (step_overlap.zero_grads: written fresh)
    assert res[0]["kept_grads"] == {"experts": res[0]["experts_in_fsdp"], "attention": True}
    one = _one_process(plain, str(tmp_path / "one"))
    # Adam hides a gradient off by a constant factor (it divides by the gradient's own scale): the norms show it.
    for key in ("losses", "norms"):
        torch.testing.assert_close(torch.tensor(res[0][key]), torch.tensor(one[0][key]), rtol=1e-5, atol=1e-5)
    for k, v in res[0]["state"].items():
        torch.testing.assert_close(torch.tensor(v), torch.tensor(one[0]["state"][k]), rtol=1e-4, atol=1e-4, msg=k)


@pytest.mark.skipif(not experts_outside_fsdp(1, 1), reason="experts stay in FSDP before torch 2.7")
def test_one_rank_runs_its_experts_outside_fsdp_as_two_ranks_train_them_inside(tmp_path):
    """A world of one keeps its experts out of FSDP (LocalExperts: cast by the computation, gradients written fresh
    every step) and trains the weights that 2 ranks of plain FSDP (experts gathered and reduce-scattered) train;
    with parallel.offload the experts stay in FSDP (its policy moves their shards to the host)."""
    overrides = [*MOE, "--compute.activation_checkpoint=selective"]
    one = run_ranks(_train_ep, 1, overrides, str(tmp_path / "one"))[0]
    two = run_ranks(_train_ep, 2, overrides, str(tmp_path / "two"))[0]
    # (exchange, experts held, gradients kept): FSDP's shard of 2 ranks holds 4 of the 8 experts' rows
    assert (one["exchange"], one["local_rows"], one["kept_grads"]["experts"]) == ("LocalExperts", 8, False)
    assert (two["exchange"], two["local_rows"], two["kept_grads"]["experts"]) == ("NoneType", 4, True)
    assert one["sharded"] and not two["sharded"]
    for key in ("losses", "norms"):
        torch.testing.assert_close(torch.tensor(one[key]), torch.tensor(two[key]), rtol=1e-5, atol=1e-5)
    for k, v in two["state"].items():
        torch.testing.assert_close(torch.tensor(one["state"][k]), torch.tensor(v), rtol=1e-4, atol=1e-4, msg=k)
    assert not experts_outside_fsdp(1, 1, "all")


RESUME = [*MOE, "--train.steps=6", "--compute.activation_checkpoint=full", "--checkpoint.export_dtype=float32"]


def _run(rank, world, extra, run_dir):
    t = Trainer(small_config(*RESUME, *extra, run_dir=run_dir))
    return {"start": t.step, "losses": [h["loss"] for h in t.fit()]}


def _exported(path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    out = {}
    for f in sorted(path.glob("*.safetensors")):
        out.update(load_file(f))
    return out


def test_expert_parallel_checkpoint_and_export_are_the_plain_models(tmp_path):
    """Saved and exported by 4 ranks under EP 2 (experts FSDP-sharded over 2 ranks each), the Hugging Face export
    holds the tensors one plain process exports, and the checkpoint resumes under EP 2 on 2 ranks (another layout:
    DCP reshards the experts, which are out of FSDP there) to end where the plain run ends, and export the same."""
    ep_dir, plain_dir = tmp_path / "ep_hf", tmp_path / "plain_hf"
    run_ranks(_run, 4, ["--parallel.expert_parallel=2", "--train.steps=3", "--checkpoint.final=true",
                        f"--checkpoint.export_hf={ep_dir}"], str(tmp_path / "a"), timeout=300)
    run_ranks(_run, 1, ["--train.steps=3", f"--checkpoint.export_hf={plain_dir}"], str(tmp_path / "p3"))
    got, want = _exported(ep_dir), _exported(plain_dir)
    assert set(got) == set(want) and any(".experts.7.down_proj." in k for k in got)
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=1e-5, atol=1e-5, msg=k)
    step3 = f"--checkpoint.resume={tmp_path}/a/checkpoints/step_00000003"
    resumed = run_ranks(_run, 2, ["--parallel.expert_parallel=2", step3, EXTEND,
                                  f"--checkpoint.export_hf={tmp_path}/b_hf"], str(tmp_path / "b"), timeout=300)[0]
    plain = run_ranks(_run, 1, [f"--checkpoint.export_hf={tmp_path}/p6_hf"], str(tmp_path / "p6"))[0]
    assert resumed["start"] == 3
    torch.testing.assert_close(torch.tensor(resumed["losses"]), torch.tensor(plain["losses"][3:]), rtol=1e-5,
                               atol=1e-5)
    got, want = _exported(tmp_path / "b_hf"), _exported(tmp_path / "p6_hf")
    assert set(got) == set(want)
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=1e-4, atol=1e-4, msg=k)


def test_regroup_destinations_are_the_stable_sort_by_local_expert():
    """The exchange's arithmetic regroup (no sort) against its definition: arrival rows ordered (peer, expert) go
    where a stable sort by local expert puts them, empty blocks and all-empty exchanges included."""
    from shardfit.models.moe import inverse_permutation
    from shardfit.parallel.expert import regroup_destinations

    g = torch.Generator().manual_seed(0)
    for ep, local in ((2, 4), (4, 2), (1, 8), (3, 5)):
        for trial in range(10):
            received = torch.randint(0, 5, (ep, local), generator=g) * (trial > 0)
            rows = int(received.sum())
            expert = torch.arange(local).repeat(ep).repeat_interleave(received.reshape(-1), output_size=rows)
            want = inverse_permutation(torch.argsort(expert, stable=True))
            assert torch.equal(regroup_destinations(received, rows), want), received


@pytest.mark.parametrize("world,ep,replicate", [
    (4, 2, 2),
    # experts HSDP-sharded over (replicate 2, efsdp 2); 8 processes, ~8 s
    pytest.param(8, 2, 2, marks=pytest.mark.slow),
], ids=["hsdp2-ep2", "hsdp2-efsdp2-ep2"])
def test_expert_parallel_inside_hsdp_replicas_matches_single_process(tmp_path, world, ep, replicate):
    """EP with HSDP (multi-node MoE): each replica of world/R ranks holds every expert, split over its EP groups;
    the experts are HSDP-sharded over (replicate, efsdp), so nothing of theirs is gathered across replicas and
    their gradients are all-reduced across them. Trains what one process trains."""
    batch = [f"--train.global_batch={2 * world}"]
    overrides = [*MOE, *batch, f"--parallel.expert_parallel={ep}", f"--parallel.replicate={replicate}",
                 "--compute.activation_checkpoint=full"]
    res = run_ranks(_train_ep, world, overrides, str(tmp_path), timeout=300)
    assert all(r["local_rows"] == 8 // (world // replicate) for r in res)  # a replica's shard of the experts
    one = run_ranks(_train_ep, 1, [*MOE, *batch, "--compute.activation_checkpoint=full"], str(tmp_path / "one"))
    for key in ("losses", "norms"):
        torch.testing.assert_close(torch.tensor(res[0][key]), torch.tensor(one[0][key]), rtol=1e-5, atol=1e-5)
    for k, v in res[0]["state"].items():
        torch.testing.assert_close(torch.tensor(v), torch.tensor(one[0]["state"][k]), rtol=1e-4, atol=1e-4, msg=k)


def test_hsdp_expert_parallel_checkpoint_resumes_under_another_layout(tmp_path):
    """Saved by 4 ranks under HSDP 2 x EP 2 (expert DTensors over replicate, efsdp and ep), resumed by 2 ranks under
    plain EP 2 (experts out of FSDP): ends where one plain process ends."""
    run_ranks(_run, 4, ["--parallel.expert_parallel=2", "--parallel.replicate=2", "--train.steps=3",
                        "--checkpoint.final=true", "--train.global_batch=8"], str(tmp_path / "a"), timeout=300)
    step3 = f"--checkpoint.resume={tmp_path}/a/checkpoints/step_00000003"
    resumed = run_ranks(_run, 2, ["--parallel.expert_parallel=2", step3, "--train.global_batch=8", EXTEND],
                        str(tmp_path / "b"), timeout=300)[0]
    plain = run_ranks(_run, 1, ["--train.global_batch=8"], str(tmp_path / "p6"))[0]
    assert resumed["start"] == 3
    torch.testing.assert_close(torch.tensor(resumed["losses"]), torch.tensor(plain["losses"][3:]), rtol=1e-5,
                               atol=1e-5)
