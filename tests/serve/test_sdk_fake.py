"""The official tinker SDK against the server's HTTP side and command loop on the one-process fake Engine: the
protocol end to end (futures, protobuf results, seq_id order, sampling) without torch.distributed."""

import numpy as np
import pytest

tinker = pytest.importorskip("tinker")
from tinker import types  # noqa: E402


def _datum(tokens: list[int]) -> types.Datum:
    return types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]),
                       loss_fn_inputs={"target_tokens": np.asarray(tokens[1:], dtype=np.int64),
                                       "weights": np.ones(len(tokens) - 1, dtype=np.float32)})


def test_sdk_train_sample_save_load(served, sdk_client):
    sc = sdk_client(served.url, "tml-test")
    tc = sc.create_lora_training_client(base_model="tiny", rank=0).result()
    assert tc.get_info().model_data.model_name == "tiny"
    data = [_datum(list(b"hello world, hello shardfit")), _datum(list(b"the quick brown fox"))]
    losses = []
    for _ in range(4):
        fb = tc.forward_backward(data, "cross_entropy")
        opt = tc.optim_step(types.AdamParams(learning_rate=1e-2))
        out = fb.result()
        opt.result()
        losses.append(out.metrics["loss:sum"])
        assert [len(o["logprobs"].data) for o in out.loss_fn_outputs] == [26, 18]
    assert losses[-1] < losses[0]
    fwd = tc.forward(data, "cross_entropy").result()
    assert fwd.metrics["loss:sum"] < losses[0]
    sampler = tc.save_weights_and_get_sampling_client().result()
    res = sampler.sample(types.ModelInput.from_ints(list(b"hello")), num_samples=3,
                         sampling_params=types.SamplingParams(max_tokens=5, temperature=1.0, seed=1)).result()
    assert len(res.sequences) == 3
    for seq in res.sequences:
        assert 1 <= len(seq.tokens) <= 5 and len(seq.logprobs) == len(seq.tokens)
        assert all(lp <= 0 for lp in seq.logprobs)
    lps = sampler.compute_logprobs(types.ModelInput.from_ints(list(b"hello"))).result()
    assert lps[0] is None and len(lps) == 5 and all(v <= 0 for v in lps[1:])
    path = tc.save_state("ckpt1").result().path
    assert path.startswith("tinker://") and path.endswith("/weights/ckpt1")
    resumed = sc.create_training_client_from_state_with_optimizer(path).result()
    assert served.engine.calls.count("load_state") == 1
    assert resumed.model_id != tc.model_id and resumed.model_id.split(":")[1] == "train"
    again = resumed.forward(data, "cross_entropy").result()  # the resumed model's seq_ids start again at 1
    assert again.metrics["loss:sum"] == pytest.approx(fwd.metrics["loss:sum"], rel=1e-5)
