"""--logging.profile_step: the GPU-time summary's arithmetic, and a real profiled step on the CPU."""

import gzip
import json

from shardfit.train import Trainer
from shardfit.train.profile import format_summary, kernel_kind, summarize_trace
from tests._dist import run_ranks
from tests.helpers import small_config


def _k(name, ts, dur, stream, cat="kernel"):
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "args": {"stream": stream}}


def test_summary_counts_overlaps_once_and_finds_the_compute_stream():
    events = [
        _k("nvjet_tst_128x256_64x4_1x2_h_bz_coopB_TNT", 0, 400, 7),  # matmul
        _k("triton_poi_fused_add_mul_0", 450, 50, 7),  # compiled fusion; 50 us idle before it
        _k("pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<128>>", 500, 300, 7),
        _k("Memcpy HtoD (Pinned -> Device)", 900, 20, 7, cat="gpu_memcpy"),  # 100 us idle before it
        _k("ncclDevKernel_AllGather_RING_LL", 100, 500, 20),  # another stream, overlapping compute
        _k("ncclDevKernel_ReduceScatter_Sum_f32_RING_LL", 550, 200, 21),
        {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 0, "dur": 5000},  # host events are not GPU time
    ]
    s = summarize_trace(events)
    assert s["span_ms"] == 0.92 and s["compute_busy_ms"] == 0.77 and s["compute_idle_ms"] == 0.15
    assert s["compute_kinds_ms"] == {"matmul": 0.4, "attention": 0.3, "compiled fusion": 0.05, "copy": 0.02}
    assert s["communication_ms"] == 0.65  # union of [100, 600) and [550, 750)
    assert s["kernels"] == 3 and s["top_kernels_ms"][0][1] == 0.4
    assert s["top_kernels_by_kind_ms"]["attention"] == [[events[2]["name"], 0.3]]
    assert "idle 0 ms" in format_summary(5, s) and "matmul 0" in format_summary(5, s)
    assert kernel_kind("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n") == "matmul"
    assert kernel_kind("void at::native::multi_tensor_apply_kernel<FusedAdamMathFunctor>") == "optimizer"
    assert kernel_kind("void at::native::vectorized_elementwise_kernel<4, CUDAFunctor_add>") == "other"
    assert summarize_trace([events[-1]]) == {}


def test_profiled_step_writes_trace_and_summary(tmp_path, capsys):
    Trainer(small_config("--train.micro_batch=2", "--train.steps=3", "--logging.profile_step=2",
                         "--logging.progress=lines", run_dir=str(tmp_path))).fit()
    out = capsys.readouterr().out
    assert "profile of step 2:" in out and "aten::mm" in out
    with gzip.open(tmp_path / "profile" / "step2_rank0.json.gz") as f:
        trace = json.loads(f.read())
    assert any(e.get("name") == "aten::mm" for e in trace["traceEvents"])
    summary = json.loads((tmp_path / "profile" / "step2_summary.json").read_text())
    assert summary["top_ops_ms"] and all(t > 0 for _, t in summary["top_ops_ms"])
    assert sorted(p.name for p in (tmp_path / "profile").iterdir()) == ["step2_rank0.json.gz", "step2_summary.json"]


def _profiled(rank, world, run_dir):
    trainer = Trainer(small_config("--train.micro_batch=2", "--train.steps=3", "--logging.profile_step=2",
                                   run_dir=run_dir))
    return {"losses": [h["loss"] for h in trainer.fit()]}


def test_two_ranks_profile_the_same_step_and_rank_zero_writes(tmp_path):
    """Every rank profiles step 2 (the step stays symmetric, no rank is left in a collective); only rank 0 writes."""
    results = run_ranks(_profiled, 2, str(tmp_path))
    assert results[0]["losses"] == results[1]["losses"] and len(results[0]["losses"]) == 3
    assert sorted(p.name for p in (tmp_path / "profile").iterdir()) == ["step2_rank0.json.gz", "step2_summary.json"]
