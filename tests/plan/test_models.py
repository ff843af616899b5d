"""The plan's LoRA models and versions (plan/models.py) against what the registry holds (engine/registry.py), measured
on the CPU: a model out of the slot and a frozen version cost exactly the bytes the plan counts; `shardfit plan
--models/--versions` prints them and how many fit; without LoRA --models is one line, and a version is a copy of
every weight in the compute dtype."""

from __future__ import annotations

import torch

from tests._dist import run_ranks
from tests.engine.test_registry import ARGS, _data


def _held(rank, world):
    from shardfit.config import load_config
    from shardfit.plan.models import models_cost
    from shardfit.rl import AdamParams, DatumEngine

    cfg = load_config(None, ARGS)
    e = DatumEngine.start(cfg)
    e.add_model("A", seed=1)
    e.forward_backward(_data(1), "cross_entropy", model="A")
    e.optim_step(AdamParams(learning_rate=1e-2), model="A")
    e.forward_backward(_data(2), "cross_entropy", model="A")  # gradients pending when A leaves the slot
    e.add_model("B", seed=2)
    slot = e.models.models["A"]
    nbytes = lambda ts: sum(t.numel() * t.element_size() for t in ts if isinstance(t, torch.Tensor))  # noqa: E731
    held = (nbytes(slot.values) + nbytes(g.to_local() if hasattr(g, "to_local") else g for g in slot.grads)
            + nbytes(v.to_local() if hasattr(v, "to_local") else v for s in slot.opt_state
                     for k, v in s.items() if k != "step"))
    vid = e.freeze("A")
    cost = models_cost(cfg, world, models=2, versions=1)
    return {"held": held, "version": e.models.versions[vid].nbytes, "plan_model": cost.model_bytes,
            "plan_version": cost.version_bytes}


def test_a_model_and_a_version_cost_what_the_plan_counts():
    for world in (1, 2):
        r = run_ranks(_held, world)[0]
        assert r["held"] == r["plan_model"] and r["version"] == r["plan_version"], (world, r)


def _held_full(rank, world):
    """Without LoRA: a version's bytes (every parameter's shard in the compute dtype, bf16 here) and the plan's."""
    from shardfit.config import load_config
    from shardfit.plan.models import models_cost
    from shardfit.rl import DatumEngine

    cfg = load_config(None, [a for a in ARGS if not a.startswith("--lora")] + ["--compute.param_dtype=bfloat16"])
    e = DatumEngine.start(cfg)
    vid = e.freeze()
    return {"version": e.models.versions[vid].nbytes, "plan_version": models_cost(cfg, world, 1, 1).version_bytes,
            "dtype": str(e.models.versions[vid].values[0].dtype)}


def test_a_full_parameter_version_costs_what_the_plan_counts():
    r = run_ranks(_held_full, 2)[0]  # each rank's shards of every parameter
    assert r["version"] == r["plan_version"] and r["dtype"] == "torch.bfloat16", r


def test_plan_says_what_models_cost_and_how_many_fit(tmp_path):
    from tests.cli.session import run_commands

    base = ["plan", "--model.name=llama3-8b", "--data.seq_len=4096", "--gpu-memory", "79"]
    p, q, f = run_commands([[*base, "--lora.rank=16", "--lora.targets=all-linear", "--models", "16", "--versions",
                             "4"], [*base, "--models", "3"], [*base, "--versions", "2"]], cwd=tmp_path)
    assert p.returncode == 0, p.stderr
    assert "0.625 GiB a model beyond the first" in p.stdout
    assert "models that fit this GPU with 4 version(s):" in p.stdout
    assert q.returncode == 2 and "--models: several models share one base only with LoRA" in q.stderr
    assert f.returncode == 0, f.stderr
    assert "frozen versions (without LoRA a copy of every weight): 14.958 GiB each" in f.stdout, f.stdout
