"""forward_backward requests of several models ready together run as ONE pass (serve/executor.py's combine,
serve/ordering.py's take_together, engine/multi_model.py), through the official tinker SDK: 3 training clients whose
requests queue behind a long forward are answered from one pass of 3 models ("server_pass_models:max"), each
client's losses and log-probs those of its seed trained alone on the same server; 4 clients sending forward
concurrently get the log-probs and losses each gets alone, from one pass of 4 (1 and 2 ranks); and the grouping
itself: each model's oldest ready request only, of the same kind (forward-only or forward_backward) and loss only,
samples and other kinds left in place, a model's forward and forward_backward in their order.
"""

from __future__ import annotations

import numpy as np
import pytest

tinker = pytest.importorskip("tinker")

from tests._dist import run_ranks  # noqa: E402
from tests.helpers import SMALL  # noqa: E402
from tests.serve.engine_server import datums, serve  # noqa: E402

ARGS = [*SMALL, "--train.device=cpu", "--train.micro_batch_tokens=64", "--lora.rank=8"]
SEEDS = (1, 2, 3)


def _step(clients: list[tuple], step: int, busy: bool) -> list:
    """(client, seed) pairs: one forward_backward and optim_step each, all sent before any is read; busy: behind a
    long forward of the first client, so that the forward_backward requests are ready together."""
    from tinker import types

    first = clients[0][0].forward(datums(50, n=200), "cross_entropy") if busy else None
    fbs = [c.forward_backward(datums(10 * step + s), "cross_entropy") for c, s in clients]
    opts = [c.optim_step(types.AdamParams(learning_rate=2e-2)) for c, _ in clients]
    if first is not None:
        first.result()
    res = [f.result() for f in fbs]
    for o in opts:
        o.result()
    return res


def _train(clients: list[tuple], busy: bool) -> dict:
    out = {"loss": [], "lp": [], "models": []}
    for step in range(2):
        res = _step(clients, step, busy)
        out["loss"].append([r.metrics["loss:sum"] for r in res])
        out["lp"].append([np.asarray(r.loss_fn_outputs[0]["logprobs"].to_numpy()).tolist() for r in res])
        out["models"].append([r.metrics.get("server_pass_models:max", 1.0) for r in res])
    return out


def _three(sc, url: str, base_model: str) -> dict:
    new = lambda s: sc.create_lora_training_client(base_model=base_model, rank=8, seed=s).result()  # noqa: E731
    together = _train([(new(s), s) for s in SEEDS], busy=True)
    alone = [_train([(new(s), s)], busy=False) for s in SEEDS]  # each seed alone, its requests one by one
    return {"together": together, "alone": alone}


def test_three_clients_ready_together_run_in_one_pass_and_equal_each_alone(tmp_path):
    r = run_ranks(serve, 1, str(tmp_path / "run"), _three, ARGS, timeout=600)[0]
    t = r["together"]
    assert any(m == [3.0, 3.0, 3.0] for m in t["models"]), t["models"]  # answered from one pass of 3 models
    for i, a in enumerate(r["alone"]):
        assert a["models"] == [[1.0], [1.0]]
        for step in range(2):
            np.testing.assert_allclose(t["loss"][step][i], a["loss"][step][0], rtol=1e-5, atol=1e-6)
            np.testing.assert_allclose(t["lp"][step][i], a["lp"][step][0], rtol=0, atol=2e-5)
    assert len({round(x, 6) for x in t["loss"][1]}) == 3  # three models apart


def _forwards(sc, url: str, base_model: str) -> dict:
    """4 clients, each trained one step alone (its own weights, B != 0), then 3 rounds of a forward from each, all
    sent before any is read, behind a long forward of a fifth client (another loss config: it joins none); then each
    client's forwards of the same datums one at a time."""
    from tinker import types

    new = lambda s: sc.create_lora_training_client(base_model=base_model, rank=8, seed=s).result()  # noqa: E731
    clients = [new(s) for s in (1, 2, 3, 4)]
    for i, c in enumerate(clients):
        c.forward_backward(datums(70 + i), "cross_entropy").result()
        c.optim_step(types.AdamParams(learning_rate=5e-2)).result()
    blocker = new(5)

    def read(r) -> dict:
        return {"lp": [np.asarray(o["logprobs"].to_numpy()).tolist() for o in r.loss_fn_outputs],
                "loss": r.metrics["loss:sum"], "models": r.metrics.get("server_pass_models:max", 1.0)}

    together = []
    for rnd in range(3):
        busy = blocker.forward(datums(50, n=200), "cross_entropy", {"normalize": "sum"})
        futures = [c.forward(datums(80 + 10 * rnd + i), "cross_entropy") for i, c in enumerate(clients)]
        busy.result()
        together.append([read(f.result()) for f in futures])
    alone = [[read(c.forward(datums(80 + 10 * rnd + i), "cross_entropy").result()) for i, c in enumerate(clients)]
             for rnd in range(3)]
    return {"together": together, "alone": alone}


@pytest.mark.parametrize("world", [1, 2])
def test_four_clients_sending_forward_concurrently_equal_each_alone(tmp_path, world):
    r = run_ranks(serve, world, str(tmp_path / "run"), _forwards, ARGS, timeout=600)[0]
    assert any([x["models"] for x in rnd] == [4.0] * 4 for rnd in r["together"]), r["together"]
    for t_rnd, a_rnd in zip(r["together"], r["alone"]):
        for t, a in zip(t_rnd, a_rnd):
            assert a["models"] == 1.0
            np.testing.assert_allclose(t["loss"], a["loss"], rtol=1e-5, atol=1e-6)
            for x, y in zip(t["lp"], a["lp"]):
                np.testing.assert_allclose(x, y, rtol=0, atol=2e-5)
    assert len({round(sum(map(sum, t["lp"])), 4) for t in r["together"][0]}) == 4  # four models apart


def test_a_pass_is_of_one_kind_and_keeps_each_models_order():
    from shardfit.serve.commands import Command
    from shardfit.serve.executor import Executor
    from shardfit.serve.ordering import Scheduler

    s = Scheduler()
    for m in "abcd":
        s.add_model(m)
    req = lambda m, seq, fwd, cfg=None: Command("forward_backward", f"{m}{seq}", {  # noqa: E731
        "loss_fn": "cross_entropy", "loss_fn_config": cfg, "forward_only": fwd}, m)
    s.submit(req("a", 1, True), "a", 1)
    s.submit(req("a", 2, False), "a", 2)  # a's forward_backward after its forward
    s.submit(req("b", 1, False), "b", 1)
    s.submit(req("c", 1, True), "c", 1)
    s.submit(req("d", 1, True, {"normalize": "sum"}), "d", 1)  # another config: its own pass
    key = Executor._loss_key
    passes = []
    while (first := s.next(0.1)) is not None:
        kind = key(first.command)
        more = s.take_together(first, lambda p, kind=kind: key(p.command) == kind)
        passes.append([p.command.request_id for p in [first, *more]])
    assert passes == [["a1", "c1"], ["a2", "b1"], ["d1"]]


def test_each_models_oldest_ready_request_of_the_same_loss_joins():
    from shardfit.serve.commands import Command
    from shardfit.serve.ordering import Scheduler

    s = Scheduler()
    for m in "abcd":
        s.add_model(m)
    fb = lambda m, seq, loss="cross_entropy": Command("forward_backward", f"{m}{seq}", {  # noqa: E731
        "loss_fn": loss, "forward_only": False}, m)
    s.submit(fb("a", 1), "a", 1)
    s.submit(fb("b", 1), "b", 1)
    s.submit(Command("sample", "s1"), None, None)
    s.submit(fb("a", 2), "a", 2)  # a's second: waits for the next pass
    s.submit(Command("optim_step", "c1", {}, "c"), "c", 1)
    s.submit(fb("c", 2), "c", 2)  # behind c's optim_step: stays
    s.submit(fb("d", 1, "ppo"), "d", 1)  # another loss: stays
    first = s.next(0.1)
    same = lambda p: p.command.kind == "forward_backward" and p.command.args["loss_fn"] == "cross_entropy"  # noqa
    taken = s.take_together(first, same)
    assert first.command.request_id == "a1" and [p.command.request_id for p in taken] == ["b1"]
    left = [s.next(0.1).command.request_id for _ in range(5)]
    assert left == ["s1", "a2", "c1", "c2", "d1"]  # in their order, nothing lost


class _Refusing:
    """A datum engine whose pass of several models is refused (one request's bad input) and whose single passes
    refuse only the datums starting with token 999."""

    class dist:
        rank = 0

    def forward_backward_many(self, groups, loss_fn, loss_fn_config):
        from shardfit.errors import ShardfitError

        raise ShardfitError("token 999 is bad", where="data[0]", fix="send another")

    def forward_backward(self, datums, loss_fn, loss_fn_config):
        from shardfit.errors import ShardfitError
        from shardfit.rl.datum import ForwardBackwardResult

        if int(datums[0].tokens[0]) == 999:
            raise ShardfitError("token 999 is bad", where="data[0]", fix="send another")
        return ForwardBackwardResult([{"logprobs": np.zeros(len(d.tokens), np.float32)} for d in datums],
                                     {"loss:sum": 1.5})


def test_a_pass_refused_for_one_request_answers_each_request_on_its_own():
    from dataclasses import asdict

    from shardfit.rl import AdamParams, Datum
    from shardfit.serve.commands import MANY, Command, datums_to_json
    from shardfit.serve.executor import Executor
    from shardfit.serve.protocol import WireDatum

    def fb(model, first_token):
        d = WireDatum(np.asarray([first_token, 2, 3]), {"target_tokens": np.asarray([2, 3, 4])})
        return Command("forward_backward", f"req-{model}", {"datums": datums_to_json([d]), "loss_fn": "cross_entropy",
                                                            "forward_only": False}, model)

    ex = Executor(_Refusing(), rl_types=(Datum, AdamParams))
    result, _ = ex(Command(MANY, "req-a", {"parts": [asdict(fb("a", 1)), asdict(fb("b", 999)),
                                                     asdict(fb("c", 5))]}))
    ok, bad, also_ok = result.parts
    assert ok.error is None and also_ok.error is None and ok.proto and also_ok.proto
    assert "token 999 is bad" in bad.error and bad.category == "user"
