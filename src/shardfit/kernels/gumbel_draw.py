"""The decode step's draw in one pass over the logits: Gumbel-max token and its log-prob (sampling/sample.py's
"plain" and "greedy" draws, fused).

Why a kernel: sampling/sample.py spells the draw as torch ops on [B, V] tensors: the counter hash of every (row,
token) as ~20 int64 elementwise ops, the uniform, two logs, the scaled logits plus the noise, their argmax, then
log_softmax (max, sum of exp, subtract) and a gather for the log-prob. Each op reads and writes a [B, V] tensor: at
B = 256 rows and V = 151,936 (Qwen3) an int64 one is 311 MB, so the draw moves ~12 GB a step, about a third of
what the step's weights and KV cache do (16 GB + ~24 GB at 256 rows of ~640 tokens). Here each program reads a
chunk of one row's logits once and keeps what the draw needs in registers: the best (scaled logit + noise) and its
token, the chunk's largest logit and sum of exp (for the log-sum-exp at temperature 1). A small combine over the
chunks [B, C] gives the token and its log-prob: logit - logsumexp, as log_softmax gives it.

The same numbers as sample.py's ops: the noise of token v in a row with key h (32-bit) is
-log(-log(((fmix32(h ^ (v * 0x9E3779B9 mod 2^32)) >> 8) + 0.5) / 2^24)) with uint32 arithmetic here (wrapping
multiplication is the mod 2^32 that sample.py's _mul32 spells with int64 halves), and the row's score is
logits / max(temperature, 1e-6) + noise, or the logits alone at temperature 0 (greedy). The hash and the uniform are
exact in both; the logs are the device's, so a token whose score ties another's within a rounding may differ between
this kernel and the torch ops, never between two runs of either (tests/kernels/test_gumbel_draw.py: every token
equal on the inputs tested, log-probs within fp32 rounding). Ties go to the smaller token id in both (torch.argmax's
first occurrence; the kernel's combine and the chunks' first).

Without Triton (CPU wheels) `available` is False and the caller keeps sample.py's ops.
"""

from __future__ import annotations

import torch

from shardfit.kernels.triton_common import combine_fns, runs_on, triton_kernels

BLOCK_V = 4096  # tokens a program: 16 KiB of fp32 logits; V = 151,936 is 38 programs a row


@triton_kernels
def _triton_kernel(triton, tl):
    @triton.jit
    def _fmix(h):
        h = h ^ (h >> 16)
        h = h * 0x85EBCA6B
        h = h ^ (h >> 13)
        h = h * 0xC2B2AE35
        return h ^ (h >> 16)

    fns = combine_fns()  # kernels/triton_common.py: why not tl.max / tl.sum
    globals().update(_gumbel_fmix=_fmix, _gumbel_max=fns["maximum"], _gumbel_add=fns["add"],
                     _gumbel_first_best=fns["first_best"])

    @triton.jit
    def gumbel_draw_kernel(logits_ptr, temp_ptr, keys_ptr, best_ptr, arg_ptr, lmax_ptr, lsum_ptr, V, stride_b,
                           CHUNKS: tl.constexpr, BLOCK: tl.constexpr):
        # logits [B, V] fp32 (stride_b, V contiguous); temperature [B] fp32; keys [B] int64 (32-bit values);
        # outputs [B, CHUNKS] fp32 best score, int32 its token, fp32 the chunk's max logit and sum exp(l - max)
        b = tl.program_id(0).to(tl.int64)
        c = tl.program_id(1)
        v = c * BLOCK + tl.arange(0, BLOCK)
        ok = v < V
        lg = tl.load(logits_ptr + b * stride_b + v, mask=ok, other=float("-inf"))
        t = tl.load(temp_ptr + b)
        h = tl.load(keys_ptr + b).to(tl.uint32)
        bits = _gumbel_fmix(h ^ (v.to(tl.uint32) * 0x9E3779B9))  # noqa: F821 (made by the factory)
        u = ((bits >> 8).to(tl.float32) + 0.5) * (1.0 / 16777216.0)
        noise = -tl.log(-tl.log(u))
        score = tl.where(t > 0, lg / tl.maximum(t, 1e-6) + noise, lg)
        score = tl.where(ok, score, float("-inf"))
        best, arg = tl.reduce((score, v), 0, _gumbel_first_best)  # noqa: F821
        m = tl.reduce(lg, 0, _gumbel_max)  # noqa: F821
        s = tl.reduce(tl.where(ok, tl.exp(lg - m), 0.0), 0, _gumbel_add)  # noqa: F821
        out = b * CHUNKS + c
        tl.store(best_ptr + out, best)
        tl.store(arg_ptr + out, arg.to(tl.int32))
        tl.store(lmax_ptr + out, m)
        tl.store(lsum_ptr + out, s)

    return gumbel_draw_kernel


def available(t: torch.Tensor) -> bool:
    """Whether gumbel_draw runs on t's device here: CUDA with Triton importable (or the interpreter)."""
    return runs_on(t, _triton_kernel)


def gumbel_draw(logits: torch.Tensor, temperature: torch.Tensor, keys: torch.Tensor,
                block: int = BLOCK_V) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [B, V] fp32, temperature [B] fp32 (0: greedy), keys [B] int64 (sample.row_keys) -> (tokens [B] int64,
    their log-probs [B] fp32 under log_softmax of the logits). No host synchronisation; capturable."""
    kernel = _triton_kernel()
    if kernel is None:
        raise RuntimeError("gumbel_draw needs Triton (sampling/sample.py's choose and token_logprobs are the same "
                           "function in PyTorch)")
    logits = logits.float()
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    B, V = logits.shape
    C = -(-V // block)
    best = torch.empty(B, C, dtype=torch.float32, device=logits.device)
    lmax, lsum = torch.empty_like(best), torch.empty_like(best)
    arg = torch.empty(B, C, dtype=torch.int32, device=logits.device)
    if B:
        kernel[(B, C)](logits, temperature.float().contiguous(), keys.contiguous(), best, arg, lmax, lsum, V,
                       logits.stride(0), CHUNKS=C, BLOCK=block)
    tokens = arg.gather(1, best.argmax(1, keepdim=True)).squeeze(1).long()  # argmax: the first chunk of a tie
    top = lmax.amax(1, keepdim=True)  # [B, 1]
    lse = top.squeeze(1) + torch.log((lsum * torch.exp(lmax - top)).sum(1))
    return tokens, logits.gather(1, tokens[:, None]).squeeze(1) - lse
