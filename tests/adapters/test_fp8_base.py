"""The FP8 base (model.quantize=fp8, adapters/fp8_base.py), one process: the format (a scale per row, every row
alone, e4m3's rounding and no worse), the matmul's numerics against the arithmetic it stands for and against the
unquantised layer, backward's input gradient and what it saves, the storage in place of the weight, the merge, a
bit-preserving dtype change, and the config's refusals. Training on 1 and 2 ranks: test_fp8_base_training.py."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from shardfit.adapters.fp8_base import E4M3, FP8Linear, dequantize_fp8, quantize_rows_fp8
from shardfit.adapters.lora import apply_lora, is_adapter
from shardfit.adapters.quantized import apply_quantized, is_storage, to_dtype, to_quantized
from shardfit.config.schema import LoraConfig, ModelConfig
from shardfit.errors import ShardfitError
from shardfit.models import build_model
from tests.adapters.test_qlora import _pair
from tests.helpers import SMALL

IDS = torch.tensor([[5, 17, 99, 3, 250, 42, 7, 8, 120, 64, 1, 2]])


def _e4m3_grid() -> torch.Tensor:
    """Every finite e4m3 value, ascending, from its 256 bit patterns (independent of the cast under test)."""
    vals = torch.arange(256, dtype=torch.uint8).view(E4M3).float()
    return vals[torch.isfinite(vals)].unique()


def test_each_row_is_scaled_to_e4m3s_range_and_rounded_to_its_nearest_value():
    torch.manual_seed(0)
    w = torch.randn(24, 48) * torch.logspace(-3, 2, 24)[:, None]  # rows of very different magnitudes
    w[5] = 0  # a zero row: scale 1, codes 0
    codes, scale = quantize_rows_fp8(w)
    assert codes.dtype == E4M3 and scale.shape == (24, 1) and scale.dtype == torch.float32
    amax = w.abs().amax(1, keepdim=True)
    torch.testing.assert_close(scale[amax > 0], (amax / 448)[amax > 0], rtol=2**-23, atol=0)
    assert scale[5].item() == 1.0 and codes[5].float().abs().max() == 0
    # each row's largest weight is the largest e4m3 value, exactly
    assert torch.equal(codes.float().abs().amax(1)[amax[:, 0] > 0], torch.full((23,), 448.0))
    # every code is a nearest e4m3 value of w / s (a tie may go either way: the distance is what is checked)
    grid = _e4m3_grid()
    t = (w / scale).reshape(-1, 1)
    nearest = (grid[None, :] - t).abs().min(1).values
    assert torch.allclose((codes.float().reshape(-1, 1) - t).abs()[:, 0], nearest, rtol=0, atol=1e-6)
    # rows are quantised alone: any split into row ranges (FSDP's shards) gives the same bits
    parts = [quantize_rows_fp8(w[a:b]) for a, b in ((0, 7), (7, 8), (8, 24))]
    assert torch.equal(torch.cat([c for c, _ in parts]).view(torch.uint8), codes.view(torch.uint8))
    assert torch.equal(torch.cat([s for _, s in parts]), scale)


def test_the_scale_is_the_product_every_device_computes_alike():
    """amax x fp32(1/448), exactly: CUDA divides a tensor by a number, and Inductor by a constant, as that product,
    so a division gave the CPU other scales than the GPU (1 ulp, about half the rows): a CPU export re-quantised
    another base than the GPU run trained on, and the CUDA test's bit-for-bit comparison failed."""
    w = torch.randn(256, 64, generator=torch.Generator().manual_seed(1))
    _, scale = quantize_rows_fp8(w)
    assert torch.equal(scale, w.abs().amax(1, keepdim=True) * torch.tensor(1 / 448, dtype=torch.float32))


def test_rows_too_small_for_a_normal_scale_stay_finite():
    """A row whose amax / 448 underflows fp32 (amax under ~3e-43: an fp32 checkpoint may hold one) had scale 0,
    so its zero weights were coded 0 / 0: NaN, a non-finite model from finite weights."""
    w = torch.zeros(4, 32)
    w[0, 0], w[1], w[2, 1], w[3, 2] = 1e-44, 1e-40, -2e-38, 3e-43
    codes, scale = quantize_rows_fp8(w)
    got = dequantize_fp8(codes.view(torch.uint8), scale.view(torch.uint8), 4, torch.float32)
    assert torch.isfinite(got).all() and (scale > 0).all()
    tiny = torch.finfo(torch.float32).tiny
    torch.testing.assert_close(got, w, rtol=2**-4, atol=tiny * 2**-10)  # half e4m3's smallest step at that scale


def test_a_non_finite_weight_surfaces_in_the_output_as_it_would_in_bf16():
    """An inf or NaN weight is no finite garbage: its output column is not finite (and the others are)."""
    for bad in (float("inf"), float("nan")):
        lin = torch.nn.Linear(32, 16, bias=False)
        with torch.no_grad():
            lin.weight[3, 5] = bad
        y = to_quantized(lin, FP8Linear)(torch.randn(4, 32))
        assert not torch.isfinite(y[:, 3]).any() and torch.isfinite(y[:, :3]).all(), bad


def _layer(out_f=32, in_f=48, bias=True, seed=0) -> tuple[FP8Linear, torch.Tensor]:
    torch.manual_seed(seed)
    lin = torch.nn.Linear(in_f, out_f, bias=bias)
    w = lin.weight.detach().clone()
    return to_quantized(lin, FP8Linear), w


def test_the_matmul_is_e4m3_activations_per_token_times_the_stored_codes():
    layer, w = _layer()
    x = torch.randn(2, 5, 48) * 3
    y = layer(x)
    xq, xs = quantize_rows_fp8(x.reshape(-1, 48))
    wq = layer.dequantized([layer.weight_fp8, layer.weight_scale], torch.float32)
    want = ((xq.float() * xs) @ wq.t()).view(2, 5, 32) + layer.bias
    torch.testing.assert_close(y, want, rtol=1e-6, atol=1e-6)
    # and FP8's rounding is all that separates it from the unquantised layer: e4m3 keeps 3 mantissa bits
    exact = F.linear(x, w, layer.bias)
    rel = (y - exact).norm() / exact.norm()
    assert 1e-4 < rel < 0.06, rel


def test_backward_gives_the_input_gradient_and_saves_only_the_storage():
    layer, w = _layer(bias=False)
    x = torch.randn(7, 48, requires_grad=True)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        y = layer(x)
    assert [tuple(t.shape) for t in saved] == [(32, 48 // 4), (32, 1)]  # the codes and scales, carried in fp32
    dy = torch.randn(7, 32)
    y.backward(dy)
    s_w = layer.weight_scale.view(torch.float32).view(32)
    gq, gs = quantize_rows_fp8(dy, s_w)  # dX = (dY s_w) Wq, the first operand quantised per row
    want = (gq.float() * gs) @ layer.weight_fp8.view(E4M3).float()
    torch.testing.assert_close(x.grad, want, rtol=1e-6, atol=1e-6)
    exact = dy @ w
    assert (x.grad - exact).norm() / exact.norm() < 0.06
    assert layer.weight_fp8.grad is None and not layer.weight_fp8.requires_grad


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_a_model_on_an_fp8_base_is_close_to_lora_on_the_dequantised_base(dtype):
    """The same weights (the dequantised base): only the activations' FP8 rounding separates the two, forward and
    backward; adapters take gradients, the storage none."""
    q, plain = _pair(dtype, FP8Linear)
    storage = [p for n, p in q.named_parameters() if is_storage(n)]
    assert len(storage) == 2 * 2 * 7 and all(p.dtype == dtype for p in storage)  # carried in the compute dtype
    out_q, out_p = q(IDS), plain(IDS)
    assert (out_q.float() - out_p.float()).norm() / out_p.float().norm() < 0.05
    out_q.float().square().mean().backward()
    out_p.float().square().mean().backward()
    grads_p = {n: p.grad for n, p in plain.named_parameters() if is_adapter(n)}
    for n, p in q.named_parameters():
        if is_adapter(n):
            g, want = p.grad.float(), grads_p[n].float()
            assert (g - want).norm() <= 0.1 * want.norm() + 1e-6, n
        else:
            assert p.grad is None, n


def test_dtype_changes_keep_the_storage_bit_for_bit():
    q, _ = _pair(torch.float32, FP8Linear)
    before = {n: p.detach().view(torch.uint8).clone() for n, p in q.named_parameters() if is_storage(n)}
    to_dtype(q, torch.bfloat16)
    after = {n: p.detach().view(torch.uint8) for n, p in q.named_parameters() if is_storage(n)}
    assert before.keys() == after.keys() and all(torch.equal(before[n], after[n]) for n in before)
    layer = q.model.layers[0].mlp.down_proj
    assert layer.weight_fp8.shape == (64, 160 // 2) and layer.weight_scale.shape == (64, 2)


def test_layers_whose_dims_fp8_cannot_multiply_keep_their_weight():
    m = build_model(ModelConfig(dim=64, n_layers=1, n_heads=4, n_kv_heads=2, ffn_dim=168, vocab_size=264,
                                max_seq_len=64))
    targets = apply_lora(m, LoraConfig(rank=4, targets="all-linear"), None)
    assert apply_quantized(m, targets, FP8Linear) == 4  # q, k, v, o; gate/up/down have 168 (not a multiple of 16)
    assert hasattr(m.model.layers[0].mlp.up_proj, "weight")


def test_the_dequantised_weight_is_the_codes_times_the_row_scales():
    layer, w = _layer(out_f=16, in_f=32)
    got = dequantize_fp8(layer.weight_fp8, layer.weight_scale, 16, torch.float32)
    codes, scale = quantize_rows_fp8(w)
    assert torch.equal(got, codes.float() * scale)
    assert (got - w).abs().max() <= w.abs().amax(1, keepdim=True).max() / 16  # 3 mantissa bits


@pytest.mark.parametrize("extra, message", [
    (["--model.quantize=fp8"], "a quantized base cannot train"),
    (["--model.quantize=fp8", "--lora.rank=4", "--compute.fp8=tensorwise"], "already multiplies in FP8"),
    (["--model.quantize=fp8", "--lora.rank=4", "--parallel.offload=all"], "not supported with CPU offload"),
], ids=["no-rank", "fp8-twice", "offload"])
def test_config_refusals(extra, message):
    from shardfit.config import load_config

    with pytest.raises(ShardfitError, match=message):
        load_config(None, [*SMALL, *extra])
    assert load_config(None, [*SMALL, "--model.quantize=fp8", "--lora.rank=4"]).model.quantize == "fp8"
