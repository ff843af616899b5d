"""Causal self-attention kernels, plain and document-masked. Document masking and the kernels: docs/data.md.

With document masking a token attends only to earlier tokens of its own document, and its RoPE position counts from
that document's start; both come from the row's position ids [b, S], which restart at 0 where a document starts.
`DocumentMask.build` turns a micro-batch's full position ids into what the chosen kernel reads, once per
micro-batch, outside any checkpointed or compiled region: recomputation reads the very same object, and under
Ulysses every rank of a group builds it from the same full position ids (no exchange is needed for it).

Kernels, on q [B, S, H, Dh] and k/v [B, S, K, Dh] (grouped-query: K divides H):
  sdpa    SDPA with a dense boolean mask [B, 1, S, S]: the reference the CPU tests use;
  varlen  FlashAttention over cumulative sequence lengths: the B rows as one sequence cut at every document start;
  flex    FlexAttention with a document block mask built from per-block document ids (O(S^2 / 128^2) memory):
          tiles that cross documents are skipped;
  cudnn_docs  for passes without gradients: SDPA (cuDNN backend first, PyTorch's own choice where cuDNN cannot
          take the call) once per document, each output written into its slice of the row. One custom operator
          (shardfit::doc_sdpa) runs the whole loop, so a compiled block sees one opaque node and never recompiles
          for another layout; the documents reach it as a host tensor (no device sync). It has no backward.
Branches (shared prefixes): sequences that begin with the same tokens may be packed as one document that is a prefix
tree, the common prefix (the trunk, branch id 0) once, then each sequence's remainder (branch 1, 2, ...), its RoPE
positions continuing the trunk's. A branch token attends to the trunk and to earlier tokens of its own branch, never
to another branch: each sequence sees exactly what it would see alone, and the trunk is computed once (rl/pack.py:
a preference pair's prompt). sdpa and flex take branch ids; varlen and cudnn_docs do not (FlashAttention's
cumulative lengths describe contiguous key ranges only), and such a micro-batch is packed without sharing.
compute.doc_attention=auto takes flex on CUDA (varlen for short rows, or where FlexAttention is missing), for
passes with and without gradients alike: Engine.forward's log-probs are then those forward_backward computes (with
cudnn_docs for the no-grad pass they differed by bf16 rounding through every layer, enough to move a PPO step's
importance ratios at its start: benchmarks/README.md#logprob-gap). compute.doc_attention=cudnn_docs (a few percent
faster over real RL rollouts: benchmarks/README.md#rl-2x) applies to passes without gradients alone; a training
pass then takes what auto would (choose_doc_kernel).
"""

from __future__ import annotations

import contextlib
import functools
import inspect
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from shardfit.errors import ShardfitError


def sdpa_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   mask: DocumentMask | None = None) -> torch.Tensor:
    """Causal attention. q [B, S, H, Dh], k/v [B, S, K, Dh] -> [B, S, H, Dh]; document-masked when mask is given.

    enable_gqa lets SDPA's flash/cuDNN kernels read the K heads directly: no [B, H, S, Dh] copy of k and v.
    """
    if mask is not None:
        return KERNELS[mask.kernel](q, k, v, mask)
    q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # [B, H|K, S, Dh]
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=k.shape[1] != q.shape[1])
    return out.transpose(1, 2)


@dataclass
class DocumentMask:
    """Where the documents of one micro-batch start, in the form `kernel` reads. Build it with `build`."""

    kernel: str  # "sdpa" | "varlen" | "flex" | "cudnn_docs"
    dense: torch.Tensor | None = None  # sdpa: [B, 1, S, S] bool, True where attention is allowed
    cu_seqlens: torch.Tensor | None = None  # varlen: [docs + 1] int32 offsets into the B*S flattened tokens
    max_seqlen: int = 0  # varlen: the longest document
    block_mask: object = None  # flex: a BlockMask over [B, 1, S, S]
    docs: tuple[tuple[int, int, int], ...] = ()  # cudnn_docs: (row, start, end) of every document, on the host
    bounds: torch.Tensor | None = None  # cudnn_docs: the same as a host int64 tensor [docs, 3], the op's argument

    @staticmethod
    def build(position_ids: torch.Tensor, kernel: str, device: torch.device,
              branch: torch.Tensor | None = None) -> DocumentMask | None:
        """From the full position ids [B, S] of a micro-batch, on the host. None when every row is one document
        from its first token: plain causal attention is then exactly the masked one. branch [B, S] (host, int):
        documents that are prefix trees ("Branches" in the module docstring); None or all 0: none."""
        doc = document_ids(position_ids)
        trees = branch is not None and bool(branch.any())
        if not trees and not bool(doc[:, -1].any()):  # every row's last token is in its first document
            return None
        if kernel not in BRANCHED_KERNELS:
            if trees:
                raise ValueError(f"the {kernel} attention kernel has no mask for shared prefixes (branch ids): the "
                                 f"caller packs sequences apart for it ({', '.join(BRANCHED_KERNELS)} have one)")
            branch = None
        # branch ids of all 0 (a pass that may hold trees and holds none here) keep flex's branch-aware mask_mod:
        # one compiled variant of the blocks for every micro-batch of such passes, trees or not
        B, S = doc.shape
        if kernel == "varlen":
            # Number the documents of the flattened [B*S] tokens consecutively (row b's first one after all of the
            # earlier rows'): their lengths are then a bincount, their offsets its running sum from 0.
            per_row = doc[:, -1] + 1
            lengths = torch.bincount((doc + (per_row.cumsum(0) - per_row)[:, None]).flatten())
            cu = torch.cat([lengths.new_zeros(1), lengths.cumsum(0)]).to(torch.int32)
            return DocumentMask("varlen", cu_seqlens=to_device(cu, device), max_seqlen=int(lengths.max()))
        if kernel == "flex":
            return DocumentMask("flex", block_mask=document_block_mask(doc, device, branch))
        if kernel == "cudnn_docs":
            return document_bounds_mask(doc)
        doc = doc.to(device)
        causal = torch.ones(S, S, dtype=torch.bool, device=device).tril_()
        dense = (doc[:, :, None] == doc[:, None, :]) & causal  # [B, S, S]
        if branch is not None:  # a key of another branch of the same tree is not seen
            br = branch.to(device)
            dense &= (br[:, None, :] == 0) | (br[:, None, :] == br[:, :, None])
        return DocumentMask("sdpa", dense=dense[:, None])


def document_ids(position_ids: torch.Tensor) -> torch.Tensor:
    """[B, S] int32: each token's document within its row, counted from 0 and non-decreasing along the row. A
    document starts where the position ids are 0, and at every row's first token (a window may begin inside a
    document: its positions restart there)."""
    starts = position_ids == 0
    starts[:, 0] = True
    return (starts.cumsum(1) - 1).to(torch.int32)


# FlexAttention's tile: a BlockMask describes the [S, S] scores in blocks of FLEX_BLOCK queries x FLEX_BLOCK keys
# (torch's default sparse block size, the one its kernels are tuned for). A last block of a row whose S is not a
# multiple of it is short.
FLEX_BLOCK = 128


_BRANCH_BITS = 16  # a token's (document, branch) as one int32 id: document << 16 | branch (branch < 65,536)


def _same_document_causal(doc: torch.Tensor, branch: torch.Tensor | None, device: torch.device):
    """The element mask FlexAttention evaluates inside partial blocks: same document, key not after the query; with
    branch ids, the key in the trunk or in the query's own branch. With branches, document and branch are one int32
    id a token (doc * 2^16 + branch; doc < 2^15): the key is seen iff its id is the query's (same document and
    branch) or the query's with branch 0 (its document's trunk). Two loads a pair, as without branches: the
    branch-aware mask, which every pass that may share a prefix uses (one compiled variant), costs no more inside a
    partial block than the plain one (with the two tensors apart it loaded four). doc, branch: [B, S] on the host
    (checked and packed there: no device sync), moved to `device`."""
    if branch is None:
        doc = to_device(doc, device)

        def mask_mod(b, h, q_idx, kv_idx):
            return (doc[b, q_idx] == doc[b, kv_idx]) & (q_idx >= kv_idx)
        return mask_mod
    if doc.numel() and (int(doc.max()) >= 1 << (31 - _BRANCH_BITS) or int(doc.min()) < -(1 << (31 - _BRANCH_BITS))
                        or int(branch.max()) >= 1 << _BRANCH_BITS):
        raise ValueError(f"{int(doc.max()) + 1} documents or {int(branch.max())} branches in a row: the branch "
                         f"mask's packed ids hold < {1 << (31 - _BRANCH_BITS)} and < {1 << _BRANCH_BITS}")
    ids = to_device(doc.to(torch.int32) * (1 << _BRANCH_BITS) + branch.to(torch.int32), device)  # [B, S]
    trunk_of = -(1 << _BRANCH_BITS)  # ids & trunk_of: the id with its branch bits cleared (two's complement floor)

    def branched(b, h, q_idx, kv_idx):
        query, key = ids[b, q_idx], ids[b, kv_idx]
        return (q_idx >= kv_idx) & ((key == query) | (key == (query & trunk_of)))

    return branched


def document_block_mask(doc: torch.Tensor, device: torch.device, branch: torch.Tensor | None = None):
    """FlexAttention's BlockMask over [B, 1, S, S] for document ids doc [B, S] (document_ids: host, sorted rows),
    made from the blocks' first and last document ids alone, never from the [S, S] element mask.

    Query block i against key block j (n = ceil(S / 128) blocks a row):
      j > i  every key is after every query: empty;
      j = i  the diagonal is allowed, the keys above it are not: partial;
      j < i  every key precedes every query, so only "same document" is left to decide. Ids are sorted, so every
             key's document <= last[j] <= first[i] <= every query's: some pair shares a document iff
             last[j] == first[i] (partial at least), every pair does iff first[j] == last[i] as well (all four
             equal: full). create_block_mask pads the scores to whole blocks with masked entries, so a short last
             query block is never full; key blocks j < i are always whole.
    The same blocks as create_block_mask(mask_mod) (document_block_mask_reference) lists, in the same order. Memory:
    [B, n, n] tables (n = 128 at a 16,384-token row, 256 at 32,768: 64 Ki entries, under 1 MiB a row with the int64
    sort indices) instead of its [B, 1, S, S] element mask and the mask_mod's intermediates of that size.
    """
    from torch.nn.attention.flex_attention import BlockMask

    B, S = doc.shape
    n = -(-S // FLEX_BLOCK)
    begin = torch.arange(n) * FLEX_BLOCK  # [n] first token of each block
    first = doc[:, begin]  # [B, n] document of each block's first token: the block's smallest id
    last = doc[:, (begin + FLEX_BLOCK - 1).clamp_(max=S - 1)]  # [B, n] of its last real token: its largest id
    below = torch.ones(n, n, dtype=torch.bool).tril_(-1)  # [query block i, key block j]: j < i
    shared = below & (last[:, None, :] == first[:, :, None])  # [B, n, n]
    whole_q = begin + FLEX_BLOCK <= S  # [n] query blocks of FLEX_BLOCK real tokens
    full = shared & (first[:, None, :] == last[:, :, None]) & whole_q[:, None]
    empty = torch.zeros_like(shared)
    if branch is not None:  # branches (module docstring): blocks of mixed branches stay partial, never full
        lo, hi = _block_range(branch)  # [B, n] each: the smallest and largest branch id of each block's tokens
        one = lo == hi  # [B, n]: the block's tokens all in one branch (or all in the trunk)
        same = one[:, :, None] & one[:, None, :] & (lo[:, :, None] == lo[:, None, :])  # [B, query i, key j]
        full &= (hi[:, None, :] == 0) | same  # every key in the trunk, or in the queries' one branch
        # queries all in one branch, keys all in another (not the trunk): nothing is seen, whatever the documents
        empty = one[:, :, None] & one[:, None, :] & (lo[:, :, None] > 0) & (lo[:, None, :] > 0) & ~same
    partial = (shared & ~full & ~empty) | torch.eye(n, dtype=torch.bool)

    def listed(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """[B, n, n] bool -> kv_num_blocks [B, 1, n] and kv_indices [B, 1, n, n] (int32, on device): each query
        block's key blocks in ascending order, then the unlisted ones (a stable sort of the row, True first)."""
        order = torch.argsort(blocks.to(torch.int8), dim=-1, descending=True, stable=True)
        count = blocks.sum(-1, dtype=torch.int32)
        return to_device(count[:, None], device), to_device(order.to(torch.int32)[:, None], device)

    # The backward's lists (each key block's query blocks) from the transposed tables, on the host: the tensors
    # BlockMask.from_kv_blocks makes, without its _transpose_ordered, which rebuilds these tables from the lists (a
    # vmapped scatter, then the same stable sort): ~0.7 ms of host time a table at a 17,408-token row (CPU), against
    # ~0.25 ms for both here.
    kv, kv_idx, full_kv, full_kv_idx = *listed(partial), *listed(full)
    q, q_idx, full_q, full_q_idx = *listed(partial.mT.contiguous()), *listed(full.mT.contiguous())
    mod = _same_document_causal(doc, branch, device)
    return BlockMask(seq_lengths=(S, S), kv_num_blocks=kv, kv_indices=kv_idx, full_kv_num_blocks=full_kv,
                     full_kv_indices=full_kv_idx, q_num_blocks=q, q_indices=q_idx, full_q_num_blocks=full_q,
                     full_q_indices=full_q_idx, BLOCK_SIZE=(FLEX_BLOCK, FLEX_BLOCK), mask_mod=mod)


def _block_range(values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[B, S] -> the smallest and largest value of each FLEX_BLOCK-token block [B, n] (a short last block: of its
    real tokens, the row padded with its last value)."""
    B, S = values.shape
    n = -(-S // FLEX_BLOCK)
    padded = torch.cat([values, values[:, -1:].expand(B, n * FLEX_BLOCK - S)], 1).view(B, n, FLEX_BLOCK)
    return padded.amin(-1), padded.amax(-1)


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on `device` without a host sync. A plain .to(cuda) synchronises the stream (PyTorch waits for
    the copy, i.e. for every kernel queued before it): the five copies of each document block mask made the host wait
    for the previous micro-batch and the GPU then wait for the host. Copied through pinned memory (PyTorch's caching
    host allocator: it keeps the block until the copy is done), the copy is queued like a kernel."""
    if device.type != "cuda" or t.device.type != "cpu":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


def document_block_mask_reference(doc: torch.Tensor, device: torch.device, branch: torch.Tensor | None = None):
    """The BlockMask as create_block_mask builds it from the element mask (what shardfit did before
    document_block_mask): it evaluates the mask_mod on all B x S x S (query, key) pairs at once, so its transients
    grow with S^2 (the benchmark's mask-memory case measures them). Kept as the tests' and the benchmark's
    reference. (Its _compile=True is, in torch 2.13, a deprecated spelling of torch.compile(create_block_mask): one
    compilation per micro-batch shape, where the construction above needs none.)"""
    from torch.nn.attention.flex_attention import create_block_mask

    B, S = doc.shape
    mod = _same_document_causal(doc.cpu(), branch.cpu() if branch is not None else None, device)
    return create_block_mask(mod, B, None, S, S, device=str(device))


def document_bounds_mask(doc: torch.Tensor) -> DocumentMask:
    """cudnn_docs' mask from document ids doc [B, S] (document_ids: host, sorted rows): every document's (row,
    start, end). The tensor stays on the host: the operator reads it there, so no layer waits for the device. Its
    first dimension (the number of documents) is marked dynamic, so a compiled block traces it once as a symbol and
    runs every later layout without recompiling."""
    per_row = (doc[:, -1] + 1).tolist()
    docs = []
    for b, n in enumerate(per_row):
        ends = torch.searchsorted(doc[b].contiguous(), torch.arange(n, dtype=doc.dtype), right=True).tolist()
        start = 0
        for end in ends:
            docs.append((b, start, end))
            start = end
    bounds = torch.tensor(docs, dtype=torch.int64)
    torch._dynamo.maybe_mark_dynamic(bounds, 0)
    return DocumentMask("cudnn_docs", docs=tuple(docs), bounds=bounds)


@torch.library.custom_op("shardfit::doc_sdpa", mutates_args=())
def doc_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bounds: torch.Tensor) -> torch.Tensor:
    """Causal attention within each document. q [B, S, H, Dh], k/v [B, S, K, Dh], bounds [docs, 3] int64 on the host
    ((row, start, end) of each document; together they cover every row) -> [B, S, H, Dh]."""
    out = q.new_empty(q.shape)
    gqa = k.shape[2] != q.shape[2]
    with _doc_backends(q):
        for b, s, e in bounds.tolist():
            o = F.scaled_dot_product_attention(*(t[b:b + 1, s:e].transpose(1, 2) for t in (q, k, v)), is_causal=True,
                                               enable_gqa=gqa)  # [1, H, L, Dh]
            out[b:b + 1, s:e].copy_(o.transpose(1, 2))
    return out


@doc_sdpa.register_fake
def _(q, k, v, bounds):
    return q.new_empty(q.shape)


def _doc_backends(q: torch.Tensor):
    """On CUDA: cuDNN attention first, then PyTorch's usual order (flash, efficient, math) where cuDNN cannot take
    a call (no cuDNN attention in this build, fp32, an unsupported head size). Elsewhere the default selection."""
    if not q.is_cuda:
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    order = [SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
    return sdpa_kernel(order, set_priority=True)


def _cudnn_docs(q, k, v, mask: DocumentMask) -> torch.Tensor:
    return doc_sdpa(q, k, v, mask.bounds)


def _dense_masked(q, k, v, mask: DocumentMask) -> torch.Tensor:
    q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # [B, H|K, S, Dh]
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask.dense, enable_gqa=k.shape[1] != q.shape[1])
    return out.transpose(1, 2)


@functools.lru_cache(maxsize=1)
def _varlen_api():
    """torch.nn.attention.varlen.varlen_attn and how this release spells causality and grouped-query heads: newer
    releases take window_size=(-1, 0) and enable_gqa, the first ones (2.10) is_causal and equal head counts."""
    from torch.nn.attention.varlen import varlen_attn

    params = inspect.signature(varlen_attn).parameters
    return varlen_attn, "window_size" in params, "enable_gqa" in params


def varlen_available() -> bool:
    try:
        _varlen_api()
    except ImportError:
        return False
    return True


def _varlen(q, k, v, mask: DocumentMask) -> torch.Tensor:
    B, S, H, Dh = q.shape
    fn, has_window, has_gqa = _varlen_api()
    if k.shape[2] != H and not has_gqa:  # older releases: repeat the K/V heads up to H (grouped-query order kept)
        k, v = (t.repeat_interleave(H // t.shape[2], dim=2) for t in (k, v))
    q, k, v = (t.reshape(B * S, t.shape[2], Dh) for t in (q, k, v))  # [B*S, heads, Dh]: views, no copy
    kw = {"window_size": (-1, 0)} if has_window else {"is_causal": True}
    if has_gqa:
        kw["enable_gqa"] = k.shape[1] != H
    cu, m = mask.cu_seqlens, mask.max_seqlen
    return fn(q, k, v, cu, cu, m, m, **kw).view(B, S, H, Dh)


@functools.lru_cache(maxsize=1)
def _compiled_flex():
    # FlexAttention must be compiled to run its fused kernel (eager falls back to a dense reference); inside an
    # already compiled block dynamo inlines this call.
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, dynamic=False)


def _flex(q, k, v, mask: DocumentMask) -> torch.Tensor:
    q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # [B, H|K, S, Dh]
    if q.is_cuda:
        fn = _compiled_flex()
    else:  # eager: FlexAttention's dense reference, which applies the mask_mod to every score and never reads the
        # block lists (the CPU tests compare those with create_block_mask's and run the compiled kernel on them)
        from torch.nn.attention.flex_attention import flex_attention as fn
    out = fn(q, k, v, block_mask=mask.block_mask, enable_gqa=k.shape[1] != q.shape[1])
    return out.transpose(1, 2)


KERNELS = {"sdpa": _dense_masked, "varlen": _varlen, "flex": _flex, "cudnn_docs": _cudnn_docs}
BRANCHED_KERNELS = ("sdpa", "flex")  # the kernels whose masks take branch ids (shared prefixes)


# Below this many tokens a row, Inductor lowers FlexAttention to its decoding kernel, which in torch 2.11 has no
# kernel for training (CUDA tests at sequence 64: "NoValidChoicesError"); auto then takes varlen.
FLEX_MIN_TOKENS = 128


def choose_doc_kernel(kind: str, device: torch.device, row_tokens: int = FLEX_MIN_TOKENS,
                      dtype: torch.dtype = torch.bfloat16, grad: bool = True, invariant: bool = False) -> str:
    """compute.doc_attention resolved for this device, row length (tokens per row of a micro-batch), compute dtype
    and whether the pass runs a backward (grad). The CPU always uses the dense reference (FlashAttention's varlen
    kernel is CUDA-only; FlexAttention would compile a CPU kernel per shape). FlashAttention has no fp32 kernel:
    auto never picks varlen for fp32 compute, and asking for it is refused before the first step (a rank whose
    micro-batch holds no document boundary would not call it, and its peers would wait for it in their next
    collective). cudnn_docs has no backward: taken for passes without gradients alone, when asked for (any dtype),
    and a training pass takes auto's choice instead; auto takes the training kernel for both (module docstring).
    invariant (the Engine under sampling.logprobs=trainer): auto takes varlen where it runs (bf16/fp16 on CUDA), whose
    result for a document does not depend on where it lies in the packed rows: FlashAttention starts every sequence
    at its own first key, where FlexAttention's key tiles start at the row's and a document's keys fall into other
    tiles at another offset (the trainer's log-probs of reversed datums measured under both:
    benchmarks/README.md#logprob-gap)."""
    if device.type != "cuda":
        return "sdpa"
    half = dtype in (torch.bfloat16, torch.float16)
    if kind == "cudnn_docs" and not grad:
        return kind
    if kind == "cudnn_docs":
        kind = "auto"
    if kind == "auto" and invariant and half and varlen_available():
        return "varlen"
    if kind == "varlen" and not half:
        raise ShardfitError(f"compute.doc_attention=varlen needs bf16 or fp16 compute, not {dtype} (FlashAttention "
                            "has no fp32 kernel)", where="compute.doc_attention",
                            fix="use compute.doc_attention=flex or sdpa, or compute.param_dtype=bfloat16")
    if kind == "auto" and row_tokens < FLEX_MIN_TOKENS:
        return "varlen" if varlen_available() and half else "sdpa"
    if kind == "auto":
        # flex: torch 2.11's varlen has no grouped-query heads, so K/V are repeated to all query heads and saved for
        # backward (at 8B, 4x the K/V bytes: the larger activations that made varlen the slower of the two in
        # benchmarks/README.md's document-masked runs). varlen stays the choice where FlexAttention is missing.
        return "flex" if flex_available() else "varlen"
    return kind


def flex_available() -> bool:
    try:
        from torch.nn.attention.flex_attention import create_block_mask  # noqa: F401
    except ImportError:
        return False
    return True
