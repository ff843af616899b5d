"""Supervised fine-tuning through the official Tinker SDK against `shardfit serve`.

What a Tinker user writes, with only base_url and api_key changed: Tinker-style datums (input tokens[:-1], target
tokens[1:], per-token weights 0 on the prompt and 1 on the completion), `forward_backward(..., "cross_entropy")`
and `optim_step` each step, then `save_weights_and_get_sampling_client` and samples from the trained weights.
The model is the embedded tiny one (random initial weights; byte tokenizer: ids 0-255 are UTF-8 bytes, 256 BOS,
257 EOS, in a vocabulary of 264), so the task is one it can learn in a minute: the capitals of a few countries.

    python examples/tinker_sft.py                      # starts `shardfit serve --model.name=tiny` on CPU
    python examples/tinker_sft.py --base-url http://127.0.0.1:8000
"""

from __future__ import annotations

import argparse
import random
import time

import numpy as np
import tinker
from local_server import common_args, local_server
from tinker import types

EOS = 257  # the byte tokenizer's end of sequence; the server stops sampling there (stop=None)
FACTS = [("France", "Paris"), ("Japan", "Tokyo"), ("Italy", "Rome"), ("Spain", "Madrid"), ("Egypt", "Cairo"),
         ("Peru", "Lima"), ("Kenya", "Nairobi"), ("Chile", "Santiago"), ("Norway", "Oslo"), ("Cuba", "Havana"),
         ("Greece", "Athens"), ("Poland", "Warsaw"), ("Canada", "Ottawa"), ("Ireland", "Dublin"),
         ("Austria", "Vienna"), ("Portugal", "Lisbon")]


def encode(text: str) -> list[int]:
    return list(text.encode("utf-8"))


def prompt_of(country: str) -> str:
    return f"Q: capital of {country}?\nA:"


def make_datum(prompt: str, completion: str) -> types.Datum:
    """The cookbook's shape: the model reads tokens[:-1] and is scored on tokens[1:], weight 1 on the completion."""
    p, c = encode(prompt), encode(completion) + [EOS]
    tokens = p + c
    weights = [0.0] * len(p) + [1.0] * len(c)
    return types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]),
                       loss_fn_inputs={"target_tokens": np.asarray(tokens[1:], dtype=np.int64),
                                       "weights": np.asarray(weights[1:], dtype=np.float32)})


def train(base_url: str, api_key: str, **kw) -> dict:
    """The whole run in one SDK session, finished when it ends (ServiceClient as a context manager)."""
    with tinker.ServiceClient(base_url=base_url, api_key=api_key) as service:
        return run(service, **kw)


def run(service, *, steps: int, batch: int, lr: float, seed: int, log=print) -> dict:
    """SFT for `steps` steps, then greedy answers for every country; returns the losses and the answers."""
    # rank=0: every parameter, what this example's server trains; rank=8 with `shardfit serve --lora.rank=8`
    client = service.create_lora_training_client(base_model="tiny", rank=0).result()
    data = [make_datum(prompt_of(country), " " + capital) for country, capital in FACTS]
    rng = random.Random(seed)
    losses = []
    t0 = time.perf_counter()
    for step in range(steps):
        chosen = rng.sample(data, batch)
        fb = client.forward_backward(chosen, "cross_entropy")
        opt = client.optim_step(types.AdamParams(learning_rate=lr))  # sent before fb is read: pipelined
        res = fb.result()
        opt.result()
        n = sum(float(d.loss_fn_inputs["weights"].to_numpy().sum()) for d in chosen)
        losses.append(res.metrics["loss:sum"] / n)  # mean loss per completion token
        if step % 5 == 0 or step == steps - 1:
            log(f"step {step:3d}  loss/token {losses[-1]:.3f}  ({time.perf_counter() - t0:.0f} s)")
    sampler = client.save_weights_and_get_sampling_client().result()
    futures = [sampler.sample(types.ModelInput.from_ints(encode(prompt_of(country))), num_samples=1,
                              sampling_params=types.SamplingParams(max_tokens=16, temperature=0.0, seed=seed))
               for country, _ in FACTS]
    answers = {}
    for (country, _), fut in zip(FACTS, futures):
        answers[country] = bytes(t for t in fut.result().sequences[0].tokens if t < 256).decode("utf-8", "replace")
    correct = sum(answers[c].strip() == capital for c, capital in FACTS)
    for country, _ in FACTS[:4]:
        log(f"{prompt_of(country)!r} -> {answers[country]!r}")
    log(f"{correct}/{len(FACTS)} capitals right after {steps} steps; loss/token {losses[0]:.2f} -> "
        f"{losses[-1]:.3f}; {time.perf_counter() - t0:.0f} s")
    return {"losses": losses, "answers": answers, "correct": correct, "seconds": time.perf_counter() - t0}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    common_args(parser)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--batch", type=int, default=16, help="examples per step")
    parser.add_argument("--lr", type=float, default=2e-3)
    a = parser.parse_args(argv)
    kw = dict(steps=a.steps, batch=a.batch, lr=a.lr, seed=a.seed)
    if a.base_url:
        return train(a.base_url, a.api_key, **kw)
    with local_server(["--model.name=tiny", "--train.device=cpu", f"--train.seed={a.seed}",
                       "--train.micro_batch_tokens=512", *a.server_arg]) as url:
        return train(url, a.api_key, **kw)


if __name__ == "__main__":
    main()
