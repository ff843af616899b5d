"""`shardfit profile`'s analysis of a Chrome trace: kernel kinds, the compute stream's busy and idle time, exposed
communication, idle time split between the CPU and other streams, phases, and the command on a saved trace."""

import gzip

from shardfit.doctor.profile_trace import format_summary, kernel_kind, summarize_trace


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


def test_exposed_communication_is_the_collective_time_no_other_kernel_covers():
    events = [
        _k("nvjet_tst_128x256_64x4_1x2_h_bz_coopB_TNT", 0, 400, 7),
        _k("triton_poi_fused_add_mul_0", 450, 50, 7),
        _k("multi_tensor_apply_kernel<FusedAdamMathFunctor>", 500, 300, 9),  # a side stream's work hides it too
        _k("ncclDevKernel_AllGather_RING_LL", 100, 500, 20),  # [100, 600): uncovered only in [400, 450)
        _k("ncclDevKernel_AllGather_RING_LL", 580, 40, 20),  # overlaps the first: counted once
        _k("ncclDevKernel_ReduceScatter_Sum_f32_RING_LL", 550, 200, 21),  # covered by the optimizer
        _k("ncclDevKernel_SendRecv(ncclDevKernelArgsStorage<4096ul>)", 900, 100, 7),  # on the compute stream, alone
    ]
    s = summarize_trace(events)
    assert s["communication_exposure_ms"] == {"all-to-all": {"ms": 0.1, "exposed_ms": 0.1},
                                              "all-gather": {"ms": 0.52, "exposed_ms": 0.05},
                                              "reduce-scatter": {"ms": 0.2, "exposed_ms": 0.0}}
    assert "all-to-all 0 (0 exposed)" in format_summary(1, s)


def test_idle_time_is_split_into_cpu_late_launches_and_waits_on_other_streams():
    def k(ts, dur, corr):
        e = _k("nvjet_gemm", ts, dur, 7)
        e["args"]["correlation"] = corr
        return e

    def host(name, ts, dur, cat="cpu_op", corr=None, tid=1):
        e = {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "pid": 0, "tid": tid, "args": {}}
        if corr is not None:
            e["args"]["correlation"] = corr
        return e

    events = [
        k(0, 100, 1), k(100, 100, 2),  # back to back: no gap
        k(300, 100, 3),  # 100 us gap; launched at 50, before the stream ran dry at 200: a wait on another stream
        k(700, 100, 4),  # 300 us gap; launched at 650, after: the CPU's, under the exchange's annotation
        k(805, 10, 5),  # a 5 us gap: below the threshold, launched late but not counted
        host("cudaLaunchKernel", 0, 5, "cuda_runtime", 1), host("cudaLaunchKernel", 10, 5, "cuda_runtime", 2),
        host("cudaLaunchKernel", 50, 5, "cuda_runtime", 3),
        host("exchange", 400, 400, "user_annotation"), host("aten::_local_scalar_dense", 410, 200),
        host("cudaStreamSynchronize", 420, 180, "cuda_runtime"),  # the host sync inside .tolist()
        host("aten::mm", 640, 20), host("cudaLaunchKernel", 650, 5, "cuda_runtime", 4),
        host("cudaLaunchKernel", 790, 5, "cuda_runtime", 5),
        host("cudaMemcpyAsync", 700, 5, "cuda_runtime"),  # asynchronous: not a sync
    ]
    s = summarize_trace(events)
    assert s["compute_idle_ms"] == 0.41  # 815 us span - 410 us busy
    idle = s["idle"]
    assert idle["cpu_ms"] == 0.3 and idle["other_stream_ms"] == 0.1
    assert idle["host_syncs"] == 1 and idle["host_sync_ms"] == 0.18
    assert idle["cpu_by_launch_context_ms"] == [["exchange > aten::mm", 0.3]]
    assert "CPU 0, other streams 0; 1 host syncs" in format_summary(3, s)


def test_phases_group_kernels_by_the_host_phase_that_launched_them():
    def k(ts, dur, corr):
        e = _k("nvjet_gemm", ts, dur, 7)
        e["args"]["correlation"] = corr
        return e

    def launch(ts, corr):
        return {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": ts, "dur": 2, "pid": 0,
                "tid": 1, "args": {"correlation": corr}}

    events = [
        k(10, 20, 1), k(60, 20, 2),  # forward: launched at 0 and 50; span 70, busy 40 (host-bound)
        k(100, 50, 3), k(150, 50, 4),  # backward: back to back
        k(300, 30, 5),  # the optimizer
        launch(0, 1), launch(50, 2), launch(90, 3), launch(95, 4), launch(290, 5),
        {"ph": "X", "cat": "cpu_op", "name": "autograd::engine::evaluate_function: MmBackward0", "ts": 85, "dur": 20},
        {"ph": "X", "cat": "user_annotation", "name": "Optimizer.step#AdamW.step", "ts": 280, "dur": 30},
    ]
    assert summarize_trace(events)["phases"] == {"forward": {"span_ms": 0.07, "busy_ms": 0.04},
                                                 "backward": {"span_ms": 0.1, "busy_ms": 0.1},
                                                 "optimizer": {"span_ms": 0.03, "busy_ms": 0.03}}


def test_profile_command_explains_a_saved_trace(tmp_path, capsys):
    """`shardfit profile TRACE`: the summary of a kept trace (gzipped, as the trainer keeps it), the CPU-bound idle
    time by the host code that launched the next kernel, and --json."""
    import json as _json

    from shardfit.cli.main import main

    def k(ts, dur, corr):
        e = _k("nvjet_gemm", ts, dur, 7)
        e["args"]["correlation"] = corr
        return e

    def host(name, ts, dur, cat="cpu_op", corr=None):
        return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "pid": 0, "tid": 1,
                "args": {} if corr is None else {"correlation": corr}}

    events = [k(0, 100, 1), k(400, 100, 2), host("cudaLaunchKernel", 0, 5, "cuda_runtime", 1),
              host("exchange", 300, 200, "user_annotation"), host("cudaLaunchKernel", 350, 5, "cuda_runtime", 2)]
    path = tmp_path / "step8_rank0.json.gz"
    with gzip.open(path, "wt") as f:
        _json.dump({"traceEvents": events}, f)
    assert main(["profile", str(path)]) == 0
    out = capsys.readouterr().out
    assert "idle 0 ms (CPU 0, other streams 0" in out and "0.30  exchange" in out
    assert main(["profile", str(path), "--json"]) == 0
    assert _json.loads(capsys.readouterr().out)["idle"]["cpu_ms"] == 0.3


def test_time_by_region_follows_the_host_labels_open_at_launch():
    """A kernel belongs to the first region whose label is open at any depth when the CPU launched it (FSDP's
    record_function labels sit several operators above the cast's kernel), else to "elsewhere"; kinds within."""
    from shardfit.doctor.profile_trace import time_by_region

    def k(name, ts, dur, corr, stream=7):
        e = _k(name, ts, dur, stream)
        e["args"]["correlation"] = corr
        return e

    def host(name, ts, dur, cat="cpu_op", corr=None):
        e = {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "pid": 0, "tid": 1, "args": {}}
        if corr is not None:
            e["args"]["correlation"] = corr
        return e

    events = [
        k("void at::native::unrolled_elementwise_kernel<copy>", 0, 40, 1),  # the cast, under FSDP's label
        k("nvjet_tst_gemm", 40, 300, 2),  # a block's matmul: elsewhere
        k("nvjet_tst_gemm", 340, 100, 3), k("triton_red_fused_logsumexp_0", 440, 30, 4),  # the head
        k("ncclDevKernel_AllGather", 0, 10, 5, stream=20),  # another stream: not counted
        k("void at::native::elementwise_kernel<orphan>", 480, 10, 99),  # no launch in the trace
        host("FSDP::pre_forward (model.layers.0)", 0, 30, "user_annotation"), host("aten::to", 1, 20),
        host("aten::_to_copy", 2, 15), host("aten::copy_", 3, 10), host("cudaLaunchKernel", 4, 2, "cuda_runtime", 1),
        host("aten::mm", 31, 5), host("cudaLaunchKernel", 32, 2, "cuda_runtime", 2),
        host("shardfit::logprob_head", 40, 50, "user_annotation"), host("aten::mm", 41, 5),
        host("cudaLaunchKernel", 42, 2, "cuda_runtime", 3), host("cudaLaunchKernel", 50, 2, "cuda_runtime", 4),
        host("cudaLaunchKernel", 51, 2, "cuda_runtime", 5),
    ]
    r = time_by_region(events, [("fsdp", ("FSDP::",)), ("head", ("shardfit::logprob_head",))])
    assert r == {"elsewhere": {"matmul": 0.3, "other": 0.01, "total": 0.31},
                 "head": {"matmul": 0.1, "compiled fusion": 0.03, "total": 0.13},
                 "fsdp": {"other": 0.04, "total": 0.04}}
    assert time_by_region([events[-1]], []) == {}
