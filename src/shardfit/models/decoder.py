"""A decoder-only transformer for the Llama family (Llama 2/3, Mistral, Qwen2/2.5, Qwen3).

Parameter names are the Hugging Face names (`model.layers.0.self_attn.q_proj.weight`), so a Hugging Face
safetensors checkpoint maps onto this module key for key. This file holds no distributed code: sharding,
checkpointing and compilation are applied from outside by `shardfit.parallel.parallelize`.

Shapes: B batch, S sequence, D hidden, H heads, K key/value heads, Dh head size, V vocabulary.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from shardfit.config.schema import ModelConfig, is_moe_layer
from shardfit.models.attention import DocumentMask, sdpa_attention
from shardfit.models.init import ShardView, is_quantized_storage, seeded_normal_, whole_view
from shardfit.models.logprobs import fused_linear_logprobs, select_rows, spread_rows
from shardfit.models.loss import fused_linear_cross_entropy
from shardfit.models.moe import MoE, router_aux_loss


class RMSNorm(nn.Module):
    """RMSNorm computed in fp32 and cast back, as Hugging Face's LlamaRMSNorm does (parity to 1e-6)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def rope_inv_freq(cfg: ModelConfig, head_dim: int, device: torch.device | None = None) -> torch.Tensor:
    """Inverse RoPE frequencies [Dh/2], with Llama-3 scaling of the low frequencies when configured."""
    inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64, device=device).float() / head_dim))
    if cfg.rope_scaling == "llama3":
        old = cfg.rope_original_max_seq_len
        low_wavelen = old / cfg.rope_low_freq_factor
        high_wavelen = old / cfg.rope_high_freq_factor
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > low_wavelen, inv / cfg.rope_factor, inv)
        smooth = (old / wavelen - cfg.rope_low_freq_factor) / (cfg.rope_high_freq_factor - cfg.rope_low_freq_factor)
        smoothed = (1 - smooth) * scaled / cfg.rope_factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        inv = torch.where(medium, smoothed, scaled)
    return inv


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B, S, H, Dh]; cos/sin [B, S, Dh] (the two halves share frequencies, Hugging Face layout)."""
    cos, sin = cos.unsqueeze(2), sin.unsqueeze(2)
    return x * cos + _rotate_half(x) * sin


def norm_rope(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, q_norm: nn.Module | None,
              k_norm: nn.Module | None, rope=apply_rope) -> tuple[torch.Tensor, torch.Tensor]:
    """The attention's positional step: q [B, S, H, Dh] and k [B, S, K, Dh] normed per head where the model has
    q_norm / k_norm (Qwen3; None: Llama), then rotated by `rope` (apply_rope; the decode model's one-kernel form:
    sampling/step.py)."""
    if q_norm is not None:
        q, k = q_norm(q), k_norm(k)
    return rope(q, cos, sin), rope(k, cos, sin)


class KVCache:
    """Keys and values of the tokens seen so far, per layer, dense: the reference cache (the sampler's reference decode,
    sampling/reference.py, and serve's per-request loop). The paged cache (sampling/kv.py) keeps the same protocol.

    The cache protocol the decoder calls, which any cache implements: `positions(input_ids)` the position ids [B, S]
    of the new tokens; `attend(layer, q, k, v)` stores this layer's new keys and values (after RoPE, so they are
    never recomputed) and returns the attention of q [B, S, H, Dh] over every stored token, [B, S, H, Dh];
    `advance(input_ids)` once all layers have run. Training never passes a cache.

    Here: preallocated [B, max_len, K, Dh] per layer, `length` tokens filled, the same for every row.
    """

    def __init__(self, n_layers: int, batch: int, max_len: int, n_kv: int, head_dim: int, dtype: torch.dtype,
                 device: torch.device | str | None = None):
        shape = (batch, max_len, n_kv, head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(n_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(n_layers)]
        self.length = 0

    def append(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store k/v [B, S, K, Dh] after the cached tokens; return every token's [B, length + S, K, Dh]."""
        end = self.length + k.shape[1]
        if end > self.k[layer].shape[1]:
            raise ValueError(f"KV cache holds {self.k[layer].shape[1]} tokens, {end} needed")
        self.k[layer][:, self.length:end] = k
        self.v[layer][:, self.length:end] = v
        return self.k[layer][:, :end], self.v[layer][:, :end]

    def positions(self, input_ids: torch.Tensor) -> torch.Tensor:
        """[B, S]: the new tokens sit after the `length` cached ones."""
        return torch.arange(self.length, self.length + input_ids.shape[1],
                            device=input_ids.device).expand_as(input_ids)

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return cached_attention(q, *self.append(layer, k, v))

    def advance(self, input_ids: torch.Tensor) -> None:
        self.length += input_ids.shape[1]


def cached_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Causal attention of the S newest tokens q [B, S, H, Dh] over all T >= S cached tokens k/v [B, T, K, Dh]:
    query i sits at position T - S + i. One new token (decoding) attends to everything; a prompt into an empty
    cache is plain causal attention; otherwise an explicit mask."""
    S, T = q.shape[1], k.shape[1]
    q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # [B, H|K, S|T, Dh]
    gqa = k.shape[1] != q.shape[1]
    if S == 1 or S == T:
        out = F.scaled_dot_product_attention(q, k, v, is_causal=S > 1, enable_gqa=gqa)
    else:
        allowed = torch.ones(S, T, dtype=torch.bool, device=q.device).tril_(T - S)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, enable_gqa=gqa)
    return out.transpose(1, 2)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.n_heads, self.n_kv = cfg.n_heads, cfg.n_kv_heads
        self.head_dim = cfg.head_dim or cfg.dim // cfg.n_heads
        self.q_proj = nn.Linear(cfg.dim, self.n_heads * self.head_dim, bias=cfg.qkv_bias)
        self.k_proj = nn.Linear(cfg.dim, self.n_kv * self.head_dim, bias=cfg.qkv_bias)
        self.v_proj = nn.Linear(cfg.dim, self.n_kv * self.head_dim, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(self.n_heads * self.head_dim, cfg.dim, bias=False)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, cfg.norm_eps)
            self.k_norm = RMSNorm(self.head_dim, cfg.norm_eps)
        else:
            self.q_norm = self.k_norm = None
        # The attention kernel proper, core(q, k, v, mask) on [B, S, heads, Dh] tensors (models/attention.py). A plain
        # function here; parallelize() may put a sequence-parallel wrapper in its place (Ulysses), which sees the same
        # local q, k, v and the micro-batch's document mask, and returns local rows.
        self.core = sdpa_attention
        # the per-head norms and RoPE of q and k: norm_rope, or for decoding a one-kernel form in its place
        # (sampling/step.py's set_decode_kernels)
        self.norm_rope = norm_rope

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                mask: DocumentMask | None = None, cache: tuple[KVCache, int] | None = None) -> torch.Tensor:
        """cache: (a cache of KVCache's protocol, this layer's index) when decoding; None in training."""
        B, S, _ = x.shape
        q = self.q_proj(x).view(B, S, self.n_heads, self.head_dim)  # [B, S, H, Dh]
        k = self.k_proj(x).view(B, S, self.n_kv, self.head_dim)  # [B, S, K, Dh]
        v = self.v_proj(x).view(B, S, self.n_kv, self.head_dim)
        q, k = self.norm_rope(q, k, cos, sin, self.q_norm, self.k_norm)  # Qwen3 normalises each head before RoPE
        if cache is not None:
            out = cache[0].attend(cache[1], q, k, v)  # [B, S, H, Dh]
        else:
            out = self.core(q, k, v, mask)  # [B, S, H, Dh]
        return self.o_proj(out.reshape(B, S, self.n_heads * self.head_dim))


class MLP(nn.Module):
    def __init__(self, dim: int, ffn_dim: int):
        super().__init__()
        self.gate_proj = nn.Linear(dim, ffn_dim, bias=False)
        self.up_proj = nn.Linear(dim, ffn_dim, bias=False)
        self.down_proj = nn.Linear(ffn_dim, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderBlock(nn.Module):
    """Pre-norm block: the unit of sharding, checkpointing and compilation."""

    def __init__(self, cfg: ModelConfig, layer: int = 0):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.dim, cfg.norm_eps)
        if is_moe_layer(cfg, layer):
            self.mlp = MoE(cfg.dim, cfg.n_experts, cfg.experts_per_token, cfg.moe_ffn_dim, cfg.norm_topk_prob,
                           track_router=cfg.router_aux_coef > 0, balance_bias=cfg.router_bias_rate > 0)
        else:
            self.mlp = MLP(cfg.dim, cfg.ffn_dim)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                mask: DocumentMask | None = None, cache: tuple[KVCache, int] | None = None) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, mask, cache)
        h = self.post_attention_layernorm(x)
        if not isinstance(self.mlp, MoE) or self.mlp._forward_hooks or self.mlp._forward_pre_hooks:
            return x + self.mlp(h)  # a hooked MoE layer is called as a module: its hooks run
        # MoE.forward's three phases, called from this frame: under torch.compile a graph break in MoE.run (the
        # expert-parallel exchange is left out of compilation) then splits this block into two graphs (up to the
        # dispatch | the combine and residual). Inside MoE.forward it would split the block, MoE.forward and its
        # resumes into five, each a host-side entry (guards, runtime wrappers) on a path that bounds the EP forward.
        r = self.mlp.dispatch(h)
        return x + self.mlp.combine(self.mlp.run(r), r, h.shape)


class Decoder(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.head_dim = cfg.head_dim or cfg.dim // cfg.n_heads
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleList(DecoderBlock(cfg, i) for i in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
        # Non-persistent: never in a checkpoint, rebuilt by init_buffers() on every rank after to_empty().
        self.register_buffer("inv_freq", rope_inv_freq(cfg, self.head_dim), persistent=False)

    def rope(self, position_ids: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = position_ids[..., None].float() * self.inv_freq.float()  # [B, S, Dh/2], fp32
        emb = torch.cat((freqs, freqs), dim=-1)  # [B, S, Dh]
        return emb.cos().to(dtype), emb.sin().to(dtype)

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor | None = None,
                mask: DocumentMask | None = None, cache: KVCache | None = None) -> torch.Tensor:
        """position_ids [B, S] restart at 0 at each document of a packed row; mask says where the documents are
        (DocumentMask.build, from the full position ids). Both None: one document per row. With a KV cache (decoding)
        input_ids are the tokens after the cached ones, positioned where the cache says (KVCache's protocol: a dense
        cache after its `length`, a paged one (sampling/kv.py) at each row's own length)."""
        h = self.embed_tokens(input_ids)  # [B, S, D]
        if position_ids is None:
            position_ids = (cache.positions(input_ids) if cache is not None else
                            torch.arange(input_ids.shape[1], device=input_ids.device).expand_as(input_ids))
        cos, sin = self.rope(position_ids, h.dtype)
        for i, layer in enumerate(self.layers):
            h = layer(h, cos, sin, mask) if cache is None else layer(h, cos, sin, mask, (cache, i))
        if cache is not None:
            cache.advance(input_ids)
        return self.norm(h)


class OutputHead(nn.Linear):
    """The output projection. Called with labels it returns the summed fused cross-entropy instead of the logits, so
    the loss runs inside this module's forward: FSDP can then shard the head as a group of its own (parallelize)."""

    def head_weight(self) -> torch.Tensor:
        """The [V, D] matrix every path multiplies by (a LoRA head, adapters/lora.py, adds its adapter to it)."""
        return self.weight

    def forward(self, h: torch.Tensor, labels: torch.Tensor | None = None, chunk: int = 1024, impl: str = "torch",
                compiled: bool = False, logprobs: bool = False, entropy: bool = False,
                token_losses: torch.Tensor | None = None, token_targets: torch.Tensor | None = None):
        weight = self.head_weight()
        if labels is None:
            return F.linear(h, weight, self.bias)  # logits [..., V]
        if logprobs:  # per-token log-probs of the labels (and entropies): (logp [N], entropy [N] or None)
            return fused_linear_logprobs(h, weight, labels, chunk, entropy, compiled=compiled)
        return fused_linear_cross_entropy(h, weight, labels, chunk, impl=impl, compiled=compiled,
                                          token_losses=token_losses, token_targets=token_targets)


class CausalLM(nn.Module):
    """Decoder plus output projection. With labels, returns the summed cross-entropy (fp32, no full logits)."""

    def __init__(self, cfg: ModelConfig, loss_chunk: int = 1024):
        super().__init__()
        self.cfg = cfg
        self.loss_chunk = loss_chunk
        self.loss_impl = "torch"  # "liger" where Liger-Kernel is installed on CUDA (the Engine's choice: loss.py)
        self.loss_compiled = False  # use_compiled_loss
        self.model = Decoder(cfg)
        self.lm_head = OutputHead(cfg.dim, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None, mask: DocumentMask | None = None,
                router_aux: bool = True, logprobs: bool = False, entropy: bool = False,
                rows: torch.Tensor | None = None, token_losses: torch.Tensor | None = None,
                token_targets: torch.Tensor | None = None):
        """router_aux=False leaves the MoE load-balancing term out (validation reports the cross-entropy alone).
        logprobs=True: instead of the loss, the log-probability of each label (flat [B x S] fp32, 0 where the label
        is negative) and with entropy=True each token's entropy (flat) or None: what the RL losses are made of.
        rows (logprobs only): the flat positions the head scores (models/logprobs.scored_rows); the others get 0.
        token_losses (the loss only): a flat [B x S] fp32 buffer that receives each token's cross-entropy (0 where
        the label is negative), detached, the very values the sum is made of; with token_targets [B x S], each
        token's cross-entropy for its target there (0 where negative), in the sum or not."""
        h = self.model(input_ids, position_ids, mask)  # [B, S, D]
        if labels is None:
            return self.lm_head(h)  # logits [B, S, V]
        if logprobs:
            hf, lf = h.flatten(0, 1), labels.flatten()
            if rows is not None:
                hf, lf = select_rows(hf, lf, rows)  # [n', D], [n']: the head's matmuls over these rows alone
            logp, ent = self.lm_head(hf, lf, self.loss_chunk, compiled=self.loss_compiled, logprobs=True,
                                     entropy=entropy)
            if rows is not None:
                n = labels.numel()
                logp, ent = spread_rows(logp, rows, n), (spread_rows(ent, rows, n) if ent is not None else None)
            return logp, ent  # [B x S] each: flat (a view returned through FSDP would drop its backward hook)
        # Sum over labels != -100; the Engine divides by the global token count once per step.
        impl = "torch" if token_losses is not None else self.loss_impl  # only this module's kernel writes them
        loss = self.lm_head(h.flatten(0, 1), labels.flatten(), self.loss_chunk, impl, self.loss_compiled,
                            token_losses=token_losses, token_targets=token_targets)
        if router_aux:
            # Weighted by this micro-batch's loss tokens, so that after the Engine's division by the global count it
            # is the token-weighted mean of the micro-batches' auxiliary losses (for one micro-batch: cross-entropy
            # mean + coef x aux, as transformers reports).
            aux = self.router_aux_term((labels != -100).sum())
            loss = loss + aux if aux is not None else loss
        return loss

    def router_aux_term(self, weight: torch.Tensor) -> torch.Tensor | None:
        """router_aux_coef x the MoE load-balancing loss of the last forward x weight (a device scalar: no sync);
        None for a dense model or a coefficient of 0. It is a statistic of the tokens this rank routed (under sequence
        parallelism: its slice); the caller weights it as it weights those tokens' loss (engine/losses.py)."""
        if not self.cfg.router_aux_coef > 0:
            return None
        moe = [layer.mlp for layer in self.model.layers if isinstance(layer.mlp, MoE)]
        return self.cfg.router_aux_coef * router_aux_loss(moe) * weight if moe else None

    def use_compiled_loss(self, compiled: bool = True) -> None:
        """Run the loss's per-chunk softmax and gradient (the cross-entropy's and the RL log-probs') through
        torch.compile (compute.compile_loss, set by parallelize's compile step before the first forward); its matmuls
        stay eager either way."""
        self.loss_compiled = compiled

    @torch.no_grad()
    def init_buffers(self) -> None:
        device = self.model.inv_freq.device
        if device.type != "meta":
            self.model.inv_freq.copy_(rope_inv_freq(self.cfg, self.model.head_dim, device))
            for layer in self.model.layers:  # balancing biases start at zero (a resume loads them after this)
                if getattr(layer.mlp, "balance_bias", None) is not None:
                    layer.mlp.balance_bias.zero_()

    def init_buffers_fp32(self) -> None:
        """The RoPE frequencies rebuilt in fp32 after a cast of the whole module (model.to(bf16) casts buffers too,
        and copying fp32 values into a bf16 buffer would round them again)."""
        self.model.inv_freq = rope_inv_freq(self.cfg, self.model.head_dim, self.model.inv_freq.device)

    @torch.no_grad()
    def init_weights(self, seed: int = 0, view: ShardView = whole_view) -> None:
        """Initialise every parameter in place, on any device, sharded or not (`view` locates a sharded
        parameter's rows: parallel/dtensor.py's local_view).

        Values depend only on (seed, parameter name), never on the sharding, so a 2-rank run starts from exactly
        the weights a 1-rank run starts from. A quantized weight's storage (models/init.py QUANTIZED_STORAGE) is not
        drawn: its owner fills it (adapters/qlora.py's init_quantized).
        """
        for name, p in self.named_parameters():
            if is_quantized_storage(name):  # codes, filled by their owner
                continue
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            elif name.endswith(".bias"):
                p.zero_()
            else:
                seeded_normal_(p, self.cfg.init_std, seed, name, view)
        self.init_buffers()


def count_params(model: nn.Module) -> int:
    """Parameters counted once each (tied weights once), global sizes for sharded tensors; a quantized weight
    (its storage, models/init.py QUANTIZED_STORAGE) as the weights it stands for (its module's quantized_numel)."""
    weights = sum(p.numel() for n, p in model.named_parameters() if not is_quantized_storage(n))
    return weights + sum(getattr(m, "quantized_numel", 0) for m in model.modules())
