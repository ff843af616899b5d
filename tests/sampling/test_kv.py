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
