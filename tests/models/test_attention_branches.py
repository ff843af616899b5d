"""Shared prefixes (models/attention.py, "Branches"): a document packed as a prefix tree (the trunk once, then each
sequence's remainder) gives every sequence exactly the logits it gets alone, with the dense mask and FlexAttention's
block mask; the block lists never drop a block with a visible score and never call a block full that is not."""

import shutil

import pytest
import torch

from shardfit.models.attention import (
    FLEX_BLOCK,
    DocumentMask,
    _same_document_causal,
    document_block_mask,
    document_ids,
    sdpa_attention,
)
from tests.models.test_attention import FAMILIES, _model

CPU = torch.device("cpu")


def _tree_row(trees, vocab, seed=0):
    """trees: per document (trunk length, [branch lengths]) (no branches: a plain document of that length). ->
    ids [1, S], positions [1, S], branch [1, S], and each sequence as (its columns in the row, its ids [1, L])."""
    g = torch.Generator().manual_seed(seed)
    ids, pos, br, seqs = [], [], [], []
    for trunk, branches in trees:
        t_ids = torch.randint(0, vocab, (trunk,), generator=g)
        at = sum(len(x) for x in ids)
        ids.append(t_ids)
        pos.append(torch.arange(trunk))
        br.append(torch.zeros(trunk, dtype=torch.long))
        if not branches:
            seqs.append((list(range(at, at + trunk)), t_ids[None]))
        for k, n in enumerate(branches, 1):
            b_ids = torch.randint(0, vocab, (n,), generator=g)
            start = sum(len(x) for x in ids)
            ids.append(b_ids)
            pos.append(torch.arange(trunk, trunk + n))
            br.append(torch.full((n,), k, dtype=torch.long))
            seqs.append((list(range(at, at + trunk)) + list(range(start, start + n)),
                         torch.cat([t_ids, b_ids])[None]))
    return torch.cat(ids)[None], torch.cat(pos)[None], torch.cat(br)[None], seqs


TREES = [(9, [6, 4]), (5, []), (3, [7, 2, 5])]  # two trees and a plain document between them


@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize("kernel", ["sdpa", "flex"])
def test_each_sequence_of_a_prefix_tree_gets_its_own_logits(family, kernel):
    model = _model(FAMILIES[family])
    ids, pos, br, seqs = _tree_row(TREES, model.cfg.vocab_size)
    with torch.no_grad():
        tree = model(ids, position_ids=pos, mask=DocumentMask.build(pos, kernel, CPU, branch=br))[0]
        no_branches = model(ids, position_ids=pos, mask=DocumentMask.build(pos, kernel, CPU))[0]
        for cols, alone_ids in seqs:
            torch.testing.assert_close(tree[cols], model(alone_ids)[0], rtol=1e-5, atol=1e-5)
    # without the branch ids a second branch sees the first: the test above can fail
    cols, _ = seqs[1]
    assert not torch.allclose(no_branches[cols], tree[cols], atol=1e-3)


def test_a_kernel_without_branch_masks_is_refused_and_all_zero_branches_are_none():
    ids, pos, br, _ = _tree_row(TREES, 50)
    with pytest.raises(ValueError, match="varlen attention kernel has no mask for shared prefixes"):
        DocumentMask.build(pos, "varlen", CPU, branch=br)
    one = torch.arange(20)[None]
    assert DocumentMask.build(one, "sdpa", CPU, branch=torch.zeros_like(one)) is None  # one plain document


def _blocks(mask):
    """BlockMask -> [B, n, n] int: 0 unlisted, 1 partial, 2 full."""
    B, _, n = mask.kv_num_blocks.shape
    out = torch.zeros(B, n, n, dtype=torch.long)
    for code, num, idx in ((1, mask.kv_num_blocks, mask.kv_indices), (2, mask.full_kv_num_blocks,
                                                                      mask.full_kv_indices)):
        for b in range(B):
            for i in range(n):
                out[b, i, idx[b, 0, i, :num[b, 0, i]].long()] = code
    return out


# Trees laid on block edges and across them: branches of whole blocks (their cross-branch blocks skipped), long
# trunks (full blocks into a branch), many short branches inside one block, a short last block.
BLOCK_TREES = {
    "aligned": [(256, [128, 128, 128])],
    "crossing": [(200, [100, 300, 37]), (40, []), (10, [60, 70])],
    "short branches": [(20, [3] * 30), (7, [5, 9])],
}


@pytest.mark.parametrize("layout", sorted(BLOCK_TREES))
def test_branch_block_mask_lists_every_visible_block_and_only_whole_blocks_as_full(layout):
    _, pos, br, _ = _tree_row(BLOCK_TREES[layout], 50)
    S = pos.shape[1]
    doc = document_ids(pos)
    mod = _same_document_causal(doc, br, CPU)
    q, k = torch.arange(S)[:, None], torch.arange(S)[None, :]
    element = mod(0, 0, q, k)  # [S, S] the scores each query sees
    n = -(-S // FLEX_BLOCK)
    pad = torch.zeros(n * FLEX_BLOCK, n * FLEX_BLOCK, dtype=torch.bool)
    pad[:S, :S] = element
    per_block = pad.view(n, FLEX_BLOCK, n, FLEX_BLOCK).permute(0, 2, 1, 3).flatten(2)  # [n, n, 128 * 128]
    real = torch.zeros_like(pad)
    real[:S, :S] = True
    real = real.view(n, FLEX_BLOCK, n, FLEX_BLOCK).permute(0, 2, 1, 3).flatten(2)
    listed = _blocks(document_block_mask(doc, CPU, br))[0]
    visible = per_block.any(-1)
    whole = (per_block | ~real).all(-1) & real.all(-1)  # every score of a whole block seen
    assert bool((listed[visible] > 0).all()), "a block with a visible score is not listed"
    assert bool(whole[listed == 2].all()), "a block listed as full hides scores"
    if layout == "aligned":  # a query block of branch 2 against a key block of branch 1: skipped
        assert int(listed[3, 2]) == 0 and bool(visible.sum() > 0)
    if layout != "short branches":  # 131 tokens: two blocks, the second short (never full)
        assert int((listed == 2).sum()) > 0


def test_compiled_flex_with_branches_equals_the_dense_reference():
    from shardfit.models.attention import _compiled_flex

    if not shutil.which("g++"):
        pytest.skip("Inductor's CPU FlexAttention needs a C++ compiler")
    torch.manual_seed(0)
    _, pos, br, _ = _tree_row(BLOCK_TREES["crossing"], 50)
    S = pos.shape[1]
    q, k, v = torch.randn(1, 4, S, 16), torch.randn(1, 2, S, 16), torch.randn(1, 2, S, 16)  # [B, H|K, S, Dh]
    mask = DocumentMask.build(pos, "flex", CPU, branch=br).block_mask
    out = _compiled_flex()(q, k, v, block_mask=mask, enable_gqa=True)
    ref = sdpa_attention(*(t.transpose(1, 2) for t in (q, k, v)), DocumentMask.build(pos, "sdpa", CPU, branch=br))
    torch.testing.assert_close(out.transpose(1, 2), ref, rtol=1e-5, atol=1e-5)


def test_the_packed_branch_ids_see_what_document_and_branch_apart_see():
    """The mask_mod packs (document, branch) into one int32 a token; it must allow exactly the pairs the two ids
    apart allow: same document, key not after the query, key in the trunk or in the query's branch (documents from
    -1, padding's id in some callers, to large ones; branches to 65,535)."""
    gen = torch.Generator().manual_seed(0)
    S = 300
    doc = torch.sort(torch.randint(-1, 40, (2, S), generator=gen), dim=1).values
    doc[1, :50] = 20_000
    doc[1] = torch.sort(doc[1]).values
    branch = torch.randint(0, 4, (2, S), generator=gen)
    branch[0, ::7] = 65_535
    mod = _same_document_causal(doc, branch, CPU)
    q, k = torch.arange(S)[:, None], torch.arange(S)[None, :]
    for b in range(2):
        got = mod(b, 0, q, k)
        key, query = branch[b][None, :], branch[b][:, None]
        want = (doc[b][:, None] == doc[b][None, :]) & (q >= k) & ((key == 0) | (key == query))
        assert torch.equal(got, want)
    with pytest.raises(ValueError, match="branch mask"):
        _same_document_causal(doc, branch + 65_536, CPU)
