"""Issue 35's device benchmarks: many LoRA models on one base through `shardfit serve`, what a model and a frozen
version cost against `shardfit plan --models N --versions K`, how many models fit one GPU, and one client through
the SDK against the Engine in process. One GPU, Qwen3-8B shape (rl_worker_setup.SHAPES), LoRA r=16 alpha 32 on the
7 linear layers of every block with full checkpointing (bench_rl's lora-ppo and rl-8b serve), random weights, fp32
adapters, bf16 compute, compiled; micro-batches of --micro-batch-tokens (4,096) tokens: a step's 16 datums are four
[1, 4096] rows, and a model of the memory part costs one row's pass (~0.5 s, where rl-8b's 17,408-token rows would
cost ~2 s: ~90 models would not fit the stage's time). models_fit is the plan's count at that T (the peak of one row).

  python benchmarks/bench_clients.py --out clients.json          # both parts (device_run.sh clients, ~8 min)
  python benchmarks/bench_clients.py --parts memory               # one part
  python benchmarks/bench_clients.py --tiny                       # tiny shape on the CPU, a few steps: machinery

Parts (each a fresh process under a cap cut to what is left of --budget; the JSON is rewritten after each):
  clients  `shardfit serve --lora.rank=16` (one rank, loopback; started and stopped as bench_rl's serve part:
           serve_process.py), then bench_clients_workers.worker_clients through the official tinker SDK: 16 training
           clients (each create_lora_training_client: its own model), one warm-up step each and one warm-up round
           of all 16 at once (the first pass of several models compiles; not in any figure), then 1, 4 and 16 of
           them concurrently in threads and the 16 one after another, each configuration the same --total-steps
           steps (16: 16 x 1 client, 4 x 4, 1 x 16, 1 each in turn). A step is the cookbook's RL call: forward_backward
           (importance_sampling, --datums datums of --datum-min..--datum-max tokens, ~16k tokens) + optim_step.
           Aggregate tokens/s = the steps' model-input tokens over the wall time from the start to the last client's
           last result; step_s = the median interval between a client's completed steps; server_busy = the server's
           compute + optimizer seconds (its metrics) over that wall time; passes = how many steps ran in a pass
           of how many models (server_pass_models), pass_s = the longest and the median pass compute seconds.
  memory   bench_clients_workers.worker_memory: the same Engine config in process. The cookbook step (client 0's
           data, token for token) timed: --reps steps after one warm-up. Then models added one by one, each
           stepped once on a [1, T] row (its adapters, gradients kept allocated, Adam's two moments: what the plan
           counts), torch.cuda.memory_allocated read after each; after --measure-models of them, --versions frozen
           versions (save_weights_for_sampler's freeze) likewise; then more models until an OOM, the plan's count +
           --fit-extra, or the part's deadline. The plan's figures come from its own functions on the Engine's
           config (cli/plan.py's calls: plan_prediction), for this GPU's memory.
JSON summary: multi_client_aggregate {"1", "4", "16", "sequential16": tokens/s}, multi_client_vs_one (each over
"1"; the issue's target: "16" >= 0.9), model_gib and version_gib (median allocated delta), plan_ratio {model,
version: measured over the plan's bytes; the target is within 3%}, compile_fallbacks {server: the server log's
lines for functions torch.compile gave up on, in_process: the memory part's count; both 0, or the figures ran partly
eager}, models_fit {predicted, measured, stopped: oom, cap (a lower bound) or deadline}, sdk_vs_inprocess (the SDK
step of one client over the in-process step, the issue's "within 3%"; of this ~16k-token step, where bench_rl's serve
part times a 178,786-token PPO step: a request's fixed cost weighs ~10x more here), peak_vs_plan (the last model's
pass: allocated peak over the plan's peak + models + versions).
The device lacks the SDK and the server stack: device_run.sh installs benchmarks/wheels_rl (bench_rl.py's docstring).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_clients_workers import WORKERS  # noqa: E402
from bench_rl import gpu_memory_gib, run  # noqa: E402
from bench_train import ROOT  # noqa: E402
from rl_worker_setup import LORA_RANK, TAG, engine_overrides  # noqa: E402
from serve_process import running_server  # noqa: E402

CAPS = {"server": 180, "clients": 320, "memory": 230}
MIN_START = 0.4  # a part is not started with less than this fraction of its cap left of the budget
GiB = 2**30


def worker_cmd(a, kind: str, *extra: str) -> list[str]:
    return [sys.executable, str(Path(__file__).resolve()), "--worker", kind, "--device", a.device, "--shape", a.shape,
            "--lora", str(a.lora), "--micro-batch-tokens", str(a.micro_batch_tokens), "--clients", a.clients,
            "--total-steps", str(a.total_steps), "--datums", str(a.datums), "--datum-min", str(a.datum_min),
            "--datum-max", str(a.datum_max), "--reps", str(a.reps), "--versions", str(a.versions),
            "--measure-models", str(a.measure_models), "--fit-extra", str(a.fit_extra), "--max-models",
            str(a.max_models), f"--sf-extra={a.sf_extra}", *extra]


def clients_part(a, cap_start: int, left) -> list[dict]:
    """The server, the clients worker against it (capped to CAPS["clients"] and to left(), the budget's seconds
    left once the server is up), the server stopped: [server row, clients row]."""
    run_dir = Path(tempfile.mkdtemp(prefix="clientbench-serve-"))
    cmd = [sys.executable, "-m", "shardfit", "serve", "--port=0",
           *engine_overrides(a, a.shape, a.micro_batch_tokens, run_dir / "run", lora=a.lora)]
    env = {**os.environ, "TINKER_TELEMETRY": "0", "PYTHONUNBUFFERED": "1"}
    row = {"part": "clients", "system": "server", "label": f"shardfit serve {a.shape} lora{a.lora}",
           "cmd": " ".join(cmd[1:])}
    rows = [row]
    with running_server(cmd, cap_start, ROOT, env) as srv:
        row["start_s"] = srv.start_s
        if srv.url:
            rows.append({"part": "clients", "system": "sdk",
                         **run(f"tinker SDK clients -> serve {a.shape}", worker_cmd(a, "clients", "--url", srv.url),
                               int(max(min(CAPS["clients"], left() - 5), 30)), env={"TINKER_TELEMETRY": "0"})})
        else:
            row["error"] = srv.error
    row["log_tail"] = srv.log_tail()
    from shardfit.parallel.compile_watch import MARKER  # here: the parent imports torch only once the server is gone

    # the server's lines for functions torch.compile gave up on (run eager from then on): any, and its figures are off
    row["compile_fallbacks"] = [x.strip() for x in srv.log if f"{MARKER}:" in x]
    shutil.rmtree(run_dir, ignore_errors=True)
    return rows


# ---------------------------------------------------------------------------------------------- the summary
def _lines(rows: list[dict], part: str, kind: str) -> list[dict]:
    return [x for r in rows if r.get("part") == part for x in r.get("lines", []) if x.get(TAG) == kind]


def _last(rows: list[dict], part: str, kind: str) -> dict | None:
    got = _lines(rows, part, kind)
    return got[-1] if got else None


def summarize(rows: list[dict]) -> dict:
    S: dict = {}
    agg = {}
    for x in _lines(rows, "clients", "clients"):
        agg[str(x["clients"]) if x["mode"] == "concurrent" else f"sequential{x['clients']}"] = x["tok_s"]
    if agg:
        S["multi_client_aggregate"] = agg
        if agg.get("1"):
            S["multi_client_vs_one"] = {k: round(v / agg["1"], 3) for k, v in agg.items() if k != "1"}
    plan, fit = _last(rows, "memory", "plan"), _last(rows, "memory", "fit")
    deltas = fit.get("model_deltas") if fit else None
    versions = [x["delta"] for x in _lines(rows, "memory", "version") if x.get("delta") is not None
                and x.get("on_device")]
    if deltas:
        S["model_gib"] = round(statistics.median(deltas) / GiB, 4)
    if versions:
        S["version_gib"] = round(statistics.median(versions) / GiB, 4)
    if plan:
        ratio = {"model_plan_gib": round(plan["model_bytes"] / GiB, 4),
                 "version_plan_gib": round(plan["version_bytes"] / GiB, 4)}
        if deltas:
            ratio["model"] = round(statistics.median(deltas) / plan["model_bytes"], 4)
        if versions:
            ratio["version"] = round(statistics.median(versions) / plan["version_bytes"], 4)
        S["plan_ratio"] = ratio
    if fit:
        S["models_fit"] = {"predicted": fit["predicted"], "measured": fit["measured"], "stopped": fit["stopped"],
                           "versions_held": fit["versions"], "gpu_gib": plan and plan["gpu_gib"]}
        last = _last(rows, "memory", "model")
        if plan and last and last.get("peak_alloc_GiB"):
            predicted = (plan["peak_bytes"] + plan["model_bytes"] * (last["models"] - 1)
                         + plan["version_bytes"] * fit["versions"]) / GiB
            S["peak_vs_plan"] = {"models": last["models"], "measured_gib": last["peak_alloc_GiB"],
                                 "plan_gib": round(predicted, 2),
                                 "ratio": round(last["peak_alloc_GiB"] / predicted, 4)}
    one = next((x for x in _lines(rows, "clients", "clients") if x["clients"] == 1 and x["mode"] == "concurrent"),
               None)
    inproc = _last(rows, "memory", "inproc")
    fit = _last(rows, "memory", "fit")
    # functions run eager past torch.compile's recompile_limit (parallel/compile_watch.py): 0 for figures that count
    # (only where a server ran or an in-process line counted them: a run cut short before either has no figure)
    servers = [r for r in rows if "compile_fallbacks" in r]
    counted = [x["compile_fallbacks"] for x in (inproc, fit) if x and "compile_fallbacks" in x]
    if servers or counted:
        S["compile_fallbacks"] = {"server": sum(len(r["compile_fallbacks"]) for r in servers),
                                  "in_process": max(counted, default=0)}
    if one and inproc:
        S["sdk_vs_inprocess"] = round(one["step_s"] / inproc["step_s"], 4)
        S["step_s"] = {"sdk": one["step_s"], "in_process": inproc["step_s"]}
    return S


def table(rows: list[dict], S: dict) -> None:
    print(f"\n{'what':<44} {'tokens/s':>10} {'step s':>8} {'wall s':>8} {'server busy':>11}  passes (models: steps)"
          " / pass s max, median")
    for row in rows:
        if "skipped" in row or row.get("error"):
            print(f"{row.get('label', '')[:44]:<44} {row.get('skipped') or row.get('error')}"[:200])
    for x in _lines(rows, "clients", "clients"):
        what = f"{x['clients']} clients {x['mode']} ({x['steps']} steps)"
        print(f"{what:<44} {x['tok_s']:>10,} {x['step_s']:>8} {x['wall_s']:>8} {x['server_busy']:>11}  "
              f"{x.get('passes', '')} {x.get('pass_s', '')}")
    if inproc := _last(rows, "memory", "inproc"):
        print(f"{'one client in process (Engine)':<44} {inproc['tok_s']:>10,} {inproc['step_s']:>8}")
    for key in ("multi_client_vs_one", "sdk_vs_inprocess", "model_gib", "version_gib", "plan_ratio", "models_fit",
                "peak_vs_plan", "compile_fallbacks"):
        if key in S:
            print(f"{key}: {json.dumps(S[key])}")


# ---------------------------------------------------------------------------------------------- main
def main_parent(a) -> int:
    t0 = time.time()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # the stage's `timeout`: finally blocks stop the server
    from importlib.metadata import version

    env = {"gpu_memory_GiB": round(gpu_memory_gib(), 1), "torch": version("torch"),
           "args": {k: str(v) for k, v in vars(a).items()}}
    rows: list[dict] = []

    def write(complete: bool) -> dict:
        S = summarize(rows)
        if a.out:
            Path(a.out).write_text(json.dumps({"env": env, "summary": S, "rows": rows, "complete": complete},
                                              indent=1))
        return S

    for part in [p for p in a.parts.split(",") if p]:
        left, done = a.budget - (time.time() - t0), len(rows)
        if part == "clients":
            if left < MIN_START * (CAPS["server"] + CAPS["clients"]):
                rows.append({"part": part, "label": "clients", "skipped": f"budget ({left:.0f} s left)"})
            else:
                rows.extend(clients_part(a, int(min(CAPS["server"], left / 2)),
                                         lambda: a.budget - (time.time() - t0)))
        elif part == "memory":
            if left < MIN_START * CAPS["memory"]:
                rows.append({"part": part, "label": "memory", "skipped": f"budget ({left:.0f} s left)"})
            else:
                cap = int(min(CAPS["memory"], left - 5))  # the worker's own deadline leaves it time to report
                rows.append({"part": part, "system": "shardfit",
                             **run(f"Engine in process {a.shape} lora{a.lora}",
                                   worker_cmd(a, "memory", "--deadline", str(max(cap - 40, 20))), cap)})
        else:
            raise SystemExit(f"unknown part {part!r}: clients, memory")
        for row in rows[done:]:
            print(json.dumps({k: v for k, v in row.items() if k != "lines"})[:400], flush=True)
        write(False)
    table(rows, write(True))
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--parts", default="clients,memory")
    ap.add_argument("--out", default="")
    ap.add_argument("--budget", type=float, default=530.0, help="seconds for all parts (each capped to what is left)")
    ap.add_argument("--tiny", action="store_true", help="the machinery: tiny shape on the CPU and, unless given, 1/2/4 "
                    "clients, 4 steps of 4 datums of 24-32 tokens, 5 models, 2 versions")
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    ap.add_argument("--shape", default="8b", help="a key of rl_worker_setup.SHAPES")
    ap.add_argument("--lora", type=int, default=LORA_RANK)
    ap.add_argument("--micro-batch-tokens", type=int, default=4096, help="T: the Engine's [1, T] rows")
    ap.add_argument("--clients", default="1,4,16", help="concurrent clients per configuration; the largest also "
                    "runs one after another")
    ap.add_argument("--total-steps", type=int, default=16, help="steps of every configuration, all clients together")
    ap.add_argument("--datums", type=int, default=16, help="datums a forward_backward")
    ap.add_argument("--datum-min", type=int, default=896, help="a datum's tokens, at least")
    ap.add_argument("--datum-max", type=int, default=1024, help="a datum's tokens, at most (<= T)")
    ap.add_argument("--reps", type=int, default=3, help="timed in-process steps")
    ap.add_argument("--versions", type=int, default=4, help="frozen versions measured and held while models fit")
    ap.add_argument("--measure-models", type=int, default=4, help="models added before the versions are frozen")
    ap.add_argument("--fit-extra", type=int, default=12, help="models tried past the plan's count (for its OOM)")
    ap.add_argument("--max-models", type=int, default=0, help="stop adding models here (0: plan + --fit-extra)")
    ap.add_argument("--sf-extra", default="", help="more Engine overrides, space-separated (server and in process)")
    ap.add_argument("--worker", choices=list(WORKERS), help=argparse.SUPPRESS)
    ap.add_argument("--url", default="", help=argparse.SUPPRESS)
    ap.add_argument("--deadline", type=float, default=600.0, help=argparse.SUPPRESS)
    a = ap.parse_args()
    a.moe_layers = 0  # rl_worker_setup.engine_overrides reads it (MoE shapes only)
    if a.tiny and not a.worker:
        tiny = dict(device="cpu", shape="tiny", micro_batch_tokens=128, datum_min=24, datum_max=32, clients="1,2,4",
                    total_steps=4, datums=4, measure_models=2, versions=2, reps=1, max_models=5, budget=900)
        given = {x.split("=")[0] for x in sys.argv[1:] if x.startswith("--")}
        for k, v in tiny.items():  # what the command line does not give
            if "--" + k.replace("_", "-") not in given:
                setattr(a, k, v)
        for k in CAPS:
            CAPS[k] = 400
    if a.worker:
        return WORKERS[a.worker](a)
    return main_parent(a)


if __name__ == "__main__":
    raise SystemExit(main())
