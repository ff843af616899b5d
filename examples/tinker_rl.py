"""Reinforcement learning with a verifiable reward through the official Tinker SDK against `shardfit serve`.

The task: small additions ("3+4=" -> "7", operands 0..--max-operand), reward 1 when the completion is exactly the sum
followed by EOS, else 0. The embedded tiny model starts from random weights, so a short supervised warm-up teaches it
the format first (and about a third of the sums); then each step:
  1. sample --samples completions of each of --prompts problems from the current weights (SamplingClient.sample,
     temperature 1, with the sampler's per-token log-probs);
  2. group-normalised advantages: A = (r - mean(group)) / (std(group) + 1e-6), the same for every token of a sample;
     groups whose samples all score alike carry no signal and are left out;
  3. forward_backward with importance_sampling (or ppo) on Tinker-shaped datums: the prompt's positions hold
     log-prob 0 and advantage 0, the sampled tokens the sampler's log-probs and the sample's advantage;
  4. optim_step, then save_weights_and_get_sampling_client(kind="inflight") for the next step's rollouts.
The server reports the sampler/trainer log-prob gap of every step (sampler_logprob_gap:mean, sampler_kl:mean): near
0 when the sampler runs the trained weights, as here; a broken weight sync shows as a jump.

    python examples/tinker_rl.py                       # starts `shardfit serve --model.name=tiny` on CPU
    python examples/tinker_rl.py --base-url http://127.0.0.1:8000 --loss ppo
"""

from __future__ import annotations

import argparse
import random
import time

import numpy as np
import tinker
from local_server import common_args, local_server
from tinker import types
from tinker_sft import EOS, encode, make_datum


def problems(max_operand: int) -> list[tuple[str, str]]:
    return [(f"{a}+{b}=", str(a + b)) for a in range(max_operand + 1) for b in range(max_operand + 1)]


def reward(tokens: list[int], answer: str) -> float:
    return float(list(tokens) == encode(answer) + [EOS])


def rl_datum(prompt: list[int], seq, advantage: float) -> types.Datum:
    """tokens = prompt + sample; position t scores tokens[t + 1]. The prompt's positions are placeholders."""
    tokens = prompt + list(seq.tokens)
    n_prompt = len(prompt) - 1
    return types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]),
                       loss_fn_inputs={"target_tokens": np.asarray(tokens[1:], dtype=np.int64),
                                       "logprobs": np.asarray([0.0] * n_prompt + list(seq.logprobs), np.float32),
                                       "advantages": np.asarray([0.0] * n_prompt + [advantage] * len(seq.tokens),
                                                                np.float32)})


def rollouts(sampler, chosen: list[tuple[str, str]], samples: int, seed: int) -> list:
    """Every problem's group of samples; all requests are sent before any is read."""
    futures = [sampler.sample(types.ModelInput.from_ints(encode(p)), num_samples=samples,
                              sampling_params=types.SamplingParams(max_tokens=4, temperature=1.0, seed=seed + i))
               for i, (p, _) in enumerate(chosen)]
    return [f.result().sequences for f in futures]


def evaluate(sampler, probs: list[tuple[str, str]], seed: int) -> float:
    """Mean reward of 4 samples (temperature 1) of every problem."""
    groups = rollouts(sampler, probs, 4, seed)
    return float(np.mean([reward(s.tokens, a) for (_, a), g in zip(probs, groups) for s in g]))


def train(base_url: str, api_key: str, **kw) -> dict:
    """The whole run in one SDK session, finished when it ends (ServiceClient as a context manager)."""
    with tinker.ServiceClient(base_url=base_url, api_key=api_key) as service:
        return run(service, **kw)


def run(service, *, warmup_steps: int, warmup_lr: float, steps: int, lr: float, prompts: int, samples: int, loss: str,
        max_operand: int, seed: int, log=print) -> dict:
    # rank=0: every parameter, what this example's server trains; rank=8 with `shardfit serve --lora.rank=8`
    client = service.create_lora_training_client(base_model="tiny", rank=0).result()
    probs = problems(max_operand)
    rng = random.Random(seed)
    t0 = time.perf_counter()
    # supervised warm-up: the format (digits, then EOS) and some of the sums
    warm = [make_datum(p, a) for p, a in probs]
    pending = []
    for _ in range(warmup_steps):  # sent back to back: the server runs them in order
        pending.append(client.forward_backward(rng.sample(warm, min(32, len(warm))), "cross_entropy"))
        pending.append(client.optim_step(types.AdamParams(learning_rate=warmup_lr)))
    for f in pending:
        f.result()
    # kind="inflight": the model's live weights, which synchronous RL samples (each rollout before the next step);
    # a snapshot per step would hold a frozen version per step (without LoRA a copy of every weight, up to
    # --serve.versions) until the session ends
    sampler = client.save_weights_and_get_sampling_client(kind="inflight").result()
    before = evaluate(sampler, probs, seed=seed * 7919 + 10**6)
    log(f"after {warmup_steps} warm-up steps: mean reward {before:.3f} ({time.perf_counter() - t0:.0f} s)")
    history = []
    for step in range(steps):
        chosen = rng.sample(probs, min(prompts, len(probs)))
        groups = rollouts(sampler, chosen, samples, seed=seed * 7919 + 1000 * step)
        rewards, data = [], []
        for (p, a), seqs in zip(chosen, groups):
            r = np.array([reward(s.tokens, a) for s in seqs])
            rewards.extend(r)
            if r.std() == 0:
                continue  # every sample scored alike: no advantage to learn from
            adv = (r - r.mean()) / (r.std() + 1e-6)
            data += [rl_datum(encode(p), s, float(A)) for s, A in zip(seqs, adv)]
        row = {"step": step, "reward": float(np.mean(rewards)), "datums": len(data)}
        if data:
            fb = client.forward_backward(data, loss)
            opt = client.optim_step(types.AdamParams(learning_rate=lr))
            m = fb.result().metrics
            opt.result()
            row.update(gap=m["sampler_logprob_gap:mean"], gap_max=m["sampler_logprob_gap:max"],
                       kl=m["sampler_kl:mean"])
            sampler = client.save_weights_and_get_sampling_client(kind="inflight").result()  # the new weights
        history.append(row)
        gap = f"  gap {row['gap']:.1e} (max {row['gap_max']:.1e}) kl {row['kl']:.1e}" if data else ""
        log(f"step {step:3d}  reward {row['reward']:.3f}  datums {len(data):3d}{gap}  "
            f"({time.perf_counter() - t0:.0f} s)")
    after = evaluate(sampler, probs, seed=seed * 7919 + 10**6)
    seconds = time.perf_counter() - t0
    log(f"mean reward over all {len(probs)} problems: {before:.3f} after warm-up -> {after:.3f} after {steps} RL "
        f"steps ({seconds:.0f} s)")
    return {"before": before, "after": after, "history": history, "seconds": seconds}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    common_args(parser)
    parser.add_argument("--warmup-steps", type=int, default=20, help="supervised steps before RL")
    parser.add_argument("--warmup-lr", type=float, default=2e-3)
    parser.add_argument("--steps", type=int, default=40, help="RL steps")
    parser.add_argument("--lr", type=float, default=3e-4)
    parser.add_argument("--prompts", type=int, default=16, help="problems per RL step")
    parser.add_argument("--samples", type=int, default=8, help="samples per problem (the group)")
    parser.add_argument("--loss", default="importance_sampling", choices=("importance_sampling", "ppo"))
    parser.add_argument("--max-operand", type=int, default=4, help="operands 0..N")
    a = parser.parse_args(argv)
    kw = dict(warmup_steps=a.warmup_steps, warmup_lr=a.warmup_lr, steps=a.steps, lr=a.lr, prompts=a.prompts,
              samples=a.samples, loss=a.loss, max_operand=a.max_operand, seed=a.seed)
    if a.base_url:
        return train(a.base_url, a.api_key, **kw)
    with local_server(["--model.name=tiny", "--train.device=cpu", f"--train.seed={a.seed}",
                       "--train.micro_batch_tokens=512", *a.server_arg]) as url:
        return train(url, a.api_key, **kw)


if __name__ == "__main__":
    main()
