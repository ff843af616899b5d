"""`shardfit serve --sampling.logprobs=trainer` through the official tinker SDK (the real Engine, one and two gloo
ranks -- one rank: a sample run, scored at its end; two: the batch path, sample_batch --, CPU, loopback): a sampling
client's sampled log-probs are, bit for bit, what the training client's forward returns for the datums a loop
builds from those samples (the SDK's request has no such field: the server's config decides); a request whose
sample would not fit the trainer's row fails alone with its one line.
"""

from __future__ import annotations

import numpy as np
import pytest

tinker = pytest.importorskip("tinker")

from tests._dist import run_ranks  # noqa: E402
from tests.helpers import SMALL  # noqa: E402
from tests.serve.engine_server import error, serve, steps  # noqa: E402

ARGS = [*SMALL, "--train.device=cpu", "--train.micro_batch_tokens=32", "--lora.rank=8", "--sampling.logprobs=trainer"]
PROMPT = list(b"hello trainer")


def _scenario(sc, url: str, base_model: str) -> dict:
    from tinker import types

    tc = sc.create_lora_training_client(base_model=base_model, rank=8, seed=1).result()
    steps(tc, [1, 2])
    sampler = tc.save_weights_and_get_sampling_client().result()  # a frozen version: the live weights' values
    res = sampler.sample(types.ModelInput.from_ints(PROMPT), num_samples=3, sampling_params=types.SamplingParams(
        max_tokens=6, temperature=1.0, seed=5)).result()
    datums = []
    for s in res.sequences:  # the cookbook's datum: prompt + completion[:-1], targets shifted by one
        seq = PROMPT + list(s.tokens)
        datums.append(types.Datum(model_input=types.ModelInput.from_ints(seq[:-1]),
                                  loss_fn_inputs={"target_tokens": np.asarray(seq[1:], np.int64),
                                                  "weights": np.ones(len(seq) - 1, np.float32)}))
    fwd = tc.forward(datums, "cross_entropy").result()
    long = types.SamplingParams(max_tokens=30, temperature=1.0, seed=6)  # 13 + 30 - 1 tokens: over the row of 32
    return {"sampled": [np.asarray(s.logprobs, np.float32).tolist() for s in res.sequences],
            "forward": [o["logprobs"].to_numpy()[len(PROMPT) - 1:].tolist() for o in fwd.loss_fn_outputs],
            "too_long": error(lambda: sampler.sample(types.ModelInput.from_ints(PROMPT), num_samples=1,
                                                     sampling_params=long).result())}


@pytest.mark.parametrize("world", [1, 2])
def test_served_samples_carry_the_training_clients_forward_logprobs(tmp_path, world):
    got = run_ranks(serve, world, str(tmp_path / "run"), _scenario, ARGS, timeout=600)[0]
    assert len(got["sampled"]) == 3 and all(len(s) == 6 for s in got["sampled"])
    assert got["sampled"] == got["forward"]  # exact: one Engine.forward over the same datums in the same order
    assert "train.micro_batch_tokens to at least 42" in got["too_long"] and "\n" not in got["too_long"].strip()
