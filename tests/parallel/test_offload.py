"""parallel.offload=all (FSDP2's CPUOffloadPolicy) trains, clips, skips and resumes like no offload.

On the CPU the policy runs unpinned (pinning needs CUDA; parallel/offload.py): FSDP2 takes its offload code paths
(host shards checked at lazy init, each reduced gradient moved to the host, host accumulation across
micro-batches) with the device copies being no-ops, and the optimizer is the CPU's fused AdamW with the trainer's
gradient scale as grad_scale. Pinning, the real transfers and the device-drawn initial weights are tested on CUDA
(tests/cuda/test_cuda_offload.py).
"""

import math
import threading

import pytest
import torch

from shardfit.config import load_config
from shardfit.errors import ShardfitError
from shardfit.models import build_model
from shardfit.parallel.dtensor import local_view
from shardfit.parallel.layout import check_offload
from shardfit.parallel.offload import _DeviceTwins, offload_policy, offloaded, step_threads
from shardfit.train import Trainer
from tests._dist import run_ranks
from tests.helpers import EXTEND, full_state, small_config
from tests.helpers import parallelize_config as parallelize

CLIP = 0.5  # below every step's gradient norm in these runs: the clip coefficient is < 1 at each step
ARGS = ["--train.micro_batch=2", "--train.steps=4", f"--train.grad_clip={CLIP}"]


def _tolist(state):
    return {k: v.tolist() for k, v in state.items()}


def _nan_step(t, rank, world, before):
    """One more step with a NaN on the last rank: skipped everywhere, host shards and moments untouched."""
    t.model.model.embed_tokens.register_forward_hook(lambda m, i, out: out * math.nan if rank == world - 1 else out)
    moments = [(s["exp_avg"].to_local().clone(), s["step"].clone()) for s in t.optimizer.state.values()]
    rec = t.train_step()
    after = full_state(t.model)
    return {"skipped": rec.skipped, "bad": rec.bad_ranks,
            "same": all(torch.equal(before[k], after[k]) for k in before),
            "same_opt": all(torch.equal(a, s["exp_avg"].to_local()) and torch.equal(st, s["step"])
                            for (a, st), s in zip(moments, t.optimizer.state.values())),
            "grads_freed": all(p.grad is None for p in t.model.parameters())}


def _both(rank, world, run_dir, sync_too, kept=0):
    """Offload (the CPU step overlapped with the next forward, and with sync_too also in place) and no offload in
    one process group, from the same seed; plus the device-twin initialisation. kept: parallel.offload_gpu_blocks,
    of 4 blocks (2 without)."""
    out = {}
    layers = ["--model.n_layers=4"] if kept else []
    for key in ("all", "all_sync", "none") if sync_too else ("all", "none"):
        off = key.split("_")[0]
        keep = [f"--parallel.offload_gpu_blocks={kept}"] if off == "all" else []
        sync = [f"--parallel.offload_overlap={key != 'all_sync'}"]
        t = Trainer(small_config(*ARGS, *layers, f"--parallel.offload={off}", *keep, *sync, run_dir=f"{run_dir}/{key}"))
        overlapped = t.engine.runner.overlapped
        threads, step = [], t.optimizer.step
        t.optimizer.step = lambda *a, _t=threads, _s=step, **k: (_t.append(threading.current_thread().name),
                                                                  _s(*a, **k))[1]
        blocks = [*t.model.model.layers, t.model]
        history = t.fit()
        state = full_state(t.model)  # a collective: every rank
        out[key] = {"losses": [h["loss"] for h in history], "norms": [h["grad_norm"] for h in history],
                    "overlapped": overlapped, "step_threads": threads,
                    "groups": len(t.engine.runner.groups) if overlapped else 0,
                    "offloaded": [offloaded(m) for m in blocks],
                    "host": all(p.to_local().device.type == "cpu" for p in t.model.parameters()),
                    "grads_freed": all(p.grad is None for p in t.model.parameters()),
                    "state": _tolist(state) if rank == 0 else None}
        if key == "all":
            out["nan"] = _nan_step(t, rank, world, state)
    # Step 6 with offload on a device draws each parameter into a device twin and copies it into the host shard;
    # with the CPU as "device" the twins go through the same DTensor path and must give model.init_weights' values.
    cfg = small_config(*ARGS, *layers, "--parallel.offload=all", f"--parallel.offload_gpu_blocks={kept}")
    models = []
    for twins in (False, True):
        with torch.device("meta"):
            m = build_model(cfg.model)
        parallelize(m, cfg, torch.device("cpu"), world, seed=cfg.train.seed, init=not twins)
        if twins:
            type(m).init_weights(_DeviceTwins(m, torch.device("cpu")), cfg.train.seed, view=local_view)
        models.append(full_state(m))
    out["twins_equal"] = all(torch.equal(models[0][k], models[1][k]) for k in models[0])
    return out


@pytest.mark.parametrize("world,kept", [(2, 0), (2, 2), (1, 2), pytest.param(1, 0, marks=pytest.mark.slow)])
def test_offload_trains_like_no_offload(tmp_path, world, kept):
    """Same losses and parameters after 4 steps with accumulation (2 micro-batches per rank on 2 ranks, 4 on one)
    and clipping active at every step; shards on the host, gradients freed after each step; the CPU step run under
    the next forward equals it run in place. Then a step with a NaN on the last rank is skipped on every rank and
    leaves the host shards and Adam's moments untouched. kept=2: the first 2 of 4 blocks are not offloaded (FSDP's
    own state says so) and are stepped on the main thread, the rest on the worker, with the same results."""
    res = run_ranks(_both, world, str(tmp_path), world == 2, kept, timeout=240)
    r = res[0]
    off, ref = r["all"], r["none"]
    assert off["overlapped"] and not ref["overlapped"]
    # one optimizer.step per offloaded FSDP group per training step on the worker thread, and one on the main thread
    # for the kept blocks' groups together
    worker = [n for n in off["step_threads"] if n.startswith("shardfit-cpu-step")]
    assert len(worker) == 4 * (off["groups"] - kept) and off["groups"] >= 3
    assert len(off["step_threads"]) - len(worker) == (4 if kept else 0)
    if world == 2:  # the overlapped step is the in-place step, bit for bit
        assert not r["all_sync"]["overlapped"]
        assert r["all_sync"]["losses"] == off["losses"] and r["all_sync"]["state"] == off["state"]
    n_blocks = len(off["offloaded"]) - 1  # the blocks, then the whole model (offloaded only if every group is)
    assert off["offloaded"] == [i >= kept for i in range(n_blocks)] + [kept == 0] and not any(ref["offloaded"])
    assert off["host"] and off["grads_freed"]
    assert all(n > CLIP for n in ref["norms"])  # clipping acted at every step
    assert all(x["all"]["losses"] == off["losses"] for x in res)  # every rank derives the same metrics
    torch.testing.assert_close(torch.tensor(off["losses"]), torch.tensor(ref["losses"]), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(torch.tensor(off["norms"]), torch.tensor(ref["norms"]), rtol=1e-5, atol=1e-5)
    assert off["losses"][-1] < off["losses"][0]
    assert set(off["state"]) == set(ref["state"])
    for k, v in off["state"].items():  # fused (offload) against foreach AdamW: a few ulps per step
        torch.testing.assert_close(torch.tensor(v), torch.tensor(ref["state"][k]), rtol=1e-5, atol=1e-6, msg=k)
    assert r["twins_equal"]
    for x in res:
        nan = x["nan"]
        assert nan["skipped"] and nan["bad"] == [world - 1]
        assert nan["same"] and nan["same_opt"] and nan["grads_freed"]


@pytest.mark.parametrize("kept", [0, 2])
def test_offload_resume_equals_uninterrupted(tmp_path, kept):
    """A checkpoint written with offload (DCP reads the host shards and host moments, and with kept blocks the
    device ones, through one optimizer) resumes bit for bit."""
    from tests.train.test_checkpoint_resume import _uninterrupted_then_resumed

    keep = ["--model.n_layers=4", f"--parallel.offload_gpu_blocks={kept}"] if kept else []
    r = run_ranks(_uninterrupted_then_resumed, 2, str(tmp_path), ["--parallel.offload=all", *keep,
                                                                  f"--train.grad_clip={CLIP}"], timeout=240)[0]
    assert r["b"] == r["a"][3:], "resumed losses must equal the uninterrupted run's, bit for bit"
    assert r["same_params"]


def _resume_across_offload(rank, world, root):
    """Written with offload, resumed without: DCP does not care where the shards live."""
    args = [*ARGS, "--train.steps=4", "--checkpoint.final=true"]
    a = Trainer(small_config(*args, run_dir=f"{root}/a"))
    losses_a = [h["loss"] for h in a.fit()]
    b = Trainer(small_config(*args, "--train.steps=2", "--parallel.offload=all", run_dir=f"{root}/b"))
    b.fit()
    c = Trainer(small_config(*args, EXTEND, run_dir=f"{root}/b"))  # resumes step 2 without offload
    assert c.step == 2
    losses_c = [h["loss"] for h in c.fit()]
    return {"a": losses_a, "c": losses_c}


@pytest.mark.slow
def test_checkpoints_move_between_offload_and_not(tmp_path):
    r = run_ranks(_resume_across_offload, 2, str(tmp_path), timeout=240)[0]
    torch.testing.assert_close(torch.tensor(r["c"]), torch.tensor(r["a"][2:]), rtol=1e-5, atol=1e-5)


def _hf_load(rank, world, path):
    out = {}
    for off in ("all", "none"):
        cfg = load_config(None, [f"--model.path={path}", "--data.seq_len=32", "--train.device=cpu",
                                 f"--parallel.offload={off}"])
        with torch.device("meta"):
            model = build_model(cfg.model)
        parallelize(model, cfg, torch.device("cpu"), world, seed=0, init=False)
        from shardfit.weights.hf_load import load_hf_checkpoint

        load_hf_checkpoint(model, path)  # writes into the local shards: host memory under offload
        out[off] = full_state(model)
        out[off + "_offloaded"] = offloaded(model)
    return {"equal": all(torch.equal(out["all"][k], out["none"][k]) for k in out["none"]),
            "offloaded": out["all_offloaded"], "nonzero": all(v.abs().sum() > 0 for k, v in out["all"].items()
                                                             if not k.endswith("norm.weight"))}


@pytest.mark.slow
def test_hf_load_into_offloaded_shards(tmp_path):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=256))
    hf.save_pretrained(tmp_path / "llama", max_shard_size="60KB")
    for r in run_ranks(_hf_load, 2, str(tmp_path / "llama"), timeout=180):
        assert r["equal"] and r["offloaded"] and r["nonzero"]


def test_offload_refusals_are_one_line():
    # offload=optimizer (FSDP2 has none) is no longer a choice: the loader's error, naming the valid ones
    with pytest.raises(ShardfitError) as e:
        small_config("--parallel.offload=optimizer")
    assert e.value.exit_code == 2 and "\n" not in str(e.value)
    assert str(e.value).startswith("parallel.offload: 'optimizer' is not allowed; fix: choose one of none, all")
    with pytest.raises(ShardfitError, match="does not combine with compute.fp8"):
        check_offload(small_config("--parallel.offload=all").parallel, fp8="tensorwise")
    check_offload(small_config("--parallel.offload=all").parallel)  # accepted
    # blocks kept on the GPU: only out of offload=all, and at most every block
    for args, match in ((["--parallel.offload_gpu_blocks=2"], "parallel.offload=none"),
                        (["--parallel.offload=all", "--parallel.offload_gpu_blocks=3"], "more than the model's 2")):
        with pytest.raises(ShardfitError, match=match) as e:
            check_offload(small_config(*args).parallel, n_layers=2)
        assert e.value.exit_code == 2 and "\n" not in str(e.value)
        assert str(e.value).startswith("parallel.offload_gpu_blocks: ")
    check_offload(small_config("--parallel.offload=all", "--parallel.offload_gpu_blocks=2").parallel, n_layers=2)


def test_offload_policy_keeps_the_first_blocks():
    from torch.distributed.fsdp import CPUOffloadPolicy

    par = small_config("--parallel.offload=all", "--parallel.offload_gpu_blocks=2", "--model.n_layers=4").parallel
    cpu = torch.device("cpu")
    assert [isinstance(offload_policy(par, cpu, i), CPUOffloadPolicy) for i in (0, 1, 2, 3, None)] == [
        False, False, True, True, True]  # the embedding, head and root groups (None) stay offloaded
    assert not isinstance(offload_policy(small_config().parallel, cpu, None), CPUOffloadPolicy)


def test_step_threads_share_the_cores_between_local_ranks(monkeypatch):
    before = torch.get_num_threads()
    try:
        assert step_threads(torch.device("cpu")) is None and torch.get_num_threads() == before  # CPU runs: unchanged
        monkeypatch.setattr("os.cpu_count", lambda: 64)
        monkeypatch.setattr("os.sched_getaffinity", lambda pid: set(range(32)), raising=False)
        monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
        # 8 cores per rank, one of them left to the main thread (it launches the GPU work during the step)
        assert "7 threads per rank (8 rank(s)" in step_threads(torch.device("cuda", 0))
        assert torch.get_num_threads() == 7
        monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")  # one rank: every core it may run on
        step_threads(torch.device("cuda", 0))
        assert torch.get_num_threads() == 31
    finally:
        torch.set_num_threads(before)
