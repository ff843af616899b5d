"""`shardfit serve` on the real Engine for the tests of models and versions (test_models.py, test_full_versions.py):
the Engine on every gloo rank, the server and a scenario driven through the official tinker SDK on rank 0 (CPU,
loopback), and the small steps and probes those scenarios share.
"""

from __future__ import annotations

import os
import threading

import numpy as np

SEQ = list(b"hello shardfit models")  # what every sampler scores


def serve(rank: int, world: int, run_dir: str, scenario, args: list[str]):
    """The Engine on every rank (and the frozen extra models of --serve.models), the server on rank 0 running
    `scenario(service_client, url, base_model)`; its result."""
    os.environ["TINKER_TELEMETRY"] = "0"
    import tinker

    from shardfit.config import load_config
    from shardfit.engine import Engine
    from shardfit.serve.served import start_served
    from shardfit.serve.server import follower, start_rank0

    cfg = load_config(None, [*args, f"--logging.run_dir={run_dir}"])
    engine = Engine.start(cfg)
    served = start_served(cfg, Engine.start)
    if rank != 0:
        follower(engine, served).run()
        return None
    serving = start_rank0(cfg, engine, port=0, poll_s=2.0, served=served)
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


def datums(seed: int, n: int = 2):
    from tinker import types

    rng = np.random.default_rng(seed)
    out = []
    for L in rng.integers(8, 16, n):
        t = rng.integers(0, 256, L + 1)
        out.append(types.Datum(model_input=types.ModelInput.from_ints(t[:-1].tolist()),
                               loss_fn_inputs={"target_tokens": t[1:].astype(np.int64),
                                               "weights": np.ones(L, np.float32)}))
    return out


def dpo_pairs():
    """Two preference pairs as tinker-cookbook's DPO lays them out: (seqs, datums), chosen then rejected of each pair
    interleaved; each datum the sequence shifted by one, weighted on its answer tokens alone."""
    from tinker import types

    prompt = list(b"Q: the capital of France? A:")
    pairs = [(prompt + list(b" Paris"), prompt + list(b" Rome")), (prompt + list(b" Paris."), prompt + list(b" Lyon"))]
    seqs = [s for pair in pairs for s in pair]
    answer = [np.asarray([0.0] * (len(prompt) - 1) + [1.0] * (len(s) - len(prompt)), np.float32) for s in seqs]
    return seqs, [types.Datum(model_input=types.ModelInput.from_ints(s[:-1]),
                              loss_fn_inputs={"target_tokens": np.asarray(s[1:], np.int64), "weights": w})
                  for s, w in zip(seqs, answer)]


def steps(tc, seeds, lr: float = 2e-2) -> list[float]:
    """A forward_backward and an optim_step per seed; the losses."""
    from tinker import types

    losses = []
    for s in seeds:
        fb = tc.forward_backward(datums(s), "cross_entropy")
        tc.optim_step(types.AdamParams(learning_rate=lr)).result()
        losses.append(fb.result().metrics["loss:sum"])
    return losses


def logprobs(tc) -> list[float]:
    """The training client's log-probs of a fixed datum (its forward)."""
    return tc.forward(datums(99), "cross_entropy").result().loss_fn_outputs[0]["logprobs"].to_numpy().tolist()


def scored(sampler, seq: list[int] = SEQ) -> list[float]:
    """A sampling client's log-probs of `seq` (compute_logprobs), the first token's None dropped."""
    from tinker import types

    return sampler.compute_logprobs(types.ModelInput.from_ints(seq)).result()[1:]


def error(call) -> str:
    """The message `call()` raised, or "no error"."""
    try:
        call()
    except Exception as e:  # noqa: BLE001 - the message is the assertion
        return str(e)
    return "no error"


def restarted(sc, url: str, base_model: str, sampler_path: str, state_path: str | None = None, seed: int = 0,
              lr: float = 2e-2) -> dict:
    """A scenario for a server restarted on the run directory of one that saved: the log-probs of a sampler of
    `sampler_path` (`from_path`), the checkpoints listed (`listed`), and with `state_path` one step of
    create_training_client_from_state_with_optimizer(state_path) on datums(seed) (`resumed`: its loss) and its
    log-probs after it (`resumed_lp`)."""
    import tinker

    listed = tinker.RestClient(base_url=url, api_key="tml-local").list_user_checkpoints().result().checkpoints
    out = {"from_path": scored(sc.create_sampling_client(model_path=sampler_path).result()),
           "listed": [c.tinker_path for c in listed]}
    if state_path is not None:
        tc = sc.create_training_client_from_state_with_optimizer(state_path).result()
        out["resumed"], out["resumed_lp"] = steps(tc, [seed], lr), logprobs(tc)
    return out
