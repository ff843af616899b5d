"""Sample results between ranks: each request's SampleResult as a float64 vector whose length is a function of the
request alone (tokens and fp32 log-probs are exact in float64), and the all-gathers that move them. Never pickle.

Two users, the same packing: Engine.sample on N ranks (engine/sampling.py: every result once, at the call's end,
`gather_results`) and a SampleRun on N ranks (engine/sample_run.py: the results of the requests that ended since the
last exchange, between chunks of decode steps, `exchange`).
"""

from __future__ import annotations

import math

import torch

STOP_REASONS = ("stop", "length")  # a sample's stop_reason, coded as its index


def layout(req) -> list[tuple[str, int]]:
    """(field, length) of one request's packed result, a function of the request alone (every rank knows it)."""
    T, k, P = req.params.max_tokens, req.topk_sample_logprobs, len(req.prompt)
    out = []
    for _ in range(req.num_samples):
        out += [("count", 1), ("stop", 1), ("tokens", T), ("logprobs", T), ("topk", 2 * T * k)]
    if req.prompt_logprobs:
        out.append(("prompt_logprobs", P))
    if req.topk_prompt_logprobs:
        out.append(("topk_prompt", 2 * P * req.topk_prompt_logprobs))
    return out


def size(req) -> int:
    return sum(n for _, n in layout(req))


def pack(req, res) -> list[float]:
    """`res` (the SampleResult of `req`) as size(req) floats: per sample its length, stop reason, tokens and
    log-probs padded to max_tokens, top-k pairs padded; then the prompt's log-probs (NaN: None)."""
    out: list[float] = []
    T = req.params.max_tokens
    for s in res.samples:
        pad = [0.0] * (T - len(s.tokens))
        out += [float(len(s.tokens)), float(STOP_REASONS.index(s.stop_reason))]
        out += [float(t) for t in s.tokens] + pad + list(s.logprobs) + pad
        topk = [x for pos in (s.topk or []) for pair in pos for x in pair]
        out += topk + [0.0] * (2 * T * req.topk_sample_logprobs - len(topk))
    if req.prompt_logprobs:
        out += [math.nan if x is None else x for x in res.prompt_logprobs]
    if req.topk_prompt_logprobs:
        k = req.topk_prompt_logprobs
        for pos in res.topk_prompt_logprobs:
            out += [math.nan] * (2 * k) if pos is None else [x for pair in pos for x in pair]
    return out


def unpack(req, vec: list[float]):
    """pack's inverse: the SampleResult of `req` from its size(req) floats."""
    from shardfit.sampling.params import Sampled, SampleResult

    T, k = req.params.max_tokens, req.topk_sample_logprobs
    at, samples = 0, []
    for _ in range(req.num_samples):
        n, stop = int(vec[at]), STOP_REASONS[int(vec[at + 1])]
        tokens = [int(t) for t in vec[at + 2:at + 2 + n]]
        logprobs = vec[at + 2 + T:at + 2 + T + n]
        flat = vec[at + 2 + 2 * T:at + 2 + 2 * T + 2 * n * k]
        topk = [[(int(flat[2 * (p * k + j)]), flat[2 * (p * k + j) + 1]) for j in range(k)] for p in range(n)]
        samples.append(Sampled(tokens, logprobs, stop, topk if k else None))
        at += 2 + 2 * T + 2 * T * k
    res = SampleResult(samples)
    P = len(req.prompt)
    if req.prompt_logprobs:
        res.prompt_logprobs = [None if math.isnan(x) else x for x in vec[at:at + P]]
        at += P
    if req.topk_prompt_logprobs:
        kp = req.topk_prompt_logprobs
        flat = vec[at:at + 2 * P * kp]
        res.topk_prompt_logprobs = [None if math.isnan(flat[2 * p * kp]) else
                                    [(int(flat[2 * (p * kp + j)]), flat[2 * (p * kp + j) + 1]) for j in range(kp)]
                                    for p in range(P)]
    return res


def gather_results(reqs: list, done: dict, rank: int, world: int, device: torch.device) -> list:
    """Engine.sample's end: every rank's results on every rank in one all-gather of fixed-length float64 vectors.
    reqs: the call's requests not refused, request i decoded on rank i % world; done: {i: SampleResult} of this
    rank's. Each rank's vector length is computed from the requests alone: no count travels first."""
    from shardfit.parallel import all_gather_rows

    sizes = [sum(size(r) for i, r in enumerate(reqs) if i % world == w) for w in range(world)]
    mine = [x for i in sorted(done) for x in pack(reqs[i], done[i])]
    vec = torch.zeros(max(sizes), dtype=torch.float64)
    vec[:len(mine)] = torch.tensor(mine, dtype=torch.float64)
    rows = all_gather_rows(vec.to(device)).cpu().tolist()  # [world, max(sizes)]
    out, at = [], [0] * world
    for i, r in enumerate(reqs):
        w = i % world
        out.append(unpack(r, rows[w][at[w]:at[w] + size(r)]))
        at[w] += size(r)
    return out


class RankFailed(RuntimeError):
    """Another rank's part of a SampleRun failed (its own error is in its log): the run ends on every rank alike."""


def exchange(reqs: dict, done: list, failed: bool, device: torch.device) -> list:
    """A SampleRun's exchange between chunks (N ranks, every rank, the same two collectives in this order):
    1. one all-gather of int64 [3] per rank: (requests ended, floats packed, failed 0/1) -> [world, 3];
    2. unless every rank sent nothing or one failed (both read from 1, the same on every rank), one all-gather of
       float64 [width] per rank, width the longest rank's ids + packed results: the ended requests' tickets (exact
       in float64), then their results packed (`pack`) back to back, zero-padded.
    reqs: ticket -> SampleRequest of every request of the run (every rank prepared them all: the layout of any
    rank's result is known here); done: this rank's (ticket, SampleResult) ended since the last exchange. Returns
    every rank's, in rank then ticket order; raises RankFailed on every rank that did not fail when one did."""
    from shardfit.parallel import all_gather_rows

    ids = [t for t, _ in done]
    packed = [x for t, r in done for x in pack(reqs[t], r)]
    head = all_gather_rows(torch.tensor([len(ids), len(packed), int(failed)], dtype=torch.int64, device=device))
    head = head.cpu().tolist()  # [world, 3]
    bad = [w for w, (_, _, f) in enumerate(head) if f]
    if bad:
        if failed:
            return []  # this rank's own error is raised by its caller
        raise RankFailed(f"rank(s) {bad} failed in a sample run's decode step (see their log)")
    width = max(n + m for n, m, _ in head)
    if width == 0:
        return []
    vec = torch.zeros(width, dtype=torch.float64)
    vec[:len(ids) + len(packed)] = torch.tensor(ids + packed, dtype=torch.float64)
    rows = all_gather_rows(vec.to(device)).cpu().tolist()  # [world, width]
    out = []
    for (n, _, _), row in zip(head, rows):
        at = n
        for t in (int(x) for x in row[:n]):
            out.append((t, unpack(reqs[t], row[at:at + size(reqs[t])])))
            at += size(reqs[t])
    return out
