"""The worker processes of benchmarks/bench_rl.py (issue 24): each prints JSON lines {"rlbench": KIND, ...}.

  sf      shardfit's Engine in process: forward, the PPO step (forward_backward + optim_step), weights(), export_hf,
          and (prof) the forward now against session 14's settings, timed and profiled (profile_forward)
  hf-moe  transformers' Qwen3MoeForCausalLM through the anchor hf_rl_step.py's own run_forward / run_ppo (with
          --prof-out, one forward of the first layout profiled)
  hf-lora the anchor's part D (PEFT LoRA PPO step) through its own functions, then one step profiled (--prof-out)
  sdk     the PPO step through the official tinker SDK against a running `shardfit serve`

The shapes, JSON lines and timing they share: rl_worker_setup.py; their profiles: bench_rl_profiling.py.
"""

from __future__ import annotations

import math
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import rollouts as ro  # noqa: E402
from bench_rl_profiling import (  # noqa: E402
    anchor_profiled,
    emit_profile,
    gemm_ceiling,
    label_anchor_head,
    profile_forward,
    profile_ppo,
)
from rl_worker_setup import (  # noqa: E402
    ADAM,
    MOE,
    PPO_CFG,
    _cuda,
    emit,
    engine_overrides,
    guarded,
    rate,
    timed,
    vocab_of,
    warm_idx,
)


def worker_sf(a) -> int:
    """shardfit's Engine in this process: forward, PPO step, weights() and export_hf as --what says."""
    import numpy as np
    import torch

    from shardfit.rl import AdamParams
    from shardfit.rl import DatumEngine as Engine  # the Engine through datums (rl/step.py)

    sync, reset, peaks = _cuda()
    what = set(a.what.split(","))
    r = ro.make_rollouts(vocab_of("tiny" if a.shape == "moe" and a.device == "cpu" else a.shape), scale=a.scale,
                         anchor=a.anchor)
    T = ro.token_budget(r)
    emit("data", **r.summary(), T=T)
    if "ceiling" in what and torch.cuda.is_available():  # before the engine: the whole card's memory is free
        emit("ceiling", **gemm_ceiling())
    tmp = Path(tempfile.mkdtemp(prefix="rlbench-"))
    t = time.perf_counter()
    overrides = engine_overrides(a, a.shape, T, tmp / "run", lora=a.lora)
    engine = Engine.start(overrides=overrides)
    sync()
    emit("engine", shape=a.shape, lora=a.lora, params=engine.n_params, build_s=round(time.perf_counter() - t, 1),
         overrides=overrides, checkpointing=[n for n in engine.notices if "activation_checkpoint" in n], **peaks())
    fwd = ro.to_datums(r)
    w = warm_idx(r)
    scored = {"logprobs_at": a.logprobs_at}  # counted: the head over the response tokens alone (rl/losses.py)
    if a.logprobs_at != "all":  # the same forward scoring every token, first: the change's own effect, same process
        _, warm_s, times = timed(lambda: engine.forward(fwd), lambda: engine.forward([fwd[i] for i in w]),
                                 a.fwd_reps or a.reps, sync, reset)
        emit("fwd-all", shape=a.shape, lora=a.lora, warm_s=round(warm_s, 1), **rate(r, times), **peaks())
    res, warm_s, times = timed(lambda: engine.forward(fwd, "cross_entropy", scored),
                               lambda: engine.forward([fwd[i] for i in w], "cross_entropy", scored),
                               a.fwd_reps or a.reps, sync, reset)
    emit("fwd", shape=a.shape, lora=a.lora, logprobs_at=a.logprobs_at, warm_s=round(warm_s, 1), **rate(r, times),
         **peaks())
    if "prof" in what:  # the forward now and with session 14's settings, timed and profiled
        profile_forward(engine, fwd, r, a, sync, reset, peaks, vocab=vocab_of(a.shape))
    if "ppo" in what:
        old, adv = ro.sampler_inputs(r, ro.response_logprobs(r, res.outputs))
        if a.save_inputs:
            np.savez(a.save_inputs, old=np.concatenate(old), adv=np.concatenate(adv))
        data = ro.to_datums(r, old, adv)
        adam = AdamParams(**ADAM)
        box = {}

        def step(d):
            box["fb"] = engine.forward_backward(d, "ppo", {**PPO_CFG, **scored})
            box["opt"] = engine.optim_step(adam)

        _, warm_s, times = timed(lambda: step(data), lambda: step([data[i] for i in w]), a.reps, sync, reset)
        emit("ppo", shape=a.shape, lora=a.lora, logprobs_at=a.logprobs_at, warm_s=round(warm_s, 1), **rate(r, times),
             **peaks(), metrics={**box["fb"].metrics, **box["opt"]})
        if "profppo" in what:
            guarded("prof-ppo", lambda: profile_ppo(engine, step, data, a, sync, a.lora))
    if "weights" in what:
        for rep in range(2):  # the first pass also allocates the buckets' blocks in the caching allocator
            sync()
            t, n, k = time.perf_counter(), 0, 0
            for bucket in engine.weights(torch.bfloat16, 1 << 28):
                n += sum(x.nbytes for _, x in bucket)
                k += len(bucket)
            sync()
            dt = time.perf_counter() - t
            emit("weights", rep=rep, tensors=k, GB=round(n / 1e9, 3), s=round(dt, 3), GBps=round(n / 1e9 / dt, 2))
    if "export" in what:
        out = tmp / "hf"
        sync()
        t = time.perf_counter()
        engine.export_hf(str(out), "bfloat16", None)
        dt = time.perf_counter() - t
        os.sync()  # what the page cache still held, written: the export as far as the disk
        dts = time.perf_counter() - t
        n = sum(f.stat().st_size for f in out.glob("*.safetensors"))
        emit("export", GB=round(n / 1e9, 3), s=round(dt, 2), GBps=round(n / 1e9 / dt, 2), with_sync_s=round(dts, 2),
             with_sync_GBps=round(n / 1e9 / dts, 2), where=str(out))
    if "prof1" in what:  # one forward, as it is, profiled: last, after every figure of the worker is out
        vocab = MOE["tiny" if a.device == "cpu" else "big"]["vocab"] if a.shape == "moe" else vocab_of(a.shape)
        guarded("prof", lambda: profile_forward(engine, fwd, r, a, sync, reset, peaks, variants=("now",),
                                                vocab=vocab))
    shutil.rmtree(tmp, ignore_errors=True)
    return 0

def worker_hf_moe(a) -> int:
    """transformers' Qwen3MoeForCausalLM through the anchor's own functions (its data, micro-batching, timing and
    JSON lines): C on a plain bf16 model, then E under FSDP2 (fp32 master, bf16 compute) with HF checkpointing."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    A = ro.load_anchor(a.anchor)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    m = MOE["big" if device == "cuda" else "tiny"]
    P, R, seqs = A.make_rollouts(64, 1234, m["vocab"], a.scale)
    r = ro.Rollouts(list(P), list(R), [s.numpy() for s in seqs])
    A.emit(dict(part="A", **r.summary()))
    T = ro.token_budget(r)
    cfg = Qwen3MoeConfig(vocab_size=m["vocab"], hidden_size=m["hidden"], intermediate_size=3 * m["hidden"],
                         num_hidden_layers=a.moe_layers, num_attention_heads=m["heads"], num_key_value_heads=m["kv"],
                         head_dim=m["head_dim"], num_experts=m["experts"], num_experts_per_tok=m["topk"],
                         moe_intermediate_size=m["inner"], norm_topk_prob=True, max_position_embeddings=40960,
                         rms_norm_eps=1e-6, rope_theta=1e6, tie_word_embeddings=False, output_router_logits=False,
                         use_cache=False)
    cfg._attn_implementation = "sdpa"
    cfg._experts_implementation = "grouped_mm"  # as benchmarks/anchor_hf_qwen3moe.py (eager is ~10x slower)
    torch.manual_seed(0)
    torch.set_default_dtype(torch.bfloat16)
    with torch.device(device):
        model = Qwen3MoeForCausalLM(cfg)  # HF's own init, in bf16: the anchor's build() for this class
    torch.set_default_dtype(torch.float32)
    A.emit(dict(part="B", shape=f"moe{a.moe_layers}", params=sum(p.numel() for p in model.parameters())))
    old = None
    specs = [x for x in a.hf_fwd.split(",") if x]
    for spec in specs:
        lp = A.run_forward(model, P, R, seqs, spec, T, device, a.reps)
        old = old if old is not None else lp
    if a.prof_out and specs:  # one forward of the first layout (padnm in bench_rl's stages) under the profiler
        undo = label_anchor_head(A, model)
        try:
            s = anchor_profiled(A, lambda: A.run_forward(model, P, R, seqs, specs[0], T, device, 1, tag="profiled"),
                                Path(a.prof_out), "moe_fwd_hf", m["vocab"], 0)
            emit_profile("prof", s, variant=specs[0], side="hf", what="moe_fwd")
        except Exception as e:  # noqa: BLE001 (recorded; the PPO step still runs)
            emit("prof", side="hf", what="moe_fwd", error=f"{type(e).__name__}: {str(e)[:300]}")
        finally:
            undo()
    del model
    A.reset_mem()
    # a group of one over an in-process store (no port, no launcher variables), as shardfit's one-process runs
    dist.init_process_group("nccl" if device == "cuda" else "gloo", store=dist.HashStore(), rank=0, world_size=1)
    mesh = init_device_mesh(device, (1,))
    with torch.device("meta"):
        model = Qwen3MoeForCausalLM(cfg)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    layers = model.model.layers
    for i, layer in enumerate(layers):
        fully_shard(layer, mesh=mesh, mp_policy=mp, reshard_after_forward=i < len(layers) - 1)
    fully_shard(model, mesh=mesh, mp_policy=mp)
    model.to_empty(device=device)
    with torch.no_grad():
        for p in model.parameters():
            if p.ndim > 1:
                p.normal_(0, 0.02)
            else:
                p.fill_(1.0)  # norms at 1, as HF's init
        rot = model.model.rotary_emb  # a meta buffer until now
        d = m["head_dim"]
        inv = 1.0 / (1e6 ** (torch.arange(0, d, 2, device=device, dtype=torch.float32) / d))
        rot.inv_freq = inv
        if hasattr(rot, "original_inv_freq"):
            rot.original_inv_freq = inv
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-6, fused=device == "cuda")
    g = torch.Generator(device=device).manual_seed(7)
    if old is None:
        old = [torch.full((n,), -math.log(m["vocab"]), device=device) for n in R]
    old = [(o.float() + 0.1 * torch.randn(o.shape, generator=g, device=device)).clone() for o in old]
    adv = [torch.randn(n, generator=g, device=device) for n in R]

    def ppo(spec: str) -> bool:
        try:
            A.run_ppo(model, opt, params, P, R, seqs, old, adv, spec, T, device, a.reps, part="E", autocast=False)
            return True
        except Exception as e:  # noqa: BLE001 (recorded; the next layout runs)
            opt.zero_grad(set_to_none=True)
            A.emit(dict(part="E", layout=spec, error=f"{type(e).__name__}: {str(e)[:300]}"))
            return False

    specs = [x for x in a.hf_ppo.split(",") if x]
    if not [ppo(spec) for spec in specs].count(True) and "pad" not in specs:
        ppo("pad")  # the HF default layout, when every one asked for failed
    dist.destroy_process_group()
    return 0


def worker_hf_lora(a) -> int:
    """The anchor's part D (hf_rl_step.py main(), its lines for --lora): Qwen3 of --shape in bf16, PEFT LoRA r=16
    alpha 32 on the 7 linear layers, fp32 adapters, HF checkpointing, fused AdamW, old log-probs -log V + N(0, 0.01)
    (as `--fwd ""` makes them), --reps timed PPO steps in each --hf-ppo layout through its own run_ppo; then, with
    --prof-out, one more step of the first layout profiled (anchor_profiled, the head labelled): what bench_rl's
    lora-ppo/hf runs in place of the anchor script when it profiles, the same calls in the same order."""
    import torch
    from peft import LoraConfig, get_peft_model

    A = ro.load_anchor(a.anchor)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    vocab = A.SHAPES[a.shape]["vocab_size"]
    P, R, seqs = A.make_rollouts(64, 1234, vocab, a.scale)
    r = ro.Rollouts(list(P), list(R), [x.numpy() for x in seqs])
    A.emit(dict(part="env", **A.env_info()))
    A.emit(dict(part="A", **r.summary()))
    T = ro.token_budget(r)
    model, cfg = A.build(a.shape, device, torch.bfloat16)
    A.emit(dict(part="B", shape=a.shape, params=sum(p.numel() for p in model.parameters()),
                attn=model.config._attn_implementation))
    # from here the anchor's main(), part D, line for line
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.enable_input_require_grads()
    lcfg = LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, task_type="CAUSAL_LM",
                      target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])
    model = get_peft_model(model, lcfg)
    for p in model.parameters():
        if p.requires_grad:
            p.data = p.data.float()
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    A.emit(dict(part="D_model", trainable=sum(p.numel() for p in params)))
    opt = torch.optim.AdamW(params, lr=1e-5, fused=device == "cuda")
    g = torch.Generator(device=device).manual_seed(7)
    old = [torch.full((n,), -math.log(cfg.vocab_size), device=device) for n in R]
    old = [(o.float() + 0.1 * torch.randn(o.shape, generator=g, device=device)).clone() for o in old]
    adv = [torch.randn(n, generator=g, device=device) for n in R]
    specs = [x for x in a.hf_ppo.split(",") if x]
    for spec in specs:
        A.run_ppo(model, opt, params, P, R, seqs, old, adv, spec, T, device, a.reps, part="D")
    if a.prof_out and specs:
        undo = label_anchor_head(A, model)
        try:
            s = anchor_profiled(A, lambda: A.run_ppo(model, opt, params, P, R, seqs, old, adv, specs[0], T, device,
                                                     1, tag="profiled", part="D"),
                                Path(a.prof_out), "ppo_hf", vocab, 16)
            emit_profile("prof-ppo", s, side="hf", shape=a.shape, lora=16, layout=specs[0])
        except Exception as e:  # noqa: BLE001 (recorded)
            emit("prof-ppo", side="hf", error=f"{type(e).__name__}: {str(e)[:300]}")
        finally:
            undo()
    return 0


def worker_sdk(a) -> int:
    """The PPO step through the tinker SDK against a running `shardfit serve` at --url."""
    import numpy as np
    import tinker
    from tinker import types

    r = ro.make_rollouts(vocab_of(a.shape), scale=a.scale, anchor=a.anchor)
    saved = np.load(a.save_inputs)
    cut = np.cumsum(r.responses)[:-1]
    data = ro.to_tinker(ro.to_datums(r, np.split(saved["old"], cut), np.split(saved["adv"], cut)))
    t = time.perf_counter()
    # base_model: the server's model.name (the dense shapes set every size over the default); a LoRA server
    # answers only a client asking its own rank, a full-parameter one only rank=0
    tc = tinker.ServiceClient(base_url=a.url, api_key="tml-local").create_lora_training_client(
        base_model="tiny", rank=a.lora or 0)
    emit("sdk-client", s=round(time.perf_counter() - t, 2))

    def step(d):
        fb = tc.forward_backward(d, "ppo", PPO_CFG)
        op = tc.optim_step(types.AdamParams(**ADAM))  # pipelined: sent before the first result is read
        return fb.result(), op.result()

    t = time.perf_counter()
    step([data[i] for i in warm_idx(r)])
    last = time.perf_counter()
    warm_s, times = last - t, []
    for _ in range(a.reps):
        fb, op = step(data)
        now = time.perf_counter()
        times.append(now - last)
        last = now
    emit("sdk-ppo", shape=a.shape, lora=a.lora, warm_s=round(warm_s, 1), **rate(r, times),
         metrics={**fb.metrics, **op.metrics})
    return 0


WORKERS = {"sf": worker_sf, "hf-moe": worker_hf_moe, "hf-lora": worker_hf_lora, "sdk": worker_sdk}
