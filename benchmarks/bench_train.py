"""Run shardfit and the anchor recipes on one machine in one invocation; print one table of ratios.

  python benchmarks/bench_train.py --suite SUITE --nproc N [--anchors DIR] [--out FILE.json]

Each case is a fresh `torchrun --standalone` job. shardfit figures are the median over steps after the first three
(metrics.jsonl, one record per step); anchor figures are the JSON line the anchor script prints (median after three
warm-up steps, the same rule). Memory: the largest per-rank peak over the measured steps. Read benchmarks/README.md
for how the committed results were produced.

Variable-length suites (issue 12; VARLEN_SUITES below): the fine-tuning set of benchmarks/gen_sft_data.py, made
under --data (default /tmp/sft_varlen) unless it is there already. Their cases are `shardfit train` runs and
benchmarks/anchor_sft.py (the HF + Liger recipe on the same examples, padded); tokens per second per GPU are sums
over the measured steps (steps after the first three), counted three ways: loss-bearing tokens, real (non-padding)
tokens and row capacity. The JSON's "summary" holds the issue's ratios (packed_vs_padded: loss-bearing tokens/s/GPU
of shardfit packed over shardfit padded; masked_vs_unmasked) and, for flat300, the memory-flatness table.
  python benchmarks/bench_train.py --suite varlen8b  --nproc 2 --out varlen8b.json     # 2 GPUs, ~5 min
  python benchmarks/bench_train.py --suite docmask8b --nproc 2 --out docmask8b.json    # 2 GPUs, ~3-4 min
  python benchmarks/bench_train.py --suite flat300   --nproc 1 --out flat300.json      # 1 GPU, ~5-6 min
  python benchmarks/bench_train.py --suite varlen_cpu --nproc 2                        # CPU check of the above
Issue 13, CPU offload (SUITES["offload8b"]): Llama-3-8B, seq 4096, parallel.offload=all on one GPU, ~3 min a case
(--only LABEL runs one: three cases exceed a 10-minute device call).
  python benchmarks/bench_train.py --suite offload8b --nproc 1 --timeout 270 --out offload8b.json
Issue 23, QLoRA of the 70B shape on one GPU (SUITES["qlora70b"], bitsandbytes installed; device_run.sh's stage):
  python benchmarks/bench_train.py --suite qlora70b --nproc 1 --timeout 260 --out qlora70b.json    # ~6-8 min
Issue 23, LoRA of the Qwen3-30B-A3B shape on one GPU (SUITES["lora30b"]: the HF + PEFT anchors, then shardfit):
  python benchmarks/bench_train.py --suite lora30b --nproc 1 --timeout 145 --out lora30b.json      # ~3-4 min
  python benchmarks/bench_train.py --suite lora30b_cpu --nproc 1                                   # CPU check
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

from bench_suites import SUITES, SUMMARIES, VARLEN_DATA, VARLEN_SUITES, VARLEN_WARM  # noqa: E402  (apart)


def _fill(args: list[str], nproc: int) -> list[str]:
    for k in (2, 3, 4, 5, 6, 8, 10, 20):
        args = [a.replace(f"{{{k}n}}", str(k * nproc)) for a in args]
    return args


def run_shardfit(label: str, args: list[str], nproc: int, timeout: int) -> dict:
    run_dir = Path(tempfile.mkdtemp(prefix="sf-bench-"))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", "-m",
           "shardfit", "train", *args, f"--logging.run_dir={run_dir}", "--logging.log_every=1",
           "--logging.progress=lines", "--checkpoint.final=false", "--checkpoint.resume=none"]
    rc, stdout, stderr, timed_out, wall = _run_group(cmd, timeout)  # its workers ended with it on a timeout
    out = {"system": "shardfit", "label": label, "nproc": nproc, "wall_s": round(wall, 1), "rc": rc,
           "cmd": "torchrun ... -m shardfit train " + " ".join(args)}
    metrics = run_dir / "metrics.jsonl"
    recs = [json.loads(x) for x in metrics.read_text().splitlines()] if metrics.is_file() else []
    steady = [r for r in recs if r["step"] > min(3, len(recs) - 1)]  # after warm-up; the last step of short runs
    if rc != 0 or not steady:
        out["error"] = "timeout" if timed_out else (stderr or stdout)[-1500:]
        out["oom"] = "OutOfMemoryError" in (stderr or "")
        return out
    out["losses"] = [round(r["loss"], 5) for r in recs]
    out.update(tok_s_gpu=round(statistics.median(r["tokens_per_s_per_gpu"] for r in steady)),
               mfu=round(statistics.median(r["mfu"] for r in steady), 3) if steady[0]["mfu"] else None,
               peak_alloc_GiB=round(max(r["peak_allocated_max"] for r in steady), 2),
               peak_reserved_GiB=round(max(r["peak_reserved_max"] for r in steady), 2),
               alloc_min_GiB=round(min(r["peak_allocated_min"] for r in steady), 2),
               retries=max(r["alloc_retries_max"] for r in steady), final_loss=round(recs[-1]["loss"], 4))
    if "time_forward_s" in steady[-1]:  # rank 0's phase times (train/timing.py), median seconds per step
        out["phases_s"] = {k: round(statistics.median(r[f"time_{k}_s"] for r in steady), 4)
                           for k in ("forward", "backward", "optimizer", "comm_wait")}
    profiles = sorted((run_dir / "profile").glob("step*_summary.json"))  # --logging.profile_step
    if profiles:
        out["profile"] = json.loads(profiles[-1].read_text())
        keep = os.environ.get("BENCH_KEEP_TRACES")  # a folder: the rank-0 trace is copied there, named by case
        if keep:
            shutil.copy(out["profile"]["trace"], Path(keep) / (label.replace(" ", "_") + ".json.gz"))
    doctor = sorted((run_dir / "snapshots").glob("doctor_step*.txt"))
    if doctor:
        out["doctor"] = doctor[-1].read_text()
    return out


ONE_GPU_ANCHORS = {"peft": "anchor_peft_lora.py", "peft-qlora": "anchor_peft_qlora.py",
                   "peft-moe": "anchor_peft_lora_moe.py"}


def run_anchor(label: str, args: list[str], nproc: int, anchors: Path, timeout: int, kind: str = "anchor") -> dict:
    """The dense FSDP2 recipe (shared/anchors/plain_fsdp2_llama.py, under torchrun), or with kind "peft" the HF +
    PEFT LoRA recipe (benchmarks/anchor_peft_lora.py, one process on one GPU, as PEFT users run it), "peft-qlora"
    the same on a bitsandbytes 4-bit base (anchor_peft_qlora.py), "peft-moe" on the Qwen3-MoE shape
    (anchor_peft_lora_moe.py)."""
    if kind in ONE_GPU_ANCHORS:
        cmd = [sys.executable, str(ROOT / "benchmarks" / ONE_GPU_ANCHORS[kind]), *args]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
               str(anchors / "plain_fsdp2_llama.py"), *args, "--steps", "14"]
    rc, stdout, stderr, timed_out, wall = _run_group(cmd, timeout)
    out = {"system": "anchor", "label": label, "nproc": nproc, "wall_s": round(wall, 1), "rc": rc,
           "cmd": " ".join(Path(c).name if i < 2 else c for i, c in enumerate(cmd[1:]))}
    lines = [x for x in stdout.splitlines() if x.startswith("{")]
    if not lines:
        out["error"] = "timeout" if timed_out else (stderr or stdout)[-1500:]
        return out
    r = json.loads(lines[-1])
    out.update(tok_s_gpu=r.get("tok_s_gpu"), mfu=r.get("mfu"), peak_alloc_GiB=r.get("peak_alloc_GiB"),
               peak_reserved_GiB=r.get("peak_reserved_GiB"), retries=r.get("retries"), oom=r.get("oom", False))
    out.update({k: r[k] for k in ("build_s", "built_GiB", "prep", "adapter_dtype", "final_loss", "mbs", "targets",
                                  "experts_impl", "trainable", "step_s") if k in r})
    return out


def _start_time(pid: int) -> str | None:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def _descendants(pid: int) -> list[tuple[int, str]]:
    """(pid, start time) of every process below pid (from /proc): torchrun's workers run in sessions of their own."""
    children: dict[int, list[int]] = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                ppid = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(d.name))
    out, todo = [], [pid]
    while todo:
        for c in children.get(todo.pop(), []):
            out.append((c, _start_time(c)))
            todo.append(c)
    return out


def _stop(p: subprocess.Popen) -> tuple[str, str]:
    """End a case: SIGTERM to torchrun (it stops its workers), then SIGKILL to whatever of it is left (each process
    checked by its start time, so that a reused pid is left alone)."""
    below = _descendants(p.pid)
    try:
        os.killpg(p.pid, signal.SIGTERM)
        out, err = p.communicate(timeout=30)
    except (ProcessLookupError, subprocess.TimeoutExpired):
        out, err = "", ""
    if p.poll() is None:
        p.kill()
        p.wait()
    for pid, started in below:
        if started is not None and _start_time(pid) == started:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    return out or "", err or ""


def _run_group(cmd: list[str], timeout: int) -> tuple[int, str, str, bool, float]:
    """Run cmd (a torchrun) in a session of its own; on timeout, or when this script is stopped, end it and its
    workers (a worker left behind would hold its GPU through the next case). (rc, stdout, stderr, timed out, s)."""
    t0 = time.time()
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT,
                         start_new_session=True)
    try:
        out, err = p.communicate(timeout=timeout)
        return p.returncode, out, err, False, time.time() - t0
    except subprocess.TimeoutExpired:
        out, err = _stop(p)
        return -9, out, err, True, time.time() - t0
    except BaseException:  # SIGTERM of this script (SystemExit) or Ctrl-C
        _stop(p)
        raise


def _aggregate(recs: list[dict], nproc: int, first: int = 3) -> dict:
    """Token rates over the steps after `first`, as sums: each step's seconds from its loss-token count (tokens_seen
    grows by the world's loss tokens) over its loss-token rate, so that steps of different lengths weigh by time."""
    by_step = {r["step"]: r for r in recs}
    secs = loss = real = cap = 0.0
    for r in recs:
        prev = by_step.get(r["step"] - 1, {"tokens_seen": 0} if r["step"] == 1 else None)
        rate = r.get("loss_tokens_per_s_per_gpu") or 0.0
        if r["step"] <= first or prev is None or rate <= 0:
            continue
        dt = (r["tokens_seen"] - prev["tokens_seen"]) / nproc / rate
        secs += dt
        loss += rate * dt
        real += r["real_tokens_per_s_per_gpu"] * dt
        cap += r["tokens_per_s_per_gpu"] * dt
    if secs <= 0:
        return {}
    steady = [r for r in recs if r["step"] > first]
    mfus = [r["mfu"] for r in steady if r.get("mfu")]
    return {"loss_tok_s_gpu": round(loss / secs), "real_tok_s_gpu": round(real / secs), "tok_s_gpu": round(cap / secs),
            "fill": round(real / cap, 4), "loss_share": round(loss / cap, 4),
            "loss_tok_s_gpu_median": round(statistics.median(r["loss_tokens_per_s_per_gpu"] for r in steady)),
            "tok_s_gpu_median": round(statistics.median(r["tokens_per_s_per_gpu"] for r in steady)),
            "mfu": round(statistics.median(mfus), 3) if mfus else None, "measured_s": round(secs, 2),
            "measured_steps": len(steady)}


def steady_summary(recs: list[dict]) -> dict:
    """From a run's metrics.jsonl records: the last step and loss, the peaks after step 3, the allocator retries and
    the median phase times (shardfit records them with logging.log_every=1)."""
    steady = [r for r in recs if r["step"] > 3] or recs
    out = dict(steps_done=recs[-1]["step"], final_loss=round(recs[-1]["loss"], 4),
               peak_alloc_GiB=round(max(r["peak_allocated_max"] for r in steady), 2),
               peak_reserved_GiB=round(max(r["peak_reserved_max"] for r in steady), 2),
               retries=int(max(r["alloc_retries_max"] for r in recs)))
    if "time_forward_s" in steady[-1]:
        out["phases_s"] = {k: round(statistics.median(r[f"time_{k}_s"] for r in steady), 4)
                           for k in ("forward", "backward", "optimizer", "comm_wait")}
    return out


def run_shardfit_vl(label: str, args: list[str], nproc: int, timeout: int) -> dict:
    """A variable-length case: `shardfit train` with one metrics record per step; figures from whatever steps
    were recorded (a run cut short by the timeout still reports them, flagged)."""
    run_dir = Path(tempfile.mkdtemp(prefix="sf-bench-vl-"))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", "-m",
           "shardfit", "train", *args, f"--logging.run_dir={run_dir}", "--logging.log_every=1",
           "--logging.progress=lines", "--checkpoint.final=false", "--checkpoint.resume=none"]
    rc, stdout, stderr, timed_out, wall = _run_group(cmd, timeout)
    out = {"system": "shardfit", "label": label, "nproc": nproc, "wall_s": round(wall, 1), "rc": rc,
           "timed_out": timed_out, "cmd": "torchrun ... -m shardfit train " + " ".join(args)}
    out["notes"] = [x for x in stdout.splitlines() if x.startswith(("fine-tuning", "shardfit:", "warning", "note"))]
    metrics = run_dir / "metrics.jsonl"
    recs = [json.loads(x) for x in metrics.read_text().splitlines()] if metrics.is_file() else []
    recs = [r for r in recs if not r.get("eval")]
    shutil.rmtree(run_dir, ignore_errors=True)
    if rc != 0 and not timed_out:
        out["error"] = (stderr or stdout)[-1500:]
        out["oom"] = "OutOfMemoryError" in stderr or "out of memory" in stderr
    if not recs:
        out.setdefault("error", "no metrics recorded" + (" (timeout)" if timed_out else ""))
        return out
    out.update(_aggregate(recs, nproc))
    out.update(steady_summary(recs))
    out["per_step"] = [{"step": r["step"], "reserved": round(r["peak_reserved_max"], 4),
                        "allocated": round(r["peak_allocated_max"], 4), "retries": int(r["alloc_retries_max"]),
                        "loss_tok_s_gpu": round(r["loss_tokens_per_s_per_gpu"])} for r in recs]
    return out


def run_anchor_sft(label: str, args: list[str], nproc: int, timeout: int) -> dict:
    """benchmarks/anchor_sft.py: its final JSON line, and its per-step lines when it prints them."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
           str(ROOT / "benchmarks/anchor_sft.py"), *args]
    rc, stdout, stderr, timed_out, wall = _run_group(cmd, timeout)
    out = {"system": "anchor", "label": label, "nproc": nproc, "wall_s": round(wall, 1), "rc": rc,
           "timed_out": timed_out, "cmd": "torchrun benchmarks/anchor_sft.py " + " ".join(args)}
    lines = [json.loads(x) for x in stdout.splitlines() if x.startswith("{")]
    steps = [x for x in lines if x.get("per_step")]
    final = [x for x in lines if not x.get("per_step")]
    if steps:
        out["per_step"] = [{"step": x["step"], "reserved": x["peak_reserved_GiB"], "allocated": x["peak_alloc_GiB"],
                            "retries": x["retries"], "width": x["width"]} for x in steps]
    if final and not final[-1].get("oom"):
        r = final[-1]
        out.update({k: r.get(k) for k in ("loss_tok_s_gpu", "real_tok_s_gpu", "tok_s_gpu", "fill", "loss_share",
                                          "mfu", "step_s", "peak_alloc_GiB", "peak_reserved_GiB", "retries",
                                          "measured_steps", "final_loss")})
        out["steps_done"] = r.get("steps")
    else:
        out["oom"] = bool(final and final[-1].get("oom"))
        out["error"] = "OOM" if out["oom"] else (stderr or stdout)[-1500:] + (" (timeout)" if timed_out else "")
        if steps:  # cut short: the steps it printed
            out["steps_done"] = steps[-1]["step"]
            out["retries"] = steps[-1]["retries"]
    return out


def flatness(per_step: list[dict], warm: int) -> dict:
    """The memory table of issue 12 over the steps after `warm`: peak reserved max - min as % of max (target <= 2),
    allocator retries (total, and after warm-up; target 0), reserved over allocated (target <= 1.05) both as the
    largest per-step ratio and as the ratio of the two peaks."""
    after = [r for r in per_step if r["step"] > warm]
    if not after or not after[-1]["allocated"]:
        return {}
    resv = [r["reserved"] for r in after]
    before = [r["retries"] for r in per_step if r["step"] <= warm]
    spread = 100 * (max(resv) - min(resv)) / max(resv)
    per_step_ratio = max(r["reserved"] / r["allocated"] for r in after if r["allocated"])
    peak_ratio = max(resv) / max(r["allocated"] for r in after)
    retries_after = after[-1]["retries"] - (before[-1] if before else 0)
    return {"steps": f"{after[0]['step']}-{after[-1]['step']}", "reserved_min_GiB": round(min(resv), 2),
            "reserved_max_GiB": round(max(resv), 2), "reserved_spread_pct": round(spread, 2),
            "retries_total": after[-1]["retries"], "retries_after_warmup": retries_after,
            "resv_over_alloc_step_max": round(per_step_ratio, 3), "resv_over_alloc_peaks": round(peak_ratio, 3),
            "flat": spread <= 2.0, "no_retries": after[-1]["retries"] == 0, "resv_ok": peak_ratio <= 1.05}


def _role(row: dict) -> str:
    """What a variable-length case is, from its label: padded / packed / budget / anchor (padded) / unmasked /
    masked-KERNEL / '' (e.g. the anchor's dynamic padding)."""
    label = row["label"]
    if "pretrain" in label:
        return "unmasked" if "unmasked" in label else "masked-" + label.split()[-1]
    if row["system"] == "anchor":
        return "anchor" if "padded" in label else ""
    for key, role in (("padded", "padded"), ("packed", "packed"), ("token budget", "budget")):
        if key in label:
            return role
    return ""


def summarize_varlen(rows: list[dict], warm: int | None) -> dict:
    """The issue's ratios from whichever cases ran; for each role the first run without allocator retries (else
    the first that ran)."""
    ok = [r for r in rows if r.get("loss_tok_s_gpu") and not r.get("timed_out")]
    pick: dict[str, dict] = {}
    for r in ok:
        role = _role(r)
        if role and (role not in pick or (pick[role].get("retries") and not r.get("retries"))):
            pick[role] = r
    out: dict = {"cases": {k: v["label"] for k, v in pick.items()}}

    def ratio(a: str, b: str, key: str = "loss_tok_s_gpu") -> float | None:
        if a in pick and b in pick and pick[b].get(key):
            return round(pick[a][key] / pick[b][key], 3)
        return None

    for name, a, b, key in (("packed_vs_padded", "packed", "padded", "loss_tok_s_gpu"),
                            ("packed_vs_anchor", "packed", "anchor", "loss_tok_s_gpu"),
                            ("budget_vs_padded", "budget", "padded", "loss_tok_s_gpu"),
                            ("budget_vs_packed", "budget", "packed", "loss_tok_s_gpu"),
                            ("padded_vs_anchor_rows", "padded", "anchor", "tok_s_gpu")):
        v = ratio(a, b, key)
        if v is not None:
            out[name] = v
    if "packed_vs_padded" in out:
        out["packed_vs_padded_target_4x"] = out["packed_vs_padded"] >= 4.0
    # document masks: each masked case against the unmasked one of the same micro-batch (label "... mbsN ...")
    masked = {}
    for r in ok:
        role = _role(r)
        if role.startswith("masked-"):
            mbs = next((w for w in r["label"].split() if w.startswith("mbs")), "")
            base = next((u for u in ok if _role(u) == "unmasked" and mbs in u["label"].split()), None)
            if base and role[7:] not in masked:
                masked[role[7:]] = round(r["real_tok_s_gpu"] / base["real_tok_s_gpu"], 3)
    if masked:
        out["masked_vs_unmasked"] = masked
        out["masked_target_0.95"] = {k: v >= 0.95 for k, v in masked.items()}
    if warm is not None:
        out["flatness"] = {r["label"]: r["flatness"] for r in rows if r.get("flatness")}
    return out


def varlen_main(a) -> int:
    import torch

    sys.path.insert(0, str(ROOT / "benchmarks"))
    from gen_sft_data import ensure

    extra = VARLEN_DATA.get(a.suite, {})
    data = Path(a.data + "".join(f"_{k}{v}" for k, v in extra.items()))
    t0 = time.time()
    ensure(data, **extra)
    summary_file = json.loads((data / "summary.json").read_text())
    print(f"data {data}: {summary_file['examples']:,} examples, median {summary_file['median']:.0f}, p99 "
          f"{summary_file['p99']:.0f} tokens ({time.time() - t0:.1f} s)", flush=True)
    env = {"gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu", "torch": torch.__version__,
           "nproc": a.nproc, "suite": a.suite, "data": str(data), "data_summary": summary_file,
           "alloc_conf_env": os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "")}
    warm = VARLEN_WARM.get(a.suite)
    # SIGTERM (a stage's time cap, device_run.sh) ends the running case's processes and leaves the JSON of the
    # cases done: it is rewritten after each case.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    rows: list[dict] = []
    queue = list(VARLEN_SUITES[a.suite])
    while queue:
        kind, label, args, *fallback = queue.pop(0)
        if a.only and label not in a.only:
            continue
        args = [x.replace("{data}", str(data)) for x in _fill(args, a.nproc)]
        run = run_shardfit_vl if kind == "sf" else run_anchor_sft
        row = run(label, args, a.nproc, a.timeout)
        if warm is not None and row.get("per_step"):
            row["flatness"] = flatness(row["per_step"], warm)
        rows.append(row)
        print(json.dumps({k: v for k, v in row.items() if k != "per_step"}), flush=True)
        if a.out:
            Path(a.out).write_text(json.dumps({"env": env, "summary": summarize_varlen(rows, warm), "rows": rows,
                                               "complete": False}, indent=1))
        if fallback and (not row.get("loss_tok_s_gpu") or row.get("retries") or row.get("timed_out")):
            print(f"{label}: failed or retried; running its fallback cases", flush=True)
            queue[:0] = fallback[0]
    summary = summarize_varlen(rows, warm)
    if a.out:
        Path(a.out).write_text(json.dumps({"env": env, "summary": summary, "rows": rows, "complete": True},
                                          indent=1))
    print(f"\n{env['gpu']} x{a.nproc}, torch {env['torch']}, suite {a.suite}; tokens/s/GPU: loss-bearing, real, "
          f"row capacity (sums over steps > 3)")
    print(f"{'case':40} {'loss':>8} {'real':>8} {'rows':>8} {'fill':>5} {'MFU':>5} {'alloc/resv GiB':>14} "
          f"{'retry':>5} {'wall s':>6}")
    for r in rows:
        if r.get("loss_tok_s_gpu"):
            mfu = f"{r['mfu']:.3f}" if r.get("mfu") else "-"
            print(f"{r['label']:40} {r['loss_tok_s_gpu']:>8,} {r['real_tok_s_gpu']:>8,} {r['tok_s_gpu']:>8,} "
                  f"{r['fill']:>5.2f} {mfu:>5} {r['peak_alloc_GiB']:>6.1f}/{r['peak_reserved_GiB']:<7.1f} "
                  f"{r['retries']:>5} {r['wall_s']:>6.0f}" + ("  TIMED OUT" if r.get("timed_out") else ""))
        else:
            print(f"{r['label']:40} {'OOM' if r.get('oom') else 'FAILED':>8}  {str(r.get('error', ''))[-160:]!r}")
    if summary.get("flatness"):
        print(f"\nmemory after step {warm} (per-step peaks; targets: spread <= 2%, 0 retries, reserved <= 1.05x "
              f"allocated)")
        print(f"{'case':40} {'steps':>8} {'reserved GiB':>13} {'spread %':>8} {'retries':>7} {'resv/alloc':>10}")
        for label, f in summary["flatness"].items():
            print(f"{label:40} {f['steps']:>8} {f['reserved_min_GiB']:>6.2f}-{f['reserved_max_GiB']:<6.2f} "
                  f"{f['reserved_spread_pct']:>8.2f} {f['retries_total']:>7} {f['resv_over_alloc_peaks']:>10.3f}")
    for k, v in summary.items():
        if k not in ("flatness", "cases"):
            print(f"{k}: {v}")
    return 0


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--suite", required=True, choices=sorted([*SUITES, *VARLEN_SUITES]))
    ap.add_argument("--data", default="/tmp/sft_varlen", help="variable-length suites: the data directory "
                    "(benchmarks/gen_sft_data.py makes it when missing)")
    ap.add_argument("--nproc", type=int, default=1)
    ap.add_argument("--anchors", default=str(ROOT / ".anchors"))
    ap.add_argument("--out", default="")
    ap.add_argument("--timeout", type=int, default=300)
    ap.add_argument("--only", nargs="*", default=[], help="run only the cases with these labels")
    a = ap.parse_args()
    if a.suite in VARLEN_SUITES:
        return varlen_main(a)
    import torch

    env = {"gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu",
           "torch": torch.__version__, "nproc": a.nproc, "suite": a.suite,
           "alloc_conf_env": os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "")}
    # SIGTERM (a stage's time cap, device_run.sh) ends the running case's processes; --out, rewritten after each
    # case, keeps those done. A case that fails is followed by its fallback cases (bench_suites.py).
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    rows, queue = [], list(SUITES[a.suite])
    summarize = SUMMARIES.get(a.suite, lambda r: {})
    while queue:
        kind, label, args, *fallback = queue.pop(0)
        if a.only and label not in a.only:
            continue
        args = _fill(args, a.nproc)
        row = (run_shardfit(label, args, a.nproc, a.timeout) if kind == "shardfit"
               else run_anchor(label, args, a.nproc, Path(a.anchors), a.timeout, kind))
        rows.append(row)
        print(json.dumps(row), flush=True)
        if a.out:
            Path(a.out).write_text(json.dumps({"env": env, "summary": summarize(rows), "rows": rows,
                                               "complete": False}, indent=1))
        if fallback and not row.get("tok_s_gpu"):
            print(f"{label}: failed; running its fallback cases", flush=True)
            queue[:0] = fallback[0]
    best_anchor = max((r.get("tok_s_gpu") or 0 for r in rows if r["system"] == "anchor"), default=0)
    print(f"\n{env['gpu']} x{a.nproc}, torch {env['torch']}, suite {a.suite}")
    print(f"{'case':34} {'tok/s/gpu':>10} {'MFU':>6} {'alloc':>7} {'resv':>7} {'resv/alloc':>10} {'retry':>5} "
          f"{'vs best anchor':>14}  fwd/bwd/opt/comm-wait s")
    for r in rows:
        if r.get("tok_s_gpu"):
            ratio = f"{r['tok_s_gpu'] / best_anchor:.2f}x" if best_anchor else "-"
            ra = r["peak_reserved_GiB"] / r["peak_alloc_GiB"] if r.get("peak_alloc_GiB") else 0
            print(f"{r['label']:34} {r['tok_s_gpu']:>10,} {r['mfu'] or 0:>6.3f} {r['peak_alloc_GiB']:>7.1f} "
                  f"{r['peak_reserved_GiB']:>7.1f} {ra:>10.2f} {r['retries']:>5.0f} {ratio:>14}  "
                  + "/".join(f"{v:.3f}" for v in r.get("phases_s", {}).values()))
        else:
            print(f"{r['label']:34} {'OOM' if r.get('oom') else 'FAILED':>10}")
    curves = [r for r in rows if len(r.get("losses", [])) >= 50]
    if len(curves) > 1:  # the loss curves against the first case's, step by step
        base = curves[0]["losses"]
        print(f"\nloss curves against '{curves[0]['label']}' ({len(base)} steps, {base[0]:.3f} -> {base[-1]:.3f})")
        for r in curves[1:]:
            d = [abs(x - y) for x, y in zip(r["losses"], base)]
            r["curve_vs_first"] = {"max_abs": round(max(d), 5), "mean_abs": round(sum(d) / len(d), 5),
                                   "final": r["losses"][-1]}
            print(f"{r['label']:40} max |diff| {max(d):.4f}, mean |diff| {sum(d) / len(d):.4f}, "
                  f"final {r['losses'][-1]:.4f}")
    summary = summarize(rows)  # issue 23's keys (lora8b, qlora70b*): each shardfit case against the anchor
    for k, v in summary.items():
        print(f"{k}: {json.dumps(v)}")
    if a.out:
        Path(a.out).write_text(json.dumps({"env": env, "summary": summary, "rows": rows, "complete": True}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
