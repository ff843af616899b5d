"""The wire formats against the SDK's own converters: what the SDK encodes, the server decodes; what the server
encodes, the SDK decodes into the same arrays."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("tinker")
from tinker import types  # noqa: E402
from tinker.proto.request_conv import forward_backward_request_to_proto  # noqa: E402
from tinker.proto.response_conv import deserialize_forward_backward_output, deserialize_sample_response  # noqa: E402

from shardfit.errors import ShardfitError  # noqa: E402
from shardfit.serve.executor import metric_key  # noqa: E402
from shardfit.serve.protocol import (  # noqa: E402
    check_forward_backward,
    encode_forward_backward,
    encode_sample,
    loss_config,
    parse_forward_backward,
)


def _request(data, loss_fn="cross_entropy", config=None) -> bytes:
    req = types.ForwardBackwardRequest(forward_backward_input=types.ForwardBackwardInput(
        data=data, loss_fn=loss_fn, loss_fn_config=config), model_id="s:train:0", seq_id=3)
    return forward_backward_request_to_proto(req).SerializeToString()


def test_sdk_request_decodes_to_the_same_datums():
    rng = np.random.default_rng(0)
    chunks = [types.EncodedTextChunk(tokens=[1, 2, 3]), types.EncodedTextChunk(tokens=[4]),
              types.EncodedTextChunk(tokens=[5, 6])]  # SL datums come in several chunks
    d0 = types.Datum(model_input=types.ModelInput(chunks=chunks), loss_fn_inputs={
        "target_tokens": np.array([2, 3, 4, 5, 6, 7], dtype=np.int64),
        "weights": rng.random(6).astype(np.float32),
        "logprobs": -rng.random(6).astype(np.float32), "advantages": rng.standard_normal(6).astype(np.float32)})
    d1 = types.Datum(model_input=types.ModelInput.from_ints([9]), loss_fn_inputs={
        "target_tokens": np.array([10], dtype=np.int64), "logprobs": np.array([-0.1], np.float32),
        "advantages": np.array([1.0], np.float32)})
    msg = parse_forward_backward(_request([d0, d1], "ppo", {"clip_low_threshold": 0.8, "mode": "x"}))
    assert (msg.model_id, msg.seq_id, msg.loss_fn) == ("s:train:0", 3, "ppo")
    assert loss_config(msg) == {"clip_low_threshold": 0.8, "mode": "x"}
    datums = check_forward_backward(msg, vocab=264, max_len=64)
    assert datums[0].tokens.tolist() == [1, 2, 3, 4, 5, 6] and datums[0].tokens.dtype == np.int64
    for name, td in d0.loss_fn_inputs.items():
        expected = td.to_numpy() if isinstance(td, types.TensorData) else td
        np.testing.assert_array_equal(datums[0].inputs[name], expected)
    assert datums[1].tokens.tolist() == [9]


def _one(tokens, targets, loss_fn="cross_entropy", **inputs):
    data = [types.Datum(model_input=types.ModelInput.from_ints(tokens),
                        loss_fn_inputs={"target_tokens": np.asarray(targets, np.int64), **inputs})]
    return check_forward_backward(parse_forward_backward(_request(data, loss_fn)), vocab=264, max_len=8)


@pytest.mark.parametrize("case, needle", [
    (lambda: _one([1, 300], [2, 3]), "token id 300 is outside the vocabulary"),
    (lambda: _one([1, 2], [2, 264]), "token id 264 is outside"),
    (lambda: _one([1, 2], [2]), "does not start with the model input's length 2"),
    (lambda: _one(list(range(9)), list(range(9))), "exceed the model's max_seq_len=8"),
    (lambda: _one([1, 2], [2, 3], "importance_sampling"), "'logprobs' is missing"),
    (lambda: _one([1, 2], [2, 3], weights=np.array([1.0, np.nan], np.float32)), "NaN"),
    (lambda: _one([1, 2], [2, 3], "sft"), "unknown loss_fn 'sft'"),
    # every served loss reads one value per token: [L, k] (dense or CSR) is what the Engine would refuse
    (lambda: _one([1, 2], [2, 3], weights=np.ones((2, 3), np.float32)),
     "data[0].loss_fn_inputs[weights]: shape [2, 3] is not [2]"),
    (lambda: _one([1, 2], [2, 3], topk=_sparse(2, 3)), "data[0].loss_fn_inputs[topk]: shape [2, 3] is not [2]"),
    (lambda: parse_forward_backward(b"\xff\xff\xff garbage"), "not a ForwardBackwardRequest protobuf"),
])
def test_bad_datums_are_one_line_each(case, needle):
    with pytest.raises(ShardfitError, match="fix: ") as e:
        case()
    assert needle in str(e.value) and "\n" not in str(e.value)


def test_outputs_decode_in_the_sdk():
    # ragged: the second field's trailing size changes after two datums (two ArrayRecords on the wire)
    outs = [{"logprobs": np.array([-1.0, -2.0], np.float32), "topk": np.ones((2, 2), np.float32)},
            {"logprobs": np.array([-0.5], np.float32), "topk": np.full((1, 2), 2.0, np.float32)},
            {"logprobs": np.array([-3.0, -1.5, -0.25], np.float32),
             "topk": np.arange(9, dtype=np.float32).reshape(3, 3)},
            {"logprobs": np.array([-0.75], np.float32), "topk": np.zeros((1, 3), np.float32)}]
    out = deserialize_forward_backward_output(encode_forward_backward(outs, {"loss:sum": 3.5, "n:max": 2}))
    assert out.metrics == {"loss:sum": 3.5, "n:max": 2.0}
    assert len(out.loss_fn_outputs) == 4
    for got, want in zip(out.loss_fn_outputs, outs):
        assert set(got) == set(want)
        for k in want:
            np.testing.assert_array_equal(got[k].to_numpy().reshape(want[k].shape), want[k])
    with pytest.raises(ValueError, match="name:reduction"):
        encode_forward_backward(outs[:1], {"a:b:mean": 1.0})
    with pytest.raises(ValueError, match="same fields"):  # the SDK cannot decode records with other field names
        encode_forward_backward([outs[0], {"logprobs": outs[1]["logprobs"]}], {})


def test_sample_response_decodes_in_the_sdk():
    """A SampleResult's samples, stop reasons, prompt log-probs and both top-k lists read back through the SDK's own
    decoder: a position with no context is None, a shorter top-k row keeps its own length."""
    from shardfit.sampling.params import Sampled, SampleResult

    res = SampleResult([Sampled([5, 6, 257], [-0.5, -1.0, -0.25], "stop", [[(5, -0.5), (9, -1.5)], [(6, -1.0)],
                                                                            [(257, -0.25), (3, -2.0)]]),
                        Sampled([7], [-2.0], "length")],
                       prompt_logprobs=[None, -1.0, -2.5],
                       topk_prompt_logprobs=[None, [(4, -0.75), (1, -1.0)], [(2, -2.5), (8, -3.0)]])
    back = deserialize_sample_response(encode_sample(res))
    assert [s.stop_reason for s in back.sequences] == ["stop", "length"]
    assert list(back.sequences[0].tokens) == [5, 6, 257]
    assert np.allclose(back.sequences[0].logprobs, [-0.5, -1.0, -0.25])
    assert back.prompt_logprobs[0] is None and back.prompt_logprobs[1:] == [-1.0, -2.5]
    assert back.topk_prompt_logprobs == [None, [(4, -0.75), (1, -1.0)], [(2, -2.5), (8, -3.0)]]
    assert back.sequences[0].topk_logprobs == [[(5, -0.5), (9, -1.5)], [(6, -1.0)], [(257, -0.25), (3, -2.0)]]
    assert back.sequences[1].topk_logprobs is None


def test_metric_keys_get_exactly_one_colon():
    assert metric_key("loss:sum") == "loss:sum"
    assert metric_key("grad_norm") == "grad_norm:mean"
    assert metric_key("a:b:max") == "a_b_max:mean"
    assert metric_key("x:median") == "x_median:mean"


def _sparse(rows: int, cols: int) -> types.TensorData:
    return types.TensorData(data=[1.0], dtype="float32", shape=[rows, cols],
                            sparse_crow_indices=[0, 1] + [1] * (rows - 1), sparse_col_indices=[0])


@pytest.mark.parametrize("inputs, kwargs, needle", [
    ({"topk": _sparse(2, 1 << 28)}, {}, "268,435,456 values per token, more than the vocabulary (264)"),
    ({"topk": _sparse(5, 3)}, {}, "shape [5, 3] does not start with the model input's length 2"),
    ({"topk": _sparse(2, 200)}, {"max_values": 300}, "declare more than 300 values in all"),
    ({}, {"token_budget": 1}, "2 tokens are more than the server's micro-batch of 1 tokens"),
])
def test_shapes_are_checked_before_anything_is_expanded(inputs, kwargs, needle, monkeypatch):
    import shardfit.serve.protocol as protocol

    def refuse(*a, **k):  # nothing may be densified for a request that is refused
        raise AssertionError("expanded before it was checked")

    monkeypatch.setattr(protocol.np, "zeros", refuse)
    data = [types.Datum(model_input=types.ModelInput.from_ints([1, 2]),
                        loss_fn_inputs={"target_tokens": np.array([2, 3], np.int64), **inputs})]
    with pytest.raises(ShardfitError, match="fix: ") as e:
        check_forward_backward(parse_forward_backward(_request(data)), vocab=264, max_len=8, **kwargs)
    assert needle in str(e.value), str(e.value)
