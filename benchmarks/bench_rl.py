"""Issue 24, the training side of RL on one GPU: shardfit's Engine against the Hugging Face recipe of RL frameworks
(the anchor hf_rl_step.py), over the anchor's own rollout-shaped data (benchmarks/rollouts.py), in one invocation.

  python benchmarks/bench_rl.py --out rl.json                     # every part (device_run.sh rl, ~8 min)
  python benchmarks/bench_rl.py --parts moe --out rl_moe.json     # some parts
  python benchmarks/bench_rl.py --cpu-check                       # every part on tiny shapes on CPU (machinery)
  python benchmarks/bench_rl.py --parts lora-ppo/shardfit,lora-ppo/hf,serve,moe --serve-shape 8b --serve-lora 16
                                                                  # device_run.sh rl-8b

Parts (each system a fresh process, under a cap cut to what is left of --budget; the JSON is rewritten after each),
run in the order --parts lists them; "part/shardfit" or "part/hf" runs one system of a part:
  dense-fwd  log-prob recompute, Qwen3-8B shape: Engine.forward (fp32 master weights, bf16 compute, compiled blocks)
             against the anchor's part C (bf16 HF model, inference_mode) in layouts --hf-fwd (padnm: its fastest;
             pad: the HF default with the 2-D mask). With --prof-out DIR, Engine.forward also with session 14's
             settings (bench_rl_profiling.profile_forward) and one pass of each profiled: GPU time by where it went
  lora-ppo   the PPO step of the anchor's part D, Qwen3-8B shape with LoRA r=16 alpha 32 on the 7 linear layers of
             every block and full checkpointing (as the anchor): Engine against PEFT in --hf-ppo layouts
             (rl_lora_fwdbwd_vs_hf). With --prof-out DIR, after the timed steps one more step of each side under
             torch.profiler (shapes recorded), the anchor's driven through its own functions
             (bench_rl_workers.worker_hf_lora: part D's lines, then run_ppo with the profiler on for the timed
             iteration alone and its head labelled), and the card's bf16 matmul ceiling measured first: GPU time
             of each side by rl_profile.ROWS, matmul FLOPs and TFLOP/s by class, how far 2x is (rl_profile.bounds)
             -> DIR/ppo_{shardfit,hf}_summary.json, DIR/ppo_compare.json, summary.ppo_profile
  dense-ppo  PPO step with full fine-tuning, Qwen3-1.7B shape: Engine.forward_backward("ppo", token_mean) +
             optim_step against the anchor's part E (fp32 master + bf16 autocast, checkpointing, fused AdamW, clip
             1.0) in --hf-ppo (pack_flex: its fastest). Like with like: the anchor's 8B PPO (part D) is LoRA, and no
             full fine-tune of an 8B shape fits one GPU (16 B/parameter = 122 GiB of states; offload needs 142 GiB
             of host memory, the machine has 128)
  moe        Qwen3-30B-A3B shape, --moe-layers of its 48 (auto: 6 on a GPU over 100 GiB, as moe1; else 4): Engine
             forward and PPO step (compiled, overlapped optimizer step) against transformers' Qwen3MoeForCausalLM
             (grouped_mm experts) driven by the anchor's own run_forward / run_ppo: the forward as the anchor's C
             (plain bf16 model: FSDP2 does not run under inference_mode), the PPO step under FSDP2 (fp32 master, bf16
             compute, HF checkpointing), as verl / SkyRL run it. Then Engine.weights(bf16, 256 MiB buckets) streamed
             twice (GB/s of HF-named full tensors on the GPU) and Engine.export_hf to local disk (GB/s, and with
             os.sync()). With --prof-out DIR, one forward of each side profiled last (the anchor's first --hf-fwd
             layout): DIR/moe_fwd_{shardfit,hf}_summary.json, DIR/moe_fwd_compare.json, summary.moe_fwd_profile
  serve      the same PPO step through the official tinker SDK and `shardfit serve` (one rank, loopback) against
             Engine in process (--serve-shape; --serve-lora 16: `serve --lora.rank=16`, the lora-ppo step; a part
             run before at the same shape and LoRA rank gives the in-process figure and the inputs). Step time =
             interval between the SDK's consecutive completed steps (forward_backward and optim_step pipelined, as
             an RL loop sends them).
Figures: real tokens/s = the anchor's count (prompt + response tokens, 178,786) over the median of --reps timed
passes / steps, after one warm-up call over the longest and the shortest sequence (compiles; the anchor warms on its
largest and last micro-batch). Both sides micro-batch under the same token budget T = the longest sequence rounded
up to 128 (17,408). shardfit's time includes packing the datums and returning per-datum outputs (the API's work);
the anchor builds its micro-batches before its clock starts. Peak memory: torch.cuda.max_memory_* of the phase.
JSON summary: rl_fwd_vs_hf, rl_fwdbwd_vs_hf and rl_lora_fwdbwd_vs_hf (dicts by shape: shardfit over the anchor's
fastest layout measured), *_vs_hf_default (over `pad`), weights_GBps, export_hf_GBps, serve_vs_inprocess (SDK step /
in-process step), fwd_variants_real_tok_s and fwd_profile_ms, ppo_profile and moe_fwd_profile (--prof-out).
The device lacks the SDK and the server stack: benchmarks/wheels_rl (git-ignored, carried; device_run.sh's rl stages
install it into /tmp/site) holds, for CPython 3.12 manylinux x86_64 (pip download --no-deps): tinker==0.38.0
fastapi==0.165.0 uvicorn==0.54.0 starlette==1.10.0 pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0
typing-inspection==0.4.5 typing-extensions==4.16.0 opentelemetry-api==1.45.2 pyqwest==0.12.0 orjson==3.13.0
zstandard==0.25.0 distro==1.9.0 sniffio==1.3.1 h2==4.4.1 hpack==4.2.0 hyperframe==6.1.0 annotated-doc==0.0.7
anyio==4.16.0 (~15 MB; the rest of their imports, httpx, click, rich, protobuf, numpy, are on the device).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import rollouts as ro  # noqa: E402
from bench_moe import why  # noqa: E402
from bench_rl_workers import WORKERS  # noqa: E402
from bench_train import ROOT, _run_group  # noqa: E402  (bench_train's private helpers, on purpose)
from rl_report import summarize, table  # noqa: E402
from rl_worker_setup import LORA_RANK, SHAPES, engine_overrides, serve_process, vocab_of  # noqa: E402

CAPS = {"sf": 200, "sf-prof": 230, "hf": 200, "sf-moe": 240, "hf-moe": 220, "server": 180, "sdk": 150,
        "sf-prof-ppo": 260, "hf-prof-ppo": 400}
MIN_START = 0.4  # a run is not started with less than this fraction of its cap left of the budget


def lines_of(stdout: str) -> list[dict]:
    out = []
    for x in stdout.splitlines():
        if x.startswith("{"):
            with contextlib.suppress(ValueError):
                out.append(json.loads(x))
    return out


# ---------------------------------------------------------------------------------------------- the parent
def worker_cmd(a, kind: str, *extra: str) -> list[str]:
    return [sys.executable, str(Path(__file__).resolve()), "--worker", kind, "--device", a.device, "--scale",
            str(a.scale), "--reps", str(a.reps), "--fwd-reps", str(a.fwd_reps), "--anchor", str(a.anchor),
            "--moe-layers", str(a.moe_layers), "--hf-fwd", a.hf_fwd, "--hf-ppo", a.hf_ppo, f"--sf-extra={a.sf_extra}",
            "--prof-out", a.prof_out, "--logprobs-at", a.logprobs_at, *extra]


def anchor_cmd(a, shape: str, T: int, full: bool, cap: int, lora: bool = False, no_ac: bool = False) -> list[str]:
    """The anchor's part C (forward), E (full PPO step, `full`) or D (LoRA PPO step, `lora`) in a.hf_* layouts;
    no_ac: through benchmarks/anchor_rl_no_ac.py (the same script without gradient checkpointing)."""
    specs = a.hf_ppo if full or lora else a.hf_fwd
    spec = ",".join(f"{s}:{T}" for s in specs.split(",") if s)
    which = ["--fwd", "", "--lora", spec] if lora else ["--lora", "", "--full", spec] if full else ["--lora", "",
                                                                                                  "--fwd", spec]
    script = [str(Path(__file__).with_name("anchor_rl_no_ac.py")), str(a.anchor)] if no_ac else [str(a.anchor)]
    return [sys.executable, *script, "--shape", shape, "--reps", str(a.reps), "--scale", str(a.scale),
            "--check", "", "--deadline", str(max(cap - 60, 30)), *which]


def run(label: str, cmd: list[str], cap: int, env: dict | None = None) -> dict:
    old = {k: os.environ.get(k) for k in env or {}}
    os.environ.update(env or {})
    try:
        rc, out, err, timed_out, s = _run_group(cmd, cap)
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    row = {"label": label, "rc": rc, "timed_out": timed_out, "wall_s": round(s, 1), "cap_s": cap,
           "lines": lines_of(out)}
    if rc != 0:
        row["error"] = why(out, err) or err[-600:]
    return row


def serve(a, shape: str, T: int, cap_start: int, cap_sdk: int, inputs: Path) -> list[dict]:
    """`shardfit serve` (one rank; LoRA of rank --serve-lora) in a session of its own, the SDK worker against it,
    then the server stopped."""
    run_dir = Path(tempfile.mkdtemp(prefix="rlbench-serve-"))
    cmd = [sys.executable, "-m", "shardfit", "serve", "--port=0",
           *engine_overrides(a, shape, T, run_dir / "run", lora=a.serve_lora)]
    row = {"label": f"shardfit serve {shape}", "cmd": " ".join(cmd[1:])}
    rows = [row]
    with serve_process(cmd, cap_start, ROOT) as server:
        row["start_s"] = server["start_s"]
        if server["url"]:
            rows.append(run(f"tinker SDK -> serve {shape}",
                            worker_cmd(a, "sdk", "--shape", shape, "--url", server["url"], "--save-inputs",
                                       str(inputs), "--lora", str(a.serve_lora)), cap_sdk,
                            env={"TINKER_TELEMETRY": "0"}))
        else:
            row["error"] = "no 'listening on' line: " + "".join(server["log"][-8:])[-600:]
    row["log_tail"] = server["log_tail"]
    shutil.rmtree(run_dir, ignore_errors=True)
    return rows


def gpu_memory_gib() -> float:
    """The GPU's memory from nvidia-smi (no CUDA context in this process); 0 without one."""
    if not shutil.which("nvidia-smi"):
        return 0.0
    q = subprocess.run(["nvidia-smi", "--query-gpu=memory.total", "--format=csv,noheader,nounits"],
                       capture_output=True, text=True).stdout.split()
    return float(q[0]) / 1024 if q else 0.0


def main_parent(a) -> int:
    t0 = time.time()
    # SIGTERM (the stage's `timeout`) ends the running run's processes (_run_group, serve's finally) and leaves the
    # JSON of the runs done: it is rewritten after each.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    gib = gpu_memory_gib()
    if a.moe_layers == 0:
        a.moe_layers = 2 if a.device == "cpu" else 6 if gib > 100 else 4
    a.anchor = ro.find_anchor(a.anchor)
    r = ro.make_rollouts(vocab_of(a.fwd_shape), scale=a.scale, anchor=a.anchor)
    T = ro.token_budget(r)
    tmp = Path(tempfile.mkdtemp(prefix="rlbench-parent-"))
    anchor_env = {"OUT": str(tmp)}  # the anchor appends its lines to $OUT/results.jsonl: kept out of the stage's
    from importlib.metadata import version

    env = {"gpu_memory_GiB": round(gib, 1), "torch": version("torch"), "transformers": version("transformers"),
           "T": T, "data": r.summary(), "moe_layers": a.moe_layers, "args": {k: str(v) for k, v in vars(a).items()}}
    rows: list[dict] = []
    parts = [p for p in a.parts.split(",") if p]

    def write(complete: bool) -> None:
        S = summarize(rows, r, a)
        for key, name in (("ppo_profile", "ppo_compare.json"), ("moe_fwd_profile", "moe_fwd_compare.json")):
            if a.prof_out and S.get(key):
                Path(a.prof_out).mkdir(parents=True, exist_ok=True)
                (Path(a.prof_out) / name).write_text(json.dumps(S[key], indent=1))
        if a.out:
            Path(a.out).write_text(json.dumps({"env": env, "summary": S, "rows": rows, "complete": complete},
                                              indent=1))
        return S

    def go(part: str, system: str, label: str, cap_key: str, make, env_add=None) -> None:
        left = a.budget - (time.time() - t0)
        if left < MIN_START * CAPS[cap_key]:
            rows.append({"part": part, "system": system, "label": label, "skipped": f"budget ({left:.0f} s left)"})
        else:
            cap = int(min(CAPS[cap_key], left - 5))
            rows.append({"part": part, "system": system, **run(label, make(cap), cap, env_add)})
        print(json.dumps({k: v for k, v in rows[-1].items() if k != "lines"})[:400], flush=True)
        write(False)

    inputs = {(s, lora): tmp / f"inputs_{s}_lora{lora}.npz" for s in SHAPES for lora in (0, LORA_RANK)}

    def run_part(part: str, only: str) -> None:
        """One part, both systems (only="") or one ("shardfit", "hf")."""

        def want(system: str) -> bool:
            return not only or only == system

        if part == "dense-fwd":
            s = a.fwd_shape
            what = "fwd,prof" if a.prof_out else "fwd"
            if want("shardfit"):
                go("dense-fwd", "shardfit", f"shardfit Engine.forward {s}", "sf-prof" if a.prof_out else "sf",
                   lambda cap: worker_cmd(a, "sf", "--shape", s, "--what", what))
            if want("hf"):
                go("dense-fwd", "hf", f"HF anchor C {s} ({a.hf_fwd})", "hf",
                   lambda cap: anchor_cmd(a, s, T, False, cap), anchor_env)
        elif part == "dense-ppo":
            s = a.ppo_shape
            if want("shardfit"):
                go("dense-ppo", "shardfit", f"shardfit Engine PPO {s} full FT", "sf",
                   lambda cap: worker_cmd(a, "sf", "--shape", s, "--what", "ppo", "--save-inputs",
                                          str(inputs[s, 0])))
            if want("hf"):
                go("dense-ppo", "hf", f"HF anchor E {s} ({a.hf_ppo})", "hf",
                   lambda cap: anchor_cmd(a, s, T, True, cap), anchor_env)
        elif part == "lora-ppo":  # issues 23 + 24: the anchor's part D, LoRA r=16 alpha 32, all 7 linears, full AC
            s, prof = a.fwd_shape, bool(a.prof_out)  # --prof-out: one step of each side profiled after the timed
            if want("shardfit"):
                go("lora-ppo", "shardfit", f"shardfit Engine PPO {s} LoRA r{LORA_RANK}", "sf-prof-ppo" if prof
                   else "sf", lambda cap: worker_cmd(a, "sf", "--shape", s, "--what", "ppo,profppo,ceiling" if prof
                                                     else "ppo", "--lora", str(LORA_RANK), "--save-inputs",
                                                     str(inputs[s, LORA_RANK])))
            if want("hf"):  # profiled: the anchor's part D through its own functions (bench_rl_workers.worker_hf_lora)
                go("lora-ppo", "hf", f"HF anchor D {s} PEFT ({a.hf_ppo})" + (" profiled" if prof else ""),
                   "hf-prof-ppo" if prof else "hf",
                   lambda cap: worker_cmd(a, "hf-lora", "--shape", s) if prof else
                   anchor_cmd(a, s, T, False, cap, lora=True), anchor_env)
            if only == "hf-noac":  # asked for by name only: the anchor without gradient checkpointing
                go("lora-ppo", "hf-noac", f"HF anchor D {s} PEFT ({a.hf_ppo}) no gradient checkpointing", "hf",
                   lambda cap: anchor_cmd(a, s, T, False, cap, lora=True, no_ac=True), anchor_env)
        elif part == "moe":
            if want("shardfit"):  # --prof-out: one forward profiled (and the anchor's, in hf-moe)
                go("moe", "shardfit", f"shardfit Engine moe{a.moe_layers}", "sf-moe",
                   lambda cap: worker_cmd(a, "sf", "--shape", "moe", "--what",
                                          "ppo,weights,export" + (",prof1" if a.prof_out else "")))
            if want("hf"):
                go("moe", "hf", f"HF Qwen3Moe moe{a.moe_layers} (grouped_mm)", "hf-moe",
                   lambda cap: worker_cmd(a, "hf-moe"), anchor_env)
        elif part == "serve":
            s, lora = a.serve_shape, a.serve_lora
            path = inputs[s, lora]
            if not path.is_file():  # the in-process figure and the PPO inputs of this shape
                go("serve", "shardfit", f"shardfit Engine PPO {s} in process", "sf",
                   lambda cap: worker_cmd(a, "sf", "--shape", s, "--what", "ppo", "--lora", str(lora),
                                          "--save-inputs", str(path)))
            left = a.budget - (time.time() - t0)
            if not path.is_file() or left < MIN_START * (CAPS["server"] + CAPS["sdk"]):
                rows.append({"part": "serve", "system": "sdk", "label": f"tinker SDK -> serve {s}",
                             "skipped": f"no in-process inputs for {s}" if not path.is_file() else
                             f"budget ({left:.0f} s left)"})
            else:
                srv, *sdk = serve(a, s, T, int(min(CAPS["server"], left / 2)), int(min(CAPS["sdk"], left / 2)),
                                  path)
                rows.append({"part": "serve", "system": "server", **srv})
                rows.extend({"part": "serve", "system": "sdk", **x} for x in sdk)
            for row in rows[-2:]:
                print(json.dumps({k: v for k, v in row.items() if k != "lines"})[:400], flush=True)
            write(False)
        else:
            raise SystemExit(f"unknown part {part!r}: dense-fwd, dense-ppo, lora-ppo, moe, serve "
                             "(each optionally /shardfit or /hf)")

    for spec in parts:  # in the order given: the JSON keeps the parts done when the stage's cap ends a later one
        run_part(*spec.partition("/")[::2])  # "part": both systems; "part/shardfit" or "part/hf": one of them
    S = write(True)
    shutil.rmtree(tmp, ignore_errors=True)
    table(rows, S)
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--parts", default="dense-fwd,dense-ppo,moe,serve")
    ap.add_argument("--out", default="")
    ap.add_argument("--budget", type=float, default=510.0, help="seconds for all parts (runs capped to what is left)")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--fwd-reps", type=int, default=0, help="timed forward passes of a PPO part's worker (0: --reps)")
    ap.add_argument("--serve-lora", type=int, default=0, choices=(0, LORA_RANK),
                    help="serve LoRA of this rank (the in-process figure then comes from lora-ppo); 0: every parameter")
    ap.add_argument("--prof-out", default="", help="profiles into this directory (rl_profile's kernel classes): "
                    "dense-fwd Engine.forward now and with session 14's settings; lora-ppo one PPO step of each side "
                    "and the card's matmul ceiling; moe one forward of each side")
    ap.add_argument("--scale", type=float, default=1.0, help="rollout lengths x this (CPU checks)")
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    ap.add_argument("--anchor", default=None, help="hf_rl_step.py (default: .anchors/, then shared/anchors/)")
    ap.add_argument("--fwd-shape", default="8b", choices=list(SHAPES))
    ap.add_argument("--ppo-shape", default="1.7b", choices=list(SHAPES))
    ap.add_argument("--serve-shape", default="1.7b", choices=list(SHAPES))
    ap.add_argument("--moe-layers", type=int, default=0, help="0: 6 on a GPU over 100 GiB, else 4")
    ap.add_argument("--hf-fwd", default="padnm,pad", help="the anchor's forward layouts")
    ap.add_argument("--hf-ppo", default="pack_flex", help="the anchor's PPO layouts")
    ap.add_argument("--sf-extra", default="", help="more Engine overrides, space-separated (one change)")
    ap.add_argument("--logprobs-at", default="all", choices=("all", "counted"),
                    help="shardfit's loss_fn_config logprobs_at: counted scores the response tokens alone (the "
                    "anchor's output); the forward is then also timed with all, in the same worker")
    ap.add_argument("--cpu-check", action="store_true", help="tiny shapes on CPU, scale 0.02, one rep: machinery")
    ap.add_argument("--worker", choices=list(WORKERS), help=argparse.SUPPRESS)
    ap.add_argument("--shape", default="", help=argparse.SUPPRESS)
    ap.add_argument("--what", default="fwd", help=argparse.SUPPRESS)
    ap.add_argument("--save-inputs", default="", help=argparse.SUPPRESS)
    ap.add_argument("--url", default="", help=argparse.SUPPRESS)
    ap.add_argument("--lora", type=int, default=0, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.worker:
        return WORKERS[a.worker](a)
    if a.cpu_check:
        a.device, a.scale, a.reps, a.budget = "cpu", 0.02, 1, max(a.budget, 1800)
        a.fwd_shape = a.ppo_shape = a.serve_shape = "tiny"
        a.hf_ppo = "pad"  # flex_attention on CPU compiles for minutes
        for k in CAPS:
            CAPS[k] = 600
    return main_parent(a)


if __name__ == "__main__":
    raise SystemExit(main())
