"""kernels/nf4_dequant.py: the Triton NF4 dequantisation equals adapters/nf4.py's dequantize bit for bit, on whole
tensors, ragged ends (a last group with few blocks, a weight count that is no multiple of a block or a tile) and a
shard's slice of groups; and QLoRA's operator uses it on CUDA.

On the CPU the kernel runs under Triton's interpreter where Triton imports (CI's CPU venv has none: skipped). The
interpreter rounds fp32 -> bf16 toward zero (Triton 3.9, interpreter.cast_impl) where the GPU rounds to nearest even:
there the bf16 case is checked against both roundings of the fp32 reference and fp32 and fp16 bit for bit; on CUDA
every dtype is bit for bit."""

import pytest
import torch

from shardfit.adapters.nf4 import (
    GROUP,
    NF4_LEVELS,
    dequantize,
    dequantize_kernel,
    kernel_dequantizes,
    n_groups,
    pad_to_groups,
    quantize,
)

DTYPES = (torch.bfloat16, torch.float16, torch.float32)
# numel: whole groups; a ragged last group (37 of its 256 blocks) with a partial block; fewer weights than a tile
# (4,096); a 2-D weight whose rows end inside a group (out x in = 96 x 3,000 = 17.6 groups)
NUMELS = [3 * GROUP, 2 * GROUP + 64 * 37 + 5, 111, 96 * 3000]


def _packed(numel: int, device: str = "cpu", seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(numel, generator=gen) * 0.02
    w[::997] *= 10  # outliers: absmaxes far apart, the double quantisation's scale exercised
    w[GROUP // 2:GROUP // 2 + 3 * 64] = 0  # all-zero blocks
    return tuple(t.to(device) for t in quantize(pad_to_groups(w, n_groups(numel))))


def _check(packed, numel: int, exact_bf16: bool) -> None:
    ref = dequantize(*[t.cpu() for t in packed], torch.float32)[:numel]  # the CPU's: the format's definition
    for dtype in DTYPES:
        got = dequantize_kernel(*packed, numel, dtype).cpu()
        assert got.shape == (numel,) and got.dtype == dtype
        if dtype != torch.bfloat16 or exact_bf16:
            assert torch.equal(got, ref.to(dtype)), dtype
        else:
            toward_zero = (ref.view(torch.int32) & ~0xFFFF).view(torch.float32).to(torch.bfloat16)
            assert bool(((got == ref.to(dtype)) | (got == toward_zero)).all())


def _shard_case(device: str, exact_bf16: bool) -> None:
    """A rank's groups [2, 5) of an 8-group weight (FSDP's dim-0 shard) dequantise as the same rows of the whole."""
    codes, absmax, stats = _packed(8 * GROUP, device, seed=1)
    whole = dequantize_kernel(codes, absmax, stats, 8 * GROUP, torch.float32)
    shard = tuple(t[2:5] for t in (codes, absmax, stats))
    assert torch.equal(dequantize_kernel(*shard, 3 * GROUP, torch.float32), whole[2 * GROUP:5 * GROUP])
    _check(shard, 3 * GROUP, exact_bf16)
    _check(shard, 2 * GROUP + 100, exact_bf16)  # its last group ragged


@pytest.fixture
def interpreted(monkeypatch):
    pytest.importorskip("triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # the kernel is made under it (a cache entry of its own)


@pytest.mark.parametrize("numel", NUMELS, ids=["3-groups", "ragged-group", "111", "96x3000"])
def test_interpreted_kernel_equals_the_reference(interpreted, numel):
    _check(_packed(numel), numel, exact_bf16=False)


def test_interpreted_kernel_on_a_shard_and_carried_storage(interpreted):
    _shard_case("cpu", exact_bf16=False)
    codes, absmax, stats = _packed(GROUP + 640)
    carried = tuple(t.view(torch.bfloat16) for t in (codes, absmax, stats))  # as the module stores them
    assert torch.equal(dequantize_kernel(*carried, GROUP + 640, torch.float32),
                       dequantize(codes, absmax, stats, torch.float32)[:GROUP + 640])


def test_interpreted_kernel_refuses_what_is_not_packed_nf4(interpreted):
    from shardfit.kernels.nf4_dequant import nf4_dequant

    codes, absmax, stats = _packed(GROUP)
    levels = torch.tensor(NF4_LEVELS)
    with pytest.raises(ValueError, match="not a packed NF4"):
        nf4_dequant(codes, absmax, stats.view(torch.float32), levels, GROUP + 1)  # more weights than stored
    with pytest.raises(TypeError):
        nf4_dequant(codes, absmax, stats, levels, GROUP)  # the stats' int32 bits, not their fp32 view
    assert not kernel_dequantizes(codes, torch.bfloat16)  # CPU tensors: the PyTorch path


@pytest.mark.cuda
@pytest.mark.parametrize("numel", NUMELS, ids=["3-groups", "ragged-group", "111", "96x3000"])
def test_cuda_kernel_equals_the_reference(numel):
    assert kernel_dequantizes(torch.empty(1, device="cuda"), torch.bfloat16)
    packed = _packed(numel, "cuda")
    _check(packed, numel, exact_bf16=True)
    # and the PyTorch path on the same GPU (eager)
    assert torch.equal(dequantize_kernel(*packed, numel, torch.bfloat16),
                       dequantize(*packed, torch.bfloat16)[:numel])


@pytest.mark.cuda
def test_cuda_kernel_on_a_shard_and_a_70b_sized_weight():
    _shard_case("cuda", exact_bf16=True)
    out, inn = 28672, 8192  # a Llama-3-70B gate/up weight: 14,336 groups, 57,344 programs
    gen = torch.Generator(device="cuda").manual_seed(0)
    w = torch.randn(out * inn, device="cuda", generator=gen) * 0.02
    packed = quantize(w)
    del w
    got = dequantize_kernel(*packed, out * inn, torch.bfloat16)
    assert torch.equal(got, dequantize(*packed, torch.bfloat16))


@pytest.mark.cuda
def test_cuda_operator_uses_the_kernel_in_forward_and_backward(monkeypatch):
    """shardfit::nf4_linear and its input gradient dequantise with the kernel on CUDA (eager and under
    torch.compile, where the operator is opaque), with the PyTorch path's results."""
    from shardfit.adapters import qlora

    calls = []
    kernel = qlora.dequantize_kernel
    monkeypatch.setattr(qlora, "dequantize_kernel", lambda *a: calls.append(a[3]) or kernel(*a))
    out, inn = 96, 3000
    packed = _packed(out * inn, "cuda")
    w = dequantize(*packed, torch.bfloat16)[:out * inn].view(out, inn)
    for fused in (False, True):
        def linear(x, fused=fused):
            return qlora.nf4_linear(x, *packed, out, inn, fused)

        f = torch.compile(linear, fullgraph=True) if fused else linear
        x = torch.randn(5, inn, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        y = f(x)
        y.float().square().sum().backward()
        dy = (2 * y.detach().float()).to(torch.bfloat16)  # the gradient that reached the operator
        assert torch.equal(y, torch.nn.functional.linear(x.detach(), w))
        assert torch.equal(x.grad, dy @ w)
    assert calls == [out * inn] * 4  # forward and input gradient, eager and compiled
