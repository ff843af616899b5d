"""Sample requests batched across clients (serve/commands.py's sample_batch), through the official tinker SDK on the
real Engine (`--lora.rank=8 --serve.join=false`, two gloo ranks, CPU, loopback): 12 seeded requests from 3 sampling
clients (two frozen versions and the model's live weights) sent at once run as 1-2 Engine.sample calls (the batch
broadcast as one command, its requests shared out between the ranks), and each equals what it gets alone (decoded by
rank 0); a request of a sampler whose saved weights did not load, sent among them, fails alone with its one line.
The order of the queue (serve/ordering.py's take_following) is tested without a server.
"""

from __future__ import annotations

import functools
import threading
import time
from pathlib import Path

import numpy as np
import pytest

tinker = pytest.importorskip("tinker")

from tests._dist import run_ranks  # noqa: E402
from tests.helpers import SMALL  # noqa: E402
from tests.serve.engine_server import serve, steps  # noqa: E402

# serve.join=false: the batch path (on N ranks requests would join a sample run instead: test_sample_joining.py)
ARGS = [*SMALL, "--train.device=cpu", "--train.micro_batch_tokens=64", "--lora.rank=8", "--serve.join=false"]
N = 12  # the good requests of the burst


def _counted(release: threading.Event, calls: list) -> None:
    """Engine.sample counting its calls (the prompts of each); the first one of the burst waits for `release` (the
    scenario sets it once every request is queued), so that the burst runs as at most 2 calls whatever the timing."""
    from shardfit.engine.sampling import EngineSampling

    inner = EngineSampling.sample

    def sample(self, prompts, *args, **kwargs):
        calls.append(len(prompts))
        if len(calls) == 1:
            release.wait(60)
        return inner(self, prompts, *args, **kwargs)

    EngineSampling.sample = sample


def _scenario(sc, url: str, base_model: str, run_dir: str, release: threading.Event, calls: list) -> dict:
    import httpx
    from tinker import types

    a = sc.create_lora_training_client(base_model=base_model, rank=8, seed=1).result()
    first = a.save_weights_and_get_sampling_client().result()
    steps(a, [1])
    second = a.save_weights_and_get_sampling_client().result()
    steps(a, [2])
    live = a.save_weights_and_get_sampling_client(kind="inflight").result()
    saved = a.save_weights_for_sampler("broken").result().path
    for f in Path(run_dir).rglob("*"):  # its files gone, its listing entry kept: the route accepts it, the load fails
        if f.is_file() and "broken" in f.parts and not f.name.endswith(".tinker.json"):
            f.unlink()
    broken = sc.create_sampling_client(model_path=saved).result()
    clients = [first, second, live]
    rng = np.random.default_rng(0)
    reqs = [(clients[i % 3], rng.integers(0, 256, int(rng.integers(3, 12))).tolist(), 1 + i % 3, i)
            for i in range(N)]

    def send(client, prompt, n, seed):
        return client.sample(types.ModelInput.from_ints(prompt), num_samples=n, sampling_params=types.SamplingParams(
            max_tokens=4 + seed % 5, temperature=1.0, seed=seed))

    key = {"X-API-Key": "tml-local"}
    futures = [send(*r) for r in reqs[:N // 2]]
    bad = send(broken, [1, 2, 3], 1, 99)
    futures += [send(*r) for r in reqs[N // 2:]]
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:  # every request queued, or taken by the first call
        ready = httpx.get(f"{url}/api/v1/shardfit/status", headers=key).json()["queue"]["ready"]
        if ready + (calls[0] if calls else 0) >= N:
            break
        time.sleep(0.05)
    release.set()
    out = {"together": [_seqs(f.result()) for f in futures]}
    try:
        bad.result()
        out["bad"] = "no error"
    except Exception as e:  # noqa: BLE001 - the message is the assertion
        out["bad"] = str(e)
    out["burst_calls"] = list(calls)
    out["alone"] = [_seqs(send(*r).result()) for r in reqs]
    out["calls"] = list(calls)
    return out


def _seqs(res) -> list:
    return [[list(s.tokens), list(s.logprobs)] for s in res.sequences]


def _serve(rank: int, world: int, run_dir: str):
    release, calls = threading.Event(), []
    if rank == 0:  # the other ranks' calls follow rank 0's commands (and wait for it in their collectives)
        _counted(release, calls)
    return serve(rank, world, run_dir, functools.partial(_scenario, run_dir=run_dir, release=release, calls=calls),
                 ARGS)


@pytest.fixture(scope="module")
def burst(tmp_path_factory):
    return run_ranks(_serve, 2, str(tmp_path_factory.mktemp("batch")), timeout=600)[0]


def test_twelve_requests_of_three_clients_run_as_one_or_two_calls_each_as_alone(burst):
    assert 1 <= len(burst["burst_calls"]) <= 2 and sum(burst["burst_calls"]) == N  # the broken one never reached it
    assert burst["calls"][len(burst["burst_calls"]):] == [1] * N  # alone: one request a call
    for together, alone in zip(burst["together"], burst["alone"]):
        assert [t for t, _ in together] == [t for t, _ in alone]
        np.testing.assert_allclose(np.concatenate([lp for _, lp in together]),
                                   np.concatenate([lp for _, lp in alone]), rtol=0, atol=1e-5)
    assert len({str(t) for t in burst["together"]}) == N  # different requests, different samples


def test_a_bad_request_among_them_fails_alone_with_its_line(burst):
    assert "/asample sampling_session_id" in burst["bad"] and "did not load" in burst["bad"]
    assert "\n" not in burst["bad"].strip()


def _pending(kind: str, rows: int = 1):
    from shardfit.serve.commands import Command

    return Command(kind, f"r{time.monotonic_ns()}", {"num_samples": rows} if kind == "sample" else {})


def test_a_batch_takes_the_samples_ready_behind_the_first_and_never_passes_another_command():
    from shardfit.serve.commands import BATCH_ROWS, SAMPLE_BATCH, batch_samples
    from shardfit.serve.ordering import Scheduler

    q = Scheduler()
    cmds = [_pending("sample"), _pending("sample", 3), _pending("optim_step"), _pending("sample")]
    for c in cmds:
        q.submit(c)
    first = q.next(0).command
    batch = batch_samples(first, q)
    assert batch.kind == SAMPLE_BATCH and [c.request_id for c in batch.members()] == [c.request_id for c in cmds[:2]]
    assert q.next(0).command is cmds[2]  # the optim_step next: the sample behind it waits for it
    assert batch_samples(q.next(0).command, q).members()[0].request_id == cmds[3].request_id
    big = [_pending("sample", 256) for _ in range(BATCH_ROWS // 256 + 1)]
    for c in big:
        q.submit(c)
    assert len(batch_samples(q.next(0).command, q).members()) == BATCH_ROWS // 256  # the row bound
    assert q.next(0).command is big[-1]
