"""The paged decode attention kernel (kernels/paged_attention.py) under Triton's interpreter against SDPA over each
row's keys gathered by hand: grouped heads (G = 4, 1, 3), lengths that end inside a block and at one key, splits
that leave some programs without a key, a table padded past the row's blocks."""

import math

import pytest
import torch
import torch.nn.functional as F


@pytest.fixture
def interpreted(monkeypatch):
    pytest.importorskip("triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")


def _reference(q, k_pool, v_pool, tables, lengths):
    """Per row: its blocks in table order, the first `length` keys, SDPA in fp32 with each query head on its key
    head."""
    B, H, Dh = q.shape
    K = k_pool.shape[2]
    out = torch.empty(B, H, Dh)
    for b in range(B):
        n = int(lengths[b])
        k = k_pool[tables[b]].flatten(0, 1)[:n].float()  # [n, K, Dh]
        v = v_pool[tables[b]].flatten(0, 1)[:n].float()
        k, v = k.repeat_interleave(H // K, dim=1), v.repeat_interleave(H // K, dim=1)  # [n, H, Dh]
        o = F.scaled_dot_product_attention(q[b].float()[:, None], k.transpose(0, 1), v.transpose(0, 1))
        out[b] = o[:, 0]
    return out


def _case(B, H, K, Dh, bs, lengths, M, seed=0):
    g = torch.Generator().manual_seed(seed)
    n_blocks = B * M + 3
    k_pool = torch.randn(n_blocks, bs, K, Dh, generator=g).to(torch.bfloat16)
    v_pool = torch.randn(n_blocks, bs, K, Dh, generator=g).to(torch.bfloat16)
    q = torch.randn(B, H, Dh, generator=g).to(torch.bfloat16)
    tables = torch.randperm(n_blocks, generator=g)[:B * M].view(B, M)  # each row its own blocks, scattered
    return q, k_pool, v_pool, tables, torch.tensor(lengths)


@pytest.mark.parametrize("H,K", [(8, 2), (4, 4), (6, 2)], ids=["G4", "G1", "G3"])
@pytest.mark.parametrize("splits", [1, 3])
def test_kernel_equals_sdpa_over_the_rows_blocks(interpreted, H, K, splits):
    from shardfit.kernels.paged_attention import paged_decode_attention

    bs, M = 16, 6  # 96 keys a row at most; two tiles of 4 blocks
    q, kp, vp, tables, lengths = _case(3, H, K, 32, bs, [1, 37, 96], M)
    got = paged_decode_attention(q, kp, vp, tables, lengths, splits=splits)
    assert got.dtype == torch.bfloat16 and got.shape == q.shape
    want = _reference(q, kp, vp, tables, lengths)
    # bf16 operands into the dot products (as SDPA's GPU kernels), fp32 softmax: bf16's rounding of the output
    torch.testing.assert_close(got.float(), want, atol=2e-2, rtol=2e-2)


def test_splits_agree_and_a_split_without_keys_weighs_nothing(interpreted):
    from shardfit.kernels.paged_attention import combine, paged_decode_attention

    q, kp, vp, tables, lengths = _case(2, 8, 2, 32, 16, [5, 80], 8, seed=1)
    one = paged_decode_attention(q, kp, vp, tables, lengths, splits=1).float()
    four = paged_decode_attention(q, kp, vp, tables, lengths, splits=4, tile=1).float()  # row 0: 3 empty splits
    torch.testing.assert_close(four, one, atol=1e-2, rtol=1e-2)
    part = torch.randn(1, 1, 3, 16)
    lse = torch.tensor([[[0.5, float("-inf"), -1.0]]])
    w = torch.tensor([math.exp(0.5), 0.0, math.exp(-1.0)])
    got = combine(part, lse, torch.float32)
    torch.testing.assert_close(got[0, 0], (w[:, None] * part[0, 0]).sum(0) / w.sum())


def test_refuses_shapes_it_does_not_read(interpreted):
    from shardfit.kernels.paged_attention import paged_decode_attention

    q, kp, vp, tables, lengths = _case(2, 6, 4, 32, 16, [3, 4], 2)  # 6 heads over 4 key heads
    with pytest.raises(ValueError, match="do not fit"):
        paged_decode_attention(q, kp, vp, tables, lengths)


@pytest.mark.cuda
@pytest.mark.parametrize("splits", [None, 1])
def test_cuda_kernel_equals_sdpa_at_the_8b_heads(splits):
    """On the GPU (bf16 tensor-core dots): Qwen3-8B's 32 query / 8 key heads of 128, 16-token blocks, rows whose
    lengths end anywhere, the default split choice and one split."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from shardfit.kernels.paged_attention import paged_decode_attention

    q, kp, vp, tables, lengths = _case(5, 32, 8, 128, 16, [1, 17, 300, 511, 1024], 64, seed=2)
    got = paged_decode_attention(*(t.cuda() for t in (q, kp, vp, tables, lengths)), splits=splits)
    torch.testing.assert_close(got.float().cpu(), _reference(q, kp, vp, tables, lengths), atol=2e-2, rtol=2e-2)


def test_a_row_never_reads_past_its_tables_width(interpreted):
    """A padded batch entry's length can run past its table (its position runs on): the kernel reads the table's M
    columns only, never the next columns (here a poisoned block) nor past the tensor."""
    from shardfit.kernels.paged_attention import paged_decode_attention

    bs, M = 16, 3
    q, kp, vp, wide, _ = _case(2, 8, 2, 32, bs, [1, 1], M + 2, seed=2)
    poison = wide[:, M:].flatten()
    kp[poison], vp[poison] = float("nan"), float("nan")
    tables = wide[:, :M]  # a view: the poisoned columns lie right after each row's M
    full = torch.tensor([M * bs, M * bs])
    got = paged_decode_attention(q, kp, vp, tables, full + torch.tensor([40, 5 * bs]), splits=2)
    assert not got.isnan().any()
    torch.testing.assert_close(got.float(), paged_decode_attention(q, kp, vp, tables, full, splits=2).float())
