"""`Sampler`: continuous batching over a paged KV cache, for `shardfit generate`, `Engine.sample` and serve.

    sampler = Sampler(model)                      # a plain CausalLM in eval mode, any device
    handle = sampler.submit(SampleRequest(prompt, SamplingParams(max_tokens=64, temperature=0.7, seed=1)))
    while not handle.done: sampler.step()         # or: results = sampler.run([req, ...]) (request order)

One `step()`: admit waiting requests while row slots and blocks allow (scheduler.py); prefill the next chunks of
the admitted prompts (up to `prefill_chunk` tokens, several prompts per forward), and for each prompt whose last
chunk ran, draw its rows' first tokens from the last position and start them; then one decode token for every
running row (step.py, through graphs.py on CUDA); every `check_every` steps (and when the batch empties) `flush`
reads the device's outputs back, applies stop strings and answers finished requests. Rows join the decode batch
as others leave; a prompt's `num_samples` rows share its prefill and its blocks.

Host and device: a decode step sends nothing to the device but the block-table entries of rows that cross a block
boundary; its outputs ([B] tokens, log-probs, valid, done, and the top-k) go into one packed tensor copied
non-blocking into pinned memory, an event recorded; `flush` waits on the newest event only. Stop tokens and
max_tokens are decided on the device (step.py's `done`); stop strings on the host at flush: a row whose decoded
tail holds a stop string ends at the token that completes its first occurrence (the stop text is included, as a
stop token is; the tokens drawn after it are dropped). A stopped row keeps its batch place until the flush (at most
check_every wasted tokens) so that the device never waits for the host.

The draw (sample.py) on CUDA with Triton: rows without top-k/top-p and without top-k log-probs asked take the
fused kernel (kernels/gumbel_draw.py: one read of the logits for the token and its log-prob; `fused_draw=False`
keeps the torch ops, the same tokens but for ties within a rounding of the device's log). `fused_ops` ("all"
by default, CUDA with Triton only): the model's RMSNorm layers and RoPE run kernels/rms_norm.py and kernels/rope.py
under no_grad (step.set_decode_kernels): one kernel a norm instead of seven ops, the step's largest group of small
kernels (benchmarks/README.md#sampler-fused-ops), and the attention's q and k norms and RoPE in one launch
(kernels/rope.py's qk_rope) and the MLP's silu(gate) * up in one (kernels/swiglu.py); fused_ops=True keeps the
norms' and RoPE's kernels alone, fused_ops=False the torch ops.

LoRA rows: with a `bank`, every forward is preceded by bank.set_rows(slots [B, S]): each token's adapter slot
(the request's `adapter`, -1 for the base model); the head applied to a prefill's positions alone is called as a
forward of [1, n] after its own set_rows.
"""

from __future__ import annotations

import functools
import random

import torch

from shardfit.errors import ShardfitError
from shardfit.kernels.gumbel_draw import available as draw_kernel_runs
from shardfit.kernels.paged_attention import available as paged_kernel_runs
from shardfit.kernels.rms_norm import available as norm_kernel_runs
from shardfit.sampling.graphs import DecodeGraphs, bucket, capturable
from shardfit.sampling.kv import BLOCK_SIZE, PagedKV, blocks_for_memory
from shardfit.sampling.params import Sampled, SampleRequest, SampleResult, check_request
from shardfit.sampling.sample import draw_kind, token_logprobs
from shardfit.sampling.scheduler import Prefill, Request, Row, Scheduler
from shardfit.sampling.step import RowState, pack_outputs, packed_decode_step, prefill_forward, set_decode_kernels

# The KV cache on the CPU, where free memory says little: this many tokens (a stated count, not a fraction).
CPU_KV_TOKENS = 65536
# prompt positions whose log-probs one head call scores: fp32 logits and their log_softmax, 2 x 512 x 151,936 x 4 B =
# 0.6 GB at Qwen's vocabulary, whatever prefill_chunk is (2,048 by default: unsplit, 2.5 GB beside the KV pool, which
# takes kv_fraction of the memory free after the weights and leaves the rest for these)
HEAD_ROWS = 512


class SampleHandle:
    """A submitted request: `done` once every sample has ended, then `result` (a SampleResult)."""

    def __init__(self, request: Request):
        self._request = request

    @property
    def done(self) -> bool:
        return self._request.result is not None

    @property
    def result(self) -> SampleResult | None:
        return self._request.result


class Sampler:
    def __init__(self, model, *, kv_blocks: int | None = None, kv_fraction: float = 0.9, block_size: int = BLOCK_SIZE,
                 max_rows: int = 256, prefill_chunk: int = 2048, attention: str = "auto", cuda_graphs: bool = True,
                 bank=None, tokenizer=None, check_every: int = 8, fused_draw: bool = True,
                 fused_ops: bool | str = "all"):
        for name, value, low in (("kv_blocks", kv_blocks, 1), ("block_size", block_size, 1), ("max_rows", max_rows, 1),
                                 ("prefill_chunk", prefill_chunk, 1), ("check_every", check_every, 1)):
            if value is not None and (not isinstance(value, int) or value < low):
                raise ShardfitError(f"{name}={value!r} is out of range", where=f"Sampler({name}=...)",
                                    fix=f"give an integer >= {low}")
        if attention not in ("auto", "gather", "flex", "triton"):
            raise ShardfitError(f"attention={attention!r} is not a paged attention path",
                                where="Sampler(attention=...)", fix="give auto (triton where it runs, else gather), "
                                "gather (any device), flex (CUDA) or triton (CUDA: kernels/paged_attention.py)")
        if not 0 < kv_fraction <= 1:
            raise ShardfitError(f"kv_fraction={kv_fraction} is outside (0, 1]", where="Sampler(kv_fraction=...)",
                                fix="give the share of the free memory the KV cache may take, e.g. 0.9")
        if fused_ops not in (True, False, "all"):
            raise ShardfitError(f"fused_ops={fused_ops!r} is not a set of decode kernels",
                                where="Sampler(fused_ops=...)",
                                fix='give True (norms and RoPE), "all" (q/k norms and RoPE in one launch) or False')
        weight = model.lm_head.weight
        if attention == "auto":  # the kernel reads each cached key once; the gather path three times
            attention = "triton" if weight.is_cuda and paged_kernel_runs(weight) else "gather"
        if attention == "triton" and not paged_kernel_runs(weight):
            raise ShardfitError("attention=triton needs CUDA and Triton", where="Sampler(attention=...)",
                                fix="give gather (any device)")
        self.model, self.bank, self.tokenizer = model, bank, tokenizer
        self.cfg = model.cfg
        self.device, dtype = weight.device, weight.dtype
        if kv_blocks is None:
            if self.device.type == "cuda":
                free, _ = torch.cuda.mem_get_info(self.device)
                kv_blocks = blocks_for_memory(free, kv_fraction, self.cfg, dtype, block_size)
            else:
                kv_blocks = CPU_KV_TOKENS // block_size
        self.kv = PagedKV(self.cfg, kv_blocks, block_size, dtype, self.device, attention)
        self.max_rows, self.prefill_chunk, self.check_every = max_rows, prefill_chunk, check_every
        self.st = RowState(max_rows, self.kv.blocks_for(self.cfg.max_seq_len), self.kv.trash, self.device,
                           fused_draw=fused_draw and self.device.type == "cuda" and draw_kernel_runs(weight))
        set_decode_kernels(model, fused_ops if self.device.type == "cuda" and norm_kernel_runs(weight) else False)
        self.sched = Scheduler(self.kv.allocator, block_size, max_rows)
        graphs = cuda_graphs and self.device.type == "cuda" and attention in ("gather", "triton") and capturable(model)
        # the step holds the model, pool and state, not the Sampler: no reference cycle, so that dropping the
        # Sampler frees its KV pool and graphs at once (Engine.release_sampler), not at the next gc
        step = functools.partial(packed_decode_step, self.model, self.kv, self.st, bank=self.bank)
        self.graphs = DecodeGraphs(step, self.st.pad, graphs)
        self.pending: list[tuple] = []  # (rows, packed outputs on the host, top-k width, event) per forward
        self._requests = 0
        self._batch = None  # (rows, active slots tensor, width, top-k, draw) while the decode batch is unchanged

    def describe(self) -> str:
        return self.kv.describe()

    @property
    def preemptions(self) -> int:
        return self.sched.preemptions

    def _upload(self, values: list[int]) -> torch.Tensor:
        """Host ints as an int64 device tensor, without waiting for the device's queue (a blocking copy would)."""
        return torch.tensor(values, dtype=torch.int64).to(self.device, non_blocking=True)

    # Requests.
    def check(self, req: SampleRequest) -> None:
        """One line naming the field if this sampler cannot serve `req` as asked (params.check_request)."""
        check_request(req, max_seq_len=self.cfg.max_seq_len, vocab_size=self.cfg.vocab_size,
                      kv_tokens=self.kv.tokens, max_rows=self.max_rows, tokenizer=self.tokenizer, bank=self.bank)

    def submit(self, req: SampleRequest) -> SampleHandle:
        """Check the request (one line naming the field if it is refused: nothing else is touched) and queue it."""
        self.check(req)
        seed = req.params.seed if req.params.seed is not None else random.getrandbits(63)
        n = req.num_samples
        scoring = req.params.max_tokens == 0
        request = Request(req, seed, self._requests, [] if scoring else [Sampled() for _ in range(n)])
        self._requests += 1
        rows = [] if scoring else [Row(request, i) for i in range(n)]
        request.open_rows = len(rows)
        self.sched.waiting.append(Prefill(request, list(req.prompt), rows, new=True))
        return SampleHandle(request)

    def run(self, reqs: list[SampleRequest]) -> list[SampleResult]:
        """Submit all, step until every one is answered; results in request order."""
        handles = [self.submit(r) for r in reqs]
        self.wait(handles)
        return [h.result for h in handles]

    def wait(self, handles: list[SampleHandle]) -> None:
        """Step until every one of `handles` is answered."""
        while not all(h.done for h in handles):
            if self.sched.idle:
                self.drain(handles)
            else:
                self.step()

    def drain(self, handles) -> None:
        """Every row has ended: read the outputs not read yet, which answers what is left; one of `handles` still
        unanswered then is a bug (never bad input), raised rather than stepped forever."""
        self.flush()
        if not all(h.done for h in handles):
            raise RuntimeError("the sampler is idle with requests unanswered")

    @torch.no_grad()
    def step(self) -> None:
        self.sched.admit()
        if self.sched.prefilling:
            self._prefill()
        if self.sched.active:
            self._decode()
        if self.pending and (self.sched.step % self.check_every == 0 or not self.sched.active):
            self.flush()

    # Prefill.
    def _prefill(self) -> None:
        chunks = self.sched.chunks(self.prefill_chunk)
        J, S = len(chunks), max(b - a for _, a, b in chunks)
        M = max(len(job.blocks) for job, _, _ in chunks)
        ids, pos = torch.zeros(J, S, dtype=torch.int64), torch.zeros(J, S, dtype=torch.int64)
        real = torch.zeros(J, S, dtype=torch.bool)
        tables = torch.full((J, M), self.kv.trash, dtype=torch.int64)
        adapters = torch.full((J, S), -1, dtype=torch.int64)
        for j, (job, a, b) in enumerate(chunks):
            ids[j, :b - a] = torch.tensor(job.tokens[a:b])
            pos[j, :b - a] = torch.arange(a, b)
            real[j, :b - a] = True
            tables[j, :len(job.blocks)] = torch.tensor(job.blocks, dtype=torch.int64)
            adapters[j, :b - a] = job.request.req.adapter
        dev = [t.to(self.device, non_blocking=True) for t in (ids, pos, real, tables, adapters)]
        h = prefill_forward(self.model, self.kv, *dev[:4], dev[4] if self.bank is not None else None, self.bank,
                            fresh=all(a == 0 for _, a, _ in chunks))
        for j, (job, a, b) in enumerate(chunks):
            job.done = b
            if job.new:
                self._prompt_logprobs(job, h[j], a, b)
            if b == len(job.tokens):
                self._start(job, h[j, b - a - 1])

    def _prompt_logprobs(self, job: Prefill, h: torch.Tensor, a: int, b: int) -> None:
        """Log-probs of the prompt tokens a+1..b from the chunk's hidden states h [S, D] (positions a..b-1)."""
        req = job.request.req
        n = min(b, len(req.prompt) - 1) - a  # positions whose next prompt token is known
        if not (req.prompt_logprobs or req.topk_prompt_logprobs):
            return
        for s0 in range(0, max(n, 0), HEAD_ROWS):  # the fp32 logits [<= HEAD_ROWS, V] and their log_softmax at a time
            s1 = min(n, s0 + HEAD_ROWS)
            logits = self._head(h[s0:s1], req.adapter)
            targets = self._upload(req.prompt[a + 1 + s0:a + 1 + s1])
            job.request.prompt_parts.append(token_logprobs(logits, targets, req.topk_prompt_logprobs))

    def _head(self, h: torch.Tensor, adapter: int) -> torch.Tensor:
        """fp32 logits [n, V] of one request's hidden states h [n, D], called as a forward of input [1, n]: a LoRA
        bank that adapts the head is told the rows first, in that shape."""
        if self.bank is not None:
            self.bank.set_rows(torch.full((1, h.shape[0]), adapter, dtype=torch.int64, device=self.device))
        return self.model.lm_head(h[None])[0].float()

    def _start(self, job: Prefill, last_h: torch.Tensor) -> None:
        """The job's prompt is in the cache: its rows start (a new prompt's draw their first token from last_h [D])."""
        request, req = job.request, job.request.req
        st = self.st
        for row in job.rows:
            resumed = row.out.tokens if not job.new else None
            st.start_row(row.slot, req.params, row.sample, request.seed, req.adapter,
                         token=resumed[-1] if resumed else None, position=len(job.tokens),
                         n_gen=len(resumed) if resumed else 0)
        if job.new:
            request.prefilled = True
            if job.rows:
                slots = self._upload([r.slot for r in job.rows])
                logits = self._head(last_h[None], req.adapter)[0]  # [V]
                draw = draw_kind([req.params])
                out = st.first_tokens(logits, slots, len(req.prompt), req.topk_sample_logprobs, draw)
                self._record(list(job.rows), pack_outputs(out), req.topk_sample_logprobs)
        for row in job.rows:
            row.n_gen = len(row.out.tokens) if not job.new else 1
        rows = self.sched.start_rows(job)
        for row in rows:
            if row.running:
                st.set_blocks([row.slot] * len(row.blocks), list(range(len(row.blocks))), row.blocks)
        if request.open_rows == 0 and request.result is None:  # scoring only
            self._answer(request)

    # Decode.
    def _decode(self) -> None:
        sched, bs = self.sched, self.kv.block_size
        s = sched.step
        upd: tuple[list, list, list] = ([], [], [])
        for row, epoch in sched.blocks_due.pop(s, []):
            if row.epoch != epoch or not row.running:
                continue
            w = len(row.request.req.prompt) + row.n_gen - 1 + (s - row.join_step)  # this step's write position
            col = w // bs
            if col < len(row.blocks) and self.kv.allocator.refs[row.blocks[col]] == 1:
                continue  # its own partial block
            new = self._allocate(row)
            if new is None:  # the row itself was preempted (or ended)
                continue
            if col < len(row.blocks):  # copy-on-write of the prompt's shared partial block
                self.kv.copy_block(row.blocks[col], new)
                self.kv.allocator.release(row.blocks[col])
                row.blocks[col] = new
            else:
                row.blocks.append(new)
            for u, v in zip(upd, (row.slot, col, new)):
                u.append(v)
        self.st.set_blocks(*upd)
        if not sched.active:
            return
        rows, active, width, topk, draw = self._decode_batch(max(upd[1], default=-1) + 1)
        out = self.graphs(active, width, topk, draw, self.st.stop_tokens.shape[1])
        self._record(rows, out, topk)
        sched.step += 1
        for row, epoch in sched.ends_due.pop(s, []):  # max_tokens reached: out of the batch, answered at the flush
            if row.epoch == epoch and row.running:
                sched.leave(row)

    def _decode_batch(self, grown: int):
        """The batch's slots tensor (padded to a graph bucket), table width, top-k and draw: rebuilt when rows
        joined or left, else the table width grown to cover a new block."""
        sched = self.sched
        if sched.active_changed or self._batch is None:
            rows = list(sched.active)
            slots = [r.slot for r in rows]
            if self.graphs.enabled:
                slots += [self.st.pad] * (bucket(len(slots), self.max_rows) - len(slots))
            params = [r.request.req for r in rows]
            topk = max(q.topk_sample_logprobs for q in params)
            draw = draw_kind([q.params for q in params])
            need = max(len(r.blocks) for r in rows)
            self._batch = [rows, self._upload(slots), need, topk, draw]
            sched.active_changed = False
        self._batch[2] = max(self._batch[2], grown)
        rows, active, need, topk, draw = self._batch
        # a graph per width bucket; FlexAttention compiles per width: both read a table rounded up to a bucket
        width = bucket(need, self.st.max_blocks) if self.graphs.enabled or self.kv.attention == "flex" else need
        return rows, active, width, topk, draw

    def _allocate(self, row: Row) -> int | None:
        """A free block for row, preempting the newest rows or jobs while none is; None if row itself went."""
        alloc, sched = self.kv.allocator, self.sched
        while True:
            b = alloc.allocate()
            if b is not None:
                return b
            self.flush()  # rows that ended give their blocks back
            if not row.running:
                return None
            b = alloc.allocate()
            if b is not None:
                return b
            victim = sched.victim()
            if isinstance(victim, Prefill):
                sched.preempt_job(victim)
            else:
                sched.preempt_row(victim)
            if victim is row:
                return None

    # Outputs.
    def _record(self, rows: list[Row], packed: torch.Tensor, topk: int) -> None:
        """Queue a forward's outputs for the flush: packed [B, 4 + 2k] float64 (step.pack_outputs), copied
        non-blocking into pinned memory on CUDA (before the next replay: a graph's outputs may be another's scratch)."""
        event = None
        if self.device.type == "cuda":
            host = torch.empty(packed.shape, dtype=packed.dtype, pin_memory=True)
            host.copy_(packed, non_blocking=True)
            event = torch.cuda.Event()
            event.record()
        else:
            host = packed.clone()
        self.pending.append((rows, host, topk if packed.shape[1] > 4 else 0, event))

    def flush(self) -> None:
        """Read the queued outputs: tokens into their samples, stop strings checked, ended rows out, answers."""
        if not self.pending:
            return
        if self.pending[-1][3] is not None:
            self.pending[-1][3].synchronize()
        pending, self.pending = self.pending, []
        for rows, host, k, _ in pending:
            for row, values in zip(rows, host.tolist()):
                if row.ended:
                    continue
                tok, lp, valid, done = int(values[0]), values[1], values[2], values[3]
                if not valid:
                    continue
                out, req = row.out, row.request.req
                out.tokens.append(tok)
                out.logprobs.append(lp)
                if req.topk_sample_logprobs:
                    kk = req.topk_sample_logprobs
                    out.topk = out.topk if out.topk is not None else []
                    out.topk.append([(int(i), v) for v, i in zip(values[4:4 + kk], values[4 + k:4 + k + kk])])
                if req.params.stop_strings and self._stop_string(row):
                    self._end(row, "stop")
                elif done:
                    self._end(row, "stop" if tok in req.params.stop_tokens else "length")

    def _stop_string(self, row: Row) -> bool:
        """Whether the newest token completes a stop string (the decoded tail that could hold one)."""
        strings = row.request.req.params.stop_strings
        tail = self.tokenizer.decode(row.out.tokens[-(max(len(s) for s in strings) + 8):])
        return any(s in tail for s in strings)

    def _end(self, row: Row, reason: str) -> None:
        row.ended = True
        row.out.stop_reason = reason
        self.sched.leave(row)
        request = row.request
        request.open_rows -= 1
        if request.open_rows == 0 and request.prefilled:
            self._answer(request)

    def _answer(self, request: Request) -> None:
        req = request.req
        lp = topk = None
        if req.prompt_logprobs:
            lp = [None] + [v for part, _ in request.prompt_parts for v in part.tolist()]
        if req.topk_prompt_logprobs:
            topk = [None]
            for _, (vals, ids) in request.prompt_parts:
                topk += [list(zip(i, v)) for v, i in zip(vals.tolist(), ids.tolist())]
        request.prompt_parts = []
        request.result = SampleResult(request.samples, lp, topk)
