"""Issue 38: DPO throughput and memory, shardfit `train` against TRL's `DPOTrainer` (+ PEFT), one GPU, one call.

  python benchmarks/bench_dpo.py --out dpo.json                 # device_run.sh dpo (~7-8 min)
  python benchmarks/bench_dpo.py --tiny --out /tmp/dpo.json     # the machinery on the CPU, tiny shapes (~2 min)

Data: --pairs preference records of random tokens, each a prompt of --prompt tokens and chosen / rejected answers of
--answer tokens (+ EOS), as TRL's string layout {"prompt", "chosen", "rejected"}, through one word-level tokenizer
(tokenizer.json, one word a token id: "t17" is id 17) that both systems read: the same ids, the same lengths. A pair
is 2 x (prompt + answer + EOS) tokens; both systems' figures count each sequence's L - 1 input tokens (what
shardfit's real_tokens count), so tokens/s = pairs/s x 2 x (prompt + answer).

Cases, in this order, each a fresh process under a cap cut to what is left of --budget (the JSON is rewritten after
each; a case that has too little left is recorded as skipped):
  sf-lora8b   `shardfit train --preference.objective=dpo`, Llama-3-8B shape (random weights), LoRA r=16 alpha 32 on
              the 7 linears of every block, bf16 compute, compiled, full AC, pairs packed in token-budget rows of
              --sf-budget tokens (16,384: 8 pairs; SFT's measured LoRA optimum, 1.71x PEFT at 0.62x its peak), the
              frozen base as the reference (its log-probs in one no-grad pass before step 1: not in the step times).
              Variants (not in the default --cases; suffixes, combinable): sf-lora8b-noac no AC, 4,096-token rows
              (SFT's fastest, at more memory); -8k / -4k rows of 8,192 / 4,096 tokens (TRL's memory: session 23's
              16,384-token rows peaked at 1.33x TRL's); -fp8 the frozen base's matmuls in FP8 (tensorwise, torchao,
              carried in benchmarks/wheels_dpo), the adapters in bf16; -apart chosen and rejected as two
              documents (compute.share_prefix=false: the prompt computed twice, as before session 24); -3p rows of
              3 pairs sharing their prompt, 3 x (511 + 2 x 512) = 4,605 tokens (rows are whole [1, T]: a 4,096-token
              row holds 2 pairs of 1,535 tokens as it holds 2 of 2,046, so sharing saves row work only where T fits
              more pairs; with 16 pairs a step: 6 rows of 4,605 against 8 of 4,096); -fp8base the frozen base
              stored in FP8 (model.quantize=fp8: e4m3 with a scale per row, 7.5 GiB less, its matmuls on FP8 tensor
              cores with no per-step weight quantisation; other numerics than a bf16 base, reported apart)
  trl-lora8b  TRL DPOTrainer + PEFT on transformers' LlamaForCausalLM of the same shape, bf16 weights, LoRA r=16
              alpha 32 target_modules all-linear, as TRL documents it for one GPU: bf16, gradient checkpointing
              (non-reentrant), SDPA (flash_attention_2 when flash_attn is installed), precompute_ref_log_probs
              (the adapters-off reference once before training, like shardfit's; without it TRL runs one more
              forward a step), fused AdamW, per-device batch --trl-mbs pairs x gradient accumulation = the same
              pairs a step. TRL 1.16 has no padding_free for DPO (disabled since its refactor; it warns and pads)
              and computes log-probs through its fused LM head (no full logits): its best documented settings
  sf-full1b / trl-full1b  full fine-tuning, Llama-3.2-1B shape: shardfit's fp32 master weights and bf16 compute
              against TRL with the model in fp32 under bf16 autocast (the same precision; TRL's common bf16-weights
              load has no fp32 master and half the optimizer bytes: not like with like), both with the reference's
              log-probs precomputed (no second model). The 8B shape's full DPO needs 16 B a parameter of states
              (122 GiB): one GPU holds neither side's
Figures: the median step time after --warmup steps (shardfit: metrics.jsonl, one record a step; TRL: a callback
with CUDA synchronised at each step's ends), pairs/s, tokens/s, peak allocated / reserved GiB over the timed steps.
JSON summary: dpo_vs_trl {case: {"throughput": shardfit/TRL tokens/s, "memory": shardfit/TRL peak allocated}}.
The device lacks TRL and datasets: benchmarks/wheels_dpo (git-ignored, carried; ~2 MiB, made by
benchmarks/fetch_wheels.sh, which pins and checks them; device_run.sh's dpo stage installs what is missing into
/tmp/site) holds trl 1.16.0, datasets and their needs beyond the device's image (pyarrow and pandas are its).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_train import _run_group  # noqa: E402  (bench_train's private helpers, on purpose)

SHAPES = {  # transformers' LlamaConfig fields; shardfit's preset of the same shape
    "8b": ("llama3-8b", dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                             num_key_value_heads=8, vocab_size=128256, rope_theta=500000.0,
                             tie_word_embeddings=False)),
    "1b": ("llama3-1b", dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                             num_key_value_heads=8, vocab_size=128256, rope_theta=500000.0, tie_word_embeddings=True)),
    "tiny": ("tiny", dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                          num_key_value_heads=2, vocab_size=1024, rope_theta=10000.0, tie_word_embeddings=False)),
}
CAPS = {"sf-lora8b": 170, "trl-lora8b": 170, "sf-full1b": 100, "trl-full1b": 100}  # a variant: its base case's
# a shardfit label's variants after its case (sf-lora8b-8k-fp8): (activation checkpointing, micro_batch_tokens, more
# overrides), None keeping --sf-ac / --sf-budget
VARIANTS = {"noac": ("none", 4096, []), "8k": (None, 8192, []), "4k": (None, 4096, []),
            "12k": (None, 12288, []),  # 8 shared pairs a row (8 x 1,535 tokens): 16 pairs in 2 rows, apart 3
            "fp8": (None, None, ["--compute.fp8=tensorwise"]),
            "apart": (None, None, ["--compute.share_prefix=false"]),  # chosen and rejected as two documents
            "3p": (None, "3p", []),  # rows of exactly 3 pairs as prefix trees (TRL's memory; see the docstring)
            "fp8base": (None, None, ["--model.quantize=fp8"])}  # the frozen base stored in FP8 (adapters/fp8_base.py)
RESULT = "DPO_RESULT "  # the worker's line (the Trainer prints its logs as Python dicts)
MIN_START = 0.5  # a case is not started with less than this fraction of its cap left of the budget


# ---------------------------------------------------------------------------------------------- the data
def write_data(out: Path, pairs: int, prompt: int, answer: int, vocab: int, seed: int = 0) -> Path:
    """pairs.jsonl and tokenizer.json (a word-level vocabulary "t0".."t{vocab-2}" and "</s>" last) under out."""
    import numpy as np
    from tokenizers import Tokenizer, models, pre_tokenizers

    out.mkdir(parents=True, exist_ok=True)
    words = {f"t{i}": i for i in range(vocab - 1)}
    words["</s>"] = vocab - 1
    tok = Tokenizer(models.WordLevel(words, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens(["</s>"])
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>", "pad_token": "</s>",
                                                           "tokenizer_class": "PreTrainedTokenizerFast"}))
    rng = np.random.default_rng(seed)
    text = lambda n: " ".join(f"t{i}" for i in rng.integers(1, vocab - 1, n))  # noqa: E731
    with open(out / "pairs.jsonl", "w") as f:
        for _ in range(pairs):
            f.write(json.dumps({"prompt": text(prompt), "chosen": " " + text(answer),
                                "rejected": " " + text(answer)}) + "\n")
    return out


# ---------------------------------------------------------------------------------------------- shardfit
def run_shardfit(a, label: str, shape: str, lora: bool, data: Path, cap: int) -> dict:
    preset, _ = SHAPES[shape]
    ac, budget, extra = a.sf_ac, a.sf_budget, []
    for v in label.split("-")[2:]:
        v_ac, v_budget, v_extra = VARIANTS[v]
        if v_budget == "3p":  # 3 pairs, each the prompt less its last token once, then the 2 answers with it
            v_budget = 3 * ((a.prompt - 1) + 2 * (a.answer + 1))
        ac, budget, extra = v_ac or ac, v_budget or budget, extra + v_extra
    run_dir = Path(tempfile.mkdtemp(prefix="dpo-sf-"))
    seq = a.prompt + a.answer  # labels a side keeps: prompt + answer + EOS, shifted
    args = [f"--model.name={preset}", f"--data.path={data / 'pairs.jsonl'}", f"--data.tokenizer={data}",
            "--preference.objective=dpo", "--preference.beta=0.1", f"--data.seq_len={seq}",
            f"--train.micro_batch_tokens={budget if not a.tiny else 4 * seq}",
            f"--train.global_batch={a.global_batch}", f"--train.steps={a.warmup + a.steps}",
            "--train.warmup_steps=1", "--train.lr=5e-6", f"--logging.run_dir={run_dir}", "--logging.log_every=1",
            "--logging.progress=lines", "--checkpoint.final=false", "--checkpoint.resume=none"]
    if a.tiny:
        args += ["--train.device=cpu", f"--model.vocab_size={SHAPES['tiny'][1]['vocab_size']}"]
    else:
        args += ["--compute.compile=true", f"--compute.activation_checkpoint={ac}"]
    if lora:
        args += ["--lora.rank=16", "--lora.alpha=32"]
    args += extra + [x for x in a.sf_extra.split() if x]
    if a.profile_out:  # a steady step under the profiler: kernel time by kind (doctor/profile_trace.py)
        args.append(f"--logging.profile_step={a.warmup + 2}")
    cmd = [sys.executable, "-m", "shardfit", "train", *args]
    rc, out, err, timed_out, wall = _run_group(cmd, cap)
    row = {"label": label, "system": "shardfit", "rc": rc, "timed_out": timed_out, "wall_s": round(wall, 1),
           "cmd": "shardfit train " + " ".join(args)}
    metrics = run_dir / "metrics.jsonl"
    recs = [json.loads(x) for x in metrics.read_text().splitlines()] if metrics.is_file() else []
    recs = [r for r in recs if r.get("kind", "train") == "train"]
    steady = [r for r in recs if r["step"] > a.warmup]
    ref = [x for x in out.splitlines() if x.startswith("reference log-probs")]
    if a.profile_out:  # the summaries only (the traces are large): $profile_out/<label>/step<N>_summary.json
        for f in (run_dir / "profile").glob("*summary.json"):
            (Path(a.profile_out) / label).mkdir(parents=True, exist_ok=True)
            shutil.copy(f, Path(a.profile_out) / label / f.name)
    shutil.rmtree(run_dir, ignore_errors=True)
    if rc != 0 or not steady:
        row["error"] = "timeout" if timed_out else (err or out)[-1500:]
        row["oom"] = "OutOfMemoryError" in (err or "")
        return row
    tokens_per_pair = 2 * seq
    # one record a step: the tokens it counted (what tokens_seen grew by) over its rate of them is the step's time.
    # Not G x tokens_per_pair over the real-token rate: a pair sharing its prompt (compute.share_prefix) computes
    # 2 x seq - (prompt - 1) tokens, so that quotient was the step's time x 2 seq / (2 seq - prompt + 1), ~1.33x
    seen = {r["step"]: r["tokens_seen"] for r in recs}
    step_s = statistics.median((r["tokens_seen"] - seen[r["step"] - 1]) / r["world"] / r["loss_tokens_per_s_per_gpu"]
                               for r in steady)
    row.update(step_s=round(step_s, 4), pairs_per_s=round(a.global_batch / step_s, 3),
               tok_s=round(a.global_batch * tokens_per_pair / step_s),
               peak_alloc_GiB=round(max(r["peak_allocated_max"] for r in steady), 2) if not a.tiny else None,
               peak_reserved_GiB=round(max(r["peak_reserved_max"] for r in steady), 2) if not a.tiny else None,
               losses=[round(r["loss"], 4) for r in recs], reference_line=ref[0] if ref else None,
               accuracies=[round(r.get("rewards/accuracies", 0), 3) for r in recs])
    return row


# ---------------------------------------------------------------------------------------------- TRL (worker)
def trl_worker(a) -> None:
    """One TRL DPOTrainer run in this process; prints one JSON line."""
    import torch
    import transformers
    import trl
    from datasets import Dataset
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast, TrainerCallback

    cuda = torch.cuda.is_available() and not a.tiny
    data = Path(a.data)
    tokenizer = PreTrainedTokenizerFast(tokenizer_file=str(data / "tokenizer.json"), eos_token="</s>",
                                        pad_token="</s>")
    records = [json.loads(x) for x in (data / "pairs.jsonl").read_text().splitlines()]
    _, fields = SHAPES[a.shape]
    attn = "sdpa"
    if cuda:
        try:
            import flash_attn  # noqa: F401
            attn = "flash_attention_2"
        except ImportError:
            pass
    config = LlamaConfig(**fields, max_position_embeddings=8192, attn_implementation=attn)
    dtype = torch.bfloat16 if a.lora and cuda else torch.float32  # full: fp32 master weights under bf16 autocast
    t0 = time.perf_counter()
    torch.set_default_dtype(dtype)
    with torch.device("cuda" if cuda else "cpu"):
        model = LlamaForCausalLM(config)
    torch.set_default_dtype(torch.float32)
    build_s = time.perf_counter() - t0
    peft_config = None
    if a.lora:
        from peft import LoraConfig
        peft_config = LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, target_modules="all-linear",
                                 task_type="CAUSAL_LM")
    steps = a.warmup + a.steps
    out_dir = tempfile.mkdtemp(prefix="dpo-trl-")  # nothing is saved there (save_strategy "no")
    args = trl.DPOConfig(
        output_dir=out_dir, max_steps=steps, per_device_train_batch_size=a.trl_mbs,
        gradient_accumulation_steps=max(1, a.global_batch // a.trl_mbs), learning_rate=5e-6, beta=0.1,
        lr_scheduler_type="constant", warmup_steps=0, bf16=cuda, use_cpu=not cuda,
        gradient_checkpointing=a.trl_gc, gradient_checkpointing_kwargs={"use_reentrant": False},
        precompute_ref_log_probs=True, max_length=2 * (a.prompt + a.answer + 1), logging_steps=1, report_to=[],
        save_strategy="no", optim="adamw_torch_fused" if cuda else "adamw_torch", seed=0, dataloader_num_workers=0,
        disable_tqdm=True)
    times: list[float] = []
    peaks: dict = {}

    class Clock(TrainerCallback):
        def on_step_begin(self, args, state, control, **kw):
            if cuda:
                torch.cuda.synchronize()
                if state.global_step == a.warmup:
                    torch.cuda.reset_peak_memory_stats()
            self.t = time.perf_counter()

        def on_step_end(self, args, state, control, **kw):
            if cuda:
                torch.cuda.synchronize()
            times.append(time.perf_counter() - self.t)
            if cuda and state.global_step == steps:
                peaks.update(alloc=torch.cuda.max_memory_allocated() / 2**30,
                             reserved=torch.cuda.max_memory_reserved() / 2**30)

    trainer = trl.DPOTrainer(model=model, args=args, train_dataset=Dataset.from_list(records),
                             processing_class=tokenizer, peft_config=peft_config, callbacks=[Clock()])
    t1 = time.perf_counter()
    trainer.train()
    train_s = time.perf_counter() - t1
    shutil.rmtree(out_dir, ignore_errors=True)
    timed = times[a.warmup:]
    step_s = statistics.median(timed)
    tokens_per_pair = 2 * (a.prompt + a.answer)
    losses = [round(h["loss"], 4) for h in trainer.state.log_history if "loss" in h]
    print(RESULT + json.dumps({"step_s": round(step_s, 4), "pairs_per_s": round(a.global_batch / step_s, 3),
                      "tok_s": round(a.global_batch * tokens_per_pair / step_s),
                      "peak_alloc_GiB": round(peaks["alloc"], 2) if peaks else None,
                      "peak_reserved_GiB": round(peaks["reserved"], 2) if peaks else None,
                      "build_s": round(build_s, 1), "precompute_and_overhead_s": round(train_s - sum(times), 1),
                      "losses": losses, "attn": attn, "trl": trl.__version__,
                      "transformers": transformers.__version__}), flush=True)


def run_trl(a, label: str, shape: str, lora: bool, data: Path, cap: int) -> dict:
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", "--shape", shape, "--data", str(data),
           *(["--lora"] if lora else []), *(["--tiny"] if a.tiny else []), "--prompt", str(a.prompt), "--answer",
           str(a.answer), "--global-batch", str(a.global_batch), "--trl-mbs", str(a.trl_mbs), "--warmup",
           str(a.warmup), "--steps", str(a.steps), *(["--trl-no-gc"] if not a.trl_gc else [])]
    rc, out, err, timed_out, wall = _run_group(cmd, cap)
    row = {"label": label, "system": "trl", "rc": rc, "timed_out": timed_out, "wall_s": round(wall, 1),
           "cmd": " ".join(cmd[1:])}
    lines = [json.loads(x[len(RESULT):]) for x in out.splitlines() if x.startswith(RESULT)]
    if rc != 0 or not lines:
        row["error"] = "timeout" if timed_out else (err or out)[-1500:]
        row["oom"] = "OutOfMemoryError" in (err or "")
        return row
    row.update(lines[-1])
    return row


# ---------------------------------------------------------------------------------------------- the parent
def summarize(rows: list[dict]) -> dict:
    by = {r["label"]: r for r in rows}
    out = {}
    for label, sf in by.items():
        if not label.startswith("sf-"):
            continue
        case = label[3:]  # lora8b, lora8b-8k, ...: against TRL's run of the same shape and kind
        hf = by.get(f"trl-{case.split('-')[0]}", {})
        if sf.get("tok_s") and hf.get("tok_s"):
            mem = (round(sf["peak_alloc_GiB"] / hf["peak_alloc_GiB"], 3)
                   if sf.get("peak_alloc_GiB") and hf.get("peak_alloc_GiB") else None)
            out[case] = {"throughput": round(sf["tok_s"] / hf["tok_s"], 3), "memory": mem}
    return {"dpo_vs_trl": out}


def main_parent(a) -> int:
    t0 = time.time()
    shapes = {"lora8b": "tiny", "full1b": "tiny"} if a.tiny else {"lora8b": "8b", "full1b": "1b"}
    vocab = SHAPES["tiny"][1]["vocab_size"] if a.tiny else SHAPES["8b"][1]["vocab_size"]
    data = write_data(Path(tempfile.mkdtemp(prefix="dpo-data-")), (a.warmup + a.steps) * a.global_batch, a.prompt,
                      a.answer, vocab)
    rows: list[dict] = []
    result = {"args": vars(a), "rows": rows}
    for label in [x for x in a.cases.split(",") if x]:
        system, case = label.split("-", 1)
        base = case.split("-")[0]  # lora8b or full1b
        cap = CAPS.get(label, CAPS[f"{system}-{base}"]) if not a.tiny else 200
        left = a.budget - (time.time() - t0)
        if left < MIN_START * cap:
            rows.append({"label": label, "skipped": f"{left:.0f} s left of the budget, cap {cap} s"})
            continue
        run = run_shardfit if system == "sf" else run_trl
        print(f"--- {label} (cap {min(cap, int(left))} s)", flush=True)
        rows.append(run(a, label, shapes[base], base.startswith("lora"), data, min(cap, int(left))))
        print(json.dumps(rows[-1])[:600], flush=True)
        result["summary"] = summarize(rows)
        if a.out:
            Path(a.out).write_text(json.dumps(result, indent=1))
    shutil.rmtree(data, ignore_errors=True)
    print(f"\n{'case':12} {'pairs/s':>8} {'tok/s':>9} {'step s':>7} {'peak alloc/resv GiB':>20}")
    for r in rows:
        if r.get("tok_s"):
            mem = (f"{r['peak_alloc_GiB']:.1f}/{r['peak_reserved_GiB']:.1f}" if r.get("peak_alloc_GiB") is not None
                   else "-")
            print(f"{r['label']:12} {r['pairs_per_s']:>8.2f} {r['tok_s']:>9,} {r['step_s']:>7.2f} {mem:>20}")
        else:
            print(f"{r['label']:12} {r.get('skipped') or ('OOM' if r.get('oom') else 'failed')}")
    print("dpo_vs_trl:", json.dumps(result.get("summary", {}).get("dpo_vs_trl", {})))
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="")
    ap.add_argument("--tiny", action="store_true", help="tiny shapes on the CPU (the machinery)")
    ap.add_argument("--cases", default="sf-lora8b,trl-lora8b,sf-full1b,trl-full1b")
    ap.add_argument("--budget", type=float, default=470)
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--answer", type=int, default=511, help="answer tokens (EOS is one more)")
    ap.add_argument("--global-batch", type=int, default=16, help="pairs a step")
    ap.add_argument("--trl-mbs", type=int, default=4, help="TRL's per-device batch (pairs)")
    ap.add_argument("--trl-no-gc", dest="trl_gc", action="store_false", help="TRL without gradient checkpointing")
    ap.add_argument("--sf-budget", type=int, default=16384, help="shardfit's train.micro_batch_tokens")
    ap.add_argument("--sf-ac", default="full", help="shardfit's compute.activation_checkpoint")
    ap.add_argument("--sf-extra", default="", help="more shardfit train overrides, space-separated")
    ap.add_argument("--profile-out", default="", help="profile one steady shardfit step (its time is then not "
                    "steady: read the other steps') and keep its summary under this folder")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--worker", action="store_true")
    ap.add_argument("--shape", default="8b")
    ap.add_argument("--data", default="")
    ap.add_argument("--lora", action="store_true")
    a = ap.parse_args()
    if a.tiny and "--prompt" not in sys.argv:
        a.prompt, a.answer, a.global_batch, a.trl_mbs, a.warmup, a.steps = 24, 15, 4, 2, 1, 2
    if a.worker:
        trl_worker(a)
        return 0
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    return main_parent(a)


if __name__ == "__main__":
    sys.exit(main())
