"""sampling/lora_bank.py and sampling/source.py: the Engine's decode model with a bank of adapters.

- rows of 3 adapter versions and the base in one batch: each row's logits are the FSDP Engine's forward with that
  version in the registry's slot, on the same tokens (fp32, tight tolerance), every adapted kind (linear layers, the
  embedding, the head);
- on one rank the decode model views the Engine's storage (no copy); a cast one is a copy that refresh updates in
  place after a step; a freed slot adds exactly nothing;
- an MoE model's decode model (its experts and balancing biases as they are) gives the Engine's logits, with LoRA on
  its attention, on its experts (both projections, or down_proj alone) banked;
- at decode (the Triton kernel, interpreted) the logits are the torch ops'; q|k|v and gate|up share one shrink a
  layer (counted) and give the ungrouped path's bits, in a bank made anew at a rank above the adapters';
- refusals are one line: a load of the wrong rank or shape, an unknown target, a target of another kind.
"""

from __future__ import annotations

import pytest
import torch

from shardfit.errors import ShardfitError
from tests.helpers import SMALL, random_datums

ARGS = [*SMALL, "--train.device=cpu", "--train.micro_batch_tokens=32", "--logging.run_dir=", "--lora.rank=4",
        "--lora.targets=all-linear,embed_tokens,lm_head"]


def _data(seed, n=3):
    return random_datums(seed, n)


def _train(engine, seed):
    from shardfit.rl import AdamParams

    engine.forward_backward(_data(seed), "cross_entropy")
    engine.optim_step(AdamParams(learning_rate=2e-2))


@pytest.fixture(scope="module")
def trained():
    """An Engine with two frozen versions behind its live model (each after one more step)."""
    from shardfit.config import load_config
    from shardfit.rl import DatumEngine

    e = DatumEngine.start(load_config(None, ARGS))
    versions = []
    for seed in (1, 2, 3):
        _train(e, seed)
        versions.append(e.freeze())
    _train(e, 4)
    return e, versions[:2]


@torch.no_grad()
def _engine_logits(engine, model, ids):
    engine.using(model)
    engine.finish()
    return engine.model(ids).float()  # [B, S, V] through the FSDP root


def test_rows_of_three_versions_and_the_base_each_get_their_own_logits(trained):
    from shardfit.engine.registry import BASE
    from shardfit.sampling.source import adapter_scale, adapter_tensors, decode_model

    e, (v1, v2) = trained
    e.finish()
    plain, bank, live = decode_model(e.model, torch.float32, capacity=4)
    assert set(bank.targets) == set(e.lora_targets)  # every adapted module banked: linears, embedding, head
    scale = adapter_scale(e.model)
    bank.load(2, live, scale)  # the live model's adapters, read with it in the slot
    for slot, vid in ((0, v1), (1, v2)):
        e.using(vid)
        bank.load(slot, adapter_tensors(e.model), scale)
    e.using("default")
    ids = torch.randint(0, 256, (4, 9), generator=torch.Generator().manual_seed(0))
    rows = torch.tensor([1, -1, 2, 0])  # v2, the base, the live model, v1: one batch
    bank.set_rows(rows[:, None].expand(-1, ids.shape[1]))
    got = plain(ids).float()
    for r, model in enumerate((v2, BASE, "default", v1)):
        want = _engine_logits(e, model, ids[r:r + 1])[0]
        torch.testing.assert_close(got[r], want, rtol=1e-5, atol=1e-5)
    # the versions differ from each other (else the test proves nothing)
    assert (got[0] - got[3]).abs().max() > 1e-3 and (got[2] - got[1]).abs().max() > 1e-3
    # the head called apart on each row's last position, told its rows in that shape (as the sampler does)
    h = plain.model(ids)
    bank.set_rows(rows[:, None])
    torch.testing.assert_close(plain.lm_head(h[:, -1]), got[:, -1], rtol=1e-5, atol=1e-5)
    with pytest.raises(RuntimeError, match="set_rows"):  # told another shape: refused, never the wrong rows
        plain.lm_head(h)
    e.using("default")


def _count_launches(monkeypatch, lb) -> dict:
    """Wraps lora_bank's kernel entry points: {"shrink": launches, "expand": launches} as they run."""
    n = {"shrink": 0, "expand": 0}

    def counted(fn, kinds):
        def call(*a, **k):
            for kind in kinds:
                n[kind] += 1
            return fn(*a, **k)
        return call

    for name, kinds in (("multi_lora_decode_", ("shrink", "expand")), ("lora_shrink", ("shrink",)),
                        ("lora_expand_", ("expand",))):
        monkeypatch.setattr(lb, name, counted(getattr(lb, name), kinds))
    return n


def test_the_decode_kernel_gives_the_torch_paths_logits(trained, monkeypatch):
    """Every banked linear and the head through kernels/multi_lora_decode.py (Triton's interpreter, no autograd, as
    a decode step runs them) against multi_lora's torch ops: rows of two versions and the base in one batch."""
    pytest.importorskip("triton")
    import shardfit.sampling.lora_bank as lb
    from shardfit.sampling.source import adapter_scale, adapter_tensors, decode_model

    e, (v1, _) = trained
    e.finish()
    plain, bank, live = decode_model(e.model, torch.float32, capacity=2)
    bank.load(1, live, adapter_scale(e.model))
    e.using(v1)
    bank.load(0, adapter_tensors(e.model), adapter_scale(e.model))
    e.using("default")
    ids = torch.randint(0, 256, (3, 4), generator=torch.Generator().manual_seed(5))
    bank.set_rows(torch.tensor([[1], [-1], [0]]).expand(-1, 4))
    n = _count_launches(monkeypatch, lb)
    with torch.no_grad():
        want = plain(ids)
        monkeypatch.setenv("TRITON_INTERPRET", "1")
        got = plain(ids)
    n_linear = sum(isinstance(m, (lb.BankedLinear, lb.BankedOutputHead)) for m in plain.modules())
    assert n["expand"] == n_linear > 1
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_sibling_groups_share_one_shrink_and_give_the_ungrouped_bits(trained, monkeypatch):
    """q|k|v and gate|up of every layer share one shrink launch (4 shrinks a layer for 7 banked linears, 7 expands),
    and the logits are the ungrouped path's bit for bit (fp32, the interpreter): a bank of rank 8 holding rank-4
    adapters in 3 slots (S*R = 24: column tiles of 16 would straddle two members), rows of 3 versions and the base."""
    pytest.importorskip("triton")
    import shardfit.sampling.lora_bank as lb
    from shardfit.sampling.source import adapter_scale, adapter_tensors, decode_model

    monkeypatch.setattr(lb, "GROUP_SIBLINGS", True)
    e, (v1, v2) = trained
    e.finish()
    plain, _, live = decode_model(e.model, torch.float32, capacity=2)
    bank = lb.LoRABank(plain, list(live), 3, 8, torch.float32, torch.device("cpu"))  # anew, as Engine.sample grows
    scale = adapter_scale(e.model)
    bank.load(2, live, scale)
    for slot, vid in ((0, v1), (1, v2)):
        e.using(vid)
        bank.load(slot, adapter_tensors(e.model), scale)
    e.using("default")
    layers = len(plain.model.layers)
    assert len(bank.groups) == 2 * layers and all(g.a.shape[0] == len(g.members) * 24 for g in bank.groups)
    q = plain.model.layers[0].self_attn.q_proj
    assert q.bank_A.data_ptr() == q.lora_group.a.data_ptr()  # a view of the stacked rows: load wrote through it
    ids = torch.randint(0, 256, (4, 3), generator=torch.Generator().manual_seed(6))
    bank.set_rows(torch.tensor([[2], [-1], [0], [1]]).expand(-1, 3))
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    n = _count_launches(monkeypatch, lb)
    with torch.no_grad():
        got = plain(ids)
        assert n == {"shrink": 4 * layers + 1, "expand": 7 * layers + 1}  # + the head
        assert all(g._x is None for g in bank.groups)  # the last member dropped what the first kept
        monkeypatch.setattr(lb, "GROUP_SIBLINGS", False)
        want = plain(ids)
        assert n == {"shrink": 4 * layers + 1 + 7 * layers + 1, "expand": 2 * (7 * layers + 1)}
        monkeypatch.delenv("TRITON_INTERPRET")
        torch_ops = plain(ids)
    assert torch.equal(got, want)
    torch.testing.assert_close(got, torch_ops, rtol=1e-5, atol=1e-5)
    assert min((got[r] - got[1]).abs().max() for r in (0, 2, 3)) > 1e-3  # every version moved its row


def test_one_rank_decode_model_views_the_engines_storage_and_a_freed_slot_adds_nothing(trained):
    from shardfit.parallel.dtensor import local_tensor
    from shardfit.sampling.source import adapter_scale, decode_model, gathers

    e, _ = trained
    e.finish()
    plain, bank, live = decode_model(e.model, torch.float32, capacity=2)
    assert not gathers(e.model, torch.float32)
    w = dict(e.model.named_parameters())["model.layers.0.self_attn.q_proj.weight"]
    assert plain.model.layers[0].self_attn.q_proj.weight.data_ptr() == local_tensor(w).data_ptr()
    ids = torch.randint(0, 256, (2, 5), generator=torch.Generator().manual_seed(1))
    bank.set_rows(torch.full((2, 5), -1))
    base = plain(ids)
    bank.load(1, live, adapter_scale(e.model))
    bank.set_rows(torch.ones(2, 5, dtype=torch.long))
    assert not torch.equal(plain(ids), base)
    bank.free(1)
    assert torch.equal(plain(ids), base)


def test_refusals_are_one_line(trained):
    from shardfit.sampling.lora_bank import LoRABank
    from shardfit.sampling.source import decode_model

    e, _ = trained
    _, bank, live = decode_model(e.model, torch.float32, capacity=2)
    name = "model.layers.0.self_attn.q_proj"
    a, b = live[name]
    with pytest.raises(ShardfitError, match="rank <= 4") as err:
        bank.load(0, {name: (torch.cat([a, a]), torch.cat([b, b], 1))}, 1.0)
    assert err.value.where == name
    with pytest.raises(ShardfitError, match="does not hold"):
        bank.load(0, {"model.layers.0.mlp.experts.down_proj": (a, b)}, 1.0)
    k = "model.layers.0.self_attn.k_proj"  # [32, 64]: B [32, r] where A [r, 64] belongs
    with pytest.raises(ShardfitError, match="does not fit") as err:
        bank.load(0, {k: (live[k][1], live[k][0])}, 1.0)
    assert err.value.where == k
    plain = decode_model(e.model, torch.float32)[0]
    with pytest.raises(ShardfitError, match="no such module") as err:  # a dense model's
        LoRABank(plain, ["model.layers.1.mlp.experts.gate_up_proj"], 2, 4, torch.float32, torch.device("cpu"))
    assert err.value.where == "lora.targets" and "\n" not in str(err.value)
    with pytest.raises(ShardfitError, match="cannot hold a bank") as err:
        LoRABank(plain, ["model.layers.1.input_layernorm"], 2, 4, torch.float32, torch.device("cpu"))


@pytest.mark.parametrize("targets", ["all-linear", "q_proj,experts", "experts.down_proj"])
def test_an_moe_models_decode_model_gives_the_engines_logits(targets):
    """Routed experts (and their balancing biases, buffers) come over as they are; LoRA on the experts banked too:
    rows of the live adapters and of the base in one batch each get the Engine's logits."""
    from shardfit.config import load_config
    from shardfit.engine.registry import BASE
    from shardfit.rl import DatumEngine
    from shardfit.sampling.source import adapter_scale, decode_model

    moe = ["--model.n_experts=4", "--model.experts_per_token=2", "--model.moe_ffn_dim=32"]
    e = DatumEngine.start(load_config(None, [*ARGS[:-1], f"--lora.targets={targets}", *moe]))
    _train(e, 1)
    e.finish()
    plain, bank, live = decode_model(e.model, torch.float32, capacity=2)
    assert set(bank.targets) == set(e.lora_targets) and not any("mlp.gate" in n for n in bank.targets)  # router
    bank.load(1, live, adapter_scale(e.model))
    bank.set_rows(torch.tensor([[1], [-1]]).expand(-1, 7))
    ids = torch.randint(0, 256, (2, 7), generator=torch.Generator().manual_seed(3))
    alone = plain(ids).float()[0]
    bank.free(1)
    bank.load(0, live, adapter_scale(e.model))
    bank.set_rows(torch.tensor([[0], [-1]]).expand(-1, 7))
    got = plain(ids).float()
    torch.testing.assert_close(got[0], _engine_logits(e, "default", ids[:1])[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got[1], _engine_logits(e, BASE, ids[1:])[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got[0], alone, rtol=1e-5, atol=1e-5)  # slot 1 then slot 0: the same adapter
    assert (got[0] - got[1]).abs().max() > 1e-3  # the adapters moved the logits


def test_a_cast_decode_model_is_a_copy_refreshed_in_place_after_a_step():
    """Full-parameter weights decoded in another dtype (fp32 masters, bf16 decode) are a copy: stale after a step
    until refresh copies the new values into the same tensors (a sampler's CUDA graphs keep their addresses)."""
    from shardfit.config import load_config
    from shardfit.parallel.dtensor import local_tensor
    from shardfit.rl import DatumEngine
    from shardfit.sampling.source import decode_model, gathers, refresh

    e = DatumEngine.start(load_config(None, [a for a in ARGS if not a.startswith("--lora")]))
    plain, bank, live = decode_model(e.model, torch.bfloat16)
    assert bank is None and live is None and gathers(e.model, torch.bfloat16)
    w = plain.model.layers[0].mlp.up_proj.weight
    src = local_tensor(dict(e.model.named_parameters())["model.layers.0.mlp.up_proj.weight"])
    ptr, before = w.data_ptr(), w.clone()
    assert w.dtype == torch.bfloat16 and torch.equal(w, src.to(torch.bfloat16))
    _train(e, 1)
    e.finish()
    assert torch.equal(w, before)  # a copy: the step did not reach it
    refresh(plain, e.model)
    assert w.data_ptr() == ptr and torch.equal(w, src.to(torch.bfloat16)) and not torch.equal(w, before)


def test_a_decode_model_that_does_not_fit_is_one_line_with_the_arithmetic(trained, monkeypatch):
    """On CUDA, what decode_model would copy (here: every weight cast to bf16) against 90% of the free memory."""
    from shardfit.sampling import source

    e, _ = trained
    params = source._base_params(e.model)
    n = sum(p.numel() for _, p in params)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (n, 10 * n))  # room for half of n x 2 bytes
    with pytest.raises(ShardfitError, match=f"{n:,} parameters x 2 bytes") as err:
        source._check_room(params, torch.bfloat16, torch.device("cuda"))
    assert err.value.where == "Engine.sample" and "\n" not in str(err.value)
    source._check_room(params, torch.float32, torch.device("cuda"))  # views on one rank: nothing to fit
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (4 * n, 10 * n))
    source._check_room(params, torch.bfloat16, torch.device("cuda"))  # 2n bytes within 90% of 4n
