"""Every private PyTorch API the planner uses, in one place, each looked up only when it is first needed.

The activation trace (activation_trace.py) counts what autograd and the compiler save with PyTorch internals that
carry no compatibility promise: a dispatch mode (TorchDispatchMode), AOTAutograd (aot_function, dynamo's
aot_autograd backend, make_boxed_func), Inductor's min-cut partitioner, the flash-attention operator and a
storage's identity (`_cdata`). Nothing here is imported when the module is: importing the planner, and with it
`shardfit plan` and every `train.micro_batch=0` start-up, cannot fail on a torch that moved one of them. A missing
one is one ShardfitError naming the torch version, the internal and what needed it, at the moment it is needed.
"""

from __future__ import annotations

import functools
import importlib

import torch

from shardfit.errors import ShardfitError

_FIX = ("use a torch release shardfit supports (pyproject.toml: torch>=2.6), or set train.micro_batch to a number "
        "instead of 0 (the trainer then needs no plan)")


def _missing(what: str, needed_for: str, e: Exception) -> ShardfitError:
    """The one line for a missing internal: the torch version, the internal, what needed it, and the fix."""
    return ShardfitError(f"{what} is missing, which the memory planner (shardfit plan, train.micro_batch=0) needs "
                         f"{needed_for} ({type(e).__name__}: {e})", where=f"torch {torch.__version__}", fix=_FIX)


def _internal(module: str, name: str, needed_for: str):
    """module.name, imported now; a ShardfitError (_missing) when this torch lacks it."""
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as e:
        raise _missing(f"{module}.{name}", needed_for, e) from None


def dispatch_mode_base() -> type:
    """TorchDispatchMode: the base of the mode that counts the outputs selective checkpointing keeps."""
    return _internal("torch.utils._python_dispatch", "TorchDispatchMode",
                     "to count what selective checkpointing saves")


def aot_function():
    """AOTAutograd's aot_function: traces a dense block's forward and backward together."""
    return _internal("torch._functorch.aot_autograd", "aot_function", "to trace a compiled block")


def inductor_partition():
    """Inductor's min-cut partitioner as torch.compile uses it: it decides what a compiled forward saves."""
    fn = _internal("torch._functorch.partitioners", "min_cut_rematerialization_partition",
                   "to split a compiled block as Inductor does")
    return functools.partial(fn, compiler="inductor")


def aot_autograd_backend(**kwargs):
    """dynamo's aot_autograd backend factory, called with kwargs (fw_compiler, bw_compiler, partition_fn)."""
    return _internal("torch._dynamo.backends.common", "aot_autograd", "to trace a compiled MoE block")(**kwargs)


def make_boxed_func():
    """functorch's make_boxed_func: wraps a graph module as the boxed compiler AOTAutograd expects."""
    return _internal("functorch.compile", "make_boxed_func", "to run the traced MoE graphs")


def flash_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """aten._scaled_dot_product_flash_attention (causal, no dropout) on [B, H, S, Dh] tensors: its output only."""
    try:
        op = torch.ops.aten._scaled_dot_product_flash_attention
    except (AttributeError, RuntimeError) as e:
        raise _missing("torch.ops.aten._scaled_dot_product_flash_attention", "to count what attention saves",
                       e) from None
    return op(q, k, v, 0.0, True)[0]


def storage_id(t: torch.Tensor) -> int:
    """An identity of t's storage, shared by every view of it (meta tensors have no data pointer to compare)."""
    try:
        return t.untyped_storage()._cdata
    except AttributeError as e:
        raise _missing("torch.UntypedStorage._cdata", "to count each saved storage once", e) from None
