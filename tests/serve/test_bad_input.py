"""Bad requests against a running server (HTTP side + command loop on the fake Engine): each gets a clear 4xx (or a
user-error result when only the Engine can tell), and the next good request works."""

from __future__ import annotations

import json
import os
import socket
import stat
import time
from urllib.parse import urlparse

import numpy as np
import pytest

from tests.serve.raw_http import KEY, PROTO, Client, fb_body


@pytest.fixture
def client(served):
    return Client(served.url)


def _cases(c: Client):
    m = c.model_id
    return {
        "malformed JSON": lambda: c.http.post("/optim_step", content=b"{not json", headers=KEY),
        "JSON of the wrong shape": lambda: c.http.post("/optim_step", json={"model_id": m, "seq_id": "x"},
                                                       headers=KEY),
        "bad protobuf": lambda: c.http.post("/forward_backward", content=b"\x0a\xff\xff\xff", headers=PROTO),
        "token id beyond the vocabulary": lambda: c.http.post("/forward_backward", headers=PROTO,
                                                              content=fb_body(m, c.next_seq(), tokens=(1, 999, 3))),
        "empty data": lambda: c.http.post("/forward_backward", content=fb_body(m, c.next_seq(), data=[]),
                                          headers=PROTO),
        "unknown loss": lambda: c.http.post("/forward_backward", headers=PROTO,
                                            content=fb_body(m, c.next_seq(), loss_fn="magic")),
        "unknown model": lambda: c.http.post("/optim_step", headers=KEY,
                                             json={"model_id": "nope:train:0", "seq_id": 1, "adam_params": {}}),
        "negative learning rate": lambda: c.http.post("/optim_step", headers=KEY, json={
            "model_id": m, "seq_id": c.next_seq(), "adam_params": {"learning_rate": -1}}),
        "oversize request": lambda: c.http.post("/forward_backward", content=b"x" * (2 << 20), headers=PROTO),
        "wrong key": lambda: c.http.post("/create_session", json={}, headers={"X-API-Key": "sk-not-tinker"}),
        "no key": lambda: c.http.post("/create_session", json={}),
        "path with ..": lambda: c.http.post("/load_weights", headers=KEY, json={
            "model_id": m, "seq_id": c.next_seq(), "path": "tinker://x/weights/../../../etc", "optimizer": False}),
        "absolute path": lambda: c.http.post("/save_weights", headers=KEY, json={
            "model_id": m, "seq_id": c.next_seq(), "path": "/etc/passwd"}),
        "not a tinker path": lambda: c.http.post("/load_weights", headers=KEY, json={
            "model_id": m, "seq_id": c.next_seq(), "path": "file:///etc/passwd"}),
        "sample beyond max_seq_len": lambda: c.http.post("/asample", headers=KEY, json={
            "base_model": "tiny", "prompt": {"chunks": [{"type": "encoded_text", "tokens": [1, 2]}]},
            "sampling_params": {"max_tokens": 10_000}}),
        "seq_id used twice": lambda: c.http.post("/optim_step", headers=KEY,
                                                 json={"model_id": m, "seq_id": 1, "adam_params": {}}),
        # the fake Engine trains every parameter (no --lora.rank): one model, no versions
        "a second model without --lora.rank": lambda: c.http.post("/create_model", headers=KEY, json={
            "session_id": c.session, "model_seq_id": 1, "base_model": "tiny", "lora_config": {"rank": 0}}),
        "a LoRA client without --lora.rank": lambda: c.http.post("/create_model", headers=KEY, json={
            "session_id": c.session, "model_seq_id": 3, "base_model": "tiny", "lora_config": {"rank": 4}}),
        "a negative model_seq_id": lambda: c.http.post("/create_model", headers=KEY, json={
            "session_id": c.session, "model_seq_id": -1, "base_model": "tiny", "lora_config": {"rank": 0}}),
        "a LoRA rank as a string": lambda: c.http.post("/create_model", headers=KEY, json={
            "session_id": c.session, "model_seq_id": 4, "base_model": "tiny", "lora_config": {"rank": "8"}}),
        "a seed that is not an integer": lambda: c.http.post("/create_model", headers=KEY, json={
            "session_id": c.session, "model_seq_id": 2, "base_model": "tiny", "lora_config": {"seed": "x"}}),
        "a sampler of a saved path that does not exist": lambda: c.http.post(
            "/create_sampling_session", headers=KEY, json={"session_id": c.session,
                                                           "model_path": f"tinker://{m}/sampler_weights/s"}),
        "a sampler kind that is not served": lambda: c.http.post("/save_weights_for_sampler", headers=KEY, json={
            "model_id": m, "seq_id": c.next_seq(), "kind": "eventual"}),
        "a sample of a path without its session": lambda: c.http.post("/asample", headers=KEY, json={
            "model_path": f"tinker://{m}/sampler_weights/s", "prompt": {"chunks": [{"type": "encoded_text",
                                                                                   "tokens": [1, 2]}]},
            "sampling_params": {"max_tokens": 2}}),
    }


EXPECTED = {"oversize request": 413, "wrong key": 401, "no key": 401}


def test_each_bad_request_is_refused_and_the_next_works(client):
    loss = client.good_forward()  # seq 1
    for name, send in _cases(client).items():
        r = send()
        assert r.status_code == EXPECTED.get(name, 400), (name, r.status_code, r.text)
        detail = r.json()["detail"]
        assert "fix" in detail and "\n" not in detail, (name, detail)
        assert name != "a second model without --lora.rank" or "--lora.rank=R" in detail, detail
        assert name != "a sampler of a saved path that does not exist" or "no checkpoint at" in detail, detail
        assert name != "a LoRA client without --lora.rank" or (
            "lora_config.rank" in detail and "pass rank=0" in detail and "--lora.rank=4" in detail), detail
        assert name != "a negative model_seq_id" or "model_seq_id: model_seq_id=-1 is negative" in detail, detail
        assert name != "a LoRA rank as a string" or (
            "lora_config.rank: rank='8' is not an integer >= 0" in detail and "JSON integer" in detail), detail
        assert client.good_forward() == pytest.approx(loss), name  # nothing ran in between: same weights


def test_unknown_endpoint_is_404_not_a_retried_5xx(client):
    assert client.http.post("/auth/token", json={}, headers=KEY).status_code == 404  # only with pjwt_auth_enabled
    assert client.http.get("/no/such/thing", headers=KEY).status_code == 404


def test_engine_error_is_a_user_error_result_and_the_loop_goes_on(client, served):
    # accepted by the server (ppo with its inputs) but refused by the (fake) Engine, as every rank would refuse it
    lp = np.zeros(3, np.float32)
    r = client.http.post("/forward_backward", headers=PROTO,
                         content=fb_body(client.model_id, client.next_seq(), loss_fn="ppo", logprobs=lp, advantages=lp))
    out = client.result(r.json()["request_id"])
    assert out["category"] == "user" and "unknown loss_fn 'ppo'" in out["error"]
    client.good_forward()
    status = client.http.get("/shardfit/status", headers=KEY).json()
    kinds = [t["kind"] for t in status["requests"].values()]
    assert kinds.count("forward_backward") == 2 and all(t["queue_s"] >= 0 for t in status["requests"].values())


def test_client_killed_mid_request_leaves_the_server_working(client, served):
    u = urlparse(served.url)
    body = fb_body(client.model_id, client.next_seq())
    for cut in (10, len(body) - 1):
        s = socket.create_connection((u.hostname, u.port))
        s.sendall(f"POST /api/v1/forward_backward HTTP/1.1\r\nHost: x\r\nX-API-Key: tml-t\r\n"
                  f"Content-Type: application/x-protobuf\r\nContent-Length: {len(body)}\r\n\r\n".encode() + body[:cut])
        s.close()  # killed before the body is whole: nothing may be queued from it
    time.sleep(0.3)
    assert served.state.scheduler.depth() == {"ready": 0, "waiting_for_earlier_seq_id": 0}
    # its seq_id was never used: the same request, sent whole, runs
    r = client.http.post("/forward_backward", content=body, headers=PROTO)
    assert r.status_code == 200 and client.result(r.json()["request_id"]).metrics["loss:sum"] > 0


def test_a_retried_post_gets_the_first_answer(client, served):
    headers = {**PROTO, "X-Idempotency-Key": "abc"}
    body = fb_body(client.model_id, client.next_seq())
    first = client.http.post("/forward_backward", content=body, headers=headers).json()
    again = client.http.post("/forward_backward", content=body, headers=headers).json()
    assert first == again
    client.result(first["request_id"])
    assert served.engine.calls.count("forward") == 0 and served.engine.calls.count("forward_backward") == 1


def test_key_off_loopback_is_generated_private_and_checked(tmp_path):
    from shardfit.errors import ShardfitError
    from shardfit.serve.security import key_ok, setup_api_key

    assert setup_api_key("127.0.0.1", tmp_path, None) is None  # loopback: any SDK key
    assert key_ok(None, "tml-anything") and not key_ok(None, "sk-x") and not key_ok(None, None)
    key = setup_api_key("0.0.0.0", tmp_path, None)
    f = tmp_path / "api_key"
    assert f.read_text().strip() == key and key.startswith("tml-") and len(key) > 30
    assert stat.S_IMODE(os.stat(f).st_mode) == 0o600
    assert key_ok(key, key) and not key_ok(key, key[:-1] + "x") and not key_ok(key, "tml-other")
    with pytest.raises(ShardfitError, match="tml-"):
        setup_api_key("0.0.0.0", tmp_path, "secret")


def test_checkpoint_paths_stay_inside_the_run_directory(tmp_path):
    from shardfit.errors import ShardfitError
    from shardfit.serve.security import checkpoint_dir, parse_tinker_path

    assert parse_tinker_path("tinker://s:train:0/weights/step-1", "p") == ("s:train:0", "weights", "step-1")
    for bad in ("tinker://a/weights/..", "tinker://../weights/x", "tinker://a/weights/b/c", "tinker://a/other/x",
                "tinker://a/weights/.hidden", "tinker://a/weights/x%2F..", "/abs/path"):
        with pytest.raises(ShardfitError):
            parse_tinker_path(bad, "p")
    (tmp_path / "checkpoints" / "r" / "weights").mkdir(parents=True)
    (tmp_path / "checkpoints" / "r" / "weights" / "link").symlink_to("/etc")
    with pytest.raises(ShardfitError, match="leaves the run directory"):
        checkpoint_dir(tmp_path, "r", "weights", "link")
    assert json.dumps(str(checkpoint_dir(tmp_path, "r", "weights", "ok")))


def _saved_by(run_dir, name: str, base_model: str = "tiny", lora_rank: int = 0) -> str:
    """A checkpoint's listing entry (serve's META) as another server would have written it: its tinker path."""
    from shardfit.serve.state import META

    path = f"tinker://other:train:0/weights/{name}"
    d = run_dir / "checkpoints" / "other:train:0" / "weights" / name
    d.mkdir(parents=True)
    (d / META).write_text(json.dumps({
        "tinker_path": path, "checkpoint_type": "training", "time": "2026-12-07T00:00:00+00:00",
        "model_id": "other:train:0", "base_model": base_model, "is_lora": bool(lora_rank),
        "lora_rank": lora_rank or None, "train_attn": bool(lora_rank) or None, "train_mlp": bool(lora_rank) or None,
        "train_unembed": False if lora_rank else None}))
    return path


def test_sampler_weights_with_the_optimizer_is_one_line_naming_the_fix(client, served):
    """A sampler's weights hold no optimizer state: load_state_with_optimizer and
    create_training_client_from_state_with_optimizer of one are a 400 naming the loads that work (it was a result
    error naming the server's directory and Engine.load_state)."""
    from shardfit.serve.state import META

    c, run = client, "other:train:0"
    d = served.state.run_dir / "checkpoints" / run / "sampler_weights" / "s"
    d.mkdir(parents=True)
    path = f"tinker://{run}/sampler_weights/s"
    (d / META).write_text(json.dumps({"tinker_path": path, "checkpoint_type": "sampler", "model_id": run,
                                      "time": "2026-12-07T00:00:00+00:00", "base_model": "tiny"}))
    for body in ({"model_id": c.model_id, "seq_id": c.next_seq(), "path": path, "optimizer": True},
                 {"session_id": c.session, "model_seq_id": 5, "path": path, "optimizer": True}):
        r = c.http.post("/load_weights", headers=KEY, json=body)
        assert r.status_code == 400, r.text
        detail = r.json()["detail"]
        assert "holds weights only" in detail and "create_training_client_from_state" in detail, detail
        assert str(served.state.run_dir) not in detail and "\n" not in detail


def test_a_model_seq_id_used_twice_is_refused_and_the_model_keeps_its_record(tmp_path):
    """A second create_model with a session's model_seq_id overwrote the model's record (its unsaved steps, its
    metadata) and then failed in the Engine as a result error; now it is a 400 naming model_seq_id."""
    from tests.serve.conftest import start_fake, stop_fake
    from tests.serve.fake_engine import tiny_config

    lora = start_fake(tiny_config(tmp_path, "--lora.rank=8"))
    try:
        c = Client(lora.url, model=False)
        body = {"session_id": c.session, "model_seq_id": 0, "base_model": "tiny", "lora_config": {"rank": 8},
                "user_metadata": {"run": "first"}}
        model_id = c.http.post("/create_model", headers=KEY, json=body).json()["model_id"]
        r = c.http.post("/create_model", headers=KEY, json={**body, "user_metadata": {"run": "second"}})
        assert r.status_code == 400 and "model_seq_id 0 of this session is taken" in r.json()["detail"], r.text
        assert lora.state.models[model_id]["user_metadata"] == {"run": "first"}
    finally:
        stop_fake(lora)


def _loads(c: Client, path: str) -> list[str]:
    """A sampler of `path`, load_state of it into c's model, a training client from it: the three refusals."""
    out = []
    for url, body in (("/create_sampling_session", {"session_id": c.session, "model_path": path}),
                      ("/load_weights", {"model_id": c.model_id, "seq_id": c.next_seq(), "path": path,
                                         "optimizer": True}),
                      ("/load_weights", {"session_id": c.session, "model_seq_id": 9, "path": path,
                                         "optimizer": True})):
        r = c.http.post(url, headers=KEY, json=body)
        assert r.status_code == 400, (url, r.status_code, r.text)
        out.append(r.json()["detail"])
        assert "\n" not in out[-1] and "fix:" in out[-1]
    return out


def test_a_checkpoint_this_server_cannot_load_is_one_line_each(tmp_path):
    """A tinker path of another model, of LoRA adapters on a server that trains every parameter, of every weight on
    a LoRA server, of adapters of another rank: one 400 line each (sampler, load_state, a client from the state)
    naming what it holds and the server that loads it; the model trains on as before."""
    from tests.serve.conftest import start_fake, stop_fake
    from tests.serve.fake_engine import tiny_config

    full = start_fake(tiny_config(tmp_path / "full"))
    lora = start_fake(tiny_config(tmp_path / "lora", "--lora.rank=8"))
    try:
        c = Client(full.url)
        loss = c.good_forward()
        for line in _loads(c, _saved_by(full.state.run_dir, "of-8b", base_model="llama3-8b")):
            assert "holds weights of 'llama3-8b', this server serves 'tiny'" in line and "--model.name" in line
        for line in _loads(c, _saved_by(full.state.run_dir, "adapters", lora_rank=8)):
            assert "holds LoRA adapters of rank 8; this server trains every parameter (no --lora.rank)" in line
            assert "started with --lora.rank=8" in line
        assert c.good_forward() == pytest.approx(loss)  # nothing ran in between: same weights

        c = Client(lora.url, model=False)
        c.model_id = c.http.post("/create_model", headers=KEY, json={
            "session_id": c.session, "model_seq_id": 0, "base_model": "tiny", "lora_config": {"rank": 8}}
            ).json()["model_id"]
        for line in _loads(c, _saved_by(lora.state.run_dir, "every-weight")):
            assert "holds every weight (saved without --lora.rank); this server trains LoRA adapters of rank 8" in line
            assert "started without --lora.rank" in line
        for line in _loads(c, _saved_by(lora.state.run_dir, "rank-4", lora_rank=4)):
            assert "holds LoRA adapters of rank 4; this server trains LoRA adapters of rank 8" in line
            assert "--lora.rank=4" in line
        c.good_forward()
    finally:
        stop_fake(full)
        stop_fake(lora)
