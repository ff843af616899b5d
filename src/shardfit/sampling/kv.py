"""The paged KV cache: keys and values in fixed-size blocks that rows hold by reference, sized from free memory.

Per layer two pools k, v [n_blocks + 1, block_size, K, Dh]; the last block is the trash block, never handed out:
padded rows and padded table entries point at it, so that every write and gather has a fixed shape (a CUDA graph
replays it) and no write needs a mask. The pools start at zero and only ever receive finite keys and values: a
masked position's value still enters attention's product with a zero weight, and 0 x NaN would be NaN.

`BlockAllocator` hands out block ids and counts references on the host: the `num_samples` rows of one prompt hold the
prompt's blocks together (one reference each) and a row about to write into a block others hold gets a private copy
first (`PagedKV.copy_block`: copy-on-write), so a prompt is prefilled once whatever its sample count. A block is
free again when its last reference goes.

`PagedKV` implements the decoder's cache protocol (models/decoder.py KVCache): the runner `bind`s one forward's
layout first (position ids [B, S], the slot of every new token [B x S] in the flat pool, each row's block table
[B, M] padded with the trash block), then each layer's `attend` writes its new keys and values into their slots and
attends each row's queries over that row's blocks (sampling/attention.py).

Size: `blocks_for_memory` turns the memory left after the weights into blocks (on CUDA a stated fraction of the
free memory); on the CPU the sampler takes a stated token count instead (runner.CPU_KV_TOKENS).
"""

from __future__ import annotations

import torch

from shardfit.config.schema import ModelConfig
from shardfit.sampling.attention import causal_attention, flex_attention_paged, flex_block_mask, gather_attention

BLOCK_SIZE = 16  # tokens a KV block holds, by default (the Sampler's, the planner's)

def block_bytes(cfg: ModelConfig, dtype: torch.dtype, block_size: int) -> int:
    """Bytes of one block over all layers: keys and values of block_size tokens."""
    head_dim = cfg.head_dim or cfg.dim // cfg.n_heads
    return 2 * cfg.n_layers * block_size * cfg.n_kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()


def blocks_for_memory(free_bytes: int, fraction: float, cfg: ModelConfig, dtype: torch.dtype,
                      block_size: int = BLOCK_SIZE) -> int:
    """How many blocks `fraction` of `free_bytes` (the memory left after the weights) holds."""
    return int(free_bytes * fraction) // block_bytes(cfg, dtype, block_size)


class BlockAllocator:
    """Block ids 0..n_blocks-1 with reference counts, on the host. allocate() -> an id or None when none is free."""

    def __init__(self, n_blocks: int):
        self.n_blocks = n_blocks
        self.refs = [0] * n_blocks
        self._free = list(range(n_blocks - 1, -1, -1))  # a stack: the lowest ids first

    @property
    def n_free(self) -> int:
        return len(self._free)

    def allocate(self) -> int | None:
        if not self._free:
            return None
        b = self._free.pop()
        self.refs[b] = 1
        return b

    def share(self, block: int) -> None:
        """One more holder of a block that is in use."""
        assert self.refs[block] > 0, f"block {block} is free"
        self.refs[block] += 1

    def release(self, block: int) -> None:
        assert self.refs[block] > 0, f"block {block} released twice"
        self.refs[block] -= 1
        if self.refs[block] == 0:
            self._free.append(block)

    def release_all(self, blocks: list[int]) -> None:
        for b in blocks:
            self.release(b)


class PagedKV:
    """The pools, their allocator, and the layout of the forward being run (bind). attention: "gather" (the reference
    path: every device, capturable) or "flex" (FlexAttention, CUDA)."""

    def __init__(self, cfg: ModelConfig, n_blocks: int, block_size: int, dtype: torch.dtype, device: torch.device,
                 attention: str = "gather"):
        if attention not in ("gather", "flex", "triton"):
            raise ValueError(f"attention={attention!r}: gather, flex or triton")
        self.cfg, self.block_size, self.dtype, self.device = cfg, block_size, dtype, torch.device(device)
        self.n_blocks, self.attention = n_blocks, attention
        self.trash = n_blocks  # the padding block: written by padded rows, never read unmasked
        head_dim = cfg.head_dim or cfg.dim // cfg.n_heads
        shape = (n_blocks + 1, block_size, cfg.n_kv_heads, head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(cfg.n_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(cfg.n_layers)]
        self.allocator = BlockAllocator(n_blocks)
        self._positions = self._slots = self._tables = self._mask = None
        self._fresh = False

    @property
    def tokens(self) -> int:
        return self.n_blocks * self.block_size

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.k, *self.v))

    def describe(self) -> str:
        """The start banner's line."""
        return (f"KV cache: {self.n_blocks} blocks of {self.block_size} tokens = {self.tokens} tokens, "
                f"{self.nbytes() / 2 ** 30:.2f} GiB ({self.dtype}, {self.attention} attention)")

    def blocks_for(self, n_tokens: int) -> int:
        return -(-n_tokens // self.block_size)

    def copy_block(self, src: int, dst: int) -> None:
        """dst's keys and values := src's, every layer (copy-on-write of a shared block)."""
        for pool in (*self.k, *self.v):
            pool[dst] = pool[src]

    # The decoder's cache protocol (models/decoder.py).
    def bind(self, positions: torch.Tensor, slots: torch.Tensor, tables: torch.Tensor, fresh: bool = False) -> None:
        """The forward about to run: positions [B, S] (int64: each new token's position in its row, which is also the
        last key it may attend to), slots [B x S] (int64: where its key and value go in the flat pool
        [(n_blocks + 1) x block_size]), tables [B, M] (int64: the row's blocks in order, padded with `trash`).
        fresh: every row's tokens are its first (positions 0 .. S-1, padding after the real ones): a prompt's first
        chunk. Its keys are then exactly this forward's, and attend takes causal attention over them (SDPA's
        FlashAttention on CUDA) instead of gathering them back from the pool under an explicit mask: the same keys
        and the same rule (a query at position p sees keys 0 .. p of its row; padding lies past every real query)."""
        self._positions, self._slots, self._tables, self._fresh = positions, slots, tables, fresh
        self._mask = None  # flex: the block mask, made by the forward's first layer
        # triton: decoding (one token a row) reads the pool in place (kernels/paged_attention.py); a prefill chunk
        # takes the gather path. The split count is chosen here, on the host, once per forward's shape.
        self._kernel = self.attention == "triton" and positions.shape[1] == 1
        if self._kernel:
            from shardfit.kernels.paged_attention import default_splits

            self._splits = default_splits(tables.shape[0], self.k[0].shape[2], tables.shape[1], tables.device)

    def positions(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self._positions

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q [B, S, H, Dh], k/v [B, S, K, Dh] -> [B, S, H, Dh]."""
        kp, vp = self.k[layer], self.v[layer]
        flat = (-1, *kp.shape[2:])  # [(n_blocks + 1) x block_size, K, Dh]: a view of the pool
        k, v = k.to(kp.dtype), v.to(vp.dtype)
        kp.view(flat).index_copy_(0, self._slots, k.reshape(-1, *k.shape[2:]))
        vp.view(flat).index_copy_(0, self._slots, v.reshape(-1, *v.shape[2:]))
        if self._fresh:
            return causal_attention(q, k, v)
        if self.attention == "flex":
            if self._mask is None:
                self._mask = flex_block_mask(self._positions, self._tables.shape[1] * self.block_size)
            return flex_attention_paged(q, kp, vp, self._tables, self._mask)
        if self._kernel:
            from shardfit.kernels.paged_attention import paged_decode_attention

            # [B]: keys 0 .. position are visible, never past the table (a padding entry's position runs on)
            lengths = (self._positions[:, 0] + 1).clamp(max=self._tables.shape[1] * self.block_size)
            return paged_decode_attention(q[:, 0], kp, vp, self._tables, lengths, splits=self._splits)[:, None]
        return gather_attention(q, kp, vp, self._tables, self._positions)

    def advance(self, input_ids: torch.Tensor) -> None:
        """Lengths are the runner's (each row's own): nothing to do here."""
