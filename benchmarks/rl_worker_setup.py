"""What the worker processes of benchmarks/bench_rl.py (bench_rl_workers.py) share: the shapes as Engine
overrides, the JSON lines they print and their timing (`shardfit serve` as a child: serve_process.py).

Shapes: the anchor's SHAPES, key for key, as Engine overrides (bench_rl.py's JSON compares the parameter counts);
MOE the Qwen3-30B-A3B shape (bench_moe.py's constants) and a tiny one for CPU checks. Timing: one warm-up call over
the longest and the shortest sequence, then --reps calls between device syncs; tokens/s counts the anchor's real
tokens (prompt + response).
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import rollouts as ro  # noqa: E402

QWEN3 = ["--model.qk_norm=true", "--model.rope_theta=1000000", "--model.norm_eps=1e-6"]
BIG = [*QWEN3, "--model.vocab_size=151936", "--model.n_kv_heads=8", "--model.head_dim=128"]
# the anchor's SHAPES, key for key (the part's JSON compares the parameter counts), plus 4b for --serve-shape
SHAPES = {
    "8b": [*BIG, "--model.dim=4096", "--model.n_layers=36", "--model.n_heads=32", "--model.ffn_dim=12288",
           "--model.tie_embeddings=false"],
    "4b": [*BIG, "--model.dim=2560", "--model.n_layers=36", "--model.n_heads=32", "--model.ffn_dim=9728",
           "--model.tie_embeddings=true", "--compute.activation_checkpoint=full"],  # 60 GiB of states: AC on H100
    "1.7b": [*BIG, "--model.dim=2048", "--model.n_layers=28", "--model.n_heads=16", "--model.ffn_dim=6144",
             "--model.tie_embeddings=true"],
    "tiny": [*QWEN3, "--model.vocab_size=3000", "--model.dim=256", "--model.n_layers=2", "--model.n_heads=4",
             "--model.n_kv_heads=2", "--model.head_dim=64", "--model.ffn_dim=512", "--model.tie_embeddings=false"],
}
MOE = {"big": dict(vocab=151936, hidden=2048, heads=32, kv=4, head_dim=128, experts=128, topk=8, inner=768),
       "tiny": dict(vocab=3000, hidden=64, heads=4, kv=2, head_dim=16, experts=8, topk=2, inner=32)}
PPO_CFG = {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2, "normalize": "token_mean"}
ADAM = dict(learning_rate=1e-6, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01, grad_clip_norm=1.0)  # E's AdamW
LORA_RANK = 16  # the anchor's part D: LoRA r=16 alpha 32 on all 7 linear layers
TAG = "rlbench"  # workers' JSON lines: {"rlbench": KIND, ...}


def vocab_of(shape: str) -> int:
    return 3000 if shape == "tiny" else 151936


def moe_overrides(layers: int, tiny: bool) -> list[str]:
    m = MOE["tiny" if tiny else "big"]
    out = ["--model.name=qwen3-30b-a3b", f"--model.n_layers={layers}"]
    if tiny:
        out += [f"--model.vocab_size={m['vocab']}", f"--model.dim={m['hidden']}", f"--model.n_heads={m['heads']}",
                f"--model.n_kv_heads={m['kv']}", f"--model.head_dim={m['head_dim']}", "--model.ffn_dim=128",
                f"--model.n_experts={m['experts']}", f"--model.experts_per_token={m['topk']}",
                f"--model.moe_ffn_dim={m['inner']}"]
    return out


def lora_overrides(rank: int) -> list[str]:
    """LoRA of rank `rank` on the 7 linear layers of every block (alpha 2 x rank), with full checkpointing as the
    anchor's part D runs it (17k-token rows of the 8B shape do not fit without: 73 GB of activations); none for 0."""
    return [f"--lora.rank={rank}", f"--lora.alpha={2 * rank}", "--compute.activation_checkpoint=full"] if rank else []


def engine_overrides(a, shape: str, T: int, run_dir: Path, lora: int = 0) -> list[str]:
    """The Engine's config for a shape (`moe` or a SHAPES key), LoRA of rank `lora` (0: every parameter trains): the
    same list for in-process and `shardfit serve`."""
    gpu = a.device == "cuda"
    ov = moe_overrides(a.moe_layers, not gpu) if shape == "moe" else list(SHAPES[shape])
    ov += [f"--train.micro_batch_tokens={T}", f"--data.seq_len={min(T, 4096)}", f"--model.max_seq_len={max(T, 40960)}",
           f"--train.device={a.device}", f"--logging.run_dir={run_dir}", "--logging.progress=none"]
    if gpu:
        ov.append("--compute.compile=true")
        if shape == "moe":
            ov.append("--parallel.overlap_optimizer=true")  # moe1's fastest shardfit case
    return [*ov, *lora_overrides(lora), *a.sf_extra.split()]


def emit(kind: str, **kw) -> None:
    print(json.dumps({TAG: kind, **kw}), flush=True)


def guarded(kind: str, fn) -> None:
    """fn(), a profile after the worker's figures: a failure is one line of `kind` with its error, not the
    worker's end."""
    try:
        fn()
    except Exception as e:  # noqa: BLE001 (recorded)
        emit(kind, error=f"{type(e).__name__}: {str(e)[:300]}")



# ---------------------------------------------------------------------------------------------- timing
def _cuda():
    import torch

    on = torch.cuda.is_available()

    def sync():
        if on:
            torch.cuda.synchronize()

    def reset():
        if on:
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()

    def peaks() -> dict:
        if not on:
            return {}
        return dict(peak_alloc_GiB=round(torch.cuda.max_memory_allocated() / 2**30, 2),
                    peak_reserved_GiB=round(torch.cuda.max_memory_reserved() / 2**30, 2))
    return sync, reset, peaks


def timed(fn, warm, reps: int, sync, reset) -> tuple[object, float, list[float]]:
    """warm() once, then reps x fn() between syncs: (last result, warm-up seconds, timed seconds)."""
    t = time.perf_counter()
    warm()
    sync()
    warm_s = time.perf_counter() - t
    reset()
    times, res = [], None
    for _ in range(reps):
        sync()
        t = time.perf_counter()
        res = fn()
        sync()
        times.append(time.perf_counter() - t)
    return res, warm_s, times


def rate(r: ro.Rollouts, times: list[float]) -> dict:
    s = statistics.median(times)
    return dict(times_s=[round(x, 3) for x in times], step_s=round(s, 3), real_tok_s=round(r.real_tokens / s),
                resp_tok_s=round(r.response_tokens / s))


def warm_idx(r: ro.Rollouts) -> list[int]:
    lens = [len(s) for s in r.seqs]
    return [lens.index(max(lens)), lens.index(min(lens))]
