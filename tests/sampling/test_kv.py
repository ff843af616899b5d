"""The paged KV cache (sampling/kv.py): the allocator's reference counts, copy-on-write of a block's contents, the
pool sized from memory, and attention over a row's blocks equal to the dense cache's attention."""

import pytest
import torch

from shardfit.config.schema import ModelConfig
from shardfit.models.decoder import cached_attention
from shardfit.sampling.attention import gather_attention
from shardfit.sampling.kv import BlockAllocator, PagedKV, block_bytes, blocks_for_memory


def test_allocator_counts_references_and_frees_on_the_last():
    a = BlockAllocator(3)
    b0, b1, b2 = a.allocate(), a.allocate(), a.allocate()
    assert (b0, b1, b2) == (0, 1, 2) and a.allocate() is None and a.n_free == 0
    a.share(b1)
    a.share(b1)
    assert a.refs == [1, 3, 1]
    a.release(b1)
    a.release(b1)
    assert a.n_free == 0  # one holder left
    a.release_all([b0, b1, b2])
    assert a.n_free == 3 and a.refs == [0, 0, 0]
    assert a.allocate() in (0, 1, 2)


def test_copy_block_copies_every_layer_and_sizes_from_memory():
    cfg = ModelConfig(vocab_size=50, dim=32, n_layers=3, n_heads=4, n_kv_heads=2, ffn_dim=64, max_seq_len=64)
    kv = PagedKV(cfg, 6, 4, torch.float32, "cpu")
    for layer in range(3):
        kv.k[layer][2].normal_()
        kv.v[layer][2].normal_()
    kv.copy_block(2, 5)
    assert all(torch.equal(kv.k[i][5], kv.k[i][2]) and torch.equal(kv.v[i][5], kv.v[i][2]) for i in range(3))
    assert block_bytes(cfg, torch.bfloat16, 16) == 2 * 3 * 16 * 2 * 8 * 2
    assert blocks_for_memory(10 * 2 ** 20, 0.5, cfg, torch.bfloat16, 16) == (5 * 2 ** 20) // (2 * 3 * 16 * 2 * 8 * 2)
    assert kv.describe() == ("KV cache: 6 blocks of 4 tokens = 24 tokens, 0.00 GiB (torch.float32, gather "
                             "attention)")


def test_attention_over_scattered_blocks_is_the_dense_caches():
    """Two rows of 11 and 6 cached tokens in blocks of 4 scattered over the pool, 3 new queries each at their own
    positions (a prefill chunk): the dense cache's causal attention over the row's tokens."""
    torch.manual_seed(0)
    H, K, Dh, bs = 4, 2, 8, 4
    pool_k, pool_v = torch.zeros(9, bs, K, Dh), torch.zeros(9, bs, K, Dh)
    lengths, tables = [11, 6], [[5, 0, 7], [3, 1, 8]]  # row 1's third entry: the padding (trash) block
    dense = []
    for length, table in zip(lengths, tables):
        k, v = torch.randn(1, length, K, Dh), torch.randn(1, length, K, Dh)
        for t in range(length):
            pool_k[table[t // bs], t % bs], pool_v[table[t // bs], t % bs] = k[0, t], v[0, t]
        dense.append((k, v))
    pool_k[8].normal_()  # whatever the trash block holds stays hidden
    q = torch.randn(2, 3, H, Dh)
    positions = torch.tensor([[8, 9, 10], [3, 4, 5]])
    out = gather_attention(q, pool_k, pool_v, torch.tensor(tables), positions)
    for b, (k, v) in enumerate(dense):
        torch.testing.assert_close(out[b:b + 1], cached_attention(q[b:b + 1], k, v), rtol=1e-5, atol=1e-6)


def test_a_fresh_chunk_attends_as_the_gather_path_and_fills_the_pool():
    """Prompts' first chunks (PagedKV.bind fresh: rows at positions 0 .., padding after the real tokens) through
    causal attention over their own keys: the gather path's output for every real query, and the same pool
    contents (the keys written for the next chunk and the decode steps)."""
    torch.manual_seed(1)
    cfg = ModelConfig(vocab_size=50, dim=32, n_layers=1, n_heads=4, n_kv_heads=2, ffn_dim=64, max_seq_len=64)
    bs, real_len = 4, [7, 3]  # row 1: 3 real tokens, 4 of padding (keys to the trash block)
    positions = torch.tensor([list(range(7)), [0, 1, 2, 0, 0, 0, 0]])
    real = positions.new_tensor([[True] * 7, [True] * 3 + [False] * 4]).bool()
    tables = torch.tensor([[2, 0], [4, 6]])  # [J, M]: row 1's second block the padding's place
    q, k, v = torch.randn(2, 7, 4, 8), torch.randn(2, 7, 2, 8), torch.randn(2, 7, 2, 8)
    from shardfit.sampling.step import slot_mapping

    outs, pools = [], []
    for fresh in (False, True):
        kv = PagedKV(cfg, 7, bs, torch.float32, "cpu")
        slots = slot_mapping(tables, positions, bs, kv.trash, real)
        kv.bind(positions, slots, torch.where(tables == 6, kv.trash, tables), fresh=fresh)
        outs.append(kv.attend(0, q, k, v))
        pools.append((kv.k[0][:kv.trash].clone(), kv.v[0][:kv.trash].clone()))
    for b, n in enumerate(real_len):
        torch.testing.assert_close(outs[1][b, :n], outs[0][b, :n], rtol=1e-5, atol=1e-6)
    assert all(torch.equal(a, b) for a, b in zip(pools[0], pools[1]))


@pytest.mark.slow  # FlexAttention compiles (~15 s on 2 idle cores)
def test_flex_attention_is_the_gather_paths():
    from shardfit.sampling.attention import flex_attention_paged, flex_block_mask

    torch.manual_seed(0)
    pool_k, pool_v = torch.randn(9, 4, 2, 16), torch.randn(9, 4, 2, 16)
    tables = torch.tensor([[5, 0, 7, 8], [3, 1, 8, 8]])  # 8: the trash block
    q = torch.randn(2, 3, 4, 16)
    positions = torch.tensor([[8, 9, 10], [3, 4, 5]])
    torch.testing.assert_close(flex_attention_paged(q, pool_k, pool_v, tables, flex_block_mask(positions, 16)),
                               gather_attention(q, pool_k, pool_v, tables, positions), rtol=1e-5, atol=1e-6)
