"""GPU tests of the Engine's RL API: packed token-budget rows with the CUDA document-mask kernels give each datum
the log-probs of its own unpacked forward (compiled: the compiled log-prob chunks), gathering the weights once per
forward call gives them bit for bit, and PPO steps on the GPU train (bf16, compiled blocks)."""

import math

import numpy as np
import pytest
import torch

from tests._dist import run_ranks
from tests.helpers import SMALL

pytestmark = pytest.mark.cuda


def _run(rank, world, extra):
    from shardfit.config import load_config
    from shardfit.rl import AdamParams, make_datum
    from shardfit.rl import DatumEngine as Engine  # the Engine through datums (rl/step.py)

    engine = Engine.start(load_config(None, [*SMALL, "--train.device=cuda", "--train.micro_batch_tokens=64",
                                             "--logging.run_dir=", *extra]))
    rng = np.random.default_rng(0)
    seqs = [rng.integers(0, 256, n + 1) for n in (50, 7, 33, 20, 64)]
    datums = [make_datum(s[:-1], target_tokens=s[1:]) for s in seqs]
    packed = engine.forward(datums)  # one rank: the weights gathered (cast to bf16) once for the call
    engine.gather_once = False
    per_micro_batch = engine.forward(datums)  # FSDP's own: cast again at every micro-batch
    engine.gather_once = True
    same = all(np.array_equal(a["logprobs"], b["logprobs"]) for a, b in zip(packed.outputs, per_micro_batch.outputs))
    gap = 0.0
    with torch.no_grad():
        for s, out in zip(seqs, packed.outputs):  # each datum alone: one document, plain causal attention
            ids = torch.as_tensor(s[:-1], device="cuda")[None]
            ls = torch.log_softmax(engine.model(ids).float()[0], -1)
            ref = ls.gather(1, torch.as_tensor(s[1:], device="cuda")[:, None]).squeeze(1).cpu().numpy()
            gap = max(gap, float(np.abs(out["logprobs"] - ref).max()))
    # the sampler's log-probs are the first weights' (fixed): as the log-probs rise, -ratio x A falls to the clip
    rl = [make_datum(s[:-1], target_tokens=s[1:], logprobs=o["logprobs"], advantages=np.ones(len(s) - 1))
          for s, o in zip(seqs, packed.outputs)]
    losses = []
    for _ in range(6):
        res = engine.forward_backward(rl, "ppo", {"normalize": "token_mean"})
        engine.optim_step(AdamParams(learning_rate=3e-3, grad_clip_norm=1.0))
        losses.append(res.metrics["loss:sum"])
    return {"gap": gap, "losses": losses, "same_gathered_once": same}


@pytest.mark.parametrize("extra", [[], ["--compute.compile=true", "--compute.doc_attention=flex"],
                                   ["--compute.compile=true"],  # auto: flex for forward and training
                                   ["--compute.doc_attention=cudnn_docs"]])
def test_packed_logprobs_equal_each_datum_alone_and_ppo_trains(extra):
    r = run_ranks(_run, 1, extra, backend="nccl")[0]
    assert r["gap"] < 0.05, r  # bf16 compute: packed vs alone differ by rounding only
    assert r["same_gathered_once"]  # gathering once per call changes no bit
    assert all(math.isfinite(x) for x in r["losses"])
    assert r["losses"][-1] < r["losses"][0]  # advantages of 1 everywhere: the log-probs rise, -ratio falls


def _counted(rank, world):
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list

    from shardfit.config import load_config
    from shardfit.models.logprobs import _chunk_stats
    from shardfit.rl import DatumEngine as Engine  # the Engine through datums (rl/step.py)
    from shardfit.rl import make_datum

    engine = Engine.start(load_config(None, [*SMALL, "--train.device=cuda", "--train.micro_batch_tokens=512",
                                             "--compute.loss_chunk=256", "--compute.compile=true",
                                             "--logging.run_dir="]))
    rng = np.random.default_rng(1)
    gap, others = 0.0, 0.0
    for _ in range(8):  # a new count of scored rows at every call: the chunks' shapes stay a handful
        seqs = [rng.integers(0, 256, n + 1) for n in rng.integers(20, 200, 6)]
        datums = []
        for s in seqs:
            mask = (np.arange(len(s) - 1) >= rng.integers(1, len(s) - 1)).astype(np.float32)
            datums.append(make_datum(s[:-1], target_tokens=s[1:], mask=mask))
        full = engine.forward(datums)
        part = engine.forward(datums, "cross_entropy", {"logprobs_at": "counted"})
        for d, a, b in zip(datums, full.outputs, part.outputs):
            on = d.inputs["mask"] != 0
            gap = max(gap, float(np.abs(a["logprobs"] - b["logprobs"])[on].max(initial=0)))
            others = max(others, float(np.abs(b["logprobs"][~on]).max(initial=0)))
    entries = len(_debug_get_cache_entry_list(_chunk_stats.__code__))
    return {"gap": gap, "others": others, "entries": entries}


def test_counted_rows_equal_every_row_compiled_with_few_shapes():
    r = run_ranks(_counted, 1, backend="nccl")[0]
    assert r["gap"] < 0.02 and r["others"] == 0, r  # the head's matmul over fewer rows: rounding at most
    assert 1 <= r["entries"] <= 5, r  # 256 and a rest of 128 or 256 per pass (and "all"'s own tail), not one a count


def test_two_gpus_equal_one():
    """The same calls on 2 GPUs over NCCL (the datums split between ranks, every datum's outputs gathered on both):
    the log-probs and the PPO losses of one GPU, to bf16 rounding."""
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    extra = ["--compute.compile=true"]
    one = run_ranks(_run, 1, extra, backend="nccl")[0]
    two = run_ranks(_run, 2, extra, backend="nccl")
    assert two[0] == two[1], "every rank returns every datum's outputs"
    assert two[0]["gap"] < 0.05  # each datum's log-probs against its own unpacked forward, on 2 ranks
    np.testing.assert_allclose(two[0]["losses"], one["losses"], rtol=3e-2, atol=3e-2)
