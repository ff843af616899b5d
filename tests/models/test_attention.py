"""Document masking: a packed row gives each document exactly the logits it gets alone (fp32, every family), with
the dense-mask reference, FlexAttention's block mask, and under Ulysses sequence parallelism on 2 gloo ranks."""

import pytest
import torch
import torch.distributed as dist

from shardfit.config import load_config
from shardfit.config.schema import ParallelConfig
from shardfit.models import build_model
from shardfit.models.attention import DocumentMask
from tests._dist import run_ranks

BASE = ["--model.dim=64", "--model.n_layers=2", "--model.n_heads=4", "--model.n_kv_heads=2", "--model.ffn_dim=96",
        "--model.vocab_size=300", "--model.max_seq_len=128", "--data.seq_len=64"]
FAMILIES = {
    "llama": ["--model.tie_embeddings=false"],
    "qwen2": ["--model.qkv_bias=true"],
    "qwen3": ["--model.qk_norm=true", "--model.head_dim=32"],
    "mistral": ["--model.sliding_window=64"],
    "qwen3_moe": ["--model.qk_norm=true", "--model.n_experts=8", "--model.experts_per_token=2",
                  "--model.moe_ffn_dim=32", "--model.dense_layers=0"],
}
DOCS = [[7, 13, 5, 11], [20, 16]]  # document lengths of two packed rows of 36 tokens


def _packed(vocab: int, seed: int = 0):
    """ids [2, 36], position ids restarting at each document, and the documents alone as (row, start, ids [1, n])."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (len(DOCS), sum(DOCS[0])), generator=g)
    positions = torch.cat([torch.cat([torch.arange(n) for n in row])[None] for row in DOCS])
    docs, start = [], 0
    for r, row in enumerate(DOCS):
        start = 0
        for n in row:
            docs.append((r, start, ids[r:r + 1, start:start + n]))
            start += n
    return ids, positions, docs


def _model(extra):
    cfg = load_config(None, BASE + extra).model
    model = build_model(cfg)
    model.init_weights(seed=3)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(".bias"):
                p.normal_(0, 0.1)
    return model.eval()


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_packed_row_gives_each_document_its_own_logits(family):
    model = _model(FAMILIES[family])
    ids, positions, docs = _packed(model.cfg.vocab_size)
    with torch.no_grad():
        packed = model(ids, position_ids=positions, mask=DocumentMask.build(positions, "sdpa", torch.device("cpu")))
        unmasked = model(ids)
        for r, start, doc in docs:
            alone = model(doc)[0]
            torch.testing.assert_close(packed[r, start:start + doc.shape[1]], alone, rtol=1e-5, atol=1e-5)
    # Without the mask the later documents see the earlier ones: the test above can fail.
    r, start, doc = docs[1]
    assert not torch.allclose(unmasked[r, start:start + doc.shape[1]], packed[r, start:start + doc.shape[1]],
                              atol=1e-3)


def test_flex_block_mask_equals_the_dense_reference():
    torch.manual_seed(0)
    _, positions, _ = _packed(300)
    q, k, v = torch.randn(2, 36, 4, 16), torch.randn(2, 36, 2, 16), torch.randn(2, 36, 2, 16)
    from shardfit.models.attention import sdpa_attention

    cpu = torch.device("cpu")
    ref = sdpa_attention(q, k, v, DocumentMask.build(positions, "sdpa", cpu))
    flex = sdpa_attention(q, k, v, DocumentMask.build(positions, "flex", cpu))
    torch.testing.assert_close(flex, ref, rtol=1e-5, atol=1e-5)


def test_one_document_per_row_needs_no_mask():
    positions = torch.arange(16).expand(3, 16).clone()
    assert DocumentMask.build(positions, "sdpa", torch.device("cpu")) is None
    positions[1, 9] = 0
    m = DocumentMask.build(positions, "varlen", torch.device("cpu"))
    assert m.cu_seqlens.tolist() == [0, 16, 25, 32, 48] and m.max_seqlen == 16


def _ulysses_logits(rank, world, extra):
    from shardfit.parallel import parallelize
    from shardfit.parallel.ulysses import local_slice

    with torch.device("meta"):
        model = build_model(load_config(None, BASE + extra).model)
    model = parallelize(model, ParallelConfig(sequence_parallel=2, activation_checkpoint="full"),
                        torch.device("cpu"), world, seed=3)
    ids, positions, _ = _packed(model.cfg.vocab_size)
    mask = DocumentMask.build(positions, "sdpa", torch.device("cpu"))  # from the full position ids, on every rank
    with torch.no_grad():
        local = model(local_slice(ids, rank, 2), position_ids=local_slice(positions, rank, 2), mask=mask)
        parts = [torch.empty_like(local) for _ in range(world)]
        dist.all_gather(parts, local.contiguous())
    return torch.cat(parts, dim=1).tolist()


@pytest.mark.parametrize("family", ["llama", "qwen3_moe"])
def test_document_mask_under_ulysses(family):
    logits = torch.tensor(run_ranks(_ulysses_logits, 2, FAMILIES[family], timeout=180)[0])
    model = build_model(load_config(None, BASE + FAMILIES[family]).model)
    model.init_weights(seed=3)
    _, _, docs = _packed(model.cfg.vocab_size)
    with torch.no_grad():
        for r, start, doc in docs:
            torch.testing.assert_close(logits[r, start:start + doc.shape[1]], model(doc)[0], rtol=1e-4, atol=1e-4)


def test_auto_kernel_takes_flex_on_cuda_except_for_short_rows():
    from shardfit.models.attention import FLEX_MIN_TOKENS, choose_doc_kernel, flex_available, varlen_available

    cuda = torch.device("cuda", 0)  # only the device's type is read: no GPU needed
    assert choose_doc_kernel("auto", torch.device("cpu"), 4096) == "sdpa"
    if flex_available():
        assert choose_doc_kernel("auto", cuda, 4096) == "flex"
    short = choose_doc_kernel("auto", cuda, FLEX_MIN_TOKENS - 1)
    assert short == ("varlen" if varlen_available() else "sdpa")
    assert choose_doc_kernel("flex", cuda, 64) == "flex"  # an explicit choice is kept
