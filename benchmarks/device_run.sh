#!/usr/bin/env bash
# One device session's stages; each writes its log and JSON under $OUT. Usage: benchmarks/device_run.sh STAGE...
#   setup   install the carried wheels (.whl: liger-kernel) into /tmp/site
#   tests   the CUDA tests (pytest -m cuda tests/cuda)
#   tiny2   `shardfit train --nproc 2` on the embedded default
#   hf8b    write a random Llama-3-8B checkpoint, load it on 2 GPUs, train 4 steps, export (issue 3)
#   probe   page-cache read rate (4 and 8 threads per rank) and pinned host-to-device rate on the 48-layer checkpoint
#   load    48-layer Qwen3-30B-A3B shape: probe, shardfit load on 2 and 4 GPUs, the broadcast anchor on 2 (issue 3)
#   load-variants  the loader at 8/16 threads x 16/64 MiB pinned buffers (after load)
#   heads   compile mbs4 from .old/src (an earlier commit's src, carried) then from src: one change, one call
#   curve   50 steps of the fastest configuration against the plain one (1 GPU, 1B shape): loss curves compared
#   gemm    the step's GEMMs alone (1 GPU) and beside a looping NCCL all-gather (2 GPUs): the matmul ceiling
#   fp8     FP8 tensorwise and rowwise (torchao, carried in .whl) against the bf16 best and the Liger anchor
#   final4  session 4's closing comparison: bf16 best, FP8 at micro-batch 4/5/6, the Liger anchor
#   single8 1 GPU (H100), 1B shape: bf16, FP8 tensorwise, the Liger anchor
#   fp8x24  FP8 tensorwise mbs 5 on 2 then 4 GPUs (scaling)
#   curve8  50 steps: bf16 fast against FP8 tensorwise and rowwise (1 GPU, 1B shape)
#   profile the best configuration profiled, its trace kept under $OUT/traces
#   levers  bench_train --suite levers on 2 GPUs (issue 5); levers2, levers3 likewise
# Issue 12, variable-length training (bench_suites.py's VARLEN_SUITES; the fine-tuning set of gen_sft_data.py is
# made in /tmp/sft_varlen on first use, ~3 s). Each stage runs under a time cap (`timeout`; bench_train.py then ends
# the running case and keeps the JSON of those done) so that two calls of <= 10 minutes hold all four:
#   call 1: benchmarks/device_run.sh setup varlen8b docmask8b      (~4 + ~4 min)
#   call 2: benchmarks/device_run.sh setup flat300 attn            (~5.5 + ~2.5 min)
#   sftdata    the data set alone (/tmp/sft_varlen: sft.jsonl, docs.jsonl, summary.json)
#   varlen8b   2 GPUs, Llama-3-8B seq 4096 compiled: shardfit padded, packed, token-budget; HF + Liger anchor padded
#              (cap 290 s); JSON summary: packed_vs_padded (loss-bearing tokens/s/GPU), packed_vs_anchor
#   docmask8b  2 GPUs, packed pretraining on docs.jsonl: unmasked against document masks, varlen and flex (cap 280 s)
#   flat300a   flat300's two anchor cases alone (session 6: the shardfit cases filled flat300's cap)
#   flat300    1 GPU, Llama-3.2-1B shape, 300 steps each: shardfit packed, token-budget, padded; the anchor with
#              dynamic padding and padded to 4096; memory-flatness table after step 20 (cap 380 s)
#   attn       1 GPU, bench_attention.py: causal SDPA against varlen, flex, dense-mask SDPA at the 8B attention
#              shape, 4/2/1 packed rows of 4096, and DocumentMask.build's cost (cap 190 s)
# Issue 13, CPU offload:
#   offload8b  1 GPU (nvidia-h100-x1), Llama-3-8B seq 4096 compiled, parallel.offload=all, full checkpointing, mbs 16,
#              8 steps, then the 16-layer shape (cap 470 s); host MemAvailable sampled every second
#              ($OUT/offload8b_hostmem.txt, the lowest printed): the states alone are 120 GiB
#   moecurve   issue 15: 50 steps, the fastest MoE configuration (compiled, EP 2) and FP8 beside bf16 experts against
#              the plain one and a noise case (2 GPUs, 6 layers)
#   tests-split  pytest -m cuda file by file (240 s cap each), the log under $OUT as it runs: a call of its own
#   moeprof    bench_moe's EP2 compiled case with step 8 under torch.profiler (2 GPUs): kernel time by kind, the idle
#              time split (late launches by host context, waits on other streams), the trace kept under $OUT
#   tests-a2a  the CUDA cases of parallel.expert_overlap alone (2 GPUs: fp32 full AC, bf16 compiled, both modes)
#   tests-overlap  the CUDA test of parallel.overlap_optimizer alone (2 GPUs, ~2 min), before moe2 measures it
#   offload8b-cap80  the same on GPU 0 of nvidia-h200-x2 (256 GiB host), GPU memory capped at an H100's 79.1 GiB
# Issue 15, mixture of experts (bench_moe.py: shardfit against benchmarks/anchor_hf_qwen3moe.py, the HF FSDP2 recipe,
# and torchtitan 0.2.2 through benchmarks/anchor_torchtitan_launch.py; torchtitan's wheels and torchao's are in .whl,
# installed by setup). Cases in priority order, each under a cap cut to what is left of --budget; the JSON keeps the
# cases done when a later one fails or the stage's `timeout` ends it. One call each (carry .whl):
#   call (nvidia-h200-x2): benchmarks/device_run.sh setup ttsetup moe2     (~10 + ~15 + <= 540 s)
#   ttsetup  torchtitan's offline assets in /tmp/ttassets (word tokenizers of the exact vocab sizes, random-word set;
#            ~3 s) and an import check of torchtitan and torchao (installs the wheels itself when setup did not run)
#   moe2     2 GPUs, Qwen3-30B-A3B shape with 12 of its 48 layers, seq 4096, mbs 2: HF grouped_mm (full AC), shardfit
#            no-AC compile, torchtitan no-AC compile, both with expert parallelism 2, shardfit full AC and no AC eager
#            (~45 s + ~100 s a compiled case: the last eager case may be skipped by the budget, 525 s)
#   moe4     4 GPUs, all 48 layers, every case with full checkpointing: the states fit only so. 16 bytes a parameter
#            (fp32 weights, gradients, two Adam moments) x 30.5B / 4 = 113.7 GiB a GPU, plus 5.8 GiB of FSDP buffers,
#            ~6 GiB of activations and ~2 GiB working set at mbs 2: 123 GiB of the 132.5 GiB `shardfit plan
#            --nproc 4 --gpu-memory 140.4` allows on an H200 (no AC: 193 GiB; expert parallelism moves expert
#            shards, not their size). Cases: HF, shardfit compile, torchtitan compile, shardfit EP 4 and 2, torchtitan
#            EP 2, shardfit eager; what the 525 s budget holds (~130 s a compiled case)
#   tests1   the CUDA suite on one GPU (the cases needing 2 or 4 skip), under a 180 s cap, the log kept
#   tests-a2a1  one GPU: the overlapped exchange with two ranks on cuda:0 over gloo (NCCL takes one rank a GPU)
#   tests1b  one GPU: the CUDA files tests1's cap did not reach (training, varlen)
#   moeprof1 moe1's fastest shardfit case (compiled, overlapped step; the experts out of FSDP) with step 8 profiled
#   moe1     1 GPU, 6 of the 48 layers (the states fit one H200 without checkpointing): the HF recipe, shardfit
#            compiled with and without the overlapped step, torchtitan compiled; no exchange of any kind (~300 s)
#   moe2-a2a  2 GPUs, 12 layers: the fastest case (compiled, EP 2, overlapped step) without and with
#            parallel.expert_overlap=dispatch and =both (all-to-alls under the own rows' experts), HF beside (~430 s)
# Issue 26, the house (the step moved into train/engine.py): .old/src, a copy of the session's first commit's src
# (carried), against src, one GPU, in one call each (nvidia-h200, as session 11's moe1):
#   house1-dense  Llama-3.2-1B shape compiled mbs 4 (suite single), old then new then old then new (4 x ~60 s)
#   house1-moe    moe1's fastest shardfit case (6 layers, compiled, overlapped step), 40 steps, old/new/old/new:
#                 wall-clock ms per step from timestamped log lines (benchmarks/wall_per_step.py; ~110 s)
# Issue 36, sampling in an RL loop: rl-iter (bench_rl_iter.py: an SDK-driven RL iteration against `shardfit serve`,
#   8B shape LoRA r=16, 64 x 16 x 512 sampled then trained; rl_iter_sample_over_train) and rl-iter-old (the same
#   against .old/src's server); carry benchmarks/wheels_rl as the rl stages do (~8-9 min each, cap RLITER_CAP)
# Issue 36 item 6, the train/sample log-prob gap: gap  benchmarks/bench_logprob_gap.py, one GPU, Qwen3-8B shape, bf16,
#   random weights, LoRA r=16 (one step taken), 64 prompts of 512 tokens x 1 sample x 256 new tokens: Engine.sample
#   with sampling.logprobs=decode against Engine.forward and forward_backward on the loop's datums
#   (sampler_logprob_gap:mean/:max, the importance ratio's error), then =trainer against the same datums, reversed
#   and halved, and each sample call's time (the switch's cost); GAP_ARGS: more flags (--reps 3, --fwdbwd 0, ...).
#   Cap GAP_CAP, 300 s (~2-3 min expected). JSON $OUT/gap.json (summary: sampler_logprob_gap:mean, ...,
#   trainer_cost_fraction), log $OUT/gap.log
# Issue 23, QLoRA: nf4  benchmarks/bench_nf4.py, NF4 dequantisation and the frozen linear's forward at the 70B
#   shapes: shardfit eager, compiled and its Triton kernel (kernels/nf4_dequant.py, with a sweep of its launch
#   shapes), bitsandbytes 0.50.2 (carry benchmarks/wheels_bnb), torchao if present (~50 s)
# Issue 24, the training side of RL (benchmarks/bench_rl.py: shardfit's Engine against the anchor hf_rl_step.py on
# its own rollout data, one GPU). Carry .anchors (a copy of shared/anchors) and benchmarks/wheels_rl (tinker 0.38.0,
# fastapi, uvicorn and their dependencies missing on the device, ~15 MB, for Python 3.12; made here by
# `pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp --platform
# manylinux_2_28_x86_64 --platform manylinux2014_x86_64 -d benchmarks/wheels_rl NAME==VERSION ...`, the list in
# bench_rl.py's docstring); each stage installs them into /tmp/site first. RL_PARTS=dense-fwd,... picks parts;
# RL_EXTRA="--compute.compile_loss=false ..." adds Engine overrides to every shardfit run (in process and serve).
#   rl        every part in one call, 2 reps each, the anchor's forward in its fastest layout only (padnm; cap 530 s;
#             a part the budget cannot hold is recorded as skipped): log-prob recompute at the Qwen3-8B shape, PPO
#             step with full fine-tuning at the 1.7B shape (the anchor's E), the same step through the tinker SDK +
#             `shardfit serve`, Qwen3-30B-A3B with 6 of its 48 layers (4 on an H100): forward, PPO step, weights()
#             GB/s and export_hf to disk. JSON: $OUT/rl.json (summary: rl_fwd_vs_hf, rl_fwdbwd_vs_hf, ...), log rl.log
#   rl-dense  dense-fwd (padnm and pad), dense-ppo, serve, 3 reps (cap 500 s)
#   rl-moe    the MoE part alone, so that its anchor fits (session 15's rl-8b spent its budget on the 8B parts and
#             skipped it): Qwen3-30B-A3B, 6 layers on an H200 / 4 on an H100, 3 reps; shardfit Engine forward, PPO
#             step, weights(), export_hf (~75 s, 62 s in session 15), then the anchor (HF Qwen3Moe grouped_mm) forward
#             padnm and pad, PPO step pack_flex (~55 s; 39 s for 4 layers on an H100 in session 14); with each side's
#             forward profiled last (RL_MOE_PROF=0: not), $OUT/rlmoe/moe_fwd_{shardfit,hf}_summary.json and
#             moe_fwd_compare.json (~20 s). Cap RL_CAP, 420 s; expected ~150-200 s. JSON $OUT/rl-moe.json: summary
#             rl_fwd_vs_hf / rl_fwdbwd_vs_hf {"moe-6L"}, weights_GBps, export_hf_GBps, moe_fwd_profile
#   rl-lora   the 8B PPO step with LoRA r=16 on the 7 linears (issues 23 + 24) against the anchor's part D
#             (PEFT, pack_flex), 2 reps (cap RL_CAP, 300 s)
#   docattn   benchmarks/bench_doc_attention.py: one layer's document-masked attention of Engine.forward on the
#             rollouts' 17,408-token rows (Qwen3-30B-A3B 32/4 heads, Qwen3-8B 32/8), no grad: shardfit's flex against
#             flex kernel_options, per-document and padded (the anchor's) cuDNN / flash SDPA, varlen, cuDNN ragged;
#             outputs checked against flex (carry .anchors; cap 230 s, its own deadline 195 s). JSON $OUT/docattn.json
#   lora8b    issue 23: LoRA SFT, Llama-3-8B shape seq 4096, shardfit (compiled: no AC mbs 1, full AC mbs 4)
#             against HF + PEFT (benchmarks/anchor_peft_lora.py, full AC mbs 4), one GPU (cap LORA_CAP, 420 s)
#   lora30b   issue 23's MoE part: LoRA r=16, Qwen3-30B-A3B shape, all 48 layers, seq 4096, one GPU (H100, the
#             issue's card): the HF + PEFT anchors first (benchmarks/anchor_peft_lora_moe.py: transformers' default
#             grouped_mm experts, SDPA, full AC; attention, then attention + experts through target_parameters; mbs 2,
#             falling back to 1 on an OOM, ~35 s a case), then shardfit compiled, full AC, mbs 2: attention, then
#             attention + the experts' grouped adapters (cap LORA30B_CAP, 360 s). JSON summary: lora30b_vs_peft
#             (shardfit attention tok/s over the anchor's), lora30b_experts_vs_peft, *_peak_vs_peft, lora30b_cases
#   qlora70b  issue 23's QLoRA figure: the Llama-3-70B shape, LoRA r=16 on an NF4 base, seq 4096, ONE H200
#             (nvidia-h200): HF + PEFT + bitsandbytes 4-bit (benchmarks/anchor_peft_qlora.py, axolotl's preparation,
#             full AC, mbs 1), then shardfit compiled with no AC (falls back to the first 10 blocks checkpointed),
#             full AC, the first 40 of 80 blocks (cap QLORA_CAP, 540 s: ~60 s the anchor, ~100-150 s a shardfit case
#             with its build, NF4 init and compile). Carry benchmarks/wheels_bnb (bitsandbytes 0.50.2, 43 MB, its
#             needs torch, numpy and packaging are on the image); installed into /tmp/site first. JSON summary:
#             qlora_vs_peft (best shardfit tokens/s over the anchor's), qlora_70b_peak_gib (that case's peak)
#   qlora70b-h100  the same on one H100 (nvidia-h100-x1): the first 60 blocks checkpointed (falls back to all), all
#   qlora70b-anchors  the anchor's variants on one H200: axolotl, TRL (bf16 adapters), PEFT's guide (fp32 norms and
#             head), axolotl at mbs 2
#   rl-serve4b  the serve comparison at the Qwen3-4B shape (the largest dense full fine-tune one H100 holds, full AC):
#             in process, then through the SDK (cap 400 s)
#   rl-8b     issue 24's 8B figures in one call (one H100 or H200, cap RL_CAP, 550 s; parts in this order, each kept
#             when a later one is cut): the 8B PPO step with LoRA r=16 (full AC) through Engine in process (one timed
#             forward for the old log-probs, 2 timed steps; ~110 s), the anchor's part D on the same data (PEFT,
#             pack_flex, 2 steps; ~130 s): rl_lora_fwdbwd_vs_hf; the same step through `shardfit serve --lora.rank=16`
#             and the tinker SDK (~100 s): serve_vs_inprocess; then the MoE part as `rl` runs it (~120 s), to see
#             the compiled log-prob head's effect there (the first part the cap cuts)
#   rl-prof   Engine.forward at the 8B shape (cap 235 s): 2 timed passes now and 2 with session 14's settings (FSDP
#             gathers at every micro-batch, eager log-prob chunks), then one pass of each under torch.profiler:
#             GPU time by GEMM, attention, the log-prob head, compiled and eager elementwise, FSDP's cast, copies and
#             idle ($OUT/rlprof/fwd_{now,s14}_summary.json, traces under 15 MB), then the anchor's C padnm:
#             rl_fwd_vs_hf of this call
#   rl-auto   the 8B LoRA PPO step (rl-8b's lora-ppo) with compute.activation_checkpoint=auto (the fewest first
#             blocks checkpointed that the plan fits to this GPU: 13 of 36 on an H100, none on an H200) against
#             anchor D (full AC, as RL frameworks default) and anchor D without gradient checkpointing
#             (benchmarks/anchor_rl_no_ac.py; an OOM where it does not fit), then the same shardfit step with full AC
#             (cap RL_CAP 400 s + 160 s): rl_lora_fwdbwd_vs_hf, rl_lora_fwdbwd_vs_hf_no_ac
#   rl-prof-ppo  the 8B LoRA PPO step (rl-8b's lora-ppo) profiled on both sides, kernel class by kernel class
#             (benchmarks/rl_profile.py: GEMM blocks forward / backward+recompute, LoRA, head; attention; the head's
#             softmax; elementwise; optimizer; FSDP; copies; idle), matmul FLOPs from the shapes (record_shapes).
#             shardfit: the card's bf16 matmul ceiling (3 shapes, ~6 s), build, 1 timed forward (old log-probs),
#             warm-up + 1 timed step, 1 profiled step (~150 s); the anchor's part D through its own functions (PEFT,
#             pack_flex; bench_rl_workers.worker_hf_lora): warm-up + 1 timed step, then 1 profiled step with its
#             head labelled (~250 s, most of it the trace: ~1.5M host events). Cap RL_CAP, 560 s. $OUT/rlprofppo/:
#             ppo_{shardfit,hf}_summary.json (each side's class_table_ms, classes.gemm, profile_trace's summary),
#             ppo_compare.json (table_ms [shardfit, anchor, anchor/shardfit], gemm, bounds: how far 2x is,
#             useful: the step's matmul and attention work by the model's sizes), traces under 15 MB (else the GPU
#             events alone, else none); JSON $OUT/rl-prof-ppo.json (summary.ppo_profile, rl_lora_fwdbwd_vs_hf)
# Issue 38, preference training: benchmarks/bench_dpo.py, one GPU (H100 or H200; say which). Carry benchmarks/wheels_dpo
# (TRL, datasets and what they import that the device lacks, ~2 MiB: made by `bash benchmarks/fetch_wheels.sh`, which
# lists and checks them; FULL=1 adds pyarrow and pandas, 55 MiB, for a device without them); the stage prints the
# device's pyarrow and pandas versions (TRL needs pyarrow>=21), then installs into /tmp/site the wheels whose
# distribution the device does not have, or has older (transformers, peft, torch, accelerate are the device's).
#   dpo       DPO, shardfit train against TRL's DPOTrainer (+ PEFT) on the same random-token pairs (prompt 512, answers
#             511 + EOS: 2 x 1,023 tokens a pair, 16 pairs a step, 3 warm-up + 4 timed steps): Llama-3-8B shape LoRA
#             r=16 all linears (shardfit compiled, full AC, 8 pairs a 16,384-token row; TRL bf16, gradient
#             checkpointing, 4 pairs a micro-batch, reference precomputed), then the Llama-3.2-1B shape full fine-tune
#             (fp32 master, bf16 compute, both); caps 170 + 170 + 100 + 100 s cut to a 470 s budget (DPO_CAP 480).
#             DPO_ARGS adds bench_dpo.py options (--cases sf-lora8b-noac,... : no AC, 4,096-token rows; --sf-ac auto;
#             --trl-mbs 2; ...).
#             JSON $OUT/dpo.json: summary.dpo_vs_trl {lora8b, full1b: {throughput, memory}} (shardfit over TRL)
# Issue 35, many LoRA models on one base (benchmarks/bench_clients.py; one GPU, H100 or H200: say which). Carry
# benchmarks/wheels_rl (as the rl stages: the tinker SDK and the server stack, installed into /tmp/site first).
#   clients   Qwen3-8B shape, LoRA r=16 on the 7 linears, full AC, 4,096-token rows, random weights: `shardfit serve
#             --lora.rank=16` and 16 tinker SDK training clients (one model each), the cookbook's RL step
#             (importance_sampling, 16 datums of 896-1,024 tokens, + optim_step): 1, 4, 16 concurrent clients and the
#             16 models one after another, 16 steps each configuration (~4 min with the server's start); then the
#             Engine in process: the same step timed (the SDK's 1-client step against it), a model's and a version's
#             allocated bytes against the plan's, models added until an OOM or the plan's count + 12 (~3.5 min).
#             Cap CLIENTS_CAP, 490 s; CLIENTS_ARGS adds options (--parts memory, --total-steps 32, ...). JSON
#             $OUT/clients.json: summary multi_client_aggregate {1, 4, 16, sequential16}, multi_client_vs_one,
#             model_gib, version_gib, plan_ratio, models_fit, sdk_vs_inprocess, peak_vs_plan
#   multi-ab  session 24: a pass of several models under compile, before and after lora_stack's per-layer
#             _Layer (55ea422): bench_multi_model.py on the 8B shape (LoRA r=16 all-linear, full AC, compiled,
#             4,096-token rows), K = 3 models x 8 datums of 960 tokens, one pass against 3 passes, from .old/src (carry
#             .old: `git archive 6cd7213 src | tar -x -C .old`) then from src; each cap 270 s. Before
#             the fix dynamo compiled a variant per block and ran the blocks past recompile_limit (8) eager: its log
#             says "hit config.recompile_limit" and one_pass_over_sequential should be ~0.6 (the clients benchmark's
#             1.6x); after, no such line and ~0.9-1.0 (the stacked adapter's K-fold FLOPs: ~2% at K = 3).
#             $OUT/mm_old.json, $OUT/mm_new.json and their logs
#   tests-s25 session 25's CUDA tests of code no GPU has run: flex attention with prefix trees (the packed
#             document/branch ids) and the FP8 base (model.quantize=fp8: _scaled_mm against the CPU's emulation, a
#             compiled run); $OUT/pytest_s25.log
#   fp8k      session 26: the FP8 base's Triton quantiser and transposed copy (kernels/fp8_rows.py) against the
#             compiled quantiser and eager copy they replace (bench_fp8_linear.py, MLP then attention shape), after
#             the fp8base DPO case in rows of 3 shared pairs and at 16k-token rows with TRL's between them, one
#             steady step of each profiled (summaries under $OUT/dpoprof; carry benchmarks/wheels_dpo; DPO_CAP,
#             510 s). The CUDA tests in s26b
set -u
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
export PYTHONPATH=/tmp/site:$PWD/src
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
two="CUDA_VISIBLE_DEVICES=0,1"
for stage in "$@"; do
  echo "=== $stage $(date +%T)"
  case $stage in
    setup) python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl ;;
    tests) env $two python3 -m pytest -q -m cuda tests/cuda -p no:cacheprovider 2>&1 | tee "$OUT/pytest_cuda.log" | tail -15 ;;
    tiny2) env $two python3 -m shardfit train --nproc 2 --logging.progress=lines --logging.run_dir=/tmp/tiny2 2>&1 | tee "$OUT/tiny2.log" | grep -v "^step [0-9]*/150 " | tail -12 ;;
    hf8b)
      python3 benchmarks/bench_load.py write --shape llama3-8b --layers 32 --init normal --out /tmp/llama8b
      env $two python3 -m shardfit train --nproc 2 --model.path=/tmp/llama8b --data.seq_len=4096 \
        --train.micro_batch=1 --train.global_batch=2 --train.steps=4 --train.warmup_steps=1 --train.lr=1e-5 \
        --logging.log_every=1 --logging.progress=lines --logging.run_dir=/tmp/hf8b --checkpoint.final=false \
        --checkpoint.export_hf=/tmp/llama8b_out 2>&1 | tee "$OUT/hf8b.log" | grep -E "^(loaded|step|exported|shardfit|done|rank)" ;
      ls -la /tmp/llama8b_out | tee -a "$OUT/hf8b.log" ;;
    load)
      python3 benchmarks/bench_load.py write --shape qwen3-30b-a3b --layers 48 --out /tmp/q48
      for i in 1 2; do env $two python3 -m torch.distributed.run --standalone --nproc_per_node 2 benchmarks/bench_load.py load --path /tmp/q48; done | tee "$OUT/load2.json"
      if [ "$(nvidia-smi -L | wc -l)" -ge 4 ]; then python3 -m torch.distributed.run --standalone --nproc_per_node 4 benchmarks/bench_load.py load --path /tmp/q48 | tee "$OUT/load4.json"; fi
      env $two LAYERS=48 python3 -m torch.distributed.run --standalone --nproc_per_node 2 .anchors/broadcast_load.py 2>&1 | tail -3 | tee "$OUT/anchor_load2.txt" ;;
    load-variants)  # after `load` (needs /tmp/q48): reading threads x staging buffer size (the largest read), 2 GPUs
      for t in 8 16; do for m in 16 64; do echo "threads $t pinned ${m} MiB"; env $two SHARDFIT_LOAD_THREADS=$t SHARDFIT_PINNED_MIB=$m python3 -m torch.distributed.run --standalone --nproc_per_node 2 benchmarks/bench_load.py load --path /tmp/q48 2>&1 | grep '^{'; done; done | tee "$OUT/load_variants.txt" ;;
    probe)
      for t in 4 8; do env $two python3 -m torch.distributed.run --standalone --nproc_per_node 2 benchmarks/bench_load.py probe --path /tmp/q48 --threads $t; done ;;
    levers) env $two python3 benchmarks/bench_train.py --suite levers --nproc 2 --out "$OUT/levers_x2.json" 2>&1 | tail -9 ;;
    levers2) env $two python3 benchmarks/bench_train.py --suite levers2 --nproc 2 --out "$OUT/levers2_x2.json" 2>&1 | tail -8 ;;
    heads)  # A/B in one call: the tree in .old/src (a copy of an earlier commit, carried) against this one
      for tree in .old/src src; do env $two PYTHONPATH=/tmp/site:$PWD/$tree python3 benchmarks/bench_train.py --suite best --nproc 2 --only "compile mbs4" --out "$OUT/heads_$(dirname $tree | tr ./ _)_x2.json" 2>&1 | tail -1; done ;;
    final) env $two python3 benchmarks/bench_train.py --suite final --nproc 2 --out "$OUT/final_x2.json" 2>&1 | tail -6 ;;
    levers4) env $two python3 benchmarks/bench_train.py --suite levers4 --nproc 2 --out "$OUT/levers4_x2.json" 2>&1 | tail -8 ;;
    levers3) env $two python3 benchmarks/bench_train.py --suite levers3 --nproc 2 --out "$OUT/levers3_x2.json" 2>&1 | tail -11 ;;
    best2) env $two python3 benchmarks/bench_train.py --suite best --nproc 2 --out "$OUT/best_x2.json" 2>&1 | tail -4 ;;
    honest) env $two python3 benchmarks/bench_train.py --suite honest --nproc 2 --out "$OUT/honest_x2.json" 2>&1 | tail -4 ;;
    best4) python3 benchmarks/bench_train.py --suite best --nproc 4 --only "compile mbs4" --out "$OUT/best_x4.json" 2>&1 | tail -4 ;;
    best24)  # the best configuration on 2 then on 4 GPUs, in one call (scaling)
      env $two python3 benchmarks/bench_train.py --suite best --nproc 2 --only "compile mbs4" --out "$OUT/best_x2.json" 2>&1 | tail -2
      python3 benchmarks/bench_train.py --suite best --nproc 4 --only "compile mbs4" --out "$OUT/best_x4.json" 2>&1 | tail -2 ;;
    long)
      for i in $(seq 30); do cat src/shardfit/data/corpus/field_guide.txt; done > /tmp/long.txt
      env $two python3 benchmarks/bench_train.py --suite long --nproc 2 --timeout 560 --out "$OUT/long_x2.json" 2>&1 | tail -4 ;;
    curve) python3 benchmarks/bench_train.py --suite curve --nproc 1 --timeout 400 --out "$OUT/curve_x1.json" 2>&1 | tail -9 ;;
    single8) python3 benchmarks/bench_train.py --suite single8 --nproc 1 --out "$OUT/single8_x1.json" 2>&1 | tail -5 ;;
    single) python3 benchmarks/bench_train.py --suite single --nproc 1 --out "$OUT/single_x1.json" 2>&1 | tail -6 ;;
    gemm)  # the step's GEMMs alone on one GPU, then on 2 with an NCCL all-gather looping beside them (default
      # channels, then 4): the matmul ceiling against the profile's in-step rate
      python3 benchmarks/bench_gemm.py --out "$OUT/gemm_x1.json"
      env $two python3 -m torch.distributed.run --standalone --nproc_per_node 2 benchmarks/bench_gemm.py --comm --out "$OUT/gemm_comm_x2.json" 2>&1 | grep -v Warn
      env $two NCCL_MAX_NCHANNELS=4 python3 -m torch.distributed.run --standalone --nproc_per_node 2 benchmarks/bench_gemm.py --comm --out "$OUT/gemm_comm4_x2.json" 2>&1 | grep -v Warn ;;
    fp8) mkdir -p "$OUT/traces"; env $two BENCH_KEEP_TRACES="$OUT/traces" python3 benchmarks/bench_train.py --suite fp8 --nproc 2 --out "$OUT/fp8_x2.json" 2>&1 | tail -7 ;;
    fp8x24)  # FP8 tensorwise mbs 5 on 2 then 4 GPUs, in one call (scaling)
      env $two python3 benchmarks/bench_train.py --suite final4 --nproc 2 --only "fp8 tensorwise mbs5" --out "$OUT/fp8_mbs5_x2.json" 2>&1 | tail -2
      python3 benchmarks/bench_train.py --suite final4 --nproc 4 --only "fp8 tensorwise mbs5" --out "$OUT/fp8_mbs5_x4.json" 2>&1 | tail -2 ;;
    final4) env $two python3 benchmarks/bench_train.py --suite final4 --nproc 2 --out "$OUT/final4_x2.json" 2>&1 | tail -8 ;;
    curve8) python3 benchmarks/bench_train.py --suite curve8 --nproc 1 --timeout 400 --out "$OUT/curve8_x1.json" 2>&1 | tail -9 ;;
    profile) mkdir -p "$OUT/traces"; env $two BENCH_KEEP_TRACES="$OUT/traces" python3 benchmarks/bench_train.py --suite profile --nproc 2 --out "$OUT/profile_x2.json" 2>&1 | tail -3 ;;
    sftdata) python3 benchmarks/gen_sft_data.py --out /tmp/sft_varlen | tee "$OUT/sftdata.txt"; cp /tmp/sft_varlen/summary.json "$OUT/sft_summary.json" ;;
    varlen8b) env $two timeout 290 python3 benchmarks/bench_train.py --suite varlen8b --nproc 2 --timeout 200 --out "$OUT/varlen8b_x2.json" 2>&1 | tee "$OUT/varlen8b.log" | grep -v '^{' | tail -14 ;;
    docmask8b) env $two timeout 280 python3 benchmarks/bench_train.py --suite docmask8b --nproc 2 --timeout 200 --out "$OUT/docmask8b_x2.json" 2>&1 | tee "$OUT/docmask8b.log" | grep -v '^{' | tail -10 ;;
    flat300a) env CUDA_VISIBLE_DEVICES=0 timeout 380 python3 benchmarks/bench_train.py --suite flat300_anchors --nproc 1 --timeout 180 --out "$OUT/flat300a_x1.json" 2>&1 | tee "$OUT/flat300a.log" | grep -v '^{' | tail -12 ;;
    flat300) env CUDA_VISIBLE_DEVICES=0 timeout 380 python3 benchmarks/bench_train.py --suite flat300 --nproc 1 --timeout 130 --out "$OUT/flat300_x1.json" 2>&1 | tee "$OUT/flat300.log" | grep -v '^{' | tail -22 ;;
    attn) env CUDA_VISIBLE_DEVICES=0 timeout 190 python3 benchmarks/bench_attention.py --out "$OUT/attn_x1.json" 2>&1 | tee "$OUT/attn.log" | grep -v '^{' | tail -16 ;;
    docattn) env CUDA_VISIBLE_DEVICES=0 timeout 230 python3 benchmarks/bench_doc_attention.py --out "$OUT/docattn.json" 2>&1 | tee "$OUT/docattn.log" | grep -v Warning | tail -75 ;;
    offload8b)  # one compile worker: the host's memory is for the offloaded states
      (while sleep 1; do echo "$(date +%T) $(grep MemAvailable /proc/meminfo)"; done) > "$OUT/offload8b_hostmem.txt" & sampler=$!
      env CUDA_VISIBLE_DEVICES=0 TORCHINDUCTOR_COMPILE_THREADS=1 timeout 470 python3 benchmarks/bench_train.py --suite offload8b --nproc 1 --timeout 270 --out "$OUT/offload8b_x1.json" 2>&1 | tee "$OUT/offload8b.log" | grep -v '^{' | tail -5
      kill $sampler; echo "lowest host MemAvailable: $(sort -k3 -n "$OUT/offload8b_hostmem.txt" | head -1)" ;;
    offload8b-cap80)
      (while sleep 1; do echo "$(date +%T) $(grep MemAvailable /proc/meminfo)"; done) > "$OUT/offload8b_cap80_hostmem.txt" & sampler=$!
      env CUDA_VISIBLE_DEVICES=0 TORCHINDUCTOR_COMPILE_THREADS=1 timeout 470 python3 benchmarks/bench_train.py --suite offload8b_cap80 --nproc 1 --timeout 270 --out "$OUT/offload8b_cap80_x1.json" 2>&1 | tee "$OUT/offload8b_cap80.log" | grep -v '^{' | tail -5
      kill $sampler; echo "lowest host MemAvailable: $(sort -k3 -n "$OUT/offload8b_cap80_hostmem.txt" | head -1)" ;;
    ttsetup)
      [ -d /tmp/site/torchtitan ] || python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
      python3 benchmarks/anchor_torchtitan_assets.py /tmp/ttassets
      python3 -c "import importlib.metadata as m, torchtitan.train, torchao; print({p: m.version(p) for p in ('torchtitan', 'torchdata', 'tyro', 'datasets', 'torchao', 'transformers', 'torch')})" 2>&1 | tail -2 ;;
    moe2) env $two timeout 540 python3 benchmarks/bench_moe.py --nproc 2 --layers 12 --budget 525 --out "$OUT/moe2_x2.json" 2>&1 | tee "$OUT/moe2.log" | grep -v '^{' | tail -16 ;;
    moe4) timeout 540 python3 benchmarks/bench_moe.py --nproc 4 --layers 48 --ac full --budget 525 --out "$OUT/moe4_x4.json" 2>&1 | tee "$OUT/moe4.log" | grep -v '^{' | tail -16 ;;
    moesweep)  # the EP2 cases, one change at a time, beside the HF recipe (MOE_VARIANTS: more NAME=FLAGS cases, ";")
      IFS=';' read -ra vs <<< "${MOE_VARIANTS:-prefetch1=--parallel.prefetch=1}"; va=(); for v in "${vs[@]}"; do va+=(--variant "$v"); done
      base="shardfit no-AC compile EP2"; labels=("HF grouped_mm full-AC" "$base" "$base overlap-opt"); for v in "${vs[@]}"; do labels+=("$base overlap-opt ${v%%=*}"); done
      env $two timeout 560 python3 benchmarks/bench_moe.py --nproc 2 --layers 12 --budget 540 "${va[@]}" --only "${labels[@]}" --out "$OUT/moesweep_x2.json" 2>&1 | tee "$OUT/moesweep.log" | grep -v '^{' | tail -9 ;;
    tests-moe) env $two timeout 400 python3 -m pytest -m cuda -q -rA --tb=short -p no:cacheprovider tests/kernels tests/cuda/test_cuda_moe.py tests/cuda/test_cuda_step_overlap.py 2>&1 | tee "$OUT/pytest_moe.log" | grep -E "PASSED|FAILED|passed|failed|^E " | tail -14 ;;
    moe2-short)  # the fastest systems only, beside the HF recipe: HF, torchtitan's best, shardfit EP2 with and without the overlap
      env $two timeout 400 python3 benchmarks/bench_moe.py --nproc 2 --layers 12 --budget 380 --only "HF grouped_mm full-AC" "torchtitan no-AC compile EP2" "shardfit no-AC compile EP2" "shardfit no-AC compile EP2 overlap-opt" --out "$OUT/moe2_short_x2.json" 2>&1 | tee "$OUT/moe2_short.log" | grep -v '^{' | tail -9 ;;
    tests1) env CUDA_VISIBLE_DEVICES=0 timeout 180 python3 -m pytest -m cuda -q -rA --tb=short -p no:cacheprovider tests/kernels tests/cuda 2>&1 | tee "$OUT/pytest_cuda1.log" | grep -E "PASSED|FAILED|ERROR|passed|failed|^E " | tail -30 ;;
    tests-a2a1) env CUDA_VISIBLE_DEVICES=0 timeout 300 python3 -m pytest -m cuda -q -rA --tb=short -p no:cacheprovider tests/cuda/test_cuda_moe.py -k "one_gpu or grouped" 2>&1 | tee "$OUT/pytest_a2a1.log" | grep -E "PASSED|FAILED|ERROR|passed|failed|^E " | tail -12 ;;
    tests1b) env CUDA_VISIBLE_DEVICES=0 timeout 250 python3 -m pytest -m cuda -q -rA --tb=short -p no:cacheprovider tests/cuda/test_cuda_training.py tests/cuda/test_cuda_varlen.py 2>&1 | tee "$OUT/pytest_cuda1b.log" | grep -E "PASSED|FAILED|ERROR|passed|failed|^E " | tail -16 ;;
    nf4)  # issue 23: NF4 kernels at the 70B linear shapes, shardfit eager/compiled/Triton against bitsandbytes (carry benchmarks/wheels_bnb)
      [ -d /tmp/site/bitsandbytes ] || python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site benchmarks/wheels_bnb/*.whl
      env CUDA_VISIBLE_DEVICES=0 timeout ${NF4_CAP:-150} python3 benchmarks/bench_nf4.py --out "$OUT/nf4_x1.json" 2>&1 | grep -v '^{' | tail -12 ;;
    moeprof1)
      python3 -c "import sys, argparse; sys.path.insert(0, 'benchmarks'); import bench_moe; bench_moe.ensure_data(argparse.Namespace(tokens='uniform', assets='/tmp/ttassets', dry_run=False))"
      cmd=$(python3 benchmarks/bench_moe.py --dry-run --nproc 1 --layers 6 --only "shardfit no-AC compile overlap-opt" | grep -o 'torchrun .*')
      env CUDA_VISIBLE_DEVICES=0 timeout 150 $cmd --train.steps=9 --logging.profile_step=8 --logging.run_dir=/tmp/moeprof1 2>&1 | grep -E "^(step [89]/|profile)" | cut -c1-600
      cp /tmp/moeprof1/profile/step8_summary.json "$OUT/moeprof1_summary.json"
      t=/tmp/moeprof1/profile/step8_rank0.json.gz; [ "$(stat -c %s $t)" -lt 16000000 ] && cp $t "$OUT/moeprof1_trace.json.gz"
      python3 -c "import json; d=json.load(open('$OUT/moeprof1_summary.json')); print(json.dumps({k: d[k] for k in ('idle',) if k in d}, indent=1))" ;;
    house1-dense)
      for tree in .old/src src .old/src src; do tag=$(echo "$tree" | tr -d ./); n=$((${n:-0} + 1))
        env CUDA_VISIBLE_DEVICES=0 PYTHONPATH=/tmp/site:$PWD/$tree timeout 140 python3 benchmarks/bench_train.py --suite single --nproc 1 --timeout 130 --only "llama3-1b compile mbs4" --out "$OUT/house1_dense_${n}_$tag.json" 2>&1 | tail -1; done ;;
    house1-moe)  # wall clock per step over steps 10-40, from timestamped log lines (old then new, twice)
      cmd=$(python3 benchmarks/bench_moe.py --dry-run --nproc 1 --layers 6 --only "shardfit no-AC compile overlap-opt" | grep -o 'torchrun .*' | sed 's/--train.steps=12//')
      python3 -c "import sys, argparse; sys.path.insert(0, 'benchmarks'); import bench_moe; bench_moe.ensure_data(argparse.Namespace(tokens='uniform', assets='/tmp/ttassets', dry_run=False))" >/dev/null
      n=0; for tree in .old/src src .old/src src; do n=$((n + 1)); tag=$(echo "$tree" | tr -d ./); rm -rf /tmp/house1
        env CUDA_VISIBLE_DEVICES=0 PYTHONPATH=/tmp/site:$PWD/$tree timeout 150 $cmd --train.steps=40 --logging.run_dir=/tmp/house1 2>&1 | while IFS= read -r l; do echo "$(date +%s.%N) $l"; done > "$OUT/house1_moe_${n}_$tag.log"
        python3 benchmarks/wall_per_step.py "$OUT/house1_moe_${n}_$tag.log" 10 40; done ;;
    moe1) env CUDA_VISIBLE_DEVICES=0 timeout 360 python3 benchmarks/bench_moe.py --nproc 1 --layers 6 --budget 345 --only "HF grouped_mm full-AC" "shardfit no-AC compile" "shardfit no-AC compile overlap-opt" "torchtitan no-AC compile" --out "$OUT/moe1_x1.json" 2>&1 | tee "$OUT/moe1.log" | grep -v '^{' | tail -8 ;;
    moe2-a2a)  # the dispatch all-to-all overlapped with the own rows (parallel.expert_overlap): one change against the fastest case, HF beside
      env $two timeout 500 python3 benchmarks/bench_moe.py --nproc 2 --layers 12 --budget 480 --variant "a2a=--parallel.expert_overlap=dispatch" --variant "a2a-both=--parallel.expert_overlap=both" --only "HF grouped_mm full-AC" "shardfit no-AC compile EP2 overlap-opt" "shardfit no-AC compile EP2 overlap-opt a2a" "shardfit no-AC compile EP2 overlap-opt a2a-both" --out "$OUT/moe2_a2a_x2.json" 2>&1 | tee "$OUT/moe2_a2a.log" | grep -v '^{' | tail -8 ;;
    moecurve3)  # the plain curve, its noise yardstick and the fastest configuration's, 50 steps each
      env $two timeout 300 python3 benchmarks/bench_train.py --suite moecurve --nproc 2 --timeout 120 --only "plain MoE: eager, full AC" "plain MoE, loss chunk 512 (noise)" "fastest MoE: compiled, no AC, EP 2, overlapped step" --out "$OUT/moecurve3_x2.json" 2>&1 | tail -6 ;;
    hsdp4) timeout 400 python3 benchmarks/bench_train.py --suite hsdp4 --nproc 4 --timeout 180 --out "$OUT/hsdp4_x4.json" 2>&1 | tail -4 ;;
    moe24)  # EP scaling in one call: the fastest MoE case on 2 GPUs (EP 2), then on 4 (EP 4 and EP 2), HF beside both
      env $two timeout 200 python3 benchmarks/bench_moe.py --nproc 2 --layers 12 --budget 190 --only "HF grouped_mm full-AC" "shardfit no-AC compile EP2 overlap-opt" --out "$OUT/moe24_x2.json" 2>&1 | grep -v '^{' | tail -5
      timeout 340 python3 benchmarks/bench_moe.py --nproc 4 --layers 12 --budget 330 --variant "ep2=--parallel.expert_parallel=2" --only "HF grouped_mm full-AC" "shardfit no-AC compile EP4 overlap-opt" "shardfit no-AC compile EP4 overlap-opt ep2" --out "$OUT/moe24_x4.json" 2>&1 | grep -v '^{' | tail -6 ;;
    moecurve) env $two timeout 560 python3 benchmarks/bench_train.py --suite moecurve --nproc 2 --timeout 200 --out "$OUT/moecurve_x2.json" 2>&1 | tail -9 ;;
    tests-split)  # the CUDA suite file by file, each under its own cap, the whole log kept (call it alone)
      for f in tests/cuda/test_*.py; do env $two timeout 240 python3 -m pytest -m cuda -q -rA --tb=short -p no:cacheprovider "$f" 2>&1 | tee -a "$OUT/pytest_cuda.log" | tail -3; done ;;
    tests-a2a) env $two timeout 400 python3 -m pytest -m cuda -q -rA --tb=short -p no:cacheprovider tests/cuda/test_cuda_moe.py -k overlap 2>&1 | tee "$OUT/pytest_a2a.log" | grep -E "PASSED|FAILED|passed|failed|^E " | tail -12 ;;
    tests-overlap) env $two timeout 240 python3 -m pytest -m cuda -q -rA --tb=short -p no:cacheprovider tests/cuda/test_cuda_step_overlap.py 2>&1 | tee "$OUT/pytest_overlap.log" | grep -E "PASSED|FAILED|passed|failed|^E " | tail -12 ;;
    moeprof)  # shardfit's fastest MoE case (moe2's EP2 compiled) with step 8 profiled; summary JSON to $OUT
      python3 -c "import sys, argparse; sys.path.insert(0, 'benchmarks'); import bench_moe; bench_moe.ensure_data(argparse.Namespace(tokens='uniform', assets='/tmp/ttassets', dry_run=False))"
      cmd=$(python3 benchmarks/bench_moe.py --dry-run --only "shardfit no-AC compile EP2" | grep -o 'torchrun .*')
      # MOEPROF_EXTRA: flags added to the case (e.g. --parallel.overlap_optimizer=true), one change against the last
      env $two timeout 150 $cmd --train.steps=9 --logging.profile_step=8 --logging.run_dir=/tmp/moeprof ${MOEPROF_EXTRA:-} 2>&1 | grep -E "^(step [89]/|profile)" | cut -c1-600
      cp /tmp/moeprof/profile/step8_summary.json "$OUT/moeprof_summary.json"
      t=/tmp/moeprof/profile/step8_rank0.json.gz; [ "$(stat -c %s $t)" -lt 16000000 ] && cp $t "$OUT/moeprof_trace.json.gz"
      python3 -c "import json; print(json.dumps(json.load(open('$OUT/moeprof_summary.json'))['idle'], indent=1))" ;;
    lora8b) env CUDA_VISIBLE_DEVICES=0 timeout ${LORA_CAP:-420} python3 benchmarks/bench_train.py --suite lora8b --nproc 1 --timeout 200 --out "$OUT/lora8b_x1.json" 2>&1 | tail -6 ;;
    lora30b) env CUDA_VISIBLE_DEVICES=0 timeout ${LORA30B_CAP:-360} python3 benchmarks/bench_train.py --suite lora30b --nproc 1 --timeout 145 --out "$OUT/lora30b_x1.json" 2>&1 | tee "$OUT/lora30b.log" | grep -v '^{' | tail -14 ;;
    qlora70b|qlora70b-h100|qlora70b-anchors)
      [ -d /tmp/site/bitsandbytes ] || python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site benchmarks/wheels_bnb/*.whl
      python3 -c "import importlib.metadata as m; print({p: m.version(p) for p in ('bitsandbytes', 'peft', 'transformers', 'torch')})"
      suite=${stage//-/_}
      env CUDA_VISIBLE_DEVICES=0 timeout ${QLORA_CAP:-540} python3 benchmarks/bench_train.py --suite $suite --nproc 1 --timeout 260 --out "$OUT/${suite}_x1.json" 2>&1 | tee "$OUT/$suite.log" | grep -v '^{' | tail -14 ;;
    sample-baseline)  # issue 36: today's serve sampler against transformers' generate (dynamic, static compiled,
      # generate_batch) and the decode roofline at the measured copy bandwidth; Qwen3-8B shape, 1 GPU (carry .anchors);
      # the new sampler (Engine.sample) first, at 16/64/256 rows; SAMPLE_ARGS: more flags (--new-variants, --today 0)
      env CUDA_VISIBLE_DEVICES=0 timeout ${SAMPLE_CAP:-560} python3 benchmarks/bench_sampling.py ${SAMPLE_ARGS:-} --rows ${SAMPLE_ROWS:-16,64} --hf-rows ${SAMPLE_HF_ROWS:-64} --hf-timeout 130 --out "$OUT/sampling_baseline.json" 2>&1 | tee "$OUT/sampling.log" | grep -v '^{' | tail -12 ;;
    sample-core)  # issue 36: the new sampler (src/shardfit/sampling) per decode path (gather+graphs, gather+eager,
      # flex+eager) at 16/64/256 rows against the decode roofline; Qwen3-8B shape, plain bf16 CausalLM, 1 GPU
      env CUDA_VISIBLE_DEVICES=0 timeout ${SAMPLE_CAP:-560} python3 benchmarks/bench_sampler_core.py ${CORE_ARGS:-} --rows ${CORE_ROWS:-16,64,256} --out "$OUT/sampler_core.json" 2>&1 | tee "$OUT/sampler_core.log" | grep -v '^{' | tail -14 ;;
    rl-iter|rl-iter-old)  # issue 36: a cookbook-shaped RL iteration through the tinker SDK against `shardfit serve`
      # (benchmarks/bench_rl_iter.py): Qwen3-8B shape, LoRA r=16, 64 prompts of 256 tokens x 16 samples x 512 new
      # tokens (forced), then importance_sampling forward_backward + optim_step; a warm-up, then 2 timed iterations
      # (those the budget holds). rl-iter-old: the same against .old/src's server (an earlier commit's src, carried),
      # in a call of its own. RLITER_ARGS: more flags (--shape 4b, --prompts 32, --iters 3, ...). JSON
      # $OUT/<stage>.json (summary: rl_iter_sample_over_train, rl_iter_s, ...), log $OUT/<stage>.log
      [ -d /tmp/site/tinker ] || python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site benchmarks/wheels_rl/*.whl
      src=src; [ $stage = rl-iter-old ] && src=.old/src
      env CUDA_VISIBLE_DEVICES=0 timeout ${RLITER_CAP:-570} python3 benchmarks/bench_rl_iter.py --src $src --budget $((${RLITER_CAP:-570} - 40)) ${RLITER_ARGS:-} --out "$OUT/$stage.json" 2>&1 | tee "$OUT/$stage.log" | grep -v FutureWarning | tail -12 ;;
    gap)  # issue 36 item 6: the train/sample log-prob gap and sampling.logprobs=trainer's cost (header above)
      env CUDA_VISIBLE_DEVICES=0 timeout ${GAP_CAP:-300} python3 benchmarks/bench_logprob_gap.py ${GAP_ARGS:-} --out "$OUT/gap.json" 2>&1 | tee "$OUT/gap.log" | grep -v '^{' | tail -12 ;;
    sampler-ab)  # issue 36: the sampler's and kernels' CUDA tests, then one change each against triton+graphs
      # (steady-window decode rate, distinct prompts, Qwen3-8B shape). Session 23 ran it with the then-new paths
      # against the then-defaults and made them the defaults (fused_ops="all", the LoRA sibling groups,
      # prefill_chunk 2048); it now compares each default with the form it replaced: fused_ops=True at 16/64 rows,
      # 256 rows with 512 new tokens, ungrouped LoRA at 64 rows (r=16), prefill_chunk 512 at 64 rows.
      # Each part its own cap and JSON ($OUT/ab_*.json); ~9 min
      env CUDA_VISIBLE_DEVICES=0 timeout 170 python3 -m pytest -m cuda -q -rf --tb=short -p no:cacheprovider tests/kernels tests/sampling tests/cuda/test_cuda_sampling.py 2>&1 | tee "$OUT/pytest_sampling.log" | tail -6
      core() { local cap=$1 name=$2; shift 2
        env CUDA_VISIBLE_DEVICES=0 timeout $cap python3 benchmarks/bench_sampler_core.py "$@" --out "$OUT/ab_$name.json" 2>&1 | tee "$OUT/ab_$name.log" | grep -v '^{' | tail -5; }
      core 120 fusednorms --rows 16,64 --paths triton+graphs,triton+graphs+fusednorms
      core 100 rows256 --rows 256 --new 512 --paths triton+graphs
      core 100 ungrouped --rows 64 --lora 16 --paths triton+graphs,triton+graphs+ungrouped
      core 70 chunk512 --rows 64 --prefill-chunk 512 --paths triton+graphs ;;
    tests-sampling)  # the sampler's CUDA tests: graphs, flex, the paged-attention and multi-LoRA kernels (1 GPU)
      env CUDA_VISIBLE_DEVICES=0 timeout ${TESTS_CAP:-200} python3 -m pytest -m cuda -q -rf --tb=short -p no:cacheprovider tests/cuda/test_cuda_sampling.py tests/kernels/test_paged_attention.py tests/kernels/test_multi_lora.py 2>&1 | tee "$OUT/pytest_sampling.log" | tail -8 ;;
    rl-auto)  # the 8B LoRA PPO step with compute.activation_checkpoint=auto against anchor D with and without its
      # gradient checkpointing, then the same step with full AC (the one change), each its own JSON
      [ -d /tmp/site/tinker ] || python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site benchmarks/wheels_rl/*.whl
      env CUDA_VISIBLE_DEVICES=0 timeout ${RL_CAP:-400} python3 benchmarks/bench_rl.py --parts lora-ppo/shardfit,lora-ppo/hf,lora-ppo/hf-noac --reps 2 --fwd-reps 1 --budget $((${RL_CAP:-400} - 20)) --sf-extra=--compute.activation_checkpoint=auto --out "$OUT/rl-auto.json" 2>&1 | tee "$OUT/rl-auto.log" | grep -v '^{' | tail -30
      env CUDA_VISIBLE_DEVICES=0 timeout 160 python3 benchmarks/bench_rl.py --parts lora-ppo/shardfit --reps 2 --fwd-reps 1 --budget 150 --out "$OUT/rl-auto-full.json" 2>&1 | tee "$OUT/rl-auto-full.log" | grep -v '^{' | tail -8 ;;
    rl|rl-dense|rl-moe|rl-serve4b|rl-lora|rl-8b|rl-prof|rl-prof-ppo)
      [ -d /tmp/site/tinker ] || python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site benchmarks/wheels_rl/*.whl
      case $stage in
        rl) parts=dense-fwd,dense-ppo,serve,moe; reps=2; cap=530; more=(--hf-fwd padnm) ;;
        rl-dense) parts=dense-fwd,dense-ppo,serve; reps=3; cap=500; more=() ;;
        rl-moe) parts=moe; reps=3; cap=${RL_CAP:-420}; more=(); [ "${RL_MOE_PROF:-1}" = 1 ] && more=(--prof-out "$OUT/rlmoe") ;;
        rl-serve4b) parts=serve; reps=3; cap=400; more=(--serve-shape 4b) ;;
        rl-lora) parts=lora-ppo; reps=2; cap=${RL_CAP:-300}; more=(--fwd-reps 1) ;;
        rl-8b) parts=lora-ppo/shardfit,lora-ppo/hf,serve,moe; reps=2; cap=${RL_CAP:-550}; more=(--serve-shape 8b --serve-lora 16 --fwd-reps 1 --hf-fwd padnm) ;;
        rl-prof) parts=dense-fwd; reps=2; cap=235; more=(--hf-fwd padnm --prof-out "$OUT/rlprof") ;;
        rl-prof-ppo) parts=lora-ppo/shardfit,lora-ppo/hf; reps=1; cap=${RL_CAP:-560}; more=(--fwd-reps 1 --hf-ppo pack_flex --prof-out "$OUT/rlprofppo") ;;
      esac
      [ -n "${RL_EXTRA:-}" ] && more+=("--sf-extra=$RL_EXTRA")  # Engine overrides for every shardfit run of the stage
      # RL_LOGPROBS_AT=counted: shardfit's passes score the response tokens alone (the forward also timed scoring
      # all); RL_TAG names the JSON/log $OUT/<stage>-<tag>.json so that a second run of a stage keeps the first's
      name=$stage${RL_TAG:+-$RL_TAG}
      env CUDA_VISIBLE_DEVICES=0 timeout $cap python3 benchmarks/bench_rl.py --parts "${RL_PARTS:-$parts}" --reps $reps --budget $((cap - 20)) --logprobs-at "${RL_LOGPROBS_AT:-all}" "${more[@]}" --out "$OUT/$name.json" 2>&1 | tee "$OUT/$name.log" | grep -v '^{' | tail -90 ;;
    dpo)
      python3 -c "import pyarrow, pandas; print('device pyarrow', pyarrow.__version__, 'pandas', pandas.__version__)" || echo "device: no pyarrow/pandas: FULL=1 bash benchmarks/fetch_wheels.sh"
      for w in benchmarks/wheels_dpo/*.whl; do  # each wheel whose distribution the device lacks, or has older
        python3 -c "import importlib.metadata as m, sys; from packaging.version import Version as V; n, v = sys.argv[1].split('-')[:2]; sys.exit(V(m.version(n)) < V(v))" "$(basename "$w")" 2>/dev/null || echo "$w"
      done > /tmp/dpo_wheels.txt
      [ -s /tmp/dpo_wheels.txt ] && python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site $(cat /tmp/dpo_wheels.txt)
      echo "installed: $(xargs -n1 basename < /tmp/dpo_wheels.txt | tr '\n' ' ')"
      env CUDA_VISIBLE_DEVICES=0 timeout ${DPO_CAP:-480} python3 benchmarks/bench_dpo.py --budget $((${DPO_CAP:-480} - 10)) ${DPO_ARGS:-} --out "$OUT/dpo.json" 2>&1 | tee "$OUT/dpo.log" | grep -v '^{' | tail -14 ;;
    clients)  # issue 35: concurrent SDK training clients, a model's and a version's memory against the plan
      [ -d /tmp/site/tinker ] || python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site benchmarks/wheels_rl/*.whl
      env CUDA_VISIBLE_DEVICES=0 timeout ${CLIENTS_CAP:-560} python3 benchmarks/bench_clients.py --budget $((${CLIENTS_CAP:-560} - 20)) ${CLIENTS_ARGS:-} --out "$OUT/clients.json" 2>&1 | tee "$OUT/clients.log" | grep -v '^{' | grep -v "^Retrying request" | tail -30 ;;
    multi-ab)  # session 24: compiled multi-model pass, .old/src (before the per-layer stack) then src
      MM="--models 3 --datums 8 --length 960 --steps 2 --warmup 1"
      MMO="--model.qk_norm=true --model.rope_theta=1000000 --model.norm_eps=1e-6 --model.vocab_size=151936 --model.n_kv_heads=8 --model.head_dim=128 --model.dim=4096 --model.n_layers=36 --model.n_heads=32 --model.ffn_dim=12288 --model.tie_embeddings=false --train.micro_batch_tokens=4096 --data.seq_len=4096 --model.max_seq_len=40960 --train.device=cuda --logging.run_dir=/tmp/mmrun --logging.progress=none --compute.compile=true --lora.rank=16 --lora.alpha=32 --lora.targets=all-linear --compute.activation_checkpoint=full"
      for t in old new; do tree=src; [ $t = old ] && tree=.old/src
        env CUDA_VISIBLE_DEVICES=0 PYTHONPATH=/tmp/site:$PWD/$tree timeout 270 python3 benchmarks/bench_multi_model.py $MM --out "$OUT/mm_$t.json" -- $MMO > "$OUT/mm_$t.log" 2>&1
        echo "$t rc=$?"; grep -E '^\{|recompile_limit|Error' "$OUT/mm_$t.log" | cut -c1-400; done ;;
    tests-s25)  # session 25's GPU code, never run on a GPU: flex with prefix trees (packed branch ids), the FP8 base
      env CUDA_VISIBLE_DEVICES=0 timeout 300 python3 -m pytest -m cuda -q -rA --tb=short -p no:cacheprovider tests/cuda/test_cuda_fp8_base.py "tests/cuda/test_cuda_varlen.py" -k "branches or fp8" 2>&1 | tee "$OUT/pytest_s25.log" | grep -E "PASSED|FAILED|ERROR|passed|failed|^E " | tail -16 ;;
    fp8k)  # the DPO cases first (the issue's figure, TRL in the same call), then the matmul's parts while time is left
      DPO_ARGS="${DPO_ARGS:---cases sf-lora8b-fp8base-3p,trl-lora8b,sf-lora8b-fp8base --steps 5 --profile-out $OUT/dpoprof}" DPO_CAP=${DPO_CAP:-510} bash "$0" dpo
      python3 -c "import json,glob; [print(f, json.dumps(json.load(open(f)))[:1200]) for f in glob.glob('$OUT/dpoprof/*/*.json')]"
      for shape in mlp attn; do nk="--n 14336"; [ $shape = attn ] && nk="--n 4096"
        env CUDA_VISIBLE_DEVICES=0 timeout ${FP8LIN_CAP:-45} python3 benchmarks/bench_fp8_linear.py $nk --reps 10 --out "$OUT/fp8lin_$shape.json" 2>&1 | tee "$OUT/fp8lin_$shape.log" | grep -v '^{' | tail -16; done ;;
    s26b)  # after fp8k on the same machine: the FP8 base's CUDA tests (the kernels' bit-for-bit test is new), issue
      # 35's concurrent clients alone (the memory part was measured in session 23)
      [ -d /tmp/site/tinker ] || python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site benchmarks/wheels_rl/*.whl
      env CUDA_VISIBLE_DEVICES=0 timeout 110 python3 -m pytest -m cuda -q -rA --tb=short -p no:cacheprovider tests/cuda/test_cuda_fp8_base.py 2>&1 | tee "$OUT/pytest_fp8.log" | grep -E "PASSED|FAILED|ERROR|passed|failed|^E " | tail -12
      CLIENTS_ARGS="--parts clients" CLIENTS_CAP=${CLIENTS_CAP:-420} bash "$0" clients ;;
    s26c)  # issue 38's full fine-tuning case in rows of 12,288 tokens (8 shared pairs a row: the step's 16 in 2 rows,
      # 0.75x the work of 16k rows) and at 16k rows (apart since d52324a), TRL in the same call; then the LoRA FP8
      # base case at 16k rows, now packed apart (d52324a; measured with trees in session 26: 2.10x)
      DPO_ARGS="--cases sf-full1b-12k,trl-full1b,sf-full1b,sf-lora8b-fp8base" DPO_CAP=540 bash "$0" dpo ;;
    *) echo "unknown stage $stage" ;;
  esac
done
