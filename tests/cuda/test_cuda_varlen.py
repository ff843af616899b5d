"""GPU tests of document-masked attention: the CUDA kernels against the dense reference, and packed training with
compile and checkpointing. Run on the device machine (`pytest -m cuda tests/cuda`)."""

import pytest
import torch

from shardfit.models.attention import DocumentMask, sdpa_attention, varlen_available
from shardfit.train import Trainer
from tests._dist import run_ranks
from tests.helpers import full_state, reference_train, small_config

pytestmark = pytest.mark.cuda


def _positions(rows: list[list[int]]) -> torch.Tensor:
    return torch.cat([torch.cat([torch.arange(n) for n in row])[None] for row in rows])


@pytest.mark.parametrize("kernel", ["varlen", "flex"])
def test_kernel_matches_dense_reference_forward_and_backward(kernel):
    if kernel == "varlen" and not varlen_available():
        pytest.skip("torch.nn.attention.varlen is not in this release")
    dev = torch.device("cuda")
    positions = _positions([[300, 1000, 48, 700, 2048], [4096]])  # [2, 4096]: long, short and one whole-row document
    torch.manual_seed(0)
    q = torch.randn(2, 4096, 8, 128, device=dev, dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(2, 4096, 2, 128, device=dev, dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn(2, 4096, 2, 128, device=dev, dtype=torch.bfloat16, requires_grad=True)
    grad = torch.randn(2, 4096, 8, 128, device=dev, dtype=torch.bfloat16)

    def run(kind):
        out = sdpa_attention(q, k, v, DocumentMask.build(positions, kind, dev))
        gq, gk, gv = torch.autograd.grad(out, (q, k, v), grad)
        return out.float(), gq.float(), gk.float(), gv.float()

    for got, want in zip(run(kernel), run("sdpa")):
        torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2)


def _train(rank, world, extra, run_dir):
    trainer = Trainer(small_config("--train.device=cuda", *extra, run_dir=run_dir))
    history = trainer.fit()
    state = full_state(trainer.model)
    return {"losses": [h["loss"] for h in history],
            "state": {k: v.float().tolist() for k, v in state.items()} if rank == 0 else None}


def test_masked_fp32_training_matches_the_dense_reference(tmp_path):
    """Packed pretraining (the embedded corpus: documents start inside windows) with FlexAttention on 2 GPUs equals
    the single-process reference that uses the dense mask (fp32; FlashAttention's varlen kernel has no fp32 path,
    its bf16 numerics are checked above)."""
    extra = ["--compute.param_dtype=float32", "--train.micro_batch=2", "--compute.doc_attention=flex",
             "--compute.activation_checkpoint=selective"]
    res = run_ranks(_train, min(2, torch.cuda.device_count()), extra, str(tmp_path), backend="nccl")
    torch.backends.cuda.matmul.allow_tf32 = False
    _, ref_losses = reference_train(small_config("--train.device=cuda", *extra), device="cuda")
    torch.testing.assert_close(torch.tensor(res[0]["losses"]), torch.tensor(ref_losses), rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize("kernel", ["varlen", "flex"])
def test_compiled_packed_sft_learns_with_token_budgets(tmp_path, kernel):
    """Fine-tuning examples of mixed lengths in token-budget rows, compiled blocks, full checkpointing: the loss
    falls, and compile does not recompile per micro-batch (a recompile per step would take minutes here)."""
    if kernel == "varlen" and not varlen_available():
        pytest.skip("torch.nn.attention.varlen is not in this release")
    import json

    rng = torch.Generator().manual_seed(0)
    with open(tmp_path / "sft.jsonl", "w") as f:
        for _ in range(400):
            n, m = (int(x) for x in torch.randint(4, 60, (2,), generator=rng))
            f.write(json.dumps({"prompt": "q" * n + "?", "completion": "ab" * (m // 2)}) + "\n")
    extra = [f"--data.path={tmp_path / 'sft.jsonl'}", "--data.seq_len=128", "--train.micro_batch_tokens=512",
             "--train.global_batch=16", "--train.steps=25", f"--compute.doc_attention={kernel}",
             "--compute.compile=true", "--compute.activation_checkpoint=full", "--model.max_seq_len=128"]
    res = run_ranks(_train, min(2, torch.cuda.device_count()), extra, str(tmp_path / "run"), backend="nccl",
                    timeout=600)
    losses = res[0]["losses"]
    assert losses[-1] < 0.6 * losses[0], losses


def test_cudnn_docs_matches_flex_without_gradients_eager_and_compiled():
    """cudnn_docs (per-document SDPA, cuDNN first) against flex, bf16, no gradients: eagerly and inside a compiled
    function (Inductor; the operator's host document table as an input), which two layouts with other document
    counts run without a recompilation. cuDNN alone can take the per-document calls, so it is the backend used."""
    from torch._dynamo.testing import CompileCounterWithBackend
    from torch.nn.attention import SDPBackend, sdpa_kernel

    dev = torch.device("cuda")
    torch.manual_seed(0)
    q = torch.randn(2, 4096, 8, 128, device=dev, dtype=torch.bfloat16)
    k = torch.randn(2, 4096, 2, 128, device=dev, dtype=torch.bfloat16)
    v = torch.randn(2, 4096, 2, 128, device=dev, dtype=torch.bfloat16)
    count = CompileCounterWithBackend("inductor")
    compiled = torch.compile(lambda q, k, v, m: sdpa_attention(q, k, v, m), backend=count)
    layouts = [[[300, 1000, 48, 700, 2048], [4096]], [[1, 4095], [17, 2000, 79, 1000, 1000]]]
    with torch.no_grad():
        for rows in layouts:
            positions = _positions(rows)
            mask = DocumentMask.build(positions, "cudnn_docs", dev)
            want = sdpa_attention(q, k, v, DocumentMask.build(positions, "flex", dev)).float()
            torch.testing.assert_close(sdpa_attention(q, k, v, mask).float(), want, rtol=2e-2, atol=2e-2)
            torch.testing.assert_close(compiled(q, k, v, mask).float(), want, rtol=2e-2, atol=2e-2)
        assert count.frame_count == 1, count.frame_count
        b, s, e = mask.docs[-1]
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):  # raises where cuDNN cannot take this call
            alone = torch.nn.functional.scaled_dot_product_attention(
                *(t[b:b + 1, s:e].transpose(1, 2) for t in (q, k, v)), is_causal=True, enable_gqa=True)
        assert torch.equal(sdpa_attention(q, k, v, mask)[b:b + 1, s:e], alone.transpose(1, 2))


def test_flex_with_prefix_tree_branches_matches_the_dense_reference_forward_and_backward():
    """Shared prefixes (models/attention.py "Branches") through the compiled FlexAttention kernel and its block lists
    (cross-branch blocks skipped, mixed blocks partial) against the dense mask, forward and backward, bf16: trees of a
    512-token prompt and two 512-token answers (bench_dpo's pairs), one tree of short branches, a plain document."""
    dev = torch.device("cuda")
    trees = [(511, [512, 512]), (511, [512, 512]), (40, [7, 300, 90]), (200, [])]
    pos, br = [], []
    for trunk, branches in trees:
        pos.append(torch.arange(trunk))
        br.append(torch.zeros(trunk, dtype=torch.long))
        for k, n in enumerate(branches, 1):
            pos.append(torch.arange(trunk, trunk + n))
            br.append(torch.full((n,), k, dtype=torch.long))
    positions, branch = torch.cat(pos)[None], torch.cat(br)[None]
    S = positions.shape[1]
    torch.manual_seed(0)
    q = torch.randn(1, S, 8, 128, device=dev, dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(1, S, 2, 128, device=dev, dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn(1, S, 2, 128, device=dev, dtype=torch.bfloat16, requires_grad=True)
    grad = torch.randn(1, S, 8, 128, device=dev, dtype=torch.bfloat16)

    def run(kind):
        out = sdpa_attention(q, k, v, DocumentMask.build(positions, kind, dev, branch=branch))
        gq, gk, gv = torch.autograd.grad(out, (q, k, v), grad)
        return out.float(), gq.float(), gk.float(), gv.float()

    for got, want in zip(run("flex"), run("sdpa")):
        torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2)
