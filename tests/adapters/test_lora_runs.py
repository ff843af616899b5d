"""A LoRA run from a Hugging Face base, end to end: its checkpoints hold no base and resume exactly (the base rebuilt
from model.path, or from the seed), its exports load in PEFT and transformers with the trained model's logits, its
adapter continues training (lora.adapter), and `shardfit generate` reads its checkpoint."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from shardfit.adapters.lora import is_adapter
from shardfit.train import Trainer
from tests._dist import run_ranks
from tests.adapters.tiny_hf import hf_model, save_tiny
from tests.helpers import EXTEND, full_state, same_bits

peft = pytest.importorskip("peft")
RUN = ["--data.seq_len=32", "--train.global_batch=8", "--train.micro_batch=4", "--train.warmup_steps=1",
       "--logging.progress=none", "--compute.loss_chunk=48", "--train.lr=1e-2", "--lora.rank=4", "--lora.alpha=8",
       "--lora.targets=q_proj,v_proj,o_proj,down_proj,lm_head"]
IDS = [[5, 17, 99, 3, 250, 42, 7, 8, 120, 64, 1, 2]]


def _config(base: str | None, *extra: str, run_dir: str):
    from shardfit.config import load_config
    from shardfit.weights.peft_config import adapter_lora_fields

    where = [f"--model.path={base}"] if base else ["--model.dim=64", "--model.n_layers=2", "--model.n_heads=4",
                                                    "--model.n_kv_heads=2", "--model.ffn_dim=128",
                                                    "--model.max_seq_len=64", "--model.tie_embeddings=false"]
    return load_config(None, [*RUN, *where, *extra, f"--logging.run_dir={run_dir}"], adapter_lora_fields)


def _logits(model) -> list:
    with torch.no_grad():
        return model(torch.tensor(IDS)).tolist()


def _uninterrupted_then_resumed(rank, world, base, root, extra=()):
    full = Trainer(_config(base, "--train.steps=4", "--checkpoint.final=false", *extra, run_dir=f"{root}/a"))
    losses_a = [h["loss"] for h in full.fit()]
    state_a = full_state(full.model)
    Trainer(_config(base, "--train.steps=2", *extra, run_dir=f"{root}/b")).fit()  # saves step 2 at the end
    resumed = Trainer(_config(base, "--train.steps=4", "--checkpoint.final=false", EXTEND, *extra,
                              run_dir=f"{root}/b"))
    assert resumed.step == 2
    losses_b = [h["loss"] for h in resumed.fit()]
    state_b = full_state(resumed.model)
    return {"a": losses_a, "b": losses_b, "same": all(same_bits(state_a[k], state_b[k]) for k in state_a)}


@pytest.mark.parametrize("world, base", [(1, True), pytest.param(2, False, marks=pytest.mark.slow)],
                         ids=["1rank-model-path", "2ranks-seeded"])
def test_resume_equals_uninterrupted_and_saves_no_base(tmp_path, world, base):
    from shardfit.weights.checkpoint_verify import check_files, read_metadata

    path = str(save_tiny("llama", tmp_path)) if base else None
    r = run_ranks(_uninterrupted_then_resumed, world, path, str(tmp_path))[0]
    assert r["b"] == r["a"][2:], "resumed losses must equal the uninterrupted run's, bit for bit"
    assert r["same"]
    ckpt = Path(tmp_path) / "b" / "checkpoints" / "step_00000002"
    assert check_files(ckpt) is None  # checkpoint_verify reads a LoRA checkpoint as any other
    model_keys = [k[len("model."):] for k in read_metadata(ckpt).state_dict_metadata if k.startswith("model.")]
    assert model_keys and all(is_adapter(k) for k in model_keys)  # no frozen base, no tied alias


def _train_and_export(rank, world, base, root, extra=()):
    from shardfit.engine import Engine

    t = Trainer(_config(base, "--train.steps=3", f"--checkpoint.export_hf={root}/adapter",
                        f"--checkpoint.export_merged={root}/merged", "--checkpoint.export_dtype=float32", *extra,
                        run_dir=f"{root}/run"))
    t.fit()
    trained = {k: v for k, v in full_state(t.model).items() if is_adapter(k)}
    logits = _logits(t.model)
    # continue training from the exported adapter: the Engine starts from exactly the trained adapters
    more = Engine(_config(base, f"--lora.adapter={root}/adapter", *extra, run_dir=f"{root}/more"), t.dist)
    loaded = {k: v for k, v in full_state(more.model).items() if is_adapter(k)}
    return {"logits": logits, "continued": all(torch.equal(loaded[k], v) for k, v in trained.items()),
            "n": len(trained)}


@pytest.mark.parametrize("world", [1, pytest.param(2, marks=pytest.mark.slow)], ids=["1rank", "2ranks"])
def test_exports_load_in_peft_and_transformers_and_continue(tmp_path, world):
    from shardfit.weights.local import load_dcp

    base = save_tiny("llama", tmp_path)
    r = run_ranks(_train_and_export, world, str(base), str(tmp_path))[0]
    assert r["continued"] and r["n"] == 2 * (4 * 2 + 1)  # A and B of 4 targets x 2 blocks, and the head
    trained = torch.tensor(r["logits"])
    ids = torch.tensor(IDS)
    with torch.no_grad():
        via_peft = peft.PeftModel.from_pretrained(hf_model(base), tmp_path / "adapter")(input_ids=ids).logits
        merged = hf_model(tmp_path / "merged")(input_ids=ids).logits
        untrained = hf_model(base)(input_ids=ids).logits
        model, _ = load_dcp(str(tmp_path / "run"), torch.device("cpu"), torch.float32)  # generate --checkpoint
        from_ckpt = model(ids)
    for got in (via_peft, merged, from_ckpt):
        assert ((got - trained).norm() / trained.norm()).item() < 1e-5
    assert ((untrained - trained).norm() / trained.norm()).item() > 1e-3  # training moved the adapters
    assert (tmp_path / "merged" / "model.safetensors").is_file() and not (tmp_path / "adapter" / "config.json").exists()
