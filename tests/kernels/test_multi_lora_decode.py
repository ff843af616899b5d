"""The decode multi-LoRA kernel (kernels/multi_lora_decode.py) under Triton's interpreter against kernels/multi_lora.py:
N of 1, 3 and 64 tokens, in / out that are not multiples of the tiles, adapters of lower rank zero-padded in the
bank, slots of different scales and -1 (those rows bit for bit the base's, -0.0 included), one split or several
(uneven, one past `in`); a row's bits whatever shares the batch; sampling/lora_bank.py's BankedLinear through it at
decode and through the torch ops otherwise. On a GPU (cuda mark): bf16 against multi_lora's and a BankedLinear
captured in a CUDA graph."""

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
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            step()  # warm up: the kernels compiled outside the capture
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = step()
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
