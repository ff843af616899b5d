"""Issue 15: Mixture-of-experts at speed. shardfit against the Hugging Face FSDP2 recipe and torchtitan 0.2.2, on the
Qwen3-30B-A3B shape truncated to --layers of its 48, seq 4096, micro-batch 2, random init, in one invocation.

  python benchmarks/bench_moe.py --nproc 2 --layers 12 --budget 525 --out moe2.json     # device_run.sh moe2
  python benchmarks/bench_moe.py --nproc 4 --layers 48 --ac full --out moe4.json         # device_run.sh moe4
  python benchmarks/bench_moe.py --dry-run                   # every command line, nothing run
  python benchmarks/bench_moe.py --cpu-check --nproc 2       # the shardfit cases on a tiny MoE, gloo (machinery only)

Cases run one after the other in priority order (the figures of the issue's ratios first): the HF anchor
(benchmarks/anchor_hf_qwen3moe.py, grouped_mm experts, its own full checkpointing), shardfit compiled, torchtitan
compiled (benchmarks/anchor_torchtitan_launch.py; wheels from .whl, assets from anchor_torchtitan_assets.py), shardfit
with expert parallelism E = nproc and 2, torchtitan with EP 2, shardfit eager (full AC, then no AC), and with --hf-eager
the HF anchor's default `eager` experts (slow, ~60 s more). Each case runs under its own cap, cut to what is left of
--budget; a case that does not start in time is recorded as skipped, a case cut short keeps the steps it logged
(flagged timed_out), a failure (e.g. shardfit refusing --parallel.expert_parallel) is recorded and the next case runs.
The JSON is rewritten after every case, so a stage's `timeout` keeps the finished ones.

Figures: tokens/s/GPU is the median over steps after the third (shardfit: metrics.jsonl; torchtitan: its own per-step
rate, mean over ranks; HF: the anchor's median step time). MFU on ACTIVE parameters, the issue's formula for every
system: 6 x (per layer q/k/v/o + router + top-k experts' three matrices; plus the output head) + 12 x layers x heads x
head_dim x seq per token, against 989 TFLOP/s (mfu_own is the system's own figure). Peak allocated / reserved: the
largest per-rank peak over the measured steps; retries: allocator retries. Each shardfit case also has `shardfit plan
--json`'s predicted peak allocated (run in the background while the first cases run) beside the measured one.
Tokens: --tokens uniform (default) feeds shardfit uniform random ids through the torchtitan assets' word tokenizer,
like both anchors' random ids (expert routing depends on the ids); --tokens bytes is bench_train's embedded corpus.
Attention is plain causal in every system (shardfit: data.document_mask=false), the work the formula counts.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_train import ROOT, _aggregate, _run_group, steady_summary  # noqa: E402  (bench_train's private helpers, on purpose)

BENCH = ROOT / "benchmarks"
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
# Qwen3-30B-A3B: vocab, hidden, heads, kv heads, head_dim, experts, top-k, expert inner size
V, H, NH, NKV, HD, E, K, I = 151936, 2048, 32, 4, 128, 128, 8, 768
# per-case caps (s), before cutting to the budget: compile costs ~60-90 s a case; 48 layers step ~4x longer
CAPS = {"hf": 150, "sf": 120, "sf-compile": 200, "tt": 200}
MIN_START = 0.5  # a case is not started with less than this fraction of its cap left of the budget
# tiny MoE overrides of --cpu-check (gloo, 2 CPU cores: ~15 s a case)
TINY = ["--model.dim=64", "--model.n_heads=4", "--model.n_kv_heads=2", "--model.head_dim=16", "--model.ffn_dim=128",
        "--model.n_experts=8", "--model.experts_per_token=2", "--model.moe_ffn_dim=32", "--data.seq_len=256",
        "--train.steps=6"]


def flop_per_token(layers: int, seq: int) -> int:
    attn = H * NH * HD + 2 * H * NKV * HD + NH * HD * H  # q, k, v, o
    active = layers * (attn + H * E + K * 3 * H * I) + V * H  # blocks (router + top-k experts) + output head
    return 6 * active + 12 * layers * NH * HD * seq


def ensure_data(a) -> list[str]:
    """shardfit's data flags; for uniform ids, the torchtitan assets (made if missing) and a 32-document slice of their
    random-word set (524k tokens: 12 steps on 4 GPUs need 393k; tokenized in well under a second)."""
    if a.tokens == "bytes":
        return []
    small = Path(a.assets) / "synth_small" / "train.jsonl"
    if not a.dry_run and not small.is_file():
        if not (Path(a.assets) / "tok151936" / "tokenizer.json").is_file():
            subprocess.run([sys.executable, str(BENCH / "anchor_torchtitan_assets.py"), a.assets], check=True)
        small.parent.mkdir(parents=True, exist_ok=True)
        with open(Path(a.assets) / "synth" / "train.jsonl") as f:
            small.write_text("".join(next(f) for _ in range(32)))
    return [f"--data.path={small}", f"--data.tokenizer={a.assets}/tok151936/tokenizer.json", "--data.mode=pretrain"]


def cases(a, data: list[str]) -> list[dict]:
    n, L, ac = a.nproc, a.layers, a.ac
    sf = ["--model.name=qwen3-30b-a3b", f"--model.n_layers={L}", f"--data.seq_len={a.seq}",
          f"--train.micro_batch={a.mbs}", f"--train.global_batch={a.mbs * n}", f"--train.steps={a.steps}",
          "--train.warmup_steps=2", "--train.lr=1e-4", "--data.document_mask=false", *data]
    if a.cpu_check:
        sf += TINY + (["--model.vocab_size=264"] if a.tokens == "bytes" else [])
    acf = [f"--compute.activation_checkpoint={ac}"] if ac != "none" else []
    fast = [*sf, *acf] if a.cpu_check else [*sf, *acf, "--compute.compile=true"]
    acl = "no" if ac == "none" else ac
    fast_label = f"shardfit {acl}-AC" + ("" if a.cpu_check else " compile")
    hf = ["--layers", str(L), "--seq", str(a.seq), "--mbs", str(a.mbs), "--steps", str(a.steps)]
    tt = ["--model.name", "qwen3", "--model.flavor", f"30B-A3B-{L}L", "--model.hf_assets_path",
          f"{a.assets}/tok151936", "--compile.enable", "--activation_checkpoint.mode", ac,
          "--training.local_batch_size", str(a.mbs), "--training.seq_len", str(a.seq), "--training.dataset", "c4_test",
          "--training.dataset_path", f"{a.assets}/synth", "--training.steps", str(a.steps), "--metrics.log_freq", "1",
          "--lr_scheduler.warmup_steps", "2"]
    eps = sorted({e for e in (2, n) if 2 <= e <= n}, reverse=True)  # EP = nproc first, then 2
    out = [dict(system="hf", label="HF grouped_mm full-AC", args=[*hf, "--experts", "grouped_mm"], cap=CAPS["hf"]),
           dict(system="shardfit", label=fast_label, args=fast, cap=CAPS["sf-compile"]),
           dict(system="torchtitan", label=f"torchtitan {acl}-AC compile", args=tt, cap=CAPS["tt"])]
    out += [dict(system="shardfit", label=f"{fast_label} EP{e}", args=[*fast, f"--parallel.expert_parallel={e}"],
                 cap=CAPS["sf-compile"]) for e in eps]
    # the optimizer step under the next forward (parallel/step_overlap.py): one change against the EP case above
    out.append(dict(system="shardfit", label=f"{fast_label} EP{eps[0]} overlap-opt" if eps else f"{fast_label} "
                    "overlap-opt", args=[*fast, *([f"--parallel.expert_parallel={eps[0]}"] if eps else []),
                                         "--parallel.overlap_optimizer=true"], cap=CAPS["sf-compile"]))
    base = out[-1]
    for v in a.variant:  # NAME=FLAGS: the overlapped EP case with FLAGS added (one change against it)
        name, _, flags = v.partition("=")
        out.append(dict(system="shardfit", label=f"{base['label']} {name}", args=[*base["args"], *flags.split()],
                        cap=CAPS["sf-compile"]))
    if n >= 2:
        out.append(dict(system="torchtitan", label=f"torchtitan {acl}-AC compile EP2",
                        args=[*tt, "--parallelism.expert_parallel_degree", "2"], cap=CAPS["tt"]))
    out.append(dict(system="shardfit", label="shardfit full-AC", args=[*sf, "--compute.activation_checkpoint=full"],
                    cap=CAPS["sf"]))
    if ac == "none":
        out.append(dict(system="shardfit", label="shardfit no-AC", args=sf, cap=CAPS["sf"]))
    if a.hf_eager:
        out.append(dict(system="hf", label="HF eager full-AC", args=[*hf[:-1], "6", "--experts", "eager"],
                        cap=CAPS["hf"]))
    if a.cpu_check:
        out = [c for c in out if c["system"] == "shardfit"]
    seen: set[tuple] = set()  # the same command once (--cpu-check: no compile, so no-AC twice)
    out = [c for c in out if (c["system"], *c["args"]) not in seen and not seen.add((c["system"], *c["args"]))]
    return [c for c in out if not a.only or c["label"] in a.only]


def command(c: dict, a) -> tuple[list[str], dict]:
    """The case's command line and the environment it adds."""
    run = [*TORCHRUN, f"--nproc_per_node={a.nproc}"]
    if c["system"] == "hf":
        return [*run, str(BENCH / "anchor_hf_qwen3moe.py"), *c["args"]], {}
    if c["system"] == "torchtitan":
        # offline: the tokenizer and the JSON-lines set are local files (no hub look-up on a machine with no network)
        return [*run, str(BENCH / "anchor_torchtitan_launch.py"), *c["args"]], {
            "TT_MOE_LAYERS": str(a.layers), "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    return [*run, "-m", "shardfit", "train", *c["args"], "--logging.log_every=1", "--logging.progress=lines",
            "--checkpoint.final=false", "--checkpoint.resume=none"], {}


def shown(cmd: list[str], env_add: dict) -> str:
    """A command as one would type it from the repository root."""
    words = [*(f"{k}={v}" for k, v in env_add.items()), "torchrun", "--standalone", *cmd[len(TORCHRUN):]]
    return shlex.join(words).replace(f"{ROOT}/", "")


def plan_cmd(c: dict, a) -> list[str]:
    return [sys.executable, "-m", "shardfit", "plan", *c["args"], f"--nproc={a.nproc}", f"--gpu-memory={a.gpu_memory}",
            "--json"]


def start_plans(todo: list[dict], a) -> dict[str, subprocess.Popen]:
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    return {c["label"]: subprocess.Popen(plan_cmd(c, a), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                         cwd=ROOT, env=env) for c in todo if c["system"] == "shardfit"}


def plan_result(p: subprocess.Popen | None) -> dict:
    if p is None:
        return {}
    try:
        out, err = p.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        p.kill()
        return {"plan_error": "plan timed out"}
    try:
        terms = json.loads(out)["configured"]["terms"]
    except (ValueError, KeyError, TypeError):
        return {"plan_error": (err or out).strip()[-300:]}
    return {"plan_peak_GiB": round(terms["peak"] / 2**30, 2),
            "plan_terms_GiB": {k: round(v / 2**30, 2) for k, v in terms.items() if k != "micro_batch"}}


def why(stdout: str, stderr: str) -> str:
    """The line that says why a run failed: shardfit's own error line, else the last exception line (not torchrun's)."""
    lines = (stderr + "\n" + stdout).splitlines()
    own = [x for x in lines if x.startswith("shardfit: error")]
    exc = [x.strip() for x in lines
           if ("Error" in x or "error:" in x) and "elastic" not in x and "ChildFailed" not in x]
    return (own or exc or [""])[-1][:300]


def parse_shardfit(row: dict, run_dir: Path, stdout: str, stderr: str, n: int) -> None:
    f = run_dir / "metrics.jsonl"
    recs = [r for r in (json.loads(x) for x in f.read_text().splitlines()) if not r.get("eval")] if f.is_file() else []
    row["notes"] = [x for x in stdout.splitlines() if x.startswith(("shardfit:", "warning", "note"))][:6]
    if row["rc"] != 0 and not row["timed_out"]:
        row["error"] = (stderr or stdout)[-1500:]
        row["oom"] = "OutOfMemoryError" in stderr or "out of memory" in stderr
    agg = _aggregate(recs, n) if recs else {}
    if not agg:
        row.setdefault("error", "fewer than 4 steps recorded" + (" (timeout)" if row["timed_out"] else ""))
        return
    row.update(tok_s_gpu=agg["tok_s_gpu_median"], tok_s_gpu_timeweighted=agg["tok_s_gpu"], mfu_own=agg["mfu"],
               measured_steps=agg["measured_steps"], **steady_summary(recs))
    moe = {k: v for k, v in recs[-1].items() if any(w in k for w in ("expert", "moe", "load", "router", "aux"))}
    if moe:  # expert load and router metrics, when shardfit logs them (issue 15)
        row["moe_metrics_last"] = moe


def parse_hf(row: dict, stdout: str, stderr: str) -> None:
    lines = [json.loads(x) for x in stdout.splitlines() if x.startswith("{")]
    r = lines[-1] if lines else {}
    if r.get("oom"):
        row.update(oom=True, error="OOM")
    elif r.get("tok_s_gpu"):
        row.update(tok_s_gpu=r["tok_s_gpu"], mfu_own=r.get("mfu_active"), peak_alloc_GiB=r.get("peak_alloc_GiB"),
                   peak_reserved_GiB=r.get("peak_reserved_GiB"), retries=r.get("retries"), step_s=r.get("step_s"),
                   init_s=r.get("init_s"), flop_check=r.get("active_flop_per_tok"))
    else:
        row["error"] = (stderr or stdout)[-1500:]


def parse_torchtitan(row: dict, stdout: str, stderr: str) -> None:
    # Two ranks print to one pipe: their lines can interleave mid-line, so every JSON object after each "TTJSON "
    # marker is decoded on its own and a cut one is skipped.
    decoder, recs = json.JSONDecoder(), []
    for piece in stdout.split("TTJSON ")[1:]:
        try:
            recs.append(decoder.raw_decode(piece)[0])
        except ValueError:
            continue
    by_step: dict[int, list[dict]] = {}
    for r in recs:
        by_step.setdefault(r["step"], []).append(r)
    steady = {s: rs for s, rs in by_step.items() if s > 3}
    if row["rc"] != 0 and not row["timed_out"]:
        row["error"] = (stderr or stdout)[-1500:]
        row["oom"] = "OutOfMemoryError" in stderr or "out of memory" in stderr
    if not steady:
        row.setdefault("error", "fewer than 4 steps logged" + (" (timeout)" if row["timed_out"] else ""))
        return
    flat = [r for rs in steady.values() for r in rs]
    row.update(tok_s_gpu=round(statistics.median(statistics.mean(r["tps"] for r in rs) for rs in steady.values())),
               mfu_own=round(statistics.median(r["mfu_pct"] for r in flat) / 100, 3),
               peak_alloc_GiB=round(max(r["peak_alloc_GiB"] for r in flat), 2),
               peak_reserved_GiB=round(max(r["peak_reserved_GiB"] for r in flat), 2),
               retries=int(max(r["retries"] for r in recs)), measured_steps=len(steady), steps_done=max(by_step),
               final_loss=round(by_step[max(by_step)][0]["loss"], 4), tt_flops_per_token=flat[0]["flops_per_token"])


def run_case(c: dict, a, timeout: int) -> dict:
    cmd, env_add = command(c, a)
    row = {"system": c["system"], "label": c["label"], "nproc": a.nproc, "layers": a.layers,
           "cmd": shown(cmd, env_add)}
    if c["system"] == "torchtitan" and importlib.util.find_spec("torchtitan") is None:
        row["error"] = "torchtitan is not installed (device_run.sh setup installs the .whl wheels)"
        return row
    tmp = Path(tempfile.mkdtemp(prefix="moe-bench-"))
    if c["system"] == "shardfit":
        cmd.append(f"--logging.run_dir={tmp}")
    elif c["system"] == "torchtitan":
        cmd += ["--job.dump_folder", str(tmp)]
    old = {k: os.environ.get(k) for k in env_add}
    os.environ.update(env_add)
    try:
        rc, stdout, stderr, timed_out, wall = _run_group(cmd, timeout)
    finally:
        for k, v in old.items():
            os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)
    row.update(rc=rc, timed_out=timed_out, wall_s=round(wall, 1), timeout_s=timeout)
    if rc != 0:
        row["error_line"] = why(stdout, stderr)
    if c["system"] == "shardfit":
        parse_shardfit(row, tmp, stdout, stderr, a.nproc)
    else:
        (parse_hf if c["system"] == "hf" else parse_torchtitan)(row, stdout, stderr)
    shutil.rmtree(tmp, ignore_errors=True)
    if row.get("tok_s_gpu"):
        row["mfu_active"] = round(row["tok_s_gpu"] * flop_per_token(a.layers, a.seq) / a.peak, 3)
    return row


def summarize(rows: list[dict]) -> dict:
    def best(system: str) -> dict | None:
        ok = [r for r in rows if r["system"] == system and r.get("tok_s_gpu")]
        return max(ok, key=lambda r: r["tok_s_gpu"], default=None)

    b = {s: best(s) for s in ("shardfit", "hf", "torchtitan")}
    out: dict = {"best": {s: (r["label"], r["tok_s_gpu"], r["mfu_active"]) if r else None for s, r in b.items()}}
    for key, other in (("moe_vs_hf", "hf"), ("moe_vs_torchtitan", "torchtitan")):
        if b["shardfit"] and b[other]:
            out[key] = round(b["shardfit"]["tok_s_gpu"] / b[other]["tok_s_gpu"], 3)
    out["targets"] = {"moe_vs_hf>=2": out.get("moe_vs_hf", 0) >= 2,
                      "mfu_active>=0.30": bool(b["shardfit"]) and b["shardfit"]["mfu_active"] >= 0.30,
                      "moe_vs_torchtitan>=1": out.get("moe_vs_torchtitan", 0) >= 1}
    pvm = {r["label"]: {"plan_GiB": r["plan_peak_GiB"], "measured_GiB": r["peak_alloc_GiB"],
                        "error_pct": round(100 * (r["plan_peak_GiB"] - r["peak_alloc_GiB"]) / r["peak_alloc_GiB"], 1)}
           for r in rows if r.get("plan_peak_GiB") and r.get("peak_alloc_GiB")}
    out["plan_vs_measured"] = pvm
    out["plan_within_3pct"] = sum(abs(v["error_pct"]) <= 3 for v in pvm.values())
    return out


def table(env: dict, rows: list[dict], summary: dict) -> None:
    print(f"\n{env['gpu']} x{env['nproc']}, torch {env['torch']}, Qwen3-30B-A3B shape {env['layers']} layers, seq "
          f"{env['seq']}, mbs {env['mbs']}, {env['flop_per_token'] / 1e9:.2f} GFLOP/token active")
    print(f"{'case':32} {'tok/s/GPU':>9} {'MFU act':>7} {'own':>6} {'alloc/resv GiB':>14} {'retry':>5} "
          f"{'plan GiB (err)':>15} {'wall s':>6}")
    for r in rows:
        plan = f"{r['plan_peak_GiB']:.1f} ({summary['plan_vs_measured'][r['label']]['error_pct']:+.1f}%)" \
            if r["label"] in summary["plan_vs_measured"] else ("-" if "plan_error" not in r else "plan error")
        if r.get("tok_s_gpu"):
            own = f"{r['mfu_own']:.3f}" if r.get("mfu_own") is not None else "-"
            print(f"{r['label']:32} {r['tok_s_gpu']:>9,} {r['mfu_active']:>7.3f} {own:>6} "
                  f"{r['peak_alloc_GiB']:>6.1f}/{r['peak_reserved_GiB']:<7.1f} {r.get('retries', 0) or 0:>5} "
                  f"{plan:>15} {r.get('wall_s', 0):>6.0f}" + ("  TIMED OUT (partial)" if r.get("timed_out") else ""))
        else:
            reason = r.get("skipped") or ("OOM" if r.get("oom") else r.get("error_line") or r.get("error", "")[-90:])
            print(f"{r['label']:32} {'SKIPPED' if r.get('skipped') else 'FAILED':>9}  {reason[:150]}")
    for k in ("moe_vs_hf", "moe_vs_torchtitan", "plan_within_3pct", "targets"):
        if k in summary:
            print(f"{k}: {summary[k]}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--layers", type=int, default=12, help="of Qwen3-30B-A3B's 48")
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--mbs", type=int, default=2)
    ap.add_argument("--steps", type=int, default=12, help="per case; the median is over steps 4..steps")
    ap.add_argument("--ac", default="none", choices=["none", "full", "selective"],
                    help="checkpointing of the compiled shardfit / torchtitan cases (48 layers on 4 GPUs: full)")
    ap.add_argument("--tokens", default="uniform", choices=["uniform", "bytes"])
    ap.add_argument("--hf-eager", action="store_true", help="also the HF anchor's default eager experts (6 steps)")
    ap.add_argument("--budget", type=int, default=530, help="seconds for all cases together")
    ap.add_argument("--assets", default="/tmp/ttassets", help="torchtitan's offline assets (made when missing)")
    ap.add_argument("--gpu-memory", type=float, default=0.0, help="GiB for shardfit plan; 0: nvidia-smi, else 140.4")
    ap.add_argument("--peak", type=float, default=989e12)
    ap.add_argument("--variant", action="append", default=[],
                    help="NAME=FLAGS: one case more, the overlapped EP case with FLAGS added (repeatable)")
    ap.add_argument("--only", nargs="*", default=[], help="run only the cases with these labels")
    ap.add_argument("--out", default="")
    ap.add_argument("--dry-run", action="store_true", help="print every command line and exit")
    ap.add_argument("--cpu-check", action="store_true", help="the shardfit cases on a tiny MoE (CPU, gloo)")
    a = ap.parse_args()
    t0 = time.time()
    gpu, mib = "cpu", 0.0
    with_smi = shutil.which("nvidia-smi") and not a.dry_run
    if with_smi:  # no CUDA context in this process
        q = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total", "--format=csv,noheader,nounits"],
                           capture_output=True, text=True).stdout.splitlines()
        if q:
            gpu, mib = q[0].split(",")[0].strip(), float(q[0].split(",")[1])
    a.gpu_memory = a.gpu_memory or (round(mib / 1024, 1) if mib else 140.4)
    data = ensure_data(a)
    todo = cases(a, data)
    if a.dry_run:
        print("# shardfit plan, in the background at the start (CUDA_VISIBLE_DEVICES=''):")
        for c in todo:
            if c["system"] == "shardfit":
                print(shlex.join(plan_cmd(c, a)[1:]).replace("-m shardfit", "shardfit", 1))
        print(f"# cases in order (budget {a.budget} s):")
        for c in todo:
            cmd, env_add = command(c, a)
            print(f"[{c['label']}, cap {c['cap']} s] {shown(cmd, env_add)}")
        return 0
    from importlib.metadata import version

    env = {"gpu": gpu, "torch": version("torch"), "nproc": a.nproc, "layers": a.layers, "seq": a.seq, "mbs": a.mbs,
           "steps": a.steps, "ac": a.ac, "tokens": a.tokens, "gpu_memory_GiB": a.gpu_memory, "budget_s": a.budget,
           "flop_per_token": flop_per_token(a.layers, a.seq), "peak_flops": a.peak}
    plans = start_plans(todo, a)
    # SIGTERM (the stage's `timeout`) ends the running case's processes (_run_group) and leaves the JSON of the
    # cases done: it is rewritten after each case.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    rows: list[dict] = []
    try:
        for c in todo:
            left = a.budget - (time.time() - t0)
            if left < MIN_START * c["cap"]:
                row = {"system": c["system"], "label": c["label"], "skipped": f"budget ({left:.0f} s left)"}
            else:
                row = run_case(c, a, int(min(c["cap"], left - 5)))
                if c["system"] == "shardfit":
                    row.update(plan_result(plans.pop(c["label"], None)))
            rows.append(row)
            print(json.dumps(row), flush=True)
            if a.out:
                Path(a.out).write_text(json.dumps({"env": env, "summary": summarize(rows), "rows": rows,
                                                   "complete": False}, indent=1))
    finally:
        for p in plans.values():
            p.kill()
    summary = summarize(rows)
    if a.out:
        Path(a.out).write_text(json.dumps({"env": env, "summary": summary, "rows": rows, "complete": True}, indent=1))
    table(env, rows, summary)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
