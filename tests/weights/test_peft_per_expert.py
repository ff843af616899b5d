"""A PEFT adapter trained on transformers 4's Qwen3-MoE (one pair a module and expert: weights/peft_per_expert.py),
written by hand as PEFT 0.x wrote it there: read through shardfit's paths (lora.adapter's config, generate
--adapter's attach_adapter), the model's logits equal the base with every delta W = (alpha / r) B A added by hand
(gate and up separately, into transformers 5's fused gate_up_proj); what cannot be converted exactly is one line;
the export of the converted adapter loads back to the same logits."""

from __future__ import annotations

import json
import re
import shutil

import pytest
import torch
from safetensors.torch import save_file

import shardfit.weights.hf_load as hf_load
from shardfit.adapters.lora import is_adapter
from shardfit.config import load_config
from shardfit.config.schema import LoraConfig
from shardfit.errors import ShardfitError
from shardfit.weights.peft import adapter_notices, attach_adapter, export_adapter
from shardfit.weights.peft_config import (
    ADAPTER_CONFIG,
    ADAPTER_WEIGHTS,
    PREFIX,
    adapter_lora_fields,
    read_adapter_config,
)
from tests.adapters.tiny_hf import hf_model, save_tiny, shardfit_model

R, ALPHA = 4, 12  # PEFT's scale alpha / r = 3
E, I = 4, 32  # tiny_hf.MOE_SIZES: 4 experts of inner size 32 in layer 0; layer 1 is a dense MLP (mlp_only_layers)
ALL = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
IDS = torch.randint(0, 300, (2, 24), generator=torch.Generator().manual_seed(0))
EXPERT = re.compile(r"^(.+\.experts)\.(\d+)\.(\w+)$")


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    return save_tiny("qwen3_moe", tmp_path_factory.mktemp("base"))


def write_v4_adapter(out, base, modules, r=R, moe_layers=(0,), dropout=0.05) -> dict[str, torch.Tensor]:
    """adapter_config.json and adapter_model.safetensors as PEFT on transformers 4 saved a LoRA on `modules` of the
    tiny Qwen3-MoE: gate/up/down per expert in moe_layers, on the dense MLP in the other layer. Random A and B (B
    not zero: the adapter must count). Returns the tensors."""
    shapes = {n[:-len(".weight")]: tuple(t.shape) for n, t in hf_model(base).state_dict().items()}
    gen, tensors = torch.Generator().manual_seed(7), {}
    for layer in (0, 1):
        names = [f"model.layers.{layer}.self_attn.{m}" for m in modules if m.endswith(("q_proj", "k_proj", "v_proj",
                                                                                      "o_proj"))]
        for m in (m for m in modules if m in ("gate_proj", "up_proj", "down_proj")):
            names += ([f"model.layers.{layer}.mlp.experts.{e}.{m}" for e in range(E)] if layer in moe_layers
                      else [f"model.layers.{layer}.mlp.{m}"])
        for name in names:
            match = EXPERT.match(name)
            out_f, in_f = ((I, 64) if match.group(3) != "down_proj" else (64, I)) if match else shapes[name]
            tensors[f"{PREFIX}{name}.lora_A.weight"] = torch.randn(r, in_f, generator=gen) * 0.2
            tensors[f"{PREFIX}{name}.lora_B.weight"] = torch.randn(out_f, r, generator=gen) * 0.2
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / ADAPTER_WEIGHTS))
    config = {"alpha_pattern": {}, "auto_mapping": None, "base_model_name_or_path": str(base), "bias": "none",
              "corda_config": None, "eva_config": None, "exclude_modules": None, "fan_in_fan_out": False,
              "inference_mode": True, "init_lora_weights": True, "layer_replication": None, "layers_pattern": None,
              "layers_to_transform": None, "loftq_config": {}, "lora_alpha": ALPHA, "lora_bias": False,
              "lora_dropout": dropout, "megatron_config": None, "megatron_core": "megatron.core",
              "modules_to_save": None, "peft_type": "LORA", "r": r, "rank_pattern": {}, "revision": None,
              "target_modules": list(modules), "task_type": "CAUSAL_LM", "use_dora": False, "use_rslora": False}
    (out / ADAPTER_CONFIG).write_text(json.dumps(config, indent=2))
    return tensors


@torch.no_grad()
def reference_logits(base, tensors) -> torch.Tensor:
    """transformers 5's model of the base with each adapter's (alpha / r) B A added to its weight by hand: an
    expert's gate into rows :I of its fused gate_up_proj, its up into rows I:."""
    model = hf_model(base)
    weights = dict(model.named_parameters())
    for key, a in tensors.items():
        if key.endswith("lora_A.weight"):
            delta = (tensors[key.replace("lora_A", "lora_B")].double() @ a.double() * (ALPHA / R)).float()
            name = key[len(PREFIX):-len(".lora_A.weight")]
            match = EXPERT.match(name)
            if not match:
                weights[f"{name}.weight"] += delta
                continue
            fqn, e, w = match.group(1), int(match.group(2)), match.group(3)
            if w == "down_proj":
                weights[f"{fqn}.down_proj"][e] += delta
            else:
                rows = slice(0, I) if w == "gate_proj" else slice(I, 2 * I)
                weights[f"{fqn}.gate_up_proj"][e, rows] += delta
    return model(input_ids=IDS).logits


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


@pytest.mark.parametrize("modules, rank, targets", [
    (ALL, 2 * R, "down_proj,gate_proj,k_proj,o_proj,q_proj,up_proj,v_proj,experts"),
    (("v_proj", "down_proj"), R, "down_proj,v_proj,experts.down_proj"),
    (("up_proj", "o_proj"), R, "o_proj,up_proj,experts.gate_up_proj"),
])
def test_transformers4_adapter_loads_exactly(base, tmp_path, modules, rank, targets):
    out = tmp_path / "adapter"
    tensors = write_v4_adapter(out, base, modules)
    # lora.adapter: rank 2r with both gate and up (their As stacked), alpha with it (the same scale), no dropout
    fields = {"rank": rank, "alpha": ALPHA * rank // R, "dropout": 0.0, "targets": targets}
    assert read_adapter_config(out) == fields
    cfg = load_config(None, ["--data.seq_len=32", f"--model.path={base}", f"--lora.adapter={out}"], adapter_lora_fields)
    assert (cfg.lora.rank, cfg.lora.alpha, cfg.lora.dropout, cfg.lora.targets) == (rank, ALPHA * rank // R, 0.0,
                                                                                   targets)
    assert f"r={R}) read exactly" in adapter_notices(out)[0]
    with pytest.raises(ShardfitError, match=f"lora.rank=3 conflicts with rank={rank} in .*adapter_config.json "
                                            fr"\(transformers 4's per-expert MoE layout, r={R} read at rank {rank}\)"):
        load_config(None, ["--data.seq_len=32", f"--model.path={base}", f"--lora.adapter={out}", "--lora.rank=3"],
                    adapter_lora_fields)
    model = shardfit_model(base)
    attach_adapter(model, out)  # generate --adapter; the engine's lora.adapter calls the same load_adapter
    with torch.no_grad():
        ours, want = model(IDS), reference_logits(base, tensors)
        assert _rel(ours, want) < 1e-5
        assert _rel(ours, hf_model(base)(input_ids=IDS).logits) > 1e-2  # the adapters count
    experts = model.model.layers[0].mlp.experts
    up = f"{PREFIX}model.layers.0.mlp.experts.2.up_proj.lora_"
    if "gate_proj" in modules:  # expert 2's fused adapter: [A_gate; A_up], B block-diagonal
        gate = f"{PREFIX}model.layers.0.mlp.experts.2.gate_proj.lora_"
        assert torch.equal(experts.gate_up_proj_lora_A[2], torch.cat([tensors[gate + "A.weight"],
                                                                      tensors[up + "A.weight"]]))
        b = torch.block_diag(tensors[gate + "B.weight"], tensors[up + "B.weight"])
        assert torch.equal(experts.gate_up_proj_lora_B[2], b)
        assert model.model.layers[0].self_attn.q_proj.lora_A[R:].abs().sum() == 0  # zero-padded to 2r
    elif "up_proj" in modules:  # up alone: rank r, the gate's rows of B zero
        assert torch.equal(experts.gate_up_proj_lora_A[2], tensors[up + "A.weight"])
        assert experts.gate_up_proj_lora_B[2, :I].abs().sum() == 0


def test_converted_adapter_exports_and_loads_back(base, tmp_path, monkeypatch):
    out = tmp_path / "adapter"
    tensors = write_v4_adapter(out, base, ALL)
    model = shardfit_model(base)
    targets = attach_adapter(model, out)
    bf16 = tmp_path / "bf16"  # PEFT saves a bf16 model's adapters in bf16: read, and widened to fp32
    shutil.copytree(out, bf16)
    save_file({k: v.bfloat16() for k, v in tensors.items()}, str(bf16 / ADAPTER_WEIGHTS))
    narrow = shardfit_model(base)
    attach_adapter(narrow, bf16)
    got = dict(narrow.named_parameters())
    assert all(torch.equal(got[n], p.bfloat16().float()) for n, p in model.named_parameters() if is_adapter(n))
    small = shardfit_model(base)
    monkeypatch.setattr(hf_load, "_PINNED_BYTES", 256)  # every tensor read in chunks, B's strided blocks included
    attach_adapter(small, out)
    monkeypatch.undo()
    got, want = dict(small.named_parameters()), dict(model.named_parameters())
    assert all(torch.equal(got[n], want[n]) for n in want)
    export_adapter(model, tmp_path / "saved", LoraConfig(**read_adapter_config(out)), targets, str(base))
    config = json.loads((tmp_path / "saved" / ADAPTER_CONFIG).read_text())
    assert (config["r"], config["lora_alpha"], config["lora_dropout"]) == (2 * R, 2 * ALPHA, 0.0)
    assert config["target_parameters"] == ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
    assert adapter_notices(tmp_path / "saved") == []  # transformers 5's layout now: read as any adapter
    again = shardfit_model(base)
    attach_adapter(again, tmp_path / "saved")
    with torch.no_grad():
        assert torch.equal(again(IDS), model(IDS))


def test_peft_on_transformers5_converts_it_alike(tmp_path):
    """PEFT 0.21 converts such an adapter itself on transformers 5 (rank 2r on gate_up_proj, through rank_pattern):
    its logits are shardfit's. A base without dense layers (PEFT takes a dense MLP's names for the experts') and
    no dropout (PEFT refuses it on the fused experts)."""
    peft = pytest.importorskip("peft")
    base = save_tiny("qwen3_moe", tmp_path, mlp_only_layers=[])
    out = tmp_path / "adapter"
    write_v4_adapter(out, base, ("q_proj", "gate_proj", "up_proj", "down_proj"), moe_layers=(0, 1), dropout=0.0)
    model = shardfit_model(base)
    attach_adapter(model, out)
    with torch.no_grad():
        theirs = peft.PeftModel.from_pretrained(hf_model(base), out)(input_ids=IDS).logits
        assert _rel(model(IDS), theirs) < 1e-5


def _load_and_step(rank, world, base, adapter, run_dir, extra):
    from shardfit.train import Trainer
    from tests.helpers import full_state

    t = Trainer(load_config(None, ["--data.seq_len=32", "--train.global_batch=8", "--train.micro_batch=4",
                                   "--logging.progress=none", "--train.steps=1", "--checkpoint.final=false",
                                   f"--model.path={base}", f"--lora.adapter={adapter}", *extra,
                                   f"--logging.run_dir={run_dir}"], adapter_lora_fields))
    loaded = {k: v.tolist() for k, v in full_state(t.model).items() if is_adapter(k)}  # every rank: collectives
    return {"adapters": loaded if rank == 0 else None, "losses": [h["loss"] for h in t.fit()],
            "notice": sum("a transformers-4 MoE adapter (per-expert keys, r=4) read exactly" in n for n in t.notices)}


@pytest.mark.parametrize("extra", [[], ["--parallel.expert_parallel=2"]], ids=["fsdp", "ep2"])
def test_two_ranks_read_their_rows_as_one_process_reads_all(base, tmp_path, extra):
    """lora.adapter on 2 gloo ranks: each reads its rows of the zero-padded adapters (rank 1's rows of every rank-2r
    A are all padding) and its experts' blocks (FSDP's dim-0 shards, or EP's experts); gathered, they are the
    adapters one process reads, and a step trains on them."""
    from tests._dist import run_ranks

    out = tmp_path / "adapter"
    write_v4_adapter(out, base, ALL)
    two = run_ranks(_load_and_step, 2, str(base), str(out), str(tmp_path / "run"), extra)
    one = shardfit_model(base)
    attach_adapter(one, out)
    want = {n: p for n, p in one.named_parameters() if n in two[0]["adapters"]}
    assert len(want) == len(two[0]["adapters"]) == 2 * (2 * 4 + 3 + 2)  # attention, the dense MLP, the experts
    for name, p in want.items():
        assert torch.equal(torch.tensor(two[0]["adapters"][name]), p), name
    assert [r["notice"] for r in two] == [1, 1] and two[0]["losses"] == two[1]["losses"]
    assert torch.isfinite(torch.tensor(two[0]["losses"])).all()


def _drop(tensors, key):
    del tensors[key]


def _rank_2_up(tensors):
    for k in [k for k in tensors if ".up_proj.lora_" in k and ".experts." in k]:
        tensors[k] = (tensors[k][:2] if k.endswith("lora_A.weight") else tensors[k][:, :2]).contiguous()


@pytest.mark.parametrize("change, needle", [
    (lambda t: _drop(t, f"{PREFIX}model.layers.0.mlp.experts.3.up_proj.lora_A.weight"),
     "'base_model.model.model.layers.0.mlp.experts.3.up_proj.lora_A.weight' is missing: a transformers-4 MoE"),
    (_rank_2_up, ".experts.0.up_proj.lora_A.weight' has shape [2, 64], up_proj's lora_A of rank r=4 is [4, 64]"),
    (lambda t: t.update({f"{PREFIX}model.layers.0.mlp.experts.4.down_proj.lora_A.weight": torch.zeros(R, I)}),
     "experts.4.down_proj.lora_A.weight' has no place in the model: no MoE layer of it has that expert"),
    (lambda t: t.update({f"{PREFIX}model.layers.0.mlp.gate.lora_A.weight": torch.zeros(R, 64)}),
     "mlp.gate.lora_A.weight' adapts an MoE router, which shardfit keeps frozen"),
])
def test_what_cannot_be_converted_exactly_is_one_line(base, tmp_path, change, needle):
    out = tmp_path / "adapter"
    tensors = write_v4_adapter(out, base, ALL)
    change(tensors)
    save_file(tensors, str(out / ADAPTER_WEIGHTS))
    with pytest.raises(ShardfitError) as e:
        attach_adapter(shardfit_model(base), out)
    assert needle in str(e.value) and "\n" not in str(e.value) and "fix:" in str(e.value)


def test_two_layouts_of_expert_adapters_in_one_file_are_refused(base, tmp_path):
    out = tmp_path / "adapter"
    write_v4_adapter(out, base, ALL)
    config = json.loads((out / ADAPTER_CONFIG).read_text())
    (out / ADAPTER_CONFIG).write_text(json.dumps({**config, "target_parameters": ["mlp.experts.down_proj"]}))
    with pytest.raises(ShardfitError, match="target_parameters and transformers 4's per-expert keys") as e:
        read_adapter_config(out)
    assert "\n" not in str(e.value) and ADAPTER_CONFIG in str(e.value)
