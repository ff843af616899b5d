"""An FP8 base (model.quantize=fp8): the adapted linear layers' frozen base weights stored in float8 e4m3 with one
fp32 scale per output row, multiplied in FP8 on GPUs with FP8 tensor cores. Storage, sharding and filling:
adapters/quantized.py.

Why: a LoRA run's frozen bf16 base is most of its memory (15.0 GiB of the 8B shape's ~20-27); stored in FP8 it is
half, and the matmuls that read it run on FP8 tensor cores (twice bf16's peak) with no per-step weight quantisation
(compute.fp8 quantises every weight again in each forward, recompute and backward). It changes the base's numerics
like QLoRA does, less: e4m3 keeps 3 mantissa bits against NF4's 16 levels.
Format: a weight row w [in] is stored as codes round_e4m3(w / s) with s = amax|w| x (1 / 448) in fp32 (at least
fp32's smallest normal; 1 for a zero row); it reads back as codes x s. Storage: weight_fp8 [out, in] bytes and
weight_scale [out] fp32, carried bit for bit as [out, in / size] and [out, 4 / size] in the carrier dtype (size: its
bytes): 1 + 4 / in bytes a weight. Storage rows are weight rows, so FSDP's dim-0 shards are whole rows and a rank
quantises its own rows alone.
The matmul, a custom operator (opaque to torch.compile, recomputed whole under checkpointing; its autograd saves the
storage, never a dequantised weight), per device:
  fp8 tensor cores (CUDA, compute capability >= 8.9, bf16 input): y = x W^T as torch._scaled_mm of x quantised per
     row (e4m3, each token scaled as a weight row is) and the codes, scaled by both rows' scales (the forward with
     Hopper's fast accumulation, as torchao's float8 forward; bf16 out). Backward: dX = dY W = (dY s_w) Wq, dY s_w
     quantised per row, times the codes transposed (a contiguous copy, 1 byte a weight, freed after its matmul:
     _scaled_mm takes its second operand column-major), accumulated exactly. The quantisations and the transposed
     copy are Triton kernels (kernels/fp8_rows.py; without Triton the quantiser is compiled); what each part costs:
     benchmarks/bench_fp8_linear.py.
  the CPU: the same arithmetic emulated (the rounded operands, products in fp32): the numerics the GPU computes, for
     tests; no speed-up.
  other GPUs: the weight dequantised to the compute dtype for a plain matmul (memory saved, no FP8 arithmetic).
"""

from __future__ import annotations

import functools

import torch

from shardfit.adapters.qlora import NF4Linear
from shardfit.adapters.quantized import QuantizedLinear, Span, register_frozen_matmul, rows_span
from shardfit.kernels import fp8_rows
from shardfit.models.init import FP8_STORAGE, ShardView
from shardfit.models.loss import compiled_once

E4M3 = torch.float8_e4m3fn
E4M3_MAX = 448.0
ALIGN = 16  # _scaled_mm needs both dims of its second operand to be multiples of 16 (others stay unquantised)
_INV_MAX = 1 / E4M3_MAX  # rounded to fp32 where it multiplies, alike on every device
_TINY = torch.finfo(torch.float32).tiny


def quantize_rows_fp8(t: torch.Tensor, col_scale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes [m, k] e4m3, scales [m, 1] fp32) of t [m, k] (times col_scale [k] first, when given): each row scaled to
    e4m3's range by its own amax. Deterministic and row-local: any split into row ranges gives the same codes."""
    quotients, scale = row_quotients(t, col_scale)
    return quotients.to(E4M3), scale


def row_quotients(t: torch.Tensor, col_scale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """quantize_rows_fp8 before its cast: (clamp(f / scale, +-448) [m, k] fp32, scale [m, 1] fp32)."""
    f = t.float() if col_scale is None else t.float() * col_scale
    amax = f.abs().amax(dim=1, keepdim=True)
    # amax times fp32(1 / 448), not amax / 448: CUDA's eager division by a number and Inductor's division by a
    # constant both multiply by the reciprocal, so dividing gave the CPU other scales (1 ulp, about half the rows).
    # At least fp32's smallest normal: under ~3e-43 the scale rounded to 0 and a zero weight's code was 0 / 0, NaN.
    scale = torch.where(amax > 0, (amax * _INV_MAX).clamp_min(_TINY), 1.0)
    return (f / scale).clamp(-E4M3_MAX, E4M3_MAX), scale


def _codes(stored: torch.Tensor, out_features: int) -> torch.Tensor:
    return stored.view(E4M3).view(out_features, -1)


def _scales(stored: torch.Tensor, out_features: int) -> torch.Tensor:
    return stored.view(torch.float32).view(out_features)


def dequantize_fp8(codes: torch.Tensor, scale: torch.Tensor, out_features: int, dtype: torch.dtype) -> torch.Tensor:
    """The weight [out, in] in dtype from its carried storage: fp32(code x scale), then dtype. Scaled in place: one
    fp32 copy of the weight, not two (in fp32 it is the result; plan/adapters.py counts it)."""
    w = _codes(codes, out_features).float()
    return w.mul_(_scales(scale, out_features)[:, None]).to(dtype)


@functools.cache
def _tensor_cores(device: torch.device) -> bool:
    return torch.cuda.get_device_capability(device) >= (8, 9)


def _mode(x: torch.Tensor) -> str:
    if x.device.type != "cuda":
        return "emulate"
    return "fp8" if x.dtype == torch.bfloat16 and _tensor_cores(x.device) else "dequant"


def _quantized_rows(t: torch.Tensor, col_scale: torch.Tensor | None, mode: str) -> tuple[torch.Tensor, torch.Tensor]:
    """quantize_rows_fp8 of the activations or gradients t [m, k] for _mm's first operand: row-major (_scaled_mm
    refuses a column-major one, and the quantisation keeps its input's strides) and out of autograd (one compiled
    graph whatever t.requires_grad and the grad mode: a graph each would pass torch._dynamo's recompile limit)."""
    t = t.detach().contiguous()
    if mode == "fp8" and fp8_rows.available(t):  # one read of t and one write (kernels/fp8_rows.py: why)
        return fp8_rows.quantize_rows(t, col_scale)
    # on the tensor cores without Triton compiled: eagerly the quantisation is ~6 passes over an fp32 copy of the
    # activations, which costs about what the FP8 matmul saves
    fn = compiled_once(quantize_rows_fp8, dynamic=True) if mode == "fp8" else quantize_rows_fp8
    with torch.no_grad():
        return fn(t, col_scale)


def _codes_transposed(codes: torch.Tensor, out_features: int, mode: str) -> torch.Tensor:
    """The codes [out, in] as a contiguous [in, out] (Wq column-major, _scaled_mm's second operand): 1 byte a weight,
    freed after its matmul. On the tensor cores a tiled kernel, as the quantiser is chosen (the eager strided copy
    ran at under a tenth of the memory bandwidth: kernels/fp8_rows.py)."""
    c = _codes(codes, out_features)
    return fp8_rows.transpose_bytes(c) if mode == "fp8" and fp8_rows.available(c) else c.t().contiguous()


def _mm(a: torch.Tensor, b_codes_t: torch.Tensor, a_scale: torch.Tensor, b_scale: torch.Tensor, mode: str,
        dtype: torch.dtype, fast_accum: bool = False) -> torch.Tensor:
    """a [m, k] e4m3 (row scales a_scale [m, 1]) times b_codes_t [k, n] e4m3 (column scales b_scale [n]) in dtype."""
    if mode == "fp8":
        return torch._scaled_mm(a, b_codes_t, scale_a=a_scale, scale_b=b_scale.view(1, -1), out_dtype=dtype,
                                use_fast_accum=fast_accum)
    return ((a.float() * a_scale) @ (b_codes_t.float() * b_scale)).to(dtype)


@torch.library.custom_op("shardfit::fp8_linear", mutates_args=())
def fp8_linear(x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor, out_features: int,
               in_features: int) -> torch.Tensor:
    """y = x W^T, W [out, in] stored in FP8 (module docstring: the matmul per device)."""
    mode = _mode(x)
    if mode == "dequant":
        return torch.nn.functional.linear(x, dequantize_fp8(codes, scale, out_features, x.dtype))
    xq, xs = _quantized_rows(x.reshape(-1, in_features), None, mode)
    # the forward's products with Hopper's fast accumulation (as torchao's float8 forward: its cost and saving in
    # benchmarks/README.md#dpo-s25); gradients keep the exact one
    y = _mm(xq, _codes(codes, out_features).t(), xs, _scales(scale, out_features), mode, x.dtype, fast_accum=True)
    return y.view(*x.shape[:-1], out_features)


@torch.library.custom_op("shardfit::fp8_linear_input_grad", mutates_args=())
def fp8_linear_input_grad(dy: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor, out_features: int,
                          in_features: int) -> torch.Tensor:
    """dX = dY W = (dY s_w) Wq: the weight's row scales move onto dY's columns, so the codes need no rescaling."""
    mode = _mode(dy)
    if mode == "dequant":
        return dy @ dequantize_fp8(codes, scale, out_features, dy.dtype)
    s_w = _scales(scale, out_features)
    gq, gs = _quantized_rows(dy.reshape(-1, out_features), s_w, mode)
    codes_t = _codes_transposed(codes, out_features, mode)  # [in, out] row-major
    ones = s_w.new_ones(in_features)
    return _mm(gq, codes_t.t(), gs, ones, mode, dy.dtype).view(*dy.shape[:-1], in_features)


register_frozen_matmul(fp8_linear, fp8_linear_input_grad, n_storage=2)


class FP8Linear(QuantizedLinear):
    """A frozen linear layer whose weight is stored in FP8 with per-row scales (module docstring)."""

    STORAGE = FP8_STORAGE
    FORMAT = "fp8"
    LABEL = "FP8"
    DESCRIPTION = ("FP8 base: the base weights of {} adapted linear layers ({:,} weights) are float8 e4m3 with a "
                   "scale per row")
    NOTICE = "their matmuls run in FP8 where the GPU has FP8 tensor cores (compute capability >= 8.9)"

    def notice(self) -> str:
        """How its matmuls run here (_mode): FP8 needs CUDA and bf16 compute (the storage's carrier is the compute
        dtype)."""
        if self.weight_fp8.device.type == "cpu":
            return "on the CPU their FP8 arithmetic is emulated (the GPU's numerics, no speed-up)"
        if self.weight_fp8.dtype != torch.bfloat16:
            return (f"with {str(self.weight_fp8.dtype)[6:]} compute they dequantise each weight and multiply in it "
                    "(no FP8 matmul; bf16 compute has them)")
        return self.NOTICE

    @classmethod
    def eligible(cls, out_features: int, in_features: int) -> bool:
        return out_features % ALIGN == 0 and in_features % ALIGN == 0

    @classmethod
    def storage_shapes(cls, out_features: int, in_features: int, carrier: torch.dtype) -> list[tuple[int, int]]:
        return [(out_features, in_features // carrier.itemsize), (out_features, 4 // carrier.itemsize)]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = fp8_linear(x, self.weight_fp8, self.weight_scale, self.out_features, self.in_features)
        return out if self.bias is None else out + self.bias

    def span(self, view: ShardView) -> Span:
        return rows_span(self, view)

    @torch.no_grad()
    def quantize_rows(self, rows: torch.Tensor, span: Span) -> None:
        codes, scale = quantize_rows_fp8(rows.reshape(-1, self.in_features))
        carrier = span.shards[0].dtype
        for dst, src in zip(span.shards, (codes.view(torch.uint8), scale.view(torch.uint8))):
            dst.copy_(src.view(carrier))  # the same dtype: a copy of the bytes

    def dequantized(self, parts: list[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
        return dequantize_fp8(*parts, self.out_features, dtype)


def quantized_class(name: str) -> type[QuantizedLinear]:
    """The module class of a model.quantize format (named here, with the format that came after NF4's)."""
    return {"nf4": NF4Linear, "fp8": FP8Linear}[name]


__all__ = ["E4M3", "FP8Linear", "dequantize_fp8", "fp8_linear", "quantize_rows_fp8", "quantized_class"]
