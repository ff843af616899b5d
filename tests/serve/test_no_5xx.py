"""No input makes the server answer 5xx (which the SDK retries for minutes, so that its client seems to hang): each
hostile or clumsy request below gets a 4xx whose detail is one line naming the field, no handler meets an exception
nobody foresaw (the server's `bugs` count stays 0), and the next good request computes what it computed before."""

from __future__ import annotations

import time

import numpy as np
import pytest

from tests.serve.raw_http import KEY, PROTO, Client, fb_body, httpx

pytest.importorskip("tinker")
from tinker import types  # noqa: E402


def _csr(rows: int, cols: int) -> types.TensorData:
    """A few bytes of CSR declaring a dense [rows, cols] tensor."""
    return types.TensorData(data=[1.0], dtype="float32", shape=[rows, cols],
                            sparse_crow_indices=[0, 1] + [1] * (rows - 1), sparse_col_indices=[0])


def _nested(depth: int) -> bytes:
    return b'{"session_id": "s", "user_metadata": ' + b'{"a": ' * depth + b"1" + b"}" * depth + b"}"


def _cases(c: Client, url: str) -> dict:
    """name -> (send, the status, what the one-line detail names)."""
    m, post, sample = c.model_id, c.http.post, "/asample"

    def fb(**kw):
        return lambda: post("/forward_backward", content=fb_body(m, c.next_seq(), **kw), headers=PROTO)

    def asample(prompt, params=None):
        return lambda: post(sample, headers=KEY, json={"base_model": "tiny", "prompt": prompt,
                                                       "sampling_params": params or {"max_tokens": 2}})

    def chunked(n: int):
        return lambda: post("/forward_backward", content=iter([b"x" * 65536] * n), headers=PROTO)

    return {
        "JSON nested far too deeply": (lambda: post("/create_model", headers=KEY, content=b"[" * 200000 +
                                                    b"]" * 200000), 400, "/create_model"),
        "JSON nested deeper than any SDK body": (lambda: post("/create_session", headers=KEY, content=_nested(900)),
                                                 400, "nested"),
        "a lone surrogate echoed in the error": (lambda: post("/create_model", headers=KEY, content=b'{"session_id": "'
                                                         + c.session.encode() + b'", "model_seq_id": 7, '
                                                         b'"base_model": "bad \\ud800 name"}'), 400, "base_model"),
        "bytes that are not UTF-8": (lambda: post("/create_model", headers=KEY,
                                                  content=b'{"session_id": "\xff\xfe"}'), 400, "not JSON"),
        "a request id never issued (digit-like)": (lambda: post("/retrieve_future", headers=KEY,
                                                                json={"request_id": "req-\u00b2"}), 404, "request_id"),
        "a request id of the old, guessable kind": (lambda: post("/retrieve_future", headers=KEY,
                                                                 json={"request_id": "req-1"}), 404, "request_id"),
        "a request id that is a number": (lambda: post("/retrieve_future", headers=KEY, json={"request_id": 12}),
                                          400, "request_id"),
        "an over-limit body sent chunked": (chunked(20), 413, "exceeds"),
        "a prompt chunk that is a list": (asample({"chunks": [[1, 2]]}), 400, "prompt"),
        "a prompt chunk that is a string": (asample({"chunks": ["hello"]}), 400, "prompt"),
        "a token id beyond int64": (asample({"chunks": [{"type": "encoded_text", "tokens": [10**30]}]}), 400,
                                    "prompt"),
        "a prompt that is a string": (asample("hello"), 400, "prompt"),
        "max_tokens as a string": (asample({"chunks": [{"tokens": [1]}]}, {"max_tokens": "5"}), 400, "max_tokens"),
        "top_p as a string": (asample({"chunks": [{"tokens": [1]}]}, {"top_p": "x"}), 400, "sampling_params"),
        "stop as an object": (asample({"chunks": [{"tokens": [1]}]}, {"stop": {"a": 1}}), 400, "stop"),
        "a prompt as long as the context": (asample({"chunks": [{"tokens": [1] * 128}]}, {"max_tokens": 1}), 400,
                                            "the prompt has 128 tokens and the model's context is max_seq_len=128"),
        "adam_params as a list": (lambda: post("/optim_step", headers=KEY, json={
            "model_id": m, "seq_id": c.next_seq(), "adam_params": [1]}), 400, "adam_params"),
        "a learning rate as text": (lambda: post("/optim_step", headers=KEY, json={
            "model_id": m, "seq_id": c.next_seq(), "adam_params": {"learning_rate": "fast"}}), 400, "learning_rate"),
        "an eps of 0 (NaN weights wherever a gradient is 0)": (lambda: post("/optim_step", headers=KEY, json={
            "model_id": m, "seq_id": c.next_seq(), "adam_params": {"learning_rate": 1e-3, "eps": 0}}), 400,
            "adam_params.eps"),
        "a top_k of 0 (keeps no token)": (asample({"chunks": [{"tokens": [1]}]}, {"top_k": 0}), 400, "top_k=0"),
        "top-k log-probs beyond the vocabulary": (lambda: post(sample, headers=KEY, json={
            "base_model": "tiny", "prompt": {"chunks": [{"tokens": [1]}]}, "sampling_params": {"max_tokens": 1},
            "prompt_logprobs": True, "topk_prompt_logprobs": 300}), 400, "0 to 264"),
        "kl_coef without ref_logprobs": (fb(config={"kl_coef": 0.1}), 400, "'ref_logprobs' is missing"),
        "a PPO clip range without the ratio 1": (fb(loss_fn="ppo", config={"clip_low_threshold": 1.5,
                                                                          "clip_high_threshold": 0.5},
                                                   logprobs=np.zeros(3, np.float32),
                                                   advantages=np.ones(3, np.float32)), 400, "clip_low_threshold"),
        "a session id that is a number": (lambda: post("/session_heartbeat", headers=KEY, json={"session_id": 5}),
                                          400, "session_id"),
        "a loss option of the wrong kind": (fb(config={"kl_coef": "high"}), 400, "loss_fn_config.kl_coef"),
        "a loss option that is unknown": (fb(config={"clip": 0.2}), 400, "loss_fn_config"),
        "a preference loss's option that is KTO's": (fb(loss_fn="simpo", config={"kl": 0.1}), 400,
                                                     "simpo takes no option 'kl'"),
        "a preference loss over one datum": (fb(loss_fn="orpo"), 400, "1 datums: a preference loss takes pairs"),
        "a preference pair with no counted token": (fb(loss_fn="simpo", data=[types.Datum(
            model_input=types.ModelInput.from_ints([1, 2, 3]), loss_fn_inputs={
                "target_tokens": np.asarray([2, 3, 4], np.int64), "weights": np.zeros(3, np.float32)})] * 2), 400,
            "datum 0 has no counted token (chosen of pair 0)"),
        "KTO's labels, one too few": (fb(loss_fn="kto", config={"desirable": ""},
                                         ref_logprobs=np.zeros(3, np.float32)), 400, "loss_fn_config.desirable"),
        "CSR declaring a [3, 2^28] tensor": (fb(topk=_csr(3, 1 << 28)), 400, "loss_fn_inputs[topk]"),
        # the Engine takes [L] loss inputs only: an [L, k] one is a 400 here, not a failed result later
        "a 2-D loss input (CSR within the vocabulary)": (fb(topk=_csr(3, 264)), 400,
                                                         "data[0].loss_fn_inputs[topk]: shape [3, 264] is not [3]"),
        "a 2-D loss input (dense)": (fb(weights=np.ones((3, 2), np.float32)), 400,
                                     "data[0].loss_fn_inputs[weights]: shape [3, 2] is not [3]"),
        "a path that is not UTF-8": (lambda: httpx.get(url + "/api/v1/training_runs/%ED%A0%80", headers=KEY), 400,
                                     "training_runs"),
        "a checkpoint name with a slash": (lambda: httpx.delete(
            url + f"/api/v1/training_runs/{m}/checkpoints/weights/..%2F..", headers=KEY), 404, "Not Found"),
        "a checkpoint name with ..": (lambda: httpx.delete(
            url + f"/api/v1/training_runs/{m}/checkpoints/weights/a..b", headers=KEY), 400, "allowed name"),
    }


def test_no_input_is_answered_5xx_and_the_next_request_works(served):
    c = Client(served.url)
    loss = c.good_forward()
    for name, (send, status, needle) in _cases(c, served.url).items():
        t0 = time.monotonic()
        r = send()
        assert r.status_code == status, (name, r.status_code, r.text[:300])
        detail = r.json()["detail"]
        assert needle in detail and "\n" not in detail and len(detail) < 1000, (name, detail[:300])
        assert time.monotonic() - t0 < 10, name  # refused before anything was expanded or queued
        assert c.good_forward() == pytest.approx(loss), name  # nothing ran in between: the same weights
    assert served.state.bugs == 0
    assert served.state.scheduler.depth() == {"ready": 0, "waiting_for_earlier_seq_id": 0}


def test_a_skipped_steps_infinite_gradient_norm_reaches_the_sdk(served, sdk_client):
    """Weights of 1e30 overflow the gradient norm: the step is skipped (as the Engine skips it), and its metrics,
    infinity included, come back as the SDK reads them (JSON has no infinity: "Infinity", a float to the SDK)."""
    tc = sdk_client(served.url, "tml-test").create_lora_training_client(base_model="tiny", rank=0).result()
    t = list(b"an overflowing step")
    huge = types.Datum(model_input=types.ModelInput.from_ints(t[:-1]),
                       loss_fn_inputs={"target_tokens": np.asarray(t[1:], np.int64),
                                       "weights": np.full(len(t) - 1, 1e30, np.float32)})
    tc.forward_backward([huge], "cross_entropy").result()
    t0 = time.monotonic()
    metrics = tc.optim_step(types.AdamParams(learning_rate=1e-3)).result().metrics
    assert metrics["grad_norm:mean"] == float("inf") and metrics["skipped:max"] == 1.0
    assert time.monotonic() - t0 < 10  # answered, not retried for minutes
    ok = types.Datum(model_input=types.ModelInput.from_ints(t[:-1]),
                     loss_fn_inputs={"target_tokens": np.asarray(t[1:], np.int64)})
    assert np.isfinite(tc.forward([ok], "cross_entropy").result().metrics["loss:sum"])


def test_a_wrong_loss_option_reaches_the_sdk_as_one_line_naming_the_key(served, sdk_client):
    tc = sdk_client(served.url, "tml-test").create_lora_training_client(base_model="tiny", rank=0).result()
    t = list(b"a datum")
    d = types.Datum(model_input=types.ModelInput.from_ints(t[:-1]),
                    loss_fn_inputs={"target_tokens": np.asarray(t[1:], np.int64)})
    t0 = time.monotonic()
    with pytest.raises(Exception, match=r"loss_fn_config\.normalize_constant: normalize_constant='many' is not a "
                                        r"finite number"):
        tc.forward_backward([d], "cross_entropy", {"normalize": "constant", "normalize_constant": "many"}).result()
    assert time.monotonic() - t0 < 10
    assert served.state.bugs == 0
