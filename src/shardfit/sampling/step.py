"""The device side of decoding: every row's state in fixed tensors, and the decode step that reads and advances it.

`RowState` holds R = max_rows + 1 row slots (the last is the padding slot: padded batch entries point at it, so that
its garbage stays there) of per-row tensors on the model's device: the sampling params (temperature, top_k, top_p,
seed, sample index), the stop tokens (padded with -1), max_tokens, the count generated, the position of the next
input token, that token, the `done` flag, the adapter slot and the block table [R, max_blocks] (padded with the KV
cache's trash block). The host writes a slot when a row starts (`start_row`) and a table entry when a row gets a
block (`set_blocks`); nothing else crosses from the host while a row decodes.

`decode_step(active)` runs one token for the rows whose slots `active` [B] lists: the slot of each new key from the
table (computed on the device), the model's forward through the paged cache, the head on the last position, the
choice (sampling/sample.py), the stop-token and length checks (`done`), and the state advanced in place. It has no
host sync and no data-dependent shape: at fixed (B, table width, top-k, draw) it is what graphs.py captures.
Outputs [B]: tokens, their log-probs, `valid` (the row was not done before this step: its token counts), `done`
after it, and the top-k (log-probs, ids) [B, k] when asked.
"""

from __future__ import annotations

import functools

import torch

from shardfit.kernels.gumbel_draw import gumbel_draw
from shardfit.kernels.rms_norm import rms_norm
from shardfit.kernels.rope import fits as rope_fits
from shardfit.kernels.rope import qk_rope, rope
from shardfit.kernels.swiglu import silu_mul
from shardfit.models.decoder import MLP, Attention, RMSNorm, apply_rope, norm_rope
from shardfit.sampling.kv import PagedKV
from shardfit.sampling.sample import choose, row_keys, token_logprobs


class RowState:
    def __init__(self, max_rows: int, max_blocks: int, trash: int, device: torch.device, fused_draw: bool = False):
        R = max_rows + 1
        self.fused_draw = fused_draw  # the plain and greedy draws through kernels/gumbel_draw.py (CUDA + Triton)
        self.pad = max_rows  # the padding slot
        self.max_blocks, self.trash, self.device = max_blocks, trash, device

        def z(dtype):
            return torch.zeros(R, dtype=dtype, device=device)

        self.temperature, self.top_p = z(torch.float32), z(torch.float32)
        self.top_k, self.seed, self.sample, self.max_tokens = (z(torch.int64) for _ in range(4))
        self.n_gen, self.position, self.last_token, self.adapter = (z(torch.int64) for _ in range(4))
        self.done = torch.ones(R, dtype=torch.bool, device=device)
        # widened (a new tensor: graphs.py keys its graphs by the width) for a request with more stop tokens
        self.stop_tokens = torch.full((R, 4), -1, dtype=torch.int64, device=device)
        self.tables = torch.full((R, max_blocks), trash, dtype=torch.int64, device=device)

    def start_row(self, slot: int, params, sample: int, seed: int, adapter: int, *, token: int | None = None,
                  position: int = 0, n_gen: int = 0) -> None:
        """A row's params into its slot (host values, one small upload each). token/position/n_gen: a row resumed
        after preemption continues from its last token; a new row gets them from its first draw (`first_tokens`)."""
        stops = list(params.stop_tokens)
        if len(stops) > self.stop_tokens.shape[1]:  # widen the table once for a request with more stop tokens
            wider = torch.full((self.stop_tokens.shape[0], len(stops)), -1, dtype=torch.int64, device=self.device)
            wider[:, :self.stop_tokens.shape[1]] = self.stop_tokens
            self.stop_tokens = wider
        row = torch.full((self.stop_tokens.shape[1],), -1, dtype=torch.int64)
        row[:len(stops)] = torch.tensor(stops, dtype=torch.int64)
        self.stop_tokens[slot] = row.to(self.device, non_blocking=True)
        self.temperature[slot] = float(params.temperature)
        self.top_p[slot] = float(params.top_p)
        ints = torch.tensor([params.top_k, seed, sample, params.max_tokens, n_gen, position, token or 0, adapter])
        for t, v in zip((self.top_k, self.seed, self.sample, self.max_tokens, self.n_gen, self.position,
                         self.last_token, self.adapter), ints.to(self.device, non_blocking=True)):
            t[slot] = v
        self.done[slot] = False
        self.tables[slot] = self.trash

    def set_blocks(self, slots: list[int], cols: list[int], blocks: list[int]) -> None:
        """tables[slots[i], cols[i]] = blocks[i] (one upload)."""
        if slots:
            t = torch.tensor([slots, cols, blocks], dtype=torch.int64).to(self.device, non_blocking=True)
            self.tables[t[0], t[1]] = t[2]

    def first_tokens(self, logits: torch.Tensor, slots: torch.Tensor, position: int, topk: int, draw: str):
        """The first draw of a prompt's rows: logits [V] (the prompt's last position) for every slot [n] at the
        token position `position` (the prompt's length). Returns decode_step's outputs and starts the rows."""
        n = slots.shape[0]
        logits = logits.float().expand(n, -1)
        pos = torch.full((n,), position, dtype=torch.int64, device=logits.device)
        return self._advance(logits, slots, pos, topk, draw, torch.ones(n, dtype=torch.bool, device=pos.device))

    def _advance(self, logits, slots, pos, topk, draw, valid):
        """Draw the token at position `pos` [B] for each row, check stops, advance the state (no sync)."""
        keys = row_keys(self.seed[slots], self.sample[slots], pos)
        if self.fused_draw and draw != "filtered" and topk == 0:  # one pass over the logits (kernels/gumbel_draw.py)
            tokens, logp = gumbel_draw(logits, self.temperature[slots], keys)
            top = None
        else:
            tokens = choose(logits, self.temperature[slots], self.top_k[slots], self.top_p[slots], keys, draw)
            logp, top = token_logprobs(logits, tokens, topk)
        n_gen = self.n_gen[slots] + valid.long()
        stop = (tokens[:, None] == self.stop_tokens[slots]).any(-1)
        done = ~valid | stop | (n_gen >= self.max_tokens[slots])
        self.last_token[slots] = tokens
        self.position[slots] = pos  # the next input is this token, at this position
        self.position[self.pad:].zero_()  # the padding slot (the last) would run on: kept at 0, capturably
        self.n_gen[slots] = n_gen
        self.done[slots] = done
        return tokens, logp, valid, done, top


def slot_mapping(tables: torch.Tensor, positions: torch.Tensor, block_size: int, trash: int,
                 real: torch.Tensor | None = None) -> torch.Tensor:
    """Where each new token's key and value go in the flat pool, on the device: tables [B, M], positions [B, S] ->
    [B x S] (the block of the row's table that holds the position, and the offset in it). real [B, S] bool: the
    padding's slots (False) go to the trash block, where nothing reads them."""
    col = (positions // block_size).clamp(0, tables.shape[1] - 1)  # bounded, whatever a position says
    slots = tables.gather(1, col) * block_size + positions % block_size
    if real is not None:
        slots = torch.where(real, slots, trash * block_size)
    return slots.flatten()


def decode_step(model, kv: PagedKV, st: RowState, active: torch.Tensor, width: int, topk: int, draw: str,
                bank=None):
    """One token for the rows in `active` [B] (slots; padding: st.pad). width: the table columns read (every row's
    blocks fit in them). Returns (tokens, logprobs, valid, done, top-k or None), [B] each."""
    pos = st.position[active]  # [B]: the input token's position
    tables = st.tables[active, :width]  # [B, M]
    kv.bind(pos[:, None], slot_mapping(tables, pos[:, None], kv.block_size, kv.trash), tables)
    if bank is not None:
        bank.set_rows(st.adapter[active][:, None])  # [B, 1]: each token's adapter slot
    h = model.model(st.last_token[active][:, None], cache=kv)  # [B, 1, D]
    logits = model.lm_head(h)[:, -1].float()  # [B, V]: the head sees the shape set_rows was told
    return st._advance(logits, active, pos + 1, topk, draw, ~st.done[active])


def pack_outputs(out) -> torch.Tensor:
    """A step's outputs (tokens, log-probs, valid, done, top-k or None), [B] each, as one [B, 4 + 2k] float64 tensor
    (tokens and ids are exact in it): the one tensor the host copies back a step. Inside the captured step on CUDA,
    so that a replay leaves nothing to launch but that copy."""
    tokens, logp, valid, done, top = out
    cols = [tokens.double(), logp.double(), valid.double(), done.double()]
    if top is not None:
        return torch.cat([torch.stack(cols, 1), top[0].double(), top[1].double()], 1)
    return torch.stack(cols, 1)


def packed_decode_step(model, kv: PagedKV, st: RowState, active: torch.Tensor, width: int, topk: int, draw: str,
                       bank=None) -> torch.Tensor:
    """decode_step's outputs packed (pack_outputs): what graphs.py captures."""
    return pack_outputs(decode_step(model, kv, st, active, width, topk, draw, bank))


def prefill_forward(model, kv: PagedKV, ids: torch.Tensor, positions: torch.Tensor, real: torch.Tensor,
                    tables: torch.Tensor, adapters: torch.Tensor | None, bank=None,
                    fresh: bool = False) -> torch.Tensor:
    """Prompt chunks ids [J, S] at positions [J, S] (real [J, S]: False for the padding, whose keys go to the trash
    block) over the jobs' tables [J, M] -> the final hidden states [J, S, D] (the head is applied where logits are
    needed). fresh: every chunk is its prompt's first (PagedKV.bind)."""
    kv.bind(positions, slot_mapping(tables, positions, kv.block_size, kv.trash, real), tables, fresh=fresh)
    if bank is not None:
        bank.set_rows(adapters)
    return model.model(ids, cache=kv)


def _kernels_run(x: torch.Tensor) -> bool:
    """Whether a patched module takes its decode kernel on x: CUDA, no autograd (training through the same module
    keeps autograd's ops)."""
    return x.is_cuda and not torch.is_grad_enabled()


def _decode_norm(norm: RMSNorm, x: torch.Tensor) -> torch.Tensor:
    if not _kernels_run(x):
        return RMSNorm.forward(norm, x)
    return rms_norm(x, norm.weight, norm.eps)


def _decode_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    if not _kernels_run(x) or not rope_fits(x.shape[-1]):
        return apply_rope(x, cos, sin)
    return rope(x, cos, sin)


# fused_ops=True: the per-head norms (their patched forward: a kernel each) and a RoPE kernel for q and k
_decode_norm_rope = functools.partial(norm_rope, rope=_decode_rope)


def _decode_qk_rope(q, k, cos, sin, q_norm, k_norm):
    """fused_ops="all": norms and RoPE of q and k in one launch (kernels/rope.py's qk_rope) where it takes them."""
    dt = q.dtype
    takes = (_kernels_run(q) and rope_fits(q.shape[-1]) and k.dtype == dt
             and (q_norm is None or (q_norm.weight.dtype == k_norm.weight.dtype == dt and q_norm.eps == k_norm.eps)))
    if not takes:
        return _decode_norm_rope(q, k, cos, sin, q_norm, k_norm)
    if q_norm is None:
        return qk_rope(q, k, cos, sin)
    return qk_rope(q, k, cos, sin, q_norm.weight, k_norm.weight, q_norm.eps)


def _decode_mlp(mlp: MLP, x: torch.Tensor) -> torch.Tensor:
    """fused_ops="all": SwiGLU's silu(gate) * up in one launch (kernels/swiglu.py) where it runs."""
    if not _kernels_run(x):
        return MLP.forward(mlp, x)
    return mlp.down_proj(silu_mul(mlp.gate_proj(x), mlp.up_proj(x)))


def set_decode_kernels(model, on: bool | str) -> None:
    """The model's RMSNorm layers and its attention's RoPE run kernels/rms_norm.py and kernels/rope.py when decoding
    (CUDA, no grad: one launch each instead of seven and five), or (on=False) their torch ops again; on="all": the
    attention's q and k norms and RoPE in one launch (qk_rope: four launches a layer become one) and the MLP's
    silu(gate) * up in one (kernels/swiglu.py: two become one). Per module instance: the decode model only, never
    the class; with grad enabled the patched modules run the torch ops."""
    for m in model.modules():
        if isinstance(m, MLP):
            if on == "all":
                m.forward = functools.partial(_decode_mlp, m)
            else:
                m.__dict__.pop("forward", None)
        elif isinstance(m, RMSNorm):
            if on:
                m.forward = functools.partial(_decode_norm, m)
            else:
                m.__dict__.pop("forward", None)
        elif isinstance(m, Attention):
            m.norm_rope = _decode_qk_rope if on == "all" else _decode_norm_rope if on else norm_rope
