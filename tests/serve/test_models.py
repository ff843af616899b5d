"""issue 35 through the official tinker SDK: `shardfit serve --lora.rank=8` holds one model per training client and
frozen versions for its samplers (the real Engine on gloo ranks, CPU, the server in the rank process on loopback).

Each row of the issue's table, reversed: a reference sampler keeps its log-probs after 5 of its model's steps; a
sampler made from a saved path (before and after a restart) returns the saved weights' log-probs; a second training
client starts at the base; B's training leaves A untouched; the REST listings name each LoRA model and, after the
restart, its checkpoint. Bad input: an unknown model, a freed version, a rank or
a lora_config field the server cannot hold: one 4xx line each.
"""

from __future__ import annotations

import os
import threading

import numpy as np
import pytest

tinker = pytest.importorskip("tinker")

from tests._dist import run_ranks  # noqa: E402
from tests.helpers import SMALL  # noqa: E402

ARGS = [*SMALL, "--train.device=cpu", "--train.micro_batch_tokens=64", "--lora.rank=8"]
SEQ = list(b"hello shardfit models")  # what every sampler scores


def _serve(rank: int, world: int, run_dir: str, scenario):
    """The Engine on every rank, the server on rank 0 running `scenario(service_client, url)`; its result."""
    os.environ["TINKER_TELEMETRY"] = "0"
    from shardfit.config import load_config
    from shardfit.engine import Engine
    from shardfit.serve.commands import Loop
    from shardfit.serve.executor import Executor
    from shardfit.serve.server import comm_device, start_rank0

    cfg = load_config(None, [*ARGS, f"--logging.run_dir={run_dir}"])
    engine = Engine.start(cfg)
    if rank != 0:
        Loop(Executor(engine), rank, world, comm_device(engine)).run()
        return None
    serving = start_rank0(cfg, engine, port=0, poll_s=2.0)
    loop = threading.Thread(target=serving.loop.run, daemon=True)
    loop.start()
    sc = tinker.ServiceClient(base_url=serving.url, api_key="tml-local")
    try:
        return scenario(sc, serving.url, serving.state.facts.base_model)
    finally:
        sc.close("success").result(timeout=30)
        serving.state.scheduler.close()  # rank 0 broadcasts stop: every rank leaves its loop
        loop.join(60)
        serving.stop()


def _datums(seed: int, n: int = 2):
    from tinker import types

    rng = np.random.default_rng(seed)
    out = []
    for L in rng.integers(8, 16, n):
        t = rng.integers(0, 256, L + 1)
        out.append(types.Datum(model_input=types.ModelInput.from_ints(t[:-1].tolist()),
                               loss_fn_inputs={"target_tokens": t[1:].astype(np.int64),
                                               "weights": np.ones(L, np.float32)}))
    return out


def _steps(tc, seeds) -> None:
    from tinker import types

    for s in seeds:
        tc.forward_backward(_datums(s), "cross_entropy").result()
        tc.optim_step(types.AdamParams(learning_rate=2e-2)).result()


def _lp(tc) -> list[float]:
    return tc.forward(_datums(99), "cross_entropy").result().loss_fn_outputs[0]["logprobs"].to_numpy().tolist()


def _scored(sampler) -> list[float]:
    from tinker import types

    return sampler.compute_logprobs(types.ModelInput.from_ints(SEQ)).result()[1:]


def _error(call) -> str:
    try:
        call()
    except Exception as e:  # noqa: BLE001 - the message is the assertion
        return str(e)
    return "no error"


def _table(sc, url: str, base_model: str) -> dict:
    import httpx

    out = {}
    a = sc.create_lora_training_client(base_model=base_model, rank=8, seed=1).result()
    out["base"] = _lp(a)
    ref = a.save_weights_and_get_sampling_client().result()  # the DPO reference, taken before training
    out["ref_before"] = _scored(ref)
    _steps(a, [1, 2])
    saved = a.save_weights_for_sampler("two").result().path
    out["two"] = _scored(a.save_weights_and_get_sampling_client().result())
    _steps(a, [3, 4, 5])
    out["ref_after"] = _scored(ref)  # 5 optimizer steps later
    out["saved_path"] = saved
    out["from_path"] = _scored(sc.create_sampling_client(model_path=saved).result())
    out["inflight"] = _scored(a.save_weights_and_get_sampling_client(kind="inflight").result())
    out["a_now"] = _scored(a.save_weights_and_get_sampling_client().result())
    out["of_base"] = _scored(sc.create_sampling_client(base_model=base_model).result())
    b = sc.create_lora_training_client(base_model=base_model, rank=8, seed=2).result()
    out["b_start"] = _lp(b)
    out["a_before_b"] = _lp(a)
    _steps(b, [6, 7, 8])
    out["a_after_b"], out["b_after"] = _lp(a), _lp(b)
    rest = tinker.RestClient(base_url=url, api_key="tml-local")  # the listings (serve/listings.py), LoRA models
    out["runs"] = ([r.training_run_id for r in rest.list_training_runs().result().training_runs], [b.model_id,
                   a.model_id])
    info = rest.get_weights_info_by_tinker_path(saved).result()
    out["weights_info"] = (info.base_model == base_model, info.is_lora, info.lora_rank)
    key = {"X-API-Key": "tml-local"}
    out["held"] = httpx.get(f"{url}/api/v1/shardfit/status", headers=key).json()["held"]
    # bad input, one line each
    out["wrong_rank"] = _error(lambda: sc.create_lora_training_client(base_model=base_model, rank=16).result())
    out["wrong_attn"] = _error(lambda: sc.create_lora_training_client(base_model=base_model, rank=8,
                                                                       train_attn=False).result())
    out["unknown_model"] = httpx.post(f"{url}/api/v1/optim_step", headers=key, json={
        "model_id": "sess-nope:train:0", "seq_id": 1, "adam_params": {}}).json()
    other = tinker.ServiceClient(base_url=url, api_key="tml-local")
    c = other.create_lora_training_client(base_model=base_model, rank=8).result()
    gone = c.save_weights_and_get_sampling_client().result()._sampling_session_id
    held = httpx.get(f"{url}/api/v1/shardfit/status", headers=key).json()["held"]["versions"]
    other.close("success").result(timeout=30)  # its session finishes: its samplers' versions are freed
    out["freed"] = (held, httpx.get(f"{url}/api/v1/shardfit/status", headers=key).json()["held"]["versions"])
    r = httpx.post(f"{url}/api/v1/asample", headers=key, json={
        "sampling_session_id": gone, "seq_id": 1, "num_samples": 1, "prompt_logprobs": True,
        "prompt": {"chunks": [{"type": "encoded_text", "tokens": SEQ}]}, "sampling_params": {"max_tokens": 1}})
    out["freed_sample"] = [r.status_code, r.json()]
    return out


def _restarted(sc, url: str, base_model: str, path: str) -> tuple[list[float], list[str]]:
    listed = tinker.RestClient(base_url=url, api_key="tml-local").list_user_checkpoints().result().checkpoints
    return _scored(sc.create_sampling_client(model_path=path).result()), [c.tinker_path for c in listed]


def _restarted_with(path: str):
    import functools

    return functools.partial(_restarted, path=path)


@pytest.fixture(scope="module")
def table(tmp_path_factory):
    run_dir = str(tmp_path_factory.mktemp("models") / "run")
    out = run_ranks(_serve, 1, run_dir, _table, timeout=600)[0]
    out["run_dir"] = run_dir
    return out


def _check_versions(t: dict) -> None:
    assert t["ref_after"] == t["ref_before"]  # frozen at the base: 5 steps later it scores the same
    assert t["ref_before"] == t["of_base"]  # create_sampling_client(base_model): the base alone
    assert t["a_now"] != t["ref_before"] and t["a_now"] != t["two"]
    assert t["inflight"] == t["a_now"]  # kind="inflight": the model's live weights
    np.testing.assert_allclose(t["from_path"], t["two"], rtol=0, atol=1e-6)  # a saved path: the saved weights
    assert t["from_path"] != t["a_now"]
    assert t["b_start"] == t["base"]  # a fresh adapter: B = 0
    assert t["a_after_b"] == t["a_before_b"]  # B's 3 steps left A untouched
    assert t["b_after"] != t["b_start"] and t["b_after"] != t["a_after_b"]


def test_the_issue_table_reversed_on_one_rank(table):
    """A reference keeps its weights, a saved path samples the saved ones, a new client starts at the base, B's
    training leaves A untouched."""
    _check_versions(table)


def test_a_saved_path_samples_the_same_weights_after_a_restart(table):
    again, listed = run_ranks(_serve, 1, table["run_dir"], _restarted_with(table["saved_path"]), timeout=600)[0]
    np.testing.assert_allclose(again, table["two"], rtol=0, atol=1e-6)
    assert listed == [table["saved_path"]]  # the one named save, listed from disk after the restart


def test_the_listings_name_each_lora_model_and_its_checkpoint(table):
    runs, made = table["runs"]
    assert runs == made  # B, then A: newest first
    assert list(table["weights_info"]) == [True, True, 8]  # a tuple comes back from the rank as a list


def test_status_counts_the_models_and_versions_held(table):
    t = table
    assert t["held"]["models"] >= 3 and t["held"]["versions"] >= 4  # default + A + B; ref, two, a_now, loaded


def test_bad_input_is_one_line_each(table):
    t = table
    assert "lora_config.rank" in t["wrong_rank"] and "rank 8, not 16" in t["wrong_rank"]
    assert "lora_config.train_attn" in t["wrong_attn"] and "train_attn=True" in t["wrong_attn"]
    assert "unknown model_id 'sess-nope:train:0'" in t["unknown_model"]["detail"]
    before, after = t["freed"]
    assert after == before - 1
    status, body = t["freed_sample"]
    assert status == 400 and "unknown sampling session" in body["detail"] and "freed" in body["detail"]
    for line in (t["wrong_rank"], t["wrong_attn"], t["unknown_model"]["detail"], body["detail"]):
        assert "\n" not in line


def test_two_ranks_serve_the_same_table(table):
    """2 gloo ranks: the same semantics, and the numbers of 1 rank (the gradient reductions' order aside)."""
    two = run_ranks(_serve, 2, table["run_dir"] + "-2", _table, timeout=600)[0]
    _check_versions(two)
    for key in ("ref_after", "from_path", "a_after_b", "b_after"):
        np.testing.assert_allclose(two[key], table[key], rtol=0, atol=2e-5)


def _pipelined(sc, url: str, base_model: str, seeds: tuple[int, ...]) -> dict:
    """One client per seed, their requests sent together (each step's forward_backward and optim_step of every
    client before any is read): each client's losses and final log-probs."""
    from tinker import types

    clients = [sc.create_lora_training_client(base_model=base_model, rank=8, seed=s).result() for s in seeds]
    losses: dict[str, list[float]] = {str(s): [] for s in seeds}
    for step in range(3):
        fbs = [c.forward_backward(_datums(10 * s + step), "cross_entropy") for s, c in zip(seeds, clients)]
        opts = [c.optim_step(types.AdamParams(learning_rate=2e-2)) for c in clients]  # gradients held apart
        for s, fb, opt in zip(seeds, fbs, opts):
            losses[str(s)].append(fb.result().metrics["loss:sum"])
            opt.result()
    return {"losses": losses, "lp": {str(s): _lp(c) for s, c in zip(seeds, clients)}}


def test_clients_trained_together_equal_each_trained_alone(tmp_path):
    """Two clients' requests interleaved on one server: each gets exactly what it gets alone (bit for bit, CPU)."""
    import functools

    both = run_ranks(_serve, 1, str(tmp_path / "both"), functools.partial(_pipelined, seeds=(1, 2)), timeout=600)[0]
    alone = run_ranks(_serve, 1, str(tmp_path / "alone"), functools.partial(_pipelined, seeds=(2,)), timeout=600)[0]
    assert both["losses"]["2"] == alone["losses"]["2"] and both["lp"]["2"] == alone["lp"]["2"]
    assert both["losses"]["1"] != both["losses"]["2"]


def test_a_sampler_is_freed_when_its_ttl_passes(served):
    """ttl_seconds on save_weights_for_sampler (the SDK sends it for named saves): past it the sampling session is
    gone, one 400 line (the fake Engine holds no versions: the session's bookkeeping is what is checked here)."""
    import time

    from tests.serve.raw_http import KEY, Client

    c = Client(served.url)
    rid = c.http.post("/save_weights_for_sampler", headers=KEY, json={
        "model_id": c.model_id, "seq_id": c.next_seq(), "ttl_seconds": 0.2}).json()["request_id"]
    sid = c.result(rid)["sampling_session_id"]
    sample = {"sampling_session_id": sid, "prompt": {"chunks": [{"type": "encoded_text", "tokens": [1, 2]}]},
              "sampling_params": {"max_tokens": 1}}
    assert c.http.post("/asample", headers=KEY, json=sample).status_code == 200
    time.sleep(0.3)
    r = c.http.post("/asample", headers=KEY, json=sample)
    assert r.status_code == 400 and "freed" in r.json()["detail"] and "ttl_seconds" in r.json()["detail"]
