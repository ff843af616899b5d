"""The decode multi-LoRA kernel (kernels/multi_lora_decode.py) under Triton's interpreter against kernels/multi_lora.py:
N of 1, 3 and 64 tokens, in / out that are not multiples of the tiles, adapters of lower rank zero-padded in the
bank, slots of different scales and -1 (those rows bit for bit the base's, -0.0 included), one split or several
(uneven, one past `in`); a row's bits whatever shares the batch; sampling/lora_bank.py's BankedLinear through it at
decode and through the torch ops otherwise; one shrink over stacked banks (lora_shrink's members) and an expand at a
column offset give each member's own bits; a sibling group's reuse, and its recomputation for another or rewritten
input or bank. On a GPU (cuda mark): bf16 against multi_lora's, a BankedLinear and a sibling group captured in a CUDA
graph."""

import pytest
import torch
from torch import nn

from shardfit.kernels.multi_lora import multi_lora, slot_columns, stack_bank

S, R, IN, OUT = 3, 8, 100, 70  # in / out: not multiples of the kernel's 64 / 128 tiles
RANKS = (8, 4, 2)  # slot s's adapter rank: zero-padded to R in the bank
SCALES = torch.tensor([2.0, 0.5, 4.0])


@pytest.fixture
def interpreted(monkeypatch):
    pytest.importorskip("triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")


def _adapters(g, in_f=IN, out_f=OUT):
    """{slot: (A_s [r, in], B_s [out, r])} of ranks RANKS."""
    return {s: (torch.randn(r, in_f, generator=g), torch.randn(out_f, r, generator=g)) for s, r in enumerate(RANKS)}


def _case(n, seed=0, in_f=IN, out_f=OUT):
    """x [n, in], the stacked bank (A_all [S*R, in], B_all [S*R, out]) and slots [n] cycling through 0, -1, 1, 2."""
    g = torch.Generator().manual_seed(seed)
    a, b = torch.zeros(S, R, in_f), torch.zeros(S, out_f, R)
    for s, (a_s, b_s) in _adapters(g, in_f, out_f).items():
        a[s, :a_s.shape[0]], b[s, :, :b_s.shape[1]] = a_s, b_s
    x = torch.randn(n, in_f, generator=g)
    slot = torch.tensor([0, -1, 1, 2])[torch.arange(n) % 4]
    return x, *stack_bank(a, b), slot


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int32)  # fp32's bits: -0.0 and +0.0 differ


@pytest.mark.parametrize("n", [1, 3, 64])
@pytest.mark.parametrize("splits", [None, 1, 3])
def test_kernel_adds_multi_loras_delta_in_place(interpreted, n, splits):
    from shardfit.kernels.multi_lora_decode import multi_lora_decode_

    x, a_all, b_all, slot = _case(n)
    cols = slot_columns(slot, SCALES, R)
    out = torch.randn(n, OUT, generator=torch.Generator().manual_seed(9))
    out[slot < 0, :5] = -0.0  # the base's -0.0 stays -0.0 (out + 0 would make it +0.0)
    base = out.clone()
    got = multi_lora_decode_(out, x, a_all, b_all, cols, splits=splits)
    assert got is out
    torch.testing.assert_close(out, base + multi_lora(x, a_all, b_all, cols), rtol=1e-5, atol=1e-4)
    assert torch.equal(_bits(out[slot < 0]), _bits(base[slot < 0]))
    if n > 1:
        assert (out[slot >= 0] - base[slot >= 0]).abs().min() > 0  # adapted rows moved (else nothing is shown)


def test_a_rows_bits_do_not_depend_on_what_shares_the_batch(interpreted):
    """Row 2 alone, in a batch of 3 and in a batch of 20 (another row tile, other neighbours): the same bits."""
    from shardfit.kernels.multi_lora_decode import multi_lora_decode_

    x, a_all, b_all, slot = _case(20, seed=3)
    cols = slot_columns(slot, SCALES, R)
    out = torch.randn(20, OUT, generator=torch.Generator().manual_seed(4))
    runs = []
    for rows in (slice(2, 3), slice(0, 3), slice(0, 20)):
        o = out[rows].clone()
        multi_lora_decode_(o, x[rows], a_all, b_all, cols[rows].contiguous())
        runs.append(o[2 - (rows.start or 0)])
    assert torch.equal(_bits(runs[0]), _bits(runs[1])) and torch.equal(_bits(runs[0]), _bits(runs[2]))


def test_splits_past_in_write_zeros_and_agree(interpreted):
    """Splits of 64 wide over in = 100: two splits hold it, the rest are past it and must add nothing."""
    from shardfit.kernels.multi_lora_decode import multi_lora_decode_

    x, a_all, b_all, slot = _case(5, seed=5)
    cols = slot_columns(slot, SCALES, R)
    one, many = torch.zeros(5, OUT), torch.zeros(5, OUT)
    multi_lora_decode_(one, x, a_all, b_all, cols, splits=1)
    multi_lora_decode_(many, x, a_all, b_all, cols, splits=6)
    torch.testing.assert_close(many, one, rtol=1e-5, atol=1e-4)


def test_refuses_shapes_it_does_not_read(interpreted):
    from shardfit.kernels.multi_lora_decode import multi_lora_decode_

    x, a_all, b_all, slot = _case(4)
    cols = slot_columns(slot, SCALES, R)
    with pytest.raises(ValueError, match="do not fit"):
        multi_lora_decode_(torch.zeros(4, OUT + 1), x, a_all, b_all, cols)
    with pytest.raises(ValueError, match="do not fit"):
        multi_lora_decode_(torch.zeros(OUT, 4).t(), x, a_all, b_all, cols)  # out's columns strided


def test_a_shared_shrink_and_offset_expands_give_each_members_own_bits(interpreted):
    """Three banks stacked [3*S*R, in] (S*R = 24: a member's column tiles of 16 kept apart), one lora_shrink, each
    member's lora_expand_ at its offset: multi_lora_decode_'s bits for that member alone."""
    from shardfit.kernels.multi_lora_decode import lora_expand_, lora_shrink, multi_lora_decode_

    x, _, _, slot = _case(7, seed=10)
    cols = slot_columns(slot, SCALES, R)
    banks = [_case(1, seed=11 + m, out_f=o)[1:3] for m, o in enumerate((70, 30, 130))]  # (A_all, B_all) each
    part = lora_shrink(x, torch.cat([a for a, _ in banks]), members=3)
    assert part.shape == (1, 7, 3 * S * R)  # plan_splits of one member's S*R: in = 100 is one split
    base = torch.randn(7, 130, generator=torch.Generator().manual_seed(12))
    for m, (a_all, b_all) in enumerate(banks):
        o = b_all.shape[1]
        alone = multi_lora_decode_(base[:, :o].clone(), x, a_all, b_all, cols)
        shared = lora_expand_(base[:, :o].clone(), part, b_all, cols, offset=m * S * R)
        assert torch.equal(_bits(shared), _bits(alone)) and not torch.equal(shared, base[:, :o])
    with pytest.raises(ValueError, match="do not fit"):
        lora_expand_(base[:, :70].clone(), part, banks[0][1], cols, offset=2 * S * R + 1)  # past part's width


def _logged(fn, name: str, log: list):
    return lambda *a, **k: log.append(name) or fn(*a, **k)


class _Siblings(nn.Module):
    """q|k|v of different widths reading one x (lora_bank's SIBLINGS, at the root)."""

    def __init__(self, in_f=IN, outs=(OUT, 30, 30)):
        super().__init__()
        self.q_proj, self.k_proj, self.v_proj = (nn.Linear(in_f, o) for o in outs)


def _banked_siblings(g, dtype=torch.float32, device="cpu", in_f=IN, outs=(OUT, 30, 30)):
    from shardfit.sampling.lora_bank import LoRABank

    model = _Siblings(in_f, outs).to(device=device, dtype=dtype)
    names = ["q_proj", "k_proj", "v_proj"]
    bank = LoRABank(model, names, S, R, dtype, torch.device(device))
    per = [_adapters(g, in_f, o) for o in outs]
    for s in range(S):
        bank.load(s, {n: per[i][s] for i, n in enumerate(names)}, float(SCALES[s]))
    return model, bank


def test_siblings_share_the_first_ones_shrink_only_for_the_same_unwritten_input(interpreted, monkeypatch):
    import shardfit.sampling.lora_bank as lb

    monkeypatch.setattr(lb, "GROUP_SIBLINGS", True)
    import shardfit.sampling.lora_bank as lb

    model, bank = _banked_siblings(torch.Generator().manual_seed(13))
    shrinks = []
    for name in ("lora_shrink", "multi_lora_decode_"):
        monkeypatch.setattr(lb, name, _logged(getattr(lb, name), name, shrinks))
    g = torch.Generator().manual_seed(14)
    x, y = torch.randn(2, 3, IN, generator=g), torch.randn(2, 3, IN, generator=g)
    bank.set_rows(torch.tensor([[0, -1, 1], [2, 1, -1]]))
    mods = (model.q_proj, model.k_proj, model.v_proj)

    def alone(mod, t):  # the ungrouped path's output
        monkeypatch.setattr(lb, "GROUP_SIBLINGS", False)
        try:
            return mod(t)
        finally:
            monkeypatch.setattr(lb, "GROUP_SIBLINGS", True)

    with torch.no_grad():
        got = [m(x) for m in mods]
        assert shrinks == ["lora_shrink"] and model.q_proj.lora_group._x is None  # one shrink; v dropped it
        want = [alone(m, x) for m in mods]
        assert all(torch.equal(_bits(a), _bits(b)) for a, b in zip(got, want))
        shrinks.clear()
        model.q_proj(x)
        assert torch.equal(model.k_proj(y), alone(model.k_proj, y))  # another x: its own shrink
        x.add_(1.0)  # the same object, rewritten: recomputed, not the stale partials
        assert torch.equal(model.v_proj(x), alone(model.v_proj, x))
        model.q_proj(x)
        bank.free(1)  # the bank rewritten between two siblings: recomputed
        assert torch.equal(model.k_proj(x), alone(model.k_proj, x))
    own = ["multi_lora_decode_"] * 2  # the sibling's own shrink, then alone's
    assert shrinks == ["lora_shrink", *own, *own, "lora_shrink", *own]


class _Tiny(nn.Module):
    def __init__(self, in_f=IN, out_f=OUT):
        super().__init__()
        self.proj = nn.Linear(in_f, out_f)


def _banked(g, dtype=torch.float32, device="cpu", in_f=IN, out_f=OUT):
    """A _Tiny whose proj is banked with S slots of adapters (RANKS, SCALES)."""
    from shardfit.sampling.lora_bank import LoRABank

    model = _Tiny(in_f, out_f).to(device=device, dtype=dtype)
    bank = LoRABank(model, ["proj"], S, R, dtype, torch.device(device))
    for s, (a_s, b_s) in _adapters(g, in_f, out_f).items():
        bank.load(s, {"proj": (a_s, b_s)}, float(SCALES[s]))
    return model, bank


def test_banked_linear_decodes_through_the_kernel_and_prefills_through_torch(interpreted, monkeypatch):
    import shardfit.sampling.lora_bank as lb
    from shardfit.kernels.multi_lora_decode import MAX_TOKENS

    g = torch.Generator().manual_seed(6)
    model, bank = _banked(g)
    calls = []
    kernel = lb.multi_lora_decode_
    monkeypatch.setattr(lb, "multi_lora_decode_", lambda *a, **k: calls.append(a[1].shape[0]) or kernel(*a, **k))
    x = torch.randn(2, 3, IN, generator=g)
    slots = torch.tensor([[0, 1, -1], [2, -1, 0]])
    bank.set_rows(slots)
    with torch.no_grad():
        got = model.proj(x)
        monkeypatch.delenv("TRITON_INTERPRET")  # the CPU without the interpreter: the torch path
        want = model.proj(x)
    assert calls == [6]
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4)
    base = nn.functional.linear(x, model.proj.weight, model.proj.bias)
    assert torch.equal(got[slots < 0], base[slots < 0])
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    bank.set_rows(torch.zeros(1, MAX_TOKENS + 1, dtype=torch.long))  # a prefill chunk: the torch path
    with torch.no_grad():
        model.proj(torch.randn(1, MAX_TOKENS + 1, IN, generator=g))
    bank.set_rows(slots)
    model.proj(x)  # autograd on: the torch path (the kernel writes in place)
    assert calls == [6]


@pytest.mark.cuda
@pytest.mark.parametrize("n", [1, 64, 256])
def test_cuda_bf16_kernel_equals_multi_lora_at_the_8b_shape(n):
    """bf16 on the GPU, Qwen3-8B's q_proj (4096 x 4096) and down_proj (12288 -> 4096), 4 slots of rank 16 with -1
    rows: within bf16's rounding of multi_lora's, the -1 rows the base's bits, the same bits run to run and for a row
    alone."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from shardfit.kernels.multi_lora_decode import multi_lora_decode_

    g = torch.Generator().manual_seed(7)
    for in_f, out_f in ((4096, 4096), (12288, 4096)):
        a_all = (torch.randn(64, in_f, generator=g) / 64).to("cuda", torch.bfloat16)
        b_all = (torch.randn(64, out_f, generator=g) / 8).to("cuda", torch.bfloat16)
        x = torch.randn(n, in_f, generator=g).to("cuda", torch.bfloat16)
        slot = (torch.arange(n) % 5 - 1).cuda()  # -1, 0, 1, 2, 3
        cols = slot_columns(slot, torch.tensor([2.0, 0.5, 1.0, 4.0], device="cuda", dtype=torch.bfloat16), 16)
        base = torch.randn(n, out_f, generator=g).to("cuda", torch.bfloat16)
        want = base + multi_lora(x, a_all, b_all, cols)
        got = multi_lora_decode_(base.clone(), x, a_all, b_all, cols)
        torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=5e-2)
        assert torch.equal(got[slot < 0], base[slot < 0])
        assert torch.equal(multi_lora_decode_(base.clone(), x, a_all, b_all, cols), got)
        last = n - 1  # the same bits alone as in the batch (another N: other specialisations, other row tiles)
        alone = multi_lora_decode_(base[last:].clone(), x[last:], a_all, b_all, cols[last:].contiguous())
        assert torch.equal(alone[0], got[last])


def _captured(step):
    """step() run once on a side stream (its kernels compiled outside the capture), then captured: (graph, the
    captured call's outputs). Under the caller's no_grad."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    return graph, out


@pytest.mark.cuda
def test_cuda_banked_linear_captured_in_a_graph_replays_new_rows():
    """BankedLinear (bf16, the kernel path) with set_rows inside a CUDA graph, as the sampler's decode step: replays
    with new inputs and slots give the eager torch path's outputs."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    import shardfit.sampling.lora_bank as lb

    g = torch.Generator().manual_seed(8)
    model, bank = _banked(g, torch.bfloat16, "cuda", 4096, 1024)
    x = torch.zeros(64, 4096, dtype=torch.bfloat16, device="cuda")
    slots = torch.zeros(64, 1, dtype=torch.long, device="cuda")

    def step():
        bank.set_rows(slots)
        return model.proj(x)

    with torch.no_grad():
        graph, out = _captured(step)
        for seed in (1, 2):
            gg = torch.Generator().manual_seed(seed)
            x.copy_(torch.randn(64, 4096, generator=gg))
            slots.copy_(torch.randint(-1, S, (64, 1), generator=gg))
            graph.replay()
            bank.set_rows(slots)
            want = lb.multi_lora(x, model.proj.bank_A, model.proj.bank_B, bank.columns(64)).to(torch.bfloat16)
            want = want + nn.functional.linear(x, model.proj.weight, model.proj.bias)
            # randn adapters: deltas of ~10^3, where one bf16 rounding of h moves an output by ~1: tolerance by scale
            tol = 2e-2 * want.abs().max().item()
            torch.testing.assert_close(out.float(), want.float(), rtol=0, atol=tol)
            assert (out - nn.functional.linear(x, model.proj.weight, model.proj.bias)).abs().max() > tol  # adapted


@pytest.mark.cuda
def test_cuda_sibling_group_captured_in_a_graph_replays_the_ungrouped_bits(monkeypatch):
    """q|k|v banked (bf16, the kernel path) with set_rows inside a CUDA graph: one shrink captured for the three;
    replays with new inputs and slots give the ungrouped eager kernel path's bits."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    import shardfit.sampling.lora_bank as lb

    monkeypatch.setattr(lb, "GROUP_SIBLINGS", True)
    outs = (4096, 1024, 1024)
    model, bank = _banked_siblings(torch.Generator().manual_seed(15), torch.bfloat16, "cuda", 4096, outs)
    x = torch.zeros(64, 4096, dtype=torch.bfloat16, device="cuda")
    slots = torch.zeros(64, 1, dtype=torch.long, device="cuda")
    mods = (model.q_proj, model.k_proj, model.v_proj)

    def step():
        bank.set_rows(slots)
        return [m(x) for m in mods]

    with torch.no_grad():
        graph, outs_g = _captured(step)
        assert model.q_proj.lora_group._x is None  # nothing of the capture kept
        for seed in (1, 2):
            gg = torch.Generator().manual_seed(seed)
            x.copy_(torch.randn(64, 4096, generator=gg))
            slots.copy_(torch.randint(-1, S, (64, 1), generator=gg))
            graph.replay()
            lb.GROUP_SIBLINGS = False
            try:
                want = step()
            finally:
                lb.GROUP_SIBLINGS = True
            for got, w, m in zip(outs_g, want, mods):
                assert torch.equal(got, w)
                assert (got - nn.functional.linear(x, m.weight, m.bias)).abs().max() > 0  # adapted
