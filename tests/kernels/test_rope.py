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
