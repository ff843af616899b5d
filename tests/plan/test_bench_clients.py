"""benchmarks/bench_clients.py (issue 35's many-clients and memory benchmarks): its plan figures are the ones `shardfit
plan --models N --versions K` prints for the same config, every client trains the same token counts and the SDK and
the in-process Engine get the same datums, and the summary is the arithmetic its docstring states."""

import subprocess
import sys
from argparse import Namespace
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import bench_clients as bc  # noqa: E402
import bench_clients_workers as bw  # noqa: E402
from rl_worker_setup import engine_overrides  # noqa: E402

GiB = 2**30


def test_plan_prediction_is_what_shardfit_plan_prints(tmp_path):
    from shardfit.config import load_config
    from shardfit.weights.peft_config import adapter_lora_fields

    a = Namespace(device="cpu", moe_layers=0, sf_extra="")
    overrides = engine_overrides(a, "tiny", 256, tmp_path / "run", lora=16)
    plan = bw.plan_prediction(load_config(None, overrides, adapter_lora_fields), versions=3, models=16)
    p = subprocess.run([sys.executable, "-m", "shardfit", "plan", *overrides, "--gpu-memory", "80", "--models", "16",
                        "--versions", "3"], capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr
    assert plan["gpu_gib"] == 80.0 and len(plan["lines"]) == 3  # models and versions, what fits, the one-pass cost
    for line in plan["lines"]:
        assert line in p.stdout, (line, p.stdout)
    assert f"models that fit this GPU with 3 version(s): {plan['models_fit']}" in p.stdout
    assert plan["model_bytes"] == 4 * plan["version_bytes"] > 0  # fp32 values, gradients, two moments / values


def test_every_client_trains_the_same_tokens_and_both_sides_get_the_same_datums():
    lengths = bw.datum_lengths(16, 896, 1024)
    assert len(lengths) == 16 and all(896 <= n <= 1024 for n in lengths)
    assert bw.datum_lengths(16, 896, 1024) == lengths  # every worker, every client
    a, b = bw.step_data(0, lengths, 3000), bw.step_data(1, lengths, 3000)
    assert [len(d["tokens"]) for d in a] == [len(d["tokens"]) for d in b] == lengths
    assert not np.array_equal(a[0]["tokens"], b[0]["tokens"])  # each client its own tokens
    d = a[3]
    prompt = lengths[3] // 4
    assert np.array_equal(d["tokens"][1:], d["target_tokens"][:-1])  # next-token targets
    assert not d["advantages"][:prompt].any() and not d["logprobs"][:prompt].any()
    assert len(set(d["advantages"][prompt:].tolist())) == 1 and d["advantages"][prompt] != 0
    engine, sdk = bw.to_engine(a), bw.to_sdk(a)
    for x, e, s in zip(a, engine, sdk):
        assert np.array_equal(e.tokens, x["tokens"]) and s.model_input.to_ints() == x["tokens"].tolist()
        assert set(e.inputs) == set(s.loss_fn_inputs) == {"target_tokens", "logprobs", "advantages"}
        for k in e.inputs:
            assert np.array_equal(e.inputs[k], x[k]) and np.array_equal(s.loss_fn_inputs[k].to_numpy(), x[k])


def _clients(n, mode, tok_s, step_s=1.0):
    return {"rlbench": "clients", "clients": n, "mode": mode, "tok_s": tok_s, "step_s": step_s, "steps": 16,
            "wall_s": 1.0, "server_busy": 0.9}


def test_summary_is_the_docstrings_arithmetic():
    plan = {"rlbench": "plan", "model_bytes": GiB, "version_bytes": GiB // 4, "peak_bytes": 20 * GiB,
            "models_fit": 50, "gpu_gib": 79.1}
    rows = [{"part": "clients", "system": "sdk", "lines": [
                _clients(1, "concurrent", 1000, step_s=2.06), _clients(4, "concurrent", 990),
                _clients(16, "concurrent", 950), _clients(16, "sequential", 800)]},
            {"part": "memory", "system": "shardfit", "lines": [
                plan, {"rlbench": "inproc", "step_s": 2.0},
                {"rlbench": "model", "models": 2, "peak_alloc_GiB": 21.0},
                {"rlbench": "version", "delta": GiB // 4 + 2**20, "on_device": True},
                {"rlbench": "version", "delta": 0, "on_device": False},  # on the host: not the device's cost
                {"rlbench": "model", "models": 54, "peak_alloc_GiB": 74.0},
                {"rlbench": "fit", "measured": 54, "stopped": "oom", "predicted": 50, "versions": 1,
                 "model_deltas": [GiB, GiB + 2**21, GiB - 2**20]}]}]
    S = bc.summarize(rows)
    assert S["multi_client_aggregate"] == {"1": 1000, "4": 990, "16": 950, "sequential16": 800}
    assert S["multi_client_vs_one"] == {"4": 0.99, "16": 0.95, "sequential16": 0.8}
    assert S["model_gib"] == 1.0 and S["plan_ratio"]["model"] == 1.0
    assert S["version_gib"] == 0.251 and S["plan_ratio"]["version"] == round((GiB // 4 + 2**20) / (GiB // 4), 4)
    assert S["models_fit"]["predicted"] == 50 and S["models_fit"]["measured"] == 54
    assert S["models_fit"]["stopped"] == "oom"
    # the last model's pass: 20 GiB peak + 53 more models + 1 version = 73.25 GiB planned
    assert S["peak_vs_plan"] == {"models": 54, "measured_gib": 74.0, "plan_gib": 73.25, "ratio": round(74 / 73.25, 4)}
    assert S["sdk_vs_inprocess"] == 1.03


def test_summary_of_a_run_cut_short_keeps_what_it_has():
    rows = [{"part": "clients", "label": "clients", "skipped": "budget (10 s left)"},
            {"part": "memory", "system": "shardfit", "lines": [{"rlbench": "inproc", "step_s": 2.0}]}]
    assert bc.summarize(rows) == {}


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"  # a zombie has ended (its parent, killed, cannot reap it)


# a stand-in server: a child of its own (as a server's compile workers), its "listening on" line, then the child's pid
FAKE = ("import subprocess, sys, time; c = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)']); "
        "print('shardfit serve: listening on http://127.0.0.1:9', flush=True); print(c.pid, flush=True); "
        "time.sleep(120)")


def test_the_server_and_its_children_end_with_the_block_even_on_an_error(tmp_path):
    from serve_process import running_server

    srv = None
    try:
        with running_server([sys.executable, "-c", FAKE], 60, tmp_path, {}) as srv:
            assert srv.url == "http://127.0.0.1:9" and not srv.error
            while len(srv.log) < 2:
                __import__("time").sleep(0.1)
            child = int(srv.log[1])
            assert _alive(child)
            raise KeyboardInterrupt  # what SIGTERM's SystemExit does to the benchmark: the block is left
    except KeyboardInterrupt:
        pass
    assert not _alive(child)
    assert "listening on" in srv.log_tail()


def test_a_server_that_never_listens_is_an_error_line(tmp_path):
    from serve_process import running_server

    with running_server([sys.executable, "-c", "print('starting', flush=True); raise SystemExit(3)"], 60, tmp_path,
                        {}) as srv:
        assert srv.url == ""
    assert srv.error.startswith("no 'listening on' line: ") and "starting" in srv.error


def test_an_oom_ends_the_count_and_nothing_else_does():
    import torch

    from shardfit.engine.records import OutOfMemory

    assert bw.is_oom(OutOfMemory("rank 0 ran out of GPU memory in step 3", where="step 3", fix="lower it"))
    assert bw.is_oom(torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"))
    assert bw.is_oom(RuntimeError("CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling cublasCreate(handle)"))
    assert not bw.is_oom(ValueError("datum 0 has 5,000 tokens, more than the engine's micro-batch"))
    assert not bw.is_oom(KeyboardInterrupt())
