"""benchmarks/rl_profile.py (issue 24's profiles of an RL step, bench_rl.py --prof-out) on synthetic Chrome traces:
each kernel lands in one row, a backward kernel in the region its forward operator ran in, each matmul operator's
FLOPs are counted once from its shapes, and the 2x bounds are the arithmetic their docstring states."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import rl_profile as rp  # noqa: E402

M, K, N = 16384, 4096, 4096  # a block matmul: 2 M K N = 0.5498 TFLOP
V, R = 3000, 16


def host(name, ts, dur, tid, seq=None, dims=None, cat="cpu_op"):
    args = {}
    if seq is not None:
        args.update({"Sequence number": seq, "Fwd thread id": 0})
    if dims is not None:
        args["Input Dims"] = dims
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "pid": 0, "tid": tid, "args": args}


def launch(ts, corr, tid):
    return {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": ts, "dur": 1, "pid": 0, "tid": tid,
            "args": {"correlation": corr}}


def kernel(name, ts, dur, corr, stream=7, cat="kernel"):
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "pid": 1, "tid": stream,
            "args": {"stream": stream, "correlation": corr}}


def trace():
    ev = [
        # forward, main thread 1: a block matmul (sequence 5), a LoRA down-projection (rank 16), the labelled head
        host("aten::mm", 0, 10, 1, seq=5, dims=[[M, K], [K, N]]), launch(2, 1, 1),
        host("aten::mm", 10, 5, 1, seq=6, dims=[[M, K], [K, R]]), launch(11, 2, 1),
        host("anchor::logprob_head", 20, 30, 1, cat="user_annotation"),
        host("aten::linear", 21, 10, 1, seq=7), host("aten::mm", 22, 8, 1, dims=[[M, K], [K, V]]), launch(23, 3, 1),
        host("aten::logsumexp", 35, 5, 1, seq=8), launch(36, 4, 1),
        host("## Call CompiledFxGraph abc", 60, 20, 1, cat="user_annotation"), launch(61, 5, 1), launch(62, 10, 1),
        # backward, autograd thread 2: each node placed by its forward's sequence number
        host(f"{rp.EVAL}: MmBackward0", 200, 30, 2, seq=5), host("aten::mm", 201, 20, 2, dims=[[M, N], [N, K]]),
        launch(202, 6, 2),
        host(f"{rp.EVAL}: LogsumexpBackward0", 240, 10, 2, seq=8), host("aten::exp", 241, 5, 2), launch(242, 7, 2),
        host(f"{rp.EVAL}: LinearBackward0", 260, 20, 2, seq=7), host("aten::mm", 261, 10, 2, dims=[[M, V], [V, K]]),
        launch(262, 8, 2),
        # the optimizer, main thread, and a copy on another stream
        host("Optimizer.step#AdamW.step", 300, 20, 1, cat="user_annotation"), launch(301, 9, 1),
        host("aten::add_", 305, 2, 1), launch(306, 11, 1),
        kernel("nvjet_sm90_tst_256x128_64x4_1x2_h_bz_coopA_TNT", 1000, 1000, 1),
        kernel("nvjet_sm90_tst_128x64_small", 2000, 100, 2),
        kernel("nvjet_sm90_tst_256x128_head", 2100, 400, 3),
        kernel("triton_red_fused_logsumexp_0", 2500, 50, 4),
        kernel("triton_tem_fused_flex_attention_0", 2550, 300, 5),
        kernel("triton_tem_fused_mm_1", 2850, 60, 10),  # an Inductor mm template: a matmul without shapes
        kernel("nvjet_sm90_tst_256x128_64x4_1x2_h_bz_coopA_NNT", 3000, 2000, 6),  # backward of the block mm
        kernel("void at::native::vectorized_elementwise_kernel<4, exp>", 5000, 440, 7),  # the head's, by sequence
        kernel("nvjet_sm90_tst_256x128_head_bwd", 5440, 400, 8),
        kernel("void at::native::multi_tensor_apply_kernel<FusedAdamMathFunctor>", 5900, 30, 9),
        kernel("void at::native::vectorized_elementwise_kernel<4, CUDAFunctor_add>", 5930, 10, 11),
        kernel("Memcpy DtoD (Device -> Device)", 100, 70, 99, stream=9, cat="gpu_memcpy"),
        kernel("void at::native::unlaunched_kernel", 6000, 5, 12345),  # no launch in the trace: "elsewhere"
    ]
    return ev


def test_every_kernel_lands_in_one_row_and_backward_follows_its_forward():
    an = rp.analyse(trace(), vocab=V, lora_rank=R)
    rows = an["rows_ms"]
    assert rows["GEMM blocks: forward"] == 1.0 and rows["GEMM blocks: backward + recompute"] == 2.0
    assert rows["GEMM LoRA adapters"] == 0.1
    assert rows["GEMM log-prob head"] == 0.8  # the forward's (label) and the backward's (its forward's label)
    assert rows["GEMM without shapes"] == 0.1  # 0.06, rounded
    assert rows["attention: forward"] == 0.3 and rows["attention: backward + recompute"] == 0.0
    assert rows["log-prob head: softmax/gather/other"] == 0.5  # 0.05 forward + 0.44 backward, linked by sequence
    assert rows["optimizer + grad clip"] == 0.0 and rows["eager elementwise"] == 0.0  # 0.03 + 0.01, 0.005: rounded
    assert an["busy_sum_ms"] == round((1000 + 100 + 400 + 50 + 300 + 60 + 2000 + 440 + 400 + 30 + 10 + 5) / 1e3, 1)
    assert an["other_streams_ms"] == 0.1 and an["kernels_without_launch_ms"] == 0.0
    g = an["gemm"]
    block = 2.0 * M * K * N
    assert g["blocks: forward"]["TFLOP"] == round(block * 1e-12, 3)
    assert g["blocks: forward"]["TFLOPs"] == round(block / 1e-3 * 1e-12, 1)  # 1 ms
    assert g["blocks: backward + recompute"]["TFLOPs"] == round(block / 2e-3 * 1e-12, 1)
    assert g["log-prob head"]["ops"] == 2 and g["log-prob head"]["TFLOP"] == round(4.0 * M * K * V * 1e-12, 3)
    assert g["without shapes"]["TFLOP"] == 0 and g["without shapes"]["TFLOPs"] is None
    shaped_ms = 1000 + 100 + 400 + 2000 + 400  # the total rate leaves the matmuls without shapes out
    total = 2 * block + 2.0 * M * K * R + 4.0 * M * K * V
    assert g["total"]["TFLOPs"] == round(total / (shaped_ms * 1e-6) * 1e-12, 1)


def test_optimizer_label_and_vocab_by_shape():
    ev = trace()
    for e in ev:  # no head label: the head's matmuls are still the head's by the vocabulary in their shapes
        if e["name"] == "anchor::logprob_head":
            e["name"] = "something_else"
    an = rp.analyse(ev, vocab=V, lora_rank=R)
    assert an["rows_ms"]["GEMM log-prob head"] == 0.8
    assert an["rows_ms"]["log-prob head: softmax/gather/other"] == 0.0  # its softmax is elementwise now
    assert an["rows_ms"]["eager elementwise"] == 0.4 and an["rows_ms"]["compiled elementwise/norm/rope"] == 0.1
    for e in ev:  # a kernel launched under the optimizer's label is the optimizer's whatever its kind
        if e.get("args", {}).get("correlation") == 11 and e["cat"] == "kernel":
            e["dur"] = 100
    assert rp.analyse(ev, vocab=V, lora_rank=R)["rows_ms"]["optimizer + grad clip"] == 0.1
    assert rp.analyse([host("aten::mm", 0, 1, 1)]) == {}  # a CPU run: no GPU work
    ev = [host("## Call CompiledFxGraph x", 0, 10, 1, cat="user_annotation"), launch(1, 1, 1), launch(2, 2, 1),
          host("aten::_grouped_mm", 3, 5, 1, dims=[[64, 4], [8, 4, 2], [8]]), launch(4, 3, 1),
          kernel("triton_tem_fused__grouped_mm_0", 10, 100, 1),  # Inductor's grouped template: the experts'
          kernel("_ZN7cutlass13device_kernelIN2at4cuda6detail25GemmUniversalINS5_17GroupProblemShape", 110, 50, 2),
          kernel("_ZN7cutlass13device_kernelIN2at4cuda6detail25GemmUniversalINS5_17GroupProblemShape", 160, 200, 3)]
    g = rp.analyse(ev)["gemm"]
    assert g["experts (grouped): forward"]["ms"] == 0.35 and g["experts (grouped): forward"]["ops"] == 1
    assert g["experts (grouped): forward"]["ms_with_shapes"] == 0.2  # the rate's time: the shaped kernel's alone
    assert g["experts (grouped): forward"]["TFLOP"] == 0.0 and g["without shapes"]["ms"] == 0.0


@pytest.mark.parametrize("name, dims, flops", [
    ("aten::mm", [[8, 4], [4, 2]], 2 * 8 * 4 * 2),
    ("aten::addmm", [[2], [8, 4], [4, 2], [], []], 2 * 8 * 4 * 2),
    ("aten::mm", [[8, 4], [4, 2], [8, 2]], 2 * 8 * 4 * 2),  # Inductor's extern mm(out=)
    ("aten::bmm", [[3, 8, 4], [3, 4, 2]], 2 * 3 * 8 * 4 * 2),
    ("aten::baddbmm", [[3, 8, 2], [3, 8, 4], [3, 4, 2], [], []], 2 * 3 * 8 * 4 * 2),
    ("aten::_grouped_mm", [[64, 4], [8, 4, 2], [8]], 2 * 64 * 4 * 2),  # each token row meets one expert
    ("aten::_grouped_mm", [[4, 64], [64, 2], [8]], 2 * 4 * 64 * 2),  # weight gradient: K split by offsets
    ("aten::mm", [[8, 4]], None),
    ("aten::mm", None, None),
])
def test_gemm_flops(name, dims, flops):
    assert rp.gemm_flops(name, dims) == flops


def test_bounds_are_the_stated_arithmetic():
    sf = {"table": {"GEMM blocks: forward": 4000.0, "GEMM blocks: backward + recompute": 8000.0,
                    "attention: forward": 2000.0, "eager elementwise": 1000.0, "idle: waiting for the CPU": 500.0,
                    "busy": 15000.0, "span": 15500.0},
          "gemm": {"blocks: forward": {"TFLOP": 2000.0}, "LoRA adapters": {"TFLOP": 40.0},
                   "total": {"TFLOP": 6040.0, "TFLOPs": 503.3}}}
    hf = {"table": {"GEMM blocks: forward": 9000.0, "attention: forward": 6000.0, "busy": 15000.0},
          "gemm": {"total": {"TFLOP": 7000.0, "TFLOPs": 777.8}}}
    b = rp.bounds(sf, hf, sf_step_s=16.0, hf_step_s=30.0, ceiling_tflops=800.0)
    assert b["ratio_now"] == round(30 / 16, 3) and b["anchor_gemm_over_shardfit_gemm"] == 0.75
    assert b["gemm_as_now_rest_free"] == 2.5  # 30 / 12
    assert b["gemm_at_ceiling_rest_free"] == round(30 / (6040 / 800), 3)
    assert b["gemm_at_ceiling_rest_as_now"] == round(30 / (6040 / 800 + 3.0 + 0.5), 3)
    recompute = 2000 + 40 / 4
    assert b["no_recompute_gemm_at_ceiling_rest_as_now"] == round(30 / ((6040 - recompute) / 800 + 3.5), 3)
    assert b["gemm_TFLOPs_for_2x"] == round(6040 / (15 - 3.5), 1)
    assert rp.bounds(sf, hf, 16.0, 6.0, None)["gemm_TFLOPs_for_2x"] is None  # the rest alone is over half
    assert rp.compare({"a": 2.0}, {"a": 3.0, "b": 1.0}) == {"a": [2.0, 3.0, 1.5], "b": [0.0, 1.0, None]}


def test_model_flops_formulas():
    f = rp.dense_flops(rp.QWEN3_8B, tokens=1000, head_rows=500, lora_rank=16, head_passes=2)
    assert f["block_linear_params"] == 36 * (4096 * 4096 * 2 + 2 * 4096 * 1024 + 3 * 4096 * 12288)
    assert f["lora_params"] == 36 * 16 * (2 * 8192 + 2 * 5120 + 3 * 16384)  # 43.6M: the anchor's D_model count
    assert f["head_TFLOP"] == round(2 * 2 * 151936 * 4096 * 500 * 1e-12, 2)
    m = rp.moe_forward_flops(rp.QWEN3_30B_A3B, layers=6, tokens=1000, head_rows=0)
    assert m["experts_TFLOP"] == round(8 * 3 * 2 * 2048 * 768 * 6 * 1000 * 1e-12, 2)
    assert rp.attention_flops([4, 2], heads=1, head_dim=1, layers=1) == 2 * 16 + 2 * 4
