"""Sampling under FSDP on 2 gloo ranks: the same tokens and log-probs as the whole model in one process, every
rank leaving the decode loop together; and the command loop keeps ranks in step through a run of commands."""

from __future__ import annotations

import numpy as np
import torch

from tests._dist import run_ranks


def _cfg():
    from shardfit.config import load_config

    return load_config(None, ["--model.max_seq_len=64", "--data.seq_len=64"])


ARGS = dict(prompt=[72, 101, 108, 108, 111], num_samples=3, max_tokens=6, temperature=1.0, top_k=50, top_p=0.9,
            seed=7, stop_tokens=(257,), prompt_logprobs=True)


def _sample_sharded(rank: int, world: int):
    from shardfit.models import build_model
    from shardfit.sampling.fsdp_reference import SampleArgs, sample
    from tests.helpers import parallelize_config as parallelize

    cfg = _cfg()
    with torch.device("meta"):
        model = build_model(cfg.model)
    parallelize(model, cfg, torch.device("cpu"), world, cfg.train.seed, init=True)  # in place; returns its report
    seqs, prompt_lp = sample(model, SampleArgs(**ARGS), torch.float32, torch.device("cpu"), rank, world)
    seqs2, _ = sample(model, SampleArgs(**{**ARGS, "seed": 8, "prompt_logprobs": False}), torch.float32,
                      torch.device("cpu"), rank, world)  # a second call: FSDP's state is fine after the first
    return {"tokens": [s.tokens for s in seqs], "logprobs": [s.logprobs for s in seqs], "prompt": prompt_lp[1:],
            "again": [s.tokens for s in seqs2]}


def test_sharded_sampling_equals_whole_model():
    from shardfit.models import build_model
    from shardfit.sampling.fsdp_reference import SampleArgs, sample

    cfg = _cfg()
    model = build_model(cfg.model)
    model.init_weights(cfg.train.seed)
    seqs, prompt_lp = sample(model, SampleArgs(**ARGS), torch.float32, torch.device("cpu"))
    # the reference log-probs of the prompt, from a plain forward
    with torch.no_grad():
        logits = model(torch.tensor([ARGS["prompt"]]))[0]
    ref = torch.log_softmax(logits[:-1], -1).gather(-1, torch.tensor(ARGS["prompt"][1:])[:, None]).squeeze(-1)
    assert np.isnan(prompt_lp[0]) and np.allclose(prompt_lp[1:], ref.tolist(), atol=1e-5)
    # each sampled token's log-prob, recomputed without the cache, for the first sequence
    full = ARGS["prompt"] + seqs[0].tokens
    with torch.no_grad():
        logits = model(torch.tensor([full]))[0]
    S = len(ARGS["prompt"])
    recomputed = torch.log_softmax(logits[S - 1:-1], -1).gather(-1, torch.tensor(seqs[0].tokens)[:, None])
    assert np.allclose(seqs[0].logprobs, recomputed.squeeze(-1).tolist(), atol=1e-4)

    ranks = run_ranks(_sample_sharded, 2)
    assert ranks[0]["tokens"] == [s.tokens for s in seqs]
    assert np.allclose(ranks[0]["logprobs"], [s.logprobs for s in seqs], atol=1e-4)
    assert np.allclose(ranks[0]["prompt"], prompt_lp[1:], atol=1e-5)
    assert ranks[0]["again"] != ranks[0]["tokens"]  # another seed, other samples


def _loop(rank: int, world: int):
    from shardfit.errors import ShardfitError
    from shardfit.serve.commands import Command, Loop
    from shardfit.serve.futures import FutureStore, Result
    from shardfit.serve.ordering import Scheduler

    seen = []

    def execute(cmd):
        seen.append([cmd.kind, cmd.args.get("n")])
        if cmd.args.get("bad"):
            raise ShardfitError("bad input", where="x", fix="y")  # every rank alike, as the Engine raises
        t = torch.tensor([float(cmd.args["n"])])
        torch.distributed.all_reduce(t)  # the Engine's own collective, in step
        return Result(json={"sum": float(t)}), {}

    sched, futures = (Scheduler(), FutureStore()) if rank == 0 else (None, None)
    results, rids = {}, []
    if rank == 0:
        sched.add_model("m")
        # seq_ids arrive out of order (the SDK sends the first chunk last); one is refused before queueing
        for seq, n in ((3, 30), (2, 20), (5, 50)):
            rids.append(futures.create("work"))
            sched.submit(Command("work", rids[-1], {"n": n}), "m", seq)
        sched.skip("m", 4)
        rids.append(futures.create("work"))
        sched.submit(Command("work", rids[-1], {"n": 10}), "m", 1)
        rids.append(futures.create("work"))
        sched.submit(Command("work", rids[-1], {"n": 0, "bad": True}))
    loop = Loop(execute, rank, world, torch.device("cpu"), sched, futures, idle_s=0.2, log=lambda line: None)
    if rank == 0:
        import threading

        threading.Timer(1.5, sched.close).start()
    stop = loop.run()
    if rank == 0:
        for i, rid in enumerate(rids, 1):
            r = futures._results.get(rid)
            results[i] = r.body() if r else None
    return {"seen": seen, "results": results, "stop": stop.kind}


def test_loop_keeps_ranks_in_step_and_in_seq_order():
    r0, r1 = run_ranks(_loop, 2)
    assert r0["seen"] == r1["seen"]
    # the model's seq 1, 2, 3 and 5 (4 was given up) in seq order, whatever the arrival; then the command without
    # a model, ready when it arrived (after seq 1 released the rest)
    assert [n for _, n in r0["seen"]] == [10, 20, 30, 50, 0]
    assert r0["results"]["4"] == {"sum": 20.0}  # n=10 on both ranks
    assert r0["results"]["5"] == {"error": "x: bad input; fix: y", "category": "user"}
    assert r0["stop"] == r1["stop"] == "stop"  # both left at the same command
