"""The worker processes of benchmarks/bench_clients.py (issue 35): each prints JSON lines {"rlbench": KIND, ...}
(rl_worker_setup.emit).

  clients  concurrent training clients through the official tinker SDK against a running `shardfit serve`: every
           client its own LoRA model (create_lora_training_client), one step each and one round of all of them
           at once as a warm-up (the pass of several models compiles once), then 1, 4, 16, ...
           clients in threads (the same total of steps: --total-steps), then the 16 models one after another
  memory   shardfit's Engine in this process, the server's config: the cookbook step timed (the in-process side of
           the SDK-against-in-process figure), then models and frozen versions added one by one, the device's
           allocated bytes read after each, against the plan's prediction (plan/models.py), until an OOM, the
           plan's count + --fit-extra, or the deadline

A step is what a tinker-cookbook RL loop sends: forward_backward with the importance_sampling loss over --datums
datums of ~1k tokens (a quarter prompt, advantage 0 and sampler log-prob 0 there; the response's sampler log-probs
-log V + N(0, 0.1), one advantage a datum), then optim_step; the SDK sends both before reading the first result.
Every client's datums have the same lengths (its own tokens), so each configuration trains the same tokens.
"""

from __future__ import annotations

import math
import shutil
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from rl_worker_setup import ADAM, _cuda, emit, engine_overrides, timed, vocab_of  # noqa: E402

LOSS = "importance_sampling"  # the cookbook's RL loss (Tinker's definition, rl/losses.py)


# ---------------------------------------------------------------------------------------------- the data
def datum_lengths(n: int, lo: int, hi: int) -> list[int]:
    """The n datums' token counts (model input), the same for every client: uniform in [lo, hi] from seed 0."""
    return np.random.default_rng(0).integers(lo, hi + 1, n).tolist()


def step_data(seed: int, lengths: list[int], vocab: int) -> list[dict]:
    """One client's datums as numpy arrays: tokens [L] and the loss inputs target_tokens, logprobs, advantages [L]
    (the cookbook's keys; zero on the prompt, the first quarter)."""
    g = np.random.default_rng(1000 + seed)
    out = []
    for L in lengths:
        ids = g.integers(0, vocab, L + 1)
        prompt = L // 4
        lp, adv = np.zeros(L, np.float32), np.zeros(L, np.float32)
        lp[prompt:] = -math.log(vocab) + 0.1 * g.standard_normal(L - prompt)
        adv[prompt:] = g.standard_normal()
        out.append({"tokens": ids[:-1], "target_tokens": ids[1:], "logprobs": lp, "advantages": adv})
    return out


def to_engine(data: list[dict]) -> list:
    from shardfit.rl import make_datum

    return [make_datum(d["tokens"], **{k: v for k, v in d.items() if k != "tokens"}) for d in data]


def to_sdk(data: list[dict]) -> list:
    from tinker import types

    return [types.Datum(model_input=types.ModelInput.from_ints(d["tokens"].tolist()),
                        loss_fn_inputs={k: v.astype(np.int64 if k == "target_tokens" else np.float32)
                                        for k, v in d.items() if k != "tokens"}) for d in data]


# ---------------------------------------------------------------------------------------------- clients
def _server_s(fb, op) -> tuple[float, int, float]:
    """The server's own time of one step (its forward_backward compute and optimizer seconds: serve/executor.py), the
    number of models its pass held (server_pass_models), and the pass's compute seconds alone."""
    compute = fb.metrics.get("server_compute_s:sum", 0.0)
    return (compute + op.metrics.get("server_optimizer_s:sum", 0.0), int(fb.metrics.get("server_pass_models:max", 1)),
            compute)


def run_concurrent(step, ids: list[int], steps: int, tokens: int) -> dict:
    """Each client of `ids` in a thread of its own, `steps` steps each, started together: the aggregate."""
    barrier = threading.Barrier(len(ids) + 1)
    ends: dict[int, list[float]] = {i: [] for i in ids}
    busy: list[tuple[float, int, float]] = []
    errors: list[str] = []

    def client(i: int) -> None:
        barrier.wait()
        try:
            for _ in range(steps):
                busy.append(_server_s(*step(i)))
                ends[i].append(time.perf_counter())
        except Exception as e:  # noqa: BLE001 (re-raised in the main thread)
            errors.append(f"client {i}: {type(e).__name__}: {str(e)[:300]}")

    threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in ids]
    for t in threads:
        t.start()
    barrier.wait()
    t0 = time.perf_counter()
    for t in threads:
        t.join()
    if errors:
        raise RuntimeError(errors[0])
    wall = max(max(e) for e in ends.values()) - t0
    gaps = [b - a for i in ids for a, b in zip([t0, *ends[i][:-1]], ends[i])]  # each client's step intervals
    return _figures(len(ids) * steps, tokens, wall, gaps, busy)


def run_sequential(step, ids: list[int], steps: int, tokens: int) -> dict:
    """The models of `ids` one after another in this thread, `steps` steps each (one client at a time)."""
    t0 = last = time.perf_counter()
    gaps, busy = [], []
    for i in ids:
        for _ in range(steps):
            busy.append(_server_s(*step(i)))
            now = time.perf_counter()
            gaps.append(now - last)
            last = now
    return _figures(len(ids) * steps, tokens, last - t0, gaps, busy)


def _figures(n_steps: int, tokens: int, wall: float, gaps: list[float], busy: list[tuple[float, int, float]]) -> dict:
    """passes: {models in the pass: steps that ran in such a pass}; pass_s: the longest and the median pass compute
    seconds (a compile shows as the longest: the warm-up round should have taken it)."""
    passes: dict[str, int] = {}
    for _, k, _ in busy:
        passes[str(k)] = passes.get(str(k), 0) + 1
    compute = [c for _, _, c in busy]
    return dict(steps=n_steps, tokens=n_steps * tokens, wall_s=round(wall, 3),
                tok_s=round(n_steps * tokens / wall), step_s=round(statistics.median(gaps), 3),
                server_busy=round(sum(b for b, _, _ in busy) / wall, 3), passes=passes,
                pass_s=[round(max(compute), 3), round(statistics.median(compute), 3)])


def worker_clients(a) -> int:
    """--clients counts (e.g. 1,4,16) of concurrent SDK training clients, then sequential: JSON lines "clients"."""
    import tinker
    from tinker import types

    counts = [int(x) for x in a.clients.split(",") if x]
    n = max(counts)
    lengths = datum_lengths(a.datums, a.datum_min, a.datum_max)
    tokens = sum(lengths)
    t = time.perf_counter()
    service = tinker.ServiceClient(base_url=a.url, api_key="tml-local")
    # a LoRA server answers only a client asking its own rank; base_model: the server's model.name (the dense
    # shapes set every size over the default, tiny)
    clients = [service.create_lora_training_client(base_model="tiny", rank=a.lora) for _ in range(n)]
    clients = [c if isinstance(c, tinker.TrainingClient) else c.result() for c in clients]  # 0.38: futures
    emit("created", clients=n, s=round(time.perf_counter() - t, 2))
    data = [to_sdk(step_data(i, lengths, vocab_of(a.shape))) for i in range(n)]
    adam = types.AdamParams(**ADAM)

    def step(i: int):
        fb = clients[i].forward_backward(data[i], LOSS)
        op = clients[i].optim_step(adam)  # pipelined: sent before the first result is read, as an RL loop does
        return fb.result(), op.result()

    t = time.perf_counter()
    step(0)  # the first pass compiles
    first = time.perf_counter() - t
    for i in range(1, n):  # every model its first step (its optimizer state) before any clock
        step(i)
    alone = time.perf_counter() - t
    # one round of every client at once: the first pass of several models compiles its graph (one for every K:
    # adapters/lora_stack.py), as a served run does once; session 23's figures timed it inside the 4-client round
    run_concurrent(step, list(range(n)), 1, tokens)
    emit("warm", first_s=round(first, 1), all_s=round(alone, 1), many_s=round(time.perf_counter() - t - alone, 1),
         tokens_per_step=tokens, datums=len(lengths))
    for k in counts:
        if a.total_steps % k:
            raise SystemExit(f"--total-steps {a.total_steps} is not a multiple of {k} clients")
        emit("clients", clients=k, mode="concurrent", **run_concurrent(step, list(range(k)), a.total_steps // k,
                                                                       tokens))
    emit("clients", clients=n, mode="sequential",
         **run_sequential(step, list(range(n)), a.total_steps // n, tokens))
    return 0


# ---------------------------------------------------------------------------------------------- memory
def plan_prediction(cfg, versions: int, models: int) -> dict:
    """`shardfit plan --models M --versions K`'s figures for the Engine's own config on this GPU (cli/plan.py's
    calls: the configured run's peak, the allocation budget, plan/models.py's costs and count)."""
    import torch

    from shardfit.plan.estimate import allocation_budget
    from shardfit.plan.models import models_cost, models_lines, models_that_fit
    from shardfit.plan.table import configured

    gpu_gib = torch.cuda.get_device_properties(0).total_memory / 2**30 if torch.cuda.is_available() else 80.0
    gpu_gib *= cfg.memory.max_fraction or 1.0
    e, fits = configured(cfg, 1, gpu_gib)
    budget = allocation_budget(gpu_gib * 2**30)
    cost = models_cost(cfg, 1, models, versions)
    return dict(gpu_gib=round(gpu_gib, 2), peak_bytes=e.peak, budget_bytes=int(budget), fits=fits,
                model_bytes=cost.model_bytes, version_bytes=cost.version_bytes,
                models_fit=models_that_fit(cost, e.peak, budget),
                lines=models_lines(cfg, 1, models, versions, e.peak, budget))


def is_oom(e: BaseException) -> bool:
    """The Engine's OutOfMemory (a pass), torch's (an adapter's allocation), or a library's failed allocation
    (cuBLAS's workspace: a RuntimeError)."""
    import torch

    from shardfit.engine.records import OutOfMemory

    text = str(e).lower()
    return (isinstance(e, (torch.cuda.OutOfMemoryError, OutOfMemory)) or "out of memory" in text
            or "alloc_failed" in text)


def worker_memory(a) -> int:
    """The Engine in process: the step timed, then models and versions added with the allocated bytes after each."""
    import torch

    from shardfit.parallel.compile_watch import fallback_count
    from shardfit.rl import AdamParams, DatumEngine

    deadline = time.time() + a.deadline
    sync, reset, peaks = _cuda()
    on = torch.cuda.is_available()
    tmp = Path(tempfile.mkdtemp(prefix="clientbench-"))
    t = time.perf_counter()
    overrides = engine_overrides(a, a.shape, a.micro_batch_tokens, tmp / "run", lora=a.lora)
    e = DatumEngine.start(overrides=overrides)
    sync()
    emit("engine", shape=a.shape, lora=a.lora, params=e.n_params, build_s=round(time.perf_counter() - t, 1),
         overrides=overrides)
    plan = plan_prediction(e.cfg, a.versions, max(int(x) for x in a.clients.split(",")))
    emit("plan", **plan)
    lengths = datum_lengths(a.datums, a.datum_min, a.datum_max)
    data = to_engine(step_data(0, lengths, vocab_of(a.shape)))  # client 0's step, token for token
    adam = AdamParams(**ADAM)

    def step():
        e.forward_backward(data, LOSS)
        e.optim_step(adam)

    _, warm_s, times = timed(step, step, a.reps, sync, reset)
    s = statistics.median(times)
    emit("inproc", step_s=round(s, 3), times_s=[round(x, 3) for x in times], tok_s=round(sum(lengths) / s),
         warm_s=round(warm_s, 1), tokens_per_step=sum(lengths), compile_fallbacks=fallback_count(), **peaks())
    # a model's state as the plan counts it: its adapters, gradients (kept allocated: memory.keep_grads) and Adam's
    # two moments, after one pass of a [1, T] row (one short datum: the row is padded to T, so each pass reaches
    # the configured micro-batch's activation peak) and one optimizer step
    small = to_engine(step_data(1, [min(lengths)], vocab_of(a.shape)))
    alloc = (lambda: (sync(), torch.cuda.memory_allocated())[1]) if on else (lambda: None)
    held = len(e.models.models)  # the configured run's model ("default"), stepped above
    before, k = alloc(), 0
    deltas: list[int] = []
    cap = a.max_models or plan["models_fit"] + a.fit_extra
    stop, frozen = "cap", 0
    while held < cap:
        if time.time() > deadline:
            stop = "deadline"
            break
        k += 1
        t = time.perf_counter()
        reset()
        try:
            e.add_model(f"m{k}", seed=k)
            e.forward_backward(small, LOSS, model=f"m{k}")
            e.optim_step(adam, model=f"m{k}")
            now = alloc()
        except BaseException as ex:  # noqa: BLE001 (an OOM ends the count; anything else is re-raised)
            if not is_oom(ex):
                raise
            stop = "oom"
            emit("oom", models=held + 1, error=str(ex).splitlines()[0][:300])
            break
        held += 1
        if now is not None and before is not None:
            deltas.append(now - before)
        before = now
        emit("model", models=held, alloc=now, s=round(time.perf_counter() - t, 2), **peaks())
        if held == 1 + a.measure_models and frozen < a.versions:  # the versions, once a few model deltas are in
            for j in range(a.versions):
                vid = e.freeze(f"m{k}")
                now = alloc()
                emit("version", versions=j + 1, id=vid, alloc=now, on_device=e.models.versions[vid].on_device,
                     delta=None if before is None else now - before)
                before = now
            frozen = a.versions
    emit("fit", measured=held, stopped=stop, predicted=plan["models_fit"], versions=frozen, model_deltas=deltas,
         compile_fallbacks=fallback_count())  # functions run eager past recompile_limit: any, and figures are off
    shutil.rmtree(tmp, ignore_errors=True)
    return 0


WORKERS = {"clients": worker_clients, "memory": worker_memory}
