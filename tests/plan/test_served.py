"""shardfit serve's frozen extra models (--serve.models) in the plan (plan/served.py): the bytes the plan gives each
one equal what the server allocates for it on the CPU (its parameters' local shards, built as serve builds them:
serve/served.py start_served, frozen in the compute dtype), on 1 and 2 gloo ranks; one rank samples from views of
them (no copy); `shardfit plan --json` and its text carry each model, the total, and the KV cache's free memory less
that total; the 8B shape's shards and gathered copy by the arithmetic."""

from __future__ import annotations

import json

import pytest
import torch

from shardfit.config import load_config
from shardfit.plan.estimate import GiB, adapter_params
from shardfit.plan.served import served_cost, served_costs, served_lines
from tests._dist import run_ranks
from tests.helpers import SMALL

transformers = pytest.importorskip("transformers")

SIZES = dict(vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=128)


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory) -> str:
    """A tiny Llama checkpoint, seeded."""
    path = tmp_path_factory.mktemp("hf") / "llama"
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(transformers.LlamaConfig(**SIZES)).save_pretrained(path)
    return str(path)


def _args(hf_dir: str, dtype: str) -> list[str]:
    return [*SMALL, "--train.device=cpu", f"--serve.models={hf_dir}", f"--compute.param_dtype={dtype}",
            "--logging.run_dir="]


def _allocated(rank: int, world: int, args: list[str]) -> dict:
    """The extra model as the server builds it (start_served): its parameters' local shards' bytes and dtypes, the
    trained parameters and optimizer state it holds, and (one rank) whether a sample's decode model viewed them."""
    from shardfit.engine import Engine
    from shardfit.parallel.dtensor import local_tensor
    from shardfit.sampling.params import SamplingParams
    from shardfit.serve.served import start_served

    (name, e), = start_served(load_config(None, args), Engine.start).items()
    shards = [local_tensor(p.data) for p in e.model.parameters()]
    out = {"name": name, "bytes": sum(t.nbytes for t in shards), "dtypes": sorted({str(t.dtype) for t in shards}),
           "trained": len(e.params), "optimizer_state": len(e.optimizer.state)}
    e.sample([[1, 2, 3]], SamplingParams(max_tokens=2, temperature=0.0))
    if world == 1:
        mine = {t.untyped_storage().data_ptr() for t in shards}
        out["views"] = all(p.untyped_storage().data_ptr() in mine for p in e._sampling.model.parameters())
    return out


@pytest.mark.parametrize("dtype, item", [("bfloat16", 2), ("float32", 4)])
def test_the_plans_bytes_are_what_the_server_allocates_on_one_rank(hf_dir, dtype, item):
    from shardfit.serve.served import served_configs

    args = _args(hf_dir, dtype)
    got = run_ranks(_allocated, 1, args)[0]
    (c,) = served_costs(served_configs(load_config(None, args)), 1)
    assert got["dtypes"] == [f"torch.{dtype}"] and c.dtype == dtype
    assert got["bytes"] == c.shard_bytes == c.params * item and c.decode_bytes == 0 and c.bytes == c.shard_bytes
    assert got["views"]  # sampled from views of the stored shards: the plan's 0 bytes of decode model
    assert got["trained"] == 0 and got["optimizer_state"] == 0  # frozen: no gradients, no moments
    assert c.name == got["name"] == hf_dir


def test_the_plans_bytes_are_rank_zeros_shards_on_two_ranks(hf_dir):
    from shardfit.serve.served import served_configs

    args = _args(hf_dir, "bfloat16")
    got = run_ranks(_allocated, 2, args)
    (c,) = served_costs(served_configs(load_config(None, args)), 2)
    assert got[0]["bytes"] == c.shard_bytes >= got[1]["bytes"]  # rank 0's dim-0 chunks: the largest
    assert c.decode_bytes == c.params * 2  # the whole model gathered for sampling on each rank


def test_the_8b_shapes_shards_and_gathered_copy():
    cfg = load_config(None, ["--model.name=llama3-8b"])
    _, n_params = adapter_params(cfg)
    one, eight = served_cost("m", cfg, 1), served_cost("m", cfg, 8)
    assert one.params == eight.params == n_params and one.dtype == "bfloat16"  # auto: bf16, as on CUDA
    assert one.shard_bytes == 2 * n_params and one.decode_bytes == 0
    assert 2 * n_params / 8 <= eight.shard_bytes < 2 * n_params / 8 + 2 * 8 * 4096  # rows rounded up per tensor
    assert eight.decode_bytes == 2 * n_params
    line, total = served_lines([eight], 8, peak=60 * GiB, budget=74.5 * GiB)
    assert f"{eight.shard_bytes / GiB:.3f} GiB of shards a rank" in line and "on each of 8 ranks" in line
    assert f"{eight.bytes / GiB:.3f} GiB a rank in all" in total and "OVER the 74.5 GiB budget" in total


def test_plan_json_and_text_count_each_model_and_the_kv_cache_after_them(hf_dir, capsys):
    from shardfit.cli.main import main

    base = ["plan", "--model.name=tiny", "--nproc=1", "--gpu-memory=80"]
    assert main([*base, "--json"]) == 0
    without = json.loads(capsys.readouterr().out)
    assert main([*base, f"--serve.models={hf_dir}", "--json"]) == 0
    with_ = json.loads(capsys.readouterr().out)
    (m,) = with_["served"]["models"]
    assert m["name"] == hf_dir and m["bytes"] == m["shard_bytes"] == 2 * m["params"] and m["decode_bytes"] == 0
    assert with_["served"]["total"] == m["bytes"] and without["served"] == {"models": [], "total": 0}
    assert with_["sampling"]["served_bytes"] == m["bytes"]
    assert with_["sampling"]["free"] == without["sampling"]["free"] - m["bytes"]
    assert main([*base, f"--serve.models={hf_dir}"]) == 0
    text = capsys.readouterr().out
    assert f"frozen extra model {hf_dir} (serve.models): {m['params']:,} parameters in bfloat16" in text
    assert "frozen extra models: 0.000 GiB a rank in all" in text and "within the" in text
    assert "GiB of frozen extra models)" in text  # the KV cache line: what is free after them
