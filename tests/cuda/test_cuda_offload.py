"""GPU test of parallel.offload=all: shards pinned on the host, less GPU memory, the no-offload losses (bf16)."""

import pytest
import torch

from shardfit.train import Trainer
from tests._dist import run_ranks
from tests.helpers import full_state, small_config

pytestmark = pytest.mark.cuda
SIZE = ["--train.device=cuda", "--model.dim=512", "--model.n_layers=4", "--model.n_heads=8", "--model.ffn_dim=1536",
        "--data.seq_len=64", "--train.steps=6", "--train.micro_batch=2", "--train.warmup_steps=2",
        "--train.lr=1e-3", "--logging.log_every=100", "--checkpoint.every=3"]


def _train(rank, world, off, root):
    run_dir = f"{root}/{off}"
    cfg = small_config(*SIZE, f"--parallel.offload={off}", run_dir=run_dir)
    trainer = Trainer(cfg)
    start = full_state(trainer.model)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    history = trainer.fit()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated()
    end = full_state(trainer.model)
    locals_ = [p.to_local() for p in trainer.model.parameters()]
    moments = [t for s in trainer.optimizer.state.values() for k, t in s.items() if k != "step"]
    out = {"losses": [h["loss"] for h in history], "peak": peak, "overlapped": trainer.engine.runner.overlapped,
           "on_host": all(t.device.type == "cpu" for t in locals_),
           "pinned": all(t.is_pinned() for t in locals_),
           "moments_on_host": all(t.to_local().device.type == "cpu" for t in moments),
           "buffers_on_gpu": all(b.device.type == "cuda" for b in trainer.model.buffers())}
    if rank == 0:
        torch.save({"start": start, "end": end}, f"{root}/{off}_state.pt")
    if off == "all":
        # resume the offloaded run's step-3 checkpoint (DCP over NCCL, host shards) in a new run directory
        resumed = Trainer(small_config(*SIZE, "--parallel.offload=all",
                                       f"--checkpoint.resume={run_dir}/checkpoints/step_00000003",
                                       run_dir=f"{root}/resumed"))
        out["resumed"] = [h["loss"] for h in resumed.fit()]
    return out


def test_offload_all_trains_like_no_offload_with_less_gpu_memory(tmp_path):
    world = min(2, torch.cuda.device_count())
    ref = run_ranks(_train, world, "none", str(tmp_path), backend="nccl")
    off = run_ranks(_train, world, "all", str(tmp_path), backend="nccl")
    for r in off:
        assert r["on_host"] and r["pinned"] and r["moments_on_host"] and r["buffers_on_gpu"]
        assert r["overlapped"]  # the CPU step ran under the next forward
    assert not any(r["on_host"] for r in ref)
    # fp32 weights, gradients and Adam moments (16 bytes per parameter, /world) left the GPU
    assert max(r["peak"] for r in off) < 0.5 * min(r["peak"] for r in ref), ([r["peak"] for r in off],
                                                                           [r["peak"] for r in ref])
    a, b = torch.load(tmp_path / "all_state.pt"), torch.load(tmp_path / "none_state.pt")
    for k in b["start"]:  # initial values drawn on the GPU, copied into the host shards: the same weights
        assert torch.equal(a["start"][k], b["start"][k]), k
    # bf16 compute on identical weights; the steps differ only in the CPU's fused AdamW and the scale's rounding
    torch.testing.assert_close(torch.tensor(off[0]["losses"]), torch.tensor(ref[0]["losses"]), rtol=1e-2, atol=1e-2)
    for k in b["end"]:
        diff = (a["end"][k].float() - b["end"][k].float()).norm() / b["end"][k].float().norm()
        assert diff < 2e-2, (k, diff.item())
    assert off[0]["resumed"] == off[0]["losses"][3:]  # the checkpoint written with offload resumes exactly


def _train_and_export(rank, world, off, root, device):
    # vocab 265: the embedding and output rows split unevenly over 2 ranks (133 + 132), the short-shard case
    cfg = small_config(*SIZE, f"--train.device={device}", "--train.steps=2", "--model.vocab_size=265",
                       f"--parallel.offload={off}", f"--checkpoint.export_hf={root}/{off}_hf",
                       "--checkpoint.export_dtype=float32", run_dir=f"{root}/{off}_run")
    trainer = Trainer(cfg)
    trainer.fit()  # exports at the end (checkpoint.export_hf)
    state = full_state(trainer.model)  # gathered by DCP's own code path, not the exporter's
    if rank == 0:
        torch.save(state, f"{root}/{off}_trained.pt")
    return {"on_host": all(p.to_local().device.type == "cpu" for p in trainer.model.parameters())}


def _exported(path):
    from safetensors.torch import load_file

    return {k: v for f in sorted(path.glob("*.safetensors")) for k, v in load_file(f).items()}


def test_offload_all_exports_hf_weights_equal_to_the_trained_ones(tmp_path):
    """checkpoint.export_hf under offload=all: the exporter copies each host shard to the GPU for NCCL's gather.
    Two GPUs where there are (on one, DTensor skips the collective of a mesh of one rank, so the NCCL-on-host-tensor
    failure this guards against cannot occur)."""
    _check_export(tmp_path, "cuda", min(2, torch.cuda.device_count()))


def _check_export(tmp_path, device, world):
    """Both offload settings trained 2 steps and exported; each export equals its run's weights gathered by DCP."""
    backend = "nccl" if device == "cuda" else "gloo"
    for off in ("all", "none"):
        ranks = run_ranks(_train_and_export, world, off, str(tmp_path), device, backend=backend)
        assert off == "none" or all(r["on_host"] for r in ranks)  # the exported shards were on the host
    runs = {off: (_exported(tmp_path / f"{off}_hf"), torch.load(tmp_path / f"{off}_trained.pt"))
            for off in ("all", "none")}
    for off, (exported, trained) in runs.items():
        assert exported and set(exported) <= set(trained), off
        for k, t in exported.items():  # fp32 weights written as fp32: bit-equal to the trained parameters
            assert torch.equal(t, trained[k]), (off, k)
    # and the offloaded run's weights are the no-offload run's up to the CPU optimizer's rounding (test above)
    (a, _), (b, _) = runs["all"], runs["none"]
    for k in b:
        assert (a[k] - b[k]).norm() / b[k].norm() < 2e-2, k


def _train_kept(rank, world, root, overlap):
    """offload=all keeping the first 2 of 4 blocks on the GPU (parallel.offload_gpu_blocks): where each block's
    shards and moments live, and the run's losses and weights; the overlapped run also resumes its step-3 checkpoint."""
    keep = [*SIZE, "--parallel.offload=all", "--parallel.offload_gpu_blocks=2", f"--parallel.offload_overlap={overlap}"]
    run_dir = f"{root}/kept{int(overlap)}"
    trainer = Trainer(small_config(*keep, run_dir=run_dir))
    start = full_state(trainer.model)
    history = trainer.fit()
    end = full_state(trainer.model)
    opt = trainer.optimizer
    blocks = [[p.to_local() for p in b.parameters()] for b in trainer.model.model.layers]
    out = {"losses": [h["loss"] for h in history], "overlapped": trainer.engine.runner.overlapped,
           "devices": [sorted({t.device.type for t in b}) for b in blocks],
           "pinned": [all(t.is_pinned() for t in b) for b in blocks],
           "moments": [sorted({opt.state[p]["exp_avg"].to_local().device.type for p in b.parameters()})
                       for b in trainer.model.model.layers],
           "embedding_on_host": trainer.model.model.embed_tokens.weight.to_local().device.type == "cpu"}
    if rank == 0:
        torch.save({"start": start, "end": end}, f"{root}/kept{int(overlap)}_state.pt")
    if overlap:
        resumed = Trainer(small_config(*keep, f"--checkpoint.resume={run_dir}/checkpoints/step_00000003",
                                       run_dir=f"{root}/kept_resumed"))
        out["resumed"] = [h["loss"] for h in resumed.fit()]
    return out


def test_offload_gpu_blocks_keep_the_first_blocks_on_the_gpu(tmp_path):
    """The first 2 blocks' shards and Adam moments on the GPU (not pinned host memory), the others' on the host; one
    optimizer over both devices (torch's fused AdamW groups by device): the overlapped step (kept groups on the main
    thread, the rest on the worker) equals the synchronous one bit for bit, resumes exactly, and starts from the
    no-offload weights."""
    world = min(2, torch.cuda.device_count())
    ref = run_ranks(_train, world, "none", str(tmp_path), backend="nccl")  # writes none_state.pt
    kept = run_ranks(_train_kept, world, str(tmp_path), True, backend="nccl")
    sync = run_ranks(_train_kept, world, str(tmp_path), False, backend="nccl")
    for r in kept:
        assert r["overlapped"] and r["embedding_on_host"]
        assert r["devices"] == [["cuda"], ["cuda"], ["cpu"], ["cpu"]] and r["pinned"] == [False, False, True, True]
        assert r["moments"] == [["cuda"], ["cuda"], ["cpu"], ["cpu"]]
    assert not sync[0]["overlapped"] and sync[0]["losses"] == kept[0]["losses"]
    a, s, b = (torch.load(tmp_path / f"{k}_state.pt") for k in ("kept1", "kept0", "none"))
    for k in b["start"]:  # kept blocks drawn in place on the GPU, the others through device twins: the same weights
        assert torch.equal(a["start"][k], b["start"][k]), k
    for k in a["end"]:  # the overlapped step is the synchronous one; both within bf16 noise of no offload
        assert torch.equal(a["end"][k], s["end"][k]), k
        diff = (a["end"][k].float() - b["end"][k].float()).norm() / b["end"][k].float().norm()
        assert diff < 2e-2, (k, diff.item())
    torch.testing.assert_close(torch.tensor(kept[0]["losses"]), torch.tensor(ref[0]["losses"]), rtol=1e-2, atol=1e-2)
    assert kept[0]["resumed"] == kept[0]["losses"][3:]
