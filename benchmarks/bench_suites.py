"""The suites bench_train.py runs: name -> cases (kind, label, args[, fallback cases]). Kept apart from the runner so
that the runner reads in one sitting; every figure in benchmarks/README.md names its suite here."""

from __future__ import annotations

# name -> list of (kind, label, args[, fallback cases]). kind "shardfit" takes `shardfit train` overrides; "anchor",
# "peft" and "peft-qlora" take their anchor script's flags (bench_train.py's run_anchor). {nproc} is filled in.
LLAMA8B_4K = ["--model.name=llama3-8b", "--data.seq_len=4096", "--train.steps=14", "--train.warmup_steps=2",
              "--train.lr=1e-4"]
COMPILED = [*LLAMA8B_4K, "--compute.compile=true"]
MBS4 = [*COMPILED, "--train.micro_batch=4", "--train.global_batch={4n}"]  # the compiled baseline of sessions 3-4
BF16_BEST = [*MBS4, "--compute.reduce_dtype=bfloat16"]  # session 4's best bf16 configuration
# The levers, best, long and single suites were measured before memory.keep_grads existed (gradients were freed
# between steps); FREED reproduces that. At the edge of memory (mbs 4, seq 262,144) kept gradients cause retries.
# FREED goes first, so that a case's own --memory.keep_grads wins.
FREED = ["--memory.keep_grads=false"]
CURVE = ["--model.name=llama3-1b", "--data.seq_len=4096", "--train.steps=50", "--train.warmup_steps=5",
         "--train.lr=3e-4", "--train.global_batch=4"]
CURVE8 = [*CURVE, "--train.lr=1e-4", "--train.warmup_steps=10"]
MOE_CURVE = ["--model.name=qwen3-30b-a3b", "--model.n_layers=6", "--data.seq_len=4096", "--train.steps=50",
             "--train.warmup_steps=10", "--train.lr=1e-4", "--train.micro_batch=2", "--train.global_batch=4"]
SINGLE_1B = ["--model.name=llama3-1b", "--data.seq_len=4096", "--train.steps=14", "--train.warmup_steps=2",
             "--train.lr=1e-4", "--compute.compile=true", "--train.micro_batch=4", "--train.global_batch=4"]
LORA8B = [*LLAMA8B_4K, "--compute.compile=true", "--lora.rank=16", "--lora.alpha=32", "--train.steps=12"]
# Issue 23's MoE part: Qwen3-30B-A3B's shape, all 48 layers (random init; the frozen bf16 base alone is 57.1 GiB) on
# one 80 GB GPU, compiled blocks (the experts run eagerly between them: E = W = 1), full AC, micro-batch 2 x 4096.
ATTN = "q_proj,k_proj,v_proj,o_proj"  # the MLP names of the default match nothing here: every block is MoE
LORA30B = ["--model.name=qwen3-30b-a3b", "--data.seq_len=4096", "--train.steps=10", "--train.warmup_steps=2",
           "--train.lr=1e-4", "--compute.compile=true", "--compute.activation_checkpoint=full", "--lora.rank=16",
           "--lora.alpha=32", "--train.micro_batch=2", "--train.global_batch=4"]
# Its anchor (benchmarks/anchor_peft_lora_moe.py): HF Qwen3MoeForCausalLM at the same shape, bf16 base built on meta,
# PEFT LoRA r=16 alpha 32 (fp32 adapters under autocast) on q/k/v/o (target_modules) or also on the fused expert
# tensors (target_parameters), non-reentrant full AC, SDPA, transformers' default grouped_mm experts. Micro-batch 2,
# then 1 when 2 does not fit (its fallback case): by the script's estimate attention fits at mbs 2 (~73 GiB) and the
# expert adapters' 9.6 GiB of fp32 states do not (~80 GiB) on an H100. Build ~20 s, then 2 + 4 steps.
LORA30B_ANCHOR = ["--size", "30b-a3b", "--seq", "4096", "--steps", "4", "--warmup", "2"]


def _anchor30b(targets: str, mbs: int = 2, args: list[str] = LORA30B_ANCHOR) -> tuple:
    """The HF + PEFT case at micro-batch mbs; at 2, with the same at 1 as its fallback."""
    case = ("peft-moe", f"HF+PEFT LoRA {targets} full-AC mbs{mbs}", [*args, "--targets", targets, "--mbs", str(mbs)])
    return (*case, [_anchor30b(targets, 1, args)]) if mbs == 2 else case


LIGER_ANCHOR = ["--size", "8b", "--seq", "4096", "--mbs", "2", "--liger", "--ac", "none"]
SUITES: dict[str, list[tuple[str, str, list[str]]]] = {
    "tiny": [
        ("shardfit", "tiny default", []),
    ],
    "llama8b": [
        ("shardfit", "shardfit 8B mbs2 no-AC", [*LLAMA8B_4K, "--train.micro_batch=2", "--train.global_batch={2n}"]),
        ("shardfit", "shardfit 8B mbs4 selective-AC", [*LLAMA8B_4K, "--train.micro_batch=4",
                                                       "--train.global_batch={4n}",
                                                       "--compute.activation_checkpoint=selective"]),
        ("shardfit", "shardfit 8B mbs2 no-AC compile", [*LLAMA8B_4K, "--train.micro_batch=2",
                                                        "--train.global_batch={2n}", "--compute.compile=true"]),
        ("anchor", "anchor plain full-AC mbs2", ["--size", "8b", "--seq", "4096", "--mbs", "2"]),
        ("anchor", "anchor liger no-AC mbs2", LIGER_ANCHOR),
    ],
    # session 2's levers, one change at a time from the compiled baseline (predictions: benchmarks/notes/*_s2.md)
    "levers": [  # all with FREED (added below)
        ("shardfit", "compile mbs2 torch-CE", [*COMPILED, "--train.micro_batch=2", "--train.global_batch={2n}",
                                               "--compute.kernels=torch", "--memory.snapshot_steps=6"]),
        ("shardfit", "compile mbs2 liger-CE", [*COMPILED, "--train.micro_batch=2", "--train.global_batch={2n}",
                                               "--compute.kernels=liger"]),
        ("shardfit", "compile mbs2 liger-CE cudnn", [*COMPILED, "--train.micro_batch=2", "--train.global_batch={2n}",
                                                     "--compute.kernels=liger", "--compute.attention=cudnn"]),
        ("shardfit", "compile mbs4 liger-CE", [*MBS4, "--compute.kernels=liger"]),
        ("anchor", "anchor liger no-AC mbs2", LIGER_ANCHOR),
    ],
    # the best 2-GPU configuration, for scaling (run with --nproc 2 and 4) and one more lever on it
    "best": [
        ("shardfit", "compile mbs4", MBS4),
        ("shardfit", "compile mbs4 bf16-reduce", BF16_BEST),
    ],
    # Issue 13: HSDP (parallel.replicate = 2: two replicas of 2 ranks) against FSDP over all 4 ranks, one node of
    # 4 x H200, the compiled bf16 configuration at micro-batch 3 (HSDP's states are sharded over 2 ranks, not 4:
    # +30 GiB a rank for 8B; shardfit plan: 86.3 and 116.2 GiB; at micro-batch 4 HSDP's 133.3 does not fit 140 GB);
    # plan vs measured through tests/plan/test_estimate.py's MEASURED
    "hsdp4": [
        ("shardfit", "FSDP over 4 compile mbs3", [*COMPILED, "--train.micro_batch=3", "--train.global_batch={3n}"]),
        ("shardfit", "HSDP 2x2 compile mbs3", [*COMPILED, "--train.micro_batch=3", "--train.global_batch={3n}",
                                               "--parallel.replicate=2"]),
    ],
    # memory.keep_grads (on by default since session 2): reserved vs allocated, eager defaults and the best config
    "honest": [
        ("shardfit", "eager mbs2 (defaults)", [*LLAMA8B_4K, "--train.micro_batch=2", "--train.global_batch={2n}"]),
        ("shardfit", "compile mbs4", MBS4),
    ],
    # next levers (session 2, not yet run; predictions in benchmarks/notes/*_s2.md): each from "compile mbs4"
    "levers2": [
        ("shardfit", "compile mbs4", MBS4),
        ("shardfit", "compile mbs4 loss-chunk 4096", [*MBS4, "--compute.loss_chunk=4096"]),
        ("shardfit", "compile mbs4 prefetch 2", [*MBS4, "--parallel.prefetch=2"]),
        ("shardfit", "compile mbs6 selective-AC", [*COMPILED, "--train.micro_batch=6", "--train.global_batch={6n}",
                                                   "--compute.activation_checkpoint=selective"]),
        ("anchor", "anchor liger no-AC mbs2", LIGER_ANCHOR),
    ],
    # session 3's levers, each from "compile mbs4" (predictions: benchmarks/notes/*_s3.md); the first two are profiled
    "levers3": [
        ("shardfit", "compile mbs4 eager-loss", [*MBS4, "--compute.compile_loss=false", "--logging.profile_step=8"]),
        ("shardfit", "compile mbs4", [*MBS4, "--logging.profile_step=8"]),
        ("shardfit", "compile mbs4 loss-chunk 4096", [*MBS4, "--compute.loss_chunk=4096"]),
        ("shardfit", "compile mbs4 prefetch 2", [*MBS4, "--parallel.prefetch=2"]),
        ("shardfit", "compile mbs4 cudnn", [*MBS4, "--compute.attention=cudnn", "--logging.profile_step=8"]),
        ("shardfit", "compile mbs6 selective-AC", [*COMPILED, "--train.micro_batch=6", "--train.global_batch={6n}",
                                                   "--compute.activation_checkpoint=selective"]),
        ("anchor", "anchor liger no-AC mbs2", LIGER_ANCHOR),
        ("shardfit", "compile mbs4 keep-grads", [*MBS4, "--memory.keep_grads=true"]),
    ],
    # session 3, after levers3: the compiled loss is on; amortising the optimizer and FSDP's fp32 reduce copy
    "levers4": [
        ("shardfit", "compile mbs4", [*MBS4, "--logging.profile_step=8"]),
        ("shardfit", "compile mbs4 bf16-reduce", BF16_BEST),
        ("shardfit", "compile mbs4 accum2", [*COMPILED, "--train.micro_batch=4", "--train.global_batch={8n}"]),
        ("shardfit", "compile mbs4 accum2 bf16-reduce", [
            *COMPILED, "--train.micro_batch=4", "--train.global_batch={8n}", "--compute.reduce_dtype=bfloat16",
            "--logging.profile_step=8"]),
        ("anchor", "anchor liger no-AC mbs2", LIGER_ANCHOR),
    ],
    # session 4's first call: the best configuration profiled (the trace is kept: matmul time under communication)
    "profile": [
        ("shardfit", "compile mbs4 bf16-reduce", [*BF16_BEST, "--logging.profile_step=8"]),
    ],
    # session 4: FP8 matmuls (torchao), reported apart from bf16; each from the bf16 best (compile mbs4 bf16-reduce)
    "fp8": [
        ("shardfit", "compile mbs4 bf16-reduce", BF16_BEST),
        ("shardfit", "fp8 tensorwise mbs4", [*BF16_BEST, "--compute.fp8=tensorwise",
                                             "--logging.profile_step=8"]),
        ("shardfit", "fp8 rowwise mbs4", [*BF16_BEST, "--compute.fp8=rowwise"]),
        ("anchor", "anchor liger no-AC mbs2", LIGER_ANCHOR),
    ],
    # session 4's closing comparison: bf16 best, FP8 best and larger FP8 micro-batches (FP8 frees ~13 GiB), anchor
    "final4": [
        ("shardfit", "compile mbs4 bf16-reduce", BF16_BEST),
        ("shardfit", "fp8 tensorwise mbs4", [*BF16_BEST, "--compute.fp8=tensorwise"]),
        ("shardfit", "fp8 tensorwise mbs5", [*COMPILED, "--train.micro_batch=5", "--train.global_batch={5n}",
                                             "--compute.reduce_dtype=bfloat16", "--compute.fp8=tensorwise"]),
        ("shardfit", "fp8 tensorwise mbs6", [*COMPILED, "--train.micro_batch=6", "--train.global_batch={6n}",
                                             "--compute.reduce_dtype=bfloat16", "--compute.fp8=tensorwise"]),
        ("anchor", "anchor liger no-AC mbs2", LIGER_ANCHOR),
    ],
    # session 3's closing comparison: the best configurations with the anchor in the same call
    "final": [
        ("shardfit", "compile mbs4", MBS4),
        ("shardfit", "compile mbs4 bf16-reduce", BF16_BEST),
        ("anchor", "anchor liger no-AC mbs2", LIGER_ANCHOR),
    ],
    # correctness does not move: 50 steps of the fastest configuration against the plain one on the same data (one
    # GPU, Llama-3.2-1B shape); the plain one with another loss chunk size measures bf16 rounding noise alone
    "curve": [
        ("shardfit", "plain: eager, full AC, mbs1 x accum4", [*CURVE, "--train.micro_batch=1",
                                                              "--compute.activation_checkpoint=full"]),
        ("shardfit", "plain, loss chunk 512 (noise)", [*CURVE, "--train.micro_batch=1",
                                                        "--compute.activation_checkpoint=full",
                                                        "--compute.loss_chunk=512"]),
        ("shardfit", "fast: compiled, no AC, mbs4", [*CURVE, "--train.micro_batch=4", "--compute.compile=true"]),
    ],
    # Issue 15: 50 steps of the fastest MoE configuration (compiled, no AC, expert parallel 2) against the plain one
    # (eager, full AC, no EP) on the same data, Qwen3-30B-A3B shape with 6 of its 48 layers on 2 GPUs; the plain one
    # with another loss chunk is the bf16 noise yardstick; FP8 for attention and dense layers beside bf16 experts.
    "moecurve": [
        ("shardfit", "plain MoE: eager, full AC", [*MOE_CURVE, "--compute.activation_checkpoint=full"]),
        ("shardfit", "plain MoE, loss chunk 512 (noise)", [*MOE_CURVE, "--compute.activation_checkpoint=full",
                                                           "--compute.loss_chunk=512"]),
        ("shardfit", "fast MoE: compiled, no AC, EP 2", [*MOE_CURVE, "--compute.compile=true",
                                                         "--parallel.expert_parallel=2"]),
        # session 9's fastest: the optimizer step under the next forward (parallel/step_overlap.py)
        ("shardfit", "fastest MoE: compiled, no AC, EP 2, overlapped step", [
            *MOE_CURVE, "--compute.compile=true", "--parallel.expert_parallel=2",
            "--parallel.overlap_optimizer=true"]),
        # compiled without EP: against the EP case, what EP adds beyond compile's own reassociation (session 8: the
        # EP case's max difference from the eager run was 1.6x the loss-chunk noise case's)
        ("shardfit", "compiled, no AC, no EP (compile's own noise)", [*MOE_CURVE, "--compute.compile=true"]),
        ("shardfit", "fast MoE + FP8 tensorwise (experts bf16)", [*MOE_CURVE, "--compute.compile=true",
                                                                  "--parallel.expert_parallel=2",
                                                                  "--compute.fp8=tensorwise"]),
    ],
    # FP8 against bf16 over 50 steps, same data (one GPU, Llama-3.2-1B shape). At CURVE's lr 3e-4 even bf16 spikes
    # in warm-up and the curves measure the spike's sensitivity (session 4, third call); curve8 trains at 1e-4 with
    # 10 warm-up steps, and its noise case (bf16, another loss chunk) is the yardstick in the same regime.
    "curve8": [
        ("shardfit", "fast bf16: compiled, no AC, mbs4", [*CURVE8, "--train.micro_batch=4", "--compute.compile=true"]),
        ("shardfit", "bf16, loss chunk 512 (noise)", [*CURVE8, "--train.micro_batch=4", "--compute.compile=true",
                                                      "--compute.loss_chunk=512"]),
        ("shardfit", "fast fp8 tensorwise", [*CURVE8, "--train.micro_batch=4", "--compute.compile=true",
                                             "--compute.fp8=tensorwise"]),
        ("shardfit", "fast fp8 rowwise", [*CURVE8, "--train.micro_batch=4", "--compute.compile=true",
                                          "--compute.fp8=rowwise"]),
    ],
    # capacity: one 262,144-token sequence split over 2 ranks (Ulysses), full checkpointing, 2 steps (the second
    # is measured); the data file must hold more than 262,145 tokens (device_run.sh makes one)
    "long": [
        ("shardfit", "seq 262144 ulysses-2 full-AC", [
            "--model.name=llama3-8b", "--model.max_seq_len=262144", "--data.seq_len=262144",
            "--data.path=/tmp/long.txt", "--train.steps=2",
            "--train.warmup_steps=1", "--train.lr=1e-5", "--train.micro_batch=1", "--train.global_batch=1",
            "--parallel.sequence_parallel=2", "--compute.activation_checkpoint=full", *FREED]),
    ],
    # one GPU (H100): FP8 on the 1B shape against bf16 and the Liger anchor
    "single8": [
        ("shardfit", "llama3-1b compile mbs4", [*SINGLE_1B]),
        ("shardfit", "llama3-1b compile mbs4 fp8 tensorwise", [*SINGLE_1B, "--compute.fp8=tensorwise"]),
        ("anchor", "anchor 1b liger no-AC mbs4", ["--size", "1b", "--seq", "4096", "--mbs", "4", "--liger",
                                                 "--ac", "none"]),
    ],
    # Issue 23: LoRA r=16 (alpha 32) on every linear layer of the blocks, Llama-3-8B shape, seq 4096 rows, one GPU,
    # against HF + PEFT (benchmarks/anchor_peft_lora.py) at its fastest measured micro-batch (4, full AC). Targets:
    # >= 1.5x its tokens/s at <= 0.8x its peak. Predictions: benchmarks/notes/2026-11-25_s14.md.
    "lora8b": [
        ("peft", "HF+PEFT LoRA full-AC mbs4", ["--size", "8b", "--seq", "4096", "--mbs", "4"]),
        ("shardfit", "shardfit LoRA compile no-AC mbs1", [*LORA8B, "--train.micro_batch=1", "--train.global_batch=4"]),
        ("shardfit", "shardfit LoRA compile full-AC mbs4", [*LORA8B, "--train.micro_batch=4",
                                                            "--train.global_batch=4",
                                                            "--compute.activation_checkpoint=full"]),
    ],
    # Issue 23, MoE experts as grouped adapters (adapters/expert_lora.py): r=16 on attention and every expert's
    # gate_up_proj and down_proj (630M adapter parameters, 10.5 GiB of fp32 states) against attention alone, one
    # change. shardfit plan --gpu-memory 79 predicts 71.0 and 60.9 GiB (budget 74.5; with experts, micro-batch 4 is
    # planned at 74.2: too close to run). The HF + PEFT anchors of both go first (lora30b_anchor below).
    "lora30b": [
        *(_anchor30b(targets) for targets in ("attn", "attn+experts")),
        ("shardfit", "shardfit LoRA attn mbs2", [*LORA30B, f"--lora.targets={ATTN}"]),
        ("shardfit", "shardfit LoRA attn+experts mbs2", [*LORA30B, f"--lora.targets={ATTN},experts"]),
    ],
    # one GPU (H100): a model that fits, against the anchor at the same size
    "single": [
        ("shardfit", "llama3-1b compile mbs4", ["--model.name=llama3-1b", "--data.seq_len=4096", "--train.steps=14",
                                                "--train.warmup_steps=2", "--train.lr=1e-4", "--compute.compile=true",
                                                "--train.micro_batch=4", "--train.global_batch=4"]),
        ("shardfit", "llama3-1b untied compile mbs4", [
            "--model.name=llama3-1b", "--model.tie_embeddings=false", "--data.seq_len=4096", "--train.steps=14",
            "--train.warmup_steps=2", "--train.lr=1e-4", "--compute.compile=true", "--train.micro_batch=4",
            "--train.global_batch=4"]),
        ("anchor", "anchor 1b liger no-AC mbs4", ["--size", "1b", "--seq", "4096", "--mbs", "4", "--liger",
                                                 "--ac", "none"]),
        ("anchor", "anchor 1b plain full-AC mbs4", ["--size", "1b", "--seq", "4096", "--mbs", "4"]),
    ],
}


for _suite in ("levers", "best", "single", "levers2", "levers3", "levers4", "final", "profile", "fp8", "final4"):
    SUITES[_suite] = [(k, label, FREED + args if k == "shardfit" else args) for k, label, args in SUITES[_suite]]

# Issue 13: Llama-3-8B full fine-tuning on ONE GPU (H100, 80 GB) with parallel.offload=all. Its fp32 states (weights,
# gradients, Adam moments: 16 bytes x 8.03B = 120 GiB) live in host memory; the GPU holds the gathered bf16 groups,
# activations and transient fp32 copies. Full checkpointing keeps 1 GiB of block inputs per sequence, so the
# micro-batch can be large: `shardfit plan` gives 3.6 GiB FSDP + 16.0 activations + 13.0 working set at mbs 16,
# compiled (~33 GiB; offload adds ~6 GiB of fp32 staging and gradient copies). A large micro-batch and no
# accumulation: every micro-batch copies all fp32 shards to the GPU (~59 GB: forward, and backward for the resharded
# blocks) and the gradients back (32 GB); the CPU step (one per step, ~225 GB of host memory traffic) is amortised
# over 65,536 tokens; accumulation would add the host adds of FSDP's offloaded gradient accumulation inside backward.
# The CPU step runs group by group under the next forward (parallel/offload.py, OverlappedStep); the phases then show
# ~0 s of optimizer and the waits inside forward. --parallel.offload_overlap=false runs it in place (A/B).
# The second case (16 of the 32 layers, 4.5B parameters, 68 GiB of states) still runs where the host's memory
# cannot hold the full model's 120 GiB plus the pinned allocator's rounding.
OFFLOAD8B = ["--model.name=llama3-8b", "--data.seq_len=4096", "--train.steps=8", "--train.warmup_steps=2",
             "--train.lr=1e-5", "--compute.compile=true", "--parallel.offload=all",
             "--compute.activation_checkpoint=full", "--train.micro_batch=16", "--train.global_batch=16"]
SUITES["offload8b"] = [
    # the first 5 blocks' states on the GPU: what `shardfit plan ... --gpu-memory 80 --host-memory 123` proposes for
    # the H100 machine (host 108.6 GiB of the 110.7 it leaves usable, GPU peak 46.0 GiB), where all-offloaded (125.8
    # GiB of host memory) was killed by the host's OOM killer
    ("shardfit", "8B offload=all keep 5 blocks full-AC mbs16", [*OFFLOAD8B, "--parallel.offload_gpu_blocks=5"]),
    ("shardfit", "8B offload=all full-AC mbs16", OFFLOAD8B),
    ("shardfit", "8B shape 16 layers offload=all mbs16", [*OFFLOAD8B, "--model.n_layers=16"]),
]
# The same on one H200 of a host with more memory (nvidia-h200-x2: 256 GiB), its GPU memory capped at an 80 GB
# H100's 79.1 GiB (memory.max_fraction, of 139.8 GiB): for when the H100 host's 128 GiB cannot hold the 8B states
# (parallel/offload.py counts 126 GiB with the pinned allocator's rounding).
SUITES["offload8b_cap80"] = [(k, label + " cap80", [*args, "--memory.max_fraction=0.565"])
                             for k, label, args in SUITES["offload8b"]]

# Issue 23's QLoRA figure: the Llama-3-70B shape, rank-16 adapters (alpha 32) on the 7 linear layers of every block,
# seq 4096 rows, ONE GPU, against HF + PEFT + bitsandbytes 4-bit as axolotl runs it (benchmarks/anchor_peft_qlora.py:
# NF4 with double quantisation, bf16 compute, fp32 adapters, full non-reentrant checkpointing, micro-batch 1).
# Cases may carry fallback cases (kind, label, args, [fallbacks]): run when the case fails (an OOM at the edge).
# Memory by shardfit plan (compiled, micro-batch 1): states 39.9 GiB (the NF4 base 35.3, head and embeddings in bf16
# 3.9, adapters 16 B x 207M), FSDP's buffers 5.2, and per block 1.05 GiB of activations unrecomputed, 0.06 (its input)
# checkpointed: no checkpointing 129.3 GiB (an H200's budget is 132.3), the first 40 of 80 blocks 89.8, every block
# 50.7 (an H100's budget is 74.6: the first 60 of 80 blocks 70.0). Six steps a case, the last three measured (a 70B
# step is ~2-4 s; the model's build, init and compile take the rest). Predictions: benchmarks/notes (session 15).
QLORA70B = ["--model.name=llama3-70b", "--data.seq_len=4096", "--train.steps=6", "--train.warmup_steps=2",
            "--train.lr=1e-4", "--compute.compile=true", "--lora.rank=16", "--lora.alpha=32", "--model.quantize=nf4",
            "--train.micro_batch=1", "--train.global_batch=1"]
QLORA_ANCHOR = ["--size", "70b", "--seq", "4096", "--steps", "3", "--warmup", "2"]


def _qlora_case(first: int | None) -> tuple[str, str, list[str]]:
    """shardfit on the 70B QLoRA shape: no checkpointing (first None), the first N blocks (compute.ac_blocks), or
    every block (first 80)."""
    if first is None:
        return "shardfit", "shardfit QLoRA compile no-AC mbs1", [*QLORA70B, "--compute.activation_checkpoint=none"]
    label = "full-AC" if first == 80 else f"AC first {first}/80"
    return "shardfit", f"shardfit QLoRA compile {label} mbs1", [
        *QLORA70B, "--compute.activation_checkpoint=full", *([f"--compute.ac_blocks={first}"] if first < 80 else [])]


SUITES["qlora70b"] = [  # one H200 (nvidia-h200): the anchor first (the ratio needs it), then shardfit's fastest
    ("peft-qlora", "HF+PEFT+bnb QLoRA full-AC mbs1", QLORA_ANCHOR),
    (*_qlora_case(None), [_qlora_case(10)]),  # 129.3 of 132.3 GiB planned
    _qlora_case(80),
    _qlora_case(40),
]
SUITES["qlora70b_h100"] = [  # one H100 (nvidia-h100-x1): no checkpointing does not fit; 60 of 80 blocks does
    ("peft-qlora", "HF+PEFT+bnb QLoRA full-AC mbs1", QLORA_ANCHOR),
    (*_qlora_case(60), [_qlora_case(80)]),
    _qlora_case(80),
]
SUITES["qlora_cpu"] = [  # the CPU check of the machinery (bitsandbytes in PYTHONPATH): tiny sizes, not a measurement
    ("peft-qlora", "HF+PEFT+bnb QLoRA tiny", ["--size", "tiny", "--device", "cpu", "--seq", "64", "--mbs", "2"]),
    ("shardfit", "shardfit QLoRA tiny no-AC (fails: seq 70000)", ["--lora.rank=16", "--model.quantize=nf4",
                                                                  "--data.seq_len=70000", "--train.steps=6"],
     [("shardfit", "shardfit QLoRA tiny AC first 1/2", ["--lora.rank=16", "--model.quantize=nf4", "--data.seq_len=64",
                                                        "--train.steps=6", "--compute.activation_checkpoint=full",
                                                        "--compute.ac_blocks=1"])]),
]
SUITES["qlora70b_anchors"] = [  # the anchor's variants (module docstring of anchor_peft_qlora.py), one H200
    ("peft-qlora", "HF+PEFT+bnb QLoRA full-AC mbs1", QLORA_ANCHOR),
    ("peft-qlora", "HF+PEFT+bnb QLoRA TRL (bf16 adapters) full-AC mbs1", [*QLORA_ANCHOR, "--prep", "trl"]),
    ("peft-qlora", "HF+PEFT+bnb QLoRA PEFT-guide (fp32 norms, head) full-AC mbs1", [*QLORA_ANCHOR, "--prep", "peft"]),
    ("peft-qlora", "HF+PEFT+bnb QLoRA full-AC mbs2", [*QLORA_ANCHOR, "--mbs", "2"]),
]


def lora_vs_peft(rows: list[dict]) -> dict[str, dict[str, float]]:
    """{shardfit label: {"speed": tok/s over the anchor's, "peak_alloc": peak allocated over the anchor's}}."""
    anchor = next((r for r in rows if r["system"] == "anchor" and r.get("tok_s_gpu")), None)
    if anchor is None:
        return {}
    peak = anchor.get("peak_alloc_GiB")  # 0 on the CPU (RSS is not comparable): no ratio
    return {r["label"]: {"speed": round(r["tok_s_gpu"] / anchor["tok_s_gpu"], 3),
                         "peak_alloc": round(r["peak_alloc_GiB"] / peak, 3) if peak else None}
            for r in rows if r["system"] == "shardfit" and r.get("tok_s_gpu")}


def qlora_summary(rows: list[dict]) -> dict:
    """Issue 23's QLoRA keys: qlora_vs_peft, the best shardfit case's tokens/s over the anchor's (the first anchor
    row: axolotl's preparation), and qlora_70b_peak_gib, that case's peak allocated; every case's ratios beside."""
    cases = lora_vs_peft(rows)
    best = max((r for r in rows if r["system"] == "shardfit" and r.get("tok_s_gpu")), key=lambda r: r["tok_s_gpu"],
               default=None)
    out = {"qlora_cases_vs_peft": cases, "qlora_peaks_gib": {r["label"]: r["peak_alloc_GiB"] for r in rows
                                                              if r.get("peak_alloc_GiB")}}
    if best is not None:
        out.update(qlora_best=best["label"], qlora_70b_peak_gib=best["peak_alloc_GiB"])
        if best["label"] in cases:
            out["qlora_vs_peft"] = cases[best["label"]]["speed"]
            out["qlora_target_1.5x"] = out["qlora_vs_peft"] >= 1.5
    return out


def lora30b_summary(rows: list[dict]) -> dict:
    """Issue 23's MoE keys: lora30b_vs_peft, shardfit's attention-only tokens/s over the HF + PEFT anchor's
    attention-only case (each at the largest micro-batch that ran: the anchor's fallback row when mbs 2 did not fit),
    lora30b_experts_vs_peft the same with expert adapters, and each pair's peak allocated ratio (*_peak_vs_peft);
    every case's tokens/s, peak and micro-batch beside."""
    def first(system: str, experts: bool) -> dict | None:
        return next((r for r in rows if r["system"] == system and r.get("tok_s_gpu")
                     and ("attn+experts" in r["label"]) == experts), None)

    out = {}
    for key, experts in (("lora30b", False), ("lora30b_experts", True)):
        ours, anchor = first("shardfit", experts), first("anchor", experts)
        if ours and anchor:
            out[f"{key}_vs_peft"] = round(ours["tok_s_gpu"] / anchor["tok_s_gpu"], 3)
            peak = anchor.get("peak_alloc_GiB")  # 0 on the CPU: no ratio
            out[f"{key}_peak_vs_peft"] = round(ours["peak_alloc_GiB"] / peak, 3) if peak else None
    out["lora30b_cases"] = {r["label"]: {"tok_s_gpu": r["tok_s_gpu"], "peak_alloc_GiB": r.get("peak_alloc_GiB"),
                                         "mbs": r.get("mbs") or int(r["label"].rsplit("mbs", 1)[1].split()[0])}
                            for r in rows if r.get("tok_s_gpu")}
    return out


# The CPU check of lora30b's machinery (anchor, fallback structure, summary): tiny sizes, not a measurement
_TINY_MOE = ["--model.n_layers=2", "--model.n_experts=4", "--model.experts_per_token=2", "--model.moe_ffn_dim=64",
             "--data.seq_len=64", "--train.steps=5", "--lora.rank=16", "--lora.alpha=32", "--train.micro_batch=2",
             "--train.global_batch=2"]
SUITES["lora30b_cpu"] = [
    *(_anchor30b(t, args=["--size", "tiny", "--device", "cpu", "--seq", "64", "--steps", "2", "--warmup", "1"])
      for t in ("attn", "attn+experts")),
    ("shardfit", "shardfit LoRA attn mbs2", [*_TINY_MOE, f"--lora.targets={ATTN}"]),
    ("shardfit", "shardfit LoRA attn+experts mbs2", [*_TINY_MOE, f"--lora.targets={ATTN},experts"]),
]

# The summary a suite's JSON carries (bench_train.py): issue 23's keys
SUMMARIES = {"lora8b": lambda rows: {"lora_vs_peft": lora_vs_peft(rows)},
             **{name: qlora_summary for name in ("qlora70b", "qlora70b_h100", "qlora70b_anchors", "qlora_cpu")},
             **{name: lora30b_summary for name in ("lora30b", "lora30b_cpu")}}

# Issue 12: variable-length training. Cases are (kind, label, args[, fallback cases]); kinds "sf" (`shardfit
# train`, --logging.log_every=1 added) and "anchor-sft" (benchmarks/anchor_sft.py). A case whose run fails (an OOM
# at the memory edge) is followed by its fallback cases, so that one device call still yields every ratio. {data}
# is the data directory (--data), {Nn} N x nproc.
SFT = ["--data.path={data}/sft.jsonl", "--data.mode=sft"]
DOCS = ["--data.path={data}/docs.jsonl", "--data.mode=pretrain"]
# Llama-3-8B, seq 4096, compiled, gradients freed between steps (the layout of the compiled mbs-4 baseline, which
# peaks at 119 GiB allocated / 136 GiB reserved on an H200), fp32 gradient reduction like the anchor.
V8 = [*FREED, *COMPILED, "--train.lr=1e-5"]
ANCHOR_SFT_8B = ["--data", "{data}/sft.jsonl", "--size", "8b", "--seq", "4096", "--liger", "--ac", "none",
                 "--steps", "14"]
# Llama-3.2-1B shape on one GPU, 300 steps, ~8-9k tokens per step (~50k tokens/s: ~60 s of steps per case)
F1 = ["--model.name=llama3-1b", "--data.seq_len=4096", "--train.steps=300", "--train.warmup_steps=5",
      "--train.lr=1e-5", "--compute.compile=true", *SFT]
ANCHOR_SFT_1B = ["--data", "{data}/sft.jsonl", "--size", "1b", "--seq", "4096", "--liger", "--ac", "none",
                 "--mbs", "2", "--steps", "300", "--per-step-json"]
# The CPU check of the machinery (tiny model, gloo, seq 512, a 400-example set): not a measurement.
TINY_SFT = ["--data.seq_len=512", "--train.steps=6", "--train.warmup_steps=1", "--train.lr=1e-3", *SFT]
VARLEN_SUITES: dict[str, list[tuple]] = {
    # packed vs padded vs the HF + Liger padded recipe, loss-bearing tokens/s/GPU (2 GPUs)
    "varlen8b": [
        ("sf", "8B padded mbs4", [*V8, *SFT, "--data.pack=false", "--train.micro_batch=4",
                                  "--train.global_batch={4n}"]),
        ("sf", "8B packed mbs4", [*V8, *SFT, "--train.micro_batch=4", "--train.global_batch={4n}"],
         [("sf", "8B packed mbs2", [*V8, *SFT, "--train.micro_batch=2", "--train.global_batch={2n}"])]),
        # one [1, 16384] row per micro-batch; 40 examples per step: ~1 micro-batch per rank (~33k tokens a step,
        # like packed mbs 4), bins ~76% full (simulated with data/batching.py on this set)
        ("sf", "8B token budget 16384", [*V8, *SFT, "--train.micro_batch_tokens=16384",
                                         "--train.global_batch={20n}"],
         [("sf", "8B token budget 8192", [*V8, *SFT, "--train.micro_batch_tokens=8192",
                                          "--train.global_batch={10n}"])]),
        ("anchor-sft", "anchor HF+Liger padded mbs2", [*ANCHOR_SFT_8B, "--mbs", "2", "--pad", "max"]),
    ],
    # packed pretraining on many short documents: document-masked (varlen, flex) against unmasked (2 GPUs)
    "docmask8b": [
        ("sf", "8B pretrain mbs4 unmasked", [*V8, *DOCS, "--data.document_mask=false", "--train.micro_batch=4",
                                             "--train.global_batch={4n}"]),
        ("sf", "8B pretrain mbs4 masked varlen", [*V8, *DOCS, "--compute.doc_attention=varlen",
                                                  "--train.micro_batch=4", "--train.global_batch={4n}"],
         [("sf", "8B pretrain mbs2 unmasked", [*V8, *DOCS, "--data.document_mask=false", "--train.micro_batch=2",
                                               "--train.global_batch={2n}"]),
          ("sf", "8B pretrain mbs2 masked varlen", [*V8, *DOCS, "--compute.doc_attention=varlen",
                                                    "--train.micro_batch=2", "--train.global_batch={2n}"])]),
        ("sf", "8B pretrain mbs4 masked flex", [*V8, *DOCS, "--compute.doc_attention=flex",
                                                "--train.micro_batch=4", "--train.global_batch={4n}"]),
    ],
    # the third seed report's experiment: 300 steps of variable-length data, per-step peak memory (1 GPU)
    "flat300": [
        ("sf", "1B packed mbs2", [*F1, "--train.micro_batch=2", "--train.global_batch={2n}"]),
        # 10 examples per step in [1, 8192] rows: ~1.15 micro-batches a step, bins ~71% full
        ("sf", "1B token budget 8192", [*F1, "--train.micro_batch_tokens=8192", "--train.global_batch={10n}"]),
        ("sf", "1B padded mbs2", [*F1, "--data.pack=false", "--train.micro_batch=2", "--train.global_batch={2n}"]),
        ("anchor-sft", "anchor HF+Liger dynamic padding mbs2", [*ANCHOR_SFT_1B, "--pad", "longest"]),
        ("anchor-sft", "anchor HF+Liger padded mbs2", [*ANCHOR_SFT_1B, "--pad", "max"]),
    ],
    # CPU check of every kind of case and of the summary (tiny sizes, gloo); flatness over steps > 2
    "varlen_cpu": [
        ("sf", "tiny padded mbs2", [*TINY_SFT, "--data.pack=false", "--train.micro_batch=2",
                                    "--train.global_batch={2n}"]),
        ("sf", "tiny packed mbs2", [*TINY_SFT, "--train.micro_batch=2", "--train.global_batch={2n}"]),
        ("sf", "tiny token budget 1024", [*TINY_SFT, "--train.micro_batch_tokens=1024",
                                          "--train.global_batch={2n}"]),
        ("sf", "tiny pretrain mbs2 unmasked", [*TINY_SFT, *DOCS, "--data.document_mask=false",
                                               "--train.micro_batch=2", "--train.global_batch={2n}"]),
        ("sf", "tiny pretrain mbs2 masked sdpa", [*TINY_SFT, *DOCS, "--compute.doc_attention=sdpa",
                                                  "--train.micro_batch=2", "--train.global_batch={2n}"]),
        ("anchor-sft", "anchor padded mbs2", ["--data", "{data}/sft.jsonl", "--size", "tiny", "--device", "cpu",
                                              "--seq", "512", "--mbs", "2", "--steps", "6", "--pad", "max",
                                              "--per-step-json"]),
        ("anchor-sft", "anchor dynamic padding mbs2", ["--data", "{data}/sft.jsonl", "--size", "tiny", "--device",
                                                       "cpu", "--seq", "512", "--mbs", "2", "--steps", "6",
                                                       "--pad", "longest", "--per-step-json"]),
    ],
}
VARLEN_DATA = {"varlen_cpu": {"n": 400}}  # gen_sft_data arguments other than the defaults (20,000 examples)
# The anchors of flat300 alone: the 380 s cap of one device stage held only shardfit's three cases (~90 s each on an
# H100 with compile), so the two anchor cases run as a stage of their own.
VARLEN_SUITES["flat300_anchors"] = [c for c in VARLEN_SUITES["flat300"] if c[0] == "anchor-sft"]
# steps before the memory-flatness window (others: no table)
VARLEN_WARM = {"flat300": 20, "flat300_anchors": 20, "varlen_cpu": 2}
