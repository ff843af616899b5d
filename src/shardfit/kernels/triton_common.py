"""What the Triton kernels of this package share: the reductions' combine functions and the interpreter switch.

The kernels spell their reductions with tl.reduce and the combine functions made here, not with triton's library
reductions (tl.max, tl.sum): those are jit-wrapped when triton is imported, and under Triton's interpreter
(TRITON_INTERPRET=1, set by the tests after triton may have been imported) they cannot be called. Functions made
after the switch can: `combine_fns(interpret)` makes them once per mode, and each kernel's factory puts them among
its module's globals, where triton (compiled and interpreted) resolves a kernel's callees. `triton_kernels` is the
factory every kernel here is made by (once per mode, None without Triton), `runs_on` the check its `available` is.
"""

from __future__ import annotations

import functools
import os


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def triton_kernels(make):
    """Decorator: make(triton, tl) -> a kernel (or a tuple of them), made on first use and kept, one entry per mode
    (compiled, or under TRITON_INTERPRET=1: triton.jit reads the switch when it wraps); the decorated name is then a
    function of no argument returning it, or None without Triton (the CPU wheels do not ship it)."""

    @functools.cache
    def per_mode(interpret: bool):
        del interpret  # the cache key: the environment triton.jit sees now
        try:
            import triton
            import triton.language as tl
        except ImportError:
            return None
        return make(triton, tl)

    @functools.wraps(make)
    def get():
        return per_mode(interpreting())

    return get


def launch_device(t):
    """The context a kernel on t is launched in: Triton launches on the current CUDA device, which need not be t's."""
    import contextlib

    import torch

    return torch.cuda.device(t.device) if t.is_cuda else contextlib.nullcontext()


def runs_on(t, kernels) -> bool:
    """Whether the kernels of a `triton_kernels` factory run on t's device here: CUDA with Triton importable, or
    Triton's interpreter (the tests)."""
    return (t.is_cuda or interpreting()) and kernels() is not None


@triton_kernels
def combine_fns(triton, tl) -> dict:
    """{"maximum", "add", "first_best"} as triton.jit functions."""

    @triton.jit
    def maximum(a, b):
        return tl.maximum(a, b)

    @triton.jit
    def add(a, b):
        return a + b

    @triton.jit
    def first_best(a, ia, b, ib):  # argmax's combine: the larger value, a tie to the smaller index
        left = (a > b) | ((a == b) & (ia < ib))
        return tl.where(left, a, b), tl.where(left, ia, ib)

    return {"maximum": maximum, "add": add, "first_best": first_best}
