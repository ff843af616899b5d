"""What each fault costs a client of `shardfit serve`: the wall time from sending a bad (or unlucky) request to its
answer, on the real Engine (one process, the tiny model on the CPU), against a good request's time. The fault table
of docs/reliability.md quotes it.

  PYTHONPATH=src python benchmarks/bench_serve_faults.py [--repeat 20] [--out faults.json]

The full-disk row needs a small tmpfs (root, mount allowed) for the run directory; elsewhere it is left out.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
import numpy as np
from tinker import types
from tinker.proto.request_conv import forward_backward_request_to_proto

from shardfit.config import load_config
from shardfit.engine import Engine
from shardfit.serve.server import start_rank0

KEY = {"X-API-Key": "tml-bench"}


def _fb(model_id: str, seq: int, config=None, **inputs) -> bytes:
    t = list(b"what a fault costs the client")
    d = types.Datum(model_input=types.ModelInput.from_ints(t[:-1]),
                    loss_fn_inputs={"target_tokens": np.asarray(t[1:], np.int64), **inputs})
    req = types.ForwardBackwardRequest(forward_backward_input=types.ForwardBackwardInput(
        data=[d], loss_fn="cross_entropy", loss_fn_config=config), model_id=model_id, seq_id=seq)
    return forward_backward_request_to_proto(req).SerializeToString()


def _result(http: httpx.Client, rid: str) -> httpx.Response:
    while True:
        r = http.post("/retrieve_future", json={"request_id": rid}, headers=KEY)
        if r.headers["content-type"].startswith("application/x-protobuf") or r.json().get("type") != "try_again":
            return r


def _mount(path: Path, size: str) -> bool:
    path.mkdir(parents=True, exist_ok=True)
    return subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
                          capture_output=True).returncode == 0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeat", type=int, default=20)
    ap.add_argument("--out")
    a = ap.parse_args()
    root = Path(tempfile.mkdtemp(prefix="serve-faults-"))
    tmpfs = _mount(root / "run", "256m")
    cfg = load_config(None, [f"--logging.run_dir={root / 'run'}", "--train.device=cpu", "--model.max_seq_len=128",
                             "--data.seq_len=128"])
    serving = start_rank0(cfg, Engine.start(cfg), port=0, max_body=8 << 20)
    threading.Thread(target=serving.loop.run, daemon=True).start()
    http = httpx.Client(base_url=serving.url + "/api/v1", timeout=120)
    sid = http.post("/create_session", json={}, headers=KEY).json()["session_id"]
    m = http.post("/create_model", headers=KEY, json={"session_id": sid, "model_seq_id": 0,
                                                      "base_model": "tiny"}).json()["model_id"]
    seq = iter(range(1, 1 << 30))
    proto = {**KEY, "Content-Type": "application/x-protobuf"}

    def forward():
        return _result(http, http.post("/forward_backward", content=_fb(m, next(seq)), headers=proto).json()[
            "request_id"])

    def optim():
        return _result(http, http.post("/optim_step", headers=KEY, json={"model_id": m, "seq_id": next(seq),
                                                                           "adam_params": {}}).json()["request_id"])

    csr = types.TensorData(data=[1.0], dtype="float32", shape=[28, 1 << 28],
                           sparse_crow_indices=[0, 1] + [1] * 27, sparse_col_indices=[0])
    cases = {
        "a good forward_backward (the yardstick)": forward,
        "a good optim_step": optim,
        "JSON nested 200,000 deep": lambda: http.post("/optim_step", headers=KEY, content=b"[" * 200000 +
                                                      b"]" * 200000),
        "a prompt chunk of the wrong JSON type": lambda: http.post("/asample", headers=KEY, json={
            "base_model": "tiny", "prompt": {"chunks": [[1, 2]]}, "sampling_params": {}}),
        "a request id never issued to this key": lambda: http.post("/retrieve_future", headers=KEY,
                                                                   json={"request_id": "req-1"}),
        "CSR declaring [28, 2^28] floats (1 TiB dense)": lambda: http.post(
            "/forward_backward", headers=proto, content=_fb(m, next(seq), topk=csr)),
        "a loss_fn_config option of the wrong kind": lambda: http.post(
            "/forward_backward", headers=proto, content=_fb(m, next(seq), config={"kl_coef": "high"})),
        "a 9 MiB body sent chunked (limit 8 MiB)": lambda: http.post(
            "/forward_backward", headers=proto, content=iter([b"x" * (1 << 20)] * 9)),
    }
    rows = {}
    for name, send in cases.items():
        times, status = [], None
        for _ in range(a.repeat):
            t0 = time.perf_counter()
            status = send().status_code
            times.append(time.perf_counter() - t0)
        rows[name] = {"status": status, "median_ms": round(1e3 * statistics.median(times), 2)}
    # a skipped step's infinite gradient norm: the answer carries it
    t = list(b"an overflowing step")
    d = types.Datum(model_input=types.ModelInput.from_ints(t[:-1]), loss_fn_inputs={
        "target_tokens": np.asarray(t[1:], np.int64), "weights": np.full(len(t) - 1, 1e30, np.float32)})
    req = types.ForwardBackwardRequest(forward_backward_input=types.ForwardBackwardInput(
        data=[d], loss_fn="cross_entropy"), model_id=m, seq_id=next(seq))
    _result(http, http.post("/forward_backward", content=forward_backward_request_to_proto(req).SerializeToString(),
                            headers=proto).json()["request_id"])
    t0 = time.perf_counter()
    r = optim()
    rows["a skipped step's infinite gradient norm"] = {"status": r.status_code, "answer": r.json()["metrics"][
        "grad_norm:mean"], "median_ms": round(1e3 * (time.perf_counter() - t0), 2)}
    if tmpfs:
        def save(name: str):
            t0 = time.perf_counter()
            r = _result(http, http.post("/save_weights", headers=KEY, json={
                "model_id": m, "seq_id": next(seq), "path": name}).json()["request_id"])
            return r.json(), round(1e3 * (time.perf_counter() - t0), 2)

        save("first")
        ballast = root / "run" / "ballast"
        with open(ballast, "wb") as f:
            left = shutil.disk_usage(root / "run").free - (64 << 10)
            while left > 0:
                f.write(b"\0" * min(left, 1 << 20))
                left -= 1 << 20
        failed, ms = save("second")
        rows["a full disk at save_state"] = {"answer": failed, "median_ms": ms}
        ballast.unlink()
        ok, ms = save("second")
        rows["the same save once space is freed"] = {"answer": ok, "median_ms": ms}
        rows["forward_backward after it"] = {"status": forward().status_code}
    serving.state.scheduler.close()
    serving.stop()
    if tmpfs:
        subprocess.run(["umount", "-l", str(root / "run")])
    for name, row in rows.items():
        print(f"| {name} | {row} |")
    if a.out:
        Path(a.out).write_text(json.dumps({"rows": rows, "python": sys.version.split()[0]}, indent=1))


if __name__ == "__main__":
    main()
