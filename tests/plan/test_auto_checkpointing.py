"""compute.activation_checkpoint=auto: the fewest checkpointed blocks the plan says fit the GPU in hand (the search
of partial_checkpointing), none where everything fits, every block where nothing less does; refused with
train.micro_batch=0; resolved in place by the Engine before it builds (none on the CPU); `shardfit plan` shows the
choice."""

import json

import pytest

from shardfit.config import load_config
from shardfit.errors import ShardfitError
from shardfit.plan.auto_checkpointing import auto_checkpointing
from shardfit.plan.estimate import GiB, allocation_budget, estimate, fits
from shardfit.plan.proposals import apply

# the Qwen3-8B-shaped LoRA PPO step of benchmarks/bench_rl.py (17,408-token micro-batches, compiled), measured at
# 28.1 GiB with every block checkpointed (plan 28.2)
RL_8B = ["--model.qk_norm=true", "--model.vocab_size=151936", "--model.n_kv_heads=8", "--model.head_dim=128",
         "--model.dim=4096", "--model.n_layers=36", "--model.n_heads=32", "--model.ffn_dim=12288",
         "--model.tie_embeddings=false", "--train.micro_batch_tokens=17408", "--data.seq_len=4096",
         "--model.max_seq_len=40960", "--compute.compile=true", "--lora.rank=16", "--lora.alpha=32",
         "--compute.activation_checkpoint=auto"]
H100, H200 = 79.1, 139.8


def _fits(cfg, changes, gib):
    return fits(estimate(apply(cfg, changes), 1, 1), allocation_budget(gib * GiB), gib * GiB)


@pytest.mark.parametrize("gib", [H100, 60.0, 40.0])
def test_auto_takes_the_fewest_first_blocks_that_fit(gib):
    cfg = load_config(None, RL_8B)
    changes, line = auto_checkpointing(cfg, 1, gib)
    n = changes["compute.ac_blocks"]
    assert changes["compute.activation_checkpoint"] == "full" and 0 < n < 36
    assert _fits(cfg, changes, gib) and not _fits(cfg, {**changes, "compute.ac_blocks": n - 1}, gib)
    assert f"the first {n} of 36 blocks checkpointed" in line and "NOT" not in line


def test_auto_checkpoints_nothing_where_every_block_fits_and_everything_where_nothing_less_does():
    cfg = load_config(None, RL_8B)
    changes, line = auto_checkpointing(cfg, 1, H200)
    assert changes == {"compute.activation_checkpoint": "none", "compute.ac_blocks": 0, "compute.ac_every": 1}
    assert "no checkpointing" in line
    changes, line = auto_checkpointing(cfg, 1, 31.0)  # every block checkpointed: 28.2 GiB; 35 of them: more
    assert (changes["compute.activation_checkpoint"], changes["compute.ac_blocks"]) == ("full", 0)
    assert "every block checkpointed" in line and "NOT" not in line
    changes, line = auto_checkpointing(cfg, 1, 20.0)
    assert changes["compute.ac_blocks"] == 0 and "predicted NOT to fit" in line


def test_auto_on_the_cpu_is_no_checkpointing():
    changes, line = auto_checkpointing(load_config(None, RL_8B), 1, None)
    assert changes["compute.activation_checkpoint"] == "none" and "CPU" in line


def test_auto_with_a_micro_batch_chosen_at_start_up_is_refused():
    with pytest.raises(ShardfitError, match="train.micro_batch=0"):
        load_config(None, ["--compute.activation_checkpoint=auto", "--train.micro_batch=0"])
    with pytest.raises(ShardfitError, match="compute.ac_blocks"):
        load_config(None, ["--compute.activation_checkpoint=auto", "--compute.ac_blocks=3"])


def test_an_unresolved_auto_is_never_built_silently():
    from shardfit.config.schema import ComputeConfig
    from shardfit.parallel.parallelize import checkpointed_blocks

    with pytest.raises(ValueError, match="resolved first"):
        checkpointed_blocks(ComputeConfig(activation_checkpoint="auto"), 4)


def test_plan_shows_what_auto_chooses_on_its_gpu(capsys):
    from shardfit.cli.plan import plan

    assert plan([*RL_8B, "--gpu-memory", str(H100)]) == 0
    out = capsys.readouterr().out
    changes, line = auto_checkpointing(load_config(None, RL_8B), 1, H100)
    assert line in out and f"full {changes['compute.ac_blocks']}/36" in out
    assert plan([*RL_8B, "--gpu-memory", str(H100), "--json"]) == 0  # the JSON says which blocks its terms are of
    out = json.loads(capsys.readouterr().out)
    assert out["auto_checkpointing"] == {"changes": changes, "line": line}
    assert out["configured"]["terms"]["peak"] == estimate(apply(load_config(None, RL_8B), changes), 1, 1).peak


def test_the_engine_resolves_auto_in_place_before_it_builds(monkeypatch):
    """On the CPU: no checkpointing, said in a notice. With a choice of the first block (as a GPU short of memory
    would get), the Engine builds exactly that: block 0 checkpointed, block 1 not, the config saying so."""
    from shardfit.engine import Engine
    from shardfit.plan import auto_checkpointing as auto
    from tests.helpers import SMALL

    args = [*SMALL, "--train.device=cpu", "--train.micro_batch_tokens=32", "--logging.run_dir=",
            "--compute.activation_checkpoint=auto"]
    engine = Engine.start(load_config(None, args))
    assert engine.cfg.compute.activation_checkpoint == "none"
    assert any("auto on the CPU: no checkpointing" in n for n in engine.notices)
    assert not any("forward" in b.__dict__ for b in engine.model.model.layers)

    monkeypatch.setattr(auto, "auto_checkpointing", lambda cfg, world, gib: (
        {"compute.activation_checkpoint": "full", "compute.ac_blocks": 1}, "chose the first block"))
    engine = Engine.start(load_config(None, args))
    assert (engine.cfg.compute.activation_checkpoint, engine.cfg.compute.ac_blocks) == ("full", 1)
    assert "chose the first block" in engine.notices
    assert ["forward" in b.__dict__ for b in engine.model.model.layers][:2] == [True, False]


@pytest.mark.parametrize("fname,gib", [("2026-11-26_s16_h100x1_rl_auto.json", H100),
                                       ("2026-11-26_s16_h200x1_rl_auto.json", H200)])
def test_what_auto_chose_on_the_gpu_peaked_as_planned(fname, gib):
    """The 8B LoRA PPO step through the Engine with auto (benchmarks/bench_rl.py, stage rl-auto): on an H100 the
    first 13 of 36 blocks checkpointed, on an H200 none; the measured peak within 3% of the plan's for that choice,
    and the choice the one the plan makes now."""
    from pathlib import Path

    data = json.loads((Path(__file__).resolve().parents[2] / "benchmarks" / "results" / fname).read_text())
    lines = [x for r in data["rows"] if r["system"] == "shardfit" for x in r["lines"]]
    chose = next(x for x in lines if x.get("rlbench") == "engine")["checkpointing"][0]
    measured = next(x for x in lines if x.get("rlbench") == "ppo")["peak_alloc_GiB"]
    cfg = load_config(None, RL_8B)
    changes, line = auto_checkpointing(cfg, 1, gib)
    assert line.split(",")[0] == chose.split(",")[0]  # the same blocks
    assert abs(estimate(apply(cfg, changes), 1, 1).peak / GiB / measured - 1) < 0.03


def test_one_block_is_all_or_nothing():
    """partial_checkpointing searches two blocks or more; a one-block model takes none where it fits."""
    one = load_config(None, [*RL_8B, "--model.n_layers=1"])
    assert auto_checkpointing(one, 1, H200)[0]["compute.activation_checkpoint"] == "none"
    changes, line = auto_checkpointing(one, 1, 9.5)  # none needs 8.7 GiB: over this budget (8.5)
    assert changes["compute.activation_checkpoint"] == "full" and "NOT to fit" in line


def test_a_run_records_auto_and_its_choice_beside_it(tmp_path):
    """`shardfit train` with auto: config.toml keeps "auto" (a resume on another GPU chooses again) with the choice
    made on this machine as the comment above it; the run's output says it too."""
    from tests.cli.session import run_commands
    from tests.cli.test_cli import TINY

    run = tmp_path / "run"
    (res,) = run_commands([["train", *TINY, "--train.steps=2", "--compute.activation_checkpoint=auto",
                            f"--logging.run_dir={run}"]], tmp_path)
    assert res.returncode == 0, res.stderr[-2000:]
    assert "compute.activation_checkpoint=auto on the CPU: no checkpointing" in res.stdout + res.stderr
    text = (run / "config.toml").read_text()
    assert text.startswith("# compute.activation_checkpoint=auto on the CPU")
    assert 'activation_checkpoint = "auto"' in text


def test_plan_takes_the_memory_fraction_the_run_is_capped_at(capsys):
    """memory.max_fraction caps the run's GPU memory (train, and auto's choice); shardfit plan plans for the same
    share of --gpu-memory."""
    from shardfit.cli.plan import plan

    assert plan([*RL_8B, "--gpu-memory", str(H200), "--memory.max_fraction=0.5"]) == 0
    out = capsys.readouterr().out
    half = load_config(None, RL_8B)
    assert "1 GPU of 69.9 GiB" in out and auto_checkpointing(half, 1, H200 / 2)[1] in out
