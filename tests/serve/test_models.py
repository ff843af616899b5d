"""issue 35 through the official tinker SDK: `shardfit serve --lora.rank=8` holds one model per training client and
frozen versions for its samplers (the real Engine on gloo ranks, CPU, the server in the rank process on loopback).

Each row of the issue's table, reversed: a reference sampler keeps its log-probs after 5 of its model's steps; a
sampler made from a saved path (before and after a restart) returns the saved weights' log-probs, and a state saved
with its optimizer resumes exactly after the restart; a second training client starts at the base; B's training
leaves A untouched; the REST listings name each LoRA model and, after the restart, its checkpoints. 4 clients
trained at once by SDK threads equal each trained alone (16: slow); tinker-cookbook's DPO loop keeps its reference
frozen. Bad input: an unknown model, a freed version, a rank or a lora_config field the server cannot hold, too many
models or versions for the limits: one 4xx line each.
"""

from __future__ import annotations

import functools

import numpy as np
import pytest

tinker = pytest.importorskip("tinker")

from tests._dist import run_ranks  # noqa: E402
from tests.helpers import SMALL  # noqa: E402
from tests.serve.engine_server import SEQ, datums, dpo_pairs, error, logprobs, restarted, scored, serve, steps  # noqa: E402

ARGS = [*SMALL, "--train.device=cpu", "--train.micro_batch_tokens=64", "--lora.rank=8"]


def _serve(rank: int, world: int, run_dir: str, scenario):
    return serve(rank, world, run_dir, scenario, ARGS)


def _table(sc, url: str, base_model: str) -> dict:
    import httpx

    out = {}
    a = sc.create_lora_training_client(base_model=base_model, rank=8, seed=1).result()
    out["base"] = logprobs(a)
    ref = a.save_weights_and_get_sampling_client().result()  # the DPO reference, taken before training
    out["ref_before"] = scored(ref)
    steps(a, [1, 2])
    saved = a.save_weights_for_sampler("two").result().path
    out["state_path"] = a.save_state("two").result().path  # with the optimizer: a restart resumes from it
    out["two"] = scored(a.save_weights_and_get_sampling_client().result())
    out["step3"] = steps(a, [3])
    out["lp3"] = logprobs(a)
    steps(a, [4, 5])
    out["ref_after"] = scored(ref)  # 5 optimizer steps later
    out["saved_path"] = saved
    out["from_path"] = scored(sc.create_sampling_client(model_path=saved).result())
    out["inflight"] = scored(a.save_weights_and_get_sampling_client(kind="inflight").result())
    out["a_now"] = scored(a.save_weights_and_get_sampling_client().result())
    out["of_base"] = scored(sc.create_sampling_client(base_model=base_model).result())
    b = sc.create_lora_training_client(base_model=base_model, rank=8, seed=2).result()
    out["b_start"] = logprobs(b)
    out["a_before_b"] = logprobs(a)
    steps(b, [6, 7, 8])
    out["a_after_b"], out["b_after"] = logprobs(a), logprobs(b)
    rest = tinker.RestClient(base_url=url, api_key="tml-local")  # the listings (serve/listings.py), LoRA models
    out["runs"] = ([r.training_run_id for r in rest.list_training_runs().result().training_runs], [b.model_id,
                   a.model_id])
    info = rest.get_weights_info_by_tinker_path(saved).result()
    out["weights_info"] = (info.base_model == base_model, info.is_lora, info.lora_rank)
    key = {"X-API-Key": "tml-local"}
    out["held"] = httpx.get(f"{url}/api/v1/shardfit/status", headers=key).json()["held"]
    # bad input, one line each
    out["wrong_rank"] = error(lambda: sc.create_lora_training_client(base_model=base_model, rank=16).result())
    out["wrong_attn"] = error(lambda: sc.create_lora_training_client(base_model=base_model, rank=8,
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
    """A sampler of the saved path scores the saved weights after a restart, and the state saved with its optimizer
    resumes exactly: one step after the restart is the step A took (its loss, and the log-probs after it), bit for
    bit on the CPU."""
    r = run_ranks(_serve, 1, table["run_dir"], functools.partial(
        restarted, sampler_path=table["saved_path"], state_path=table["state_path"], seed=3), timeout=600)[0]
    np.testing.assert_allclose(r["from_path"], table["two"], rtol=0, atol=1e-6)
    assert r["from_path"] == table["from_path"]  # the same load before and after the restart: bit for bit
    assert r["resumed"] == table["step3"] and r["resumed_lp"] == table["lp3"]
    assert sorted(r["listed"]) == sorted([table["saved_path"], table["state_path"]])  # listed from disk


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


def _trained(tc, seed: int) -> dict:
    """3 steps of one client, each step's forward_backward and optim_step sent before either is read: the losses and
    the first datum's log-probs of each step."""
    from tinker import types

    out = {"loss": [], "lp": []}
    for step in range(3):
        fb = tc.forward_backward(datums(10 * seed + step), "cross_entropy")
        opt = tc.optim_step(types.AdamParams(learning_rate=2e-2))
        res = fb.result()
        opt.result()
        out["loss"].append(res.metrics["loss:sum"])
        out["lp"].append(res.loss_fn_outputs[0]["logprobs"].to_numpy().tolist())
    return out


def _together_then_alone(sc, url: str, base_model: str, n: int) -> dict:
    """n clients trained at once by n SDK threads, then a client of each seed trained alone on the same server."""
    from concurrent.futures import ThreadPoolExecutor

    import httpx

    seeds = list(range(1, n + 1))
    clients = [sc.create_lora_training_client(base_model=base_model, rank=8, seed=s).result() for s in seeds]
    with ThreadPoolExecutor(n) as pool:
        together = list(pool.map(_trained, clients, seeds))
    alone = [_trained(sc.create_lora_training_client(base_model=base_model, rank=8, seed=s).result(), s)
             for s in seeds]
    if n != 4:
        return {"together": together, "alone": alone}
    out = {"together": together, "alone": alone, **_dpo(sc, base_model)}  # 9 models, 1 version (the reference)
    key = {"X-API-Key": "tml-local"}
    out["too_many_models"] = httpx.post(f"{url}/api/v1/create_model", headers=key, json={
        "session_id": sc.holder.get_session_id(), "model_seq_id": 10**6, "base_model": base_model,
        "lora_config": {"rank": 8}}).json()["detail"]
    tc = clients[0]
    tc.save_weights_and_get_sampling_client().result()  # the second version: the limit
    out["too_many_versions"] = error(lambda: tc.save_weights_and_get_sampling_client().result())
    out["after_refusals"] = steps(tc, [40])  # the refused requests' seq_ids given up: the model trains on
    out["held"] = httpx.get(f"{url}/api/v1/shardfit/status", headers=key).json()["held"]
    return out


def _dpo(sc, base_model: str, beta: float = 0.1) -> dict:
    """tinker-cookbook 0.6.1's preference/train_dpo.py, its calls reproduced through the official SDK (the cookbook
    cannot be pip-installed with its requirements here: test_cookbook.py runs its own code where it is importable):
    the reference from save_weights_and_get_sampling_client("reference") before any step; each
    step the reference's log-probs of every chosen and rejected sequence (compute_logprobs), then
    forward_backward_custom with the DPO loss -logsigmoid(beta * (chosen log-ratio - rejected log-ratio)) on the
    policy, then optim_step. The reference's log-probs of each step, and the policy's."""
    import warnings

    import torch
    import torch.nn.functional as F
    from tinker import types

    policy = sc.create_lora_training_client(base_model=base_model, rank=8, seed=7).result()
    with warnings.catch_warnings():  # the SDK deprecates the name (it has no effect); the cookbook passes it
        warnings.simplefilter("ignore", DeprecationWarning)
        reference = policy.save_weights_and_get_sampling_client("reference").result()
    seqs, data = dpo_pairs()  # chosen, rejected, chosen, rejected
    out = {"ref": [], "policy": [], "loss": []}
    for _ in range(4):
        ref_lp = [torch.tensor(reference.compute_logprobs(types.ModelInput.from_ints(s)).result()[1:]) for s in seqs]
        out["ref"].append([float((lp * torch.as_tensor(d.loss_fn_inputs["weights"].to_numpy())).sum())
                           for lp, d in zip(ref_lp, data)])

        def dpo_loss(batch, logprobs_list, ref_lp=ref_lp):
            w = [torch.as_tensor(d.loss_fn_inputs["weights"].to_numpy()) for d in batch]
            pol = [(lp * wi).sum() for lp, wi in zip(logprobs_list, w)]
            ref = [(lp * wi).sum() for lp, wi in zip(ref_lp, w)]
            chosen = torch.stack([pol[i] - ref[i] for i in range(0, len(pol), 2)])
            rejected = torch.stack([pol[i] - ref[i] for i in range(1, len(pol), 2)])
            loss = -F.logsigmoid(beta * (chosen - rejected)).mean()
            return loss, {"dpo_loss": float(loss), "policy_chosen": float(pol[0])}

        fb = policy.forward_backward_custom(data, dpo_loss)
        policy.optim_step(types.AdamParams(learning_rate=5e-2)).result()
        m = fb.result().metrics
        out["loss"].append(m["dpo_loss"])
        out["policy"].append(m["policy_chosen"])
    return out


@pytest.fixture(scope="module")
def four(tmp_path_factory):
    run_dir = str(tmp_path_factory.mktemp("four") / "run")
    return run_ranks(serve, 1, run_dir, functools.partial(_together_then_alone, n=4),
                     [*ARGS, "--serve.max_models=9", "--serve.versions=2"], timeout=600)[0]


def _same_as_alone(r: dict) -> None:
    for got, want in zip(r["together"], r["alone"]):
        np.testing.assert_allclose(got["loss"], want["loss"], rtol=1e-6, atol=0)
        np.testing.assert_allclose(np.concatenate(got["lp"]), np.concatenate(want["lp"]), rtol=0, atol=1e-6)
    assert len({round(t["loss"][-1], 6) for t in r["together"]}) == len(r["together"])  # seeds apart: models apart


def test_four_clients_trained_at_once_equal_each_trained_alone(four):
    """4 SDK threads, each its own model, requests interleaved as they come: each equals its seed trained alone."""
    _same_as_alone(four)


def test_the_cookbook_dpo_reference_stays_frozen_while_the_policy_moves(four):
    """issue 35's DPO row: the reference is the policy before training, its log-probs the same at every step.
    The cookbook's train_dpo.py loop is written out with the same SDK calls in _dpo (its own code:
    test_cookbook.py, where the cookbook is importable)."""
    d = four
    assert all(ref == d["ref"][0] for ref in d["ref"])  # exactly: a frozen version
    assert d["policy"][-1] != d["policy"][0]  # the policy moved (its chosen sequence's log-prob)
    assert d["loss"][0] == pytest.approx(np.log(2), abs=1e-6)  # policy == reference at step 0: -logsigmoid(0)
    assert d["loss"][-1] < d["loss"][0]


def test_too_many_models_or_versions_is_one_line_each_and_the_model_trains_on(four):
    r = four
    assert "--serve.max_models=9" in r["too_many_models"] and "9 training models" in r["too_many_models"]
    assert "--serve.versions=2" in r["too_many_versions"] and "2 frozen versions" in r["too_many_versions"]
    assert "kind='inflight'" in r["too_many_versions"]
    for line in (r["too_many_models"], r["too_many_versions"]):
        assert "\n" not in line and "fix:" in line
    assert len(r["after_refusals"]) == 1 and r["held"]["models"] == 10 and r["held"]["versions"] == 2  # + default


@pytest.mark.slow
def test_sixteen_clients_trained_at_once_equal_each_trained_alone(tmp_path):
    _same_as_alone(run_ranks(_serve, 1, str(tmp_path / "run"), functools.partial(_together_then_alone, n=16),
                             timeout=1200)[0])


def test_a_sampler_is_freed_when_its_ttl_passes(served):
    """ttl_seconds on save_weights_for_sampler (the SDK sends it for named saves): past it the sampling session is
    gone, one 400 line (the fake Engine holds no versions: the session's bookkeeping is what is checked here)."""
    import time

    from tests.serve.raw_http import KEY, Client

    c = Client(served.url)
    rid = c.http.post("/save_weights_for_sampler", headers=KEY, json={
        "model_id": c.model_id, "seq_id": c.next_seq(), "ttl_seconds": 1.5}).json()["request_id"]
    sid = c.result(rid)["sampling_session_id"]
    sample = {"sampling_session_id": sid, "prompt": {"chunks": [{"type": "encoded_text", "tokens": [1, 2]}]},
              "sampling_params": {"max_tokens": 1}}
    assert c.http.post("/asample", headers=KEY, json=sample).status_code == 200
    time.sleep(1.6)  # the TTL with room: at 0.2 s a loaded 2-core CI host passed it before the first sample
    r = c.http.post("/asample", headers=KEY, json=sample)
    assert r.status_code == 400 and "freed" in r.json()["detail"] and "ttl_seconds" in r.json()["detail"]
