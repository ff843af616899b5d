"""kernels/multi_lora.py: every token through its own slot's adapter, against a loop over tokens; slot -1 adds
exactly nothing; adapters of lower rank padded to the bank's rank with zeros; the embedding's banked form."""

import pytest
import torch
import torch.nn.functional as F

from shardfit.kernels.multi_lora import multi_lora, multi_lora_embedding, slot_columns, stack_bank

S, R, IN, OUT, N = 3, 8, 24, 20, 11
RANKS = (8, 4, 2)  # slot s's adapter rank: padded to R in the bank


def _bank(dtype, g):
    """Per-slot adapters (A_s [r_s, in], B_s [out, r_s], scale_s) and the bank they fill, zero-padded to R."""
    adapters, a, b = [], torch.zeros(S, R, IN), torch.zeros(S, OUT, R)
    for s, r in enumerate(RANKS):
        a_s, b_s = torch.randn(r, IN, generator=g), torch.randn(OUT, r, generator=g)
        adapters.append((a_s.to(dtype), b_s.to(dtype), 16.0 / r))
        a[s, :r], b[s, :, :r] = a_s, b_s
    return adapters, a.to(dtype), b.to(dtype), torch.tensor([16.0 / r for r in RANKS], dtype=dtype)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_each_token_gets_its_own_slots_adapter(dtype, device):
    g = torch.Generator().manual_seed(0)
    adapters, a, b, scale = _bank(dtype, g)
    x = torch.randn(N, IN, generator=g).to(dtype)
    slot = torch.tensor([0, 1, 2, -1, 2, 0, -1, 1, 1, 0, 2])
    a_all, b_all = (t.to(device) for t in stack_bank(a, b))
    got = multi_lora(x.to(device), a_all, b_all, slot_columns(slot.to(device), scale.to(device), R)).cpu()
    assert got.shape == (N, OUT) and got.dtype == dtype
    for n in range(N):
        s = int(slot[n])
        if s < 0:
            assert torch.equal(got[n], torch.zeros(OUT, dtype=dtype))  # exactly nothing: the base's output stays
            continue
        a_s, b_s, sc = adapters[s]
        want = (F.linear(F.linear(x[n].double(), a_s.double()), b_s.double()) * sc)
        tol = {"rtol": 1e-5, "atol": 1e-5} if dtype == torch.float32 else {"rtol": 2e-2, "atol": 0.5}
        torch.testing.assert_close(got[n].double(), want, **tol)


def test_slot_minus_one_leaves_the_base_output_bit_for_bit():
    g = torch.Generator().manual_seed(1)
    _, a, b, scale = _bank(torch.float32, g)
    base = torch.nn.Linear(IN, OUT)
    x = torch.randn(5, IN, generator=g)
    slot = torch.full((5,), -1)
    y = base(x) + multi_lora(x, *stack_bank(a, b), slot_columns(slot, scale, R))
    assert torch.equal(y, base(x))


def test_slot_columns_put_the_slots_scale_on_its_rank_columns_only():
    cols = slot_columns(torch.tensor([1, -1]), torch.tensor([2.0, 3.0, 5.0]), 2)
    assert cols.tolist() == [[0, 0, 3.0, 3.0, 0, 0], [0] * 6]


def test_the_banked_embedding_is_pefts_per_token():
    """PEFT's embedding adapter A [r, V], B [D, r]: delta = scale A^T[id] B^T, per token's slot."""
    g = torch.Generator().manual_seed(2)
    V, D = 30, 12
    a = torch.zeros(S, R, V)
    b = torch.zeros(S, D, R)
    for s, r in enumerate(RANKS):
        a[s, :r], b[s, :, :r] = torch.randn(r, V, generator=g), torch.randn(D, r, generator=g)
    scale = torch.tensor([0.5, 2.0, 4.0])
    ids, slot = torch.tensor([3, 7, 3, 29, 0]), torch.tensor([0, 2, -1, 1, 2])
    a_t = a.permute(2, 0, 1).reshape(V, S * R)  # [V, S*R]: slot s's A^T in columns s*R:(s+1)*R
    got = multi_lora_embedding(ids, a_t, stack_bank(a, b)[1], slot_columns(slot, scale, R))
    for n in range(len(ids)):
        s = int(slot[n])
        want = torch.zeros(D) if s < 0 else a[s][:, ids[n]] @ b[s].t() * scale[s]
        torch.testing.assert_close(got[n], want, rtol=1e-5, atol=1e-5)
    assert torch.equal(got[2], torch.zeros(D))


def test_the_grouped_form_gives_each_routed_row_its_experts_adapter_of_its_slot():
    """MoE experts: rows sorted by expert, expert e's bank [S*R, in] / [out, S*R]; each row through the adapter of
    its expert and its token's slot (models/moe.py's split_linear as the grouped matmul)."""
    import functools

    from shardfit.kernels.multi_lora import multi_lora_grouped
    from shardfit.models.moe import split_linear

    g = torch.Generator().manual_seed(3)
    E, sizes = 3, [2, 0, 4]
    a = torch.randn(E, S, R, IN, generator=g)  # per expert, per slot
    b = torch.randn(E, S, OUT, R, generator=g)
    scale = torch.tensor([0.5, 1.0, 2.0])
    x = torch.randn(sum(sizes), IN, generator=g)
    slot = torch.tensor([2, -1, 0, 1, 2, 0])
    experts = [e for e, n in enumerate(sizes) for _ in range(n)]
    a_bank = a.reshape(E, S * R, IN)
    b_bank = b.permute(0, 2, 1, 3).reshape(E, OUT, S * R)
    got = multi_lora_grouped(x, a_bank, b_bank, slot_columns(slot, scale, R),
                             functools.partial(split_linear, sizes=sizes))
    for n, (e, s) in enumerate(zip(experts, slot.tolist())):
        want = torch.zeros(OUT) if s < 0 else b[e, s] @ (a[e, s] @ x[n]) * scale[s]
        torch.testing.assert_close(got[n], want, rtol=1e-5, atol=1e-4)
