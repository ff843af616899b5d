"""A raw HTTP client of the Tinker API for the tests that send what the SDK never would: requests built by hand
(httpx), forward_backward bodies built with the SDK's own protobuf conversion."""

from __future__ import annotations

import numpy as np
import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("tinker")
from tinker import types  # noqa: E402
from tinker.proto.request_conv import forward_backward_request_to_proto  # noqa: E402
from tinker.proto.response_conv import deserialize_forward_backward_output  # noqa: E402

KEY = {"X-API-Key": "tml-test"}
PROTO = {**KEY, "Content-Type": "application/x-protobuf"}


def fb_body(model_id: str, seq_id: int, tokens=(1, 2, 3), targets=(2, 3, 4), loss_fn="cross_entropy", data=None,
            config=None, **inputs) -> bytes:
    if data is None:
        data = [types.Datum(model_input=types.ModelInput.from_ints(list(tokens)),
                            loss_fn_inputs={"target_tokens": np.asarray(targets, np.int64), **inputs})]
    req = types.ForwardBackwardRequest(forward_backward_input=types.ForwardBackwardInput(
        data=data, loss_fn=loss_fn, loss_fn_config=config), model_id=model_id, seq_id=seq_id)
    return forward_backward_request_to_proto(req).SerializeToString()


class Client:
    """One session with one training model (none: `model=False`), speaking with `key`."""

    def __init__(self, url: str, key: str = "tml-test", model: bool = True):
        self.key = {"X-API-Key": key}
        self.proto = {**self.key, "Content-Type": "application/x-protobuf"}
        self.http = httpx.Client(base_url=url + "/api/v1", timeout=30)
        self.session = self.http.post("/create_session", json={}, headers=self.key).json()["session_id"]
        self.model_id, self.seq = None, 0
        if model:
            self.model_id = self.http.post("/create_model", headers=self.key, json={
                "session_id": self.session, "model_seq_id": 0, "base_model": "tiny",
                "lora_config": {"rank": 0}}).json()["model_id"]

    def next_seq(self) -> int:
        self.seq += 1
        return self.seq

    def result(self, rid: str):
        for _ in range(30):
            r = self.http.post("/retrieve_future", json={"request_id": rid}, headers=self.key)
            if r.headers["content-type"].startswith("application/x-protobuf"):
                return deserialize_forward_backward_output(r.content)
            if r.json().get("type") != "try_again":
                return r.json()
        raise AssertionError("no result")

    def good_forward(self) -> float:
        r = self.http.post("/forward_backward", content=fb_body(self.model_id, self.next_seq()), headers=self.proto)
        assert r.status_code == 200, r.text
        return self.result(r.json()["request_id"]).metrics["loss:sum"]
