"""Full-parameter serve (no --lora.rank) and frozen extra models (--serve.models) through the official tinker SDK, on
the real Engine (gloo ranks, CPU, the server in the rank process on loopback); issue 35 items 4 and 5.

Without LoRA the server holds one model: a second client, and a client asking for LoRA (rank > 0), are refused in one
line naming --lora.rank. A sampler of save_weights_and_get_sampling_client samples and scores the weights frozen then
(a copy of every weight) however the model trains afterwards, on 1 and 2 ranks, up to --serve.versions; past it one
line naming the option (a saved path's load too). A sampler of a path save_weights_for_sampler returned scores the
saved weights (loaded from disk into a version, the model untouched), before and after a restart on the same run
directory, and the state save_state wrote resumes exactly after it (issue 35 item 6; the LoRA twin is in
test_models.py, both through engine_server.restarted); a path that does not exist is one line. Two tiny Hugging Face
checkpoints written here (Llama and Qwen2) are served frozen: a sampler naming one as base_model scores what
transformers computes; get_server_capabilities lists all three; an unknown base and a training client of a frozen one
are one line each; `shardfit serve` with a path that is no model exits 2.
"""

from __future__ import annotations

import functools
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

tinker = pytest.importorskip("tinker")
transformers = pytest.importorskip("transformers")

from tests._dist import run_ranks  # noqa: E402
from tests.helpers import SMALL  # noqa: E402
from tests.serve.engine_server import SEQ, error, logprobs, restarted, scored, serve, steps  # noqa: E402

ARGS = [*SMALL, "--train.device=cpu", "--train.micro_batch_tokens=64", "--serve.versions=3"]
SIZES = dict(vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=128)


def _hf_models(root: Path) -> list[str]:
    """Two tiny checkpoints of two families, seeded: their directories."""
    import torch

    paths = []
    for name, (config, model) in {"llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
                                  "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM)}.items():
        torch.manual_seed(len(paths))
        model(config(**SIZES)).save_pretrained(root / name)
        paths.append(str(root / name))
    return paths


def _hf_scored(path: str) -> list[float]:
    """transformers' log-probs of SEQ[1:] under the checkpoint at `path`."""
    import torch

    model = transformers.AutoModelForCausalLM.from_pretrained(path).eval()
    with torch.no_grad():
        logits = model(torch.tensor([SEQ])).logits[0, :-1].float()
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(SEQ[1:])[:, None]).squeeze(-1).tolist()


def _greedy(sampler) -> list:
    from tinker import types

    seq = sampler.sample(types.ModelInput.from_ints(SEQ[:6]), num_samples=1,
                         sampling_params=types.SamplingParams(max_tokens=5, temperature=0.0)).result().sequences[0]
    return [list(seq.tokens), list(seq.logprobs)]


def _scenario(sc, url: str, base_model: str, extra: list[str]) -> dict:
    import httpx

    key = {"X-API-Key": "tml-local"}
    out = {}
    a = sc.create_lora_training_client(base_model=base_model, rank=0).result()
    out["lora_refused"] = error(lambda: sc.create_lora_training_client(base_model=base_model, rank=8).result())
    out["second_refused"] = error(lambda: sc.create_lora_training_client(base_model=base_model, rank=0).result())
    out["live0"] = logprobs(a)
    ref = a.save_weights_and_get_sampling_client().result()  # a copy of every weight, now
    out["ref_before"], out["ref_greedy_before"] = scored(ref), _greedy(ref)
    steps(a, [1, 2], lr=1e-2)
    out["live2"] = logprobs(a)
    mid = a.save_weights_and_get_sampling_client().result()
    out["mid_before"] = scored(mid)
    out["saved_path"] = a.save_weights_for_sampler("two").result().path  # the weights of mid, on disk
    out["state_path"] = a.save_state("two").result().path  # and with the optimizer: a restart resumes from it
    out["step3"] = steps(a, [3], lr=1e-2)
    out["ref_after"], out["ref_greedy_after"], out["mid_after"] = scored(ref), _greedy(ref), scored(mid)
    out["live3"] = logprobs(a)  # the model's own weights back after the versions' samples
    out["from_path"] = scored(sc.create_sampling_client(model_path=out["saved_path"]).result())  # the third version
    out["no_path"] = error(lambda: sc.create_sampling_client(model_path=out["saved_path"] + "x").result())
    out["inflight"] = scored(a.save_weights_and_get_sampling_client(kind="inflight").result())
    out["too_many"] = error(lambda: a.save_weights_and_get_sampling_client().result())
    out["too_many_paths"] = error(lambda: sc.create_sampling_client(model_path=out["saved_path"]).result())
    out["live3_again"] = logprobs(a)  # the refusal disturbed nothing
    out["held"] = httpx.get(f"{url}/api/v1/shardfit/status", headers=key).json()["held"]
    out["served"] = [scored(sc.create_sampling_client(base_model=p).result()) for p in extra]
    out["served_greedy"] = _greedy(sc.create_sampling_client(base_model=extra[0]).result())
    out["capabilities"] = httpx.get(f"{url}/api/v1/get_server_capabilities", headers=key).json()
    out["unknown_base"] = error(lambda: scored(sc.create_sampling_client(base_model="no-such-model").result()))
    other = tinker.ServiceClient(base_url=url, api_key="tml-local")
    out["train_frozen"] = error(lambda: other.create_lora_training_client(base_model=extra[0], rank=0).result())
    other.close("success").result(timeout=30)
    out["live3_last"] = logprobs(a)
    return out


@pytest.fixture(scope="module")
def extra(tmp_path_factory) -> list[str]:
    return _hf_models(tmp_path_factory.mktemp("hf"))


def _run(tmp_path_factory, extra: list[str], world: int) -> dict:
    run_dir = str(tmp_path_factory.mktemp(f"full{world}") / "run")
    out = run_ranks(serve, world, run_dir, functools.partial(_scenario, extra=extra),
                    [*ARGS, f"--serve.models={','.join(extra)}"], timeout=600)[0]
    return {**out, "run_dir": run_dir}


@pytest.fixture(scope="module")
def one(tmp_path_factory, extra):
    return _run(tmp_path_factory, extra, 1)


def _check_versions(r: dict) -> None:
    assert r["ref_after"] == r["ref_before"] and r["ref_greedy_after"] == r["ref_greedy_before"]
    assert r["mid_after"] == r["mid_before"] and r["mid_before"] != r["ref_before"]
    assert r["live2"] != r["live0"] and r["live3"] != r["live2"]
    assert r["inflight"] != r["mid_after"]  # the live weights, one step past mid
    assert r["from_path"] == r["mid_before"]  # a sampler of the saved path: the saved weights, loaded from disk
    assert r["live3_again"] == r["live3"] == r["live3_last"]


def test_a_version_samples_the_weights_frozen_then_on_one_rank(one):
    _check_versions(one)


def test_a_version_samples_the_weights_frozen_then_on_two_ranks(one, tmp_path_factory, extra):
    two = _run(tmp_path_factory, extra, 2)
    _check_versions(two)
    for k in ("ref_after", "mid_after", "live3"):
        np.testing.assert_allclose(two[k], one[k], rtol=0, atol=2e-5)
    for got, path in zip(two["served"], extra):  # the frozen extra models sharded over 2 ranks
        np.testing.assert_allclose(got, _hf_scored(path), rtol=0, atol=1e-4)


def test_one_model_only_and_no_lora_on_a_full_parameter_server(one):
    assert "lora_config.rank" in one["lora_refused"] and "pass rank=0" in one["lora_refused"]
    assert "--lora.rank=8" in one["lora_refused"]
    assert "has one already" in one["second_refused"] and "--lora.rank=R" in one["second_refused"]


def test_versions_past_the_limit_are_one_line_naming_the_option(one):
    for line in (one["too_many"], one["too_many_paths"]):  # a snapshot, and a saved path's load
        assert "3 frozen versions (copies of every weight)" in line and "--serve.versions=3" in line
        assert "\n" not in line
    assert one["held"]["models"] == 1 and one["held"]["versions"] == 3


def test_a_path_that_does_not_exist_is_one_line(one):
    line = one["no_path"]
    assert f"no checkpoint at '{one['saved_path']}x'" in line and "list_user_checkpoints" in line
    assert "\n" not in line


def test_a_saved_path_samples_and_resumes_the_same_after_a_restart(one):
    """Without LoRA: stopped, then started again on the same run directory, a sampler of the sampler path saved
    at mid scores what it scored before (bitwise on the CPU), and the state saved with its optimizer resumes
    exactly: one step after the restart is the step the first server took (its loss, and the log-probs after)."""
    r = run_ranks(serve, 1, one["run_dir"], functools.partial(
        restarted, sampler_path=one["saved_path"], state_path=one["state_path"], seed=3, lr=1e-2), ARGS,
        timeout=600)[0]
    assert r["from_path"] == one["from_path"] == one["mid_before"]
    assert r["resumed"] == one["step3"] and r["resumed_lp"] == one["live3"]
    assert sorted(r["listed"]) == sorted([one["saved_path"], one["state_path"]])


def test_frozen_extra_models_score_what_transformers_computes(one, extra):
    for got, path in zip(one["served"], extra):
        np.testing.assert_allclose(got, _hf_scored(path), rtol=0, atol=1e-4)
    tokens, lps = one["served_greedy"]
    assert len(tokens) == 5 and all(lp <= 0 for lp in lps)


def test_capabilities_list_every_served_model(one, extra):
    models = one["capabilities"]["supported_models"]
    assert [m["model_name"] for m in models] == ["tiny", *extra]
    assert [m["trainable"] for m in models] == [True, False, False]
    assert all(m["sampleable"] for m in models)
    assert [m["max_context_length"] for m in models] == [64, 128, 128]


def test_an_unknown_or_frozen_base_is_one_line(one, extra):
    assert "this server serves 'tiny'" in one["unknown_base"] and "not 'no-such-model'" in one["unknown_base"]
    assert "sampling and scoring only (--serve.models)" in one["train_frozen"]
    assert all("\n" not in one[k] for k in ("unknown_base", "train_frozen"))


@pytest.mark.parametrize("case", ["missing", "no weights"])
def test_serve_with_a_path_that_is_no_model_exits_2(tmp_path, case):
    path = tmp_path / "m"
    if case == "no weights":
        path.mkdir()
        transformers.LlamaConfig(**SIZES).save_pretrained(path)  # config.json alone
    p = subprocess.run([sys.executable, "-m", "shardfit", "serve", f"--serve.models={path}", "--train.device=cpu",
                        f"--logging.run_dir={tmp_path / 'run'}"], capture_output=True, text=True, timeout=120)
    said = "model directory not found" if case == "missing" else "no *.safetensors weights"
    assert p.returncode == 2 and f"serve.models {path}: {said}" in p.stderr, p.stderr
    assert len(p.stderr.strip().splitlines()) == 1
