"""Tinker's wire formats <-> shardfit's RL data: protobuf ForwardBackwardRequest in, ForwardBackwardOutput and
SampleResponse out (the schema is the SDK's own, tinker.proto.tinker_public_pb2, tinker 0.38.0).

Shapes: a datum's model input is its chunks' int32 token bytes concatenated, [L]; every loss_fn_input is [L]
(dense; a CSR or dense [L, k] is refused from its declared shape before it is expanded: every served loss reads
one value per token, and the Engine refuses anything else). Outputs go back as one ArrayRecord per run of datums
whose fields agree in dtype and trailing shape, each field a BatchedTensor (the datums' bytes concatenated, byte
offsets [n+1] int64).
Everything a request carries is checked here, on rank 0, before any rank sees it, and each tensor's declared shape
before it is expanded: L against the model's context and the Engine's token budget, a tensor's leading dimension
against L, its values per token against the vocabulary, and the values of all of a request's tensors against
`max_values` (what a dense request of the largest accepted body holds), so a few bytes of CSR cannot declare
gigabytes. A bad request is a ShardfitError (HTTP 400) and never a command.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from shardfit.errors import ShardfitError
from shardfit.rl.losses import REQUIRED_INPUTS  # every loss a name selects (the pair losses too)

try:  # the SDK's schema (Apache-2.0): `pip install 'shardfit[serve]'`
    from tinker.proto import tinker_public_pb2 as pb
except ImportError:  # pragma: no cover - the CLI says how to install it
    pb = None

LOSSES = tuple(REQUIRED_INPUTS)
_NP = {1: np.float32, 2: np.int64, 3: np.int32, 4: np.uint16}  # pb.DType -> numpy (4: bfloat16 bits)


@dataclass
class WireDatum:
    """One datum as the engine takes it (shardfit.rl.datum.Datum's fields), before conversion."""

    tokens: np.ndarray  # [L] int64
    inputs: dict[str, np.ndarray]  # name -> [L] float32 or int64


def _bad(what: str, where: str, fix: str) -> ShardfitError:
    return ShardfitError(what, where=where, fix=fix)


def _frombuffer(raw: bytes, dtype, where: str) -> np.ndarray:
    item = np.dtype(dtype).itemsize
    if len(raw) % item:
        raise _bad(f"{len(raw)} bytes is not a whole number of {np.dtype(dtype).name} values", where,
                   "send the SDK's encoding (np.asarray(x, dtype).tobytes())")
    return np.frombuffer(raw, dtype=dtype)


class ValueBudget:
    """The values a request's tensors may still expand to (dense elements, CSR included)."""

    def __init__(self, values: int | None):
        self.left, self.total = values, values

    def take(self, shape: list[int], where: str) -> None:
        if self.left is None:
            return
        self.left -= math.prod(shape)
        if self.left < 0:
            raise _bad(f"the request's tensors declare more than {self.total:,} values in all (this one: shape "
                       f"{shape})", where, "send fewer or smaller datums per request")


def tensor_from_proto(msg, where: str, rows: int | None = None, max_width: int | None = None,
                      budget: ValueBudget | None = None, flat: bool = False) -> np.ndarray:
    """A pb.Tensor as a dense numpy array: float32 (bfloat16 widened) or int64 (int32 widened). With rows: its shape
    must be [rows, ...] with at most max_width values per row, and budget takes its values, before anything is
    expanded; with flat too, it must be [rows] (refused before a CSR [rows, k] is expanded)."""
    dtype = _NP.get(msg.dtype)
    if dtype is None:
        raise _bad(f"unsupported tensor dtype {msg.dtype}", where, "send float32 or int64 tensors")
    shape = [int(s) for s in msg.shape]
    if any(s < 0 for s in shape):
        raise _bad(f"negative dimension in shape {shape}", where, "send the tensor's true shape")
    sparse = msg.HasField("sparse_csr")
    if sparse and len(shape) != 2:
        raise _bad(f"a CSR tensor needs a 2-D shape, got {shape}", where, "send shape [rows, cols]")
    if rows is not None and shape and shape[0] != rows:
        raise _bad(f"shape {shape} does not start with the model input's length {rows}", where,
                   "send one value per input token")
    if max_width is not None and math.prod(shape[1:]) > max_width:
        raise _bad(f"shape {shape} holds {math.prod(shape[1:]):,} values per token, more than the vocabulary "
                   f"({max_width:,})", where, "send at most one value per vocabulary entry per token")
    if budget is not None:
        budget.take(shape or [len(msg.dense) // np.dtype(dtype).itemsize], where)
    if flat and rows is not None and len(shape) > 1:  # every served loss reads one value per token (rl/datum.py)
        raise _bad(f"shape {shape} is not [{rows}]: the served losses take one value per token", where,
                   f"send a 1-D tensor of {rows} values ([L, k] inputs are not served)")
    if sparse:
        csr = msg.sparse_csr
        values = _widen(_frombuffer(csr.values, dtype, where), msg.dtype)
        crow = _frombuffer(csr.crow_indices, np.int64, where)
        col = _frombuffer(csr.col_indices, np.int64, where)
        n_rows, cols = shape
        ends_ok = len(crow) == n_rows + 1 and crow[0] == 0 and crow[-1] == len(values)
        if (not ends_ok or len(col) != len(values) or np.any(np.diff(crow) < 0)
                or np.any((col < 0) | (col >= cols))):
            raise _bad("inconsistent CSR indices", where, "send crow_indices [rows + 1] (0 .. nnz, rising) and "
                       "col_indices [nnz] within the shape")
        dense = np.zeros(shape, dtype=values.dtype)
        dense[np.repeat(np.arange(n_rows), np.diff(crow)), col] = values
        return dense
    data = _widen(_frombuffer(msg.dense, dtype, where), msg.dtype)
    if shape:
        if math.prod(shape) != data.size:
            raise _bad(f"shape {shape} holds {math.prod(shape)} values, the data {data.size}", where,
                       "send a shape that matches the data")
        data = data.reshape(shape)
    return data


def _widen(a: np.ndarray, dtype: int) -> np.ndarray:
    if dtype == 4:  # bfloat16: the upper 16 bits of a float32
        return (a.astype(np.uint32) << 16).view(np.float32)
    return a.astype(np.int64) if a.dtype == np.int32 else a.copy()


def chunk_tokens(chunks, where: str) -> np.ndarray:
    """The model input's tokens [L] int64 from its chunks (text only: images and audio are refused)."""
    parts = []
    for i, c in enumerate(chunks):
        kind = c.WhichOneof("chunk")
        if kind != "encoded_text":
            raise _bad(f"chunk {i} is {kind or 'empty'}", f"{where}.model_input", "send encoded_text chunks: "
                       "this server trains text models")
        parts.append(_frombuffer(c.encoded_text.tokens, np.int32, f"{where}.model_input[{i}]"))
    return np.concatenate(parts).astype(np.int64) if parts else np.zeros(0, dtype=np.int64)


def check_tokens(tokens: np.ndarray, vocab: int, where: str) -> None:
    if tokens.size and (tokens.min() < 0 or tokens.max() >= vocab):
        bad = int(tokens[(tokens < 0) | (tokens >= vocab)][0])
        raise _bad(f"token id {bad} is outside the vocabulary [0, {vocab})", where,
                   "encode with the model's tokenizer (get_tokenizer())")


def parse_forward_backward(body: bytes):
    """The protobuf body of /forward_backward as a message (nothing checked but the encoding)."""
    if pb is None:
        raise ShardfitError("the tinker SDK's protobuf schema is not installed", fix="pip install 'shardfit[serve]'")
    msg = pb.ForwardBackwardRequest()
    try:
        msg.ParseFromString(body)
    except Exception:  # protobuf's DecodeError and friends: the body is not this message
        raise _bad("the body is not a ForwardBackwardRequest protobuf", "/forward_backward",
                   "send it with the tinker SDK (Content-Type application/x-protobuf)") from None
    return msg


def check_forward_backward(msg, vocab: int, max_len: int, token_budget: int = 0, max_values: int | None = None,
                           options_need: dict[str, str] | None = None) -> list[WireDatum]:
    """The request's datums, each checked against the model (vocabulary, max_len), the Engine's token budget (a
    datum longer than one micro-batch; 0: none) and the loss, before any tensor is expanded (module docstring).
    options_need: the inputs the loss's options add (kl_coef: ref_logprobs), each with the fix to name."""
    if msg.loss_fn not in LOSSES:
        raise _bad(f"unknown loss_fn '{msg.loss_fn[:80]}'", "/forward_backward loss_fn",
                   f"use one of {', '.join(LOSSES)} (or forward_backward_custom)")
    if not msg.data:
        raise _bad("no datums", "/forward_backward data", "send at least one datum")
    budget = ValueBudget(max_values)
    needs = {name: f"loss_fn={msg.loss_fn} needs {name}" for name in REQUIRED_INPUTS[msg.loss_fn]}
    needs.update({name: fix for name, fix in (options_need or {}).items() if name not in needs})
    return [decode_datum(d, f"data[{i}]", needs, vocab, max_len, token_budget, budget)
            for i, d in enumerate(msg.data)]


def decode_datum(d, where: str, needs: dict[str, str], vocab: int, max_len: int, token_budget: int = 0,
                 budget: ValueBudget | None = None) -> WireDatum:
    """needs: each input the loss needs -> the fix a datum without it is told."""
    tokens = chunk_tokens(d.model_input, where)
    L = len(tokens)
    if L == 0:
        raise _bad("empty model input", where, "send at least one token")
    if max_len < L:
        raise _bad(f"{L} tokens exceed the model's max_seq_len={max_len}", where, "send shorter datums")
    if token_budget and token_budget < L:
        raise _bad(f"{L} tokens are more than the server's micro-batch of {token_budget} tokens", where,
                   f"send datums of at most {token_budget} tokens, or start shardfit serve with "
                   f"--train.micro_batch_tokens={L} or more")
    check_tokens(tokens, vocab, f"{where}.model_input")
    inputs = {}
    for name, t in d.loss_fn_inputs.items():
        at = f"{where}.loss_fn_inputs[{name}]"
        a = tensor_from_proto(t, at, rows=L, max_width=vocab, budget=budget, flat=True)
        if a.ndim == 0 or a.shape[0] != L:
            raise _bad(f"shape {list(a.shape)} does not start with the model input's length {L}", at,
                       "send one value per input token")
        if a.dtype == np.float32 and not np.isfinite(a).all():
            raise _bad("holds a NaN or an infinity", at, "send finite values")
        inputs[name] = a
    for name, fix in needs.items():
        if name not in inputs:
            raise _bad(f"'{name}' is missing", f"{where}.loss_fn_inputs", fix)
    target = inputs["target_tokens"]
    if target.dtype != np.int64 or target.ndim != 1:
        raise _bad("target_tokens must be int64 [L]", f"{where}.loss_fn_inputs[target_tokens]",
                   "send token ids (TensorData dtype int64)")
    check_tokens(target, vocab, f"{where}.loss_fn_inputs[target_tokens]")
    return WireDatum(tokens, inputs)


def loss_config(msg) -> dict[str, float | str]:
    """loss_fn_config: v2 (numbers and strings) where the SDK set it, else the legacy float map."""
    if msg.loss_fn_config_v2:
        return {k: (v.text if v.WhichOneof("value") == "text" else float(v.number))
                for k, v in msg.loss_fn_config_v2.items()}
    return {k: float(v) for k, v in msg.loss_fn_config.items()}


# ---------------------------------------------------------------------------------------------------- responses
def _proto_dtype(a: np.ndarray) -> tuple[np.ndarray, int]:
    if np.issubdtype(a.dtype, np.integer):
        return a.astype(np.int64, copy=False), pb.DTYPE_INT64
    return a.astype(np.float32, copy=False), pb.DTYPE_FLOAT32


def encode_forward_backward(outputs: list[dict[str, np.ndarray]], metrics: dict[str, float]) -> bytes:
    """ForwardBackwardOutput bytes: the per-datum outputs in the caller's order, and metrics "name:reduction"."""
    for key in metrics:
        if key.count(":") != 1:  # the SDK splits every key once and fails otherwise
            raise ValueError(f"metric key '{key}' is not 'name:reduction'")
    msg = pb.ForwardBackwardOutput(loss_fn_output_type="ArrayRecord",
                                   metrics={k: float(v) for k, v in metrics.items()})
    runs: list[tuple[tuple, list[dict[str, np.ndarray]]]] = []
    if len({tuple(sorted(out)) for out in outputs}) > 1:  # the SDK reads the field names of one record for all
        raise ValueError("every datum's outputs must have the same fields")
    for out in outputs:
        arrays = {name: _proto_dtype(np.asarray(a)) for name, a in out.items()}
        sig = tuple(sorted((name, code, a.shape[1:]) for name, (a, code) in arrays.items()))
        if runs and runs[-1][0] == sig:
            runs[-1][1].append(arrays)
        else:
            runs.append((sig, [arrays]))
    for sig, group in runs:
        record = msg.loss_fn_outputs.add(type_tag="ArrayRecord", num_datums=len(group))
        for name, code, trailing in sig:
            parts = [g[name][0] for g in group]
            offsets = np.cumsum([0] + [p.nbytes for p in parts], dtype=np.int64)
            bt = record.fields[name]
            bt.data = b"".join(p.tobytes() for p in parts)
            bt.offsets = offsets.tobytes()
            bt.dtype = code
            bt.trailing_shape.extend(int(s) for s in trailing)
    return msg.SerializeToString()


def _topk(msg, rows: list) -> None:
    """rows: per position None (no context) or up to k (token, log-prob) pairs -> a TopkLogprobs message: two [n, k]
    matrices, empty places as the SDK's sentinel (token 0, log-prob -99999)."""
    k = max((len(r) for r in rows if r), default=0)
    ids = np.zeros((len(rows), k), dtype=np.int32)
    lps = np.full((len(rows), k), -99999.0, dtype=np.float32)
    for i, r in enumerate(rows):
        for j, (t, lp) in enumerate(r or ()):
            ids[i, j], lps[i, j] = t, lp
    msg.length, msg.k = len(rows), k
    msg.token_ids, msg.logprobs = ids.tobytes(), lps.tobytes()


def encode_sample(result) -> bytes:
    """SampleResponse bytes of a sampling.SampleResult: each sample's tokens, log-probs, stop reason ("stop": a stop
    token or string, EOS included) and top-k on request; the prompt's log-probs (NaN at position 0: no context) and
    top-k."""
    msg = pb.SampleResponse()
    for s in result.samples:
        seq = msg.sequences.add(stop_reason=pb.STOP_REASON_STOP if s.stop_reason == "stop" else pb.STOP_REASON_LENGTH,
                                tokens=np.asarray(s.tokens, dtype=np.int32).tobytes(),
                                logprobs=np.asarray(s.logprobs, dtype=np.float32).tobytes())
        if s.topk is not None:
            _topk(seq.topk_sampled_logprobs, s.topk)
    if result.prompt_logprobs is not None:
        msg.prompt_logprobs = np.asarray([float("nan") if x is None else x for x in result.prompt_logprobs],
                                         dtype=np.float32).tobytes()
    if result.topk_prompt_logprobs is not None:
        _topk(msg.topk_prompt_logprobs, result.topk_prompt_logprobs)
    return msg.SerializeToString()
