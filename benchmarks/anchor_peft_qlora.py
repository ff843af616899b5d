"""Anchor for QLoRA fine-tuning on one GPU (issue 23): Hugging Face + PEFT + bitsandbytes 4-bit, as axolotl and TRL
run it.

The model a user gets from `LlamaForCausalLM.from_pretrained(path, dtype=torch.bfloat16,
quantization_config=BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
bnb_4bit_compute_dtype=torch.bfloat16))` (quant_storage: its default, uint8): every nn.Linear of the blocks a
bitsandbytes Linear4bit holding a Params4bit in NF4 with double-quantised absmaxes (blocks of 64, the absmaxes in
8 bits per 256), the output head, embeddings and norms in bf16. No 70B checkpoint exists on the device and a bf16
70B (141 GB) fits neither its host memory (128 GiB) nor its GPU, so the model is built as from_pretrained builds it:
on the meta device, the linear layers replaced by transformers' own `replace_with_bnb_linear` (the modules it skips,
the head, from the quantizer's own `get_modules_to_not_convert`), then each weight materialised in bf16 on the GPU
from a normal draw and quantised with transformers' own loading line (`Params4bit(value, requires_grad=False,
**meta.__dict__).to(device)`), one weight at a time: the largest transient is one 28672 x 8192 bf16 weight (470 MB).
What training then applies (`--prep`, default axolotl):
  axolotl  prepare_model_for_kbit_training (every non-4-bit parameter to fp32), then axolotl's cast of the norms,
           embeddings and head back to bf16 (loaders/model.py: "needs_fa2_dtype" is set for every adapter); PEFT's
           fp32 adapters (autocast_adapter_dtype). Net: a bf16 base, fp32 adapters.
  trl      TRL's SFTTrainer since 0.26: no prepare_model_for_kbit_training; get_peft_model, then every trainable
           parameter cast to bf16 (QLoRA's paper): bf16 base, bf16 adapters.
  peft     prepare_model_for_kbit_training alone, as PEFT's QLoRA guide runs it: norms, embeddings and the head stay
           fp32 (+4.2 GB at 70B: two [128256, 8192] tensors at 4 B instead of 2), the norms' outputs fp32.
Then: LoRA r=16 alpha 32 on the 7 linear layers of every block, enable_input_require_grads, non-reentrant gradient
checkpointing of every block (`--ac full`, axolotl's and the Trainer's gradient_checkpointing), SDPA, bf16 autocast,
clipping at 1.0, fused AdamW over the adapters. Random token ids at --seq, labels = ids.

  python benchmarks/anchor_peft_qlora.py --size 70b --seq 4096 --mbs 1          # one H200 or H100
  PYTHONPATH=/tmp/bnb python benchmarks/anchor_peft_qlora.py --size tiny --device cpu --seq 64 --mbs 2 --steps 2
      # CPU check: bitsandbytes 0.50 quantises and multiplies NF4 on the CPU too (its default backend)

One JSON line at the end: tokens/s (median step after --warmup steps; the build is not timed), MFU with the dense
recipes' formula (6 x non-embedding parameters, the 4-bit ones counted as the weights they stand for, + 12 x layers x
hidden x seq per token: a throughput figure, not utilisation), peak allocated and reserved GiB over the steps (the
peak counters are reset after the build), allocator retries, build seconds; {"oom": true} after an OOM.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
from anchor_peft_lora import timed_steps  # the same timed loop as the LoRA anchor's

SIZES = {  # Llama-3 shapes (vocab 128256, GQA 8 kv heads), and a tiny one for CPU checks
    "70b": dict(hidden_size=8192, intermediate_size=28672, num_hidden_layers=80, num_attention_heads=64,
                num_key_value_heads=8, vocab_size=128256, rope_theta=500000.0),
    "8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
               num_key_value_heads=8, vocab_size=128256, rope_theta=500000.0),
    "tiny": dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=1000),
}
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def bnb_config():
    from transformers import BitsAndBytesConfig

    return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                              bnb_4bit_compute_dtype=torch.bfloat16)  # bnb_4bit_quant_storage: uint8, the default


def skipped_modules(model) -> list[str]:
    """The modules from_pretrained leaves unquantised (its quantizer's own rule: the output head, tied and last)."""
    from transformers.quantizers.base import HfQuantizer

    skip = HfQuantizer.get_modules_to_not_convert(model, None, getattr(model, "_keep_in_fp32_modules", None))
    assert "lm_head" in skip, skip
    return skip


@torch.no_grad()
def build(cfg, dev: torch.device):
    """The 4-bit model from_pretrained would give, built on meta and filled one weight at a time on `dev` (module
    docstring). Values: N(0, initializer_range) for matrices, ones for norms (timing does not depend on them)."""
    import bitsandbytes as bnb
    from transformers import LlamaForCausalLM
    from transformers.integrations.bitsandbytes import replace_with_bnb_linear

    qcfg = bnb_config()
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg).to(torch.bfloat16)
    replace_with_bnb_linear(model, modules_to_not_convert=skipped_modules(model), quantization_config=qcfg)
    std = cfg.initializer_range
    for mod_name, mod in model.named_modules():
        for name, p in list(mod.named_parameters(recurse=False)):
            if isinstance(p, bnb.nn.Params4bit):  # transformers' Bnb4bitQuantize.convert, the same line
                value = torch.empty(p.shape, dtype=torch.bfloat16, device=dev).normal_(0.0, std)
                new = bnb.nn.Params4bit(value, requires_grad=False, **p.__dict__).to(value.device)
                del value  # one bf16 weight in flight at a time
            else:  # embeddings, norms, the head: bf16, as loaded (from_pretrained marks them trainable)
                new = torch.empty(p.shape, dtype=torch.bfloat16, device=dev)
                if "norm" in mod_name:
                    new.fill_(1.0)
                else:
                    new.normal_(0.0, std)
                new = torch.nn.Parameter(new, requires_grad=True)
            setattr(mod, name, new)
    rotary = model.model.rotary_emb  # inv_freq was computed on meta: computed again where the model lives
    with torch.device(dev):
        model.model.rotary_emb = type(rotary)(cfg)
    left = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.device.type == "meta"]
    assert not left, left
    # what from_pretrained's quantizer sets (preprocess_model and postprocess_model): PEFT reads is_loaded_in_4bit
    # to dispatch its bitsandbytes LoRA layer, prepare_model_for_kbit_training to enable checkpointing
    from transformers.quantizers import AutoHfQuantizer

    model.is_quantized, model.quantization_method, model.is_loaded_in_4bit = True, qcfg.quant_method, True
    model.config.quantization_config = qcfg
    model.hf_quantizer = AutoHfQuantizer.from_config(qcfg, pre_quantized=False)
    return model


def prepare(model, prep: str, ac: str, rank: int, alpha: int):
    """What training applies to the loaded model (module docstring, --prep), then the PEFT model."""
    from peft import LoraConfig, get_peft_model, prepare_model_for_kbit_training

    gc = {"use_reentrant": False}
    if prep in ("axolotl", "peft"):
        model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=ac == "full",
                                                gradient_checkpointing_kwargs=gc)
    if prep == "axolotl":  # axolotl's _convert_embedding_modules_dtype(..., bf16) after the prepare
        for name, mod in model.named_modules():
            if "norm" in name or (any(e in name for e in ("embed_tokens", "lm_head")) and hasattr(mod, "weight")):
                mod.to(torch.bfloat16)
    if ac == "full":
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=gc)
    model = get_peft_model(model, LoraConfig(r=rank, lora_alpha=alpha, lora_dropout=0.0, task_type="CAUSAL_LM",
                                             target_modules=TARGETS))
    if ac == "full":
        model.enable_input_require_grads()  # TRL and the Trainer do it for PEFT with checkpointing
    params = [p for p in model.parameters() if p.requires_grad]
    if prep == "trl":
        for p in params:
            p.data = p.data.to(torch.bfloat16)
    return model, params


def logical_numel(p: torch.Tensor) -> int:
    qs = getattr(p, "quant_state", None)
    return int(torch.Size(qs.shape).numel()) if qs is not None else p.numel()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", default="70b", choices=sorted(SIZES))
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--mbs", type=int, default=1)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--alpha", type=int, default=32)
    ap.add_argument("--ac", default="full", choices=("full", "none"))
    ap.add_argument("--prep", default="axolotl", choices=("axolotl", "trl", "peft"))
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--peak", type=float, default=989.0, help="peak bf16 TFLOP/s for the MFU figure")
    a = ap.parse_args()
    from transformers import LlamaConfig

    dev = torch.device(a.device)
    cuda = dev.type == "cuda"
    cfg = LlamaConfig(**SIZES[a.size], max_position_embeddings=max(a.seq, 8192), attn_implementation="sdpa",
                      use_cache=False)
    torch.manual_seed(0)
    gib = 2**30
    try:
        t0 = time.perf_counter()
        model = build(cfg, dev)
        model, params = prepare(model, a.prep, a.ac, a.rank, a.alpha)
        model.train()
        opt = torch.optim.AdamW(params, lr=1e-4, fused=cuda)
        if cuda:
            torch.cuda.synchronize()
            built_gib = torch.cuda.memory_allocated() / gib
            torch.cuda.reset_peak_memory_stats()
        build_s = time.perf_counter() - t0
        n_total = sum(logical_numel(p) for p in model.parameters())
        n_embed = cfg.vocab_size * cfg.hidden_size * (1 if cfg.tie_word_embeddings else 2)
        flops_per_token = 6 * (n_total - n_embed) + 12 * cfg.num_hidden_layers * cfg.hidden_size * a.seq
        g = torch.Generator(device=dev).manual_seed(1)
        times, loss = timed_steps(model, params, opt, cfg.vocab_size, a, dev, g, autocast=True)
    except torch.cuda.OutOfMemoryError:
        print(json.dumps({"oom": True, "size": a.size, "mbs": a.mbs, "seq": a.seq, "prep": a.prep}), flush=True)
        return
    dt = statistics.median(times)
    tok_s = a.mbs * a.seq / dt
    stats = torch.cuda.memory_stats() if cuda else {}
    dtypes = sorted({str(p.dtype).removeprefix("torch.") for p in params})
    print(json.dumps({
        "anchor": "hf_peft_bnb_qlora", "size": a.size, "seq": a.seq, "mbs": a.mbs, "rank": a.rank, "ac": a.ac,
        "prep": a.prep, "adapter_dtype": dtypes, "trainable": sum(p.numel() for p in params),
        "params": n_total, "tok_s_gpu": round(tok_s),
        "mfu": round(tok_s * flops_per_token / (a.peak * 1e12), 3) if cuda else None, "step_s": round(dt, 4),
        "peak_alloc_GiB": round(torch.cuda.max_memory_allocated() / gib, 2) if cuda else 0.0,
        "peak_reserved_GiB": round(torch.cuda.max_memory_reserved() / gib, 2) if cuda else 0.0,
        "built_GiB": round(built_gib, 2) if cuda else 0.0, "build_s": round(build_s, 1),
        "retries": stats.get("num_alloc_retries", 0), "measured_steps": len(times),
        "final_loss": round(loss.item(), 4), "torch": torch.__version__}), flush=True)


if __name__ == "__main__":
    main()
