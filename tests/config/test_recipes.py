"""Shipped recipes: each loads, fits the GPUs it names by shardfit plan, and says what the user must add."""

import pytest

from shardfit.config import load_config
from shardfit.config.recipes import check_needs, listing, names, read, resolve
from shardfit.errors import ShardfitError
from shardfit.memory.plan import GiB, allocation_budget, estimate, fits

RECIPES = names()


def test_the_common_cases_are_shipped():
    assert {"llama3-8b-sft-1gpu", "llama3-8b-sft-8gpu", "qwen3-30b-a3b-sft", "llama3-70b-sft",
            "llama3-8b-long-context", "llama3-8b-fp8-pretrain"} <= set(RECIPES)
    text = listing()
    assert all(name in text for name in RECIPES) and "needs: --model.path" in text


@pytest.mark.parametrize("name", RECIPES)
def test_recipe_fits_every_layout_it_names(name):
    """What `shardfit plan --config recipe:NAME --nproc N --gpu-memory G` checks, for each layout of the recipe."""
    recipe = read(f"recipe:{name}")
    cfg = load_config(f"recipe:{name}")
    if cfg.parallel.fp8 != "none":
        pytest.importorskip("torchao.float8", reason="FP8 needs the optional torchao extra")
    assert recipe.layouts and cfg.train.micro_batch > 0  # a fixed micro-batch, planned here
    for gpus, gib in recipe.layouts:
        dp = gpus // cfg.parallel.sequence_parallel
        assert cfg.train.global_batch % (cfg.train.micro_batch * dp) == 0, (gpus, cfg.train.global_batch)
        e = estimate(cfg, gpus, cfg.train.micro_batch)
        assert fits(e, allocation_budget(gib * GiB), gib * GiB), (name, gpus, gib, e.peak / GiB)


def test_70b_says_truthfully_that_one_node_fits_only_with_cpu_offload():
    """The 70B recipe names two and three nodes because one node of 8 GPUs does not fit full fine-tuning without
    offload, even of H200s with gradients freed between steps; with parallel.offload=all, shardfit plan proposes a
    layout for one node of 8 x 80 GB (its comment gives these figures and the flags)."""
    from shardfit.memory.propose import proposals

    cfg = load_config("recipe:llama3-70b-sft")
    assert min(n for n, _ in read("recipe:llama3-70b-sft").layouts) > 8
    for extra in ([], ["--memory.keep_grads=false", "--train.global_batch=8"]):
        one_node = load_config("recipe:llama3-70b-sft", extra)
        assert not fits(estimate(one_node, 8, 1), allocation_budget(139 * GiB), 139 * GiB)
    assert cfg.parallel.activation_checkpoint == "full"
    props, _ = proposals(cfg, 8, 79)
    offload = next(p for p in props if p.world == 8)
    assert offload.flags == ["--parallel.offload=all", "--parallel.activation_checkpoint=full", "--train.micro_batch=6"]
    assert round(offload.estimate.peak / GiB, 1) == 53.6 and round(offload.host_per_node / GiB) == 1112
    text = resolve("recipe:llama3-70b-sft").read_text()
    assert "53.6 GiB per GPU at micro-batch 6" in text and "1,112 GiB of host memory" in text


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
