"""The decode RoPE kernel (kernels/rope.py) under Triton's interpreter against models/decoder.py's apply_rope: bit for
bit (the eager form's three roundings reproduced: here in fp16, the interpreter's numpy having no bf16), a head count
that is not a power of two, cos/sin broadcast over the batch; a head size it does not take is refused."""

import pytest
import torch

from shardfit.models.decoder import apply_rope


@pytest.fixture
def interpreted(monkeypatch):
    pytest.importorskip("triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")


@pytest.mark.parametrize("B,S,H,Dh,dtype", [(3, 1, 6, 32, torch.float16), (2, 2, 4, 16, torch.float32)],
                         ids=["decode-fp16-6-heads", "two-tokens-fp32"])
def test_kernel_is_apply_rope_bit_for_bit(interpreted, B, S, H, Dh, dtype):
    from shardfit.kernels.rope import rope

    g = torch.Generator().manual_seed(0)
    x = (torch.randn(B, S, H * Dh, generator=g) * 2).to(dtype).view(B, S, H, Dh)  # as a projection's view
    angles = torch.rand(B, S, Dh // 2, generator=g) * 50
    emb = torch.cat((angles, angles), -1)
    cos, sin = emb.cos().to(dtype), emb.sin().to(dtype)
    got = rope(x, cos, sin)
    assert got.dtype == dtype
    assert torch.equal(got, apply_rope(x, cos, sin))


def test_head_sizes_it_does_not_take(interpreted):
    from shardfit.kernels.rope import fits, rope

    assert fits(128) and fits(64) and not fits(80) and not fits(2)
    x = torch.zeros(1, 1, 2, 80)
    with pytest.raises(ValueError, match="not twice a power of two"):
        rope(x, torch.zeros(1, 1, 80), torch.zeros(1, 1, 80))


@pytest.mark.parametrize("norm", [True, False], ids=["qwen3-norms", "llama-no-norm"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_qk_rope_is_norm_rope(interpreted, norm, dtype):
    """qk_rope (q and k, their per-head norms and RoPE in one launch) against models/decoder.py's norm_rope with the
    RMSNorm modules: without the norms bit for bit (the rope kernel's roundings); with them to the norm's reduction
    order (kernels/rms_norm.py's tolerance). Head counts not a power of two; the weights of the tensors' dtype."""
    from shardfit.kernels.rope import qk_rope
    from shardfit.models.decoder import RMSNorm, norm_rope

    g = torch.Generator().manual_seed(3)
    B, S, H, K, Dh = 3, 1, 6, 3, 32
    q = (torch.randn(B, S, H * Dh, generator=g) * 3).to(dtype).view(B, S, H, Dh)
    k = (torch.randn(B, S, K * Dh, generator=g) * 3).to(dtype).view(B, S, K, Dh)
    angles = torch.rand(B, S, Dh // 2, generator=g) * 50
    emb = torch.cat((angles, angles), -1)
    cos, sin = emb.cos().to(dtype), emb.sin().to(dtype)
    norms = (None, None)
    if norm:
        norms = tuple(RMSNorm(Dh, 1e-6).to(dtype) for _ in range(2))
        for n in norms:
            n.weight.data = (torch.rand(Dh, generator=g) + 0.5).to(dtype)
    with torch.no_grad():
        want_q, want_k = norm_rope(q, k, cos, sin, *norms)
        got_q, got_k = qk_rope(q, k, cos, sin, *((norms[0].weight, norms[1].weight, 1e-6) if norm else ()))
    assert got_q.dtype == got_k.dtype == dtype and got_q.shape == q.shape and got_k.shape == k.shape
    if norm:
        tol = 1e-3 if dtype == torch.float16 else 1e-5
        torch.testing.assert_close(got_q, want_q, rtol=tol, atol=tol)
        torch.testing.assert_close(got_k, want_k, rtol=tol, atol=tol)
    else:
        assert torch.equal(got_q, want_q) and torch.equal(got_k, want_k)
    with pytest.raises(ValueError, match="not taken"):
        qk_rope(q, k.float() if dtype != torch.float32 else k.half(), cos, sin)
