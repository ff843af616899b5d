"""Document masking: a packed row gives each document exactly the logits it gets alone (fp32, every family), with
the dense-mask reference, FlexAttention's block mask, and under Ulysses sequence parallelism on 2 gloo ranks."""

import pytest
import torch
import torch.distributed as dist

from shardfit.config import load_config
from shardfit.config.schema import ComputeConfig, Config, ParallelConfig
from shardfit.models import build_model
from shardfit.models.attention import (
    DocumentMask,
    document_block_mask,
    document_block_mask_reference,
    document_ids,
    sdpa_attention,
)
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
    cpu = torch.device("cpu")
    ref = sdpa_attention(q, k, v, DocumentMask.build(positions, "sdpa", cpu))
    flex = sdpa_attention(q, k, v, DocumentMask.build(positions, "flex", cpu))
    torch.testing.assert_close(flex, ref, rtol=1e-5, atol=1e-5)


def _doc_ids(rows):
    """document_ids [B, S] of rows given as document lengths (every row the same total)."""
    return document_ids(torch.stack([torch.cat([torch.arange(n) for n in row]) for row in rows]))


def _random_rows(B, S, longest, seed):
    g = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(B):
        row = []
        while sum(row) < S:
            row.append(min(int(torch.randint(1, longest + 1, (1,), generator=g)), S - sum(row)))
        rows.append(row)
    return rows


# Document lengths per row. The block mask's cases: one document (full blocks below the diagonal), many tiny ones
# (every block partial, none shared beyond the diagonal), boundaries on and across 128-token block edges, S not a
# multiple of 128 (a short last block: never full), S under one block, several rows with different layouts.
LAYOUTS = {
    "one document": [[300]],
    "tiny documents": _random_rows(2, 260, 3, seed=1),
    "block-aligned": [[128, 128, 256], [256, 256]],
    "crossing edges": [[100, 200, 37], [5, 128, 130, 74], [337]],
    "short row": [[3, 4]],
    "one long one short": [[1000, 24]],
    **{f"random {i}": _random_rows(1 + i % 3, (130, 384, 517, 1000)[i % 4], (4, 60, 300, 900)[i], seed=i)
       for i in range(4)},
}
FIELDS = ("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices",
          "q_num_blocks", "q_indices", "full_q_num_blocks", "full_q_indices")


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_block_mask_from_document_ids_equals_create_block_mask(layout):
    doc = _doc_ids(LAYOUTS[layout])
    cpu = torch.device("cpu")
    ours, ref = document_block_mask(doc, cpu), document_block_mask_reference(doc, cpu)
    assert ours.seq_lengths == ref.seq_lengths == (doc.shape[1],) * 2 and ours.BLOCK_SIZE == ref.BLOCK_SIZE
    for f in FIELDS:  # the same blocks, listed in the same order: not only the same sets
        assert torch.equal(getattr(ours, f), getattr(ref, f)), f
    assert torch.equal(ours.to_dense(), ref.to_dense())


def test_block_mask_layouts_cover_full_partial_and_short_blocks():
    """The layouts above reach every case of document_block_mask (otherwise its test could pass vacuously)."""
    masks = {name: document_block_mask(_doc_ids(rows), torch.device("cpu")) for name, rows in LAYOUTS.items()}
    full = {n: int(m.full_kv_num_blocks.sum()) for n, m in masks.items()}
    below = {n: int(m.kv_num_blocks.sum()) - m.kv_num_blocks.numel() for n, m in masks.items()}  # partial, j < i
    # [300]: blocks 0, 1 and a short 2; (1, 0) full; (2, 0) and (2, 1) partial only because block 2 is short
    assert (full["one document"], below["one document"]) == (1, 2)
    # boundaries on block edges: (3, 2) of row 0, (1, 0) and (3, 2) of row 1 full, no partial block below the diagonal
    assert (full["block-aligned"], below["block-aligned"]) == (3, 0)
    assert full["crossing edges"] > 0 and below["crossing edges"] > 0 and full["tiny documents"] == 0


def test_compiled_flex_with_the_block_mask_equals_the_dense_reference():
    """The compiled kernel reads the block lists (the eager one does not): with them it gives the dense-mask
    attention, on a layout with full, partial and empty blocks and a short last block."""
    import shutil

    from shardfit.models.attention import _compiled_flex

    if not shutil.which("g++"):
        pytest.skip("Inductor's CPU FlexAttention needs a C++ compiler")
    torch.manual_seed(0)
    rows = LAYOUTS["crossing edges"]
    positions = torch.stack([torch.cat([torch.arange(n) for n in row]) for row in rows])
    B, S = positions.shape
    q, k, v = torch.randn(B, 4, S, 16), torch.randn(B, 2, S, 16), torch.randn(B, 2, S, 16)  # [B, H|K, S, Dh]
    cpu = torch.device("cpu")
    mask = DocumentMask.build(positions, "flex", cpu).block_mask
    assert int(mask.full_kv_num_blocks.sum()) > 0
    out = _compiled_flex()(q, k, v, block_mask=mask, enable_gqa=True)
    ref = sdpa_attention(*(t.transpose(1, 2) for t in (q, k, v)), DocumentMask.build(positions, "sdpa", cpu))
    torch.testing.assert_close(out.transpose(1, 2), ref, rtol=1e-5, atol=1e-5)


def test_one_document_per_row_needs_no_mask():
    positions = torch.arange(16).expand(3, 16).clone()
    assert DocumentMask.build(positions, "sdpa", torch.device("cpu")) is None
    positions[1, 9] = 0
    m = DocumentMask.build(positions, "varlen", torch.device("cpu"))
    assert m.cu_seqlens.tolist() == [0, 16, 25, 32, 48] and m.max_seqlen == 16
    positions[2] = torch.cat([torch.arange(7, 12), torch.arange(11)])  # begins inside a document; one starts at 5
    m = DocumentMask.build(positions, "varlen", torch.device("cpu"))
    assert m.cu_seqlens.tolist() == [0, 16, 25, 32, 37, 48] and m.max_seqlen == 16


ULYSSES_FAMILIES = ["llama", "qwen3_moe"]


def _ulysses_logits(rank, world, families):
    """family -> the packed rows' logits [2, 36, V] under sequence_parallel=2, gathered from the ranks' halves."""
    from shardfit.parallel.ulysses import local_slice
    from tests.helpers import parallelize_config as parallelize

    out = {}
    for family in families:  # one group of ranks for every family: a spawn each would cost more than the model
        with torch.device("meta"):
            model = build_model(load_config(None, BASE + FAMILIES[family]).model)
        cfg = Config(parallel=ParallelConfig(sequence_parallel=2), compute=ComputeConfig(activation_checkpoint="full"))
        parallelize(model, cfg, torch.device("cpu"), world, seed=3)
        ids, positions, _ = _packed(model.cfg.vocab_size)
        mask = DocumentMask.build(positions, "sdpa", torch.device("cpu"))  # from the full position ids, on every rank
        with torch.no_grad():
            local = model(local_slice(ids, rank, 2), position_ids=local_slice(positions, rank, 2), mask=mask)
            parts = [torch.empty_like(local) for _ in range(world)]
            dist.all_gather(parts, local.contiguous())
        out[family] = torch.cat(parts, dim=1).tolist()
    return out


@pytest.fixture(scope="module")
def ulysses_logits():
    return run_ranks(_ulysses_logits, 2, ULYSSES_FAMILIES, timeout=180)[0]


@pytest.mark.parametrize("family", ULYSSES_FAMILIES)
def test_document_mask_under_ulysses(family, ulysses_logits):
    logits = torch.tensor(ulysses_logits[family])
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


def test_fp32_compute_never_gets_flash_attention_varlen():
    """FlashAttention has no fp32 kernel: auto takes the dense mask for short fp32 rows, and an explicit varlen with
    fp32 is refused at start-up (one line, exit 2). Found on 2 GPUs: an fp32 run died on the rank whose micro-batch
    held a document boundary, and its peer waited in the next collective until the watchdog fired."""
    from shardfit.errors import ShardfitError
    from shardfit.models.attention import FLEX_MIN_TOKENS, choose_doc_kernel

    cuda = torch.device("cuda", 0)
    assert choose_doc_kernel("auto", cuda, FLEX_MIN_TOKENS - 1, torch.float32) == "sdpa"
    with pytest.raises(ShardfitError, match="doc_attention=varlen needs bf16"):
        choose_doc_kernel("varlen", cuda, 4096, torch.float32)
    assert choose_doc_kernel("varlen", torch.device("cpu"), 4096, torch.float32) == "sdpa"  # the CPU reference


def _positions(rows: list[list[int]]) -> torch.Tensor:
    return torch.cat([torch.cat([torch.arange(n) for n in row])[None] for row in rows])


# Packed layouts of two 36-token rows: several documents, a row that is one document, one-token documents.
DOC_LAYOUTS = [[[7, 13, 5, 11], [36]], [[20, 16], [1, 35]], [[3, 3, 3, 27], [10, 10, 1, 15]]]


@pytest.mark.parametrize("rows", DOC_LAYOUTS)
def test_cudnn_docs_equals_the_dense_reference(rows):
    """Per-document SDPA (the shardfit::doc_sdpa operator; on the CPU PyTorch's default backend: the same math) gives
    the dense-mask kernel's output, grouped-query heads included (H=4, K=2), fp32."""
    torch.manual_seed(0)
    positions, cpu = _positions(rows), torch.device("cpu")
    q, k, v = torch.randn(2, 36, 4, 16), torch.randn(2, 36, 2, 16), torch.randn(2, 36, 2, 16)
    mask = DocumentMask.build(positions, "cudnn_docs", cpu)
    assert mask.kernel == "cudnn_docs" and mask.bounds.device.type == "cpu"
    assert mask.docs == tuple((r, sum(row[:i]), sum(row[:i + 1])) for r, row in enumerate(rows)
                              for i in range(len(row)))
    ref = sdpa_attention(q, k, v, DocumentMask.build(positions, "sdpa", cpu))
    torch.testing.assert_close(sdpa_attention(q, k, v, mask), ref, rtol=1e-5, atol=1e-5)


def test_cudnn_docs_compiles_once_for_every_layout():
    """A compiled block sees shardfit::doc_sdpa as one node whose document table is a host tensor with a dynamic
    first dimension: layouts with other document counts and lengths run the first graph, no recompilation."""
    from torch._dynamo.testing import CompileCounterWithBackend

    torch._dynamo.reset()
    model, reference = _model([]), _model([])  # the same weights; the reference's blocks stay eager
    count = CompileCounterWithBackend("aot_eager")  # runs the operator's register_fake like Inductor would
    for block in model.model.layers:  # as parallelize.apply_compile does
        block.forward = torch.compile(block.forward, backend=count)
    cpu = torch.device("cpu")
    ids = torch.randint(0, model.cfg.vocab_size, (2, 36), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        for i, rows in enumerate(DOC_LAYOUTS):
            positions = _positions(rows)
            got = model(ids, position_ids=positions, mask=DocumentMask.build(positions, "cudnn_docs", cpu))
            if i == 0:
                frames = count.frame_count
            want = reference(ids, position_ids=positions, mask=DocumentMask.build(positions, "sdpa", cpu))
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert count.frame_count == frames == 1, (frames, count.frame_count)
    torch._dynamo.reset()


def test_cudnn_docs_is_for_passes_without_gradients():
    """auto takes the training kernel for passes with and without gradients (Engine.forward's log-probs are then
    forward_backward's); an explicit cudnn_docs applies to passes without gradients (any dtype) and training takes
    auto's choice; the CPU keeps the dense reference."""
    from shardfit.models.attention import choose_doc_kernel

    cuda, cpu = torch.device("cuda", 0), torch.device("cpu")
    train = choose_doc_kernel("auto", cuda, 4096)
    assert train != "cudnn_docs"
    assert choose_doc_kernel("auto", cuda, 4096, grad=False) == train
    assert choose_doc_kernel("auto", cuda, 64, grad=False) == choose_doc_kernel("auto", cuda, 64)
    assert choose_doc_kernel("auto", cuda, 4096, torch.float32, grad=False) == choose_doc_kernel(
        "auto", cuda, 4096, torch.float32)
    assert choose_doc_kernel("cudnn_docs", cuda, 4096, grad=False) == "cudnn_docs"
    assert choose_doc_kernel("cudnn_docs", cuda, 4096, torch.float32, grad=False) == "cudnn_docs"
    assert choose_doc_kernel("cudnn_docs", cuda, 4096) == train
    assert choose_doc_kernel("flex", cuda, 4096, grad=False) == "flex"  # another explicit choice is kept
    assert choose_doc_kernel("cudnn_docs", cpu, 4096, grad=False) == "sdpa"


def test_an_invariant_pass_takes_varlen_where_auto_chooses(monkeypatch):
    """invariant (the Engine under sampling.logprobs=trainer): auto takes varlen for passes with and without
    gradients in bf16/fp16 where FlashAttention's varlen runs; fp32, an explicit kernel, a missing varlen and the CPU
    keep their choice; Engine.doc_kernel asks for it exactly under sampling.logprobs=trainer."""
    from types import SimpleNamespace

    from shardfit.engine import engine as engine_mod
    from shardfit.models import attention
    from shardfit.models.attention import choose_doc_kernel

    cuda, cpu = torch.device("cuda", 0), torch.device("cpu")
    monkeypatch.setattr(attention, "varlen_available", lambda: True)
    monkeypatch.setattr(attention, "flex_available", lambda: True)
    assert choose_doc_kernel("auto", cuda, 4096) == "flex"
    assert choose_doc_kernel("auto", cuda, 4096, invariant=True) == "varlen"
    assert choose_doc_kernel("auto", cuda, 4096, grad=False, invariant=True) == "varlen"
    assert choose_doc_kernel("auto", cuda, 4096, torch.float32, invariant=True) == choose_doc_kernel(
        "auto", cuda, 4096, torch.float32)
    assert choose_doc_kernel("flex", cuda, 4096, invariant=True) == "flex"
    assert choose_doc_kernel("cudnn_docs", cuda, 4096, grad=False, invariant=True) == "cudnn_docs"
    assert choose_doc_kernel("auto", cpu, 4096, invariant=True) == "sdpa"
    monkeypatch.setattr(attention, "varlen_available", lambda: False)
    assert choose_doc_kernel("auto", cuda, 4096, invariant=True) == "flex"

    asked = []
    monkeypatch.setattr(engine_mod, "choose_doc_kernel", lambda *a, **k: asked.append(k["invariant"]) or "x")
    for logprobs in ("decode", "trainer"):
        cfg = SimpleNamespace(compute=SimpleNamespace(param_dtype="bfloat16", doc_attention="auto"),
                              sampling=SimpleNamespace(logprobs=logprobs))
        engine_mod.Engine.doc_kernel(SimpleNamespace(cfg=cfg, device=cuda), 4096, grad=True)
    assert asked == [False, True]
