"""Engine.sample_run (engine/sample_run.py), the streaming form of Engine.sample, on one CPU rank (and two gloo ranks
where it says so):
- a short request submitted while a long one decodes is collected first, and each gets what it gets alone from
  Engine.sample (seeded: the same tokens, log-probs within fp32 rounding); a request refused in the middle (too
  long) comes back as its one line and disturbs nothing;
- the run's adapters keep their bank slots: once every slot is the run's, a request of another version cannot join
  (None) and the next run samples it as Engine.sample does;
- under sampling.logprobs=trainer (the RL API's sample_run: rl/trainer_logprobs.py's ScoredRun) nothing is
  collected before the run closes, and close returns the trainer-scored results DatumEngine.sample returns;
- on two ranks every rank makes the same calls: requests submitted between steps decode on their ticket's rank, each
  collected on every rank as it ends, equal to one rank's; a rank whose step fails makes the other raise RankFailed
  from the same exchange (none waits in a collective), and both go on in step; so does a rank that cannot build its
  Sampler (from the requests' verdicts).
"""

from __future__ import annotations

import numpy as np
import pytest

from tests._dist import run_ranks
from tests.helpers import SMALL, random_datums

ARGS = [*SMALL, "--model.max_seq_len=128", "--train.device=cpu", "--train.micro_batch_tokens=128",
        "--logging.run_dir=", "--lora.rank=4"]
KV = {"kv_blocks": 64, "block_size": 8}  # CPU: no free-memory query, the pool given


def _params(max_tokens: int, seed: int):
    from shardfit.sampling.params import SamplingParams

    return SamplingParams(max_tokens=max_tokens, temperature=1.0, seed=seed)


def _flat(results) -> tuple[list, list]:
    return ([s.tokens for r in results for s in r.samples],
            [x for r in results for s in r.samples for x in s.logprobs])


def _same(a, b) -> None:
    assert _flat(a)[0] == _flat(b)[0]
    np.testing.assert_allclose(_flat(a)[1], _flat(b)[1], rtol=0, atol=1e-5)


@pytest.fixture(scope="module")
def engine():
    from shardfit.config import load_config
    from shardfit.rl import AdamParams, DatumEngine

    e = DatumEngine.start(load_config(None, ARGS))
    e.forward_backward(random_datums(1, 3), "cross_entropy", model="default")
    e.optim_step(AdamParams(learning_rate=5e-2), model="default")
    return e


def test_a_request_joins_a_running_one_is_collected_first_and_gets_what_it_gets_alone(engine):
    from shardfit.errors import ShardfitError

    long, short, bad = ([5, 6, 7], _params(60, 1)), ([8, 9], _params(3, 2)), ([1] * 127, _params(5, 3))
    run = engine.sample_run(**KV)
    [t_long] = run.submit([long[0]], long[1], num_samples=2)
    order = []
    for _ in range(3):
        run.step()
    assert run.busy and run.rows == 2 and not run.collect()  # the long one decodes, nothing has ended
    t_short, refused = run.submit([short[0], bad[0]], [short[1], bad[1]])
    assert isinstance(refused, ShardfitError) and refused.where == "sampling_params.max_tokens"
    got = {}
    while run.busy:
        run.step()
        for t, res in run.collect():
            order.append(t)
            got[t] = res
    run.close()
    assert order == [t_short, t_long]
    assert [len(s.tokens) for s in got[t_long].samples] == [60, 60]
    _same([got[t_long]], engine.sample([long[0]], long[1], num_samples=2, **KV))
    _same([got[t_short]], engine.sample([short[0]], short[1], **KV))


def test_a_version_finds_no_slot_beside_the_runs_and_waits_for_the_next_run(engine):
    versions = [engine.freeze("default") for _ in range(engine._sampling.capacity + 1)]
    prompt = [3, 1, 4]
    run = engine.sample_run(**KV)
    tickets = run.submit([prompt] * (len(versions) - 1), _params(4, 7), version=versions[:-1])
    assert all(isinstance(t, int) for t in tickets)
    assert run.submit([prompt], _params(4, 7), version=versions[-1]) == [None]  # every slot is the run's
    while run.busy:
        run.step()
        run.collect()
    run.close()
    nxt = engine.sample_run(**KV)
    [t] = nxt.submit([prompt], _params(4, 7), version=versions[-1])
    done = []
    while nxt.busy:
        nxt.step()
        done += nxt.collect()
    nxt.close()
    assert [d[0] for d in done] == [t]
    _same([done[0][1]], engine.sample([prompt], _params(4, 7), version=versions[-1], **KV))


def test_under_trainer_logprobs_the_run_is_scored_when_it_closes(engine):
    prompts, params = [[5, 6, 7], [8, 9]], [_params(6, 11), _params(3, 12)]
    run = engine.sample_run(logprobs="trainer", **KV)
    tickets = run.submit(prompts[:1], params[:1], num_samples=2)
    run.step()
    tickets += run.submit(prompts[1:], params[1:])
    while run.busy:
        run.step()
        assert run.collect() == []  # answered at the run's end
    got = dict(run.close())
    expected = engine.sample(prompts, params, num_samples=[2, 1], logprobs="trainer", **KV)
    assert _flat([got[t] for t in tickets]) == _flat(expected)  # bit for bit: the same forward over the same datums


def _streaming(rank, world):
    """A run on every rank: a long request, a short and a refused one joining after 3 chunks; then a run whose step
    fails on the last rank; then one Engine.sample (the ranks still in step)."""
    from shardfit.config import load_config
    from shardfit.engine.sample_results import RankFailed
    from shardfit.rl import DatumEngine

    e = DatumEngine.start(load_config(None, ARGS))
    run = e.sample_run(**KV)
    order, got = [], {}

    def chunk():
        run.step()
        for t, res in run.collect():
            order.append(t)
            got[t] = [s.tokens for s in res.samples], [s.logprobs for s in res.samples]

    tickets = run.submit([[5, 6, 7]], _params(40, 1), num_samples=2)
    for _ in range(3):
        chunk()
    tickets += run.submit([[8, 9], [1] * 127], [_params(3, 2), _params(5, 3)])
    while run.busy:
        chunk()
    run.close()
    broken = e.sample_run(**KV)
    broken.submit([[4, 4], [2, 3]], _params(20, 4))
    if rank == world - 1:
        broken.sampler.step = lambda: (_ for _ in ()).throw(RuntimeError("out of memory (a test)"))
    try:
        broken.step()
        failed = False
    except RuntimeError:
        failed = True
    try:
        broken.collect(failed=failed)
        said = "own error" if failed else "nothing"
    except RankFailed as err:
        said = str(err)
    broken.close(failed=True)
    if rank == world - 1:  # this rank alone cannot build its Sampler (out of memory sizing its KV pool), once
        inner, real = e.engine, e.engine._sampler

        def _no_pool(*args, **kwargs):
            inner._sampler = real
            raise RuntimeError("out of memory (a test)")
        inner._sampler = _no_pool
    unbuilt = e.sample_run(**KV)
    try:
        unbuilt.submit([[4, 4]], _params(5, 4))
        built = "built"
    except RankFailed as err:
        built = str(err)
    except RuntimeError:
        built = "own error"
    unbuilt.close(failed=True)
    after = e.sample([[8, 9]], _params(3, 2), **KV)[0].samples[0].tokens
    return {"tickets": [t if isinstance(t, int) else str(t) for t in tickets], "order": order,
            "got": {str(t): v for t, v in got.items()}, "said": said, "built": built, "after": after}


def test_two_ranks_stream_as_one_and_a_failed_step_ends_the_run_on_both():
    one = run_ranks(_streaming, 1)[0]
    two = run_ranks(_streaming, 2)
    assert two[0]["tickets"][:2] == [0, 1] and "sampling_params.max_tokens" in two[0]["tickets"][2]
    for r in two:
        assert r["order"] == [1, 0]  # the short one (decoded on rank 1) collected on both ranks before the long one
        assert r["got"].keys() == one["got"].keys()
        for t, (tokens, logprobs) in one["got"].items():
            assert r["got"][t][0] == tokens
            np.testing.assert_allclose(np.concatenate(r["got"][t][1]), np.concatenate(logprobs), rtol=0, atol=1e-5)
        assert r["after"] == one["after"]
    assert one["said"] == "own error"  # one rank: its step failed, nothing to exchange
    assert "rank(s) [1] failed" in two[0]["said"] and two[1]["said"] == "own error"
    # a Sampler one rank cannot build: both raise from the verdicts' all-reduce (none waits), then go on in step
    assert one["built"] == "own error" and two[1]["built"] == "own error"
    assert "could not build its sampler" in two[0]["built"]
