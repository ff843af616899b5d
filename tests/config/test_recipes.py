"""Shipped recipes: each loads, fits the GPUs it names by shardfit plan, and says what the user must add."""

import json
import re
from pathlib import Path

import pytest

from shardfit.config import load_config
from shardfit.config.recipes import check_needs, listing, names, read, resolve
from shardfit.errors import ShardfitError
from shardfit.plan.auto_checkpointing import resolved
from shardfit.plan.estimate import GiB, allocation_budget, estimate, fits

RECIPES = names()
BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


def test_the_common_cases_are_shipped():
    assert {"llama3-8b-sft-1gpu", "llama3-8b-sft-8gpu", "qwen3-30b-a3b-sft", "llama3-70b-sft",
            "llama3-8b-long-context", "llama3-8b-fp8-pretrain", "llama3-8b-lora-1gpu",
            "llama3-70b-qlora-1gpu"} <= set(RECIPES)
    text = listing()
    assert all(name in text for name in RECIPES) and "needs: --model.path" in text
    # every recipe says whether it was measured
    assert text.count("measured: ") == len(RECIPES) and "measured: not yet (planned only)" in text


@pytest.mark.parametrize("name", RECIPES)
def test_recipe_fits_every_layout_it_names(name, capsys):
    """`shardfit plan --config recipe:NAME --nproc N --gpu-memory G` says "as configured: fits" (and the launcher's
    layout checks pass: the batch splits over the data-parallel ranks) for each layout the recipe names."""
    from shardfit.cli.main import main
    from shardfit.plan.proposals import accepted

    recipe = read(f"recipe:{name}")
    cfg = load_config(f"recipe:{name}")
    if cfg.compute.fp8 != "none":
        pytest.importorskip("torchao.float8", reason="FP8 needs the optional torchao extra")
    assert recipe.layouts and cfg.train.micro_batch > 0  # a fixed micro-batch, planned here
    for gpus, gib in recipe.layouts:
        assert accepted(cfg, gpus), (name, gpus)
        capsys.readouterr()
        assert main(["plan", "--config", f"recipe:{name}", "--nproc", str(gpus), "--gpu-memory", str(gib)]) == 0
        out = capsys.readouterr().out
        assert "<- as configured: fits" in out, (name, gpus, gib, out)
        assert f"{gpus} GPU{'s' if gpus > 1 else ''} of {gib:.4g} GiB" in out


def test_measured_figures_are_in_benchmarks():
    """A recipe's `measured` names the benchmarks/ files that hold its figures, and each figure (1,422 or 3.55) is in
    one of them; the others say they were not measured."""
    if not BENCHMARKS.is_dir():
        pytest.skip("benchmarks/ is in the source tree only")
    measured = {n: read(f"recipe:{n}").measured for n in RECIPES}
    assert {n for n, m in measured.items() if m} == {"llama3-8b-fp8-pretrain", "llama3-8b-long-context",
                                                    "qwen3-30b-a3b-sft", "llama3-8b-lora-1gpu", "llama3-70b-qlora-1gpu"}
    for name, text in measured.items():
        if not text:
            assert "not measured" in resolve(f"recipe:{name}").read_text().lower(), name
            continue
        files = re.findall(r"benchmarks/[\w./-]*\w", text)
        assert files and all((BENCHMARKS.parent / f).is_file() for f in files), (name, files)
        held = "".join((BENCHMARKS.parent / f).read_text(encoding="utf-8") for f in files)
        figures = re.findall(r"\d{1,3}(?:,\d{3})+|\d+\.\d+", text)
        assert figures and all(f in held for f in figures), (name, [f for f in figures if f not in held])


# The config.json of the checkpoints the recipes need (the Hugging Face hub's, without the keys shardfit ignores)
_LLAMA31 = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": 128256,
            "max_position_embeddings": 131072, "num_key_value_heads": 8, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
            "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                             "original_max_position_embeddings": 8192}, "tie_word_embeddings": False}
CHECKPOINTS = {
    "llama3-8b": {**_LLAMA31, "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
                  "num_attention_heads": 32},
    "llama3-70b": {**_LLAMA31, "hidden_size": 8192, "intermediate_size": 28672, "num_hidden_layers": 80,
                   "num_attention_heads": 64},
    "qwen3-30b-a3b": {"model_type": "qwen3_moe", "architectures": ["Qwen3MoeForCausalLM"], "vocab_size": 151936,
                      "hidden_size": 2048, "intermediate_size": 6144, "num_hidden_layers": 48,
                      "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128,
                      "max_position_embeddings": 40960, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
                      "rope_scaling": None, "tie_word_embeddings": False, "num_experts": 128,
                      "num_experts_per_tok": 8, "moe_intermediate_size": 768, "norm_topk_prob": True,
                      "decoder_sparse_step": 1, "mlp_only_layers": [], "router_aux_loss_coef": 0.001,
                      "output_router_logits": False, "sliding_window": None, "use_sliding_window": False},
}


@pytest.mark.parametrize("name", [n for n in RECIPES if "model.path" in read(f"recipe:{n}").needs])
def test_recipe_with_its_checkpoint_is_the_model_it_planned(name, tmp_path):
    """A recipe names a preset so that it plans without the weights; with the --model.path it needs, the model (from
    config.json), the plan and the training defaults it shows (fine-tuning rates, before the weights are given) are
    the same."""
    from shardfit.config.schema import SIZE_DEFAULTS

    planned = load_config(f"recipe:{name}")
    (tmp_path / "config.json").write_text(json.dumps(CHECKPOINTS[planned.model.name]))
    real = load_config(f"recipe:{name}", [f"--model.path={tmp_path}"])
    skip = {"name", "path", "router_aux_coef"}  # router_aux_coef: Qwen3's 0.001, used only with output_router_logits
    assert {k: v for k, v in vars(real.model).items() if k not in skip} == \
        {k: v for k, v in vars(planned.model).items() if k not in skip}
    assert real.train == planned.train
    # a fine-tuning rate (2e-5, 1e-5), not 3e-4; LoRA recipes LoRA's (the adapters start at zero: about 10x); DPO
    # with LoRA the alignment handbook's (preference steps are small)
    if planned.preference.objective != "none":
        assert planned.lora.rank and planned.train.lr == 5e-6
    else:
        assert planned.train.lr in ({1e-4} if planned.lora.rank else {row[3] for row in SIZE_DEFAULTS})
    gpus, gib = read(f"recipe:{name}").layouts[0]
    real, planned = resolved(real, gpus, gib), resolved(planned, gpus, gib)  # activation_checkpoint=auto: its choice
    assert estimate(real, gpus, real.train.micro_batch).peak == estimate(planned, gpus, planned.train.micro_batch).peak


def test_70b_says_truthfully_that_one_node_fits_only_with_cpu_offload():
    """The 70B recipe names two and three nodes because one node of 8 GPUs does not fit full fine-tuning without
    offload, even of H200s with gradients freed between steps; with parallel.offload=all, shardfit plan proposes a
    layout for one node of 8 x 80 GB (its comment gives these figures and the flags)."""
    from shardfit.plan.proposals import proposals

    cfg = load_config("recipe:llama3-70b-sft")
    assert min(n for n, _ in read("recipe:llama3-70b-sft").layouts) > 8
    for extra in ([], ["--memory.keep_grads=false", "--train.global_batch=8"]):
        one_node = load_config("recipe:llama3-70b-sft", extra)
        assert not fits(estimate(one_node, 8, 1), allocation_budget(139 * GiB), 139 * GiB)
    assert cfg.compute.activation_checkpoint == "full"
    props, _ = proposals(cfg, 8, 79)
    offload = next(p for p in props if p.world == 8)
    assert offload.flags == ["--parallel.offload=all", "--compute.activation_checkpoint=full", "--train.micro_batch=6"]
    assert round(offload.estimate.peak / GiB, 1) == 53.6 and round(offload.host_per_node / GiB) == 1112
    text = resolve("recipe:llama3-70b-sft").read_text()
    assert "53.6 GiB per GPU at micro-batch 6" in text and "1,112 GiB of host memory" in text


def test_lora_recipe_is_the_measured_run_and_fits_one_80_gb_gpu():
    """The 8B LoRA recipe is the measured run's configuration (its row in benchmarks/results, without the steps and
    batch of the benchmark), planned within 3% of its peak; full fine-tuning of the same model does not fit there."""
    import shlex

    cfg = load_config("recipe:llama3-8b-lora-1gpu")
    row = next(r for r in json.loads((BENCHMARKS / "results/2026-11-25_s14_h100x1_lora8b.json").read_text())["rows"]
               if r["label"] == "shardfit LoRA compile no-AC mbs1")
    run = load_config(None, shlex.split(row["cmd"].split("shardfit train", 1)[1]))
    assert (run.lora.rank, run.lora.alpha, run.lora.targets) == (cfg.lora.rank, cfg.lora.alpha, cfg.lora.targets)
    assert (run.compute, run.data.seq_len, run.train.micro_batch) == (cfg.compute, cfg.data.seq_len,
                                                                      cfg.train.micro_batch)
    peak = estimate(cfg, 1, cfg.train.micro_batch).peak / GiB
    assert abs(peak / row["peak_alloc_GiB"] - 1) < 0.03 and f"predicts {peak:.1f}" in resolve(
        "recipe:llama3-8b-lora-1gpu").read_text()
    full = load_config("recipe:llama3-8b-lora-1gpu", ["--lora.rank=0"])
    assert not fits(estimate(full, 1, 1), allocation_budget(79 * GiB), 79 * GiB)


def test_qlora_70b_recipe_fits_one_h200_and_one_h100_as_its_comment_says():
    """70B QLoRA on one GPU: the recipe (checkpointing auto) takes none on an H200 with its NF4 base; on an H100,
    where that does not fit, the first 56 of the 80 blocks, shardfit plan's first proposal there, as its comment
    says; neither a bf16 base (LoRA) nor full fine-tuning fits the H200."""
    from shardfit.plan.proposals import proposals

    cfg = load_config("recipe:llama3-70b-qlora-1gpu")
    text = resolve("recipe:llama3-70b-qlora-1gpu").read_text()
    assert (cfg.model.quantize, cfg.lora.rank, cfg.compute.activation_checkpoint) == ("nf4", 16, "auto")
    h200 = resolved(cfg, 1, 139)
    assert h200.compute.activation_checkpoint == "none"
    assert fits(estimate(h200, 1, 1), allocation_budget(139 * GiB), 139 * GiB)
    assert f"{estimate(h200, 1, 1).peak / GiB:.1f} GiB peak" in text
    assert not fits(estimate(h200, 1, 1), allocation_budget(79 * GiB), 79 * GiB)
    first = proposals(h200, 1, 79)[0][0]
    assert first.flags == ["--compute.activation_checkpoint=full", "--compute.ac_blocks=56"]
    h100 = resolved(cfg, 1, 79)
    assert (h100.compute.activation_checkpoint, h100.compute.ac_blocks) == ("full", 56)
    assert "the first 56 of the 80" in text and f"({first.estimate.peak / GiB:.1f} GiB)" in text
    for extra in (["--model.quantize=none"], ["--model.quantize=none", "--lora.rank=0"]):
        other = resolved(load_config("recipe:llama3-70b-qlora-1gpu", extra), 1, 139)  # every block, if nothing less
        assert not fits(estimate(other, 1, 1), allocation_budget(139 * GiB), 139 * GiB)


def test_recipes_take_the_size_defaults_and_overrides_win():
    sft = load_config("recipe:llama3-8b-sft-8gpu")
    assert sft.train.global_batch == 32 and sft.data.mode == "sft"  # fine-tuning data: examples per step
    mine = load_config("recipe:llama3-8b-sft-8gpu", ["--train.lr=1e-5", "--data.seq_len=2048"])
    assert mine.train.lr == 1e-5 and mine.data.seq_len == 2048


def test_training_refuses_a_recipe_without_what_it_needs(tmp_path):
    recipe = read("recipe:llama3-8b-sft-8gpu")
    with pytest.raises(ShardfitError, match=r"needs model.path; fix: add --model.path="):
        check_needs(recipe, load_config("recipe:llama3-8b-sft-8gpu"))
    fp8 = read("recipe:llama3-8b-fp8-pretrain")
    data = tmp_path / "corpus.txt"
    data.write_text("text\n")
    with pytest.raises(ShardfitError, match="needs data.tokenizer"):  # left at its default, "byte"
        check_needs(fp8, load_config("recipe:llama3-8b-fp8-pretrain", [f"--data.path={data}"]))


def test_unknown_recipe_and_copies(tmp_path):
    with pytest.raises(ShardfitError, match=r"unknown recipe 'llama3-8b-sft'.*recipe:llama3-8b-sft-1gpu"):
        resolve("recipe:llama3-8b-sft")
    copy = tmp_path / "mine.toml"
    copy.write_text(resolve("recipe:llama3-8b-sft-8gpu").read_text())  # [recipe] table and all
    assert load_config(copy) == load_config("recipe:llama3-8b-sft-8gpu")
    assert read(str(copy)).needs and read(str(tmp_path / "missing.toml")) is None
