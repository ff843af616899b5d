"""The FP8 base's tensor-core branch (adapters/fp8_base.py, mode "fp8": CUDA, compute capability >= 8.9, bf16) run
on the CPU: torch._scaled_mm replaced by a stand-in that refuses what PyTorch's refuses (aten/src/ATen/native/cuda/
ScaledBlas.cpp: cuBLASLt on an H100 multiplies a row-major mat1 by a column-major mat2 only; K and N multiples of 16;
row-wise scales fp32, [M, 1] and [1, N], contiguous; bf16 out) and otherwise computes the CPU's emulation. So the
operands the branch builds are checked for every input shape a model gives it (2-D, 3-D, no token, one token, strided
activations and gradients) with no GPU; tests/cuda/test_cuda_fp8_base.py runs the real kernel. And the quantiser it
compiles: one graph for the forward and one for the input gradient, whatever autograd's state."""

from __future__ import annotations

import types

import pytest
import torch
from torch._dynamo.testing import CompileCounter

import shardfit.adapters.fp8_base as fp8_base
from shardfit.adapters.quantized import to_dtype, to_quantized


def _scaled_mm(a, b, scale_a, scale_b, out_dtype=None, use_fast_accum=False):  # its accumulation: exact here
    (m, k), (k2, n) = a.shape, b.shape
    assert a.dtype == b.dtype == torch.float8_e4m3fn and k == k2 and k % 16 == 0 and n % 16 == 0
    assert a.stride(1) == 1 and (m < 2 or a.stride(0) >= k), f"mat1 must be row-major, strides {a.stride()}"
    assert b.stride(0) == 1 and (n < 2 or b.stride(1) >= k), f"mat2 must be column-major, strides {b.stride()}"
    assert scale_a.dtype == scale_b.dtype == torch.float32
    assert scale_a.shape == (m, 1) and scale_a.is_contiguous(), scale_a.shape
    assert scale_b.shape == (1, n) and scale_b.t().is_contiguous() and scale_b.stride(1) == 1, scale_b.shape
    assert out_dtype == torch.bfloat16
    return ((a.float() * scale_a) @ (b.float() * scale_b)).to(out_dtype)


@pytest.fixture
def tensor_cores(monkeypatch):
    """fp8_linear's tensor-core branch on the CPU; returns the compile counter of its quantiser (the eager backend:
    the graphs it would compile, without Inductor's minutes)."""
    counter = CompileCounter()
    fn = fp8_base.quantize_rows_fp8  # a copy of its code: torch._dynamo's cache of it starts empty in every test
    fresh = types.FunctionType(fn.__code__.replace(co_name="quantize_rows_fp8_counted"), fn.__globals__,
                               argdefs=fn.__defaults__)
    compiled = torch.compile(fresh, dynamic=True, backend=counter)
    monkeypatch.setattr(fp8_base, "_tensor_cores", lambda device: True)
    monkeypatch.setattr(fp8_base, "compiled_once", lambda fn, dynamic=False: compiled)
    monkeypatch.setattr(torch, "_scaled_mm", _scaled_mm)
    monkeypatch.setattr(fp8_base, "_mode", lambda x: "fp8" if x.dtype == torch.bfloat16 else "emulate")
    return counter


def _layer() -> fp8_base.FP8Linear:
    torch.manual_seed(0)
    return to_dtype(to_quantized(torch.nn.Linear(64, 32, bias=False), fp8_base.FP8Linear), torch.bfloat16)


X = {"2d": lambda: torch.randn(5, 64), "3d": lambda: torch.randn(2, 3, 64), "no token": lambda: torch.randn(0, 64),
     "one token": lambda: torch.randn(1, 1, 64), "transposed": lambda: torch.randn(64, 7).t(),
     "sliced": lambda: torch.randn(2, 5, 80)[..., 8:72]}


@pytest.mark.parametrize("x", X.values(), ids=X.keys())
def test_the_tensor_core_branch_gives_scaled_mm_its_layouts_and_the_emulations_numbers(tensor_cores, x):
    layer, x = _layer(), x().to(torch.bfloat16)
    dy = torch.randn(32, *x.shape[:-1]).to(torch.bfloat16).movedim(0, -1)  # a gradient in column-major strides
    got, want = {}, {}
    for out, branch in ((got, "fp8"), (want, "emulate")):
        fp8_base._mode = lambda t, b=branch: b  # the fixture's monkeypatch restores it
        xd = x.detach().requires_grad_(True)
        y = layer(xd)
        y.backward(dy)
        out.update(y=y, dx=xd.grad)
    assert got["y"].shape == (*x.shape[:-1], 32) and got["dx"].shape == x.shape
    for k in got:
        torch.testing.assert_close(got[k].float(), want[k].float(), rtol=1e-2, atol=1e-2, msg=k)


def test_the_quantiser_compiles_once_for_the_forward_and_once_for_the_input_gradient(tensor_cores):
    """Inside the operator, an input that requires grad and one that does not (the first block's), under no_grad
    or not, are one graph: not one each, which a run's shapes (no token, one token) would multiply past
    torch._dynamo's recompile limit, to eager quantisation."""
    layer = _layer()
    for m, grad in ((6, True), (9, True), (6, False), (12, False)):
        x = torch.randn(m, 64, dtype=torch.bfloat16, requires_grad=grad)
        y = layer(x)
        if grad:
            y.float().sum().backward()
    with torch.no_grad():
        layer(torch.randn(7, 64, dtype=torch.bfloat16))
    assert tensor_cores.frame_count == 2


@pytest.mark.parametrize("branch", ["fp8", "emulate"])
def test_the_operators_pass_opcheck(tensor_cores, branch):
    """Schema, fake kernels (3-D and empty inputs), autograd registration and AOT dispatch of both operators."""
    fp8_base._mode = lambda t: branch  # the fixture's monkeypatch restores it
    layer = _layer()
    storage = (layer.weight_fp8, layer.weight_scale, 32, 64)
    for lead in ((5,), (2, 3), (0,)):
        for grad in (True, False):
            x = torch.randn(*lead, 64, dtype=torch.bfloat16, requires_grad=grad)
            torch.library.opcheck(fp8_base.fp8_linear, (x, *storage))
        dy = torch.randn(*lead, 32, dtype=torch.bfloat16)
        torch.library.opcheck(fp8_base.fp8_linear_input_grad, (dy, *storage))
