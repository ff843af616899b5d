"""In-process sampling in the plan (plan/sampler.py) and a pass of several LoRA models (plan/models.py): the
reported numbers against the functions' own arithmetic on the 8B shape (sampling/kv.py's blocks_for_memory, the
parameter counts), and against what the CPU measures: the PagedKV pools of the blocks the plan reports, the decode
model's copy and its LoRA bank, the adapters a pass of several models stacks."""

from __future__ import annotations

import dataclasses
import inspect
import re

import pytest
import torch

from shardfit.config import load_config
from shardfit.plan.estimate import CUDA_CONTEXT, GiB, adapter_params, allocation_budget
from shardfit.plan.models import PASS_BYTES, models_cost, models_lines, multi_model_pass_bytes
from shardfit.plan.sampler import BANK_SLOTS, BLOCK_SIZE, sampling_cost, sampling_lines
from shardfit.plan.table import configured
from shardfit.sampling.kv import PagedKV, block_bytes, blocks_for_memory
from tests.engine.test_registry import ARGS

B8 = ["--model.name=llama3-8b", "--data.seq_len=4096"]
LORA = ["--lora.rank=16", "--lora.targets=all-linear"]


def _cfg(*args):
    return load_config(None, list(args))


def test_block_size_is_the_samplers():
    from shardfit.sampling.runner import Sampler

    assert inspect.signature(Sampler).parameters["block_size"].default == BLOCK_SIZE


@pytest.mark.parametrize("args, world, gpu, kind", [
    ((*B8, *LORA), 1, 79, "views"), ((*B8,), 1, 141, "cast"), ((*B8,), 8, 79, "gathered"),
    ((*B8, *LORA), 4, 79, "gathered"), ((*B8, "--compute.param_dtype=float32"), 8, 79, "gathered"),
    ((*B8, *LORA, "--compute.param_dtype=float32"), 1, 79, "views")])
def test_the_8b_shapes_decode_model_and_kv_cache(args, world, gpu, kind):
    cfg = _cfg(*args)
    e, _ = configured(cfg, world, gpu)
    c = sampling_cost(cfg, world, e, gpu * GiB)
    trained, n_params = adapter_params(cfg)
    item = 4 if "--compute.param_dtype=float32" in args else 2
    assert c.decode_kind == kind
    assert c.decode_bytes == (0 if kind == "views" else n_params * item)
    assert c.bank_bytes == (BANK_SLOTS * trained * item if cfg.lora.rank else 0)
    kept = 4 * trained // world  # keep_grads is on by default: the sharded fp32 gradients stay between steps
    assert c.resident == e.weights + e.moments + kept
    assert c.free == int(gpu * GiB - CUDA_CONTEXT - c.resident - c.decode_bytes - c.bank_bytes)
    dtype = torch.float32 if item == 4 else torch.bfloat16
    assert c.kv_blocks == blocks_for_memory(c.free, 0.9, cfg.model, dtype) > 0
    assert c.kv_bytes == (c.kv_blocks + 1) * block_bytes(cfg.model, dtype, BLOCK_SIZE)
    # the 8B shape: 128 KiB a token (32 layers x 8 KV heads x 128 x 2 bytes, keys and values) in bf16
    assert block_bytes(cfg.model, torch.bfloat16, 1) == 128 << 10
    lines = sampling_lines(cfg, world, e, gpu)
    assert f"decode model {c.decode_bytes / GiB:.2f} GiB" in lines[0]
    tokens = c.kv_blocks * BLOCK_SIZE
    assert lines[1].startswith(f"KV cache: {c.kv_blocks} blocks of 16 tokens = {tokens} tokens ({tokens // 4096} "
                               f"rows of prompt+max_tokens = data.seq_len 4096), {c.kv_bytes / GiB:.2f} GiB"), lines


def test_keep_kv_warns_when_the_cache_and_the_step_do_not_fit_together():
    cfg = _cfg(*B8, "--sampling.keep_kv=true")
    e, _ = configured(cfg, 8, 79.0)
    lines = sampling_lines(cfg, 8, e, 79.0)
    warning = [ln for ln in lines if ln.startswith("WARNING")]
    assert len(warning) == 1 and "sampling.keep_kv keeps the KV cache through training" in warning[0], lines
    fraction = float(re.search(r"--sampling.kv_fraction=([0-9.]+)", warning[0]).group(1))
    # the fraction it names fits beside the peak and the decode model; a hundredth more does not
    for f, fit in ((fraction, True), (fraction + 0.01, False)):
        c = sampling_cost(_cfg(*B8, "--sampling.keep_kv=true", f"--sampling.kv_fraction={f}"), 8, e, 79 * GiB)
        assert (e.peak + c.decode_total + c.kv_bytes <= allocation_budget(79 * GiB)) == fit, (f, fit)
    ok = _cfg(*B8, "--sampling.keep_kv=true", f"--sampling.kv_fraction={fraction}")
    tokens = sampling_cost(ok, 8, e, 79 * GiB).kv_blocks * BLOCK_SIZE
    assert f"--sampling.kv_fraction={fraction:g} or lower ({tokens} tokens)" in warning[0], warning
    assert not [ln for ln in sampling_lines(ok, 8, e, 79.0) if ln.startswith("WARNING")]
    off = _cfg(*B8)  # without keep_kv the cache is released before the step: no warning
    assert not [ln for ln in sampling_lines(off, 8, e, 79.0) if ln.startswith("WARNING")]


def test_plan_json_carries_the_sampling_figures(capsys):
    import json

    from shardfit.cli.main import main

    assert main(["plan", *B8, *LORA, "--nproc", "2", "--gpu-memory", "79", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)["sampling"]
    cfg = _cfg(*B8, *LORA)
    e, _ = configured(cfg, 2, 79.0)
    assert out == dataclasses.asdict(sampling_cost(cfg, 2, e, 79 * GiB)) and out["decode_kind"] == "gathered"
    assert main(["plan", *B8, "--parallel.offload=all", "--nproc", "8", "--gpu-memory", "79", "--json"]) == 0
    assert "parallel.offload=all" in json.loads(capsys.readouterr().out)["sampling"]["refused"]


@pytest.mark.parametrize("fmt", ["nf4", "fp8"])
def test_a_quantised_base_decodes_from_its_storage(fmt):
    """Engine.sample on QLoRA or an FP8 base (sampling/source.py): views on one rank, the base gathered as stored on
    N (its codes: ~0.52 or ~1 byte a weight, not the compute dtype's 2)."""
    from shardfit.plan import adapters
    from shardfit.plan.activation_trace import model_key
    from shardfit.plan.estimate import _meta_model

    cfg = _cfg(*B8, *LORA, f"--model.quantize={fmt}")
    one, four = (sampling_cost(cfg, w, configured(cfg, w, 79)[0], 79 * GiB) for w in (1, 4))
    assert one.decode_kind == "views" and one.decode_bytes == 0
    stored = adapters.counts(_meta_model(model_key(cfg.model)), adapters.lora_key(cfg), fmt, 2).base_bytes
    _, n_params = adapter_params(cfg)
    share = 0.6 if fmt == "nf4" else 0.8  # embeddings and head stay bf16
    assert four.decode_kind == "gathered" and four.decode_bytes == stored < share * 2 * n_params
    assert "refused" not in " ".join(sampling_lines(cfg, 1, configured(cfg, 1, 79)[0], 79))


def test_no_room_left_is_said():
    cfg = _cfg(*B8)  # full fine-tuning of 8B on one GPU: 16 bytes a parameter of states alone exceed 79 GiB
    e, _ = configured(cfg, 1, 79.0)
    c = sampling_cost(cfg, 1, e, 79 * GiB)
    assert c.free == 0 and c.kv_blocks == 0
    assert "no room left for a KV cache" in sampling_lines(cfg, 1, e, 79.0)[1]


def test_refused_configs_say_so():
    cfg = _cfg(*B8, "--parallel.offload=all")
    e, _ = configured(cfg, 8, 79.0)
    (line,) = sampling_lines(cfg, 8, e, 79.0)
    assert "refused with parameters offloaded to the host (parallel.offload=all)" in line


def test_the_kv_pools_the_plan_reports_are_what_pagedkv_allocates():
    """A tiny model in fp32 on the CPU: the plan's blocks for a 1 MiB 'device', the pools PagedKV makes of them."""
    cfg = _cfg(*ARGS, "--compute.param_dtype=float32", "--sampling.kv_fraction=0.5")
    e, _ = configured(cfg, 1, 80.0)
    trained = adapter_params(cfg)[0]
    device = CUDA_CONTEXT + e.weights + e.moments + 4 * trained + BANK_SLOTS * 4 * trained + (1 << 20)
    c = sampling_cost(cfg, 1, e, device)
    assert c.free == 1 << 20 and c.kv_blocks == (1 << 19) // block_bytes(cfg.model, torch.float32, 16)
    kv = PagedKV(cfg.model, c.kv_blocks, BLOCK_SIZE, torch.float32, torch.device("cpu"))
    assert kv.nbytes() == c.kv_bytes and kv.tokens == c.kv_blocks * BLOCK_SIZE


def _copied_bytes(plain, engine_model) -> int:
    """Bytes of the decode model's parameters that are not views of the Engine's storage."""
    from shardfit.parallel.dtensor import local_tensor

    owned = {local_tensor(p).untyped_storage().data_ptr() for p in engine_model.parameters()}
    seen, total = set(), 0
    for p in plain.parameters():
        ptr = p.untyped_storage().data_ptr()
        if ptr not in owned and ptr not in seen:
            seen.add(ptr)
            total += p.numel() * p.element_size()
    return total


@pytest.mark.parametrize("lora", [True, False])
def test_the_decode_model_and_bank_cost_what_the_plan_counts(lora):
    """One rank on the CPU computing in bf16: a LoRA base stored in bf16 is viewed (0 bytes), full fine-tuning's fp32
    weights are cast (a copy); the bank holds BANK_SLOTS whole adapters in bf16."""
    from shardfit.rl import DatumEngine
    from shardfit.sampling.source import decode_model

    args = [a for a in ARGS if lora or not a.startswith("--lora")] + ["--compute.param_dtype=bfloat16"]
    cfg = load_config(None, args)
    eng = DatumEngine.start(cfg)
    eng.finish()
    plain, bank, _ = decode_model(eng.model, torch.bfloat16, capacity=BANK_SLOTS, live_adapters=False)
    e, _ = configured(cfg, 1, 80.0)
    c = sampling_cost(cfg, 1, e, 80 * GiB)
    assert _copied_bytes(plain, eng.model) == c.decode_bytes and c.decode_kind == ("views" if lora else "cast")
    banked = sum(b.numel() * b.element_size() for n, b in plain.named_buffers() if "bank_" in n)
    assert banked == c.bank_bytes and (banked > 0) == lora


def test_a_pass_of_several_models_holds_their_whole_adapters_and_gradients():
    """The adapters a pass stacks (every model's whole A and B, and as many gradients) against the plan's bytes."""
    from shardfit.rl import DatumEngine

    cfg = load_config(None, ARGS)
    eng = DatumEngine.start(cfg)
    whole = sum(p.numel() for p in eng.models.params)  # one rank: the shards are the whole adapters
    for k in (2, 5):
        assert multi_model_pass_bytes(cfg, k) == PASS_BYTES * k * whole == k * (4 + 4) * whole
    assert multi_model_pass_bytes(cfg, 1) == 0  # one model is the slot's own pass
    big = _cfg(*B8, *LORA)
    e, _ = configured(big, 1, 79.0)
    budget = allocation_budget(79 * GiB)
    lines = models_lines(big, 1, 16, 4, e.peak, budget)
    extra = multi_model_pass_bytes(big, 16)
    total = e.peak + models_cost(big, 1, 16, 4).device_bytes + extra
    assert (f"a pass of 16 models in one forward/backward holds {extra / GiB:.2f} GiB more on every rank"
            in lines[-1] and f"peak {total / GiB:.1f} GiB" in lines[-1]), lines
    moe = _cfg("--model.name=qwen3-30b-a3b", "--data.seq_len=4096", *LORA)
    assert "refused with an MoE model" in models_lines(moe, 8, 4, 0, 0, budget)[-1]
