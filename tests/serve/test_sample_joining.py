"""Sample requests joining the running decode batch (serve/sample_joining.py), through the official tinker SDK on the
real Engine (`--lora.rank=8`, one and two gloo ranks, CPU, loopback):
- a short request sent while a long one decodes joins its run (the status counters: one run, one request joined)
  and is answered before the long one ends (the order the loop files answers in); each gets what it gets alone
  (seeded: the same tokens, log-probs within fp32 rounding), and two ranks answer what one does (the short one
  decodes on rank 1, its result travels to rank 0 between chunks); a request of a sampler whose weights did not
  load, sent among them, fails alone with its one line;
- a forward_backward and optim_step of the sampled model sent while a long sample decodes end the run's intake:
  they run after the run, the sample sent before them is of the weights before them and a sample sent after them
  (of the model's live weights) of the weights after them, as Tinker orders them;
- SIGTERM to `shardfit serve --nproc 2` while a run decodes: the run answers what it holds, then every rank leaves
  at the same command (one line, exit 143; slow: a server of its own).
The intake's walk of the queue (Scheduler.take_ready) is tested without a server.
"""

from __future__ import annotations

import functools
import os
import time
from pathlib import Path

import numpy as np
import pytest

tinker = pytest.importorskip("tinker")

from tests._dist import run_ranks  # noqa: E402
from tests.helpers import SMALL  # noqa: E402
from tests.serve.engine_server import datums, error, serve, steps  # noqa: E402

# a context long enough for a sample that decodes for seconds on the CPU while the others are sent
ARGS = [*SMALL, "--model.max_seq_len=640", "--train.device=cpu", "--train.micro_batch_tokens=64", "--lora.rank=8"]
LONG, SHORT = 600, 3  # max_tokens
KEY = {"X-API-Key": "tml-local"}


def _recording(filed: list) -> None:
    """Loop.file recording (kind, max_tokens, seed) of every answer, in the order the loop files them."""
    from shardfit.serve.commands import Loop

    inner = Loop.file

    def file(self, cmd, result, phases, batch=1, run=None):
        p = cmd.args.get("params") or {}
        filed.append((cmd.kind, p.get("max_tokens"), p.get("seed"), result.error))
        return inner(self, cmd, result, phases, batch, run)

    Loop.file = file


def _status(url: str) -> dict:
    import httpx

    return httpx.get(f"{url}/api/v1/shardfit/status", headers=KEY).json()


def _until(url: str, ok, what: str) -> dict:
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        st = _status(url)
        if ok(st):
            return st
        time.sleep(0.02)
    raise AssertionError(f"the server never reached: {what}")


def _send(client, prompt: list[int], max_tokens: int, seed: int, n: int = 1):
    from tinker import types

    return client.sample(types.ModelInput.from_ints(prompt), num_samples=n, sampling_params=types.SamplingParams(
        max_tokens=max_tokens, temperature=1.0, seed=seed, stop=[]))  # stop=[]: no EOS, every row max_tokens long


def _seqs(res) -> list:
    return [[list(s.tokens), list(s.logprobs)] for s in res.sequences]


def _scenario(sc, url: str, base_model: str, run_dir: str, filed: list) -> dict:
    from tinker import types

    tc = sc.create_lora_training_client(base_model=base_model, rank=8, seed=1).result()
    steps(tc, [1])
    live = tc.save_weights_and_get_sampling_client(kind="inflight").result()
    before = tc.save_weights_and_get_sampling_client().result()  # a frozen version: the live weights' values now
    saved = tc.save_weights_for_sampler("broken").result().path
    for f in Path(run_dir).rglob("*"):  # its files gone, its listing entry kept: the route accepts it, the load fails
        if f.is_file() and "broken" in f.parts and not f.name.endswith(".tinker.json"):
            f.unlink()
    broken = sc.create_sampling_client(model_path=saved).result()
    out: dict = {}

    # A: a short request (and a bad one) sent while a long one decodes
    start = _status(url)["sampling"]
    long = _send(live, [5, 6, 7, 8], LONG, 1, n=2)
    _until(url, lambda st: st["sampling"]["rows_in_flight"] > 0, "the long request decoding")
    short = _send(live, [9, 10, 11], SHORT, 2)
    bad = _send(broken, [1, 2, 3], SHORT, 3)
    together = [_seqs(short.result()), _seqs(long.result())]
    out["bad"] = error(bad.result)
    end = _status(url)["sampling"]
    out["counts"] = {k: end[k] - start[k] for k in ("runs", "requests", "joined")}
    out["filed_a"] = [f for f in filed if f[0] == "sample"]
    out["together"] = together
    out["alone"] = [_seqs(_send(live, [9, 10, 11], SHORT, 2).result()), _seqs(_send(live, [5, 6, 7, 8], LONG, 1,
                                                                                     n=2).result())]

    # B: a forward_backward and optim_step of the sampled model sent while a long sample decodes
    del filed[:]
    long = _send(live, [12, 13, 14], LONG, 4)
    _until(url, lambda st: st["sampling"]["rows_in_flight"] > 0, "the long request decoding")
    fb = tc.forward_backward(datums(7), "cross_entropy")
    opt = tc.optim_step(types.AdamParams(learning_rate=2e-2))
    _until(url, lambda st: st["queue"]["ready"] >= 2 or st["sampling"]["rows_in_flight"] == 0,
           "the step queued behind the run")
    short = _send(live, [15, 16], SHORT, 5)
    out["during"] = [_seqs(long.result()), _seqs(short.result())]
    fb.result(), opt.result()
    out["filed_b"] = [f[:2] for f in filed]
    after = tc.save_weights_and_get_sampling_client().result()
    out["expected"] = [_seqs(_send(before, [12, 13, 14], LONG, 4).result()),
                       _seqs(_send(after, [15, 16], SHORT, 5).result())]
    return out


def _serve(rank: int, world: int, run_dir: str):
    filed: list = []
    _recording(filed)
    return serve(rank, world, run_dir, functools.partial(_scenario, run_dir=run_dir, filed=filed), ARGS)


@pytest.fixture(scope="module")
def one_rank(tmp_path_factory):
    return run_ranks(_serve, 1, str(tmp_path_factory.mktemp("join")), timeout=600)[0]


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    return run_ranks(_serve, 2, str(tmp_path_factory.mktemp("join2")), timeout=600)[0]


@pytest.fixture(params=["one_rank", "two_ranks"])
def joined(request):
    return request.getfixturevalue(request.param)


def _same(a: list, b: list) -> None:
    assert [t for t, _ in a] == [t for t, _ in b]
    np.testing.assert_allclose(np.concatenate([lp for _, lp in a]), np.concatenate([lp for _, lp in b]), rtol=0,
                               atol=1e-5)


def test_a_short_request_joins_the_running_long_one_and_is_answered_first(joined):
    assert joined["counts"] == {"runs": 1, "requests": 2, "joined": 1}  # the bad one never reached the run
    kinds = [(m, s) for _, m, s, _ in joined["filed_a"]]
    assert kinds.index((SHORT, 2)) < kinds.index((LONG, 1))  # the short one answered while the long one decoded
    assert [len(t) for t, _ in joined["together"][1]] == [LONG, LONG]
    for together, alone in zip(joined["together"], joined["alone"]):
        _same(together, alone)


def test_two_ranks_answer_what_one_rank_answers(one_rank, two_ranks):
    for key in ("together", "alone", "during", "expected"):
        for a, b in zip(one_rank[key], two_ranks[key]):
            _same(a, b)


def test_a_bad_request_sent_in_the_middle_fails_alone_with_its_line(joined):
    assert "/asample sampling_session_id" in joined["bad"] and "did not load" in joined["bad"]
    assert "\n" not in joined["bad"].strip()


def test_a_step_sent_during_a_run_runs_after_it_and_samples_keep_tinkers_order(joined):
    order = [k if k != "sample" else ("long" if m == LONG else "short") for k, m in joined["filed_b"]]
    assert order == ["long", "forward_backward", "optim_step", "short"]
    _same(joined["during"][0], joined["expected"][0])  # sent before the step: the weights before it
    _same(joined["during"][1], joined["expected"][1])  # sent after it: the weights after it


def _pending(kind: str, rows: int = 1):
    from shardfit.serve.commands import Command

    return Command(kind, f"r{time.monotonic_ns()}", {"num_samples": rows} if kind == "sample" else {})


def test_the_intake_takes_and_passes_samples_and_stops_at_any_other_command():
    from shardfit.serve.ordering import Scheduler

    q = Scheduler()
    cmds = [_pending("sample"), _pending("sample", 3), _pending("sample"), _pending("optim_step"), _pending("sample")]
    for c in cmds:
        q.submit(c)
    seen = []

    def decide(p):
        seen.append(p.command.request_id)
        if p.command.kind != "sample":
            return "stop"
        return "pass" if p.command.args["num_samples"] == 3 else "take"

    taken, passed = q.take_ready(decide)
    assert [p.command for p in taken] == [cmds[0], cmds[2]] and passed
    assert seen == [c.request_id for c in cmds[:4]]  # never looked past the optim_step
    assert [q.next(0).command for _ in range(3)] == [cmds[1], cmds[3], cmds[4]]  # the passed one first, in place


@pytest.mark.slow
def test_sigterm_while_a_run_decodes_on_two_ranks_answers_it_then_stops_every_rank(tmp_path, sdk_client):
    import signal

    from tests.serve.test_sdk_engine import _start, _stop

    proc, url, lines = _start(tmp_path, "--lora.rank=8")
    try:
        sc = sdk_client(url, "tml-local")
        tc = sc.create_lora_training_client(base_model="tiny", rank=8).result()
        live = tc.save_weights_and_get_sampling_client(kind="inflight").result()
        long = _send(live, [5, 6, 7], 120, 1, n=2)
        _until(url, lambda st: st["sampling"]["rows_in_flight"] > 0, "the long request decoding")
        sc.close("success").result(timeout=30)  # the session ended (its sample still decoding): no heartbeat left
        said = _stop(proc, lines, signal.SIGTERM)
        assert said == ["shardfit: serve stopped by SIGTERM: no model had optimizer steps since its last save_state"], \
            "".join(lines)
        assert any(" sample " in ln and ": ok," in ln and "in sample run 1" in ln for ln in lines), "".join(lines)
        del long
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
